//! End to end: pod CREATE throughput through the real API server with meshgate's webhook
//! registered, against the same API server without it, side by side in one run.
//!
//! The control plane is etcd + kube-apiserver from `MESHGATE_CONTROLPLANE_BIN` (see
//! `tools/controlplane`); no scheduler, so pods stay Pending and only admission and storage are
//! measured. The webhook is meshgate's real one (`meshgate::run::start_webhook`: TLS on
//! loopback, caches fed by watches on this API server), in this process, with the `meshgate`
//! binary's allocator; the registration is what `meshgate install` generates for the Istio
//! ambient profile (the pod gate and the policies webhook, `failurePolicy: Fail` so that a
//! failed call shows as a failed create). The namespace is labelled for ambient, so every pod
//! is gated: the API server calls the webhook twice per pod (gate, policies) and stores a
//! bigger pod (the gate init container).
//!
//! A third configuration separates meshgate's cost from the cost of any mutating webhook: a
//! **minimal webhook** on the same HTTP and TLS stack (axum-server, rustls, the same
//! certificate), registered the same way, that finds the review's uid with a substring search
//! and answers a fixed response: for the pod gate the very patch meshgate computes for this pod,
//! for the policies path no patch. It is the ceiling for any webhook that gates these pods.
//!
//! A fourth configuration is the **native gate** (`meshgate_core::native_gate`): the
//! MutatingAdmissionPolicy `install` writes for the ambient clauses, with the webhook registered
//! as `install` registers it next to the policy (its gate entries routed to no namespace); the
//! round fails if the webhook answers a single pod-gate review, or if a pod is not gated.
//!
//! A fifth, **minimal policy**, is to the native gate what the minimal webhook is to the webhook:
//! a MutatingAdmissionPolicy with one constant JSON patch (a label), no condition, no variable;
//! the API server's price for any mutating admission policy on pod CREATE.
//!
//! Rounds rotate through the five (none, minimal, meshgate, native, min-policy; the order shifts every round). Each
//! round creates `MESHGATE_BENCH_PODS` (2000) pods from `tools/bench/pod.json` with
//! `MESHGATE_BENCH_CONCURRENCY` (32) creates in flight, bounded by `MESHGATE_BENCH_SECONDS` (60);
//! then deletes them. Reported per round: creates per second, p50/p99 create latency, CPU time per
//! create of kube-apiserver, etcd and this process (the client and the webhook), and how many
//! stored pods carry the gate (all with a webhook registered, none without, or the run fails).
//! Ratios are medians over `MESHGATE_BENCH_ROUNDS` (5) of the per-round ratios.
//!
//! By default only the pod gate is registered (one webhook call per pod, or none with the
//! native gate); `MESHGATE_BENCH_WEBHOOKS=gate,policies` adds the policies webhook (a second
//! call per pod in every configuration but none).
//!
//! `MESHGATE_BENCH_APISERVER_PROFILE=DIR` runs the API server with `--profiling=true` and writes
//! a Go CPU profile of it for each configuration's first round, `DIR/<configuration>.pprof`,
//! taken over the first `MESHGATE_BENCH_PROFILE_SECONDS` (2) seconds of the creates (read them
//! with `go tool pprof`; `tools/bench/apiserver-profile.sh` does it all).
//!
//! Run: `MESHGATE_CONTROLPLANE_BIN=$(tools/controlplane/build.sh) cargo bench -p meshgate --bench
//! admission_e2e`. Without `--bench` (as `cargo test --benches` runs it) it does nothing.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use meshgate_api::{GateConfig, Profile, names};
use meshgate_core::registration::{Registration, WebhookTarget, webhook_configuration};
use meshgate_testenv::measure::{cpu_time, median, quantile};
use serde_json::Value;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const POD: &str = include_str!("../../../tools/bench/pod.json");
const REGISTRATION: &str = "meshgate-e2e-bench";
/// Upper bound for the webhook registration to take effect (or go away).
const SETTLE_LIMIT: Duration = Duration::from_secs(60);

fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("admission_e2e: run with `cargo bench` (needs the control plane)");
        return ExitCode::SUCCESS;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("admission_e2e: {e}");
            ExitCode::FAILURE
        }
    }
}

struct Settings {
    pods: usize,
    concurrency: usize,
    seconds: u64,
    rounds: usize,
    /// Register the policies webhook too (`MESHGATE_BENCH_WEBHOOKS=gate,policies`; default
    /// `gate`: the pod gate alone, what the native gate replaces).
    policies: bool,
    /// Where to write the API server's CPU profiles, and over how many seconds.
    profile: Option<(std::path::PathBuf, usize)>,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let var = |name: &str, default: usize| -> Result<usize, String> {
            match std::env::var(name) {
                Ok(v) => v.trim().parse().map_err(|e| format!("{name}={v:?}: {e}")),
                Err(_) => Ok(default),
            }
        };
        Ok(Self {
            pods: var("MESHGATE_BENCH_PODS", 2000)?,
            concurrency: var("MESHGATE_BENCH_CONCURRENCY", 32)?.max(1),
            seconds: var("MESHGATE_BENCH_SECONDS", 60)? as u64,
            rounds: var("MESHGATE_BENCH_ROUNDS", 5)?.max(1),
            policies: match std::env::var("MESHGATE_BENCH_WEBHOOKS").as_deref() {
                Ok("gate,policies") => true,
                Err(_) | Ok("gate") => false,
                Ok(other) => {
                    return Err(format!(
                        "MESHGATE_BENCH_WEBHOOKS={other:?}: expected gate or gate,policies"
                    ));
                }
            },
            profile: match std::env::var_os("MESHGATE_BENCH_APISERVER_PROFILE") {
                Some(dir) => Some((dir.into(), var("MESHGATE_BENCH_PROFILE_SECONDS", 2)?.max(1))),
                None => None,
            },
        })
    }
}

/// One round's figures.
struct Round {
    created: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    gated: usize,
    /// CPU time over the round: kube-apiserver, etcd, this process (client and webhook).
    cpu: [Duration; 3],
}

fn cpu_now(pids: &[u32; 3]) -> [Duration; 3] {
    pids.map(cpu_time)
}

impl Round {
    fn rate(&self) -> f64 {
        self.created as f64 / self.elapsed.as_secs_f64()
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// The label the minimal policy adds.
const MINIMAL_POLICY_LABEL: &str = "bench.meshgate.dev/minimal-policy";

/// What admission did to a pod: the gate, or the minimal policy's label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Effect {
    None,
    Gate,
    Label,
}

fn effect(pod: &Pod) -> Effect {
    if has_gate(pod) {
        Effect::Gate
    } else if pod
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(MINIMAL_POLICY_LABEL))
    {
        Effect::Label
    } else {
        Effect::None
    }
}

fn has_gate(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .and_then(|c| c.first())
        .is_some_and(|c| c.name == names::GATE_CONTAINER)
}

/// The bench pod, in `namespace`.
fn pod_template(namespace: &str) -> Result<Pod, String> {
    let mut pod: Value =
        serde_json::from_str(POD).map_err(|e| format!("tools/bench/pod.json: {e}"))?;
    pod["metadata"]["namespace"] = Value::from(namespace);
    // No ReplicaSet exists here: the owner reference would only be dangling.
    if let Some(meta) = pod["metadata"].as_object_mut() {
        meta.remove("ownerReferences");
    }
    serde_json::from_value(pod).map_err(|e| format!("tools/bench/pod.json as a Pod: {e}"))
}

/// What the minimal webhook answers: the AdmissionReview response for the pod gate (with
/// `UID` where the request's uid goes) and for the policies path.
struct Canned {
    gate: String,
    policies: String,
}

const UID_MARK: &str = "00000000-uid-mark-0000-000000000000";

fn canned(config: &GateConfig, pod: &Pod, namespace: &str) -> Result<Canned, String> {
    let pod = serde_json::to_value(pod).map_err(|e| e.to_string())?;
    let ns = meshgate_core::select::Meta {
        labels: [("istio.io/dataplane-mode".to_owned(), "ambient".to_owned())].into(),
        ..Default::default()
    };
    let plan = meshgate_core::gate::plan_pod(
        config,
        &meshgate_core::gate::PodRequest {
            operation: "CREATE",
            namespace,
            pod: &pod,
            namespace_meta: &ns,
            limit_ranges: &[],
        },
    );
    let meshgate_core::gate::PodPlan::Mutate { patch, .. } = plan else {
        return Err(format!("the bench pod is not gated: {plan:?}"));
    };
    let text = |patch| {
        String::from_utf8(meshgate_webhook::admission::allow(UID_MARK, patch, &[]))
            .map_err(|e| e.to_string())
    };
    Ok(Canned {
        gate: text(&patch)?,
        policies: text(&meshgate_core::patch::JsonPatch::default())?,
    })
}

/// The request's uid: the first `"uid":"…"` of the body (the API server writes `request.uid`
/// before the object).
fn uid_of(body: &[u8]) -> &str {
    let text = std::str::from_utf8(body).unwrap_or_default();
    text.split_once("\"uid\":\"")
        .and_then(|(_, rest)| rest.split_once('"'))
        .map_or("", |(uid, _)| uid)
}

/// Starts the minimal webhook on loopback; returns its address.
async fn start_minimal(
    cert: &std::path::Path,
    key: &std::path::Path,
    canned: Canned,
) -> Result<std::net::SocketAddr, String> {
    use axum::routing::post;
    let files = meshgate_webhook::tls::CertFiles {
        cert: cert.to_owned(),
        key: key.to_owned(),
    };
    let tls = meshgate_webhook::tls::server_config(
        &std::fs::read(cert).map_err(|e| e.to_string())?,
        &std::fs::read(key).map_err(|e| e.to_string())?,
        &files,
    )
    .map_err(|e| e.to_string())?;
    let canned = std::sync::Arc::new(canned);
    let answer = |which: fn(&Canned) -> &str| {
        let canned = canned.clone();
        post(move |body: axum::body::Bytes| {
            let canned = canned.clone();
            async move {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    which(&canned).replacen(UID_MARK, uid_of(&body), 1),
                )
            }
        })
    };
    let app = axum::Router::new()
        .route(
            meshgate_core::registration::paths::POD_GATE,
            answer(|c| &c.gate),
        )
        .route(
            meshgate_core::registration::paths::POLICIES,
            answer(|c| &c.policies),
        );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = axum_server::from_tcp_rustls(
        listener,
        axum_server::tls_rustls::RustlsConfig::from_config(tls),
    )
    .map_err(|e| e.to_string())?;
    tokio::spawn(server.serve(app.into_make_service()));
    Ok(addr)
}

/// Whether a dry-run create of the pod comes back gated: the registration is in effect.
async fn effect_now(pods: &Api<Pod>, pod: &Pod) -> Result<Effect, String> {
    let created = pods
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            pod,
        )
        .await
        .map_err(|e| format!("dry-run create: {e}"))?;
    Ok(effect(&created))
}

/// Waits until the API server applies (or no longer applies) the registration.
async fn settle(pods: &Api<Pod>, pod: &Pod, want: Effect) -> Result<(), String> {
    let deadline = Instant::now() + SETTLE_LIMIT;
    let mut in_a_row = 0;
    while Instant::now() < deadline {
        // Three answers in a row: every API server watch cache of webhook configurations agrees.
        if effect_now(pods, pod).await? == want {
            in_a_row += 1;
            if in_a_row == 3 {
                return Ok(());
            }
        } else {
            in_a_row = 0;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "the webhook registration did not {} within {SETTLE_LIMIT:?}",
        if want == Effect::None {
            "go away"
        } else {
            "take effect"
        }
    ))
}

async fn round(
    pods: &Api<Pod>,
    pod: &Pod,
    s: &Settings,
    pids: &[u32; 3],
    profile: Option<(&kube::Client, &std::path::Path)>,
) -> Result<Round, String> {
    let limit = Duration::from_secs(s.seconds);
    let profiling = async {
        match (profile, &s.profile) {
            (Some((client, path)), Some((_, seconds))) => {
                let bytes =
                    meshgate_testenv::measure::apiserver_cpu_profile(client, *seconds).await?;
                std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
            }
            _ => Ok(()),
        }
    };
    let cpu_before = cpu_now(pids);
    let start = Instant::now();
    let creates = futures::stream::iter(0..s.pods)
        .map(|_| async {
            if start.elapsed() >= limit {
                return Err("time limit".to_owned());
            }
            let t = Instant::now();
            let created = tokio::time::timeout(limit, pods.create(&PostParams::default(), pod))
                .await
                .map_err(|_| "create timed out".to_owned())?
                .map_err(|e| format!("create: {e}"))?;
            Ok((t.elapsed(), has_gate(&created)))
        })
        .buffer_unordered(s.concurrency)
        .collect::<Vec<Result<(Duration, bool), String>>>();
    let (results, profiled) = futures::join!(
        async {
            let results = creates.await;
            (results, start.elapsed(), cpu_now(pids))
        },
        profiling
    );
    profiled?;
    let (results, elapsed, cpu_after) = results;
    let cpu = std::array::from_fn(|i| cpu_after[i].saturating_sub(cpu_before[i]));
    let mut latencies = Vec::with_capacity(results.len());
    let mut gated = 0;
    for r in results {
        match r {
            Ok((d, g)) => {
                latencies.push(d);
                gated += usize::from(g);
            }
            Err(e) if e == "time limit" => {}
            Err(e) => return Err(e),
        }
    }
    latencies.sort();
    let created = latencies.len();
    // Remove them before the next round, so that every round starts from the same store size.
    pods.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .map_err(|e| format!("delete pods: {e}"))?;
    Ok(Round {
        created,
        elapsed,
        latencies,
        gated,
        cpu,
    })
}

async fn run() -> Result<(), String> {
    let settings = Settings::from_env()?;
    let started = Instant::now();
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options::profiling(
        settings.profile.is_some(),
    ))
    .await
    .map_err(|e| format!("control plane: {e}"))?;
    let client = cp.client().await.map_err(|e| e.to_string())?;
    let crds = meshgate::install::crd_documents().map_err(|e| e.to_string())?;
    meshgate::install::apply(&client, &crds, false, |_| {})
        .await
        .map_err(|e| format!("CRDs: {e}"))?;
    let namespace = cp
        .namespace("apps", &[("istio.io/dataplane-mode", "ambient")])
        .await
        .map_err(|e| e.to_string())?;

    // The webhook, as `meshgate webhook` runs it.
    let serving = meshgate_testenv::LoopbackServing::new()?;
    let (ca, cert, key) = (&serving.ca, serving.cert.clone(), serving.key.clone());
    let config = GateConfig {
        profiles: vec![Profile::IstioAmbient],
        ..GateConfig::default()
    };
    let loopback = "127.0.0.1:0"
        .parse()
        .map_err(|e| format!("loopback address: {e}"))?;
    let server = meshgate::run::start_webhook(
        client.clone(),
        meshgate::run::WebhookSettings {
            config: config.clone(),
            addr: loopback,
            health_addr: loopback,
            cert,
            key,
            cert_poll_interval: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            max_in_flight: meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT,
        },
    )
    .await
    .map_err(|e| format!("webhook: {e}"))?;
    let routes = meshgate_core::native_gate::Routes::Namespaces(Vec::new());
    let registration =
        |url: String, native: bool| -> Result<MutatingWebhookConfiguration, String> {
            let mut r = webhook_configuration(&Registration {
                name: REGISTRATION,
                config: &config,
                target: WebhookTarget::Url(url),
                ca_bundle_pem: &ca.certificate().cert_pem,
                policies: settings.policies,
                node_taint: false,
                native_gate: native.then_some(&routes),
            });
            // A failed call must show as a failed create, not as an unmutated pod.
            if let Some(hooks) = r["webhooks"].as_array_mut() {
                for hook in hooks {
                    hook["failurePolicy"] = Value::from("Fail");
                }
            }
            serde_json::from_value(r).map_err(|e| format!("registration: {e}"))
        };
    // The native gate as `install` writes it once the controller has listed the LimitRanges
    // (none here): the MutatingAdmissionPolicy decides, the webhook's gate entries are not called.
    let api = meshgate::discovery::policy_api(&client)
        .await
        .ok_or("the API server serves no MutatingAdmissionPolicy API")?;
    let native_docs: Vec<(kube::api::ApiResource, kube::api::DynamicObject)> =
        meshgate_core::native_gate::policy(&config, api, &routes)
            .map_err(|e| format!("native gate: {e}"))?
            .into_iter()
            .map(|mut doc| {
                if doc["kind"] == "MutatingAdmissionPolicy" {
                    doc["spec"]["failurePolicy"] = Value::from("Fail");
                }
                dynamic(doc)
            })
            .collect::<Result<_, String>>()?;
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let pods = Api::<Pod>::namespaced(client.clone(), &namespace);
    let pod = pod_template(&namespace)?;
    let minimal = start_minimal(
        &serving.cert,
        &serving.key,
        canned(&config, &pod, &namespace)?,
    )
    .await?;
    let meshgate_url = format!("https://127.0.0.1:{}", server.addr.port());
    let registrations = [
        None,
        Some(registration(format!("https://{minimal}"), false)?),
        Some(registration(meshgate_url.clone(), false)?),
        Some(registration(meshgate_url, true)?),
        None,
    ];
    // The minimal policy: one constant JSON patch that adds a label, no match condition, no
    // variable: the API server's price for any mutating admission policy on pod CREATE.
    let minimal_docs: Vec<(kube::api::ApiResource, kube::api::DynamicObject)> = {
        let api_version = api.api_version();
        let docs = [
            serde_json::json!({"apiVersion": api_version, "kind": "MutatingAdmissionPolicy",
                "metadata": {"name": "meshgate-bench-minimal-policy"},
                "spec": {"matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                            "operations": ["CREATE"], "resources": ["pods"]}]},
                         "failurePolicy": "Fail", "reinvocationPolicy": "IfNeeded",
                         "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression":
                            format!("[JSONPatch{{op: \"add\", path: \"/metadata/labels/{}\", value: \"true\"}}]",
                                    meshgate_core::patch::escape(MINIMAL_POLICY_LABEL))}}]}}),
            serde_json::json!({"apiVersion": api_version, "kind": "MutatingAdmissionPolicyBinding",
                "metadata": {"name": "meshgate-bench-minimal-policy"},
                "spec": {"policyName": "meshgate-bench-minimal-policy"}}),
        ];
        docs.into_iter()
            .map(dynamic)
            .collect::<Result<_, String>>()?
    };
    let pids = {
        let cp_pids = cp.pids();
        let (etcd, apiserver) = (cp_pids[0], cp_pids[1]);
        [apiserver, etcd, std::process::id()]
    };
    println!(
        "control plane up and webhook serving in {:.1} s; {} pods per round, {} in flight, \
         namespace {namespace} (ambient); meshgate at {}, minimal webhook at {minimal}; \
         registered: {}",
        started.elapsed().as_secs_f64(),
        settings.pods,
        settings.concurrency,
        server.addr,
        if settings.policies {
            "pod gate and policies"
        } else {
            "pod gate"
        }
    );
    println!(
        "{:<6} {:<11} {:>6} {:>8} {:>10} {:>9} {:>9} {:>6}   CPU per create: {:>9} {:>8} {:>15}",
        "round",
        "webhook",
        "pods",
        "seconds",
        "creates/s",
        "p50",
        "p99",
        "gated",
        "apiserver",
        "etcd",
        "client+webhook"
    );

    const MODES: [&str; 5] = ["none", "minimal", "meshgate", "native", "min-policy"];
    const NATIVE: usize = 3;
    const MINIMAL_POLICY: usize = 4;
    let mut rates: [Vec<f64>; 5] = Default::default();
    for r in 0..settings.rounds {
        let mut round_rates = [0.0; 5];
        for step in 0..MODES.len() {
            let mode = (r + step) % MODES.len();
            // Always through "no registration": two registrations gate alike, so only its
            // absence shows that the API server has dropped the previous one.
            if configs
                .get_opt(REGISTRATION)
                .await
                .map_err(|e| e.to_string())?
                .is_some()
            {
                configs
                    .delete(REGISTRATION, &DeleteParams::default())
                    .await
                    .map_err(|e| format!("deregister: {e}"))?;
            }
            for (ar, obj) in native_docs.iter().chain(&minimal_docs) {
                let api = Api::<kube::api::DynamicObject>::all_with(client.clone(), ar);
                let name = obj.metadata.name.clone().unwrap_or_default();
                if api
                    .get_opt(&name)
                    .await
                    .map_err(|e| e.to_string())?
                    .is_some()
                {
                    api.delete(&name, &DeleteParams::default())
                        .await
                        .map_err(|e| format!("native gate off: {e}"))?;
                }
            }
            settle(&pods, &pod, Effect::None).await?;
            if let Some(registration) = &registrations[mode] {
                configs
                    .patch(
                        REGISTRATION,
                        &PatchParams::apply("meshgate-bench").force(),
                        &Patch::Apply(registration),
                    )
                    .await
                    .map_err(|e| format!("register: {e}"))?;
            }
            let policies: &[_] = match mode {
                NATIVE => &native_docs,
                MINIMAL_POLICY => &minimal_docs,
                _ => &[],
            };
            {
                for (ar, obj) in policies {
                    let name = obj.metadata.name.clone().unwrap_or_default();
                    Api::<kube::api::DynamicObject>::all_with(client.clone(), ar)
                        .patch(
                            &name,
                            &PatchParams::apply("meshgate-bench").force(),
                            &Patch::Apply(obj),
                        )
                        .await
                        .map_err(|e| format!("native gate on: {e}"))?;
                }
            }
            let registered = registrations[mode].is_some();
            let want = match mode {
                MINIMAL_POLICY => Effect::Label,
                _ if registered => Effect::Gate,
                _ => Effect::None,
            };
            settle(&pods, &pod, want).await?;
            let reviews_before = pod_gate_reviews(server.health_addr).await;
            let profile = settings
                .profile
                .as_ref()
                .filter(|_| r == 0)
                .map(|(dir, _)| (&client, dir.join(format!("{}.pprof", MODES[mode]))));
            let figures = round(
                &pods,
                &pod,
                &settings,
                &pids,
                profile.as_ref().map(|(c, p)| (*c, p.as_path())),
            )
            .await?;
            let want_gated = if want == Effect::Gate {
                figures.created
            } else {
                0
            };
            if figures.gated != want_gated {
                return Err(format!(
                    "round {}, {}: {} of {} pods gated, expected {want_gated}",
                    r + 1,
                    MODES[mode],
                    figures.gated,
                    figures.created
                ));
            }
            if mode == NATIVE {
                let reviewed = pod_gate_reviews(server.health_addr).await - reviews_before;
                if reviewed != 0 {
                    return Err(format!(
                        "round {}, native: the webhook answered {reviewed} pod-gate reviews",
                        r + 1
                    ));
                }
            }
            let per_create = |d: Duration| {
                format!(
                    "{:.2} ms",
                    d.as_secs_f64() * 1e3 / figures.created.max(1) as f64
                )
            };
            println!(
                "{:<6} {:<11} {:>6} {:>8.2} {:>10.0} {:>9} {:>9} {:>6}   {:>24} {:>8} {:>15}",
                r + 1,
                MODES[mode],
                figures.created,
                figures.elapsed.as_secs_f64(),
                figures.rate(),
                ms(quantile(&figures.latencies, 0.5)),
                ms(quantile(&figures.latencies, 0.99)),
                figures.gated,
                per_create(figures.cpu[0]),
                per_create(figures.cpu[1]),
                per_create(figures.cpu[2]),
            );
            round_rates[mode] = figures.rate();
        }
        for mode in 0..MODES.len() {
            rates[mode].push(round_rates[mode]);
        }
    }
    // Per-round ratios: meshgate/none, minimal/none, meshgate/minimal, native/none.
    let per_round = |a: usize, b: usize| -> Vec<f64> {
        rates[a].iter().zip(&rates[b]).map(|(x, y)| x / y).collect()
    };
    let ratios = [
        per_round(2, 0),
        per_round(1, 0),
        per_round(2, 1),
        per_round(NATIVE, 0),
        per_round(MINIMAL_POLICY, 0),
        per_round(NATIVE, MINIMAL_POLICY),
    ];
    println!("\nsummary (medians over rounds)");
    for mode in 0..MODES.len() {
        println!(
            "  {:<17} {:>8.0} creates/s",
            MODES[mode],
            median(rates[mode].clone())
        );
    }
    let spread = |v: &Vec<f64>| {
        (
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    };
    let spreads = ratios.each_ref().map(spread);
    let [
        with,
        minimal_ratio,
        against_minimal,
        native,
        minimal_policy,
        native_share,
    ] = ratios.map(median);
    println!(
        "  ratio native/none:      {native:.2}x (target >= 0.95x: {}; the gate in the API server, no webhook call)",
        if native >= 0.95 { "met" } else { "MISSED" }
    );
    println!("  ratio meshgate/none:    {with:.2}x (the gate through meshgate's webhook)");
    println!(
        "  ratio minimal/none:     {minimal_ratio:.2}x (what any webhook gating these pods costs here)"
    );
    println!("  ratio meshgate/minimal: {against_minimal:.2}x (meshgate's own share)");
    println!(
        "  ratio min-policy/none:  {minimal_policy:.2}x (what any mutating admission policy costs here)"
    );
    println!("  ratio native/min-policy: {native_share:.2}x (the native gate's own share)");
    println!(
        "  spread over rounds (min-max): min-policy/none {:.2}-{:.2}, native/min-policy {:.2}-{:.2}",
        spreads[4].0, spreads[4].1, spreads[5].0, spreads[5].1
    );
    println!(
        "  spread over rounds (min-max): native/none {:.2}-{:.2}, meshgate/none {:.2}-{:.2}, minimal/none {:.2}-{:.2}, meshgate/minimal {:.2}-{:.2}",
        spreads[3].0,
        spreads[3].1,
        spreads[0].0,
        spreads[0].1,
        spreads[1].0,
        spreads[1].1,
        spreads[2].0,
        spreads[2].1
    );
    if let Some(counts) = review_counts(server.health_addr).await {
        println!("  webhook reviews answered: {counts}");
    }
    // Headline figures, one per line, for tools (issue #17's format).
    println!("RATIO native-gate/none: {native:.2}");
    println!("RATIO webhook-gate/none: {with:.2}");
    println!("RATIO minimal-webhook/none: {minimal_ratio:.2}");
    println!("RATIO webhook-gate/minimal-webhook: {against_minimal:.2}");
    println!("RATIO minimal-policy/none: {minimal_policy:.2}");
    println!("RATIO native-gate/minimal-policy: {native_share:.2}");
    server
        .shutdown(Duration::from_secs(5))
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// An object to apply, with the resource it is served as.
fn dynamic(doc: Value) -> Result<(kube::api::ApiResource, kube::api::DynamicObject), String> {
    let obj: kube::api::DynamicObject = serde_json::from_value(doc).map_err(|e| e.to_string())?;
    let gvk = obj
        .types
        .as_ref()
        .ok_or("no type")
        .and_then(|t| kube::api::GroupVersionKind::try_from(t).map_err(|_| "type"))
        .map_err(str::to_owned)?;
    Ok((kube::api::ApiResource::from_gvk(&gvk), obj))
}

/// Pod-gate reviews the webhook answered so far.
async fn pod_gate_reviews(addr: std::net::SocketAddr) -> u64 {
    review_counts(addr)
        .await
        .unwrap_or_default()
        .split("; ")
        .filter(|c| c.contains("pod-gate"))
        .filter_map(|c| c.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The webhook's review counts from its `/metrics` (plain HTTP on loopback).
async fn review_counts(addr: std::net::SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut text))
        .await
        .ok()?
        .ok()?;
    let counts: Vec<String> = text
        .lines()
        .filter(|l| l.contains("reviews_total{"))
        .map(str::to_owned)
        .collect();
    Some(counts.join("; "))
}

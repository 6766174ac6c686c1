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
//! Rounds alternate: without the registration, with it (the order flips every round). Each
//! round creates `MESHGATE_BENCH_PODS` (2000) pods from `tools/bench/pod.json` with
//! `MESHGATE_BENCH_CONCURRENCY` (32) creates in flight, bounded by `MESHGATE_BENCH_SECONDS` (60);
//! then deletes them. Reported per round: creates per second, p50/p99 create latency, and how many
//! stored pods carry the gate (all in "with" rounds, none in "without" rounds, or the run
//! fails). The ratio is the median over `MESHGATE_BENCH_ROUNDS` (3) of the per-round ratios.
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
            rounds: var("MESHGATE_BENCH_ROUNDS", 3)?.max(1),
        })
    }
}

/// One round's figures.
struct Round {
    created: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    gated: usize,
}

impl Round {
    fn rate(&self) -> f64 {
        self.created as f64 / self.elapsed.as_secs_f64()
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
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

/// Whether a dry-run create of the pod comes back gated: the registration is in effect.
async fn gated_now(pods: &Api<Pod>, pod: &Pod) -> Result<bool, String> {
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
    Ok(has_gate(&created))
}

/// Waits until the API server applies (or no longer applies) the registration.
async fn settle(pods: &Api<Pod>, pod: &Pod, want: bool) -> Result<(), String> {
    let deadline = Instant::now() + SETTLE_LIMIT;
    let mut in_a_row = 0;
    while Instant::now() < deadline {
        // Three answers in a row: every API server watch cache of webhook configurations agrees.
        if gated_now(pods, pod).await? == want {
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
        if want { "take effect" } else { "go away" }
    ))
}

async fn round(pods: &Api<Pod>, pod: &Pod, s: &Settings) -> Result<Round, String> {
    let limit = Duration::from_secs(s.seconds);
    let start = Instant::now();
    let results: Vec<Result<(Duration, bool), String>> = futures::stream::iter(0..s.pods)
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
        .collect()
        .await;
    let elapsed = start.elapsed();
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
    })
}

async fn run() -> Result<(), String> {
    let settings = Settings::from_env()?;
    let started = Instant::now();
    let cp = meshgate_testenv::ControlPlane::start(meshgate_testenv::Options::default())
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
    let ca = meshgate_pki::Ca::new("meshgate-bench-ca", Duration::from_secs(3600))
        .map_err(|e| e.to_string())?;
    let serving = ca
        .issue_server(&["127.0.0.1"], Duration::from_secs(3600))
        .map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &serving.cert_pem).map_err(|e| e.to_string())?;
    std::fs::write(&key, &serving.key_pem).map_err(|e| e.to_string())?;
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
        },
    )
    .await
    .map_err(|e| format!("webhook: {e}"))?;
    let mut registration = webhook_configuration(&Registration {
        name: REGISTRATION,
        config: &config,
        target: WebhookTarget::Url(format!("https://127.0.0.1:{}", server.addr.port())),
        ca_bundle_pem: &ca.certificate().cert_pem,
        policies: true,
        node_taint: false,
    });
    // A failed call must show as a failed create, not as an unmutated pod.
    if let Some(hooks) = registration["webhooks"].as_array_mut() {
        for hook in hooks {
            hook["failurePolicy"] = Value::from("Fail");
        }
    }
    let registration: MutatingWebhookConfiguration =
        serde_json::from_value(registration).map_err(|e| format!("registration: {e}"))?;
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let pods = Api::<Pod>::namespaced(client.clone(), &namespace);
    let pod = pod_template(&namespace)?;
    println!(
        "control plane up and webhook serving in {:.1} s; {} pods per round, {} in flight, \
         namespace {namespace} (ambient)",
        started.elapsed().as_secs_f64(),
        settings.pods,
        settings.concurrency
    );
    println!(
        "{:<6} {:<16} {:>8} {:>9} {:>10} {:>10} {:>10} {:>7}",
        "round", "webhook", "pods", "seconds", "creates/s", "p50", "p99", "gated"
    );

    let mut ratios = Vec::new();
    let (mut with_rates, mut without_rates) = (Vec::new(), Vec::new());
    for r in 0..settings.rounds {
        let order = if r % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        let mut rates = [0.0; 2];
        for registered in order {
            if registered {
                configs
                    .patch(
                        REGISTRATION,
                        &PatchParams::apply("meshgate-bench").force(),
                        &Patch::Apply(&registration),
                    )
                    .await
                    .map_err(|e| format!("register: {e}"))?;
            } else if configs
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
            settle(&pods, &pod, registered).await?;
            let figures = round(&pods, &pod, &settings).await?;
            let want_gated = if registered { figures.created } else { 0 };
            if figures.gated != want_gated {
                return Err(format!(
                    "round {}: {} of {} pods gated, expected {want_gated}",
                    r + 1,
                    figures.gated,
                    figures.created
                ));
            }
            println!(
                "{:<6} {:<16} {:>8} {:>9.2} {:>10.0} {:>10} {:>10} {:>7}",
                r + 1,
                if registered { "registered" } else { "none" },
                figures.created,
                figures.elapsed.as_secs_f64(),
                figures.rate(),
                ms(quantile(&figures.latencies, 0.5)),
                ms(quantile(&figures.latencies, 0.99)),
                figures.gated
            );
            rates[usize::from(registered)] = figures.rate();
        }
        without_rates.push(rates[0]);
        with_rates.push(rates[1]);
        ratios.push(rates[1] / rates[0]);
    }
    let ratio = median(ratios);
    println!("\nsummary (medians over rounds)");
    println!(
        "  without webhook  {:>8.0} creates/s",
        median(without_rates)
    );
    println!("  with webhook     {:>8.0} creates/s", median(with_rates));
    println!(
        "  ratio with/without: {ratio:.2}x (target >= 0.95x: {})",
        if ratio >= 0.95 { "met" } else { "MISSED" }
    );
    if let Some(counts) = review_counts(server.health_addr).await {
        println!("  webhook reviews answered: {counts}");
    }
    server
        .shutdown(Duration::from_secs(5))
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
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

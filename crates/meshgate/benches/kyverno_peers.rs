//! meshgate's mutation policies against Kyverno's admission controller: the same policies, the
//! same pods, one control plane, alternating rounds.
//!
//! The policies are Kyverno files, written once (`tools/bench/kyverno/`): `platform` (the one
//! rule platform teams start from, the mesh's outbound exclusion on every pod) and `library` (ten
//! rules in the style of Kyverno's sample library: strategic merges with anchors, `foreach` over
//! containers, a variable context entry). Kyverno serves the files as they are; meshgate serves
//! what `meshgate import kyverno` makes of exactly those files, never a hand-tuned copy.
//!
//! Each peer runs as its own process, out of the cluster, as cluster-admin (both):
//! * `kyverno`: Kyverno's admission controller (`cmd/kyverno` v1.19.1, `tools/kyverno/build.sh`)
//!   with its chart's defaults, registering its own webhooks (`--serverIP`); its other
//!   controllers (background, reports, cleanup) are not run: nothing here needs them, and their
//!   cost is not counted. The ephemeral admission reports it writes are part of its cost on the
//!   API server (counted there) and deleted between rounds.
//! * `meshgate`: `meshgate webhook` (the policies path only) and `meshgate controller` (the
//!   webhook's rules kept to the policies' kinds, the policies' status), the registration
//!   `install` writes for the policies webhook; both processes counted.
//! * `meshgate-native`: the same with `--native-policies` (install's default): policies a
//!   MutatingAdmissionPolicy can express run in the API server, the rest on the webhook.
//! * `none`: no policy engine, for the API server's own cost.
//!
//! Per round and peer: a fresh process, its cold start (spawn to the first pod a dry-run create
//! returns mutated), `MESHGATE_BENCH_FIXED_PODS` (200) creates at `MESHGATE_BENCH_RATE` (20) per
//! second, then `MESHGATE_BENCH_PODS` (1000) with `MESHGATE_BENCH_CONCURRENCY` (32) in flight
//! (saturation); the CREATE latency of each (p50, p99), the peer's CPU seconds per 1,000 creates
//! (`/proc/<pid>/stat`, all of its processes, both phases), its resident memory after the creates
//! (steady) and its peak (`VmHWM`), and the API server's CPU per create. Every stored pod is
//! compared with every other peer's, apart from `metadata` the API server assigns and the
//! annotations each tool adds for itself (`IGNORED_ANNOTATIONS`): a difference fails the run.
//!
//! Prints `RATIO meshgate/kyverno-<measure>-<configuration>` (and `meshgate-native/kyverno-...`):
//! medians of the per-round ratios over `MESHGATE_BENCH_ROUNDS` (5) rounds, with their spread,
//! below 1 when meshgate costs less; `VALUE` lines with each peer's medians.
//!
//! `MESHGATE_BENCH_APISERVER_PROFILE=DIR` runs the API server with `--profiling=true` and writes
//! a Go CPU profile of it over the first `MESHGATE_BENCH_PROFILE_SECONDS` (2) of each peer's
//! saturated phase in the first round, `DIR/<configuration>-<peer>.pprof` (`go tool pprof`).
//! `MESHGATE_BENCH_LOGS=DIR` keeps the peers' logs there.
//!
//! Run: `MESHGATE_CONTROLPLANE_BIN=$(tools/controlplane/build.sh) cargo bench -p meshgate --bench
//! kyverno_peers` (Kyverno is built on demand by `tools/kyverno/build.sh`, or set
//! `MESHGATE_KYVERNO_ADMISSION` to the binary). `MESHGATE_BENCH_CONFIGS=platform` runs one
//! configuration.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[path = "../tests/common/mod.rs"]
mod common;

use common::{ChildProcess, http_get, meshgate_bin};
use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use meshgate_testenv::ControlPlane;
use meshgate_testenv::measure::quantile;
use serde_json::{Value, json};

const POD: &str = include_str!("../../../tools/bench/pod.json");
/// Kyverno's namespace (its chart's default).
const KYVERNO_NS: &str = "kyverno";
const MESHGATE_NS: &str = "meshgate-system";
/// The namespace of the pods.
const APPS: &str = "apps";
/// meshgate's policies webhook registration (install's name for it).
const REGISTRATION: &str = "meshgate-policies";
/// What each tool adds to a pod for itself, left out of the comparison.
const IGNORED_ANNOTATIONS: [&str; 1] = ["policies.kyverno.io/last-applied-patches"];
/// The admission controller's arguments in its chart (charts/kyverno v1.19.1, default values),
/// as `helm template` renders them, but for its ports (set per run).
const KYVERNO_CHART_ARGS: &[&str] = &[
    "--caSecretName=kyverno-svc.kyverno.svc.kyverno-tls-ca",
    "--tlsSecretName=kyverno-svc.kyverno.svc.kyverno-tls-pair",
    "--tlsKeyAlgorithm=RSA",
    "--backgroundServiceAccountName=system:serviceaccount:kyverno:kyverno-background-controller",
    "--reportsServiceAccountName=system:serviceaccount:kyverno:kyverno-reports-controller",
    "--servicePort=443",
    "--resyncPeriod=15m",
    "--crdWatcher=false",
    "--disableMetrics=false",
    "--otelConfig=prometheus",
    "--admissionReports=true",
    "--maxAdmissionReports=1000",
    "--autoUpdateWebhooks=true",
    "--excludeBootstrapResources=false",
    "--enableConfigMapCaching=true",
    "--enableDeferredLoading=true",
    "--dumpPayload=false",
    "--forceFailurePolicyIgnore=false",
    "--generateValidatingAdmissionPolicy=true",
    "--generateMutatingAdmissionPolicy=false",
    "--dumpPatches=false",
    "--maxAPICallResponseLength=2000000",
    "--apiCallTimeout=30s",
    "--maxGlobalContextEntries=0",
    "--loggingFormat=text",
    "--v=2",
    "--omitEvents=PolicyApplied,PolicySkipped",
    "--enablePolicyException=false",
    "--protectManagedResources=false",
    "--allowInsecureRegistry=false",
    "--registryCredentialHelpers=default,google,amazon,azure,github",
    "--enableReporting=validate,mutate,mutateExisting,imageVerify,generate",
];

/// The longest a peer may take from its start to serving the policies.
const START_LIMIT: Duration = Duration::from_secs(180);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Peer {
    None,
    Kyverno,
    Meshgate,
    MeshgateNative,
}

impl Peer {
    const ALL: [Peer; 4] = [
        Peer::None,
        Peer::Kyverno,
        Peer::Meshgate,
        Peer::MeshgateNative,
    ];

    fn name(self) -> &'static str {
        match self {
            Peer::None => "none",
            Peer::Kyverno => "kyverno",
            Peer::Meshgate => "meshgate",
            Peer::MeshgateNative => "meshgate-native",
        }
    }
}

struct Settings {
    rounds: usize,
    rate: f64,
    fixed_pods: usize,
    pods: usize,
    concurrency: usize,
    configs: Vec<String>,
    /// Where to write the API server's CPU profiles (first round, saturated phase), and over
    /// how many seconds.
    profile: Option<(PathBuf, usize)>,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let var = |name: &str, default: usize| -> Result<usize, String> {
            match std::env::var(name) {
                Ok(v) => v.trim().parse().map_err(|e| format!("{name}={v:?}: {e}")),
                Err(_) => Ok(default),
            }
        };
        let configs = std::env::var("MESHGATE_BENCH_CONFIGS")
            .unwrap_or_else(|_| "platform library".into())
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>();
        for c in &configs {
            if !["platform", "library"].contains(&c.as_str()) {
                return Err(format!(
                    "MESHGATE_BENCH_CONFIGS: {c:?}: expected platform and/or library"
                ));
            }
        }
        Ok(Self {
            rounds: var("MESHGATE_BENCH_ROUNDS", 5)?.max(1),
            rate: var("MESHGATE_BENCH_RATE", 20)?.max(1) as f64,
            fixed_pods: var("MESHGATE_BENCH_FIXED_PODS", 200)?.max(1),
            pods: var("MESHGATE_BENCH_PODS", 1000)?.max(1),
            concurrency: var("MESHGATE_BENCH_CONCURRENCY", 32)?.max(1),
            configs,
            profile: match std::env::var_os("MESHGATE_BENCH_APISERVER_PROFILE") {
                Some(dir) => Some((dir.into(), var("MESHGATE_BENCH_PROFILE_SECONDS", 2)?.max(1))),
                None => None,
            },
        })
    }
}

/// One peer's figures in one round.
#[derive(Default)]
struct Round {
    cold_start: Duration,
    fixed: Vec<Duration>,
    saturated: Vec<Duration>,
    saturated_rate: f64,
    /// The peer's CPU seconds per 1,000 creates (both phases); the API server's per create.
    cpu_per_1000: f64,
    apiserver_ms_per_create: f64,
    rss_mib: f64,
    rss_peak_mib: f64,
    /// Reviews the peer's webhook answered per create (meshgate's metrics; Kyverno's).
    reviews_per_create: Option<f64>,
}

fn repo_root() -> PathBuf {
    meshgate_testenv::workspace_dir()
}

/// Kyverno's admission controller: `MESHGATE_KYVERNO_ADMISSION`, else what
/// `tools/kyverno/build.sh --admission-controller` prints (it builds it when missing; only this
/// benchmark asks for it, so `tools/test.sh` never builds it).
fn kyverno_bin() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("MESHGATE_KYVERNO_ADMISSION").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let script = repo_root().join("tools/kyverno/build.sh");
    let out = std::process::Command::new(&script)
        .arg("--admission-controller")
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("{}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!("{} failed", script.display()));
    }
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if bin.exists() {
        Ok(bin)
    } else {
        Err(format!(
            "{}: missing (tools/kyverno/build.sh)",
            bin.display()
        ))
    }
}

/// Kyverno's CRDs (`config/crds` of the pinned module, from the Go module cache).
fn kyverno_crds() -> Result<Vec<Value>, String> {
    let dir = repo_root().join("tools/kyverno");
    let version = std::fs::read_to_string(dir.join("go.mod"))
        .map_err(|e| format!("tools/kyverno/go.mod: {e}"))?
        .lines()
        .find_map(|l| {
            let l = l.trim();
            l.strip_prefix("github.com/kyverno/kyverno ")
                .map(|v| v.split_whitespace().next().unwrap_or_default().to_owned())
        })
        .ok_or("tools/kyverno/go.mod: no github.com/kyverno/kyverno requirement")?;
    let out = std::process::Command::new("go")
        .args(["mod", "download", "-json"])
        .arg(format!("github.com/kyverno/kyverno@{version}"))
        .current_dir(&dir)
        .output()
        .map_err(|e| format!("go mod download: {e}"))?;
    let info: Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("go mod download -json: {e}"))?;
    let module = info["Dir"]
        .as_str()
        .ok_or_else(|| format!("go mod download: no Dir: {info}"))?;
    let mut files = Vec::new();
    let mut stack = vec![Path::new(module).join("config/crds")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let p = e.map_err(|e| e.to_string())?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml") {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut docs = Vec::new();
    for f in files {
        docs.extend(meshgate::render::read_documents(&f).map_err(|e| e.to_string())?);
    }
    Ok(docs)
}

/// The Kyverno policy files of a configuration.
fn policy_files(config: &str) -> Result<Vec<PathBuf>, String> {
    let dir = repo_root().join("tools/bench/kyverno").join(config);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    Ok(files)
}

/// `meshgate import kyverno FILE`, as a user runs it.
fn import(file: &Path) -> Result<Vec<Value>, String> {
    let out = std::process::Command::new(meshgate_bin())
        .args(["import", "kyverno"])
        .arg(file)
        .output()
        .map_err(|e| format!("meshgate import: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "meshgate import kyverno {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    meshgate::render::parse_documents("import", &String::from_utf8_lossy(&out.stdout))
        .map_err(|e| e.to_string())
}

/// Server-side applies documents (any kind the API server serves).
async fn apply(client: &kube::Client, docs: &[Value]) -> Result<(), String> {
    meshgate::install::apply(client, docs, false, |_| {})
        .await
        .map_err(|e| e.to_string())
}

/// Deletes every object of `kind` (cluster-scoped, or in `namespace`) whose name starts with
/// `prefix`.
async fn delete_named(
    client: &kube::Client,
    ar: &kube::api::ApiResource,
    namespace: Option<&str>,
    prefix: &str,
) -> Result<(), String> {
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, ar),
        None => Api::all_with(client.clone(), ar),
    };
    let list = match api.list(&ListParams::default()).await {
        Ok(l) => l,
        // A kind the API server does not serve has nothing to delete.
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
        Err(e) => return Err(format!("list {}: {e}", ar.plural)),
    };
    for o in list {
        let name = o.metadata.name.clone().unwrap_or_default();
        if name.starts_with(prefix) {
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) | Err(kube::Error::Api(_)) => {}
                Err(e) => return Err(format!("delete {} {name}: {e}", ar.plural)),
            }
        }
    }
    Ok(())
}

/// A stored pod as both peers must leave it: what the API server assigns per pod, and what
/// each tool adds for itself, left out.
fn normalized(pod: &Pod) -> Value {
    let mut v = serde_json::to_value(pod).unwrap_or_default();
    if let Some(meta) = v["metadata"].as_object_mut() {
        for f in [
            "name",
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "managedFields",
            "generation",
        ] {
            meta.remove(f);
        }
        if let Some(a) = meta.get_mut("annotations").and_then(Value::as_object_mut) {
            for k in IGNORED_ANNOTATIONS {
                a.remove(k);
            }
        }
    }
    v
}

/// Where two pods differ (the first few paths).
fn diff(a: &Value, b: &Value) -> String {
    let mut out = Vec::new();
    common::kyverno_cases::diff("", ("expected", a), ("got", b), &mut out);
    out.into_iter().take(8).collect::<Vec<_>>().join("\n  ")
}

fn cpu_seconds(pids: &[u32]) -> f64 {
    pids.iter()
        .map(|p| meshgate_testenv::measure::cpu_time(*p).as_secs_f64())
        .sum()
}

fn status_kib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

fn rss_mib(pids: &[u32], field: &str) -> f64 {
    pids.iter().map(|p| status_kib(*p, field)).sum::<f64>() / 1024.0
}

/// A running peer: its processes.
struct Running {
    processes: Vec<ChildProcess>,
    /// meshgate's webhook health address (its `/metrics`).
    metrics: Option<std::net::SocketAddr>,
}

impl Running {
    fn pids(&self) -> Vec<u32> {
        self.processes.iter().map(ChildProcess::pid).collect()
    }

    fn assert_running(&mut self) {
        for p in &mut self.processes {
            p.assert_running();
        }
    }
}

struct Bench {
    cp: ControlPlane,
    client: kube::Client,
    kyverno: PathBuf,
    /// meshgate's serving certificate and key, and the registration naming its CA.
    tls: (PathBuf, PathBuf),
    ca_pem: String,
    _serving: meshgate_testenv::LoopbackServing,
    apiserver: u32,
}

impl Bench {
    /// A peer's log file: in `MESHGATE_BENCH_LOGS` when set (kept), else in the control
    /// plane's directory (removed with it).
    fn log(&self, name: &str) -> PathBuf {
        match std::env::var_os("MESHGATE_BENCH_LOGS") {
            Some(dir) => {
                let dir = PathBuf::from(dir);
                let _ = std::fs::create_dir_all(&dir);
                dir.join(name)
            }
            None => self.cp.dir().join(name),
        }
    }

    fn start_kyverno(&self) -> Running {
        let port = || meshgate_testenv::free_port().expect("port");
        // The container's arguments and environment of the chart's admission controller
        // (`helm template` of charts/kyverno v1.19.1, default values), with its ports moved to
        // free ones on loopback and the two flags it needs out of a cluster: `--kubeconfig` and
        // `--serverIP` (its webhooks registered by URL, https://127.0.0.1:<port>; in this mode it
        // needs no Service or Deployment object).
        let mut args: Vec<String> = KYVERNO_CHART_ARGS.iter().map(|a| (*a).to_owned()).collect();
        let webhook = port();
        args.extend([
            format!("--webhookServerPort={webhook}"),
            "--webhookServerHost=127.0.0.1".into(),
            format!("--metricsPort={}", port()),
            format!("--controllerRuntimeMetricsAddress=127.0.0.1:{}", port()),
            format!("--kubeconfig={}", self.cp.kubeconfig_path.display()),
            // The webhooks' URL is `https://<serverIP><path>`: the port is part of it.
            format!("--serverIP=127.0.0.1:{webhook}"),
        ]);
        let env: Vec<(&str, &std::ffi::OsStr)> = [
            ("INIT_CONFIG", "kyverno"),
            ("METRICS_CONFIG", "kyverno-metrics"),
            ("KYVERNO_NAMESPACE", KYVERNO_NS),
            ("KYVERNO_POD_NAME", "kyverno-admission-controller-bench"),
            (
                "KYVERNO_SERVICEACCOUNT_NAME",
                "kyverno-admission-controller",
            ),
            ("KYVERNO_ROLE_NAME", "kyverno:admission-controller"),
            ("KYVERNO_SVC", "kyverno-svc"),
            ("KYVERNO_DEPLOYMENT", "kyverno-admission-controller"),
        ]
        .iter()
        .map(|(k, v)| (*k, std::ffi::OsStr::new(*v)))
        .collect();
        Running {
            processes: vec![ChildProcess::spawn(
                "kyverno admission controller",
                &self.kyverno,
                &args,
                &env,
                &self.log("kyverno.log"),
            )],
            metrics: None,
        }
    }

    async fn start_meshgate(&self, native: bool) -> Result<Running, String> {
        let addr = meshgate_testenv::free_port().map_err(|e| e.to_string())?;
        let health = meshgate_testenv::free_port().map_err(|e| e.to_string())?;
        let controller_health = meshgate_testenv::free_port().map_err(|e| e.to_string())?;
        // The registration `install` writes for the policies webhook, by URL (out of cluster).
        let config = common::policies_only_config();
        let mwc = meshgate_core::registration::webhook_configuration(
            &meshgate_core::registration::Registration {
                name: REGISTRATION,
                config: &config,
                target: meshgate_core::registration::WebhookTarget::Url(format!(
                    "https://127.0.0.1:{addr}"
                )),
                ca_bundle_pem: &self.ca_pem,
                policies: true,
                node_taint: false,
                native_gate: None,
            },
        );
        common::register(&self.client, &mwc).await;
        let config_file = self.cp.dir().join("bench-meshgate-config.json");
        std::fs::write(
            &config_file,
            serde_json::to_vec(&config).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
        let kubeconfig = self.cp.kubeconfig_path.as_os_str();
        let env = [
            ("KUBECONFIG", kubeconfig),
            ("RUST_LOG", std::ffi::OsStr::new("warn")),
        ];
        let webhook = ChildProcess::spawn(
            "meshgate webhook",
            &meshgate_bin(),
            &[
                "webhook".into(),
                "--config".into(),
                config_file.display().to_string(),
                "--cert".into(),
                self.tls.0.display().to_string(),
                "--key".into(),
                self.tls.1.display().to_string(),
                "--addr".into(),
                format!("127.0.0.1:{addr}"),
                "--health-addr".into(),
                format!("127.0.0.1:{health}"),
            ],
            &env,
            &self.log("meshgate-webhook.log"),
        );
        let mut args: Vec<String> = [
            "controller",
            "--lease-namespace",
            MESHGATE_NS,
            "--identity",
            "bench",
            "--policy-webhook-configuration",
            REGISTRATION,
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect();
        args.extend([
            "--health-addr".into(),
            format!("127.0.0.1:{controller_health}"),
        ]);
        if native {
            args.push("--native-policies".into());
        }
        let controller = ChildProcess::spawn(
            "meshgate controller",
            &meshgate_bin(),
            &args,
            &env,
            &self.log("meshgate-controller.log"),
        );
        Ok(Running {
            processes: vec![webhook, controller],
            metrics: Some(
                format!("127.0.0.1:{health}")
                    .parse()
                    .map_err(|e| format!("{e}"))?,
            ),
        })
    }

    /// Stops a peer and removes what it left registered: no pod is mutated afterwards.
    async fn stop(&self, peer: Peer, running: Option<Running>) -> Result<(), String> {
        drop(running);
        match peer {
            Peer::None => {}
            Peer::Kyverno => {
                // Kyverno leaves its webhook configurations behind when it stops (its chart
                // removes them with a hook); a `Fail` policy would refuse every pod.
                for (kind, plural) in [
                    (
                        "MutatingWebhookConfiguration",
                        "mutatingwebhookconfigurations",
                    ),
                    (
                        "ValidatingWebhookConfiguration",
                        "validatingwebhookconfigurations",
                    ),
                ] {
                    let ar = meshgate_testenv::api_resource(
                        "admissionregistration.k8s.io",
                        "v1",
                        kind,
                        plural,
                    );
                    delete_named(&self.client, &ar, None, "kyverno-").await?;
                }
            }
            Peer::Meshgate | Peer::MeshgateNative => {
                let _ = Api::<MutatingWebhookConfiguration>::all(self.client.clone())
                    .delete(REGISTRATION, &DeleteParams::default())
                    .await;
                if let Some(api) = meshgate::discovery::policy_api(&self.client).await {
                    let (group, version) = api
                        .api_version()
                        .split_once('/')
                        .map(|(g, v)| (g.to_owned(), v.to_owned()))
                        .unwrap_or_default();
                    for (kind, plural) in [
                        (
                            "MutatingAdmissionPolicyBinding",
                            "mutatingadmissionpolicybindings",
                        ),
                        ("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
                    ] {
                        delete_named(
                            &self.client,
                            &meshgate_testenv::api_resource(&group, &version, kind, plural),
                            None,
                            "meshgate-",
                        )
                        .await?;
                    }
                }
            }
        }
        // Kyverno's admission reports of the round.
        for (kind, plural) in [
            ("EphemeralReport", "ephemeralreports"),
            ("ClusterEphemeralReport", "clusterephemeralreports"),
        ] {
            let ar = meshgate_testenv::api_resource("reports.kyverno.io", "v1", kind, plural);
            let namespace = (kind == "EphemeralReport").then_some(APPS);
            delete_named(&self.client, &ar, namespace, "").await?;
        }
        Ok(())
    }
}

/// Dry-run creates the pod until `accept` holds three answers in a row (every API server cache
/// of admission configuration agrees); returns the time from `start` to the first accepted
/// answer, and the pod.
async fn settle(
    pods: &Api<Pod>,
    pod: &Pod,
    accept: impl Fn(&Value) -> bool,
    running: &mut Option<Running>,
    start: Instant,
    what: &str,
) -> Result<(Duration, Value), String> {
    let mut first = None;
    let mut in_a_row = 0;
    let mut last = Value::Null;
    while start.elapsed() < START_LIMIT {
        if let Some(r) = running.as_mut() {
            r.assert_running();
        }
        let dry = PostParams {
            dry_run: true,
            ..Default::default()
        };
        match pods.create(&dry, pod).await {
            Ok(created) => {
                last = normalized(&created);
                if accept(&last) {
                    first.get_or_insert(start.elapsed());
                    in_a_row += 1;
                    if in_a_row == 3 {
                        return Ok((first.unwrap_or_default(), last));
                    }
                } else {
                    in_a_row = 0;
                }
            }
            // Refused while a webhook starts (failurePolicy Fail): not yet serving.
            Err(kube::Error::Api(e)) => {
                in_a_row = 0;
                last = Value::from(format!("refused: {}", e.message));
            }
            Err(e) => return Err(format!("dry-run create: {e}")),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = running
        .as_ref()
        .map(|r| {
            r.processes
                .iter()
                .map(|p| format!("{}:\n{}", p.name, p.log_tail(40)))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default();
    Err(format!(
        "{what}: not settled within {START_LIMIT:?}; last dry-run pod:\n{last}\n{logs}"
    ))
}

/// Creates pods at a fixed rate; the latencies, the stored pods (normalized, distinct) and the
/// three slowest creates as `#<index in the schedule> <ms>` (where the tail comes from).
async fn fixed_rate(
    pods: &Api<Pod>,
    pod: &Pod,
    n: usize,
    rate: f64,
) -> Result<(Vec<Duration>, Vec<Value>, String), String> {
    let start = tokio::time::Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let pods = pods.clone();
            let pod = pod.clone();
            let at = start + Duration::from_secs_f64(i as f64 / rate);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let t = Instant::now();
                let created = pods
                    .create(&PostParams::default(), &pod)
                    .await
                    .map_err(|e| format!("create: {e}"))?;
                Ok::<_, String>((t.elapsed(), normalized(&created)))
            })
        })
        .collect();
    let results: Vec<Result<(Duration, Value), String>> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.map_err(|e| format!("create task: {e}")).and_then(|r| r))
        .collect();
    let mut by_index: Vec<(usize, Duration)> = results
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_ref().ok().map(|(d, _)| (i, *d)))
        .collect();
    by_index.sort_by_key(|b| std::cmp::Reverse(b.1));
    let slowest = by_index
        .iter()
        .take(3)
        .map(|(i, d)| format!("#{i} {:.1}", ms(*d)))
        .collect::<Vec<_>>()
        .join(", ");
    let (latencies, stored) = collect(results.into_iter())?;
    Ok((latencies, stored, slowest))
}

fn collect(
    results: impl Iterator<Item = Result<(Duration, Value), String>>,
) -> Result<(Vec<Duration>, Vec<Value>), String> {
    let mut latencies = Vec::new();
    let mut stored: Vec<Value> = Vec::new();
    for r in results {
        let (d, p) = r?;
        latencies.push(d);
        if !stored.contains(&p) {
            stored.push(p);
        }
    }
    latencies.sort();
    Ok((latencies, stored))
}

/// Creates pods with `concurrency` in flight; latencies, stored pods, creates per second.
async fn saturated(
    pods: &Api<Pod>,
    pod: &Pod,
    n: usize,
    concurrency: usize,
) -> Result<(Vec<Duration>, Vec<Value>, f64), String> {
    let start = Instant::now();
    let results = futures::stream::iter(0..n)
        .map(|_| async {
            let t = Instant::now();
            let created = pods
                .create(&PostParams::default(), pod)
                .await
                .map_err(|e| format!("create: {e}"))?;
            Ok((t.elapsed(), normalized(&created)))
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<Result<(Duration, Value), String>>>()
        .await;
    let elapsed = start.elapsed();
    let (latencies, stored) = collect(results.into_iter())?;
    let rate = latencies.len() as f64 / elapsed.as_secs_f64();
    Ok((latencies, stored, rate))
}

/// meshgate's webhook's policy reviews so far (its `/metrics`).
async fn meshgate_reviews(addr: std::net::SocketAddr) -> f64 {
    let Some((_, text)) = http_get(addr, "/metrics").await else {
        return 0.0;
    };
    text.lines()
        .filter(|l| l.contains("reviews_total{") && l.contains("polic"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

fn spread(xs: &[f64]) -> (f64, f64) {
    (
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    )
}

/// The measures, each a figure of a round.
type Measure = (&'static str, fn(&Round) -> f64);

const MEASURES: [Measure; 9] = [
    ("create-p50-fixed", |r| ms(quantile(&r.fixed, 0.5))),
    ("create-p99-fixed", |r| ms(quantile(&r.fixed, 0.99))),
    ("create-p50-saturated", |r| ms(quantile(&r.saturated, 0.5))),
    ("create-p99-saturated", |r| ms(quantile(&r.saturated, 0.99))),
    ("creates-per-second-saturated", |r| r.saturated_rate),
    ("cpu-seconds-per-1000-creates", |r| r.cpu_per_1000),
    ("rss-steady-mib", |r| r.rss_mib),
    ("rss-peak-mib", |r| r.rss_peak_mib),
    ("cold-start-ms", |r| ms(r.cold_start)),
];

fn report(config: &str, rounds: &[BTreeMap<&'static str, Round>]) {
    for (name, f) in MEASURES {
        for peer in [Peer::Meshgate, Peer::MeshgateNative] {
            let ratios: Vec<f64> = rounds
                .iter()
                .map(|r| f(&r[peer.name()]) / f(&r["kyverno"]).max(1e-9))
                .collect();
            let (lo, hi) = spread(&ratios);
            println!(
                "RATIO {}/kyverno-{name}-{config}: {:.2} (spread {lo:.2}-{hi:.2}, {} rounds)",
                peer.name(),
                median(ratios.clone()),
                rounds.len()
            );
        }
        // `none` runs no process: only its latencies are figures.
        let process_measure = !name.starts_with("create");
        let values = Peer::ALL
            .iter()
            .filter(|p| !(process_measure && **p == Peer::None))
            .map(|p| {
                let v: Vec<f64> = rounds.iter().map(|r| f(&r[p.name()])).collect();
                format!("{} {:.2}", p.name(), median(v))
            })
            .collect::<Vec<_>>()
            .join(", ");
        println!("VALUE {name}-{config}: {values} (medians)");
    }
    let extra = |p: Peer, f: &dyn Fn(&Round) -> Option<f64>| -> String {
        let v: Vec<f64> = rounds.iter().filter_map(|r| f(&r[p.name()])).collect();
        if v.is_empty() {
            "-".into()
        } else {
            format!("{:.2}", median(v))
        }
    };
    println!(
        "VALUE apiserver-cpu-ms-per-create-{config}: {} (medians)",
        Peer::ALL
            .iter()
            .map(|p| format!(
                "{} {}",
                p.name(),
                extra(*p, &|r| Some(r.apiserver_ms_per_create))
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "VALUE webhook-reviews-per-create-{config}: meshgate {}, meshgate-native {} (its /metrics)",
        extra(Peer::Meshgate, &|r| r.reviews_per_create),
        extra(Peer::MeshgateNative, &|r| r.reviews_per_create)
    );
}

#[tokio::main]
async fn main() -> ExitCode {
    if !std::env::args().any(|a| a == "--bench") {
        return ExitCode::SUCCESS;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kyverno_peers: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), String> {
    let settings = Settings::from_env()?;
    let kyverno = kyverno_bin()?;
    let crds = kyverno_crds()?;
    let cp = ControlPlane::start(meshgate_testenv::Options::profiling(
        settings.profile.is_some(),
    ))
    .await
    .map_err(|e| format!("control plane: {e}"))?;
    let client = cp.client().await.map_err(|e| e.to_string())?;
    common::install_crds(&client).await;
    apply(&client, &crds)
        .await
        .map_err(|e| format!("Kyverno's CRDs: {e}"))?;
    for ns in [KYVERNO_NS, MESHGATE_NS, APPS] {
        apply(
            &client,
            &[json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})],
        )
        .await?;
    }
    let chart_config = repo_root().join("tools/bench/kyverno/chart-config.yaml");
    apply(
        &client,
        &meshgate::render::read_documents(&chart_config).map_err(|e| e.to_string())?,
    )
    .await
    .map_err(|e| format!("{}: {e}", chart_config.display()))?;
    let serving = meshgate_testenv::LoopbackServing::new()?;
    let (ca, cert, key) = (&serving.ca, serving.cert.clone(), serving.key.clone());
    let apiserver = cp.pids()[1];
    let bench = Bench {
        cp,
        client: client.clone(),
        kyverno,
        tls: (cert, key),
        ca_pem: ca.certificate().cert_pem.clone(),
        _serving: serving,
        apiserver,
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), APPS);
    let pod: Pod = {
        let mut v: Value = serde_json::from_str(POD).map_err(|e| e.to_string())?;
        v["metadata"]["namespace"] = Value::from(APPS);
        if let Some(meta) = v["metadata"].as_object_mut() {
            meta.remove("ownerReferences");
        }
        serde_json::from_value(v).map_err(|e| e.to_string())?
    };
    let bare = normalized(
        &pods
            .create(
                &PostParams {
                    dry_run: true,
                    ..Default::default()
                },
                &pod,
            )
            .await
            .map_err(|e| format!("dry-run create: {e}"))?,
    );
    let kyverno_policies =
        meshgate_testenv::api_resource("kyverno.io", "v1", "ClusterPolicy", "clusterpolicies");
    let mutation_policies = meshgate_testenv::api_resource(
        "meshgate.dev",
        "v1alpha1",
        "MutationPolicy",
        "mutationpolicies",
    );
    println!(
        "VALUE kyverno: {} (admission controller, out of cluster); pods {} at {}/s, then {} with {} in flight; {} rounds",
        bench
            .kyverno
            .parent()
            .and_then(Path::file_name)
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_default(),
        settings.fixed_pods,
        settings.rate,
        settings.pods,
        settings.concurrency,
        settings.rounds
    );
    for config in &settings.configs {
        let files = policy_files(config)?;
        let mut kyverno_docs = Vec::new();
        let mut meshgate_docs = Vec::new();
        for f in &files {
            kyverno_docs.extend(meshgate::render::read_documents(f).map_err(|e| e.to_string())?);
            meshgate_docs.extend(import(f)?);
        }
        apply(&client, &kyverno_docs).await?;
        apply(&client, &meshgate_docs).await?;
        println!(
            "{config}: {} Kyverno policies ({} files), {} MutationPolicies imported",
            kyverno_docs.len(),
            files.len(),
            meshgate_docs.len()
        );
        // The pod every peer must store, from the first that served the policies.
        let mut reference: Option<(Peer, Value)> = None;
        let mut rounds = Vec::new();
        for r in 0..settings.rounds {
            let mut figures = BTreeMap::new();
            for step in 0..Peer::ALL.len() {
                let peer = Peer::ALL[(r + step) % Peer::ALL.len()];
                let spawned = Instant::now();
                let mut running = match peer {
                    Peer::None => None,
                    Peer::Kyverno => Some(bench.start_kyverno()),
                    Peer::Meshgate => Some(bench.start_meshgate(false).await?),
                    Peer::MeshgateNative => Some(bench.start_meshgate(true).await?),
                };
                let what = format!("round {}, {config}, {}", r + 1, peer.name());
                // From the spawn to the first pod returned mutated: the cold start.
                let (to_first, expected) = if peer == Peer::None {
                    settle(&pods, &pod, |p| *p == bare, &mut running, spawned, &what).await?
                } else {
                    settle(&pods, &pod, |p| *p != bare, &mut running, spawned, &what).await?
                };
                let cold_start = to_first;
                if peer != Peer::None {
                    match &reference {
                        None => reference = Some((peer, expected.clone())),
                        Some((by, want)) if *want != expected => {
                            return Err(format!(
                                "{what}: the pod differs from {}'s:\n  {}",
                                by.name(),
                                diff(want, &expected)
                            ));
                        }
                        Some(_) => {}
                    }
                }
                let pids = running.as_ref().map(Running::pids).unwrap_or_default();
                let reviews_before = match running.as_ref().and_then(|r| r.metrics) {
                    Some(a) => Some(meshgate_reviews(a).await),
                    None => None,
                };
                let (cpu_before, api_before) =
                    (cpu_seconds(&pids), cpu_seconds(&[bench.apiserver]));
                let (fixed, stored_fixed, slowest) =
                    fixed_rate(&pods, &pod, settings.fixed_pods, settings.rate).await?;
                let profile = async {
                    match &settings.profile {
                        Some((dir, seconds)) if r == 0 => {
                            let bytes =
                                meshgate_testenv::measure::apiserver_cpu_profile(&client, *seconds)
                                    .await?;
                            let path = dir.join(format!("{config}-{}.pprof", peer.name()));
                            std::fs::write(&path, bytes)
                                .map_err(|e| format!("{}: {e}", path.display()))
                        }
                        _ => Ok(()),
                    }
                };
                let (saturation, profiled) = futures::join!(
                    saturated(&pods, &pod, settings.pods, settings.concurrency),
                    profile
                );
                profiled?;
                let (sat, stored_sat, sat_rate) = saturation?;
                let creates = (fixed.len() + sat.len()) as f64;
                let cpu = cpu_seconds(&pids) - cpu_before;
                let api = cpu_seconds(&[bench.apiserver]) - api_before;
                let reviews = match (running.as_ref().and_then(|r| r.metrics), reviews_before) {
                    (Some(a), Some(before)) => Some((meshgate_reviews(a).await - before) / creates),
                    _ => None,
                };
                let figure = Round {
                    cold_start,
                    fixed,
                    saturated: sat,
                    saturated_rate: sat_rate,
                    cpu_per_1000: cpu / creates * 1000.0,
                    apiserver_ms_per_create: api / creates * 1e3,
                    rss_mib: rss_mib(&pids, "VmRSS:"),
                    rss_peak_mib: rss_mib(&pids, "VmHWM:"),
                    reviews_per_create: reviews,
                };
                if let Some(r) = running.as_mut() {
                    r.assert_running();
                }
                for p in stored_fixed.iter().chain(&stored_sat) {
                    if *p != expected {
                        return Err(format!(
                            "{what}: a stored pod differs from the dry-run's:\n  {}",
                            diff(&expected, p)
                        ));
                    }
                }
                println!(
                    "{:<6} {:<9} {:<16} start {:>7.0} ms  fixed p50 {:>6.1} p99 {:>6.1} ms  saturated p50 {:>6.1} p99 {:>6.1} ms {:>5.0}/s  cpu {:>6.2} s/1000  rss {:>6.1} MiB (peak {:>6.1})  apiserver {:>5.2} ms/create  slowest fixed: {slowest} ms",
                    r + 1,
                    config,
                    peer.name(),
                    ms(figure.cold_start),
                    ms(quantile(&figure.fixed, 0.5)),
                    ms(quantile(&figure.fixed, 0.99)),
                    ms(quantile(&figure.saturated, 0.5)),
                    ms(quantile(&figure.saturated, 0.99)),
                    figure.saturated_rate,
                    figure.cpu_per_1000,
                    figure.rss_mib,
                    figure.rss_peak_mib,
                    figure.apiserver_ms_per_create,
                );
                pods.delete_collection(&DeleteParams::default(), &ListParams::default())
                    .await
                    .map_err(|e| format!("delete pods: {e}"))?;
                bench.stop(peer, running).await?;
                let mut none = None;
                let after = format!("{what}: after stop");
                settle(
                    &pods,
                    &pod,
                    |p| *p == bare,
                    &mut none,
                    Instant::now(),
                    &after,
                )
                .await?;
                figures.insert(peer.name(), figure);
            }
            rounds.push(figures);
        }
        report(config, &rounds);
        delete_named(&client, &kyverno_policies, None, "").await?;
        delete_named(&client, &mutation_policies, None, "").await?;
    }
    Ok(())
}

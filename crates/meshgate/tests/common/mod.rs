//! Shared pieces of the end-to-end tests: the real control plane, meshgate's webhook serving
//! over TLS with a CA made here, its registration, and waiting.
#![allow(dead_code)]

pub mod cluster;
pub mod istio;
pub mod karpenter;
pub mod kyverno_cases;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use meshgate_api::GateConfig;
use meshgate_core::registration::{Registration, WebhookTarget, webhook_configuration};
use meshgate_testenv::{ControlPlane, Options};

/// A runtime that outlives every test: servers shared by the tests of a binary run here, since
/// each `#[tokio::test]` has a runtime of its own that ends with the test.
pub fn background() -> tokio::runtime::Handle {
    static RT: OnceLock<tokio::runtime::Handle> = OnceLock::new();
    RT.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("background runtime");
            let _ = tx.send(rt.handle().clone());
            rt.block_on(futures::future::pending::<()>());
        });
        rx.recv().expect("background runtime handle")
    })
    .clone()
}

pub async fn control_plane(scheduler: bool) -> Arc<ControlPlane> {
    meshgate_testenv::shared(Options {
        scheduler,
        ..Options::default()
    })
    .await
    .expect("control plane starts")
}

/// Applies meshgate's CRDs (server-side apply) and waits until they are established.
pub async fn install_crds(client: &Client) {
    let crds = meshgate::install::crd_documents().expect("crds render");
    meshgate::install::apply(client, &crds, false, |_| {})
        .await
        .expect("crds applied");
}

/// A running webhook and what the API server needs to call it.
pub struct Webhook {
    pub server: meshgate_webhook::Server,
    pub ca: meshgate_pki::Ca,
    pub url: String,
    pub health: String,
    pub dir: tempfile::TempDir,
}

impl Webhook {
    /// The registration for this webhook with `config`.
    pub fn registration<'a>(
        &'a self,
        name: &'a str,
        config: &'a GateConfig,
        policies: bool,
        node_taint: bool,
    ) -> serde_json::Value {
        self.registration_with(name, config, policies, node_taint, None)
    }

    /// The registration with the native gate installed: the native clauses' webhook entries are
    /// called for the `routes` namespaces only.
    #[allow(dead_code)]
    pub fn registration_native<'a>(
        &'a self,
        name: &'a str,
        config: &'a GateConfig,
        routes: &'a meshgate_core::native_gate::Routes,
    ) -> serde_json::Value {
        self.registration_with(name, config, true, false, Some(routes))
    }

    fn registration_with<'a>(
        &'a self,
        name: &'a str,
        config: &'a GateConfig,
        policies: bool,
        node_taint: bool,
        native_gate: Option<&'a meshgate_core::native_gate::Routes>,
    ) -> serde_json::Value {
        webhook_configuration(&Registration {
            name,
            config,
            target: WebhookTarget::Url(self.url.clone()),
            ca_bundle_pem: &self.ca.certificate().cert_pem,
            policies,
            node_taint,
            native_gate,
        })
    }

    /// Pod-gate reviews the webhook answered so far (its `/metrics`), with this outcome
    /// (`mutated`, ...) or all.
    #[allow(dead_code)]
    pub async fn pod_gate_reviews(&self, outcome: Option<&str>) -> u64 {
        let addr = self.health.parse().expect("health address");
        let (_, body) = http_get(addr, "/metrics").await.expect("metrics");
        let outcome = outcome.map(|o| format!("outcome=\"{o}\""));
        body.lines()
            .filter(|l| l.starts_with("meshgate_webhook_reviews_total{") && l.contains("pod-gate"))
            .filter(|l| outcome.as_ref().is_none_or(|o| l.contains(o.as_str())))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }
}

impl Webhook {
    /// The webhook's `meshgate_webhook_policy_failures_total` (its `/metrics`), summed over the
    /// policies named.
    pub async fn policy_failures(&self, policies: &[&str]) -> f64 {
        let addr = self.health.parse().expect("health address");
        let (_, body) = http_get(addr, "/metrics").await.expect("metrics");
        body.lines()
            .filter(|l| l.starts_with("meshgate_webhook_policy_failures_total{"))
            .filter(|l| {
                policies
                    .iter()
                    .any(|p| l.contains(&format!("policy=\"{p}\"")))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// Starts meshgate's webhook on loopback with a serving certificate from a fresh CA. It runs on
/// the background runtime, so it lives as long as the test binary.
pub async fn start_webhook(cp: &ControlPlane, config: GateConfig) -> Webhook {
    start_webhook_as(cp, config, None).await
}

/// [`start_webhook`], as the ServiceAccount `meshgate-webhook` of `namespace` when given
/// (impersonated: the RBAC `install` renders applies).
pub async fn start_webhook_as(
    cp: &ControlPlane,
    config: GateConfig,
    namespace: Option<&str>,
) -> Webhook {
    let (ca, dir, cert, key) = serving_certificate();
    let kubeconfig = cp.kubeconfig_path.clone();
    let settings = meshgate::run::WebhookSettings {
        config,
        addr: "127.0.0.1:0".parse().expect("addr"),
        health_addr: "127.0.0.1:0".parse().expect("addr"),
        cert,
        key,
        cert_poll_interval: Duration::from_millis(200),
        request_timeout: Duration::from_secs(10),
        max_in_flight: meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT,
    };
    let namespace = namespace.map(str::to_owned);
    let server = background()
        .spawn(async move {
            let client = match namespace {
                Some(ns) => client_as_service_account(&kubeconfig, &ns, "meshgate-webhook").await,
                None => client_from(&kubeconfig).await,
            };
            meshgate::run::start_webhook(client, settings)
                .await
                .expect("webhook starts")
        })
        .await
        .expect("webhook task");
    Webhook::new(server, ca, dir)
}

/// A CA and a serving certificate for loopback, written as `tls.crt` and `tls.key` in a new
/// directory.
fn serving_certificate() -> (
    meshgate_pki::Ca,
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = meshgate_pki::Ca::new("meshgate-e2e-ca", Duration::from_secs(3600)).expect("ca");
    let serving = ca
        .issue_server(&["127.0.0.1", "localhost"], Duration::from_secs(3600))
        .expect("cert");
    let dir = tempfile::tempdir().expect("tempdir");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &serving.cert_pem).expect("write cert");
    std::fs::write(&key, &serving.key_pem).expect("write key");
    (ca, dir, cert, key)
}

impl Webhook {
    fn new(server: meshgate_webhook::Server, ca: meshgate_pki::Ca, dir: tempfile::TempDir) -> Self {
        let url = format!("https://127.0.0.1:{}", server.addr.port());
        let health = format!("127.0.0.1:{}", server.health_addr.port());
        Webhook {
            server,
            ca,
            url,
            health,
            dir,
        }
    }
}

/// [`start_webhook_as`] the `meshgate-webhook` ServiceAccount of `namespace`, with its watches
/// never started: nothing is cached (a namespace watch cut from the start).
#[allow(dead_code)]
pub async fn start_webhook_with_cut_watches(
    cp: &ControlPlane,
    config: GateConfig,
    namespace: &str,
) -> Webhook {
    let (ca, dir, cert, key) = serving_certificate();
    let kubeconfig = cp.kubeconfig_path.clone();
    let namespace = namespace.to_owned();
    let server = background()
        .spawn(async move {
            let client =
                client_as_service_account(&kubeconfig, &namespace, "meshgate-webhook").await;
            // The watches' driver is dropped, never run.
            let (sources, _drive) = meshgate_webhook::Sources::watch(client);
            let app = meshgate_webhook::App::new(
                config,
                sources,
                meshgate_webhook::metrics::Metrics::new(),
            );
            meshgate_webhook::Server::start(
                meshgate_webhook::ServerOptions {
                    addr: "127.0.0.1:0".parse().expect("addr"),
                    health_addr: "127.0.0.1:0".parse().expect("addr"),
                    certs: meshgate_webhook::tls::CertFiles { cert, key },
                    cert_poll_interval: Duration::from_secs(5),
                    request_timeout: meshgate_core::registration::server_timeout(5),
                    max_in_flight: meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT,
                    shutdown_grace: Duration::from_secs(5),
                },
                app,
            )
            .await
            .expect("webhook starts")
        })
        .await
        .expect("webhook task");
    Webhook::new(server, ca, dir)
}

/// The webhook's configuration for the policy path alone: no init gate.
pub fn policies_only_config() -> GateConfig {
    GateConfig {
        init_gate: meshgate_api::config::InitGate {
            enabled: false,
            ..Default::default()
        },
        ..GateConfig::default()
    }
}

/// The name of the `MutatingWebhookConfiguration` that [`serve_policies`] registers.
pub const POLICIES_CONFIGURATION: &str = "meshgate-policies";

/// meshgate's webhook registered for the policy path only (no profiles, no init gate), and the
/// controller (policy backfill, and the policies webhook's rules kept in line with the kinds the
/// policies name), once per test binary, for its life.
pub async fn serve_policies(cp: &ControlPlane) {
    static READY: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    let client = cp.client().await.expect("client");
    READY
        .get_or_init(|| async {
            install_crds(&client).await;
            let config = policies_only_config();
            let webhook = start_webhook(cp, config.clone()).await;
            let mwc = webhook.registration(POLICIES_CONFIGURATION, &config, true, false);
            let hooks = mwc["webhooks"].as_array().expect("webhooks");
            assert_eq!(hooks.len(), 1, "{mwc:#}");
            assert!(
                hooks[0]["clientConfig"]["url"]
                    .as_str()
                    .is_some_and(|u| u.ends_with("/mutate/policies")),
                "{mwc:#}"
            );
            register(&client, &mwc).await;
            let kubeconfig = cp.kubeconfig_path.clone();
            background().spawn(async move {
                let client = client_from(&kubeconfig).await;
                let settings = meshgate::run::ControllerSettings {
                    policy_webhook: Some(POLICIES_CONFIGURATION.into()),
                    ..Default::default()
                };
                if let Err(e) = meshgate::run::run_controller(
                    client,
                    settings,
                    futures::future::pending::<()>(),
                )
                .await
                {
                    panic!("controller failed: {e}");
                }
            });
            // Keep the webhook for the life of the binary.
            std::mem::forget(webhook);
        })
        .await;
}

/// Waits (60 s at most) until the cluster-wide MutationPolicy `name` has a status that `done`
/// accepts (what the controller reported), and returns it.
pub async fn wait_for_policy_status(
    client: &Client,
    name: &str,
    what: &str,
    done: impl Fn(&meshgate_api::MutationPolicyStatus) -> bool,
) -> meshgate_api::MutationPolicyStatus {
    let policies: Api<meshgate_api::MutationPolicy> = Api::all(client.clone());
    let read = || async {
        policies
            .get(name)
            .await
            .ok()
            .and_then(|p| p.status)
            .filter(|s| done(s))
    };
    wait_for(what, Duration::from_secs(60), || async {
        read().await.is_some()
    })
    .await;
    read().await.expect("the status just seen")
}

/// A client built from a kubeconfig file (for the background runtime).
pub async fn client_from(kubeconfig: &std::path::Path) -> Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .expect("config");
    Client::try_from(config).expect("client")
}

/// Creates or replaces a MutatingWebhookConfiguration.
pub async fn register(client: &Client, mwc: &serde_json::Value) {
    let mwc: MutatingWebhookConfiguration = serde_json::from_value(mwc.clone()).expect("mwc");
    let name = mwc.metadata.name.clone().expect("name");
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .patch(
            &name,
            &PatchParams::apply("meshgate-test").force(),
            &Patch::Apply(&mwc),
        )
        .await
        .expect("webhook registered");
}

#[allow(unused_imports)]
pub use meshgate_testenv::wait_for;

/// Waits until a dry-run Node create comes back carrying the taint `key` (`want`) or not: the
/// API server's admission policies (the node taint at registration) follow their objects
/// asynchronously.
#[allow(dead_code)]
pub async fn wait_registration_taint(client: &Client, key: &str, want: bool) {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let mut n = 0;
    wait_for(
        &format!(
            "{key} at registration to be {}",
            if want { "on" } else { "off" }
        ),
        Duration::from_secs(30),
        || {
            n += 1;
            let nodes = nodes.clone();
            async move {
                let probe = serde_json::from_value(
                    serde_json::json!({"metadata": {"name": format!("probe-{n}")}}),
                )
                .expect("node");
                let dry = kube::api::PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                nodes.create(&dry, &probe).await.ok().is_some_and(|n| {
                    let tainted = n
                        .spec
                        .and_then(|s| s.taints)
                        .is_some_and(|ts| ts.iter().any(|t| t.key == key));
                    tainted == want
                })
            }
        },
    )
    .await;
}

/// Dry-run creates probe pods in `pods`' namespace until what the API server returns satisfies
/// `done`: webhook registrations and the webhook's caches take effect asynchronously.
#[allow(dead_code)]
pub async fn probe_until(
    pods: &Api<k8s_openapi::api::core::v1::Pod>,
    what: &str,
    limit: Duration,
    done: impl Fn(&k8s_openapi::api::core::v1::Pod) -> bool,
) {
    let done = &done;
    let mut n = 0;
    wait_for(what, limit, || {
        n += 1;
        let pods = pods.clone();
        async move {
            let p = serde_json::from_value(pod(&format!("probe-{n}"))).expect("probe pod");
            let dry = kube::api::PostParams {
                dry_run: true,
                ..Default::default()
            };
            pods.create(&dry, &p).await.ok().is_some_and(|p| done(&p))
        }
    })
    .await;
}

/// A minimal pod.
pub fn pod(name: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    })
}

/// The `meshgate` binary built for these tests.
pub fn meshgate_bin() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_meshgate"))
}

/// Runs the `meshgate` CLI against the control plane (`--kubeconfig` appended).
pub fn meshgate_on(cp: &ControlPlane, args: &[&str]) -> std::process::Output {
    std::process::Command::new(meshgate_bin())
        .args(args)
        .arg("--kubeconfig")
        .arg(&cp.kubeconfig_path)
        .output()
        .expect("meshgate runs")
}

/// `meshgate install --profile PROFILE --namespace NS --apply` against the control plane;
/// panics with its output when it fails.
pub fn install_applied(cp: &ControlPlane, profile: &str, namespace: &str) -> String {
    let out = meshgate_on(
        cp,
        &[
            "install",
            "--profile",
            profile,
            "--namespace",
            namespace,
            "--apply",
        ],
    );
    assert!(
        out.status.success(),
        "install: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The keys of a node's taints.
pub fn taint_keys(node: &k8s_openapi::api::core::v1::Node) -> Vec<String> {
    node.spec
        .iter()
        .flat_map(|s| s.taints.iter().flatten())
        .map(|t| t.key.clone())
        .collect()
}

/// A child process of a test (e.g. `meshgate webhook`), its stdout and stderr in a log file.
///
/// It cannot outlive the test: it is started through `setpriv --pdeathsig KILL` (when present)
/// from the calling thread, so the kernel kills it when that thread ends. Start it from the
/// test's own body (a `#[tokio::test]` runs it on the test's thread, which ends with the test),
/// not from a blocking-pool thread, which may end earlier. Dropping it kills it sooner.
pub struct ChildProcess {
    pub name: String,
    child: std::process::Child,
    pub log: std::path::PathBuf,
}

impl ChildProcess {
    /// Starts `program args…` with `env` added to the environment.
    pub fn spawn(
        name: &str,
        program: &std::path::Path,
        args: &[String],
        env: &[(&str, &std::ffi::OsStr)],
        log: &std::path::Path,
    ) -> Self {
        let out = std::fs::File::options()
            .create(true)
            .append(true)
            .open(log)
            .expect("child log file");
        let err = out.try_clone().expect("child log handle");
        let mut cmd = if std::path::Path::new("/usr/bin/setpriv").exists() {
            let mut c = std::process::Command::new("/usr/bin/setpriv");
            c.arg("--pdeathsig").arg("KILL").arg("--").arg(program);
            c
        } else {
            std::process::Command::new(program)
        };
        cmd.args(args)
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::from(out))
            .stderr(std::process::Stdio::from(err));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name} ({}): {e}", program.display()));
        Self {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (a name such as `TERM` or `KILL`) with kill(1).
    pub fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .arg("-s")
            .arg(signal)
            .arg(self.pid().to_string())
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -s {signal} {}: {status}", self.name);
    }

    /// The exit status, if the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("waiting for a child")
    }

    /// Waits (at most `timeout`) for the process to exit.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Panics with the log's tail if the process has exited.
    pub fn assert_running(&mut self) {
        if let Some(status) = self.exited() {
            panic!(
                "{} exited ({status}); last lines of its log:\n{}",
                self.name,
                self.log_tail(40)
            );
        }
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 GET on loopback: the status code and the body, or `None` if the server could
/// not be reached or did not answer within 10 s.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok()?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n")?;
        let code = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((code, body.to_owned()))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .ok()
        .flatten()
}

/// The value of the sample starting with `prefix` (e.g. `"name_total "`) in a metrics text.
pub fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// A test webhook server over TLS on loopback, with a CA of its own: `router` answers the
/// reviews. Returns the base URL, the CA's PEM (the registration's caBundle) and the server task.
pub async fn serve_test_webhook(
    router: axum::Router,
) -> (String, String, tokio::task::JoinHandle<std::io::Result<()>>) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = meshgate_pki::Ca::new("test-webhook-ca", Duration::from_secs(3600)).expect("ca");
    let serving = ca
        .issue_server(&["127.0.0.1"], Duration::from_secs(3600))
        .expect("cert");
    let tls = axum_server::tls_rustls::RustlsConfig::from_pem(
        serving.cert_pem.into_bytes(),
        serving.key_pem.into_bytes(),
    )
    .await
    .expect("tls config");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = background().spawn(async move {
        axum_server::from_tcp_rustls(listener, tls)?
            .serve(router.into_make_service())
            .await
    });
    (
        format!("https://127.0.0.1:{port}"),
        ca.certificate().cert_pem.clone(),
        server,
    )
}

/// An AdmissionReview answer allowing the object with a JSON patch.
pub fn review_patch(review: &serde_json::Value, ops: &serde_json::Value) -> serde_json::Value {
    let patch = serde_json::to_vec(ops).unwrap_or_default();
    serde_json::json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "response": {"uid": review["request"]["uid"], "allowed": true,
                     "patchType": "JSONPatch", "patch": k8s_openapi::ByteString(patch)}})
}

/// A client that acts as meshgate's `component` ServiceAccount (`meshgate-webhook`,
/// `meshgate-controller`) in `namespace`: the admin client impersonates it, so the API server
/// authorizes every request against the RBAC that `meshgate install` renders.
pub async fn client_as_service_account(
    kubeconfig: &std::path::Path,
    namespace: &str,
    service_account: &str,
) -> Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let mut config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .expect("config");
    config.auth_info.impersonate = Some(format!(
        "system:serviceaccount:{namespace}:{service_account}"
    ));
    config.auth_info.impersonate_groups = Some(vec![
        "system:serviceaccounts".into(),
        format!("system:serviceaccounts:{namespace}"),
        "system:authenticated".into(),
    ]);
    Client::try_from(config).expect("client")
}

/// Applies, for real, the namespace, ServiceAccounts and RBAC that `meshgate install` renders for
/// `profile` in `namespace`: the identities the components run as.
pub async fn install_identities(client: &Client, profile: &str, namespace: &str) {
    install_identities_with(client, profile, namespace, None).await;
}

/// [`install_identities`] for an install with the repair loop (`--repair label|delete`).
pub async fn install_identities_with(
    client: &Client,
    profile: &str,
    namespace: &str,
    repair: Option<meshgate::install::RepairAction>,
) {
    install_identities_of(
        client,
        &meshgate::install::InstallOptions {
            repair,
            ..install_options(profile, namespace)
        },
    )
    .await;
}

/// Applies meshgate's CRDs, then `docs` (an install's rendering) but its Deployments, as the
/// admin: the test runs the components itself, as their ServiceAccounts.
pub async fn apply_but_deployments(admin: &Client, docs: Vec<serde_json::Value>) {
    let applied: Vec<serde_json::Value> = docs
        .into_iter()
        .filter(|d| d["kind"] != "Deployment")
        .collect();
    let crds = meshgate::install::crd_documents().expect("crds");
    meshgate::install::apply(admin, &crds, false, |_| {})
        .await
        .expect("crds");
    meshgate::install::apply(admin, &applied, false, |_| {})
        .await
        .expect("install applied");
}

/// `meshgate install`'s options for the tests: `profile` in `namespace`, the webhook paths, no
/// repair loop and no grants beyond the defaults.
pub fn install_options(profile: &str, namespace: &str) -> meshgate::install::InstallOptions {
    meshgate::install::InstallOptions {
        profile: profile.into(),
        namespace: namespace.into(),
        image: "meshgate/meshgate:test".into(),
        node_taint: meshgate::install::NodeTaint::Webhook,
        pod_gate: meshgate::install::PodGate::Webhook,
        strategy: meshgate::install::Strategy::Pod,
        taint_key: meshgate_api::names::STARTUP_TAINT_KEY.into(),
        node_paths: Default::default(),
        repair: None,
        webhook_ingress_from: Vec::new(),
        context_config_maps: Vec::new(),
        context_api_reads: Vec::new(),
        existing_kinds: Vec::new(),
        policies: Default::default(),
    }
}

/// [`install_identities`] for any install options.
pub async fn install_identities_of(client: &Client, options: &meshgate::install::InstallOptions) {
    let docs = meshgate::install::render(options).expect("install renders");
    let identities: Vec<serde_json::Value> = docs
        .into_iter()
        .filter(|d| {
            [
                "Namespace",
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Role",
                "RoleBinding",
            ]
            .contains(&d["kind"].as_str().unwrap_or_default())
        })
        .collect();
    meshgate::install::apply(client, &identities, false, |_| {})
        .await
        .expect("identities applied");
}

/// A node gate controller replica running on the background runtime, leader-elected on a
/// Lease; `stop` ends it (so does dropping it).
pub struct Replica {
    pub identity: String,
    pub metrics: meshgate_controller::Metrics,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Replica {
    /// Starts a replica. `service_account`: run as meshgate's controller ServiceAccount in that
    /// namespace (its installed RBAC), else as the admin.
    pub async fn start(
        kubeconfig: std::path::PathBuf,
        lease: meshgate_controller::leader::LeaseSettings,
        status_interval: Duration,
        service_account: Option<&str>,
    ) -> Self {
        let settings = meshgate_controller::nodegate::Settings {
            status_interval,
            ..Default::default()
        };
        Self::start_with(kubeconfig, lease, settings, service_account).await
    }

    /// [`Replica::start`] with the node gate's settings.
    pub async fn start_with(
        kubeconfig: std::path::PathBuf,
        lease: meshgate_controller::leader::LeaseSettings,
        settings: meshgate_controller::nodegate::Settings,
        service_account: Option<&str>,
    ) -> Self {
        let metrics = meshgate_controller::Metrics::new();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let m = metrics.clone();
        let identity = lease.identity.clone();
        let sa = service_account.map(str::to_owned);
        background().spawn(async move {
            let client = match sa {
                Some(ns) => {
                    client_as_service_account(&kubeconfig, &ns, "meshgate-controller").await
                }
                None => client_from(&kubeconfig).await,
            };
            let leader = meshgate_controller::leader::elect(client.clone(), lease)
                .await
                .expect("lease manager");
            meshgate_controller::nodegate::run(client, leader, m, settings, async move {
                let _ = stopped.await;
            })
            .await;
        });
        Self {
            identity,
            metrics,
            stop: Some(stop),
        }
    }

    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.stop();
    }
}

/// meshgate's whole controller (`meshgate::run::run_controller`) on the background runtime, as
/// the ServiceAccount `meshgate-controller` of `namespace` (impersonated: the RBAC `install`
/// renders applies), until [`ControllerTask::finish`].
pub struct ControllerTask {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<Result<(), meshgate_controller::run::RunError>>>,
}

impl ControllerTask {
    pub fn start(
        cp: &ControlPlane,
        namespace: &str,
        settings: meshgate::run::ControllerSettings,
    ) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let kubeconfig = cp.kubeconfig_path.clone();
        let namespace = namespace.to_owned();
        let handle = background().spawn(async move {
            let client =
                client_as_service_account(&kubeconfig, &namespace, "meshgate-controller").await;
            meshgate::run::run_controller(client, settings, async move {
                let _ = stopped.await;
            })
            .await
        });
        Self {
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    /// Stops the controller; it must have run without error.
    pub async fn finish(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(handle) = self.handle.take() {
            let result = handle.await.expect("controller task");
            assert!(result.is_ok(), "controller: {result:?}");
        }
    }
}

impl Drop for ControllerTask {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Waits for an Event with this reason, about the object named `regarding` when given (any
/// namespace: Events about cluster-scoped objects go to `default`); returns its note. Events
/// are recorded off the path that decided them, so they are waited for, never read once.
pub async fn wait_for_event(
    client: &kube::Client,
    regarding: Option<&str>,
    reason: &str,
) -> String {
    let api: kube::api::Api<k8s_openapi::api::events::v1::Event> =
        kube::api::Api::all(client.clone());
    let find = |api: kube::api::Api<k8s_openapi::api::events::v1::Event>| async move {
        api.list(&kube::api::ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some(reason)
                    && regarding.is_none_or(|name| {
                        e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                    })
            })
            .map(|e| e.note.unwrap_or_default())
    };
    wait_for(
        &format!(
            "an Event {reason} about {}",
            regarding.unwrap_or("anything")
        ),
        Duration::from_secs(30),
        || {
            let api = api.clone();
            async move { find(api).await.is_some() }
        },
    )
    .await;
    find(api).await.expect("the Event just seen")
}

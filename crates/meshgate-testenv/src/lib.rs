//! A real Kubernetes control plane on loopback: etcd, kube-apiserver and, on request,
//! kube-scheduler, built from source by `tools/controlplane/build.sh`.
//!
//! * [`ControlPlane::start`] starts a private one (free ports, a temporary directory).
//! * [`shared`] gives every test of a test binary the same one; tests isolate themselves with
//!   [`ControlPlane::namespace`].
//!
//! The API server authenticates an admin by a client certificate in `system:masters`, authorizes
//! with RBAC, signs service-account tokens with a generated key, and runs without the
//! `ServiceAccount` admission plugin (there is no controller manager to create accounts) unless
//! [`Options::serve_pods`] asks for a control plane that pods of a real node use as their
//! cluster's API server.
//!
//! [`node::RealNode`] adds one real node to a control plane: containerd, kubelet,
//! kube-controller-manager (and kube-proxy on request), with images written by [`image`] and the
//! host restored afterwards by [`host`].
//!
//! No process outlives the test binary: every child is started through `setpriv --pdeathsig KILL`
//! from one supervisor thread that lives as long as the process, so the kernel kills the children
//! when the process ends, whether the tests passed, panicked or were interrupted. [`Drop`] stops a
//! private control plane early.

pub mod host;
pub mod image;
pub mod istio;
pub mod karpenter;
pub mod measure;
pub mod node;
mod process;
mod secret_dir;

pub use secret_dir::SecretDir;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tokio::sync::OnceCell;

pub use process::Process;

/// Errors of the test environment, each naming what failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("build failed ({script}): {message}")]
    Build { script: String, message: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("certificates: {0}")]
    Pki(#[from] meshgate_pki::PkiError),
    #[error("{name} did not become ready within {waited:?}; last lines of its log:\n{log}")]
    NotReady {
        name: &'static str,
        waited: Duration,
        log: String,
    },
    #[error("{name} exited early ({status}); last lines of its log:\n{log}")]
    Exited {
        name: &'static str,
        status: String,
        log: String,
    },
    #[error("kube client: {0}")]
    Kube(#[from] kube::Error),
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
    /// The host lacks what a real node needs (root, binaries, packages): each item says what.
    #[error("this host cannot run a real node: {}", .0.join("; "))]
    NodeUnsupported(Vec<String>),
    #[error("real node: {0}")]
    Node(String),
    #[error("helm {args}: {output}")]
    Helm { args: String, output: String },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// The Kubernetes minor of the control-plane binaries in `bin` (`kube-apiserver --version`:
/// `Kubernetes v1.34.4` is 34).
pub fn kube_minor(bin: &Path) -> Result<u32, Error> {
    let out = std::process::Command::new(bin.join("kube-apiserver"))
        .arg("--version")
        .output()
        .map_err(io("running kube-apiserver --version"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .last()
        .and_then(|v| v.trim_start_matches('v').split('.').nth(1)?.parse().ok())
        .ok_or_else(|| Error::Build {
            script: "kube-apiserver --version".into(),
            message: format!("no version in {text:?}"),
        })
}

/// The first minor that runs the MutatingAdmissionPolicy API by default (v1, GA).
pub const POLICY_API_GA_MINOR: u32 = 36;

/// Where the control-plane binaries are: `MESHGATE_CONTROLPLANE_BIN`, else what
/// `tools/controlplane/build.sh` prints (it builds once and caches outside the repository).
pub fn binaries() -> Result<PathBuf, Error> {
    built("MESHGATE_CONTROLPLANE_BIN", "tools/controlplane/build.sh")
}

/// Helm: `MESHGATE_HELM`, else what `tools/helm/build.sh` prints (it builds once, cached).
pub fn helm() -> Result<PathBuf, Error> {
    built("MESHGATE_HELM", "tools/helm/build.sh")
}

/// The checkout this process works in (the directory holding `Cargo.lock` and `tools/`): found
/// from `CARGO_MANIFEST_DIR` as Cargo sets it when it runs a test, bench or binary, else from
/// the working directory, else the checkout this crate was compiled in. The compile-time path
/// comes last: a build directory shared between clones (tools/test.sh keeps it in the cache)
/// reuses artifacts compiled in another clone, whose path may be gone.
pub fn workspace_dir() -> PathBuf {
    let is_root = |d: &Path| d.join("Cargo.lock").is_file() && d.join("tools").is_dir();
    let runtime = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from);
    let cwd = std::env::current_dir().ok();
    runtime
        .iter()
        .chain(cwd.iter())
        .flat_map(|d| d.ancestors())
        .find(|d| is_root(d))
        .map(Path::to_path_buf)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// A tool the repository's scripts build once and cache: the path in `env` when set, else
/// what `script` (relative to the repository) prints on stdout; its progress goes to stderr.
pub fn built(env: &str, script: &str) -> Result<PathBuf, Error> {
    built_logged(env, script, None)
}

/// [`built`], with the script's progress appended to `log` when given (the demo keeps it out
/// of its story).
pub fn built_logged(env: &str, script: &str, log: Option<&Path>) -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os(env) {
        return Ok(PathBuf::from(dir));
    }
    let script = workspace_dir().join(script);
    let stderr = match log {
        Some(log) => std::process::Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(io(format!("opening {}", log.display())))?,
        ),
        None => std::process::Stdio::inherit(),
    };
    let out = std::process::Command::new("bash")
        .arg(&script)
        .stderr(stderr)
        .output()
        .map_err(io(format!("running {}", script.display())))?;
    if !out.status.success() {
        return Err(Error::Build {
            script: script.display().to_string(),
            message: format!("exit {}", out.status),
        });
    }
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Ok(PathBuf::from(dir))
}

/// A binary of this workspace built for the running test (`target/<profile>/<bin>`, beside the
/// test executable's `deps/`), built with `cargo build -p <package>` when missing (a test
/// binary of another package does not get it otherwise).
pub fn workspace_binary(package: &str, bin: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test executable");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("the target directory")
        .to_owned();
    let path = dir.join(bin);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = std::process::Command::new(cargo)
            .args(["build", "-p", package, "--bin", bin])
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building {bin}");
    }
    path
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough on a test machine).
pub fn free_port() -> Result<u16, Error> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io("binding a free port"))?;
    Ok(l.local_addr().map_err(io("reading the bound port"))?.port())
}

/// Options for [`ControlPlane::start`].
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Also start kube-scheduler.
    pub scheduler: bool,
    /// Extra kube-apiserver flags (`--name=value`).
    pub apiserver_flags: Vec<String>,
    /// Extra kube-scheduler flags (`--name=value`), e.g. its client's `--kube-api-qps`.
    pub scheduler_flags: Vec<String>,
    /// Serve the pods of a real node ([`node::RealNode`]) as a cluster's API server does, for
    /// components installed in the cluster: the API server listens on [`POD_API_ADDRESS`] (on a
    /// link of its own, see [`host::ApiLink`]; needs root) instead of loopback, publishes it as
    /// the `kubernetes` Service's endpoint (lease reconciler), and runs the `ServiceAccount`
    /// admission plugin (the node's kube-controller-manager creates the accounts and publishes
    /// the root CA; [`ControlPlane::namespace`] waits for the `default` account).
    pub serve_pods: bool,
    /// The minor's own defaults for the admission-policy API. Without it, a minor before
    /// [`POLICY_API_GA_MINOR`] (1.34, 1.35) runs with the MutatingAdmissionPolicy beta turned
    /// on (`--runtime-config=admissionregistration.k8s.io/v1beta1=true`, the feature gate on),
    /// as users who take meshgate's policy path there turn it on: every cell of the version
    /// matrix then runs the same suites, the older ones through `v1beta1`.
    pub version_defaults: bool,
}

impl Options {
    /// The defaults, with the API server's `/debug/pprof` on when `profiling` (the benches'
    /// `MESHGATE_BENCH_APISERVER_PROFILE`).
    pub fn profiling(profiling: bool) -> Self {
        Self {
            apiserver_flags: if profiling {
                vec!["--profiling=true".into()]
            } else {
                Vec::new()
            },
            ..Self::default()
        }
    }
}

/// The resource a kind is served as, named in full (no discovery).
pub fn api_resource(
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// The host address the API server listens on with [`Options::serve_pods`]: a private address
/// outside the pods' and Services' ranges, routed to the host from every pod (through the pod
/// network's gateway); nothing leaves the machine.
pub const POD_API_ADDRESS: &str = "10.245.0.1";
/// The `kubernetes` Service's ClusterIP (the first address of `--service-cluster-ip-range`),
/// which in-cluster clients connect to.
pub const KUBERNETES_SERVICE_IP: &str = "10.96.0.1";

/// A running control plane. Dropping it stops its processes and removes its directory.
pub struct ControlPlane {
    bin: PathBuf,
    /// The Kubernetes minor of its binaries (34 for 1.34).
    pub minor: u32,
    dir: tempfile::TempDir,
    ca: meshgate_pki::Ca,
    etcd: Process,
    apiserver: Process,
    scheduler: tokio::sync::Mutex<Option<Process>>,
    /// Dropped after the processes (fields drop in order).
    api_link: Option<host::ApiLink>,
    serve_pods: bool,
    /// `https://127.0.0.1:PORT` (or [`POD_API_ADDRESS`] with [`Options::serve_pods`]).
    pub server: String,
    /// The admin kubeconfig (client certificate in `system:masters`).
    pub kubeconfig_path: PathBuf,
    /// PEM of the CA that signed the API server's serving certificate.
    pub ca_pem: String,
    etcd_url: String,
    etcd_args: Vec<String>,
    apiserver_args: Vec<String>,
    scheduler_flags: Vec<String>,
    /// How many of `apiserver_args` (the last) are [`Options::apiserver_flags`].
    extra_flags: usize,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server", &self.server)
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

const CERT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

impl ControlPlane {
    /// Starts etcd and kube-apiserver (and kube-scheduler if asked) and waits until the API
    /// server is ready.
    pub async fn start(options: Options) -> Result<Self, Error> {
        // Ports are picked free, then bound by the component: a process of another test may
        // take one in between. A component that exits on a port in use is started again, on
        // new ports.
        let mut attempt = 1;
        loop {
            match Self::start_once(options.clone()).await {
                Err(Error::Exited { log, .. })
                    if attempt < 3 && log.contains("address already in use") =>
                {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once(options: Options) -> Result<Self, Error> {
        let bin = tokio::task::spawn_blocking(binaries)
            .await
            .map_err(|e| Error::Kubeconfig(e.to_string()))??;
        let minor = kube_minor(&bin)?;
        // etcd's data is throw-away: keep it in memory when the machine has /dev/shm.
        let parent = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        remove_stale_dirs(&parent);
        let dir = match Path::new("/dev/shm").is_dir() {
            true => tempfile::Builder::new()
                .prefix("meshgate-cp-")
                .tempdir_in("/dev/shm"),
            false => tempfile::Builder::new().prefix("meshgate-cp-").tempdir(),
        }
        .map_err(io("creating the control plane's directory"))?;
        let d = dir.path();
        std::fs::write(d.join("owner.pid"), std::process::id().to_string())
            .map_err(io("writing owner.pid"))?;
        let write = |name: &str, text: &str| -> Result<PathBuf, Error> {
            let p = d.join(name);
            std::fs::write(&p, text).map_err(io(format!("writing {}", p.display())))?;
            Ok(p)
        };

        let api_link = if options.serve_pods {
            Some(host::ApiLink::create(POD_API_ADDRESS)?)
        } else {
            None
        };
        let address = if options.serve_pods {
            POD_API_ADDRESS
        } else {
            "127.0.0.1"
        };
        let ca = meshgate_pki::Ca::new("meshgate-test-ca", CERT_LIFETIME)?;
        let serving = ca.issue_server(
            &[
                "127.0.0.1",
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                KUBERNETES_SERVICE_IP,
                POD_API_ADDRESS,
            ],
            CERT_LIFETIME,
        )?;
        let admin = ca.issue_client("meshgate-test-admin", &["system:masters"], CERT_LIFETIME)?;
        let sa_key = meshgate_pki::generate_key_pem()?;
        let ca_file = write("ca.crt", &ca.certificate().cert_pem)?;
        let tls_cert = write("apiserver.crt", &serving.cert_pem)?;
        let tls_key = write("apiserver.key", &serving.key_pem)?;
        let admin_cert = write("admin.crt", &admin.cert_pem)?;
        let admin_key = write("admin.key", &admin.key_pem)?;
        let sa_key_file = write("sa.key", &sa_key)?;
        let sa_pub_file = write("sa.pub", &meshgate_pki::public_key_pem(&sa_key)?)?;

        // etcd
        let (client_port, peer_port) = (free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd_args = vec![
            format!("--data-dir={}", d.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=default={peer_url}"),
            "--unsafe-no-fsync=true".into(),
            "--log-level=warn".into(),
        ];
        let etcd = Process::spawn("etcd", &bin.join("etcd"), &etcd_args, &d.join("etcd.log"))?;
        wait_http(
            &etcd,
            &format!("{etcd_url}/health"),
            Duration::from_secs(30),
        )
        .await?;

        // kube-apiserver
        let port = free_port()?;
        let server = format!("https://{address}:{port}");
        let mut apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={address}"),
            format!("--advertise-address={address}"),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", d.join("certs").display()),
            format!("--tls-cert-file={}", tls_cert.display()),
            format!("--tls-private-key-file={}", tls_key.display()),
            format!("--client-ca-file={}", ca_file.display()),
            "--authorization-mode=RBAC".into(),
            format!("--service-account-key-file={}", sa_pub_file.display()),
            format!(
                "--service-account-signing-key-file={}",
                sa_key_file.display()
            ),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        if options.serve_pods {
            apiserver_args.push("--endpoint-reconciler-type=lease".into());
        } else {
            apiserver_args.push("--disable-admission-plugins=ServiceAccount".into());
            apiserver_args.push("--endpoint-reconciler-type=none".into());
        }
        if minor < POLICY_API_GA_MINOR && !options.version_defaults {
            apiserver_args
                .push("--runtime-config=admissionregistration.k8s.io/v1beta1=true".into());
            apiserver_args.push("--feature-gates=MutatingAdmissionPolicy=true".into());
        }
        // The caller's flags last: a later feature gate or runtime-config entry wins.
        apiserver_args.extend(options.apiserver_flags.iter().cloned());
        let apiserver = Process::spawn(
            "kube-apiserver",
            &bin.join("kube-apiserver"),
            &apiserver_args,
            &d.join("kube-apiserver.log"),
        )?;

        let kubeconfig_path = d.join("kubeconfig");
        std::fs::write(
            &kubeconfig_path,
            kubeconfig_yaml(&server, &ca_file, &admin_cert, &admin_key),
        )
        .map_err(io("writing the kubeconfig"))?;

        let ca_pem = ca.certificate().cert_pem.clone();
        let cp = Self {
            bin,
            minor,
            dir,
            ca,
            etcd,
            apiserver,
            scheduler: tokio::sync::Mutex::new(None),
            api_link,
            serve_pods: options.serve_pods,
            server,
            kubeconfig_path,
            ca_pem,
            etcd_url,
            etcd_args,
            apiserver_args,
            scheduler_flags: options.scheduler_flags.clone(),
            extra_flags: options.apiserver_flags.len(),
        };
        cp.wait_ready(Duration::from_secs(90)).await?;
        if options.scheduler {
            cp.ensure_scheduler().await?;
        }
        Ok(cp)
    }

    /// A client with the admin identity.
    pub async fn client(&self) -> Result<Client, Error> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig_path)
            .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        config.read_timeout = Some(Duration::from_secs(60));
        Ok(Client::try_from(config)?)
    }

    /// The directory holding the logs (`etcd.log`, `kube-apiserver.log`, `kube-scheduler.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA's certificate file (the API server's client CA and serving CA).
    pub fn ca_file(&self) -> PathBuf {
        self.dir().join("ca.crt")
    }

    /// The private key that signs service-account tokens (kube-controller-manager needs it).
    pub fn service_account_key_file(&self) -> PathBuf {
        self.dir().join("sa.key")
    }

    /// A client certificate from the control plane's CA: the API server authenticates it as
    /// `user` in `groups` (e.g. `system:node:NAME` in `system:nodes` for a kubelet).
    pub fn issue_client(
        &self,
        user: &str,
        groups: &[&str],
    ) -> Result<meshgate_pki::CertifiedKey, Error> {
        Ok(self.ca.issue_client(user, groups, CERT_LIFETIME)?)
    }

    /// The link holding the API server's address for pods ([`Options::serve_pods`]).
    pub fn api_link(&self) -> Option<&str> {
        self.api_link.as_ref().map(host::ApiLink::name)
    }

    /// The etcd client URL.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// Starts kube-scheduler if it is not running yet and waits until it serves.
    pub async fn ensure_scheduler(&self) -> Result<(), Error> {
        let mut slot = self.scheduler.lock().await;
        if slot.as_ref().is_some_and(|p| p.is_running()) {
            return Ok(());
        }
        let port = free_port()?;
        let args: Vec<String> = [
            format!("--kubeconfig={}", self.kubeconfig_path.display()),
            format!(
                "--authentication-kubeconfig={}",
                self.kubeconfig_path.display()
            ),
            format!(
                "--authorization-kubeconfig={}",
                self.kubeconfig_path.display()
            ),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!(
                "--cert-dir={}",
                self.dir().join("scheduler-certs").display()
            ),
            "--leader-elect=false".into(),
            "--v=2".into(),
        ]
        .into_iter()
        .chain(self.scheduler_flags.iter().cloned())
        .collect();
        let p = Process::spawn(
            "kube-scheduler",
            &self.bin.join("kube-scheduler"),
            &args,
            &self.dir().join("kube-scheduler.log"),
        )?;
        wait_http(
            &p,
            &format!("https://127.0.0.1:{port}/healthz"),
            Duration::from_secs(60),
        )
        .await?;
        *slot = Some(p);
        Ok(())
    }

    /// Stops kube-apiserver and starts it again with the same flags (fault tests).
    pub async fn restart_apiserver(&mut self) -> Result<(), Error> {
        self.apiserver.stop();
        self.apiserver = Process::spawn(
            "kube-apiserver",
            &self.bin.join("kube-apiserver"),
            &self.apiserver_args,
            &self.dir().join("kube-apiserver.log"),
        )?;
        self.wait_ready(Duration::from_secs(90)).await
    }

    /// Stops kube-apiserver and starts it again with `flags` in place of
    /// [`Options::apiserver_flags`]: a control-plane change such as an upgrade that turns an
    /// API on.
    pub async fn restart_apiserver_with(&mut self, flags: &[String]) -> Result<(), Error> {
        let kept = self.apiserver_args.len() - self.extra_flags;
        self.apiserver_args.truncate(kept);
        self.apiserver_args.extend(flags.iter().cloned());
        self.extra_flags = flags.len();
        self.restart_apiserver().await
    }

    /// Stops etcd and starts it again on the same data, then waits until the API server is ready
    /// again (fault tests).
    pub async fn restart_etcd(&mut self) -> Result<(), Error> {
        self.etcd.stop();
        self.etcd = Process::spawn(
            "etcd",
            &self.bin.join("etcd"),
            &self.etcd_args,
            &self.dir().join("etcd.log"),
        )?;
        wait_http(
            &self.etcd,
            &format!("{}/health", self.etcd_url),
            Duration::from_secs(30),
        )
        .await?;
        self.wait_ready(Duration::from_secs(90)).await
    }

    /// Process ids of the running control-plane processes.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = vec![self.etcd.pid(), self.apiserver.pid()];
        if let Ok(slot) = self.scheduler.try_lock()
            && let Some(p) = slot.as_ref()
        {
            pids.push(p.pid());
        }
        pids
    }

    /// Polls `/readyz` until it says `ok`. An API server that is not ready yet (refused
    /// connections, `500` while its post-start hooks run) is the expected state here: each try
    /// is logged at debug, and only the deadline is an error. The kube client logs every failed
    /// request at ERROR, so the probe's requests run with no log subscriber.
    async fn wait_ready(&self, timeout: Duration) -> Result<(), Error> {
        use tracing::instrument::WithSubscriber;
        let start = Instant::now();
        let client = self.client().await?;
        loop {
            self.apiserver.check_alive()?;
            let probe = match http::Request::get("/readyz").body(Vec::new()) {
                Ok(req) => client
                    .request_text(req)
                    .with_subscriber(tracing::subscriber::NoSubscriber::default())
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match probe {
                Ok(text) if text.trim() == "ok" => return Ok(()),
                Ok(text) => {
                    tracing::debug!(readyz = %text.trim(), "kube-apiserver not ready yet; retrying")
                }
                Err(e) => tracing::debug!(error = %e, "kube-apiserver not ready yet; retrying"),
            }
            if start.elapsed() > timeout {
                return Err(Error::NotReady {
                    name: "kube-apiserver",
                    waited: timeout,
                    log: self.apiserver.log_tail(30),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Creates a namespace with a unique name starting with `prefix`, with these labels.
    pub async fn namespace(&self, prefix: &str, labels: &[(&str, &str)]) -> Result<String, Error> {
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let client = self.client().await?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        if self.serve_pods {
            // The ServiceAccount admission plugin refuses pods until kube-controller-manager
            // has created the namespace's `default` account.
            let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
                Api::namespaced(client, &name);
            let start = Instant::now();
            while accounts.get_opt("default").await?.is_none() {
                if start.elapsed() > Duration::from_secs(60) {
                    return Err(Error::Node(format!(
                        "namespace {name}: no `default` ServiceAccount after 60 s (is kube-controller-manager running?)"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(name)
    }
}

/// The shared control plane lives in a static, which is never dropped: its directory outlives
/// the test binary. Each directory names its owner process; those whose owner is gone are removed
/// by the next start.
fn remove_stale_dirs(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_ours = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("meshgate-cp-"));
        if !is_ours {
            continue;
        }
        let owner = std::fs::read_to_string(path.join("owner.pid")).unwrap_or_default();
        let alive = if owner.trim().is_empty() {
            // Being set up by another process right now, unless it is old.
            entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_none_or(|age| age < Duration::from_secs(120))
        } else {
            Path::new("/proc").join(owner.trim()).exists()
        };
        if !alive {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

fn kubeconfig_yaml(server: &str, ca: &Path, cert: &Path, key: &Path) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: meshgate-test
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: admin
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: meshgate-test
  context:
    cluster: meshgate-test
    user: admin
current-context: meshgate-test
",
        ca = ca.display(),
        cert = cert.display(),
        key = key.display()
    )
}

/// Polls an HTTP(S) health endpoint with a plain TCP + TLS-less probe: for etcd (HTTP) a GET, for
/// TLS endpoints a TCP connect (the process is then serving).
async fn wait_http(p: &Process, url: &str, timeout: Duration) -> Result<(), Error> {
    let start = Instant::now();
    let hostport = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_owned();
    let plain = url.starts_with("http://");
    loop {
        p.check_alive()?;
        if let Ok(mut s) = tokio::net::TcpStream::connect(&hostport).await {
            if !plain {
                return Ok(());
            }
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let path = url.splitn(4, '/').nth(3).unwrap_or_default();
            let req = format!("GET /{path} HTTP/1.0\r\nHost: {hostport}\r\n\r\n");
            let mut buf = Vec::new();
            if s.write_all(req.as_bytes()).await.is_ok()
                && s.read_to_end(&mut buf).await.is_ok()
                && buf.starts_with(b"HTTP/1.0 200")
                || buf.starts_with(b"HTTP/1.1 200")
            {
                return Ok(());
            }
        }
        if start.elapsed() > timeout {
            return Err(Error::NotReady {
                name: p.name(),
                waited: timeout,
                log: p.log_tail(30),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

static SHARED: OnceCell<Arc<ControlPlane>> = OnceCell::const_new();

/// The control plane shared by every test of this test binary, started on first use (with the
/// scheduler when `options.scheduler`; a later caller asking for the scheduler gets it started).
///
/// Each `#[tokio::test]` has its own runtime, so the shared control plane does its own I/O
/// through fresh clients: call [`ControlPlane::client`] in each test.
pub async fn shared(options: Options) -> Result<Arc<ControlPlane>, Error> {
    let want_scheduler = options.scheduler;
    let cp = SHARED
        .get_or_try_init(|| async { ControlPlane::start(options).await.map(Arc::new) })
        .await?
        .clone();
    if want_scheduler {
        cp.ensure_scheduler().await?;
    }
    Ok(cp)
}

/// Plays kubelet and the node lifecycle controller for a Node the test created: reports it
/// Ready with some capacity and removes the `node.kubernetes.io/not-ready` taint that the API
/// server's `TaintNodesByCondition` admission plugin put on it at creation. Other taints stay.
pub async fn make_node_ready(client: &Client, name: &str) -> Result<(), Error> {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Patch, PatchParams};
    let nodes: Api<Node> = Api::all(client.clone());
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    // A kubelet of the API server's own version (what a DRA gate reads: which claims it
    // prepares).
    let version = client.apiserver_version().await?.git_version;
    let status = serde_json::json!({"status": {
        "capacity": {"cpu": "4", "memory": "8Gi", "pods": "110"},
        "allocatable": {"cpu": "4", "memory": "8Gi", "pods": "110"},
        "nodeInfo": {"kubeletVersion": version, "operatingSystem": "linux", "architecture": "amd64"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "meshgate-testenv", "lastHeartbeatTime": now,
                        "lastTransitionTime": now}],
    }});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    // Remove the condition taint with an optimistic lock on the list, like the real controller.
    loop {
        let node = nodes.get(name).await?;
        let taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
        if !taints
            .iter()
            .any(|t| t.key == "node.kubernetes.io/not-ready")
        {
            return Ok(());
        }
        let kept: Vec<_> = taints
            .iter()
            .filter(|t| t.key != "node.kubernetes.io/not-ready")
            .collect();
        let patch = serde_json::json!([
            {"op": "test", "path": "/spec/taints", "value": taints},
            {"op": "replace", "path": "/spec/taints", "value": kept},
        ]);
        let patch: json_patch::Patch =
            serde_json::from_value(patch).map_err(|e| Error::Kubeconfig(e.to_string()))?;
        match nodes
            .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 422 || e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Polls `f` every 100 ms until it is true; panics naming `what` after `timeout` (tests).
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A webhook's serving files for `127.0.0.1`: a CA (an hour), and the certificate and key it
/// issued, written as `tls.crt` and `tls.key` in a new temporary directory (gone when dropped).
pub struct LoopbackServing {
    pub ca: meshgate_pki::Ca,
    pub cert: PathBuf,
    pub key: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoopbackServing {
    pub fn new() -> Result<Self, String> {
        let hour = std::time::Duration::from_secs(3600);
        let ca = meshgate_pki::Ca::new("meshgate-bench-ca", hour).map_err(|e| e.to_string())?;
        let serving = ca
            .issue_server(&["127.0.0.1"], hour)
            .map_err(|e| e.to_string())?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert, &serving.cert_pem).map_err(|e| e.to_string())?;
        std::fs::write(&key, &serving.key_pem).map_err(|e| e.to_string())?;
        Ok(Self {
            ca,
            cert,
            key,
            _dir: dir,
        })
    }
}

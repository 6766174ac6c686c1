//! The DRA gate's kubelet plugin ("the DRA gate"): a dynamic-resource-allocation driver that
//! holds a pod's sandbox until the mesh is ready on its node.
//!
//! The kubelet calls `NodePrepareResources` for a pod's claims of the driver right before it
//! creates the pod's sandbox. The plugin answers only once the node is ready: the active CNI
//! configuration chains the mesh's CNI plugin and the mesh agent's readiness URLs answer 2xx
//! (`meshgate_core::dra::node`). A failed prepare is retried only at the kubelet's next sync of
//! the pod, 60–90 s later, so the plugin does not fail fast: it waits inside the call, up to
//! [`Settings::prepare_wait`], checking the node every [`Settings::poll`], and answers success
//! as soon as the node is ready, or after the bound a per-claim error that names what is not
//! ready. Nothing is allocated: the claims' device lists are empty, and the plugin needs no
//! Kubernetes client.
//!
//! # Sockets (as the kubelet and its Go helper name them, Kubernetes 1.36)
//! * registration: `<kubelet root>/plugins_registry/<driver>-reg.sock`
//!   ([`registration_socket`]): `pluginregistration.Registration`, which the kubelet's plugin
//!   watcher finds, asks for the plugin's info (`DRAPlugin`, `v1.DRAPlugin`) and tells whether
//!   it registered the plugin. After a kubelet restart it finds the socket again and registers
//!   the plugin again.
//! * DRA: `<kubelet root>/plugins/<driver>/dra.sock` ([`dra_socket`]):
//!   `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin` and `v1alpha1.DRAResourceHealth`, which the
//!   kubelet opens on every registered plugin (and logs an error every 5 s where it is not
//!   served).
//!
//! # HTTP (`health_addr`)
//! `/healthz`: 200 while both sockets are in place; 503 naming a socket that was removed (the
//! kubelet drops a plugin whose registration socket goes, and cannot reach one whose DRA socket
//! goes; the liveness probe then restarts the plugin, which binds both again and is registered
//! again). `/readyz`: 200 while the kubelet has registered the plugin and both sockets are in
//! place, else 503 with the reason.

// A shell's functions stay short (clippy.toml: too-many-lines-threshold).
#![deny(clippy::too_many_lines)]

pub mod authority;
mod grpc;
mod health;
mod http_probe;
mod readiness;

/// The generated messages, servers and clients of the kubelet's plugin APIs.
pub mod proto;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tracing::{info, warn};

pub use http_probe::HttpUrl;

/// The DRA driver meshgate's node plugin serves: `meshgate_api::names::DRA_DRIVER`.
pub const DEFAULT_DRIVER: &str = "gate.meshgate.dev";
/// The kubelet's default root directory.
pub const DEFAULT_KUBELET_ROOT: &str = "/var/lib/kubelet";
/// The container runtimes' default CNI configuration directory.
pub const DEFAULT_CNI_CONF_DIR: &str = "/etc/cni/net.d";
/// The kubelet's timeout for one `NodePrepareResources` call: the wait must be shorter.
pub const KUBELET_CALL_TIMEOUT: Duration = Duration::from_secs(45);
/// How long one readiness URL may take to answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The plugin's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The DRA driver name, as in the `ResourceSlice`s and `DeviceClass`es of the gate.
    pub driver: String,
    /// The kubelet's root directory (`--root-dir`).
    pub kubelet_root: PathBuf,
    /// The container runtime's CNI configuration directory.
    pub cni_conf_dir: PathBuf,
    /// The CNI plugin `type` the active configuration must chain (e.g. `istio-cni`); `None`:
    /// no CNI check.
    pub cni_plugin: Option<String>,
    /// URLs that must answer 2xx (plain `http://IP:PORT/path`, no DNS): the mesh's node agent.
    pub ready_urls: Vec<String>,
    /// How long a `NodePrepareResources` call waits for the node (less than the kubelet's 45 s).
    pub prepare_wait: Duration,
    /// How often a waiting call checks the node again.
    pub poll: Duration,
    /// Where `/healthz` and `/readyz` are served.
    pub health_addr: SocketAddr,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            driver: DEFAULT_DRIVER.to_string(),
            kubelet_root: PathBuf::from(DEFAULT_KUBELET_ROOT),
            cni_conf_dir: PathBuf::from(DEFAULT_CNI_CONF_DIR),
            cni_plugin: None,
            ready_urls: Vec::new(),
            prepare_wait: Duration::from_secs(30),
            poll: Duration::from_millis(100),
            health_addr: SocketAddr::from(([127, 0, 0, 1], 9813)),
        }
    }
}

/// The registration socket the kubelet's plugin watcher finds:
/// `<root>/plugins_registry/<driver>-reg.sock`.
pub fn registration_socket(kubelet_root: &Path, driver: &str) -> PathBuf {
    kubelet_root
        .join("plugins_registry")
        .join(format!("{driver}-reg.sock"))
}

/// The socket of the DRA services: `<root>/plugins/<driver>/dra.sock`.
pub fn dra_socket(kubelet_root: &Path, driver: &str) -> PathBuf {
    kubelet_root.join("plugins").join(driver).join("dra.sock")
}

/// Why the plugin could not run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid settings: {0}")]
    Settings(String),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("health endpoint {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("gRPC server on {}: {source}", path.display())]
    Serve {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("health endpoint {addr}: {source}")]
    Http {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

impl Settings {
    /// Checks the settings; the parsed readiness URLs.
    pub fn validate(&self) -> Result<Vec<HttpUrl>, Error> {
        let bad = |m: String| Err(Error::Settings(m));
        if !is_driver_name(&self.driver) {
            return bad(format!(
                "driver {:?} is not a DNS subdomain of at most 63 characters",
                self.driver
            ));
        }
        if self.prepare_wait >= KUBELET_CALL_TIMEOUT {
            return bad(format!(
                "prepare_wait {:?} must be shorter than the kubelet's timeout of {:?}",
                self.prepare_wait, KUBELET_CALL_TIMEOUT
            ));
        }
        if self.poll.is_zero() {
            return bad("poll must be more than 0".to_string());
        }
        if self.cni_plugin.as_deref() == Some("") {
            return bad("cni_plugin must not be empty".to_string());
        }
        let urls = self
            .ready_urls
            .iter()
            .map(|u| http_probe::parse_url(u).map_err(|e| Error::Settings(format!("{u}: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        for path in [
            registration_socket(&self.kubelet_root, &self.driver),
            dra_socket(&self.kubelet_root, &self.driver),
        ] {
            if path.to_str().is_none() {
                return bad(format!("{} is not UTF-8", path.display()));
            }
        }
        Ok(urls)
    }
}

/// A DNS-1123 subdomain of at most 63 characters, as the API server wants a driver name.
fn is_driver_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// The sockets of a running plugin, removed when it stops (or its future is dropped).
struct Sockets(Vec<PathBuf>);

impl Drop for Sockets {
    fn drop(&mut self) {
        for path in &self.0 {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => warn!("could not remove the socket {}: {e}", path.display()),
            }
        }
    }
}

/// Binds a unix socket at `path`: creates its directory, removes a stale socket first.
async fn bind_socket(path: &Path, sockets: &mut Sockets) -> Result<UnixListener, Error> {
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { what, path, source }
    };
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(io("creating the directory", dir))?;
    }
    match tokio::fs::remove_file(path).await {
        Ok(()) => info!("removed the stale socket {}", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing the stale socket", path)(e)),
    }
    let listener = UnixListener::bind(path).map_err(io("listening on", path))?;
    sockets.0.push(path.to_path_buf());
    Ok(listener)
}

/// The kubelet's connections to the registration socket, each read through
/// [`authority::AuthorityRewrite`]: the kubelet's plugin watcher dials it with
/// `grpc.DialContext(path)` (1.34 to 1.37), so grpc-go sends the socket's path as the HTTP/2
/// authority, which the server refuses otherwise. The DRA socket needs no rewrite: the kubelet
/// dials it by a `unix:` target (`grpc.NewClient`, 1.34 to 1.37), for which grpc-go sends
/// `localhost`. `real_node::dra_gate_guards_pods_by_the_layer_the_nodes_kubelet_supports` asks
/// each kubelet.
fn registration_connections(
    listener: UnixListener,
) -> impl futures::Stream<Item = std::io::Result<authority::AuthorityRewrite<tokio::net::UnixStream>>>
{
    use futures::StreamExt;
    UnixListenerStream::new(listener).map(|c| c.map(authority::AuthorityRewrite::new))
}

/// Resolves once the plugin is stopping.
async fn stopped(mut stop: watch::Receiver<bool>) {
    // An error: the sender is gone, which only happens once `run` is over.
    let _ = stop.wait_for(|stopping| *stopping).await;
}

/// Runs the plugin until `shutdown` resolves: the registration and DRA sockets and the health
/// endpoint. Removes both sockets when it returns.
pub async fn run(
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let urls = settings.validate()?;
    let reg_path = registration_socket(&settings.kubelet_root, &settings.driver);
    let dra_path = dra_socket(&settings.kubelet_root, &settings.driver);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut state = grpc::State::new(
        &settings,
        &dra_path,
        readiness::Checker::new(&settings, urls),
        stop_rx.clone(),
    );
    state.sockets = vec![reg_path.clone(), dra_path.clone()];
    let state = Arc::new(state);

    let mut sockets = Sockets(Vec::new());
    // The DRA socket serves before the kubelet can learn of it through the registration socket.
    let dra_listener = bind_socket(&dra_path, &mut sockets).await?;
    let addr = settings.health_addr;
    let http_listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let reg_listener = bind_socket(&reg_path, &mut sockets).await?;
    info!(
        driver = %settings.driver,
        "DRA plugin serving {} and {}, health on {addr}; checking: {}",
        reg_path.display(),
        dra_path.display(),
        state.checker.describe()
    );

    let dra = tonic::transport::Server::builder()
        .add_service(proto::dra_v1::dra_plugin_server::DraPluginServer::from_arc(
            state.clone(),
        ))
        .add_service(
            proto::dra_health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::from_arc(
                state.clone(),
            ),
        )
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(dra_listener),
            stopped(stop_rx.clone()),
        );
    let registration = tonic::transport::Server::builder()
        .add_service(
            proto::pluginregistration::registration_server::RegistrationServer::from_arc(
                state.clone(),
            ),
        )
        .serve_with_incoming_shutdown(
            registration_connections(reg_listener),
            stopped(stop_rx.clone()),
        );
    let http = axum::serve(http_listener, health::router(state.clone()))
        .with_graceful_shutdown(stopped(stop_rx.clone()));
    let stop = async move {
        shutdown.await;
        info!("DRA plugin stopping");
        let _ = stop_tx.send(true);
        Ok(())
    };

    let result = tokio::try_join!(
        stop,
        async {
            dra.await.map_err(|source| Error::Serve {
                path: dra_path.clone(),
                source,
            })
        },
        async {
            registration.await.map_err(|source| Error::Serve {
                path: reg_path.clone(),
                source,
            })
        },
        async { http.await.map_err(|source| Error::Http { addr, source }) },
    );
    drop(sockets);
    result.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_paths_are_the_kubelets() {
        let root = Path::new("/var/lib/kubelet");
        assert_eq!(
            registration_socket(root, DEFAULT_DRIVER),
            Path::new("/var/lib/kubelet/plugins_registry/gate.meshgate.dev-reg.sock")
        );
        assert_eq!(
            dra_socket(root, DEFAULT_DRIVER),
            Path::new("/var/lib/kubelet/plugins/gate.meshgate.dev/dra.sock")
        );
    }

    #[test]
    fn the_default_driver_is_the_gates() {
        assert_eq!(DEFAULT_DRIVER, meshgate_api::names::DRA_DRIVER);
        assert!(Settings::default().validate().is_ok());
    }

    #[test]
    fn invalid_settings_are_refused() {
        let s = Settings::default;
        for (bad, expect) in [
            (
                Settings {
                    driver: "a/b".into(),
                    ..s()
                },
                "DNS subdomain",
            ),
            (
                Settings {
                    driver: "Gate.x".into(),
                    ..s()
                },
                "DNS subdomain",
            ),
            (
                Settings {
                    driver: String::new(),
                    ..s()
                },
                "DNS subdomain",
            ),
            (
                Settings {
                    prepare_wait: KUBELET_CALL_TIMEOUT,
                    ..s()
                },
                "shorter than the kubelet's",
            ),
            (
                Settings {
                    poll: Duration::ZERO,
                    ..s()
                },
                "poll",
            ),
            (
                Settings {
                    cni_plugin: Some(String::new()),
                    ..s()
                },
                "cni_plugin",
            ),
            (
                Settings {
                    ready_urls: vec!["https://127.0.0.1/".into()],
                    ..s()
                },
                "https://127.0.0.1/: https is not supported",
            ),
        ] {
            let err = bad.validate().expect_err(expect).to_string();
            assert!(err.contains(expect), "{err}");
        }
        assert!(is_driver_name("gate.meshgate.dev"));
        assert!(!is_driver_name("-a.b"));
        assert!(!is_driver_name("a..b"));
        assert!(!is_driver_name(&"a".repeat(64)));
    }
}

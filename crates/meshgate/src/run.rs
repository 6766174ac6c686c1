//! Running meshgate's components, as processes (`meshgate webhook`, `meshgate controller`) or
//! in-process (the demo and the end-to-end tests).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use meshgate_api::GateConfig;
use meshgate_webhook::server::App;
use meshgate_webhook::tls::CertFiles;
use meshgate_webhook::{Server, ServerOptions, Sources};

/// Settings of the webhook.
#[derive(Clone, Debug)]
pub struct WebhookSettings {
    pub config: GateConfig,
    pub addr: SocketAddr,
    pub health_addr: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub cert_poll_interval: Duration,
    pub request_timeout: Duration,
    /// Reviews handled at once; more get 429 at once.
    pub max_in_flight: usize,
}

/// Starts the webhook in the background; its caches follow the cluster through `client`.
pub async fn start_webhook(client: kube::Client, s: WebhookSettings) -> anyhow::Result<Server> {
    let (sources, drive) = Sources::watch(client);
    let drive = tokio::spawn(drive);
    let app = App::new(s.config, sources, meshgate_webhook::metrics::Metrics::new());
    let server = Server::start(
        ServerOptions {
            addr: s.addr,
            health_addr: s.health_addr,
            certs: CertFiles {
                cert: s.cert,
                key: s.key,
            },
            cert_poll_interval: s.cert_poll_interval,
            request_timeout: s.request_timeout,
            max_in_flight: s.max_in_flight,
            shutdown_grace: Duration::from_secs(20),
        },
        app,
    )
    .await?;
    let mut server = server;
    server.attach(drive.abort_handle());
    Ok(server)
}

/// The controller's settings and run loop live in the controller crate.
pub use meshgate_controller::run::{ControllerSettings, run_controller};

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => futures::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = term => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

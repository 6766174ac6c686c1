//! Running meshgate's components, as processes (`meshgate webhook`, `meshgate controller`) or
//! in-process (the demo and the end-to-end tests).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use meshgate_api::GateConfig;
use meshgate_controller::leader::{self, LeaseSettings};
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

/// Settings of the controller.
#[derive(Clone, Debug)]
pub struct ControllerSettings {
    /// `None`: no leader election (a single replica).
    pub lease: Option<LeaseSettings>,
    pub health_addr: Option<SocketAddr>,
    pub node_gate: meshgate_controller::nodegate::Settings,
    /// Manage the webhook's certificates (in a cluster).
    pub certs: Option<meshgate_controller::certs::CertSettings>,
    /// The repair loop (off unless `enabled`).
    pub repair: meshgate_core::repair::RepairSettings,
    /// Keep the rules of this `MutatingWebhookConfiguration`'s policies webhook in line with
    /// the kinds the MutationPolicies name (`None`: leave them as installed).
    pub policy_webhook: Option<String>,
    /// Native mode: compile MutationPolicies that a MutatingAdmissionPolicy can express into
    /// one, when the API server serves that API (`meshgate_core::policy::native`).
    pub native_policies: bool,
}

/// Runs the controllers (node gate, and the MutationPolicy backfill of existing workloads)
/// until `shutdown` resolves.
pub async fn run_controller(
    client: kube::Client,
    s: ControllerSettings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let metrics = meshgate_controller::Metrics::new();
    let repair_metrics = metrics.repair.clone();
    s.repair
        .validate()
        .map_err(|e| anyhow::anyhow!("repair settings: {e}"))?;
    let leader = match s.lease {
        Some(lease) => leader::elect(client.clone(), lease).await?,
        None => leader::always(),
    };
    if let Some(addr) = s.health_addr {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let app = axum_router(metrics.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }
    let mut policy_settings = meshgate_controller::policies::Settings::default();
    if s.native_policies {
        policy_settings.native = crate::discovery::policy_api(&client).await;
        match policy_settings.native {
            Some(api) => tracing::info!(
                api = api.api_version(),
                "native policies: expressible MutationPolicies become MutatingAdmissionPolicies"
            ),
            None => tracing::warn!(
                "native policies: the API server serves no MutatingAdmissionPolicy API; every policy stays on the webhook"
            ),
        }
    }
    // Every controller stops on the same signal.
    let shutdown = futures::FutureExt::shared(shutdown);
    if let Some(certs) = s.certs {
        let (client, leader, stop) = (client.clone(), leader.clone(), shutdown.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = meshgate_controller::certs::run(client, leader, certs) => {},
                _ = stop => {},
            }
        });
    }
    if let Some(configuration) = s.policy_webhook {
        let (client, leader, stop) = (client.clone(), leader.clone(), shutdown.clone());
        tokio::spawn(meshgate_controller::registration::run(
            client,
            leader,
            configuration,
            Duration::from_secs(60),
            stop,
        ));
    }
    futures::join!(
        meshgate_controller::nodegate::run(
            client.clone(),
            leader.clone(),
            metrics,
            s.node_gate,
            shutdown.clone(),
        ),
        meshgate_controller::policies::run_with(
            client.clone(),
            leader.clone(),
            policy_settings,
            shutdown.clone()
        ),
        meshgate_controller::repair::run(client, leader, s.repair, repair_metrics, shutdown),
    );
    Ok(())
}

fn axum_router(metrics: meshgate_controller::Metrics) -> axum::Router {
    use axum::routing::get;
    let synced = metrics.synced.clone();
    axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        // Ready once the node gate's caches have their first full list (before that the
        // controller decides nothing; see meshgate_controller::nodegate).
        .route(
            "/readyz",
            get(move || {
                let ready = synced.get() == 1;
                async move {
                    if ready {
                        (axum::http::StatusCode::OK, "ok")
                    } else {
                        (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            "not ready: caches not synced",
                        )
                    }
                }
            }),
        )
        .route(
            "/metrics",
            // One registry: the repair loop's metrics are registered in the controller's.
            get(move || {
                let m = metrics.clone();
                async move { m.encode() }
            }),
        )
}

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

//! The controller process: every controller of this crate on one client, leader-elected, with
//! its health and metrics endpoint (`/healthz`, `/readyz`, `/metrics`), until a shutdown signal.
//! `meshgate controller` and the tests run it.

use std::net::SocketAddr;
use std::time::Duration;

use crate::leader::{self, LeaseSettings};

/// Why the controller could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("repair settings: {0}")]
    Repair(String),
    #[error("leader election: {0}")]
    Lease(#[from] kube_lease_manager::LeaseManagerError),
    #[error("health endpoint {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Settings of the controller. The default is a single replica (no leader election) with the
/// node gate's defaults and nothing optional: no health endpoint, certificates, repair, policy
/// webhook upkeep or native mode.
#[derive(Clone, Debug, Default)]
pub struct ControllerSettings {
    /// `None`: no leader election (a single replica).
    pub lease: Option<LeaseSettings>,
    pub health_addr: Option<SocketAddr>,
    pub node_gate: crate::nodegate::Settings,
    /// Manage the webhook's certificates (in a cluster).
    pub certs: Option<crate::certs::CertSettings>,
    /// Upgrade meshgate's CRDs to this version's schema on start (`crate::crds`).
    pub manage_crds: bool,
    /// The repair loop (off unless `enabled`).
    pub repair: meshgate_core::repair::RepairSettings,
    /// The repair loop's client for evictions (`crate::repair::EvictionClient`); `None`: the
    /// controller's client (a budget's refusal then stalls the loop while kube retries it).
    pub evictions: Option<crate::repair::EvictionClient>,
    /// Keep the rules of this `MutatingWebhookConfiguration`'s policies webhook in line with
    /// the kinds the MutationPolicies name (`None`: leave them as installed).
    pub policy_webhook: Option<String>,
    /// Native mode: compile MutationPolicies that a MutatingAdmissionPolicy can express into
    /// one, when the API server serves that API (`meshgate_core::policy::native`).
    pub native_policies: bool,
    /// The native gate (`meshgate_core::native_gate`): keep its routes in the policy and in this
    /// `MutatingWebhookConfiguration`'s gate entries, when the API server serves the policy API.
    /// The configuration is the webhook's.
    pub native_gate: Option<(meshgate_api::GateConfig, String)>,
    /// How often the leader proves that the API server runs the native gate's policy
    /// (`crate::native_gate::Proof`); `None`: every `crate::native_gate::PROOF_EVERY`.
    pub native_gate_proof: Option<Duration>,
    /// Namespaces in which policies never change anything (backfill, native policies): the
    /// webhook's `excludedNamespaces`. `None`: the configuration's default.
    pub excluded_namespaces: Option<Vec<String>>,
    /// Turn the backfill of existing workloads off (`--workload-backfill=false`).
    pub no_workload_backfill: bool,
}

/// Runs the controllers (node gate, and the MutationPolicy backfill of existing workloads)
/// until `shutdown` resolves.
pub async fn run_controller(
    client: kube::Client,
    s: ControllerSettings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), RunError> {
    let metrics = crate::Metrics::new();
    let repair_metrics = metrics.repair.clone();
    s.repair
        .validate()
        .map_err(|e| RunError::Repair(e.to_string()))?;
    if s.manage_crds {
        // Before anything reads them: every replica, leader or not (applying the same
        // definitions is idempotent).
        crate::crds::upgrade_logged(&client).await;
    }
    // The controller's namespace (its Lease's): where the native gate's probe is dry-run.
    let own_namespace = s
        .lease
        .as_ref()
        .map_or_else(|| "default".to_owned(), |l| l.namespace.clone());
    let leader = match s.lease {
        Some(lease) => leader::elect(client.clone(), lease).await?,
        None => leader::always(),
    };
    if let Some(addr) = s.health_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| RunError::Bind { addr, source })?;
        let app = axum_router(metrics.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }
    let policy_settings = policy_settings(
        &client,
        s.excluded_namespaces,
        !s.no_workload_backfill,
        s.native_policies,
    )
    .await;
    // Every controller stops on the same signal.
    let shutdown = futures::FutureExt::shared(shutdown);
    if let Some(certs) = s.certs {
        let (client, leader, stop) = (client.clone(), leader.clone(), shutdown.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = crate::certs::run(client, leader, certs) => {},
                _ = stop => {},
            }
        });
    }
    if let Some((config, configuration)) = s.native_gate {
        let proof = crate::native_gate::Proof {
            namespace: own_namespace,
            every: s
                .native_gate_proof
                .unwrap_or(crate::native_gate::PROOF_EVERY),
            wait: crate::discovery::PROBE_WAIT,
        };
        spawn_native_gate(
            &client,
            &leader,
            config,
            configuration,
            proof,
            shutdown.clone(),
        )
        .await;
    }
    if let Some(configuration) = s.policy_webhook {
        let (client, leader, stop) = (client.clone(), leader.clone(), shutdown.clone());
        tokio::spawn(crate::registration::run(
            client,
            leader,
            configuration,
            Duration::from_secs(60),
            stop,
        ));
    }
    futures::join!(
        crate::nodegate::run(
            client.clone(),
            leader.clone(),
            metrics,
            s.node_gate,
            shutdown.clone(),
        ),
        crate::policies::run_with(
            client.clone(),
            leader.clone(),
            policy_settings,
            shutdown.clone()
        ),
        crate::repair::run(
            client.clone(),
            s.evictions
                .unwrap_or_else(|| crate::repair::EvictionClient(client)),
            leader,
            s.repair,
            repair_metrics,
            shutdown
        ),
    );
    Ok(())
}

/// The native gate's loop, where the API server serves the policy API.
async fn spawn_native_gate(
    client: &kube::Client,
    leader: &crate::leader::Leader,
    config: meshgate_api::GateConfig,
    configuration: String,
    proof: crate::native_gate::Proof,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    match crate::discovery::policy_api(client).await {
        Some(api) => {
            let settings = crate::native_gate::Settings {
                config,
                configuration,
                api,
                proof,
            };
            tokio::spawn(crate::native_gate::run(
                client.clone(),
                leader.clone(),
                settings,
                Duration::from_secs(60),
                stop,
            ));
        }
        None => tracing::warn!(
            "native gate: the API server serves no MutatingAdmissionPolicy API; the webhook gates every pod"
        ),
    }
}

/// The policy controller's settings; with native policies, the admission policy API the API
/// server serves (none: every policy stays on the webhook).
async fn policy_settings(
    client: &kube::Client,
    excluded_namespaces: Option<Vec<String>>,
    backfill: bool,
    native_policies: bool,
) -> crate::policies::Settings {
    let mut policy_settings = crate::policies::Settings::default();
    if let Some(excluded) = excluded_namespaces {
        policy_settings.excluded_namespaces = excluded;
    }
    policy_settings.backfill = backfill;
    if native_policies {
        policy_settings.native = crate::discovery::policy_api(client).await;
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
    policy_settings
}

fn axum_router(metrics: crate::Metrics) -> axum::Router {
    use axum::routing::get;
    let synced = metrics.synced.clone();
    axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        // Ready once the node gate's caches have their first full list (before that the
        // controller decides nothing; see crate::nodegate).
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

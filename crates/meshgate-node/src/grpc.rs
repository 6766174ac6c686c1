//! The gRPC services: registration, DRA v1 prepare/unprepare, and the DRA health stream.

use std::path::Path;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

use crate::proto::dra_health_v1alpha1::{
    NodeWatchResourcesRequest, NodeWatchResourcesResponse,
    dra_resource_health_server::DraResourceHealth,
};
use crate::proto::dra_v1::{
    Claim, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
    dra_plugin_server::DraPlugin,
};
use crate::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_server::Registration as RegistrationService,
};
use crate::proto::{DRA_PLUGIN_TYPE, DRA_V1_SERVICE};
use crate::readiness::Checker;
use crate::{Settings, stopped};

/// What the kubelet last said about the registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Registration {
    /// Not told yet.
    Pending,
    Registered,
    /// The kubelet's error.
    Rejected(String),
}

/// The state the services share.
pub struct State {
    driver: String,
    endpoint: String,
    prepare_wait: Duration,
    poll: Duration,
    pub checker: Checker,
    registration: Mutex<Registration>,
    stop: watch::Receiver<bool>,
    /// The sockets the kubelet reaches the plugin through (the registration socket, the DRA
    /// socket): the health endpoints check they are still there.
    pub sockets: Vec<std::path::PathBuf>,
}

impl State {
    pub fn new(
        settings: &Settings,
        dra_socket: &Path,
        checker: Checker,
        stop: watch::Receiver<bool>,
    ) -> Self {
        State {
            driver: settings.driver.clone(),
            // Validated to be UTF-8. The kubelet dials "unix:" + this path.
            endpoint: dra_socket.to_string_lossy().into_owned(),
            prepare_wait: settings.prepare_wait,
            poll: settings.poll,
            checker,
            registration: Mutex::new(Registration::Pending),
            stop,
            sockets: Vec::new(),
        }
    }

    pub fn registration(&self) -> Registration {
        match self.registration.lock() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set_registration(&self, r: Registration) {
        match self.registration.lock() {
            Ok(mut guard) => *guard = r,
            Err(poisoned) => *poisoned.into_inner() = r,
        }
    }

    /// Waits until the node is ready, at most `wait`.
    async fn wait_ready(&self, wait: Duration, claims: &str, last: &mut Option<String>) -> Outcome {
        let deadline = Instant::now() + wait;
        let stop = stopped(self.stop.clone());
        tokio::pin!(stop);
        loop {
            let readiness = tokio::select! {
                r = self.checker.check() => r,
                () = tokio::time::sleep_until(deadline) => {
                    return Outcome::TimedOut(last.clone().unwrap_or_else(|| {
                        "the mesh is not ready on this node: the check did not finish".to_string()
                    }));
                }
                () = &mut stop => return Outcome::Stopping,
            };
            if readiness.is_ready() {
                return Outcome::Ready;
            }
            let reason = readiness.to_string();
            if last.is_none() {
                // Once per call, at INFO: why a pod's sandbox is not created yet.
                info!("{claims}: waiting, the pod's sandbox is held: {reason}");
            }
            *last = Some(reason.clone());
            let now = Instant::now();
            if now >= deadline {
                return Outcome::TimedOut(reason);
            }
            debug!("{claims}: {reason}; checking again in {:?}", self.poll);
            tokio::select! {
                () = tokio::time::sleep_until((now + self.poll).min(deadline)) => {}
                () = &mut stop => return Outcome::Stopping,
            }
        }
    }
}

enum Outcome {
    Ready,
    /// The last reason.
    TimedOut(String),
    Stopping,
}

/// `claim ns/name` or `claims ns/a, ns/b`, for the log.
fn claim_names(claims: &[Claim]) -> String {
    let names: Vec<String> = claims
        .iter()
        .map(|c| format!("{}/{}", c.namespace, c.name))
        .collect();
    let noun = if names.len() == 1 { "claim" } else { "claims" };
    format!("{noun} {}", names.join(", "))
}

/// The client's deadline from the `grpc-timeout` header (`<digits><H|M|S|m|u|n>`).
fn grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How long to wait: `prepare_wait`, or less when the client's deadline comes first (with time
/// left to send the answer).
fn wait_for(prepare_wait: Duration, client_timeout: Option<Duration>) -> Duration {
    match client_timeout {
        Some(t) => {
            let margin = (t / 10).min(Duration::from_millis(500));
            prepare_wait.min(t.saturating_sub(margin))
        }
        None => prepare_wait,
    }
}

/// Logs a prepare the kubelet gave up on (its future dropped before it answered).
struct Pending<'a> {
    claims: &'a str,
    started: Instant,
    last: Option<String>,
    answered: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.answered {
            let reason = self
                .last
                .as_deref()
                .unwrap_or("the node had not been checked yet");
            info!(
                "{}: the kubelet stopped waiting after {}ms ({reason})",
                self.claims,
                self.started.elapsed().as_millis()
            );
        }
    }
}

#[tonic::async_trait]
impl RegistrationService for State {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        debug!("the kubelet asked for the plugin's info");
        Ok(Response::new(PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_string(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec![DRA_V1_SERVICE.to_string()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            info!(
                driver = %self.driver,
                "the kubelet registered the DRA plugin {} at {}", self.driver, self.endpoint
            );
            self.set_registration(Registration::Registered);
        } else {
            let error = if status.error.is_empty() {
                "(no error given)".to_string()
            } else {
                status.error
            };
            warn!(
                driver = %self.driver,
                "the kubelet did not register the DRA plugin {}: {error}", self.driver
            );
            self.set_registration(Registration::Rejected(error));
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

#[tonic::async_trait]
impl DraPlugin for State {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let client_timeout = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(grpc_timeout);
        let wait = wait_for(self.prepare_wait, client_timeout);
        let claims = request.into_inner().claims;
        let names = claim_names(&claims);
        let mut pending = Pending {
            claims: &names,
            started: Instant::now(),
            last: None,
            answered: false,
        };
        let outcome = self.wait_ready(wait, &names, &mut pending.last).await;
        pending.answered = true;
        let elapsed = pending.started.elapsed();
        let error = match outcome {
            Outcome::Ready => {
                info!("{names}: mesh ready after {}ms", elapsed.as_millis());
                String::new()
            }
            Outcome::TimedOut(reason) => {
                info!("{names}: still not ready after {wait:?}: {reason}");
                format!("{reason} (waited {wait:?})")
            }
            Outcome::Stopping => {
                let reason = pending
                    .last
                    .clone()
                    .unwrap_or_else(|| "the node had not been checked yet".to_string());
                info!("{names}: the plugin is stopping; answered not ready");
                format!(
                    "the meshgate DRA plugin is stopping; not prepared after {}ms ({reason})",
                    elapsed.as_millis()
                )
            }
        };
        let claims = claims
            .into_iter()
            .map(|c| {
                (
                    c.uid,
                    NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error: error.clone(),
                    },
                )
            })
            .collect();
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims;
        debug!("{}: unprepared (nothing to undo)", claim_names(&claims));
        let claims = claims
            .into_iter()
            .map(|c| (c.uid, NodeUnprepareResourceResponse::default()))
            .collect();
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl DraResourceHealth for State {
    type NodeWatchResourcesStream = HealthStream;

    /// One response listing no devices (the plugin allocates none it could check), then the
    /// stream stays open until the plugin stops or the kubelet closes it.
    async fn node_watch_resources(
        &self,
        _: Request<NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        debug!("the kubelet watches the devices' health");
        let first = futures::stream::once(async {
            Ok(NodeWatchResourcesResponse {
                devices: Vec::new(),
            })
        });
        let open =
            futures::stream::once(stopped(self.stop.clone())).filter_map(|()| async { None });
        Ok(Response::new(Box::pin(first.chain(open))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_grpc_timeouts() {
        assert_eq!(
            grpc_timeout("44999958u"),
            Some(Duration::from_micros(44_999_958))
        );
        assert_eq!(grpc_timeout("45S"), Some(Duration::from_secs(45)));
        assert_eq!(grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(grpc_timeout("300m"), Some(Duration::from_millis(300)));
        assert_eq!(grpc_timeout("7n"), Some(Duration::from_nanos(7)));
        for bad in ["", "S", "5", "5s", "-5S", "123456789S", "1.5S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_wait_ends_before_the_clients_deadline() {
        let thirty = Duration::from_secs(30);
        assert_eq!(wait_for(thirty, None), thirty);
        assert_eq!(wait_for(thirty, Some(Duration::from_secs(45))), thirty);
        assert_eq!(
            wait_for(thirty, Some(Duration::from_secs(10))),
            Duration::from_millis(9500)
        );
        assert_eq!(
            wait_for(thirty, Some(Duration::from_secs(1))),
            Duration::from_millis(900)
        );
    }
}

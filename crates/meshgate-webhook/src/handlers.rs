//! The HTTP side of admission (like Kubewarden's `src/api/`): the routes, a review decoded and
//! answered for each path, the limits (body size, requests in flight, timeout), the health and
//! metrics routes. The decisions are `meshgate-core`'s; the server that runs these routes is
//! [`crate::server`].

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::routing::get;
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use meshgate_core::gate::PodPlan;
use meshgate_core::patch::JsonPatch;
use meshgate_core::registration::paths;
use meshgate_core::view::{Obj, PodView};
use tracing::Instrument;

use crate::admission::{self, Request, ReviewError};
use crate::metrics::{MutationLabels, PathLabels, ReviewLabels};

use crate::app::{App, Handled};

/// Request bodies over this size get 413. The largest object the API server stores is etcd's
/// request limit (1.5 MiB by default), and a review of an UPDATE carries two of them (`object`
/// and `oldObject`) plus the request's fields: 3.5 MiB holds that with room for JSON escaping.
pub const MAX_BODY: usize = 3 * 1024 * 1024 + 512 * 1024;

/// Reviews of the gates (pod gate and node taint) answered at once by default; more get an
/// immediate 429 (see [`ServerOptions`]). The policies route has a limit of its own, half of it
/// ([`policy_limit`]), so that slow policies (an `apiCall` context entry waits up to 2 s, and a
/// tenant can write one) never take the gate's capacity. With [`MAX_BODY`] the two bound the
/// memory held by request bodies (48 × 3.5 MiB in the worst case, a few MiB for real pods);
/// `install` sizes the container's memory limit for it.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 32;

/// The policies route's limit for a gate limit of `max_in_flight`.
pub fn policy_limit(max_in_flight: usize) -> usize {
    (max_in_flight / 2).max(1)
}

/// An answer of the admission port.
pub type Reply = http::Response<Full<Bytes>>;

/// One review in the in-flight gauge, from its creation until it is dropped: a review whose
/// future the request timeout drops leaves the gauge too.
struct InFlight(prometheus_client::metrics::gauge::Gauge);

impl InFlight {
    fn new(gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The admission routes (served over TLS), as one service: no router, no per-request layers
/// (they cost more than the review itself; see BENCHMARKS.md). Per request, in this order:
/// the path (404) and method (405), the route's in-flight limit (at most `max_in_flight` gate
/// reviews and [`policy_limit`] policy reviews at once, body reading included; one more gets
/// `429 Too Many Requests` at once: no queue, the API
/// server's timeout would expire in a queue, and a fast refusal lets it apply the failure policy
/// right away), then within `request_timeout` (else 503) the body (over [`MAX_BODY`]: 413) and
/// the review; a handler that panics gets 500 and the server goes on.
#[derive(Clone)]
pub struct Admission(Arc<AdmissionInner>);

struct AdmissionInner {
    app: App,
    /// The pod gate's and the node taint's.
    gate_permits: tokio::sync::Semaphore,
    /// The policies'.
    policy_permits: tokio::sync::Semaphore,
    request_timeout: Duration,
}

#[derive(Clone, Copy)]
enum Route {
    PodGate,
    Policies,
    NodeTaint,
}

impl Admission {
    pub fn new(app: App, request_timeout: Duration, max_in_flight: usize) -> Self {
        Self(Arc::new(AdmissionInner {
            app,
            gate_permits: tokio::sync::Semaphore::new(max_in_flight.max(1)),
            policy_permits: tokio::sync::Semaphore::new(policy_limit(max_in_flight)),
            request_timeout,
        }))
    }

    async fn handle(self, request: http::Request<hyper::body::Incoming>) -> Reply {
        let route = match request.uri().path() {
            paths::POD_GATE => Route::PodGate,
            paths::POLICIES => Route::Policies,
            paths::NODE_TAINT => Route::NodeTaint,
            _ => return empty(StatusCode::NOT_FOUND),
        };
        if request.method() != Method::POST {
            let mut reply = empty(StatusCode::METHOD_NOT_ALLOWED);
            reply
                .headers_mut()
                .insert(header::ALLOW, http::HeaderValue::from_static("POST"));
            return reply;
        }
        let this = &*self.0;
        let permits = match route {
            Route::PodGate | Route::NodeTaint => &this.gate_permits,
            Route::Policies => &this.policy_permits,
        };
        let Ok(permit) = permits.try_acquire() else {
            this.app.metrics.overloaded.inc();
            return plain(
                StatusCode::TOO_MANY_REQUESTS,
                "overloaded: too many reviews in flight\n".to_owned(),
            );
        };
        let work = AssertUnwindSafe(this.answer(route, request)).catch_unwind();
        let reply = match tokio::time::timeout(this.request_timeout, work).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => plain(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the review handler failed\n".to_owned(),
            ),
            Err(_) => empty(StatusCode::SERVICE_UNAVAILABLE),
        };
        drop(permit);
        reply
    }
}

impl AdmissionInner {
    async fn answer(&self, route: Route, request: http::Request<hyper::body::Incoming>) -> Reply {
        let (parts, body) = request.into_parts();
        let too_long = || {
            plain(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body over the length limit of {MAX_BODY} bytes\n"),
            )
        };
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX_BODY as u64) {
            return too_long();
        }
        let body = match Limited::new(body, MAX_BODY).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => return too_long(),
            Err(e) => {
                return plain(
                    StatusCode::BAD_REQUEST,
                    format!("reading the request body: {e}\n"),
                );
            }
        };
        let app = &self.app;
        let headers = &parts.headers;
        match route {
            Route::PodGate => pod_gate(app, headers, &body).await,
            Route::Policies => policies(app, headers, &body).await,
            Route::NodeTaint => node_taint(app, headers, &body).await,
        }
    }
}

impl tower::Service<http::Request<hyper::body::Incoming>> for Admission {
    type Response = Reply;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Reply, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<hyper::body::Incoming>) -> Self::Future {
        Box::pin(self.clone().handle(request).map(Ok))
    }
}

/// A review's namespace: from the cache, else read once (a namespace created a moment ago);
/// never a refusal: a namespace that cannot be read at all (the API server unreachable from
/// the webhook) is decided without its labels and annotations, logged, counted
/// (`namespace_unread`), with a warning for the client.
pub(crate) async fn namespace_or_empty(
    app: &App,
    name: &str,
) -> (Arc<meshgate_core::select::Meta>, Vec<String>) {
    // The hot path: one cache lookup.
    if let Some(meta) = app.sources.cached_namespace(name) {
        return (meta, Vec::new());
    }
    app.metrics.namespace_reads.inc();
    match app.sources.namespace(name).await {
        Ok(meta) => (meta, Vec::new()),
        Err(e) => {
            tracing::warn!(error = %e, "deciding without the namespace's labels");
            app.metrics.namespace_unread.inc();
            (
                Arc::default(),
                vec![format!(
                    "meshgate could not read namespace {name:?}: decided without its labels"
                )],
            )
        }
    }
}

/// `/healthz`, `/readyz`, `/metrics` (plain HTTP).
pub fn health_router(app: App) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|State(app): State<App>| async move {
                if app.serving.load(Ordering::Acquire) {
                    (StatusCode::OK, "ok")
                } else {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the admission server has stopped",
                    )
                }
            }),
        )
        .route(
            "/readyz",
            get(|State(app): State<App>| async move {
                if app.ready.load(Ordering::Acquire) && app.sources.ready() {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(app): State<App>| async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    app.metrics.encode(),
                )
            }),
        )
        .with_state(app)
}

fn reply(status: StatusCode, content_type: Option<&'static str>, body: Bytes) -> Reply {
    let mut reply = http::Response::new(Full::new(body));
    *reply.status_mut() = status;
    if let Some(t) = content_type {
        reply
            .headers_mut()
            .insert(header::CONTENT_TYPE, http::HeaderValue::from_static(t));
    }
    reply
}

fn empty(status: StatusCode) -> Reply {
    reply(status, None, Bytes::new())
}

fn plain(status: StatusCode, message: String) -> Reply {
    reply(
        status,
        Some("text/plain; charset=utf-8"),
        Bytes::from(message),
    )
}

fn json_response(body: Vec<u8>) -> Reply {
    reply(StatusCode::OK, Some("application/json"), Bytes::from(body))
}

/// Reads the body as a review (`request.object` read as `O`, see [`admission::Object`]),
/// handles it with `f`, and records metrics. `f` returns the patch, warnings and the outcome
/// word for metrics. `scratch` holds the body's normalised text when it has to be read through
/// a `Value` (see [`admission::decode`]).
async fn serve<'b, O, F, Fut>(
    app: &App,
    path: &'static str,
    headers: &HeaderMap,
    body: &'b [u8],
    scratch: &'b mut Option<String>,
    f: F,
) -> Reply
where
    O: admission::Object<'b>,
    F: FnOnce(Request<'b, O>) -> Fut,
    Fut: Future<Output = Result<Handled, (u16, String)>>,
{
    let start = Instant::now();
    // Counted until the review ends or is dropped (a review over the timeout is dropped).
    let in_flight = InFlight::new(&app.metrics.in_flight);
    let (response, outcome) = review(headers, body, scratch, f).await;
    drop(in_flight);
    app.metrics
        .reviews
        .get_or_create(&ReviewLabels { path, outcome })
        .inc();
    app.metrics
        .latency
        .get_or_create(&PathLabels { path })
        .observe(start.elapsed().as_secs_f64());
    response
}

async fn review<'b, O, F, Fut>(
    headers: &HeaderMap,
    body: &'b [u8],
    scratch: &'b mut Option<String>,
    f: F,
) -> (Reply, &'static str)
where
    O: admission::Object<'b>,
    F: FnOnce(Request<'b, O>) -> Fut,
    Fut: Future<Output = Result<Handled, (u16, String)>>,
{
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    if !essence.eq_ignore_ascii_case("application/json") {
        return (
            plain(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("content type {content_type:?} is not application/json"),
            ),
            "invalid",
        );
    }
    let request = match admission::decode_as::<O>(body, scratch) {
        Ok(r) => r,
        Err(e @ (ReviewError::NotJson(_) | ReviewError::Unanswerable(_))) => {
            return (plain(StatusCode::BAD_REQUEST, e.to_string()), "invalid");
        }
        Err(ReviewError::Invalid { uid, message }) => {
            return (
                json_response(admission::deny(&uid, 400, &message)),
                "invalid",
            );
        }
    };
    let uid = request.uid.clone().into_owned();
    // The span costs a fifth of a review's CPU with the JSON log layer (it formats its fields
    // when created), so it is a debug span: at the default level, reviews that are answered
    // normally log nothing, and what is logged at info and above names the review itself.
    let (kind, operation, namespace) = (
        request.kind.clone(),
        request.operation,
        request.namespace.clone(),
    );
    let span = tracing::debug_span!(
        "review",
        uid = %request.uid,
        kind = %request.kind,
        operation = %request.operation,
        namespace = %request.namespace,
        name = tracing::field::Empty,
        dry_run = request.dry_run,
        decision = tracing::field::Empty,
    );
    if !request.name.is_empty() {
        span.record("name", &*request.name);
    }
    let result = f(request).instrument(span.clone()).await;
    match result {
        Ok(h) => {
            span.record("decision", h.outcome);
            span.in_scope(|| tracing::debug!(ops = h.patch.len(), "answered"));
            (
                json_response(admission::allow(&uid, &h.patch, &h.warnings)),
                h.outcome,
            )
        }
        Err((code, message)) => {
            span.in_scope(|| {
                tracing::warn!(%uid, %kind, operation, %namespace, code, %message, "refused");
            });
            (
                json_response(admission::deny(&uid, code, &message)),
                "error",
            )
        }
    }
}

async fn pod_gate(app: &App, headers: &HeaderMap, body: &Bytes) -> Reply {
    let mut scratch = None;
    // The pod is read as a lean view, in the same pass as the review: no `Value` of the pod.
    serve::<Obj<PodView<'_>>, _, _>(
        app,
        paths::POD_GATE,
        headers,
        body,
        &mut scratch,
        |req| async move {
            if req.kind != "Pod" {
                return Ok(Handled::unchanged("not-a-pod"));
            }
            let (ns, warnings) = namespace_or_empty(app, &req.namespace).await;
            let limits = app.sources.limit_ranges(&req.namespace);
            // Not a JSON object (a DELETE's `null`): read as an empty pod.
            let empty = PodView::default();
            let pod = req.object.0.as_ref().unwrap_or(&empty);
            admission::record_name(&req, pod.name());
            let plan = app
                .planner
                .plan_view(req.operation, &req.namespace, &ns, &limits, pod);
            let outcome = plan.decision();
            let (patch, gated) = match plan {
                PodPlan::Skip(_) => (JsonPatch::default(), false),
                PodPlan::Mutate { patch, verdict, .. } => (patch, verdict.is_ok()),
            };
            // A pod the gate leaves alone may still get its verdict annotation: only gates count.
            if gated && !patch.is_empty() && !req.dry_run {
                app.metrics
                    .mutations
                    .get_or_create(&MutationLabels {
                        mutation: "init-gate",
                    })
                    .inc();
            }
            Ok(Handled {
                patch,
                warnings,
                outcome,
            })
        },
    )
    .await
}

async fn node_taint(app: &App, headers: &HeaderMap, body: &Bytes) -> Reply {
    let mut scratch = None;
    serve(
        app,
        paths::NODE_TAINT,
        headers,
        body,
        &mut scratch,
        |req| async move {
            if req.kind != "Node" || req.operation != "CREATE" {
                return Ok(Handled::unchanged("skipped"));
            }
            let object = admission::object_value(&req)?;
            let gates = app.sources.node_gates();
            let patch = meshgate_core::nodegate::taints_on_create(gates.iter(), &object);
            let outcome = if patch.is_empty() {
                "unchanged"
            } else {
                "mutated"
            };
            if !patch.is_empty() && !req.dry_run {
                app.metrics
                    .mutations
                    .get_or_create(&MutationLabels {
                        mutation: "node-taint",
                    })
                    .inc();
            }
            Ok(Handled {
                patch,
                warnings: vec![],
                outcome,
            })
        },
    )
    .await
}

async fn policies(app: &App, headers: &HeaderMap, body: &Bytes) -> Reply {
    let mut scratch = None;
    serve(
        app,
        paths::POLICIES,
        headers,
        body,
        &mut scratch,
        |req| async move { crate::policies::handle(app, req).await },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt;

    async fn status_of(app: &App, path: &str) -> StatusCode {
        let request = http::Request::get(path)
            .body(axum::body::Body::empty())
            .expect("request");
        health_router(app.clone())
            .oneshot(request)
            .await
            .expect("answer")
            .status()
    }

    /// Liveness follows the admission server: once it has stopped, `/healthz` fails (and the
    /// process exits, `meshgate webhook`), so the kubelet restarts it.
    #[tokio::test]
    async fn healthz_fails_once_the_admission_server_stopped() {
        let app = App::new(
            meshgate_api::GateConfig::default(),
            crate::Sources::fixed(Default::default(), vec![], vec![]),
            crate::metrics::Metrics::new(),
        );
        assert_eq!(status_of(&app, "/healthz").await, StatusCode::OK);
        app.serving.store(false, Ordering::Release);
        assert_eq!(
            status_of(&app, "/healthz").await,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}

//! The HTTP side of admission (like Kubewarden's `src/api/`): the routes, a review decoded and
//! answered for each path, the limits (body size, requests in flight, timeout), the health and
//! metrics routes. The decisions are `meshgate-core`'s; the server that runs these routes is
//! [`crate::server`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use meshgate_core::gate::PodPlan;
use meshgate_core::patch::JsonPatch;
use meshgate_core::registration::paths;
use meshgate_core::view::read_pod;
use serde_json::Value;
use tracing::Instrument;

use crate::admission::{self, Request, ReviewError};
use crate::metrics::{MutationLabels, PathLabels, ReviewLabels};

use crate::app::{App, Handled};

/// Request bodies over this size get 413. The largest object the API server stores is etcd's
/// request limit (1.5 MiB by default), and a review of an UPDATE carries two of them (`object`
/// and `oldObject`) plus the request's fields: 3.5 MiB holds that with room for JSON escaping.
pub const MAX_BODY: usize = 3 * 1024 * 1024 + 512 * 1024;

/// Reviews answered at once by default; more get an immediate 429 (see [`ServerOptions`]).
/// With [`MAX_BODY`] this bounds the memory held by request bodies (32 × 3.5 MiB in the worst
/// case, a few MiB for real pods); `install` sizes the container's memory limit for it.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 32;

/// The admission routes (served over TLS). At most `max_in_flight` requests are handled at
/// once, body reading included; one more gets `429 Too Many Requests` at once (no queue: the API
/// server's timeout would expire in a queue, and a fast refusal lets it apply the failure
/// policy right away).
pub fn router(app: App, request_timeout: Duration, max_in_flight: usize) -> Router {
    let permits = Arc::new(tokio::sync::Semaphore::new(max_in_flight.max(1)));
    let overloaded = app.metrics.overloaded.clone();
    Router::new()
        .route(paths::POD_GATE, post(pod_gate))
        .route(paths::POLICIES, post(policies))
        .route(paths::NODE_TAINT, post(node_taint))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            request_timeout,
        ))
        .layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let permits = permits.clone();
                let overloaded = overloaded.clone();
                async move {
                    match permits.try_acquire_owned() {
                        Ok(permit) => {
                            let response = next.run(request).await;
                            drop(permit);
                            response
                        }
                        Err(_) => {
                            overloaded.inc();
                            plain(
                                StatusCode::TOO_MANY_REQUESTS,
                                "overloaded: too many reviews in flight\n".to_owned(),
                            )
                        }
                    }
                }
            },
        ))
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
        .with_state(app)
}

/// `/healthz`, `/readyz`, `/metrics` (plain HTTP).
pub fn health_router(app: App) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
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

fn plain(status: StatusCode, message: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        message,
    )
        .into_response()
}

fn json_response(v: &Value) -> Response {
    let body = serde_json::to_vec(v).unwrap_or_default();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Reads the body as a review, handles it with `f`, and records metrics. `f` returns the patch,
/// warnings, the outcome word for metrics and the mutation kinds applied.
async fn serve<F>(
    app: &App,
    path: &'static str,
    headers: &HeaderMap,
    body: &Bytes,
    f: F,
) -> Response
where
    F: AsyncFnOnce(Request<'_>) -> Result<Handled, (u16, String)>,
{
    let start = Instant::now();
    app.metrics.in_flight.inc();
    let (response, outcome) = review(headers, body, f).await;
    app.metrics.in_flight.dec();
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

async fn review<F>(headers: &HeaderMap, body: &Bytes, f: F) -> (Response, &'static str)
where
    F: AsyncFnOnce(Request<'_>) -> Result<Handled, (u16, String)>,
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
    let mut scratch = None;
    let request = match admission::decode(body, &mut scratch) {
        Ok(r) => r,
        Err(e @ (ReviewError::NotJson(_) | ReviewError::Unanswerable(_))) => {
            return (plain(StatusCode::BAD_REQUEST, e.to_string()), "invalid");
        }
        Err(ReviewError::Invalid { uid, message }) => {
            return (
                json_response(&admission::deny(&uid, 400, &message)),
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
                json_response(&admission::allow(&uid, &h.patch, &h.warnings)),
                h.outcome,
            )
        }
        Err((code, message)) => {
            span.in_scope(|| {
                tracing::warn!(%uid, %kind, operation, %namespace, code, %message, "refused");
            });
            (
                json_response(&admission::deny(&uid, code, &message)),
                "error",
            )
        }
    }
}

async fn pod_gate(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let a = app.clone();
    serve(&app, paths::POD_GATE, &headers, &body, async |req| {
        if req.kind != "Pod" {
            return Ok(Handled {
                patch: JsonPatch::default(),
                warnings: vec![],
                outcome: "not-a-pod",
            });
        }
        let ns = a
            .sources
            .namespace(&req.namespace)
            .await
            .map_err(|e| (500, e.to_string()))?;
        let limits = a.sources.limit_ranges(&req.namespace);
        // The pod is read as a lean view of the object's text: no `Value` of the whole pod.
        let plan = read_pod(req.object.get(), |pod| {
            admission::record_name(&req, pod.name());
            a.planner
                .plan_view(req.operation, &req.namespace, &ns, &limits, pod)
        })
        .map_err(|e| (400, format!("request.object: {e}")))?;
        let outcome = plan.decision();
        let (patch, gated) = match plan {
            PodPlan::Skip(_) => (JsonPatch::default(), false),
            PodPlan::Mutate { patch, verdict, .. } => (patch, verdict.is_ok()),
        };
        // A pod the gate leaves alone may still get its verdict annotation: only gates count.
        if gated && !patch.is_empty() && !req.dry_run {
            a.metrics
                .mutations
                .get_or_create(&MutationLabels {
                    mutation: "init-gate",
                })
                .inc();
        }
        Ok(Handled {
            patch,
            warnings: vec![],
            outcome,
        })
    })
    .await
}

async fn node_taint(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let a = app.clone();
    serve(&app, paths::NODE_TAINT, &headers, &body, async |req| {
        if req.kind != "Node" || req.operation != "CREATE" {
            return Ok(Handled {
                patch: JsonPatch::default(),
                warnings: vec![],
                outcome: "skipped",
            });
        }
        let object = admission::object_value(&req)?;
        let gates = a.sources.node_gates();
        let patch = meshgate_core::nodegate::taints_on_create(gates.iter(), &object);
        let outcome = if patch.is_empty() {
            "unchanged"
        } else {
            "mutated"
        };
        if !patch.is_empty() && !req.dry_run {
            a.metrics
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
    })
    .await
}

async fn policies(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let a = app.clone();
    serve(&app, paths::POLICIES, &headers, &body, async |req| {
        crate::policies::handle(&a, req).await
    })
    .await
}

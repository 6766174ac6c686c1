//! The HTTPS admission server and the plain health/metrics server.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use meshgate_api::GateConfig;
use meshgate_core::gate::{Planner, PodPlan};
use meshgate_core::patch::JsonPatch;
use meshgate_core::registration::paths;
use meshgate_core::view::read_pod;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tracing::Instrument;

use crate::admission::{self, Request, ReviewError};
use crate::metrics::{MutationLabels, PathLabels, ReviewLabels};
use crate::tls::{self, CertFiles};
use crate::{Sources, metrics::Metrics};

/// Request bodies over this size get 413. The largest object the API server stores is etcd's
/// request limit (1.5 MiB by default), and a review of an UPDATE carries two of them (`object`
/// and `oldObject`) plus the request's fields: 3.5 MiB holds that with room for JSON escaping.
pub const MAX_BODY: usize = 3 * 1024 * 1024 + 512 * 1024;

/// Reviews answered at once by default; more get an immediate 429 (see [`ServerOptions`]).
/// With [`MAX_BODY`] this bounds the memory held by request bodies (32 × 3.5 MiB in the worst
/// case, a few MiB for real pods); `install` sizes the container's memory limit for it.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 32;

/// What a review handler needs.
#[derive(Clone, Debug)]
pub struct App {
    pub config: Arc<GateConfig>,
    /// The init gate's planning for `config`, built once.
    pub planner: Arc<Planner>,
    pub sources: Sources,
    pub metrics: Metrics,
    ready: Arc<AtomicBool>,
}

impl App {
    pub fn new(config: GateConfig, sources: Sources, metrics: Metrics) -> Self {
        Self {
            planner: Arc::new(Planner::new(&config)),
            config: Arc::new(config),
            sources,
            metrics,
            ready: Arc::new(AtomicBool::new(true)),
        }
    }
}

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

/// The result of a handler.
pub struct Handled {
    pub patch: JsonPatch,
    pub warnings: Vec<String>,
    pub outcome: &'static str,
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

/// Records the object's name in the review span when the request did not carry one (objects
/// named by the API server from `generateName`).
fn record_name(req: &Request<'_>, name: &str) {
    if req.name.is_empty() && !name.is_empty() {
        tracing::Span::current().record("name", name);
    }
}

/// `request.object` as a `Value`, or the refusal to answer with.
pub(crate) fn object_value(req: &Request<'_>) -> Result<Value, (u16, String)> {
    let object = req
        .object_value()
        .map_err(|e| (400, format!("request.object: {e}")))?;
    record_name(req, admission::object_name(&object));
    Ok(object)
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
            record_name(&req, pod.name());
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
        let object = object_value(&req)?;
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

/// How to run the server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// HTTPS address for reviews.
    pub addr: SocketAddr,
    /// Plain HTTP address for health and metrics.
    pub health_addr: SocketAddr,
    pub certs: CertFiles,
    pub cert_poll_interval: Duration,
    pub request_timeout: Duration,
    /// Requests handled at once (body reading included); more get 429 at once.
    pub max_in_flight: usize,
    /// How long in-flight reviews may take to finish after SIGTERM.
    pub shutdown_grace: Duration,
}

/// Server errors.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serving: {0}")]
    Serve(std::io::Error),
}

/// Connections taken but not yet read from.
///
/// axum-server's graceful shutdown drops such connections unanswered (those still in the TLS
/// handshake, and those hyper has not yet read far enough to tell HTTP/1 from HTTP/2), although
/// their client may already have sent a review. [`Server::shutdown`] therefore first stops taking
/// connections and waits for the taken ones to be read from.
#[derive(Clone, Default)]
struct Fresh(Arc<FreshState>);

#[derive(Default)]
struct FreshState {
    draining: AtomicBool,
    count: AtomicUsize,
}

impl Fresh {
    /// Stops taking connections; waits (at most `limit`) until every taken one has been read from.
    async fn drain(&self, limit: Duration) {
        self.0.draining.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + limit;
        while self.0.count.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Counts one connection in [`Fresh`] until dropped.
struct FreshGuard(Fresh);

impl FreshGuard {
    fn new(fresh: &Fresh) -> Self {
        fresh.0.count.fetch_add(1, Ordering::SeqCst);
        Self(fresh.clone())
    }
}

impl Drop for FreshGuard {
    fn drop(&mut self) {
        self.0.0.count.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Wraps the TLS acceptor: counts each connection in [`Fresh`] until its first read, and
/// closes new connections once draining.
#[derive(Clone)]
struct FreshAcceptor<A> {
    inner: A,
    fresh: Fresh,
}

impl<A, I, S> axum_server::accept::Accept<I, S> for FreshAcceptor<A>
where
    A: axum_server::accept::Accept<I, S>,
    A::Future: Send + 'static,
    A::Stream: Send + 'static,
    A::Service: Send + 'static,
{
    type Stream = FirstRead<A::Stream>;
    type Service = A::Service;
    type Future =
        futures::future::BoxFuture<'static, std::io::Result<(Self::Stream, Self::Service)>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        // Count first, then check: `drain` sets the flag first, then reads the count.
        let guard = FreshGuard::new(&self.fresh);
        if self.fresh.0.draining.load(Ordering::SeqCst) {
            return Box::pin(std::future::ready(Err(std::io::Error::other(
                "shutting down",
            ))));
        }
        let accept = self.inner.accept(stream, service);
        Box::pin(async move {
            let (inner, service) = accept.await?;
            Ok((
                FirstRead {
                    inner,
                    fresh: Some(guard),
                    linger: None,
                },
                service,
            ))
        })
    }
}

/// How long a connection whose side is shut down keeps reading what the client still sends
/// (see [`FirstRead::poll_shutdown`]).
const LINGER: Duration = Duration::from_secs(2);

/// A connection's stream that stops counting as fresh once data has been read from it (by
/// then hyper has the request bytes, and a graceful shutdown lets it answer them).
struct FirstRead<S> {
    inner: S,
    fresh: Option<FreshGuard>,
    /// Set once the write side is shut down: the end of the lingering read.
    linger: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstRead<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.fresh = None;
        }
        polled
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for FirstRead<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    /// Shuts down the write side (TLS close_notify, then FIN), then lingers: reads and drops
    /// what the client still sends until it closes its side, at most [`LINGER`]. A socket closed
    /// with unread data, or receiving data once closed, sends a reset; the API server's HTTP/2
    /// client then fails every request of the connection whose answer it has received but not
    /// yet read ("client connection force closed"), so reviews answered during a graceful
    /// shutdown were lost.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.linger.is_none() {
            std::task::ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            this.linger = Some(Box::pin(tokio::time::sleep(LINGER)));
        }
        let mut scratch = [0u8; 4096];
        loop {
            if let Some(end) = this.linger.as_mut()
                && end.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {}
                // The client closed its side (or the connection failed): nothing to wait for.
                Poll::Ready(_) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// A running webhook.
pub struct Server {
    handle: axum_server::Handle<SocketAddr>,
    fresh: Fresh,
    app: App,
    /// The bound HTTPS address.
    pub addr: SocketAddr,
    /// The bound health address.
    pub health_addr: SocketAddr,
    task: tokio::task::JoinHandle<Result<(), ServerError>>,
    /// Tasks that live as long as the server (its cache watches), ended after it.
    companions: Vec<tokio::task::AbortHandle>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds both ports, loads the certificate and starts serving in the background.
    pub async fn start(options: ServerOptions, app: App) -> Result<Self, ServerError> {
        let (tls_config, fingerprint) = tls::load(&options.certs)?;
        let bind = |addr: SocketAddr| {
            std::net::TcpListener::bind(addr).map_err(|source| ServerError::Bind { addr, source })
        };
        let listener = bind(options.addr)?;
        let addr = listener.local_addr().map_err(ServerError::Serve)?;
        let health = bind(options.health_addr)?;
        let health_addr = health.local_addr().map_err(ServerError::Serve)?;
        health.set_nonblocking(true).map_err(ServerError::Serve)?;
        listener.set_nonblocking(true).map_err(ServerError::Serve)?;
        let health = tokio::net::TcpListener::from_std(health).map_err(ServerError::Serve)?;

        let handle = axum_server::Handle::new();
        let fresh = Fresh::default();
        let reload = tokio::spawn(tls::reload_loop(
            tls_config.clone(),
            options.certs.clone(),
            fingerprint,
            options.cert_poll_interval,
            app.metrics.clone(),
        ));
        let https = axum_server::from_tcp_rustls(listener, tls_config)
            .map_err(ServerError::Serve)?
            .map(|inner| FreshAcceptor {
                inner,
                fresh: fresh.clone(),
            })
            .handle(handle.clone())
            .serve(
                router(app.clone(), options.request_timeout, options.max_in_flight)
                    .into_make_service(),
            );
        let health_router = health_router(app.clone());
        let task = tokio::spawn(async move {
            // The health port stays up until the review port has drained.
            let (drained, wait_drained) = tokio::sync::oneshot::channel::<()>();
            let health = tokio::spawn(
                axum::serve(health, health_router)
                    .with_graceful_shutdown(async move {
                        let _ = wait_drained.await;
                    })
                    .into_future(),
            );
            let served = https.await;
            reload.abort();
            let _ = drained.send(());
            let health = health
                .await
                .map_err(|e| ServerError::Serve(std::io::Error::other(e.to_string())))?;
            served.map_err(ServerError::Serve)?;
            health.map_err(ServerError::Serve)?;
            Ok(())
        });
        tracing::info!(%addr, %health_addr, "webhook serving");
        Ok(Self {
            handle,
            fresh,
            app,
            addr,
            health_addr,
            task,
            companions: Vec::new(),
        })
    }

    /// Graceful stop: readiness goes to 503, no new connections are accepted, in-flight reviews
    /// finish (at most `grace`), then the server ends. A connection already accepted whose
    /// request has not been read yet counts as in flight (it is read within half of `grace`).
    pub async fn shutdown(self, grace: Duration) -> Result<(), ServerError> {
        let start = Instant::now();
        self.app.ready.store(false, Ordering::Release);
        // Connections not yet read from may carry a review already: let them be read first.
        self.fresh.drain(grace / 2).await;
        self.handle
            .graceful_shutdown(Some(grace.saturating_sub(start.elapsed())));
        let served = self
            .task
            .await
            .map_err(|e| ServerError::Serve(std::io::Error::other(e.to_string())));
        for c in &self.companions {
            c.abort();
        }
        served?
    }

    /// Ends `task` (e.g. the watches that feed the server's caches) when the server shuts down.
    pub fn attach(&mut self, task: tokio::task::AbortHandle) {
        self.companions.push(task);
    }
}

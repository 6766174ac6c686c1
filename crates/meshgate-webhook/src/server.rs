//! The HTTPS admission server and the plain health/metrics server: TLS with certificate reload,
//! connection draining on shutdown. The routes are [`crate::handlers`].

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::tls::{self, CertFiles};

pub use crate::app::App;
use crate::handlers::{Admission, health_router};
pub use crate::handlers::{DEFAULT_MAX_IN_FLIGHT, MAX_BODY, policy_limit};

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

/// Connections taken but not yet read from, and whether the admission port still listens.
///
/// axum-server's graceful shutdown drops such connections unanswered (those still in the TLS
/// handshake, and those hyper has not yet read far enough to tell HTTP/1 from HTTP/2), although
/// their client may already have sent a review. [`Server::shutdown`] therefore first closes the
/// listening socket (later connections are refused at connect, which the API server reports as
/// such) and waits for the taken ones to be read from.
#[derive(Clone)]
struct Fresh(Arc<FreshState>);

struct FreshState {
    /// Turns true when draining starts; [`DrainingListener`] then closes its socket.
    draining: tokio::sync::watch::Sender<bool>,
    /// False once the listening socket is closed (every connection it gave is counted by then).
    listening: AtomicBool,
    count: AtomicUsize,
}

impl Default for Fresh {
    fn default() -> Self {
        Self(Arc::new(FreshState {
            draining: tokio::sync::watch::Sender::new(false),
            listening: AtomicBool::new(true),
            count: AtomicUsize::new(0),
        }))
    }
}

impl Fresh {
    /// Closes the listening socket; waits (at most `limit`) until it is closed and every
    /// connection taken from it has been read from.
    async fn drain(&self, limit: Duration) {
        self.0.draining.send_replace(true);
        let deadline = Instant::now() + limit;
        while (self.0.listening.load(Ordering::SeqCst) || self.0.count.load(Ordering::SeqCst) > 0)
            && Instant::now() < deadline
        {
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

/// The admission port's address as axum-server sees it: served by [`DrainingListener`].
#[derive(Clone, Debug)]
struct AdmissionAddr;

impl axum_server::Address for AdmissionAddr {
    type Stream = Counted;
    type Listener = DrainingListener;
}

/// The admission port's listening socket. When draining starts it takes the connections the
/// kernel has already completed, then closes the socket, so that a connection is either served
/// or refused at connect, never accepted and then dropped.
struct DrainingListener {
    socket: std::sync::Mutex<Option<Arc<tokio::net::TcpListener>>>,
    fresh: Fresh,
}

impl DrainingListener {
    fn socket(&self) -> Option<Arc<tokio::net::TcpListener>> {
        self.socket.lock().ok().and_then(|s| s.clone())
    }

    fn close(&self) {
        if let Ok(mut socket) = self.socket.lock() {
            *socket = None;
        }
        self.fresh.0.listening.store(false, Ordering::SeqCst);
    }

    fn counted(&self, stream: tokio::net::TcpStream) -> Counted {
        // No Nagle: a review's answer leaves in more than one TLS record when it is large, and
        // the second waited for the API server's delayed ACK (about 40 ms) with Nagle on; Go's
        // servers, Kyverno's among them, set it too. Failing to set it changes only latency.
        let _ = stream.set_nodelay(true);
        Counted {
            guard: Some(FreshGuard::new(&self.fresh)),
            stream,
        }
    }
}

/// A connection the kernel has completed and not yet handed out, taken without waiting.
fn accept_now(socket: &tokio::net::TcpListener) -> std::io::Result<Option<tokio::net::TcpStream>> {
    match socket2::SockRef::from(socket).accept() {
        Ok((stream, _)) => {
            stream.set_nonblocking(true)?;
            tokio::net::TcpStream::from_std(stream.into()).map(Some)
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

impl axum_server::AddrListener<Counted, AdmissionAddr> for DrainingListener {
    async fn bind_to(_: AdmissionAddr) -> std::io::Result<Self> {
        Err(std::io::Error::other(
            "the admission listener is bound by Server::start",
        ))
    }

    async fn accept_stream(&self) -> std::io::Result<(Counted, AdmissionAddr)> {
        let mut draining = self.fresh.0.draining.subscribe();
        loop {
            let Some(socket) = self.socket() else {
                // Closed: the server's graceful shutdown ends the accept loop.
                return std::future::pending().await;
            };
            if *draining.borrow_and_update() {
                match accept_now(&socket) {
                    Ok(Some(stream)) => return Ok((self.counted(stream), AdmissionAddr)),
                    Ok(None) => self.close(),
                    Err(e) => {
                        self.close();
                        return Err(e);
                    }
                }
                continue;
            }
            tokio::select! {
                biased;
                _ = draining.changed() => {}
                accepted = socket.accept() => {
                    return Ok((self.counted(accepted?.0), AdmissionAddr));
                }
            }
        }
    }

    fn get_local_addr(&self) -> std::io::Result<AdmissionAddr> {
        Ok(AdmissionAddr)
    }
}

/// A TCP connection counted in [`Fresh`] from the moment it is taken from the socket; the
/// count moves to [`FirstRead`] once the TLS handshake is done.
struct Counted {
    stream: tokio::net::TcpStream,
    guard: Option<FreshGuard>,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Wraps the TLS acceptor: keeps each connection counted in [`Fresh`] until its first read
/// of decrypted data.
#[derive(Clone)]
struct FreshAcceptor<A> {
    inner: A,
}

impl<A, S> axum_server::accept::Accept<Counted, S> for FreshAcceptor<A>
where
    A: axum_server::accept::Accept<tokio::net::TcpStream, S>,
    A::Future: Send + 'static,
    A::Stream: Send + 'static,
    A::Service: Send + 'static,
{
    type Stream = FirstRead<A::Stream>;
    type Service = A::Service;
    type Future =
        futures::future::BoxFuture<'static, std::io::Result<(Self::Stream, Self::Service)>>;

    fn accept(&self, stream: Counted, service: S) -> Self::Future {
        let Counted { stream, guard } = stream;
        let accept = self.inner.accept(stream, service);
        Box::pin(async move {
            let (inner, service) = accept.await?;
            Ok((
                FirstRead {
                    inner,
                    fresh: guard,
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

/// A listening socket on `addr`. The IPv6 wildcard `[::]` takes IPv4 connections too (dual
/// stack, whatever the host's `net.ipv6.bindv6only`), and on a host without IPv6 (the socket
/// family refused) falls back to `0.0.0.0`, so one default serves IPv4-only, IPv6-only and
/// dual-stack clusters.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = match Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)) {
        Err(e)
            if addr.ip() == std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
                && e.raw_os_error() == Some(libc_eafnosupport()) =>
        {
            let v4 = SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port()));
            tracing::info!(%addr, fallback = %v4, "no IPv6 on this host: listening on IPv4 only");
            return bind(v4);
        }
        other => other?,
    };
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// `EAFNOSUPPORT` (Linux): the address family is not supported (IPv6 disabled).
const fn libc_eafnosupport() -> i32 {
    97
}

/// A running webhook.
pub struct Server {
    handle: axum_server::Handle<AdmissionAddr>,
    fresh: Fresh,
    app: App,
    /// The bound HTTPS address.
    pub addr: SocketAddr,
    /// The bound health address.
    pub health_addr: SocketAddr,
    task: tokio::task::JoinHandle<Result<(), ServerError>>,
    /// Turns true when the admission server has ended (by itself, or by [`Server::shutdown`]).
    stopped: tokio::sync::watch::Receiver<bool>,
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
        let bind =
            |addr: SocketAddr| bind(addr).map_err(|source| ServerError::Bind { addr, source });
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
        let https = axum_server::Server::<AdmissionAddr>::from_listener(DrainingListener {
            socket: std::sync::Mutex::new(Some(Arc::new(
                tokio::net::TcpListener::from_std(listener).map_err(ServerError::Serve)?,
            ))),
            fresh: fresh.clone(),
        })
        .acceptor(FreshAcceptor {
            inner: axum_server::tls_rustls::RustlsAcceptor::new(tls_config.clone()),
        })
        .handle(handle.clone())
        .serve(tower::make::Shared::new(Admission::new(
            app.clone(),
            options.request_timeout,
            options.max_in_flight,
        )));
        let health_router = health_router(app.clone());
        let serving = app.serving.clone();
        let (stopped_tx, stopped) = tokio::sync::watch::channel(false);
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
            serving.store(false, Ordering::Release);
            let _ = stopped_tx.send(true);
            if let Err(e) = &served {
                tracing::error!(error = %e, "the admission server stopped");
            }
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
            stopped,
            companions: Vec::new(),
        })
    }

    /// Resolves when the admission server has ended without [`Server::shutdown`] (its listener
    /// failed): the process can no longer serve, and should exit so that it is restarted.
    pub async fn stopped(&self) {
        let mut stopped = self.stopped.clone();
        let _ = stopped.wait_for(|s| *s).await;
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

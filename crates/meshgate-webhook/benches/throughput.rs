//! Webhook throughput against a baseline HTTPS server, measured in one run side by side.
//!
//! * **baseline**: hyper 1 + tokio-rustls (ring), the webhook's own rustls configuration and
//!   certificate, answering every request with a canned AdmissionReview response: the one the
//!   webhook gives for the same review (same size). It reads the request body and nothing else:
//!   the floor of TLS plus HTTP/1.1 on this machine.
//! * **baseline+work**: the baseline server, which also does the review's own work in process
//!   for each request with the functions the webhook's pod-gate handler calls (decode the review
//!   and the pod, look up the namespace, plan, write the answer; [`Work`]) and answers what they
//!   wrote. Against it the webhook's ratio is the price of its HTTP stack alone (axum-server, the
//!   admission service's limits, metrics, the log span); against the baseline, this server's
//!   ratio is the price of the review's work when served.
//! * **webhook**: meshgate's real [`Server`] (axum + axum-server), `/mutate/pod-gate`, a ~3 KB
//!   Pod (`tools/bench/pod.json`) in a namespace labelled for Istio ambient, among 2,000 others
//!   (half with a LimitRange) in [`Sources::fixed_with_limits`], with the JSON log subscriber of the real binary at `info` (writing to a
//!   sink), so that the per-review span costs what it costs in a cluster.
//!
//! Each server runs in a child process (this binary re-executed with `MESHGATE_BENCH_ROLE`), on
//! a multi-threaded tokio runtime like `meshgate webhook`, so that its RSS and CPU time are its
//! own. The client is the same for all: `CONNECTIONS` keep-alive HTTP/1.1 connections over TLS
//! 1.3, each sending one review at a time. Per round and server: a warm-up, then `REQUESTS`
//! requests or `SECONDS` seconds, whichever ends first. Each round starts with the next server
//! in turn; a ratio reported is the median of the per-round ratios (adjacent in time, so the
//! noise of a shared machine hits them alike). After the last round each child's
//! `VmHWM`/`VmRSS` are read from `/proc/<pid>/status`.
//!
//! Run: `cargo bench -p meshgate-webhook --bench throughput`. Knobs (environment):
//! `MESHGATE_BENCH_CONNECTIONS` (16), `MESHGATE_BENCH_REQUESTS` (50000), `MESHGATE_BENCH_SECONDS`
//! (5), `MESHGATE_BENCH_ROUNDS` (5), `MESHGATE_BENCH_WARMUP` (2000),
//! `MESHGATE_BENCH_CLIENT_THREADS` (1), `MESHGATE_BENCH_LOG` (`json`; `none`: the webhook runs
//! without a log subscriber). Without `--bench` (as `cargo test --benches` runs it) it does one
//! short round as a smoke test. `MESHGATE_BENCH_STAGES_ONLY=1` runs only the review's in-process
//! stages, 20 times, for a profiler (`perf record --call-graph dwarf` on the bench binary).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use meshgate_api::{GateConfig, Profile};
use meshgate_core::gate::{PodPlan, PodRequest, plan_pod};
use meshgate_core::resources::ContainerLimits;
use meshgate_core::select::Meta;
use meshgate_testenv::measure::{cpu_time, median, memory, quantile};
use meshgate_webhook::metrics::Metrics;
use meshgate_webhook::tls::CertFiles;
use meshgate_webhook::{App, Server, ServerOptions, Sources};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

/// The allocator of the `meshgate` binary, for every role of this bench (both servers and the
/// client): the servers differ only in what they do per request.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const POD: &str = include_str!("../../../tools/bench/pod.json");
const PATH: &str = "/mutate/pod-gate";

const ROLE_ENV: &str = "MESHGATE_BENCH_ROLE";
const CERT_ENV: &str = "MESHGATE_BENCH_CERT";
const KEY_ENV: &str = "MESHGATE_BENCH_KEY";

/// A child server ends by itself after this long, whatever happens to the parent.
const CHILD_LIFETIME: Duration = Duration::from_secs(600);
/// Upper bound for one connect, one request or one response.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Upper bound for a child to print its address.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const MIB: f64 = 1024.0 * 1024.0;

// ------------------------------------------------------------------------------------------
// What both servers see and answer.

fn namespaces() -> BTreeMap<String, Meta> {
    let labels = [
        ("kubernetes.io/metadata.name", "apps"),
        ("istio.io/dataplane-mode", "ambient"),
        ("team", "payments"),
    ];
    let mut all: BTreeMap<String, Meta> = (0..OTHER_NAMESPACES)
        .map(|i| {
            let name = format!("team-{i}");
            let applied = format!(
                r#"{{"apiVersion":"v1","kind":"Namespace","metadata":{{"labels":{{"team":"{name}"}},"name":"{name}"}}}}"#
            );
            let meta = Meta {
                labels: BTreeMap::from([
                    ("kubernetes.io/metadata.name".to_owned(), name.clone()),
                    ("team".to_owned(), name.clone()),
                ]),
                annotations: BTreeMap::from([(
                    "kubectl.kubernetes.io/last-applied-configuration".to_owned(),
                    applied,
                )]),
            };
            (name, meta)
        })
        .collect();
    all.insert(
        "apps".to_owned(),
        Meta {
            labels: labels
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            annotations: BTreeMap::new(),
        },
    );
    all
}

/// Namespaces besides the reviewed pod's in the webhook's cache, every other one with a
/// LimitRange: the lookup per review is the one of a cluster of this size.
const OTHER_NAMESPACES: usize = 2000;

/// The webhook's sources: [`namespaces`], and a LimitRange in every other one but `apps`.
fn sources() -> Sources {
    let limits = (0..OTHER_NAMESPACES)
        .step_by(2)
        .map(|i| {
            let range: k8s_openapi::api::core::v1::LimitRange =
                serde_json::from_value(json!({"metadata": {"name": "limits"},
                    "spec": {"limits": [{"type": "Container", "max": {"memory": "1Gi"}}]}}))
                .expect("limit range");
            (format!("team-{i}"), ContainerLimits::of(&range))
        })
        .collect();
    Sources::fixed_with_limits(namespaces(), limits)
}

fn gate_config() -> GateConfig {
    GateConfig {
        profiles: vec![Profile::IstioAmbient],
        ..Default::default()
    }
}

const UID: &str = "0f9c1d2e-3b4a-4c5d-8e6f-7a8b9c0d1e2f";

/// The AdmissionReview the API server sends for the pod.
fn review_body() -> Vec<u8> {
    let pod: Value = serde_json::from_str(POD).expect("tools/bench/pod.json is JSON");
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": UID,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "apps",
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": "8d1b7a4e-2f3c-4e5d-9a6b-1c2d3e4f5a6b",
                "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system",
                           "system:authenticated"]
            },
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    }))
    .expect("review JSON")
}

/// The webhook's answer to [`review_body`], computed with the same functions: the baseline's
/// canned response.
fn canned_response() -> Vec<u8> {
    let pod: Value = serde_json::from_str(POD).expect("tools/bench/pod.json is JSON");
    let ns = namespaces();
    let plan = plan_pod(
        &gate_config(),
        &PodRequest {
            operation: "CREATE",
            namespace: "apps",
            pod: &pod,
            namespace_meta: &ns["apps"],
            limit_ranges: &[],
        },
    );
    let PodPlan::Mutate { patch, .. } = plan else {
        panic!("the benchmark pod is not gated: {plan:?}");
    };
    meshgate_webhook::admission::allow(UID, &patch, &[])
}

/// Reviews timed for [`review_stages`].
const STAGE_REVIEWS: u32 = 20_000;

/// What the webhook does per review besides HTTP and TLS, with the functions its pod-gate
/// handler calls: decode the review with the pod as its view, look up the namespace's metadata
/// and LimitRanges in [`sources`], plan, write the answer.
struct Work {
    planner: meshgate_core::gate::Planner,
    sources: Sources,
}

impl Work {
    fn new() -> Self {
        Self {
            planner: meshgate_core::gate::Planner::new(&gate_config()),
            sources: sources(),
        }
    }

    /// The answer to `body`; `mark` is called after each of the first three stages.
    fn answer(&self, body: &[u8], mut mark: impl FnMut()) -> Result<Vec<u8>, String> {
        use meshgate_core::view::{Obj, PodView};
        let mut scratch = None;
        let req = meshgate_webhook::admission::decode_as::<Obj<PodView<'_>>>(body, &mut scratch)
            .map_err(|e| e.to_string())?;
        mark();
        let ns = futures::executor::block_on(self.sources.namespace(&req.namespace))
            .map_err(|e| e.to_string())?;
        let limits = self.sources.limit_ranges(&req.namespace);
        mark();
        let empty = PodView::default();
        let pod = req.object.0.as_ref().unwrap_or(&empty);
        let plan = self
            .planner
            .plan_view(req.operation, &req.namespace, &ns, &limits, pod);
        mark();
        let PodPlan::Mutate { patch, .. } = plan else {
            return Err(format!("the benchmark pod is not gated: {plan:?}"));
        };
        Ok(meshgate_webhook::admission::allow(&req.uid, &patch, &[]))
    }
}

/// [`Work`] by stage, in process on one thread (µs per review, mean over [`STAGE_REVIEWS`] after
/// as many unmeasured). The last stage includes dropping the decoded review and the plan, as
/// the server does.
fn review_stages(body: &[u8]) -> Result<[f64; 4], String> {
    let work = Work::new();
    let mut total = [Duration::ZERO; 4];
    for i in 0..2 * STAGE_REVIEWS {
        let mut marks = [Instant::now(); 5];
        let mut next = 1;
        let answer = work.answer(body, || {
            marks[next] = Instant::now();
            next += 1;
        })?;
        std::hint::black_box(answer);
        marks[4] = Instant::now();
        if i >= STAGE_REVIEWS {
            for (k, sum) in total.iter_mut().enumerate() {
                *sum += marks[k + 1] - marks[k];
            }
        }
    }
    Ok(total.map(|d| d.as_secs_f64() * 1e6 / f64::from(STAGE_REVIEWS)))
}

/// Runs only [`review_stages`], repeatedly, for a profiler.
const STAGES_ONLY_ENV: &str = "MESHGATE_BENCH_STAGES_ONLY";

fn stages_only() -> ExitCode {
    let body = review_body();
    for _ in 0..20 {
        match review_stages(&body) {
            Ok([decode, lookup, plan, answer]) => {
                println!(
                    "decode {decode:.2} us, look up {lookup:.2} us, plan {plan:.2} us, answer {answer:.2} us"
                );
            }
            Err(e) => {
                eprintln!("throughput: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

// ------------------------------------------------------------------------------------------
// The child processes.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Baseline,
    BaselineWork,
    Webhook,
}

const ROLES: [Role; 3] = [Role::Baseline, Role::BaselineWork, Role::Webhook];

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Baseline => "baseline",
            Role::BaselineWork => "baseline+work",
            Role::Webhook => "webhook",
        }
    }
}

fn main() -> ExitCode {
    match std::env::var(ROLE_ENV).as_deref() {
        Ok(name) => match ROLES.into_iter().find(|r| r.name() == name) {
            Some(role) => serve(role),
            None => {
                eprintln!("{ROLE_ENV}={name:?}: expected one of baseline, baseline+work, webhook");
                ExitCode::FAILURE
            }
        },
        Err(_) if std::env::var_os(STAGES_ONLY_ENV).is_some() => stages_only(),
        Err(_) => {
            let full = std::env::args().any(|a| a == "--bench");
            match run(&Settings::from_env(full)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("throughput: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Runs one server until standard input closes (the parent is done) or [`CHILD_LIFETIME`];
/// prints `listening <addr>` once it accepts connections.
fn serve(role: Role) -> ExitCode {
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_LIFETIME);
        eprintln!("bench server: lifetime over, exiting");
        std::process::exit(2);
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let certs = CertFiles {
        cert: std::env::var_os(CERT_ENV).expect(CERT_ENV).into(),
        key: std::env::var_os(KEY_ENV).expect(KEY_ENV).into(),
    };
    let addr = runtime.block_on(async {
        match role {
            Role::Baseline => start_baseline(&certs, None).await,
            Role::BaselineWork => start_baseline(&certs, Some(Arc::new(Work::new()))).await,
            Role::Webhook => start_webhook(certs).await,
        }
    });
    println!("listening {addr}");
    std::io::stdout().flush().expect("stdout");
    // Keeps serving on the runtime's workers until the parent closes our stdin.
    let mut sink = String::new();
    while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {
        sink.clear();
    }
    runtime.shutdown_timeout(Duration::from_millis(100));
    ExitCode::SUCCESS
}

async fn start_webhook(certs: CertFiles) -> SocketAddr {
    // The subscriber of `meshgate --log-json webhook` at its default level, into a sink
    // (`MESHGATE_BENCH_LOG=none`: no subscriber, to see what logging costs).
    if std::env::var("MESHGATE_BENCH_LOG").as_deref() != Ok("none") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_writer(std::io::sink)
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init();
    }
    let app = App::new(gate_config(), sources(), Metrics::new());
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("loopback address");
    let server = Server::start(
        ServerOptions {
            addr: loopback,
            health_addr: loopback,
            certs,
            cert_poll_interval: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            max_in_flight: meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT,
            shutdown_grace: Duration::from_secs(1),
        },
        app,
    )
    .await
    .expect("webhook starts");
    let addr = server.addr;
    // The server runs until the process exits.
    std::mem::forget(server);
    addr
}

/// The baseline server; with `work`, the baseline+work server.
async fn start_baseline(certs: &CertFiles, work: Option<Arc<Work>>) -> SocketAddr {
    let cert = std::fs::read(&certs.cert).expect("certificate file");
    let key = std::fs::read(&certs.key).expect("key file");
    let tls = meshgate_webhook::tls::server_config(&cert, &key, certs).expect("TLS config");
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let body = Bytes::from(canned_response());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, body, work) = (acceptor.clone(), body.clone(), work.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let (body, work) = (body.clone(), work.clone());
                        async move {
                            // Read the review, answer the canned response (or the work's).
                            let review = req.into_body().collect().await?.to_bytes();
                            let body = match &work {
                                None => body,
                                Some(work) => Bytes::from(
                                    work.answer(&review, || {})
                                        .map_err(std::io::Error::other)
                                        .map_err(BaselineError::Http)?,
                                ),
                            };
                            hyper::Response::builder()
                                .header(hyper::header::CONTENT_TYPE, "application/json")
                                .body(Full::new(body))
                                .map_err(std::io::Error::other)
                                .map_err(BaselineError::Http)
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

#[derive(Debug)]
enum BaselineError {
    Body(hyper::Error),
    Http(std::io::Error),
}

impl From<hyper::Error> for BaselineError {
    fn from(e: hyper::Error) -> Self {
        BaselineError::Body(e)
    }
}

impl std::fmt::Display for BaselineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BaselineError::Body(e) => write!(f, "reading the body: {e}"),
            BaselineError::Http(e) => write!(f, "building the answer: {e}"),
        }
    }
}

impl std::error::Error for BaselineError {}

/// A server child: killed (by its own id) if still running when dropped.
struct ServerChild {
    role: Role,
    child: Child,
    addr: SocketAddr,
}

impl ServerChild {
    fn spawn(role: Role, certs: &CertFiles) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
        let mut child = Command::new(exe)
            .env(ROLE_ENV, role.name())
            .env(CERT_ENV, &certs.cert)
            .env(KEY_ENV, &certs.key)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting the {} server: {e}", role.name()))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut server = ServerChild {
            role,
            child,
            addr: "0.0.0.0:0".parse().expect("address"),
        };
        let line = rx
            .recv_timeout(START_TIMEOUT)
            .map_err(|_| format!("the {} server did not start in time", role.name()))?;
        server.addr = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("the {} server said {line:?}", role.name()))?;
        Ok(server)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Closes its stdin and waits (bounded) for it to end.
    fn stop(mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ------------------------------------------------------------------------------------------
// /proc readings.

// ------------------------------------------------------------------------------------------
// The load generator.

#[derive(Clone, Debug)]
struct Settings {
    connections: usize,
    requests: usize,
    seconds: u64,
    rounds: usize,
    warmup: usize,
    client_threads: usize,
}

impl Settings {
    fn from_env(full: bool) -> Self {
        let var = |name: &str, full_default: usize, quick: usize| -> usize {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|v| *v > 0)
                .unwrap_or(if full { full_default } else { quick })
        };
        Settings {
            connections: var("MESHGATE_BENCH_CONNECTIONS", 16, 4),
            requests: var("MESHGATE_BENCH_REQUESTS", 50_000, 200),
            seconds: var("MESHGATE_BENCH_SECONDS", 5, 2) as u64,
            rounds: var("MESHGATE_BENCH_ROUNDS", 5, 1),
            warmup: var("MESHGATE_BENCH_WARMUP", 2_000, 40),
            client_threads: var("MESHGATE_BENCH_CLIENT_THREADS", 1, 1),
        }
    }
}

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

struct Conn {
    stream: Tls,
    buf: Vec<u8>,
}

fn io_error(message: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message.into())
}

impl Conn {
    async fn open(addr: SocketAddr, tls: &TlsConnector) -> std::io::Result<Conn> {
        let connect = async {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            tls.connect(ServerName::IpAddress(addr.ip().into()), tcp)
                .await
        };
        let stream = timeout(IO_TIMEOUT, connect)
            .await
            .map_err(|_| io_error("connect timed out"))??;
        Ok(Conn {
            stream,
            buf: Vec::with_capacity(16 * 1024),
        })
    }

    /// Sends `request` and reads the response; returns the status and the body length.
    async fn call(&mut self, request: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        timeout(IO_TIMEOUT, self.call_now(request))
            .await
            .map_err(|_| io_error("request timed out"))?
    }

    async fn call_now(&mut self, request: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        self.stream.write_all(request).await?;
        self.stream.flush().await?;
        let head_end = loop {
            if let Some(pos) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break pos + 4;
            }
            if self.buf.len() > 64 * 1024 {
                return Err(io_error("response head over 64 KiB"));
            }
            self.fill().await?;
        };
        let head = std::str::from_utf8(&self.buf[..head_end])
            .map_err(|_| io_error("response head is not UTF-8"))?;
        let status = head
            .strip_prefix("HTTP/1.1 ")
            .and_then(|s| s.get(..3))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io_error(format!("bad status line in {head:?}")))?;
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .ok_or_else(|| io_error(format!("no content-length in {head:?}")))?;
        while self.buf.len() < head_end + length {
            self.fill().await?;
        }
        let body = self.buf[head_end..head_end + length].to_vec();
        self.buf.drain(..head_end + length);
        Ok((status, body))
    }

    async fn fill(&mut self) -> std::io::Result<()> {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(io_error("connection closed mid-response"));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

fn connector(ca_pem: &str) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA certificate");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// One measured phase against one server.
#[derive(Debug)]
struct Run {
    requests: usize,
    elapsed: Duration,
    /// Sorted latencies.
    latencies: Vec<Duration>,
    server_cpu: Duration,
    client_cpu: Duration,
}

impl Run {
    fn rate(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    fn quantile(&self, q: f64) -> Duration {
        quantile(&self.latencies, q)
    }

    fn server_cpu_per_request(&self) -> Duration {
        self.server_cpu / u32::try_from(self.requests.max(1)).unwrap_or(u32::MAX)
    }
}

/// Warm-up (unmeasured), then up to `settings.requests` requests or `settings.seconds`.
async fn load(
    server: &ServerChild,
    tls: &TlsConnector,
    request: Arc<Vec<u8>>,
    settings: &Settings,
) -> Result<Run, String> {
    let mut conns = Vec::with_capacity(settings.connections);
    for _ in 0..settings.connections {
        conns.push(
            Conn::open(server.addr, tls)
                .await
                .map_err(|e| format!("connecting to {}: {e}", server.role.name()))?,
        );
    }
    let per_conn_warmup = settings.warmup.div_ceil(settings.connections);
    let issued = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(settings.connections + 1));
    let mut tasks = Vec::with_capacity(settings.connections);
    let total = settings.requests;
    let limit = Duration::from_secs(settings.seconds);
    for mut conn in conns {
        let (request, issued, barrier) = (request.clone(), issued.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..per_conn_warmup {
                let (status, _) = conn.call(&request).await?;
                if status != 200 {
                    return Err(io_error(format!("warm-up answered {status}")));
                }
            }
            barrier.wait().await;
            let deadline = Instant::now() + limit;
            let mut latencies = Vec::with_capacity(total / 8);
            while issued.fetch_add(1, Ordering::Relaxed) < total && Instant::now() < deadline {
                let start = Instant::now();
                let (status, _) = conn.call(&request).await?;
                latencies.push(start.elapsed());
                if status != 200 {
                    return Err(io_error(format!("answered {status}")));
                }
            }
            Ok::<_, std::io::Error>(latencies)
        }));
    }
    barrier.wait().await;
    let pid = server.pid();
    let (cpu0, self0) = (cpu_time(pid), cpu_time(std::process::id()));
    let start = Instant::now();
    let mut latencies = Vec::with_capacity(total);
    for task in tasks {
        let mine = task
            .await
            .map_err(|e| format!("client task: {e}"))?
            .map_err(|e| format!("{}: {e}", server.role.name()))?;
        latencies.extend(mine);
    }
    let elapsed = start.elapsed();
    let (cpu1, self1) = (cpu_time(pid), cpu_time(std::process::id()));
    latencies.sort_unstable();
    Ok(Run {
        requests: latencies.len(),
        elapsed,
        latencies,
        server_cpu: cpu1.saturating_sub(cpu0),
        client_cpu: self1.saturating_sub(self0),
    })
}

fn micros(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

fn run(settings: &Settings) -> Result<(), String> {
    let validity = Duration::from_secs(24 * 3600);
    let ca = meshgate_pki::Ca::new("meshgate-bench-ca", validity).map_err(|e| e.to_string())?;
    let serving = ca
        .issue_server(&["localhost", "127.0.0.1"], validity)
        .map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let certs = CertFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
    };
    std::fs::write(&certs.cert, &serving.cert_pem).map_err(|e| e.to_string())?;
    std::fs::write(&certs.key, &serving.key_pem).map_err(|e| e.to_string())?;

    let servers = ROLES
        .into_iter()
        .map(|role| ServerChild::spawn(role, &certs))
        .collect::<Result<Vec<_>, _>>()?;
    let idle_rss = servers
        .iter()
        .map(|s| memory(s.pid()).map(|(_, rss)| rss))
        .collect::<Result<Vec<_>, _>>()?;

    let body = review_body();
    let mut request = format!(
        "POST {PATH} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let request = Arc::new(request);
    let tls = connector(&ca.certificate().cert_pem);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.client_threads)
        .enable_all()
        .build()
        .map_err(|e| format!("client runtime: {e}"))?;

    // All answer the review alike (the baseline's canned body is the webhook's answer).
    let answers = runtime.block_on(async {
        let mut out = Vec::new();
        for server in &servers {
            let mut conn = Conn::open(server.addr, &tls)
                .await
                .map_err(|e| format!("{}: {e}", server.role.name()))?;
            let (status, body) = conn
                .call(&request)
                .await
                .map_err(|e| format!("{}: {e}", server.role.name()))?;
            let answer: Value = serde_json::from_slice(&body)
                .map_err(|e| format!("{}: answer is not JSON: {e}", server.role.name()))?;
            if status != 200 || answer["response"]["allowed"] != true {
                return Err(format!(
                    "{} answered {status}: {answer}",
                    server.role.name()
                ));
            }
            out.push((server.role, body.len(), answer));
        }
        Ok::<_, String>(out)
    })?;
    for (role, _, answer) in &answers[1..] {
        if *answer != answers[0].2 {
            return Err(format!(
                "the {} server's answer differs from the baseline's:\n{answer}\n{}",
                role.name(),
                answers[0].2
            ));
        }
    }
    println!(
        "review: {} bytes of request body ({} bytes of Pod); answer: {} bytes, the same from \
         every server, a JSON patch adding the gate init container",
        body.len(),
        serde_json::to_vec(&serde_json::from_str::<Value>(POD).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?
            .len(),
        answers[0].1,
    );
    let stages = review_stages(&body)?;
    println!(
        "the review's own work, in process on one thread ({} reviews): decode the review and \
         the pod {:.1} µs, look up the namespace {:.2} µs, plan {:.1} µs, write the answer \
         and drop the review \
         {:.1} µs; {:.1} µs in all",
        STAGE_REVIEWS,
        stages[0],
        stages[1],
        stages[2],
        stages[3],
        stages.iter().sum::<f64>(),
    );
    println!(
        "load: {} keep-alive HTTP/1.1 connections over TLS 1.3, {} warm-up requests, then {} \
         requests or {} s per round and server; {} rounds; client on {} tokio worker(s); \
         {} CPUs",
        settings.connections,
        settings.warmup,
        settings.requests,
        settings.seconds,
        settings.rounds,
        settings.client_threads,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    println!(
        "{:<6} {:<13} {:>8} {:>8} {:>11} {:>9} {:>9} {:>9} {:>14} {:>14}",
        "round",
        "server",
        "requests",
        "seconds",
        "req/s",
        "p50",
        "p99",
        "max",
        "server CPU/req",
        "client CPU/req"
    );
    // results[round][role index in ROLES]
    let mut results: Vec<Vec<Run>> = Vec::new();
    for round in 0..settings.rounds {
        // Each round starts with another server, so that no server always runs first.
        let mut slots: Vec<Option<Run>> = ROLES.iter().map(|_| None).collect();
        for k in 0..ROLES.len() {
            let i = (round + k) % ROLES.len();
            let server = &servers[i];
            let r = runtime.block_on(load(server, &tls, request.clone(), settings))?;
            println!(
                "{:<6} {:<13} {:>8} {:>8.2} {:>11.0} {:>9} {:>9} {:>9} {:>14} {:>14}",
                round + 1,
                server.role.name(),
                r.requests,
                r.elapsed.as_secs_f64(),
                r.rate(),
                micros(r.quantile(0.50)),
                micros(r.quantile(0.99)),
                micros(r.quantile(1.0)),
                micros(r.server_cpu_per_request()),
                micros(r.client_cpu / u32::try_from(r.requests.max(1)).unwrap_or(u32::MAX)),
            );
            slots[i] = Some(r);
        }
        results.push(
            slots
                .into_iter()
                .map(|r| r.expect("every server ran"))
                .collect(),
        );
    }
    let after = servers
        .iter()
        .map(|s| memory(s.pid()))
        .collect::<Result<Vec<_>, _>>()?;
    runtime.shutdown_timeout(Duration::from_secs(1));
    for server in servers {
        server.stop();
    }

    let index = |role: Role| ROLES.iter().position(|r| *r == role).expect("a role");
    let (b, k, w) = (
        index(Role::Baseline),
        index(Role::BaselineWork),
        index(Role::Webhook),
    );
    let pick = |f: &dyn Fn(&Run) -> f64, i: usize| -> f64 {
        median(results.iter().map(|round| f(&round[i])).collect())
    };
    let rate = |r: &Run| r.rate();
    let p50 = |r: &Run| r.quantile(0.5).as_secs_f64() * 1e6;
    let p99 = |r: &Run| r.quantile(0.99).as_secs_f64() * 1e6;
    let cpu = |r: &Run| r.server_cpu_per_request().as_secs_f64() * 1e6;
    // A ratio of throughputs, per round (adjacent in time): its median and spread, and the
    // median ratio of server CPU per request. CPU time has 10 ms resolution: a round too short
    // to register any is left out of the CPU ratio.
    let compare = |num: usize, den: usize| {
        let per_round: Vec<f64> = results
            .iter()
            .map(|round| round[num].rate() / round[den].rate())
            .collect();
        let spread = (
            per_round.iter().copied().fold(f64::INFINITY, f64::min),
            per_round.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
        let cpu_ratios: Vec<f64> = results
            .iter()
            .filter(|round| cpu(&round[den]) > 0.0)
            .map(|round| cpu(&round[num]) / cpu(&round[den]))
            .collect();
        let cpu_ratio = if cpu_ratios.is_empty() {
            "n/a (rounds too short)".to_owned()
        } else {
            format!("{:.2}x", median(cpu_ratios))
        };
        (median(per_round), spread, cpu_ratio)
    };
    println!();
    println!("summary (medians over rounds)");
    for (i, role) in ROLES.iter().enumerate() {
        println!(
            "  {:<13} {:>9.0} req/s   p50 {:>6.0} µs   p99 {:>6.0} µs   server CPU {:>5.0} µs/req",
            role.name(),
            pick(&rate, i),
            pick(&p50, i),
            pick(&p99, i),
            pick(&cpu, i),
        );
    }
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let (ratio, spread, cpu_ratio) = compare(w, b);
    println!(
        "  ratio webhook/baseline: throughput {ratio:.2}x (target >= 0.80x: {}; spread \
         {:.2}-{:.2}), server CPU per request {cpu_ratio}",
        verdict(ratio >= 0.8),
        spread.0,
        spread.1,
    );
    let (stack, stack_spread, stack_cpu) = compare(w, k);
    println!(
        "  ratio webhook/baseline+work (the webhook's HTTP stack alone): throughput {stack:.2}x \
         (spread {:.2}-{:.2}), server CPU per request {stack_cpu}",
        stack_spread.0, stack_spread.1,
    );
    let (served, served_spread, served_cpu) = compare(k, b);
    println!(
        "  ratio baseline+work/baseline (the review's work, served): throughput {served:.2}x \
         (spread {:.2}-{:.2}), server CPU per request {served_cpu}",
        served_spread.0, served_spread.1,
    );
    let mib = |bytes: u64| bytes as f64 / MIB;
    for (i, role) in ROLES.iter().enumerate() {
        let (hwm, rss) = after[i];
        let target = if *role == Role::Webhook {
            format!(" (target <= 32 MiB: {})", verdict(mib(hwm) <= 32.0))
        } else {
            String::new()
        };
        println!(
            "  {} RSS: idle {:.1} MiB, after load {:.1} MiB, peak (VmHWM) {:.1} MiB{target}",
            role.name(),
            mib(idle_rss[i]),
            mib(rss),
            mib(hwm),
        );
    }
    // Headline figures, one per line, for tools (issue #17's format).
    println!("RATIO webhook/baseline: {ratio:.2}");
    println!("RATIO webhook/baseline-with-work: {stack:.2}");
    println!("RATIO baseline-with-work/baseline: {served:.2}");
    println!("VALUE webhook-peak-rss-mib: {:.1}", mib(after[w].0));
    Ok(())
}

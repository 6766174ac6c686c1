//! The plugin as the kubelet sees it: `run` on a temporary kubelet root and CNI directory, and
//! the generated tonic clients over its unix sockets, as the kubelet dials them.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use meshgate_node::proto::dra_health_v1alpha1::NodeWatchResourcesRequest;
use meshgate_node::proto::dra_health_v1alpha1::dra_resource_health_client::DraResourceHealthClient;
use meshgate_node::proto::dra_v1::dra_plugin_client::DraPluginClient;
use meshgate_node::proto::dra_v1::{
    Claim, NodePrepareResourcesRequest, NodePrepareResourcesResponse, NodeUnprepareResourcesRequest,
};
use meshgate_node::proto::pluginregistration::registration_client::RegistrationClient;
use meshgate_node::proto::pluginregistration::{InfoRequest, RegistrationStatus};
use meshgate_node::{Settings, dra_socket, registration_socket};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint, Uri};

const FLANNEL: &str = r#"{"name":"cbr0","cniVersion":"0.3.1","plugins":[
    {"type":"flannel","delegate":{"isDefaultGateway":true}},{"type":"portmap"}]}"#;
const CHAINED: &str = r#"{"name":"cbr0","cniVersion":"0.3.1","plugins":[
    {"type":"flannel"},{"type":"portmap"},{"type":"istio-cni"}]}"#;

// --- logs: the tests read what the plugin logged ---

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        std::io::stderr().write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log_buffer() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = buf.clone();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("meshgate_node=debug"))
            .with_ansi(false)
            .with_writer(move || LogWriter(writer.clone()))
            .try_init();
        buf
    })
}

/// The plugin's log lines that contain `needle`.
fn log_lines(needle: &str) -> Vec<String> {
    let text = String::from_utf8_lossy(&log_buffer().lock().unwrap()).into_owned();
    text.lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// --- the plugin under test ---

struct Plugin {
    _root: TempDir,
    kubelet_root: PathBuf,
    cni: TempDir,
    driver: String,
    health: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), meshgate_node::Error>>,
}

impl Plugin {
    async fn start(configure: impl FnOnce(&mut Settings)) -> Plugin {
        log_buffer();
        let root = tempfile::tempdir().unwrap();
        let cni = tempfile::tempdir().unwrap();
        let health = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let mut settings = Settings {
            kubelet_root: root.path().to_path_buf(),
            cni_conf_dir: cni.path().to_path_buf(),
            cni_plugin: Some("istio-cni".to_string()),
            prepare_wait: Duration::from_secs(20),
            poll: Duration::from_millis(100),
            health_addr: health,
            ..Settings::default()
        };
        configure(&mut settings);
        let driver = settings.driver.clone();
        let kubelet_root = settings.kubelet_root.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(meshgate_node::run(settings, async {
            let _ = stopped.await;
        }));
        let plugin = Plugin {
            _root: root,
            kubelet_root,
            cni,
            driver,
            health,
            stop: Some(stop),
            task,
        };
        let (reg, dra) = (plugin.registration_socket(), plugin.dra_socket());
        until("the plugin listens", || {
            is_socket(&reg) && is_socket(&dra) && std::net::TcpStream::connect(health).is_ok()
        })
        .await;
        plugin
    }

    fn registration_socket(&self) -> PathBuf {
        registration_socket(&self.kubelet_root, &self.driver)
    }

    fn dra_socket(&self) -> PathBuf {
        dra_socket(&self.kubelet_root, &self.driver)
    }

    fn write_cni(&self, name: &str, content: &str) {
        // As the CNI agents do: a temporary file, then a rename.
        let tmp = self.cni.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, self.cni.path().join(name)).unwrap();
    }

    async fn registration(&self) -> RegistrationClient<Channel> {
        RegistrationClient::new(channel(self.registration_socket()).await)
    }

    async fn dra(&self) -> DraPluginClient<Channel> {
        DraPluginClient::new(channel(self.dra_socket()).await)
    }

    async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.health, path).await
    }

    /// Stops the plugin: `run` returns `Ok` and both sockets are gone.
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = tokio::time::timeout(Duration::from_secs(10), &mut self.task)
            .await
            .expect("run returns after shutdown")
            .unwrap();
        result.unwrap();
        assert!(!self.registration_socket().exists());
        assert!(!self.dra_socket().exists());
    }
}

fn is_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// A gRPC channel over a unix socket, as tonic's uds example dials one.
async fn channel(path: PathBuf) -> Channel {
    Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .unwrap()
}

async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn claim(name: &str) -> Claim {
    Claim {
        namespace: "apps".to_string(),
        uid: format!("uid-{name}"),
        name: name.to_string(),
    }
}

fn prepare_request(claims: &[&str]) -> NodePrepareResourcesRequest {
    NodePrepareResourcesRequest {
        claims: claims.iter().map(|c| claim(c)).collect(),
    }
}

/// Asserts every claim of the response was prepared: no error, no devices.
fn assert_prepared(response: &NodePrepareResourcesResponse, claims: &[&str]) {
    assert_eq!(response.claims.len(), claims.len(), "{response:?}");
    for c in claims {
        let r = &response.claims[&format!("uid-{c}")];
        assert_eq!(r.error, "", "{c}");
        assert!(r.devices.is_empty(), "{c}");
    }
}

// --- (1) registration ---

#[tokio::test]
async fn registers_with_the_kubelet_and_readyz_follows_the_kubelets_word() {
    // A stale socket file from an earlier run is replaced.
    let stale_root = tempfile::tempdir().unwrap();
    let stale = registration_socket(stale_root.path(), meshgate_node::DEFAULT_DRIVER);
    std::fs::create_dir_all(stale.parent().unwrap()).unwrap();
    std::fs::write(&stale, "stale").unwrap();
    let root = stale_root.path().to_path_buf();
    let plugin = Plugin::start(|s| s.kubelet_root = root).await;
    assert!(is_socket(&stale));

    assert_eq!(plugin.get("/healthz").await.0, 200);
    let (status, body) = plugin.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("has not registered"), "{body}");

    let mut reg = plugin.registration().await;
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gate.meshgate.dev");
    assert_eq!(info.endpoint, plugin.dra_socket().to_str().unwrap());
    assert!(!info.endpoint.starts_with("unix:"));
    assert_eq!(info.supported_versions, ["v1.DRAPlugin"]);
    // GetInfo alone does not make the plugin ready.
    assert_eq!(plugin.get("/readyz").await.0, 503);

    // The kubelet refuses: 503 with its error, logged at WARN.
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: false,
        error: "endpoint already registered for DRA driver plugin x".to_string(),
    })
    .await
    .unwrap();
    let (status, body) = plugin.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("endpoint already registered"), "{body}");
    assert!(
        log_lines("endpoint already registered")
            .iter()
            .any(|l| l.contains("WARN")),
        "no WARN line"
    );

    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    let (status, body) = plugin.get("/readyz").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "registered with the kubelet\n")
    );

    // The kubelet restarts: it dials the same socket again and registers again.
    drop(reg);
    let mut reg = plugin.registration().await;
    let again = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(again, info);
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    assert_eq!(plugin.get("/readyz").await.0, 200);

    // The endpoint it advertises serves the DRA service.
    let mut dra = DraPluginClient::new(channel(PathBuf::from(&info.endpoint)).await);
    let r = dra
        .node_unprepare_resources(NodeUnprepareResourcesRequest {
            claims: vec![claim("reg")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims.len(), 1);

    // The registration socket removed (the kubelet then drops the plugin): neither ready nor
    // healthy, so the liveness probe restarts it and it is registered again.
    std::fs::remove_file(plugin.registration_socket()).unwrap();
    let (status, body) = plugin.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("was removed"), "{body}");
    let (status, body) = plugin.get("/healthz").await;
    assert_eq!(status, 503);
    assert!(
        body.contains(&plugin.registration_socket().display().to_string()),
        "{body}"
    );
    plugin.stop().await;
}

// --- (2) waiting for the CNI configuration ---

#[tokio::test]
async fn prepare_waits_until_the_active_cni_config_chains_the_plugin() {
    let plugin = Plugin::start(|_| {}).await;
    plugin.write_cni("10-flannel.conflist", FLANNEL);
    let mut dra = plugin.dra().await;
    let written = Arc::new(AtomicBool::new(false));
    let seen = written.clone();
    let call = tokio::spawn(async move {
        let r = dra
            .node_prepare_resources(prepare_request(&["cni-wait"]))
            .await;
        (seen.load(Ordering::SeqCst), Instant::now(), r)
    });
    // The plugin checked the node at least twice and is still waiting.
    until("two checks of the node", || {
        log_lines("apps/cni-wait")
            .iter()
            .filter(|l| l.contains("does not chain \"istio-cni\""))
            .count()
            >= 2
    })
    .await;
    assert!(!call.is_finished());

    written.store(true, Ordering::SeqCst);
    let write = Instant::now();
    // Sorted before the flannel file: the active configuration now.
    plugin.write_cni("05-chained.conflist", CHAINED);
    let (after_write, returned, response) = call.await.unwrap();
    assert!(
        after_write,
        "prepare returned before the configuration was written"
    );
    let latency = returned.duration_since(write);
    eprintln!("prepare returned {latency:?} after the write");
    assert!(latency < Duration::from_secs(1), "{latency:?}");
    assert_prepared(&response.unwrap().into_inner(), &["cni-wait"]);
    assert!(
        log_lines("apps/cni-wait: mesh ready after")
            .iter()
            .any(|l| l.contains("INFO"))
    );

    // Idempotent: the same claim again, at once.
    let mut dra = plugin.dra().await;
    let start = Instant::now();
    let again = dra
        .node_prepare_resources(prepare_request(&["cni-wait"]))
        .await
        .unwrap()
        .into_inner();
    assert_prepared(&again, &["cni-wait"]);
    assert!(start.elapsed() < Duration::from_secs(1));
    plugin.stop().await;
}

// --- (3) giving up after the bound ---

#[tokio::test]
async fn after_the_bound_each_claim_names_what_is_not_ready() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let url = format!("http://{closed}/readyz");
    let probe = url.clone();
    let plugin = Plugin::start(|s| {
        s.prepare_wait = Duration::from_millis(500);
        s.ready_urls = vec![probe];
    })
    .await;
    plugin.write_cni("10-flannel.conflist", FLANNEL);
    plugin.write_cni("20-chained.conflist", CHAINED);
    let mut dra = plugin.dra().await;
    let start = Instant::now();
    let r = dra
        .node_prepare_resources(prepare_request(&["late-a", "late-b"]))
        .await
        .expect("a per-claim error, not a gRPC error")
        .into_inner();
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(500), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(r.claims.len(), 2);
    let file = plugin.cni.path().join("10-flannel.conflist");
    for c in ["uid-late-a", "uid-late-b"] {
        let error = &r.claims[c].error;
        assert!(
            error.starts_with("the mesh is not ready on this node: "),
            "{error}"
        );
        assert!(
            error.contains(&format!(
                "the CNI configuration {} does not chain \"istio-cni\"",
                file.display()
            )),
            "{error}"
        );
        assert!(error.contains(&format!("{url} did not answer")), "{error}");
        assert!(error.contains("waited 500ms"), "{error}");
    }
    assert!(
        log_lines("apps/late-a, apps/late-b: still not ready after 500ms")
            .iter()
            .any(|l| l.contains("INFO"))
    );
    plugin.stop().await;
}

// --- (4) waiting for a readiness URL ---

/// A node agent's readiness endpoint: 503 until `ready`, then 200; counts the requests.
async fn agent(ready: Arc<AtomicBool>, hits: Arc<AtomicUsize>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let (ready, hits) = (ready.clone(), hits.clone());
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                assert!(got.starts_with(b"GET /ready?x=1 HTTP/1.1\r\n"));
                hits.fetch_add(1, Ordering::SeqCst);
                let status = if ready.load(Ordering::SeqCst) {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                };
                let _ = s
                    .write_all(format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes())
                    .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn prepare_waits_until_the_ready_url_answers_2xx() {
    let ready = Arc::new(AtomicBool::new(false));
    let hits = Arc::new(AtomicUsize::new(0));
    let addr = agent(ready.clone(), hits.clone()).await;
    let url = format!("http://{addr}/ready?x=1");
    let probe = url.clone();
    let plugin = Plugin::start(|s| {
        s.cni_plugin = None;
        s.ready_urls = vec![probe];
    })
    .await;
    let mut dra = plugin.dra().await;
    let flipped = ready.clone();
    let call = tokio::spawn(async move {
        let r = dra
            .node_prepare_resources(prepare_request(&["url-wait"]))
            .await;
        (flipped.load(Ordering::SeqCst), Instant::now(), r)
    });
    until("the agent was asked twice", || {
        hits.load(Ordering::SeqCst) >= 2
    })
    .await;
    until("the plugin logged the 503", || {
        !log_lines(&format!("{url} answered 503")).is_empty()
    })
    .await;
    assert!(!call.is_finished());

    ready.store(true, Ordering::SeqCst);
    let flip = Instant::now();
    let (after_flip, returned, response) = call.await.unwrap();
    assert!(after_flip, "prepare returned while the agent answered 503");
    let latency = returned.duration_since(flip);
    eprintln!("prepare returned {latency:?} after the agent turned ready");
    assert!(latency < Duration::from_secs(1), "{latency:?}");
    assert_prepared(&response.unwrap().into_inner(), &["url-wait"]);
    plugin.stop().await;
}

// --- (5) the health stream ---

#[tokio::test]
async fn the_health_stream_answers_once_and_stays_open_until_shutdown() {
    let plugin = Plugin::start(|_| {}).await;
    let mut health = DraResourceHealthClient::new(channel(plugin.dra_socket()).await);
    let mut stream = health
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().expect("a first response");
    assert!(first.devices.is_empty());
    // Still open: no end, no error.
    assert!(
        tokio::time::timeout(Duration::from_millis(700), stream.message())
            .await
            .is_err(),
        "the stream ended"
    );
    // A second watcher (the kubelet reconnecting) gets the same.
    let mut second = health
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(second.message().await.unwrap().is_some());

    let ended = tokio::spawn(async move {
        let a = stream.message().await;
        let b = second.message().await;
        (a.map(|m| m.is_none()), b.map(|m| m.is_none()))
    });
    plugin.stop().await;
    let (a, b) = tokio::time::timeout(Duration::from_secs(5), ended)
        .await
        .expect("the streams end on shutdown")
        .unwrap();
    // A clean end, or the connection closing: either way not a message.
    assert!(!matches!(a, Ok(false)) && !matches!(b, Ok(false)));
}

// --- (6) unprepare ---

#[tokio::test]
async fn unprepare_answers_every_claim() {
    let plugin = Plugin::start(|_| {}).await;
    let mut dra = plugin.dra().await;
    let r = dra
        .node_unprepare_resources(NodeUnprepareResourcesRequest {
            claims: vec![claim("u1"), claim("u2"), claim("u3")],
        })
        .await
        .unwrap()
        .into_inner();
    let mut uids: Vec<&String> = r.claims.keys().collect();
    uids.sort();
    assert_eq!(uids, ["uid-u1", "uid-u2", "uid-u3"]);
    assert!(r.claims.values().all(|c| c.error.is_empty()));
    plugin.stop().await;
}

// --- the kubelet gives up, or has a deadline ---

#[tokio::test]
async fn a_cancelled_prepare_stops_waiting() {
    let plugin = Plugin::start(|_| {}).await;
    plugin.write_cni("10-flannel.conflist", FLANNEL);
    let mut dra = plugin.dra().await;
    let call = dra.node_prepare_resources(prepare_request(&["cancelled"]));
    assert!(
        tokio::time::timeout(Duration::from_millis(400), call)
            .await
            .is_err(),
        "prepare answered although the node is not ready"
    );
    until("the plugin noticed the cancel", || {
        !log_lines("apps/cancelled: the kubelet stopped waiting").is_empty()
    })
    .await;
    // No check of the node for that claim after it.
    let checks = log_lines("apps/cancelled").len();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(log_lines("apps/cancelled").len(), checks);
    plugin.stop().await;
}

#[tokio::test]
async fn prepare_answers_before_the_clients_deadline() {
    let plugin = Plugin::start(|_| {}).await;
    plugin.write_cni("10-flannel.conflist", FLANNEL);
    let mut dra = plugin.dra().await;
    let mut request = tonic::Request::new(prepare_request(&["deadline"]));
    request.set_timeout(Duration::from_secs(1));
    let start = Instant::now();
    let r = dra
        .node_prepare_resources(request)
        .await
        .expect("an answer, not DEADLINE_EXCEEDED")
        .into_inner();
    assert!(start.elapsed() < Duration::from_secs(1));
    let error = &r.claims["uid-deadline"].error;
    assert!(error.contains("does not chain \"istio-cni\""), "{error}");
    plugin.stop().await;
}

#[tokio::test]
async fn a_prepare_in_flight_at_shutdown_is_answered_and_run_returns() {
    let plugin = Plugin::start(|_| {}).await;
    plugin.write_cni("10-flannel.conflist", FLANNEL);
    let mut dra = plugin.dra().await;
    let call = tokio::spawn(async move {
        dra.node_prepare_resources(prepare_request(&["at-shutdown"]))
            .await
    });
    until("the plugin is waiting", || {
        !log_lines("apps/at-shutdown: the mesh is not ready").is_empty()
    })
    .await;
    let start = Instant::now();
    // Well before the 20 s bound.
    plugin.stop().await;
    let r = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("prepare answered at shutdown")
        .unwrap()
        .expect("an answer")
        .into_inner();
    assert!(start.elapsed() < Duration::from_secs(5));
    let error = &r.claims["uid-at-shutdown"].error;
    assert!(error.contains("stopping"), "{error}");
    assert!(error.contains("does not chain \"istio-cni\""), "{error}");
}

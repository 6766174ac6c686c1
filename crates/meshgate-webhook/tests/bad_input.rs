//! In-process tests of the webhook's HTTPS server: the real [`Server`] on loopback, a certificate
//! from a test CA, and a small HTTP/1.1 client over tokio-rustls. No cluster.
//!
//! Every test checks the status code and the shape of the answer, and ends by checking that the
//! server is still up (`/healthz` on the health port). Loops are bounded in count and time; the
//! only timing in assertions is generous timeouts.
//!
//! Run: `cargo test --workspace --test bad_input`.
#![cfg(unix)]

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use meshgate_api::names::GATE_CONTAINER;
use meshgate_api::{GateConfig, Profile};
use meshgate_core::select::Meta;
use meshgate_pki::{Ca, CertifiedKey};
use meshgate_testenv::SecretDir;
use meshgate_webhook::metrics::Metrics;
use meshgate_webhook::server::MAX_BODY;
use meshgate_webhook::tls::CertFiles;
use meshgate_webhook::{App, Server, ServerOptions, Sources};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

/// Upper bound for one connect, one request or one response (the machine is noisy).
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound for waiting on an asynchronous effect (a certificate reload).
const EVENTUALLY: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(100);
const VALIDITY: Duration = Duration::from_secs(24 * 3600);

// ------------------------------------------------------------------------------------------
// Certificates on disk, laid out like a mounted Secret: `tls.crt -> ..data/tls.crt`,
// `..data -> ..gen-N`; an update writes a new generation and renames a new `..data` link over
// the old one, so that both files change at once.

fn new_ca(name: &str) -> (Ca, CertifiedKey) {
    let ca = Ca::new(name, VALIDITY).expect("CA");
    let serving = ca
        .issue_server(&["localhost", "127.0.0.1", "::1"], VALIDITY)
        .expect("serving certificate");
    (ca, serving)
}

fn connector(ca: &Ca) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca.certificate().cert_pem.as_bytes()) {
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

// ------------------------------------------------------------------------------------------
// The server under test.

struct Harness {
    server: Server,
    certs: SecretDir,
    tls: TlsConnector,
    _ca: Ca,
}

async fn start() -> Harness {
    start_with(meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT).await
}

async fn start_with(max_in_flight: usize) -> Harness {
    let namespaces = BTreeMap::from([(
        "apps".to_owned(),
        Meta {
            labels: BTreeMap::from([("istio.io/dataplane-mode".to_owned(), "ambient".to_owned())]),
            annotations: BTreeMap::new(),
        },
    )]);
    start_custom(
        Sources::fixed(namespaces, vec![], vec![]),
        "127.0.0.1:0".parse().expect("loopback address"),
        Duration::from_secs(10),
        max_in_flight,
    )
    .await
}

/// The server on `addr` (HTTPS; health on loopback) with the ambient profile over `sources`.
async fn start_custom(
    sources: Sources,
    addr: SocketAddr,
    request_timeout: Duration,
    max_in_flight: usize,
) -> Harness {
    let (ca, serving) = new_ca("meshgate-test-ca");
    let certs = SecretDir::new(serving.cert_pem.as_bytes(), serving.key_pem.as_bytes())
        .expect("certificate directory");
    let app = App::new(
        GateConfig {
            profiles: vec![Profile::IstioAmbient],
            ..Default::default()
        },
        sources,
        Metrics::new(),
    );
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("loopback address");
    let server = Server::start(
        ServerOptions {
            addr,
            health_addr: loopback,
            certs: CertFiles {
                cert: certs.cert(),
                key: certs.key(),
            },
            cert_poll_interval: POLL,
            request_timeout,
            max_in_flight,
            shutdown_grace: Duration::from_secs(5),
        },
        app,
    )
    .await
    .expect("server starts");
    Harness {
        server,
        certs,
        tls: connector(&ca),
        _ca: ca,
    }
}

impl Harness {
    async fn connect(&self) -> Conn<Tls> {
        Conn::new(
            tls_connect(self.server.addr, &self.tls)
                .await
                .expect("TLS connection"),
        )
    }

    /// One request on its own connection (`Connection: close`).
    async fn call(&self, req: &Req<'_>) -> Resp {
        let mut conn = self.connect().await;
        conn.request(&req.closing()).await.expect("response")
    }

    async fn review(&self, path: &str, review: &Value) -> Resp {
        let body = serde_json::to_vec(review).expect("review JSON");
        self.call(&Req::post(path, &body)).await
    }

    async fn health_get(&self, path: &str) -> Resp {
        let tcp = timeout(IO_TIMEOUT, TcpStream::connect(self.server.health_addr))
            .await
            .expect("health connect in time")
            .expect("health connect");
        let mut conn = Conn::new(tcp);
        conn.request(&Req::get(path).closing())
            .await
            .expect("health response")
    }

    async fn metrics(&self) -> String {
        let resp = self.health_get("/metrics").await;
        assert_eq!(resp.status, 200, "{resp:?}");
        resp.text()
    }

    /// `n` clients that send the headers of a 1 MiB review to `path`, then nothing: each holds
    /// a slot of the route until it goes away (or the request timeout).
    async fn slow_clients(&self, path: &str, n: usize) -> Vec<Tls> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{",
            1024 * 1024
        );
        let mut slow = Vec::new();
        for _ in 0..n {
            let mut tls = tls_connect(self.server.addr, &self.tls)
                .await
                .expect("connect");
            tls.write_all(head.as_bytes()).await.expect("head");
            tls.flush().await.expect("flush");
            slow.push(tls);
        }
        slow
    }

    /// The first review of `path` refused with 429 (tried for up to 20 s), if any.
    async fn refused_review(&self, path: &str) -> Option<Resp> {
        for i in 0..200 {
            let resp = self
                .review(path, &pod_review(&format!("busy-{i}"), "other"))
                .await;
            if resp.status == 429 {
                return Some(resp);
            }
            tokio::time::sleep(POLL).await;
        }
        None
    }

    /// The server is still up: `/healthz` answers, and so does a review.
    async fn assert_up(&self) {
        let resp = self.health_get("/healthz").await;
        assert_eq!((resp.status, resp.text().as_str()), (200, "ok"), "{resp:?}");
        let resp = self.review(POD_GATE, &pod_review("alive", "other")).await;
        assert_eq!(resp.status, 200, "{resp:?}");
        assert_eq!(resp.json()["response"]["allowed"], true, "{resp:?}");
    }
}

/// The value of a metric sample line that starts with `prefix` (name and labels), if present.
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .map(|v| v.parse().expect("metric value"))
}

// ------------------------------------------------------------------------------------------
// A tiny HTTP/1.1 client.

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

async fn tls_connect(addr: SocketAddr, tls: &TlsConnector) -> io::Result<Tls> {
    let attempt = async {
        let tcp = TcpStream::connect(addr).await?;
        tls.connect(ServerName::IpAddress(addr.ip().into()), tcp)
            .await
    };
    timeout(IO_TIMEOUT, attempt)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS connect timed out"))?
}

#[derive(Clone, Debug)]
struct Req<'a> {
    method: &'a str,
    path: &'a str,
    content_type: Option<&'a str>,
    body: &'a [u8],
    close: bool,
}

impl<'a> Req<'a> {
    fn post(path: &'a str, body: &'a [u8]) -> Self {
        Req {
            method: "POST",
            path,
            content_type: Some("application/json"),
            body,
            close: false,
        }
    }

    fn get(path: &'a str) -> Self {
        Req {
            method: "GET",
            path,
            content_type: None,
            body: b"",
            close: false,
        }
    }

    fn content_type(self, content_type: Option<&'a str>) -> Self {
        Req {
            content_type,
            ..self
        }
    }

    fn closing(&self) -> Self {
        Req {
            close: true,
            ..self.clone()
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n",
            self.method,
            self.path,
            self.body.len()
        );
        if let Some(ct) = self.content_type {
            head.push_str(&format!("Content-Type: {ct}\r\n"));
        }
        if self.close {
            head.push_str("Connection: close\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(self.body);
        out
    }
}

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("JSON response body")
    }
}

struct Conn<S> {
    stream: S,
    buf: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    async fn request(&mut self, req: &Req<'_>) -> io::Result<Resp> {
        self.send(req).await?;
        self.read_response().await
    }

    async fn send(&mut self, req: &Req<'_>) -> io::Result<()> {
        let bytes = req.encode();
        let write = async {
            self.stream.write_all(&bytes).await?;
            self.stream.flush().await
        };
        timeout(IO_TIMEOUT, write)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "write timed out"))?
    }
}

impl<S: AsyncRead + Unpin> Conn<S> {
    fn new(stream: S) -> Self {
        Conn {
            stream,
            buf: Vec::new(),
        }
    }

    async fn read_response(&mut self) -> io::Result<Resp> {
        timeout(IO_TIMEOUT, self.read_response_now())
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "response timed out"))?
    }

    /// Reads more bytes into the buffer; 0 at the end of the stream.
    async fn fill(&mut self) -> io::Result<usize> {
        let mut chunk = [0u8; 16 * 1024];
        let n = match self.stream.read(&mut chunk).await {
            // A peer that closes without TLS close_notify: treat as the end.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => 0,
            other => other?,
        };
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    async fn need(&mut self, len: usize) -> io::Result<()> {
        while self.buf.len() < len {
            if self.fill().await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "truncated body",
                ));
            }
        }
        Ok(())
    }

    async fn read_line(&mut self) -> io::Result<String> {
        loop {
            if let Some(pos) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line: Vec<u8> = self.buf.drain(..pos + 2).collect();
                return Ok(String::from_utf8_lossy(&line[..pos]).into_owned());
            }
            if self.buf.len() > 64 * 1024 || self.fill().await? == 0 {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "no line"));
            }
        }
    }

    async fn read_response_now(&mut self) -> io::Result<Resp> {
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
        let status_line = self.read_line().await?;
        let status = status_line
            .strip_prefix("HTTP/1.1 ")
            .and_then(|s| s.get(..3))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| invalid(format!("bad status line {status_line:?}")))?;
        let mut headers = Vec::new();
        for _ in 0..200 {
            let line = self.read_line().await?;
            if line.is_empty() {
                break;
            }
            let (name, value) = line
                .split_once(':')
                .ok_or_else(|| invalid(format!("bad header {line:?}")))?;
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
        let mut resp = Resp {
            status,
            headers,
            body: Vec::new(),
        };
        if let Some(len) = resp.header("content-length") {
            let len: usize = len
                .parse()
                .map_err(|_| invalid(format!("bad length {len:?}")))?;
            self.need(len).await?;
            resp.body = self.buf.drain(..len).collect();
        } else if resp
            .header("transfer-encoding")
            .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
        {
            for _ in 0..100_000 {
                let size = self.read_line().await?;
                let size = usize::from_str_radix(size.split(';').next().unwrap_or_default(), 16)
                    .map_err(|_| invalid(format!("bad chunk size {size:?}")))?;
                self.need(size + 2).await?;
                resp.body.extend(self.buf.drain(..size));
                self.buf.drain(..2);
                if size == 0 {
                    break;
                }
            }
        } else {
            while self.fill().await? > 0 {}
            resp.body = std::mem::take(&mut self.buf);
        }
        Ok(resp)
    }
}

// ------------------------------------------------------------------------------------------
// Reviews.

const POD_GATE: &str = "/mutate/pod-gate";
const POLICIES: &str = "/mutate/policies";
const NODE_TAINT: &str = "/mutate/node-taint";

fn review(uid: &str, kind: &str, operation: &str, namespace: &str, object: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": format!("{}s", kind.to_lowercase())},
            "operation": operation,
            "namespace": namespace,
            "name": "web",
            "userInfo": {"username": "tester"},
            "object": object,
            "dryRun": false,
        }
    })
}

fn pod(namespace: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "namespace": namespace, "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "app", "image": "registry.example/app:1"}]},
    })
}

fn pod_review(uid: &str, namespace: &str) -> Value {
    review(uid, "Pod", "CREATE", namespace, pod(namespace))
}

/// The decoded JSON patch of an allowing response, or `None` when it carries no patch.
fn patch_of(resp: &Value) -> Option<Value> {
    let response = &resp["response"];
    let patch = response.get("patch")?;
    assert_eq!(response["patchType"], "JSONPatch", "{resp}");
    let bytes: k8s_openapi::ByteString =
        serde_json::from_value(patch.clone()).expect("patch is base64");
    Some(serde_json::from_slice(&bytes.0).expect("patch is JSON"))
}

fn assert_answer(resp: &Resp, uid: &str) -> Value {
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(
        resp.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{resp:?}"
    );
    let v = resp.json();
    assert_eq!(v["apiVersion"], "admission.k8s.io/v1", "{v}");
    assert_eq!(v["kind"], "AdmissionReview", "{v}");
    assert_eq!(v["response"]["uid"], uid, "{v}");
    v
}

fn assert_allowed_unpatched(resp: &Resp, uid: &str) {
    let v = assert_answer(resp, uid);
    assert_eq!(v["response"]["allowed"], true, "{v}");
    assert!(v["response"].get("patch").is_none(), "{v}");
    assert!(v["response"].get("patchType").is_none(), "{v}");
}

// ------------------------------------------------------------------------------------------
// 1. The gate.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_in_ambient_namespace_gets_the_gate() {
    let h = start().await;

    let resp = h.review(POD_GATE, &pod_review("uid-apps-1", "apps")).await;
    let v = assert_answer(&resp, "uid-apps-1");
    assert_eq!(v["response"]["allowed"], true, "{v}");
    let ops = patch_of(&v).expect("a patch for a selected pod");
    let ops = ops.as_array().expect("patch is an array of operations");
    let add = ops
        .iter()
        .find(|op| op["path"] == "/spec/initContainers")
        .expect("an operation on /spec/initContainers");
    assert_eq!(add["op"], "add", "{add}");
    assert_eq!(add["value"][0]["name"], GATE_CONTAINER, "{add}");
    assert!(add["value"][0]["image"].is_string(), "{add}");

    let resp = h
        .review(POD_GATE, &pod_review("uid-other-1", "other"))
        .await;
    assert_allowed_unpatched(&resp, "uid-other-1");

    h.assert_up().await;
}

// ------------------------------------------------------------------------------------------
// 2. Bad input, each with its documented answer.

enum Want {
    /// A plain-text refusal with this status, whose text contains this.
    Plain(u16, &'static str),
    /// A status with an empty body (routing: 404, 405).
    Empty(u16),
    /// An answered review: allowed, no patch.
    Allowed,
    /// An answered review: allowed, with the gate's patch.
    Patched,
    /// An answered review: refused with code 400, the message containing this.
    Denied(&'static str),
}

struct Case {
    name: &'static str,
    method: &'static str,
    path: &'static str,
    content_type: Option<&'static str>,
    body: Vec<u8>,
    want: Want,
}

fn case(name: &'static str, path: &'static str, body: Vec<u8>, want: Want) -> Case {
    Case {
        name,
        method: "POST",
        path,
        content_type: Some("application/json"),
        body,
        want,
    }
}

fn json_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("JSON")
}

fn bad_input_cases() -> Vec<Case> {
    let good = pod_review("uid-case", "apps");
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = good.clone();
        f(&mut v);
        json_bytes(&v)
    };
    let nested = {
        let depth = 10_000;
        let mut b = vec![b'['; depth];
        b.extend(std::iter::repeat_n(b']', depth));
        b
    };
    // A Node whose `spec` nests 10,000 arrays: the review decodes (the object stays raw text),
    // reading the object does not.
    let deep_node = {
        let node = review(
            "uid-case",
            "Node",
            "CREATE",
            "",
            json!({"metadata": {"name": "n"}, "spec": "DEEP"}),
        );
        let text = serde_json::to_string(&node).expect("JSON");
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        text.replacen("\"DEEP\"", &deep, 1).into_bytes()
    };
    let oversized = {
        // Valid JSON, one byte over the limit.
        let mut b = br#"{"pad":""#.to_vec();
        b.resize(MAX_BODY + 1 - 2, b'x');
        b.extend_from_slice(br#""}"#);
        b
    };
    let service = review(
        "uid-case",
        "Service",
        "CREATE",
        "apps",
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {}}),
    );
    let node = review(
        "uid-case",
        "Node",
        "CREATE",
        "",
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}, "spec": {}}),
    );
    vec![
        case(
            "not JSON",
            POD_GATE,
            b"hello there".to_vec(),
            Want::Plain(400, "not JSON"),
        ),
        case(
            "JSON array",
            POD_GATE,
            b"[1,2,3]".to_vec(),
            Want::Plain(400, "JSON object"),
        ),
        case(
            "JSON string",
            POD_GATE,
            br#""review""#.to_vec(),
            Want::Plain(400, "JSON object"),
        ),
        case(
            "apiVersion v1beta1",
            POD_GATE,
            with(&|v| v["apiVersion"] = json!("admission.k8s.io/v1beta1")),
            Want::Denied("admission.k8s.io/v1beta1"),
        ),
        case(
            "kind not AdmissionReview",
            POD_GATE,
            with(&|v| v["kind"] = json!("Review")),
            Want::Denied("AdmissionReview"),
        ),
        case(
            "missing request",
            POD_GATE,
            with(&|v| {
                v.as_object_mut().expect("object").remove("request");
            }),
            Want::Plain(400, "no request"),
        ),
        case(
            "request not an object",
            POD_GATE,
            with(&|v| v["request"] = json!("request")),
            Want::Plain(400, "no request"),
        ),
        case(
            "request without uid",
            POD_GATE,
            with(&|v| {
                v["request"].as_object_mut().expect("object").remove("uid");
            }),
            Want::Plain(400, "request.uid"),
        ),
        case(
            "uid not a string",
            POD_GATE,
            with(&|v| v["request"]["uid"] = json!(42)),
            Want::Plain(400, "request.uid"),
        ),
        case(
            "operation not an admission operation",
            POD_GATE,
            with(&|v| v["request"]["operation"] = json!("PATCH")),
            Want::Denied("PATCH"),
        ),
        case(
            "missing request.kind",
            POD_GATE,
            with(&|v| {
                v["request"].as_object_mut().expect("object").remove("kind");
            }),
            Want::Denied("request.kind.kind"),
        ),
        Case {
            content_type: Some("text/plain"),
            ..case(
                "content type text/plain",
                POD_GATE,
                json_bytes(&good),
                Want::Plain(415, "text/plain"),
            )
        },
        Case {
            content_type: None,
            ..case(
                "no content type",
                POD_GATE,
                json_bytes(&good),
                Want::Plain(415, "application/json"),
            )
        },
        Case {
            content_type: Some("Application/JSON; charset=utf-8"),
            ..case(
                "content type with parameters",
                POD_GATE,
                json_bytes(&good),
                Want::Patched,
            )
        },
        case(
            "body over 3 MiB",
            POD_GATE,
            oversized,
            Want::Plain(413, "length limit"),
        ),
        case(
            "a Service to the pod gate",
            POD_GATE,
            json_bytes(&service),
            Want::Allowed,
        ),
        case(
            "DELETE with null object",
            POD_GATE,
            with(&|v| {
                v["request"]["operation"] = json!("DELETE");
                v["request"]["object"] = Value::Null;
                v["request"]["oldObject"] = pod("apps");
            }),
            Want::Allowed,
        ),
        case(
            "UPDATE of a pod",
            POD_GATE,
            with(&|v| {
                v["request"]["operation"] = json!("UPDATE");
                v["request"]["oldObject"] = pod("apps");
            }),
            Want::Allowed,
        ),
        case(
            "CREATE with object a string",
            POD_GATE,
            with(&|v| v["request"]["object"] = json!("pod")),
            Want::Denied("request.object"),
        ),
        case(
            "CREATE with no object",
            POD_GATE,
            with(&|v| {
                v["request"]
                    .as_object_mut()
                    .expect("object")
                    .remove("object");
            }),
            Want::Denied("request.object"),
        ),
        case(
            "unknown path",
            "/mutate/nothing",
            json_bytes(&good),
            Want::Empty(404),
        ),
        case("root path", "/", json_bytes(&good), Want::Empty(404)),
        Case {
            method: "GET",
            content_type: None,
            ..case(
                "GET on a review path",
                POD_GATE,
                Vec::new(),
                Want::Empty(405),
            )
        },
        case(
            // Skipped without recursion (serde_json ignores values iteratively): the body is an
            // array, not a review.
            "10,000 nested arrays",
            POD_GATE,
            nested,
            Want::Plain(400, "expected a JSON object"),
        ),
        case(
            "invalid UTF-8",
            POD_GATE,
            b"{\"apiVersion\":\"\xff\xfe\"}".to_vec(),
            Want::Plain(400, "not JSON"),
        ),
        case(
            "empty body",
            POD_GATE,
            Vec::new(),
            Want::Plain(400, "not JSON"),
        ),
        case(
            "trailing garbage",
            POD_GATE,
            [json_bytes(&good), b"}".to_vec()].concat(),
            Want::Plain(400, "not JSON"),
        ),
        case(
            "a Node with no NodeGates",
            NODE_TAINT,
            json_bytes(&node),
            Want::Allowed,
        ),
        case(
            "a Pod to the node taint",
            NODE_TAINT,
            json_bytes(&good),
            Want::Allowed,
        ),
        case(
            "a Pod with no policies",
            POLICIES,
            json_bytes(&good),
            Want::Allowed,
        ),
        case(
            "a Node nesting 10,000 arrays to the node taint",
            NODE_TAINT,
            deep_node,
            Want::Denied("recursion limit"),
        ),
        case(
            "malformed review to policies",
            POLICIES,
            with(&|v| v["request"]["object"] = json!(7)),
            Want::Denied("request.object"),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_its_documented_answer() {
    let h = start().await;
    let cases = bad_input_cases();
    assert!(cases.len() >= 18, "{} cases", cases.len());
    for c in &cases {
        let req = Req {
            method: c.method,
            ..Req::post(c.path, &c.body)
        }
        .content_type(c.content_type);
        let stream = tls_connect(h.server.addr, &h.tls)
            .await
            .expect("TLS connection");
        // Write and read at once: a server that answers before reading the whole body must
        // not deadlock the test. Write errors show up as a missing response.
        let (rd, mut wr) = tokio::io::split(stream);
        let bytes = req.closing().encode();
        let write = async {
            let _ = timeout(IO_TIMEOUT, wr.write_all(&bytes)).await;
            let _ = timeout(IO_TIMEOUT, wr.flush()).await;
        };
        let mut reader = Conn::new(rd);
        let ((), resp) = tokio::join!(write, reader.read_response());
        let resp = resp.unwrap_or_else(|e| panic!("{}: no response: {e}", c.name));
        let name = c.name;
        match c.want {
            Want::Plain(status, text) => {
                assert_eq!(resp.status, status, "{name}: {resp:?}");
                assert!(
                    resp.header("content-type")
                        .is_some_and(|t| t.starts_with("text/plain")),
                    "{name}: {resp:?}"
                );
                assert!(resp.text().contains(text), "{name}: {:?}", resp.text());
            }
            Want::Empty(status) => {
                assert_eq!(resp.status, status, "{name}: {resp:?}");
                assert!(resp.body.is_empty(), "{name}: {resp:?}");
                if status == 405 {
                    assert!(
                        resp.header("allow").is_some_and(|a| a.contains("POST")),
                        "{name}: {resp:?}"
                    );
                }
            }
            Want::Allowed => {
                assert_eq!(resp.status, 200, "{name}: {resp:?}");
                assert_allowed_unpatched(&resp, "uid-case");
            }
            Want::Patched => {
                let v = assert_answer(&resp, "uid-case");
                assert_eq!(v["response"]["allowed"], true, "{name}: {v}");
                assert!(patch_of(&v).is_some(), "{name}: {v}");
            }
            Want::Denied(text) => {
                let v = assert_answer(&resp, "uid-case");
                let r = &v["response"];
                assert_eq!(r["allowed"], false, "{name}: {v}");
                assert_eq!(r["status"]["code"], 400, "{name}: {v}");
                let message = r["status"]["message"].as_str().unwrap_or_default();
                assert!(message.contains(text), "{name}: {v}");
                assert!(r.get("patch").is_none(), "{name}: {v}");
            }
        }
    }
    h.assert_up().await;
}

// ------------------------------------------------------------------------------------------
// 3. Certificate reload.

/// Connects trusting `tls` until it works (bounded), for a reload that is under way.
async fn connect_eventually(addr: SocketAddr, tls: &TlsConnector, what: &str) -> Conn<Tls> {
    let deadline = tokio::time::Instant::now() + EVENTUALLY;
    let mut last = None;
    for _ in 0..1000 {
        match tls_connect(addr, tls).await {
            Ok(s) => return Conn::new(s),
            Err(e) => last = Some(e),
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    panic!("{what}: no successful handshake within {EVENTUALLY:?}: {last:?}");
}

async fn assert_review_ok<S: AsyncRead + AsyncWrite + Unpin>(conn: &mut Conn<S>, uid: &str) {
    let body = json_bytes(&pod_review(uid, "apps"));
    let resp = conn
        .request(&Req::post(POD_GATE, &body))
        .await
        .unwrap_or_else(|e| panic!("{uid}: no response: {e}"));
    let v = assert_answer(&resp, uid);
    assert_eq!(v["response"]["allowed"], true, "{v}");
    assert!(patch_of(&v).is_some(), "{v}");
}

const RELOADS: &str = "meshgate_webhook_cert_reloads_total ";
const RELOAD_ERRORS: &str = "meshgate_webhook_cert_reload_errors_total ";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_reload_swaps_without_dropping_connections() {
    let mut h = start().await;
    let addr = h.server.addr;
    let old_tls = h.tls.clone();
    let before = h.metrics().await;
    assert_eq!(metric(&before, RELOADS), Some(0.0), "{before}");
    assert_eq!(metric(&before, RELOAD_ERRORS), Some(0.0), "{before}");

    // A keep-alive connection opened before the swap.
    let mut kept = h.connect().await;
    assert_review_ok(&mut kept, "uid-kept-1").await;

    // A new pair from a new CA, swapped in like a Secret update.
    let (new_ca, new_pair) = new_ca("meshgate-test-ca-2");
    let new_tls = connector(&new_ca);
    h.certs
        .swap(new_pair.cert_pem.as_bytes(), new_pair.key_pem.as_bytes())
        .expect("swap the certificate");
    let mut fresh = connect_eventually(addr, &new_tls, "new CA after the swap").await;
    assert_review_ok(&mut fresh, "uid-fresh-1").await;
    let old = tls_connect(addr, &old_tls).await;
    assert!(
        old.is_err(),
        "a client trusting only the old CA still connects"
    );
    h.tls = new_tls.clone();

    // The connection from before the swap still works.
    assert_review_ok(&mut kept, "uid-kept-2").await;
    let after = h.metrics().await;
    assert!(metric(&after, RELOADS).is_some_and(|n| n >= 1.0), "{after}");

    // A garbage certificate: rejected, counted, and the current one keeps serving.
    let errors = metric(&after, RELOAD_ERRORS).expect("reload error counter");
    h.certs
        .swap(
            b"-----BEGIN CERTIFICATE-----\ngarbage\n",
            new_pair.key_pem.as_bytes(),
        )
        .expect("swap the certificate");
    let mut counted = None;
    for _ in 0..300 {
        let text = h.metrics().await;
        if metric(&text, RELOAD_ERRORS).is_some_and(|n| n > errors) {
            counted = Some(text);
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    let counted = counted.expect("the bad certificate is counted in cert_reload_errors");
    assert!(
        counted.contains("# TYPE meshgate_webhook_cert_reload_errors counter"),
        "{counted}"
    );
    let mut fresh = connect_eventually(addr, &new_tls, "after the bad certificate").await;
    assert_review_ok(&mut fresh, "uid-fresh-2").await;
    assert!(
        tls_connect(addr, &old_tls).await.is_err(),
        "the old CA came back"
    );
    assert_review_ok(&mut kept, "uid-kept-3").await;

    h.assert_up().await;
}

// ------------------------------------------------------------------------------------------
// 4. Graceful shutdown.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_answers_every_sent_review() {
    const N: usize = 20;
    let Harness {
        server, tls, certs, ..
    } = start().await;
    let (addr, health_addr) = (server.addr, server.health_addr);

    let (sent_tx, mut sent_rx) = tokio::sync::mpsc::channel::<usize>(N);
    let mut tasks = Vec::new();
    for i in 0..N {
        let tls = tls.clone();
        let sent = sent_tx.clone();
        tasks.push(tokio::spawn(async move {
            let uid = format!("uid-drain-{i}");
            let body = json_bytes(&pod_review(&uid, "apps"));
            let mut conn = Conn::new(tls_connect(addr, &tls).await?);
            conn.send(&Req::post(POD_GATE, &body).closing()).await?;
            let _ = sent.send(i).await;
            let resp = conn.read_response().await?;
            Ok::<_, io::Error>((uid, resp))
        }));
    }
    drop(sent_tx);
    for _ in 0..N {
        let sent = timeout(IO_TIMEOUT, sent_rx.recv())
            .await
            .expect("requests sent in time");
        assert!(sent.is_some(), "a request could not be sent");
    }

    timeout(IO_TIMEOUT, server.shutdown(Duration::from_secs(5)))
        .await
        .expect("shutdown in time")
        .expect("clean shutdown");

    for task in tasks {
        let answer = task.await.expect("client task");
        let (uid, resp) = answer.unwrap_or_else(|e| panic!("a sent review got no answer: {e}"));
        let v = assert_answer(&resp, &uid);
        assert_eq!(v["response"]["allowed"], true, "{v}");
        assert!(patch_of(&v).is_some(), "{v}");
    }

    // Stopped: both ports refuse new connections.
    for a in [addr, health_addr] {
        let connect = timeout(IO_TIMEOUT, TcpStream::connect(a))
            .await
            .expect("connect in time");
        let err = connect.expect_err("a connection after shutdown");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{a}: {err}");
    }
    drop(certs);
}

// ------------------------------------------------------------------------------------------
// 5. Metrics and readiness.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_readiness() {
    let h = start().await;
    let resp = h.health_get("/readyz").await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "ok"), "{resp:?}");

    let node = review(
        "uid-node",
        "Node",
        "CREATE",
        "",
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}, "spec": {}}),
    );
    for (path, v) in [
        (POD_GATE, pod_review("uid-m1", "apps")),
        (POD_GATE, pod_review("uid-m2", "other")),
        (NODE_TAINT, node),
        (POLICIES, pod_review("uid-m3", "apps")),
    ] {
        let resp = h.review(path, &v).await;
        assert_eq!(resp.status, 200, "{path}: {resp:?}");
    }
    let resp = h.call(&Req::post(POD_GATE, b"{}")).await;
    assert_eq!(resp.status, 400, "{resp:?}");

    let resp = h.health_get("/metrics").await;
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(
        resp.header("content-type")
            .is_some_and(|c| c.starts_with("application/openmetrics-text")),
        "{resp:?}"
    );
    let text = resp.text();
    let reviews = |path: &str, outcome: &str| {
        metric(
            &text,
            &format!(r#"meshgate_webhook_reviews_total{{path="{path}",outcome="{outcome}"}} "#),
        )
    };
    assert_eq!(reviews(POD_GATE, "mutated"), Some(1.0), "{text}");
    assert_eq!(reviews(POD_GATE, "not-selected"), Some(1.0), "{text}");
    assert_eq!(reviews(POD_GATE, "invalid"), Some(1.0), "{text}");
    assert_eq!(reviews(NODE_TAINT, "unchanged"), Some(1.0), "{text}");
    assert_eq!(reviews(POLICIES, "unchanged"), Some(1.0), "{text}");
    assert!(
        text.contains("# TYPE meshgate_webhook_reviews counter"),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"meshgate_webhook_mutations_total{mutation="init-gate"} "#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"meshgate_webhook_review_duration_seconds_count{path="/mutate/pod-gate"} "#
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "meshgate_webhook_in_flight_reviews "),
        Some(0.0),
        "{text}"
    );
    assert!(text.trim_end().ends_with("# EOF"), "{text}");

    let resp = h.health_get("/nothing").await;
    assert_eq!(resp.status, 404, "{resp:?}");
    h.assert_up().await;
}

// ------------------------------------------------------------------------------------------
// Overload and abuse.

/// This process's peak resident set (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .expect("VmHWM")
}

/// A POST of a shared body, written without copying it (the client's memory stays out of the
/// server's peak). Returns the status.
async fn post_shared(
    addr: SocketAddr,
    tls: &TlsConnector,
    path: &str,
    body: &[u8],
) -> io::Result<u16> {
    let mut conn = Conn::new(tls_connect(addr, tls).await?);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        conn.stream.write_all(head.as_bytes()).await?;
        conn.stream.write_all(body).await?;
        conn.stream.flush().await
    };
    // The server may answer (413) and close before the whole body is written.
    let _ = timeout(IO_TIMEOUT, write).await;
    conn.read_response().await.map(|r| r.status)
}

/// The memory limit `meshgate install` gives the webhook container.
const CONTAINER_LIMIT: u64 = 256 * 1024 * 1024;

/// Slow and oversized bodies, and reviews of the largest real objects, at the in-flight limit:
/// the webhook refuses what is over its limits at once (429 over the in-flight limit, 413 over
/// the body limit), stays up, keeps answering well-formed reviews once the slow clients are gone,
/// and its memory stays under the container's limit. (The server runs in this process; the
/// client side shares one request buffer, so the peak is the server's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_and_abuse_leave_the_webhook_up_and_answering() {
    // The limits `meshgate install` configures.
    const LIMIT: usize = meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT;
    let h = start_with(LIMIT).await;

    // 1. Slow clients take every slot: headers of a 1 MiB body, then a trickle.
    let slow = h.slow_clients(POD_GATE, LIMIT).await;
    // Once they hold the slots, a well-formed review is refused at once, not queued.
    let refused = h
        .refused_review(POD_GATE)
        .await
        .expect("a review is refused while the slow clients hold every slot");
    assert!(refused.text().contains("overloaded"), "{refused:?}");
    let overloaded = metric(&h.metrics().await, "meshgate_webhook_overloaded_total ")
        .expect("overloaded counter");
    assert!(overloaded >= 1.0, "{overloaded}");
    // The slow clients go away: their slots come back.
    drop(slow);
    let mut answered = false;
    for i in 0..200 {
        let resp = h
            .review(POD_GATE, &pod_review(&format!("free-{i}"), "other"))
            .await;
        if resp.status == 200 {
            assert_answer(&resp, &format!("free-{i}"));
            answered = true;
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    assert!(
        answered,
        "reviews are answered again once the slow clients left"
    );

    // 2. Oversized bodies, many at once: each gets 413 (or 429 over the limit), none is read
    //    beyond the body limit.
    let oversized = Arc::new(vec![b' '; MAX_BODY + 1024 * 1024]);
    let mut tasks = Vec::new();
    for _ in 0..(4 * LIMIT) {
        let (addr, tls, body) = (h.server.addr, h.tls.clone(), oversized.clone());
        tasks.push(tokio::spawn(async move {
            post_shared(addr, &tls, POD_GATE, &body).await
        }));
    }
    for t in tasks {
        // The server may close the connection before reading the whole body.
        if let Ok(status) = t.await.expect("task") {
            assert!(matches!(status, 413 | 429), "oversized body: {status}");
        }
    }

    // 3. Reviews of the largest real objects (a ConfigMap UPDATE, object and oldObject at
    //    etcd's 1.5 MiB limit), at the in-flight limit and over it.
    let data = "x".repeat(1024 * 1024 + 400 * 1024);
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "big", "namespace": "other"}, "data": {"blob": data}});
    let mut big = review("big", "ConfigMap", "UPDATE", "other", cm.clone());
    big["request"]["oldObject"] = cm;
    let body = Arc::new(serde_json::to_vec(&big).expect("json"));
    drop(big);
    assert!(body.len() < MAX_BODY, "{} bytes", body.len());
    let mut tasks = Vec::new();
    for _ in 0..(2 * LIMIT) {
        let (addr, tls, body) = (h.server.addr, h.tls.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            post_shared(addr, &tls, POLICIES, &body)
                .await
                .expect("response")
        }));
    }
    let mut ok = 0;
    for t in tasks {
        let status = t.await.expect("task");
        assert!(matches!(status, 200 | 429), "largest review: {status}");
        ok += usize::from(status == 200);
    }
    assert!(ok >= 1, "some of the largest reviews are answered");

    h.assert_up().await;
    let peak = peak_rss();
    assert!(
        peak < CONTAINER_LIMIT,
        "peak RSS {} MiB over the container limit {} MiB",
        peak / (1024 * 1024),
        CONTAINER_LIMIT / (1024 * 1024)
    );
    eprintln!(
        "peak RSS of the test process: {:.1} MiB",
        peak as f64 / (1024.0 * 1024.0)
    );
}

// ------------------------------------------------------------------------------------------
// Admission that keeps the gate: per-route limits, timed-out reviews, dual-stack listeners.

/// Slow policy reviews (a tenant's `apiCall` context entry waits up to 2 s) hold every slot
/// they can get; the pod gate keeps answering. Until the routes had limits of their own, the
/// same clients took the gate's slots too and it answered 429, which the failure policy
/// `Ignore` turns into a pod admitted without its gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_policy_reviews_never_take_the_gates_slots() {
    const LIMIT: usize = meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT;
    let h = start_with(LIMIT).await;
    // As many slow policy reviews as the whole limit: headers of a 1 MiB body, then nothing.
    let slow = h.slow_clients(POLICIES, LIMIT).await;
    // The policies route is full once its own limit is held (the others were refused).
    assert!(
        h.refused_review(POLICIES).await.is_some(),
        "the slow policy reviews fill their route"
    );
    // The gate answers every review meanwhile, with its gate.
    for i in 0..LIMIT {
        let uid = format!("gate-{i}");
        let resp = h.review(POD_GATE, &pod_review(&uid, "apps")).await;
        assert_eq!(
            resp.status, 200,
            "pod gate review {i} while policies are slow: {resp:?}"
        );
        let answer = assert_answer(&resp, &uid);
        assert!(patch_of(&answer).is_some(), "review {i} gated: {answer}");
    }
    let overloaded = metric(&h.metrics().await, "meshgate_webhook_overloaded_total ")
        .expect("overloaded counter");
    println!(
        "{LIMIT} slow policy reviews: {} held the policies route, {overloaded} refused; {LIMIT} pod-gate reviews answered, gated",
        meshgate_webhook::server::policy_limit(LIMIT)
    );
    drop(slow);
    h.assert_up().await;
}

/// An API server that accepts connections and never answers: every read the webhook makes of it
/// hangs.
async fn silent_api_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listener");
    let addr = listener.local_addr().expect("address");
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (addr, task)
}

/// A review that outlives the request timeout (here: its namespace is not cached and the API
/// server does not answer the read) gets 503 and leaves the in-flight gauge; before, the gauge
/// kept every timed-out review forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_review_over_the_timeout_leaves_the_in_flight_gauge() {
    let (api, silent) = silent_api_server().await;
    let config = kube::Config::new(format!("http://{api}").parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    // The watches are never driven: nothing is cached, every namespace is read.
    let (sources, _drive) = Sources::watch(client);
    let h = start_custom(
        sources,
        "127.0.0.1:0".parse().expect("address"),
        Duration::from_millis(500),
        meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT,
    )
    .await;
    for i in 0..3 {
        let resp = h
            .review(POD_GATE, &pod_review(&format!("slow-{i}"), "apps"))
            .await;
        assert_eq!(resp.status, 503, "review {i} over the timeout: {resp:?}");
    }
    let in_flight =
        metric(&h.metrics().await, "meshgate_webhook_in_flight_reviews ").expect("in-flight gauge");
    assert_eq!(in_flight, 0.0, "the gauge after three timed-out reviews");
    silent.abort();
}

/// The default listener, `[::]`, takes IPv6 and IPv4 connections alike (IPv6-only and
/// dual-stack clusters; before, the webhook listened on `0.0.0.0` only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wildcard_listener_serves_ipv6_and_ipv4() {
    let namespaces = BTreeMap::new();
    let h = start_custom(
        Sources::fixed(namespaces, vec![], vec![]),
        "[::]:0".parse().expect("address"),
        Duration::from_secs(10),
        meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT,
    )
    .await;
    let port = h.server.addr.port();
    for ip in ["::1", "127.0.0.1"] {
        let addr = SocketAddr::new(ip.parse().expect("ip"), port);
        let tls = tls_connect(addr, &h.tls)
            .await
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        let mut conn = Conn::new(tls);
        let body = serde_json::to_vec(&pod_review(ip, "other")).expect("json");
        let resp = conn
            .request(&Req::post(POD_GATE, &body).closing())
            .await
            .expect("response");
        assert_eq!(resp.status, 200, "{addr}: {resp:?}");
        assert_answer(&resp, ip);
    }
}

//! What a `configMap` context entry costs a review: one MutationPolicy whose annotation value
//! comes from a ConfigMap (`{{ mesh.data.exclude }}`, the ConfigMap served from the webhook's
//! cache of the ConfigMaps policies name), against the same policy with the value written in
//! it. Both give the same patch.
//!
//! * **in process**: `meshgate_core::policy::apply` on the ~3 KB pod of `tools/bench/pod.json`
//!   with the webhook's own ConfigMap cache as its cluster data (the lookup a review does);
//! * **served**: meshgate's real [`Server`], `/mutate/policies`, one keep-alive HTTPS
//!   connection, one review at a time; the two policies are two servers in this process.
//!
//! Rounds alternate the two (which goes first alternates too); a ratio is the median of the
//! per-round ratios, with their spread. Run: `cargo bench -p meshgate-webhook --bench
//! policy_context`; `MESHGATE_BENCH_ROUNDS` (7). Without `--bench` (`cargo test --benches`) it
//! does one short round as a smoke test.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshgate_api::GateConfig;
use meshgate_api::mutation_policy::{MutationPolicySpec, Operation};
use meshgate_core::policy::{self, MatchContext};
use meshgate_core::select::Meta;
use meshgate_testenv::measure::median;
use meshgate_webhook::metrics::Metrics;
use meshgate_webhook::tls::CertFiles;
use meshgate_webhook::{App, Server, ServerOptions, Sources};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

const POD: &str = include_str!("../../../tools/bench/pod.json");
const NAMESPACE: &str = "apps";
const ANNOTATION: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
const VALUE: &str = "10.96.0.1/32";

/// The three variants: the value written in the policy, from a `variable` context entry, from
/// a `configMap` context entry.
const VARIANTS: [&str; 3] = ["literal", "variable-context", "configmap-context"];

fn policy(variant: usize) -> MutationPolicySpec {
    let value = if variant == 0 {
        VALUE
    } else {
        "{{ mesh.data.exclude }}"
    };
    let mut mutation = json!({"annotations": {"values": {ANNOTATION: value}}});
    if variant == 1 {
        mutation["context"] =
            json!([{"name": "mesh", "variable": {"value": {"data": {"exclude": VALUE}}}}]);
    }
    if variant == 2 {
        mutation["context"] = json!([{"name": "mesh", "configMap": {"name": "mesh-settings", "namespace": NAMESPACE}}]);
    }
    let spec: MutationPolicySpec = serde_json::from_value(json!({
        "match": {"kinds": ["Pod"]},
        "mutations": [mutation],
    }))
    .expect("policy");
    policy::validate(&spec).expect("valid policy");
    spec
}

fn sources(variant: usize) -> Sources {
    let namespaces = BTreeMap::from([(NAMESPACE.to_owned(), Meta::default())]);
    let config_map = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "mesh-settings", "namespace": NAMESPACE, "resourceVersion": "1"},
        "data": {"exclude": VALUE, "unrelated": "x".repeat(512)}});
    Sources::fixed_with_config_maps(
        namespaces,
        vec![("mesh-egress".to_owned(), policy(variant))],
        vec![config_map],
    )
}

fn review_request(pod: &Value) -> Vec<u8> {
    let body = serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "00000000-0000-0000-0000-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE", "namespace": NAMESPACE,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod, "oldObject": null, "dryRun": false,
        }
    }))
    .expect("review");
    let mut out = format!(
        "POST /mutate/policies HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend(body);
    out
}

/// In process: `iterations` applications of the policy; ns per review.
fn in_process(
    sources: &Sources,
    policies: &[(String, MutationPolicySpec)],
    pod: &Value,
    iterations: u32,
) -> f64 {
    let labels = BTreeMap::new();
    let ctx = MatchContext {
        operation: Operation::Create,
        namespace: NAMESPACE,
        namespace_labels: &labels,
        cluster: sources.cluster_data(),
    };
    let start = Instant::now();
    for _ in 0..iterations {
        let applied = policy::apply(policies.iter().map(|(n, s)| (n.as_str(), s)), pod, &ctx);
        assert!(
            applied.failed.is_empty() && applied.changed(),
            "{:?}",
            applied.failed
        );
        std::hint::black_box(applied);
    }
    start.elapsed().as_nanos() as f64 / f64::from(iterations)
}

struct Conn {
    stream: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(addr: SocketAddr, tls: &TlsConnector) -> Conn {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        tcp.set_nodelay(true).expect("nodelay");
        let stream = tls
            .connect(ServerName::IpAddress(addr.ip().into()), tcp)
            .await
            .expect("TLS");
        Conn {
            stream,
            buf: Vec::new(),
        }
    }

    /// One review; the response body.
    async fn call(&mut self, request: &[u8]) -> Vec<u8> {
        self.stream.write_all(request).await.expect("write");
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).to_string();
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse().ok())?
                    })
                    .expect("content-length");
                if self.buf.len() >= end + 4 + length {
                    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
                    let body = self.buf[end + 4..end + 4 + length].to_vec();
                    self.buf.drain(..end + 4 + length);
                    return body;
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "connection closed");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// Served: `requests` reviews one after another; the median latency in µs.
async fn served(conn: &mut Conn, request: &[u8], requests: usize) -> f64 {
    let mut latencies = Vec::with_capacity(requests);
    for _ in 0..requests {
        let start = Instant::now();
        let body = conn.call(request).await;
        latencies.push(start.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(body);
    }
    median(latencies.clone())
}

async fn start(variant: usize, certs: CertFiles) -> (Server, SocketAddr) {
    let config = GateConfig::default();
    let app = App::new(config, sources(variant), Metrics::new());
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("address");
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
    (server, addr)
}

/// `VALUE` per variant (median of rounds) and `RATIO` of each context variant to the literal
/// one (median of the per-round ratios, with their spread).
fn report(what: &str, values: &[Vec<f64>], rounds: usize) {
    for (name, v) in VARIANTS.iter().zip(values) {
        println!("VALUE {what} {name}: {:.1}", median(v.clone()));
    }
    for i in 1..VARIANTS.len() {
        let ratios: Vec<f64> = values[i]
            .iter()
            .zip(&values[0])
            .map(|(a, b)| a / b)
            .collect();
        println!(
            "RATIO {what} {}/{}: {:.2} (spread {}, {rounds} rounds)",
            VARIANTS[i],
            VARIANTS[0],
            median(ratios.clone()),
            spread(&ratios)
        );
    }
    let ratios: Vec<f64> = values[2]
        .iter()
        .zip(&values[1])
        .map(|(a, b)| a / b)
        .collect();
    println!(
        "RATIO {what} {}/{}: {:.2} (spread {}, {rounds} rounds)",
        VARIANTS[2],
        VARIANTS[1],
        median(ratios.clone()),
        spread(&ratios)
    );
}

fn spread(ratios: &[f64]) -> String {
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.2}-{hi:.2}")
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let rounds: usize = std::env::var("MESHGATE_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if full { 7 } else { 1 });
    let (iterations, requests) = if full { (20_000, 3_000) } else { (200, 50) };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pod: Value = serde_json::from_str(POD).expect("tools/bench/pod.json is JSON");

    // In process.
    let variants: Vec<(Sources, Vec<(String, MutationPolicySpec)>)> = (0..VARIANTS.len())
        .map(|v| (sources(v), vec![("mesh-egress".to_owned(), policy(v))]))
        .collect();
    let mut values: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    for round in 0..rounds {
        for k in 0..VARIANTS.len() {
            let i = (round + k) % VARIANTS.len();
            values[i].push(in_process(&variants[i].0, &variants[i].1, &pod, iterations));
        }
    }
    report("in-process-ns-per-review", &values, rounds);

    // Served.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let ca = meshgate_pki::Ca::new("bench-ca", Duration::from_secs(3600)).expect("ca");
        let serving = ca
            .issue_server(&["127.0.0.1"], Duration::from_secs(3600))
            .expect("cert");
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert, &serving.cert_pem).expect("cert");
        std::fs::write(&key, &serving.key_pem).expect("key");
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca.certificate().cert_pem.as_bytes()) {
            roots.add(c.expect("CA PEM")).expect("CA");
        }
        let tls = TlsConnector::from(Arc::new(
            rustls::ClientConfig::builder()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        ));
        let mut servers = Vec::new();
        let mut conns = Vec::new();
        for variant in 0..VARIANTS.len() {
            let (server, addr) = start(
                variant,
                CertFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                },
            )
            .await;
            let mut conn = Conn::open(addr, &tls).await;
            let request = review_request(&pod);
            // Warm-up, and the answer is a patch.
            let body = conn.call(&request).await;
            let review: Value = serde_json::from_slice(&body).expect("review");
            assert!(review["response"]["patch"].is_string(), "{review}");
            for _ in 0..requests / 10 {
                conn.call(&request).await;
            }
            servers.push(server);
            conns.push((conn, request));
        }
        let mut values: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
        for round in 0..rounds {
            for k in 0..VARIANTS.len() {
                let i = (round + k) % VARIANTS.len();
                let (conn, request) = &mut conns[i];
                values[i].push(served(conn, request, requests).await);
            }
        }
        report("served-median-us", &values, rounds);
        for server in servers {
            let _ = server.shutdown(Duration::from_secs(1)).await;
        }
    });
}

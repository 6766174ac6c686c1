//! The init gate end to end: the real API server calls meshgate's webhook over TLS.
//!
//! Run: `cargo test --workspace --test init_gate`.

mod common;

use std::time::Duration;

use axum::Json;
use axum::routing::post;
use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use meshgate_api::config::GateCheck;
use meshgate_api::{GateConfig, Profile};
use serde_json::{Value, json};
use tokio::sync::OnceCell;

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// The port the configured gate check waits on: free on this machine, chosen once.
fn gate_port() -> u16 {
    static PORT: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    *PORT.get_or_init(|| meshgate_testenv::free_port().expect("free port"))
}

/// meshgate's webhook, registered for the istio-ambient profile, shared by the tests here.
async fn setup() -> (kube::Client, std::sync::Arc<meshgate_testenv::ControlPlane>) {
    static READY: OnceCell<()> = OnceCell::const_new();
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    READY
        .get_or_init(|| async {
            let config = GateConfig {
                profiles: vec![Profile::IstioAmbient],
                init_gate: meshgate_api::config::InitGate {
                    checks: vec![GateCheck::TcpListening { port: gate_port() }],
                    timeout_seconds: 60,
                    ..Default::default()
                },
                ..GateConfig::default()
            };
            let webhook = start_webhook(&cp, config.clone()).await;
            register(
                &client,
                &webhook.registration("meshgate", &config, false, false),
            )
            .await;
            // Registration reaches the API server's admission chain asynchronously.
            let ns = cp.namespace("warmup", &[AMBIENT]).await.expect("ns");
            let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
            probe_until(
                &pods,
                "the webhook to be active",
                Duration::from_secs(30),
                has_gate,
            )
            .await;
            // Keep the server for the life of the binary.
            std::mem::forget(webhook);
        })
        .await;
    (client, cp)
}

fn init_names(p: &Pod) -> Vec<String> {
    p.spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map(|cs| cs.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default()
}

fn has_gate(p: &Pod) -> bool {
    init_names(p).iter().any(|n| n == "meshgate-wait")
}

async fn create(client: &kube::Client, ns: &str, pod: Value) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p: Pod = serde_json::from_value(pod).expect("pod");
    let name = p.metadata.name.clone().expect("name");
    pods.create(&PostParams::default(), &p)
        .await
        .expect("pod created");
    pods.get(&name).await.expect("stored pod")
}

#[tokio::test]
async fn pod_in_selected_namespace_is_stored_with_the_gate_first() {
    let (client, cp) = setup().await;
    let ns = cp.namespace("gated", &[AMBIENT]).await.unwrap();
    let stored = create(&client, &ns, pod("plain")).await;
    assert_eq!(init_names(&stored), ["meshgate-wait"]);
    let gate = &stored
        .spec
        .as_ref()
        .unwrap()
        .init_containers
        .as_ref()
        .unwrap()[0];
    let sc = gate.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_owned()][..])
    );
    // A BestEffort pod stays BestEffort: the gate asks for no cpu or memory.
    assert!(
        gate.resources
            .as_ref()
            .is_none_or(|r| r.limits.is_none() && r.requests.is_none()),
        "{:?}",
        gate.resources
    );
    assert_eq!(
        stored.status.as_ref().and_then(|s| s.qos_class.as_deref()),
        Some("BestEffort")
    );

    // Existing init containers and native sidecars come after the gate.
    let mut p = pod("with-inits");
    p["spec"]["initContainers"] = json!([
        {"name": "migrate", "image": "registry.invalid/db:1"},
        {"name": "proxy", "image": "registry.invalid/proxy:1", "restartPolicy": "Always"},
    ]);
    let stored = create(&client, &ns, p).await;
    assert_eq!(init_names(&stored), ["meshgate-wait", "migrate", "proxy"]);
}

#[tokio::test]
async fn pods_that_are_not_ours_are_stored_untouched() {
    let (client, cp) = setup().await;
    let plain_ns = cp.namespace("plain", &[]).await.unwrap();
    assert!(init_names(&create(&client, &plain_ns, pod("unselected")).await).is_empty());

    let ns = cp.namespace("optout", &[AMBIENT]).await.unwrap();
    let mut by_label = pod("by-label");
    by_label["metadata"]["labels"] = json!({"meshgate.dev/inject": "false"});
    assert!(init_names(&create(&client, &ns, by_label).await).is_empty());
    let mut by_annotation = pod("by-annotation");
    by_annotation["metadata"]["annotations"] = json!({"meshgate.dev/inject": "false"});
    assert!(init_names(&create(&client, &ns, by_annotation).await).is_empty());
    let mut none_mode = pod("ambient-none");
    none_mode["metadata"]["labels"] = json!({"istio.io/dataplane-mode": "none"});
    assert!(init_names(&create(&client, &ns, none_mode).await).is_empty());
    let mut host = pod("host-network");
    host["spec"]["hostNetwork"] = json!(true);
    assert!(init_names(&create(&client, &ns, host).await).is_empty());
}

#[tokio::test]
async fn server_side_dry_run_comes_back_mutated_and_stores_nothing() {
    let (client, cp) = setup().await;
    let ns = cp.namespace("dryrun", &[AMBIENT]).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let p: Pod = serde_json::from_value(pod("dry")).unwrap();
    let answered = pods
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &p,
        )
        .await
        .unwrap();
    assert_eq!(init_names(&answered), ["meshgate-wait"]);
    assert!(
        pods.get_opt("dry").await.unwrap().is_none(),
        "dry run stored nothing"
    );
}

/// Another injector, called after meshgate, that puts its own init container first: the API
/// server reinvokes meshgate (reinvocationPolicy IfNeeded), which moves its gate back to the
/// front without adding a second one.
#[tokio::test]
async fn reinvocation_leaves_exactly_one_gate_in_front() {
    let (client, cp) = setup().await;
    let ns = cp
        .namespace("reinvoke", &[AMBIENT, ("reinvoke-test", "on")])
        .await
        .unwrap();

    let app = axum::Router::new().route(
        "/inject",
        post(|Json(review): Json<Value>| async move {
            let object = &review["request"]["object"];
            let has_mine = object["spec"]["initContainers"]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|c| c["name"] == "mesh-init"));
            let ops = if has_mine {
                json!([])
            } else if object["spec"]["initContainers"].is_array() {
                json!([{"op": "add", "path": "/spec/initContainers/0",
                        "value": {"name": "mesh-init", "image": "registry.invalid/init:1"}}])
            } else {
                json!([{"op": "add", "path": "/spec/initContainers",
                        "value": [{"name": "mesh-init", "image": "registry.invalid/init:1"}]}])
            };
            Json(review_patch(&review, &ops))
        }),
    );
    let (url, ca_pem, server) = serve_test_webhook(app).await;
    let mwc = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "zz-other-injector"},
        "webhooks": [{
            "name": "inject.other.example.com",
            "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
            "reinvocationPolicy": "IfNeeded",
            "clientConfig": {"url": format!("{url}/inject"),
                             "caBundle": k8s_openapi::ByteString(ca_pem.into_bytes())},
            "namespaceSelector": {"matchLabels": {"reinvoke-test": "on"}},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
        }],
    });
    register(&client, &mwc).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut n = 0;
    wait_for(
        "the other injector to be active",
        Duration::from_secs(30),
        || {
            n += 1;
            let pods = pods.clone();
            async move {
                let p: Pod = serde_json::from_value(pod(&format!("probe-{n}"))).unwrap();
                let dry = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                pods.create(&dry, &p)
                    .await
                    .ok()
                    .is_some_and(|p| init_names(&p).contains(&"mesh-init".to_owned()))
            }
        },
    )
    .await;

    let stored = create(&client, &ns, pod("both")).await;
    assert_eq!(
        init_names(&stored),
        ["meshgate-wait", "mesh-init"],
        "one gate, in front"
    );

    kube::Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
        client.clone(),
    )
    .delete("zz-other-injector", &Default::default())
    .await
    .unwrap();
    server.abort();
}

fn meshgate_wait() -> std::path::PathBuf {
    meshgate_testenv::workspace_binary("meshgate-wait", "meshgate-wait")
}

/// The stored gate works: its command and arguments, run with the real `meshgate-wait`, pass
/// when the port is listening and fail with the documented exit code and message when not.
#[tokio::test]
async fn the_stored_gate_runs() {
    let (client, cp) = setup().await;
    let ns = cp.namespace("runs", &[AMBIENT]).await.unwrap();
    let stored = create(&client, &ns, pod("runner")).await;
    let gate = stored.spec.unwrap().init_containers.unwrap().remove(0);
    let command = gate.command.unwrap();
    let args = gate.args.unwrap();
    assert_eq!(command, ["/meshgate-wait"]);
    assert!(
        args.windows(2)
            .any(|w| w[0] == "--tcp-listening" && w[1] == gate_port().to_string()),
        "{args:?}"
    );
    let bin = meshgate_wait();

    // Ready: something listens on the port.
    let listener = std::net::TcpListener::bind(("127.0.0.1", gate_port())).unwrap();
    let out = std::process::Command::new(&bin)
        .args(&args)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("ready"));
    drop(listener);

    // Not ready: the stored arguments with a short timeout.
    let mut short = args.clone();
    let i = short.iter().position(|a| a == "--timeout").unwrap();
    short[i + 1] = "500ms".into();
    let out = std::process::Command::new(&bin)
        .args(&short)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "timed out exit code");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("timed out") && stderr.contains(&format!("tcp-listening {}", gate_port())),
        "{stderr}"
    );
}

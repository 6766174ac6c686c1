//! The test control plane itself: the real etcd, kube-apiserver and kube-scheduler.
//!
//! Run: `cargo test --workspace --test control_plane`.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Json;
use axum::routing::post;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, WebhookClientConfig,
};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use meshgate_testenv::{ControlPlane, Options, shared, wait_for};
use serde_json::{Value, json};

async fn control_plane() -> std::sync::Arc<ControlPlane> {
    shared(Options {
        scheduler: true,
        ..Options::default()
    })
    .await
    .expect("the control plane starts")
}

fn pod(name: &str, labels: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some("registry.invalid/app:1".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// A Node as a kubelet would register it: Ready, with capacity, optionally tainted, labelled so
/// each test's pods can be steered to its own nodes.
fn node(name: &str, group: &str, taints: Vec<Taint>) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"meshgate.dev/test-group": group}},
        "spec": {"taints": taints},
    }))
    .expect("a valid node")
}

async fn make_node_ready(api: &Api<Node>, name: &str) {
    meshgate_testenv::make_node_ready(&api.clone().into_client(), name)
        .await
        .expect("node made ready");
}

#[tokio::test]
async fn creates_namespace_node_and_pod() {
    let cp = control_plane().await;
    let client = cp.client().await.unwrap();
    let ns = cp.namespace("basic", &[("team", "a")]).await.unwrap();

    let nodes: Api<Node> = Api::all(client.clone());
    let name = format!("{ns}-node");
    nodes
        .create(&PostParams::default(), &node(&name, &ns, vec![]))
        .await
        .unwrap();
    assert_eq!(
        nodes.get(&name).await.unwrap().metadata.name.as_deref(),
        Some(name.as_str())
    );

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.create(&PostParams::default(), &pod("p", &[("app", "x")]))
        .await
        .unwrap();
    let stored = pods.get("p").await.unwrap();
    assert_eq!(stored.metadata.namespace.as_deref(), Some(ns.as_str()));
    assert_eq!(stored.spec.unwrap().containers[0].name, "app");

    let stored_ns = Api::<k8s_openapi::api::core::v1::Namespace>::all(client)
        .get(&ns)
        .await
        .unwrap();
    assert_eq!(
        stored_ns
            .metadata
            .labels
            .unwrap()
            .get("team")
            .map(String::as_str),
        Some("a")
    );
    nodes.delete(&name, &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn scheduler_binds_to_schedulable_node_and_respects_taints() {
    let cp = control_plane().await;
    let client = cp.client().await.unwrap();
    let ns = cp.namespace("sched", &[]).await.unwrap();
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let selector = |group: &str| PodSpec {
        node_selector: Some(BTreeMap::from([(
            "meshgate.dev/test-group".to_owned(),
            group.to_owned(),
        )])),
        ..PodSpec::default()
    };

    // A schedulable node: the pod is bound to it.
    let free_group = format!("{ns}-free");
    let free = format!("{ns}-free-node");
    nodes
        .create(&PostParams::default(), &node(&free, &free_group, vec![]))
        .await
        .unwrap();
    make_node_ready(&nodes, &free).await;
    let mut p = pod("bound", &[]);
    if let Some(spec) = p.spec.as_mut() {
        spec.node_selector = selector(&free_group).node_selector;
    }
    pods.create(&PostParams::default(), &p).await.unwrap();
    wait_for(
        "the scheduler to bind the pod",
        Duration::from_secs(60),
        || async {
            pods.get("bound")
                .await
                .ok()
                .and_then(|p| p.spec?.node_name)
                .as_deref()
                == Some(free.as_str())
        },
    )
    .await;

    // The only matching node is tainted NoSchedule: the pod stays Pending and unbound, and the
    // scheduler says why.
    let tainted_group = format!("{ns}-tainted");
    let tainted = format!("{ns}-tainted-node");
    let taint = Taint {
        key: "example.com/not-ready".into(),
        effect: "NoSchedule".into(),
        ..Taint::default()
    };
    nodes
        .create(
            &PostParams::default(),
            &node(&tainted, &tainted_group, vec![taint]),
        )
        .await
        .unwrap();
    make_node_ready(&nodes, &tainted).await;
    let mut p = pod("pending", &[]);
    if let Some(spec) = p.spec.as_mut() {
        spec.node_selector = selector(&tainted_group).node_selector;
    }
    pods.create(&PostParams::default(), &p).await.unwrap();
    wait_for(
        "the scheduler to report the pod unschedulable",
        Duration::from_secs(60),
        || async {
            pods.get("pending")
                .await
                .ok()
                .and_then(|p| p.status?.conditions)
                .is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c.type_ == "PodScheduled"
                            && c.status == "False"
                            && c.reason.as_deref() == Some("Unschedulable")
                            && c.message
                                .as_deref()
                                .is_some_and(|m| m.contains("untolerated taint"))
                    })
                })
        },
    )
    .await;
    let pending = pods.get("pending").await.unwrap();
    assert_eq!(pending.spec.unwrap().node_name, None);
    assert_eq!(pending.status.unwrap().phase.as_deref(), Some("Pending"));

    for n in [free, tainted] {
        nodes.delete(&n, &DeleteParams::default()).await.unwrap();
    }
}

/// A minimal mutating webhook: labels every pod `mutated-by=test-webhook`.
async fn review(Json(review): Json<Value>) -> Json<Value> {
    let uid = review["request"]["uid"].clone();
    let has_labels = review["request"]["object"]["metadata"]["labels"].is_object();
    let mut ops = Vec::new();
    if !has_labels {
        ops.push(json!({"op": "add", "path": "/metadata/labels", "value": {}}));
    }
    ops.push(json!({"op": "add", "path": "/metadata/labels/mutated-by", "value": "test-webhook"}));
    let patch = serde_json::to_vec(&ops).unwrap_or_default();
    Json(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {
            "uid": uid,
            "allowed": true,
            "patchType": "JSONPatch",
            "patch": k8s_openapi::ByteString(patch),
        }
    }))
}

#[tokio::test]
async fn api_server_calls_a_tls_webhook_and_applies_its_patch() {
    let cp = control_plane().await;
    let client = cp.client().await.unwrap();
    let ns = cp
        .namespace("webhook", &[("webhook-test", "on")])
        .await
        .unwrap();

    // The webhook: a TLS server on loopback with a certificate from a CA made here.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = meshgate_pki::Ca::new("webhook-test-ca", Duration::from_secs(3600)).unwrap();
    let serving = ca
        .issue_server(&["127.0.0.1"], Duration::from_secs(3600))
        .unwrap();
    let tls = axum_server::tls_rustls::RustlsConfig::from_pem(
        serving.cert_pem.into_bytes(),
        serving.key_pem.into_bytes(),
    )
    .await
    .unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = calls.clone();
    let app = axum::Router::new().route(
        "/mutate",
        post(move |body: Json<Value>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            review(body)
        }),
    );
    let server = axum_server::from_tcp_rustls(listener, tls)
        .unwrap()
        .serve(app.into_make_service());
    let server = tokio::spawn(server);

    let name = format!("{ns}-test-webhook");
    let config = MutatingWebhookConfiguration {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..ObjectMeta::default()
        },
        webhooks: Some(vec![MutatingWebhook {
            name: "label.test.meshgate.dev".into(),
            admission_review_versions: vec!["v1".into()],
            side_effects: "None".into(),
            failure_policy: Some("Fail".into()),
            timeout_seconds: Some(5),
            client_config: WebhookClientConfig {
                url: Some(format!("https://127.0.0.1:{port}/mutate")),
                ca_bundle: Some(ByteString(ca.certificate().cert_pem.clone().into_bytes())),
                ..WebhookClientConfig::default()
            },
            namespace_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([("webhook-test".into(), "on".into())])),
                ..LabelSelector::default()
            }),
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec!["".into()]),
                api_versions: Some(vec!["v1".into()]),
                operations: Some(vec!["CREATE".into()]),
                resources: Some(vec!["pods".into()]),
                scope: Some("Namespaced".into()),
            }]),
            ..MutatingWebhook::default()
        }]),
    };
    let configs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    configs
        .create(&PostParams::default(), &config)
        .await
        .unwrap();

    // The API server picks up new webhook configurations asynchronously: retry the create of a
    // probe pod until it comes back mutated.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut n = 0;
    wait_for("the webhook to be called", Duration::from_secs(30), || {
        n += 1;
        let pods = pods.clone();
        let probe = format!("probe-{n}");
        async move {
            let created = pods
                .create(&PostParams::default(), &pod(&probe, &[]))
                .await
                .expect("pod created");
            created
                .metadata
                .labels
                .unwrap_or_default()
                .contains_key("mutated-by")
        }
    })
    .await;

    let created = pods
        .create(&PostParams::default(), &pod("app", &[("app", "web")]))
        .await
        .unwrap();
    let labels = created.metadata.labels.unwrap();
    assert_eq!(
        labels.get("mutated-by").map(String::as_str),
        Some("test-webhook")
    );
    assert_eq!(
        labels.get("app").map(String::as_str),
        Some("web"),
        "existing labels kept"
    );
    // What the API server stored, not only what it answered.
    let stored = pods.get("app").await.unwrap().metadata.labels.unwrap();
    assert_eq!(
        stored.get("mutated-by").map(String::as_str),
        Some("test-webhook")
    );
    assert!(calls.load(std::sync::atomic::Ordering::SeqCst) >= 2);

    configs
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    server.abort();
}

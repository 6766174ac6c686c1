//! Admission that never refuses a pod by mistake and never lets one through ungated, on the
//! real API server with the webhook running as the identity `install` creates
//! (impersonated, the RBAC `install` renders).
//!
//! * A pod created in a namespace the webhook has not seen yet (created the same instant): the
//!   webhook reads the namespace once (`get`, granted by install) and admits the pod **with its
//!   gate**. Until `get` was granted, such a read was forbidden and the pod refused (`allowed:
//!   false`, code 500: the failure policy `Ignore` does not apply to a refusal).
//! * The same while the webhook's namespace watch is cut (its watches never run: nothing is
//!   cached): every pod's namespace is read, and every pod admitted with its gate.
//!
//! Run: `cargo test -p meshgate --test admission_hardening -- --nocapture`.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;

const INSTALL_NS: &str = "meshgate-system";
const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// The first init container of a pod.
fn gate_of(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .init_containers
        .as_ref()?
        .first()
        .map(|c| c.name.clone())
}

/// A counter of the webhook's `/metrics` (0 when absent).
async fn webhook_metric(webhook: &Webhook, name: &str) -> f64 {
    let addr = webhook.health.parse().expect("health address");
    let (_, body) = http_get(addr, "/metrics").await.expect("metrics");
    body.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The installed identities and the gate configuration of `install --profile istio-ambient
/// --strategy pod` (every ambient pod gets the init gate).
async fn installed(cp: &meshgate_testenv::ControlPlane) -> meshgate_api::GateConfig {
    let admin = cp.client().await.expect("client");
    install_crds(&admin).await;
    let options = install_options("istio-ambient", INSTALL_NS);
    install_identities_of(&admin, &options).await;
    meshgate::install::gate_config_for(
        "istio-ambient",
        INSTALL_NS,
        &options.image,
        options.strategy,
        &options.taint_key,
    )
    .expect("config")
}

/// Registers `webhook` as `name` and waits until the API server calls it (a probe pod of an
/// ambient namespace is gated).
async fn register_and_wait(
    cp: &meshgate_testenv::ControlPlane,
    webhook: &Webhook,
    name: &str,
    config: &meshgate_api::GateConfig,
) {
    let admin = cp.client().await.expect("client");
    register(&admin, &webhook.registration(name, config, true, false)).await;
    let probe_ns = cp
        .namespace(&format!("{name}-probe"), &[AMBIENT])
        .await
        .expect("namespace");
    probe_until(
        &Api::<Pod>::namespaced(admin, &probe_ns),
        "the webhook registered",
        Duration::from_secs(60),
        |p| gate_of(p).as_deref() == Some(meshgate_api::names::GATE_CONTAINER),
    )
    .await;
}

/// Creates a pod in `ns` and asserts it was admitted with its gate.
async fn assert_created_gated(admin: &kube::Client, ns: &str) {
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "app"},
        "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]}}))
    .expect("pod");
    let created = Api::<Pod>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("the pod in {ns} was refused: {e}"));
    assert_eq!(
        gate_of(&created).as_deref(),
        Some(meshgate_api::names::GATE_CONTAINER),
        "the pod in {ns} carries its gate"
    );
}

#[tokio::test]
async fn pods_in_namespaces_the_webhook_has_not_seen_are_admitted_with_their_gate() {
    let cp = control_plane(false).await;
    let admin = cp.client().await.expect("client");
    let config = installed(&cp).await;
    let webhook = start_webhook_as(&cp, config.clone(), Some(INSTALL_NS)).await;
    register_and_wait(&cp, &webhook, "meshgate-hardening", &config).await;
    let reads_before = webhook_metric(&webhook, "meshgate_webhook_namespace_reads_total").await;

    // Each namespace, then its pod at once: concurrently, so that the webhook's namespace
    // watch may lag behind some of them.
    const ROUNDS: usize = 40;
    let rounds = (0..ROUNDS).map(|i| {
        let admin = admin.clone();
        async move {
            let name = format!("fresh-{i}");
            let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name,
                "labels": {AMBIENT.0: AMBIENT.1}}}))
            .expect("namespace");
            Api::<Namespace>::all(admin.clone())
                .create(&PostParams::default(), &ns)
                .await
                .expect("namespace created");
            assert_created_gated(&admin, &name).await;
        }
    });
    futures::future::join_all(rounds).await;
    let reads =
        webhook_metric(&webhook, "meshgate_webhook_namespace_reads_total").await - reads_before;
    let unread = webhook_metric(&webhook, "meshgate_webhook_namespace_unread_total").await;
    assert_eq!(unread, 0.0, "every namespace the cache missed was read");
    println!(
        "measured: {ROUNDS} pods created in namespaces made the same instant: {reads} read on a cache miss (as the webhook's ServiceAccount), {ROUNDS} admitted with their gate, 0 refused"
    );
    Api::<MutatingWebhookConfiguration>::all(admin)
        .delete("meshgate-hardening", &Default::default())
        .await
        .expect("registration removed");
}

/// With the namespace watch cut, a pod's namespace is never in the cache: the webhook reads it
/// (`get`, as its ServiceAccount) for every pod, and every pod carries its gate. Without the
/// grant (481bbe6's RBAC) that read was forbidden and the pod refused.
#[tokio::test]
async fn with_the_namespace_watch_cut_every_pod_is_admitted_with_its_gate() {
    let cp = control_plane(false).await;
    let admin = cp.client().await.expect("client");
    let config = installed(&cp).await;
    let webhook = start_webhook_with_cut_watches(&cp, config.clone(), INSTALL_NS).await;
    register_and_wait(&cp, &webhook, "meshgate-cut", &config).await;
    let reads_before = webhook_metric(&webhook, "meshgate_webhook_namespace_reads_total").await;
    const PODS: usize = 20;
    for i in 0..PODS {
        let ns = cp
            .namespace(&format!("cut-{i}"), &[AMBIENT])
            .await
            .expect("namespace");
        assert_created_gated(&admin, &ns).await;
    }
    let reads =
        webhook_metric(&webhook, "meshgate_webhook_namespace_reads_total").await - reads_before;
    let unread = webhook_metric(&webhook, "meshgate_webhook_namespace_unread_total").await;
    println!(
        "measured: namespace watch cut: {PODS} pods in new namespaces, {reads} namespace reads on a cache miss, {unread} unreadable, {PODS} admitted with their gate, 0 refused"
    );
    assert!(
        reads >= PODS as f64,
        "every pod's namespace was read: {reads}"
    );
    assert_eq!(unread, 0.0);
    Api::<MutatingWebhookConfiguration>::all(admin)
        .delete("meshgate-cut", &Default::default())
        .await
        .expect("registration removed");
}

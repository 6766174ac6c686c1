//! Admission that never refuses a pod by mistake and never lets one through ungated, on the
//! real API server with the webhook running as the identity `install` creates
//! (impersonated, the RBAC `install` renders).
//!
//! * A pod created in a namespace the webhook has not seen yet (created the same instant): the
//!   webhook reads the namespace once (`get`, granted by install) and admits the pod **with its
//!   gate**. Until `get` was granted, such a read was forbidden and the pod refused (`allowed:
//!   false`, code 500: the failure policy `Ignore` does not apply to a refusal).
//!
//! Run: `cargo test -p meshgate --test admission_hardening -- --nocapture`.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;

const INSTALL_NS: &str = "meshgate-system";
/// Namespaces created, each with a pod created right after it.
const ROUNDS: usize = 40;

#[tokio::test]
async fn pods_in_namespaces_the_webhook_has_not_seen_are_admitted_with_their_gate() {
    let cp = control_plane(false).await;
    let admin = cp.client().await.expect("client");
    install_crds(&admin).await;
    let options = install_options("istio-ambient", INSTALL_NS);
    install_identities_of(&admin, &options).await;
    let config = meshgate::install::gate_config_for(
        "istio-ambient",
        INSTALL_NS,
        &options.image,
        options.strategy,
        &options.taint_key,
    )
    .expect("config");
    let webhook = start_webhook_as(&cp, config.clone(), Some(INSTALL_NS)).await;
    register(
        &admin,
        &webhook.registration("meshgate-hardening", &config, true, false),
    )
    .await;
    // The registration in effect (it applies asynchronously): a probe in an ambient namespace
    // the webhook has listed is gated.
    let probe_ns = cp
        .namespace("probe", &[("istio.io/dataplane-mode", "ambient")])
        .await
        .expect("namespace");
    probe_until(
        &Api::<Pod>::namespaced(admin.clone(), &probe_ns),
        "the webhook registered",
        Duration::from_secs(60),
        |p| gate_of(p).as_deref() == Some(meshgate_api::names::GATE_CONTAINER),
    )
    .await;
    let reads_before = webhook_metric(&webhook, "meshgate_webhook_namespace_reads_total").await;

    // Each namespace, then its pod at once: concurrently, so that the webhook's namespace
    // watch lags behind some of them.
    let rounds = (0..ROUNDS).map(|i| {
        let admin = admin.clone();
        async move {
            let name = format!("fresh-{i}");
            let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name,
                "labels": {"istio.io/dataplane-mode": "ambient"}}}))
            .expect("namespace");
            Api::<Namespace>::all(admin.clone())
                .create(&PostParams::default(), &ns)
                .await
                .expect("namespace created");
            let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "app"},
                "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]}}))
            .expect("pod");
            let created = Api::<Pod>::namespaced(admin, &name)
                .create(&PostParams::default(), &pod)
                .await;
            (name, created)
        }
    });
    let results = futures::future::join_all(rounds).await;
    let mut gated = 0;
    for (ns, created) in &results {
        let pod = created
            .as_ref()
            .unwrap_or_else(|e| panic!("the pod in {ns} was refused: {e}"));
        assert_eq!(
            gate_of(pod).as_deref(),
            Some(meshgate_api::names::GATE_CONTAINER),
            "the pod in {ns} carries its gate"
        );
        gated += 1;
    }
    let reads =
        webhook_metric(&webhook, "meshgate_webhook_namespace_reads_total").await - reads_before;
    let unread = webhook_metric(&webhook, "meshgate_webhook_namespace_unread_total").await;
    assert_eq!(unread, 0.0, "every namespace the cache missed was read");
    println!(
        "measured: {ROUNDS} pods created in namespaces made the same instant: {reads} read on a cache miss (as the webhook's ServiceAccount), {gated} admitted with their gate, 0 refused"
    );
    Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(admin)
        .delete("meshgate-hardening", &Default::default())
        .await
        .expect("registration removed");
}

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

//! The backfill of existing objects of other kinds than the workloads, on the real API server,
//! with the controller as its installed ServiceAccount (its own binary: the other policy tests
//! run a controller that backfills every policy as the admin).
//!
//! Run: `cargo test -p meshgate --test policies_existing`.

mod common;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service};
use kube::api::{Api, PostParams};
use meshgate_api::MutationPolicy;
use serde_json::{Value, json};

fn policy(name: &str, spec: Value) -> MutationPolicy {
    serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy",
        "metadata": {"name": name}, "spec": spec,
    }))
    .expect("policy")
}

/// The backfill (`existing.enabled`) of other kinds than the workloads: the controller, as its
/// installed ServiceAccount with `--existing-kind services` and `--existing-kind namespaces`,
/// mutates existing Services (namespaced) and a Namespace (cluster-scoped), leaves an opted-out
/// Service alone, and lists them in the policy's status; a kind it was not granted (ConfigMaps)
/// makes the pass report a failure that says what to grant, in the Ready condition and the Event.
#[tokio::test]
async fn the_backfill_mutates_existing_objects_of_the_kinds_it_was_granted() {
    const NS: &str = "meshgate-system";
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    install_crds(&client).await;
    install_identities_of(
        &client,
        &meshgate::install::InstallOptions {
            existing_kinds: vec!["services".into(), "namespaces".into()],
            ..install_options("istio-ambient", NS)
        },
    )
    .await;
    let app = cp
        .namespace("backfill-kinds", &[("backfill-kinds", "yes")])
        .await
        .expect("namespace");
    let services: Api<Service> = Api::namespaced(client.clone(), &app);
    for (name, opted_out) in [("api", false), ("legacy", true)] {
        let mut svc = json!({"metadata": {"name": name}, "spec": {"ports": [{"port": 80}]}});
        if opted_out {
            svc["metadata"]["annotations"] = json!({"meshgate.dev/inject": "false"});
        }
        services
            .create(
                &PostParams::default(),
                &serde_json::from_value(svc).expect("service"),
            )
            .await
            .expect("service created");
    }
    Api::<ConfigMap>::namespaced(client.clone(), &app)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "settings"}})).expect("cm"),
        )
        .await
        .expect("configmap created");
    // Controller only: no webhook, so what changes existing objects is the backfill alone.
    let controller = ControllerTask::start(&cp, NS, Default::default());
    let policies: Api<MutationPolicy> = Api::all(client.clone());
    let label = "example.com/backfilled";
    policies
        .create(
            &PostParams::default(),
            &policy(
                "backfill-kinds",
                json!({"match": {"kinds": ["Service", "Namespace", "ConfigMap"],
                                 "namespaceSelector": {"matchLabels": {"backfill-kinds": "yes"}}},
                       "existing": {"enabled": true, "ratePerSecond": 100},
                       "mutations": [{"labels": {"values": {label: "yes"}}}]}),
            ),
        )
        .await
        .expect("policy created");
    let status = wait_for_policy_status(
        &client,
        "backfill-kinds",
        "the policy's pass to be reported",
        |s| s.existing.is_some(),
    )
    .await;
    let labelled = |labels: Option<std::collections::BTreeMap<String, String>>| {
        labels.unwrap_or_default().get(label).cloned()
    };
    assert_eq!(
        labelled(services.get("api").await.expect("api").metadata.labels).as_deref(),
        Some("yes")
    );
    assert_eq!(
        labelled(
            services
                .get("legacy")
                .await
                .expect("legacy")
                .metadata
                .labels
        ),
        None,
        "an opted-out object is left alone"
    );
    assert_eq!(
        labelled(
            Api::<Namespace>::all(client.clone())
                .get(&app)
                .await
                .expect("namespace")
                .metadata
                .labels
        )
        .as_deref(),
        Some("yes"),
        "a cluster-scoped object is mutated too"
    );
    assert_eq!(
        labelled(
            Api::<ConfigMap>::namespaced(client.clone(), &app)
                .get("settings")
                .await
                .expect("cm")
                .metadata
                .labels
        ),
        None,
        "a kind the controller was not granted is not written"
    );
    let existing = status.existing.expect("report");
    assert!(
        existing.changed.contains(&format!("Service {app}/api"))
            && existing.changed.contains(&format!("Namespace {app}")),
        "{existing:?}"
    );
    assert_eq!(existing.failed, 1, "{existing:?}");
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready");
    assert_eq!(ready.status, "False");
    assert!(
        ready.message.contains("ConfigMap: not listed")
            && ready
                .message
                .contains("meshgate install --existing-kind configmaps"),
        "{}",
        ready.message
    );
    let note = wait_for_event(&client, Some("backfill-kinds"), "ExistingWorkloadsMutated").await;
    assert!(
        note.contains("1 failed"),
        "the Event says the pass had a failure: {note}"
    );
    controller.finish().await;
}

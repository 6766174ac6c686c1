//! The backfill turned off (`meshgate install --workload-backfill=false`): the controller, as
//! its installed ServiceAccount without workload `patch`, leaves existing workloads alone and
//! says so in the policy's `Ready` condition. Its own binary: a controller of its own.
//!
//! Run: `cargo test -p meshgate --test policies_backfill_off`.

mod common;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, PostParams};
use meshgate_api::MutationPolicy;
use serde_json::json;

#[tokio::test]
async fn without_the_backfill_a_policy_applies_at_admission_only() {
    const NS: &str = "meshgate-system";
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    install_crds(&client).await;
    install_identities_of(
        &client,
        &meshgate::install::InstallOptions {
            policies: meshgate::install::PolicyFeatures {
                workload_backfill: false,
                native: true,
            },
            ..install_options("istio-ambient", NS)
        },
    )
    .await;
    let app = cp
        .namespace("backfill-off", &[("backfill-off", "yes")])
        .await
        .expect("namespace");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &app);
    let before = deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {
                    "selector": {"matchLabels": {"app": "web"}},
                    "template": {
                        "metadata": {"labels": {"app": "web"}},
                        "spec": {"containers": [{"name": "app", "image": "app:1"}]},
                    },
                },
            }))
            .expect("deployment"),
        )
        .await
        .expect("deployment created");
    let controller = ControllerTask::start(
        &cp,
        NS,
        meshgate::run::ControllerSettings {
            no_workload_backfill: true,
            ..Default::default()
        },
    );
    let policies: Api<MutationPolicy> = Api::all(client.clone());
    let policy: MutationPolicy = serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy",
        "metadata": {"name": "backfill-off"},
        "spec": {"match": {"kinds": ["Pod"],
                           "namespaceSelector": {"matchLabels": {"backfill-off": "yes"}}},
                 "existing": {"enabled": true, "ratePerSecond": 100},
                 "mutations": [{"annotations": {"values": {"example.com/backfilled": "yes"}}}]},
    }))
    .expect("policy");
    policies
        .create(&PostParams::default(), &policy)
        .await
        .expect("policy created");

    // The controller reports the policy: ready, at admission only, and why.
    let status = wait_for_policy_status(
        &client,
        "backfill-off",
        "the policy's Ready condition",
        |s| s.conditions.iter().any(|c| c.type_ == "Ready"),
    )
    .await;
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "AdmissionOnly"),
        "{ready:?}"
    );
    assert!(
        ready.message.contains("--workload-backfill=false"),
        "{}",
        ready.message
    );
    assert!(status.existing.is_none(), "no pass: {:?}", status.existing);
    // Reported, so decided: the Deployment was not written.
    let after = deployments.get("web").await.expect("deployment");
    assert_eq!(
        after.metadata.resource_version,
        before.metadata.resource_version
    );
    controller.finish().await;
}

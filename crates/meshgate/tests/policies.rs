//! MutationPolicies end to end: the real API server calls meshgate's `/mutate/policies` webhook
//! over TLS, and the controller (run in-process) backfills existing workloads.
//!
//! Run: `cargo test -p meshgate --test policies`.
//!
//! Policies are cluster-scoped and every test of this binary shares one API server, so each
//! policy created here is limited by a `namespaceSelector` on a label that only its own test's
//! namespaces carry.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use meshgate_api::mutation_policy::{
    ExistingReport, ExistingResources, MatchResources, MetadataMutation, Mutation, OnConflict,
};
use meshgate_api::{LabelSelector, MutationPolicy, MutationPolicySpec};
use serde_json::{Value, json};

/// The label that confines each test's policies to that test's namespaces.
const TEST_LABEL: &str = "e2e.meshgate.dev/policy-test";
const ISTIO_INJECTION: (&str, &str) = ("istio-injection", "enabled");
const KEY: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";

/// The Kyverno policy of the issue, as users have it.
const KYVERNO_POLICY: &str = r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: add-external-outbound-annotations
spec:
  rules:
  - name: all-pods-in-cluster
    match:
      any:
      - resources:
          kinds:
          - Pod
    mutate:
      patchStrategicMerge:
        metadata:
          annotations:
            traffic.sidecar.istio.io/excludeOutboundIPRanges: "0.0.0.0/0"
"#;

/// meshgate's webhook registered for the policy path only, and the controller, shared by the
/// tests here.
async fn setup() -> (kube::Client, std::sync::Arc<meshgate_testenv::ControlPlane>) {
    let cp = control_plane(false).await;
    serve_policies(&cp).await;
    (cp.client().await.expect("client"), cp)
}

/// A label value unique to one test (and this process).
fn test_label(test: &str) -> String {
    format!("{test}-{}", std::process::id())
}

fn only_test_namespaces(value: &str) -> LabelSelector {
    LabelSelector::labels([(TEST_LABEL, value)])
}

/// The Kyverno policy of the issue, imported with `meshgate_core::kyverno::import`. The only
/// change made to the imported spec is `match.namespaceSelector` on the test's label, which
/// keeps the tests apart; the caller may enable `existing`.
fn imported_policy(name: &str, label: &str) -> MutationPolicy {
    let doc: Value = serde_saphyr::from_str(KYVERNO_POLICY).expect("yaml");
    let imported = meshgate_core::kyverno::import(&doc).expect("the policy imports");
    assert!(imported.notes.is_empty(), "{:?}", imported.notes);
    let [(imported_name, mut spec)]: [(String, MutationPolicySpec); 1] =
        imported.policies.try_into().expect("one rule, one policy");
    assert_eq!(
        imported_name,
        "add-external-outbound-annotations-all-pods-in-cluster"
    );
    assert!(spec.match_.namespace_selector.is_none());
    spec.match_.namespace_selector = Some(only_test_namespaces(label));
    MutationPolicy::new(name, spec)
}

/// A policy that sets annotations with `onConflict`, in the test's namespaces.
fn annotation_policy(
    name: &str,
    label: &str,
    values: &[(&str, &str)],
    on_conflict: OnConflict,
) -> MutationPolicy {
    MutationPolicy::new(
        name,
        MutationPolicySpec {
            match_: MatchResources {
                namespace_selector: Some(only_test_namespaces(label)),
                ..MatchResources::default()
            },
            exclude: None,
            pod_templates: true,
            target: Default::default(),
            mutations: vec![Mutation {
                annotations: Some(MetadataMutation {
                    values: values
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                    on_conflict,
                }),
                ..Mutation::default()
            }],
            warning: None,
            existing: ExistingResources::default(),
        },
    )
}

async fn create_policy(client: &kube::Client, policy: &MutationPolicy) {
    Api::<MutationPolicy>::all(client.clone())
        .create(&PostParams::default(), policy)
        .await
        .expect("policy created");
}

fn annotations(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> BTreeMap<String, String> {
    meta.annotations.clone().unwrap_or_default()
}

fn template_annotations(d: &Deployment) -> BTreeMap<String, String> {
    d.spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .map(annotations)
        .unwrap_or_default()
}

async fn create_pod(client: &kube::Client, ns: &str, pod: Value) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p: Pod = serde_json::from_value(pod).expect("pod");
    let name = p.metadata.name.clone().expect("name");
    pods.create(&PostParams::default(), &p)
        .await
        .expect("pod created");
    pods.get(&name).await.expect("stored pod")
}

fn deployment(name: &str) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
            },
        },
    })
}

async fn create_deployment(client: &kube::Client, ns: &str, name: &str) -> Deployment {
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let d: Deployment = serde_json::from_value(deployment(name)).expect("deployment");
    api.create(&PostParams::default(), &d)
        .await
        .expect("deployment created")
}

/// Waits until the webhook applies the test's policies: a dry-run pod in `ns` comes back with
/// annotation `key` (the webhook's policy cache follows the API server by a watch, and the
/// webhook fails open).
async fn wait_until_active(client: &kube::Client, ns: &str, key: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    probe_until(
        &pods,
        &format!("the policy to apply in {ns}"),
        Duration::from_secs(30),
        |p| annotations(&p.metadata).contains_key(key),
    )
    .await;
}

/// Waits until the controller has reported on the policy's current generation.
async fn wait_for_report(client: &kube::Client, name: &str) -> MutationPolicy {
    let api: Api<MutationPolicy> = Api::all(client.clone());
    wait_for(
        &format!("the status of policy {name}"),
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                api.get(name).await.ok().is_some_and(|p| {
                    p.status.as_ref().is_some_and(|s| {
                        Some(s.observed_generation) == p.metadata.generation
                            && !s.conditions.is_empty()
                    })
                })
            }
        },
    )
    .await;
    api.get(name).await.expect("policy")
}

fn condition<'a>(
    p: &'a MutationPolicy,
    type_: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .unwrap_or_else(|| panic!("condition {type_} in {:?}", p.status))
}

fn report(p: &MutationPolicy) -> ExistingReport {
    p.status
        .as_ref()
        .and_then(|s| s.existing.clone())
        .unwrap_or_else(|| panic!("status.existing in {:?}", p.status))
}

#[tokio::test]
async fn imported_kyverno_policy_annotates_pods_where_it_matches() {
    let (client, cp) = setup().await;
    let label = test_label("kyverno");
    create_policy(&client, &imported_policy("kyverno-outbound", &label)).await;

    let ns = cp
        .namespace("kyverno-istio", &[ISTIO_INJECTION, (TEST_LABEL, &label)])
        .await
        .unwrap();
    wait_until_active(&client, &ns, KEY).await;
    let stored = create_pod(&client, &ns, pod("app")).await;
    assert_eq!(
        annotations(&stored.metadata).get(KEY).map(String::as_str),
        Some("0.0.0.0/0")
    );

    // The Kyverno rule matches all pods: the istio-injection label plays no part.
    let no_istio = cp
        .namespace("kyverno-noistio", &[(TEST_LABEL, &label)])
        .await
        .unwrap();
    let stored = create_pod(&client, &no_istio, pod("app")).await;
    assert_eq!(
        annotations(&stored.metadata).get(KEY).map(String::as_str),
        Some("0.0.0.0/0")
    );

    // Kyverno's auto-generated pod-controller rules: a new Deployment's pod template too.
    let d = create_deployment(&client, &ns, "web").await;
    assert_eq!(
        template_annotations(&d).get(KEY).map(String::as_str),
        Some("0.0.0.0/0")
    );

    // Outside the policy's match (here: a namespace without the test's label).
    let outside = cp
        .namespace("kyverno-outside", &[ISTIO_INJECTION])
        .await
        .unwrap();
    let stored = create_pod(&client, &outside, pod("app")).await;
    assert!(
        !annotations(&stored.metadata).contains_key(KEY),
        "{:?}",
        stored.metadata.annotations
    );
}

#[tokio::test]
async fn on_conflict_keep_leaves_a_value_the_pod_has() {
    let (client, cp) = setup().await;
    let label = test_label("keep");
    create_policy(
        &client,
        &annotation_policy(
            "keep-outbound",
            &label,
            &[(KEY, "0.0.0.0/0")],
            OnConflict::Keep,
        ),
    )
    .await;
    let ns = cp
        .namespace("keep", &[ISTIO_INJECTION, (TEST_LABEL, &label)])
        .await
        .unwrap();
    wait_until_active(&client, &ns, KEY).await;

    let mut own = pod("own-value");
    own["metadata"]["annotations"] = json!({KEY: "10.0.0.0/8"});
    let stored = create_pod(&client, &ns, own).await;
    assert_eq!(
        annotations(&stored.metadata).get(KEY).map(String::as_str),
        Some("10.0.0.0/8")
    );

    let stored = create_pod(&client, &ns, pod("no-value")).await;
    assert_eq!(
        annotations(&stored.metadata).get(KEY).map(String::as_str),
        Some("0.0.0.0/0")
    );
}

#[tokio::test]
async fn existing_deployment_gets_the_mutation_and_the_policy_reports_it() {
    let (client, cp) = setup().await;
    let label = test_label("existing");
    let ns = cp
        .namespace("existing", &[ISTIO_INJECTION, (TEST_LABEL, &label)])
        .await
        .unwrap();
    let outside = cp
        .namespace("existing-outside", &[ISTIO_INJECTION])
        .await
        .unwrap();
    // Created before the policy exists.
    let before = create_deployment(&client, &ns, "web").await;
    assert!(!template_annotations(&before).contains_key(KEY));
    let untouched = create_deployment(&client, &outside, "web").await;
    let bare = create_pod(&client, &ns, pod("bare")).await;
    assert!(!annotations(&bare.metadata).contains_key(KEY));

    // The imported policy, with existing workloads enabled.
    let mut policy = imported_policy("kyverno-outbound-existing", &label);
    policy.spec.existing.enabled = true;
    create_policy(&client, &policy).await;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    wait_for(
        "the existing Deployment's pod template to be mutated",
        Duration::from_secs(60),
        || {
            let deployments = deployments.clone();
            async move {
                deployments.get("web").await.ok().is_some_and(|d| {
                    template_annotations(&d).get(KEY).map(String::as_str) == Some("0.0.0.0/0")
                })
            }
        },
    )
    .await;
    let after = deployments.get("web").await.unwrap();
    // Only the pod template was written, by the controller's field manager.
    assert_eq!(after.metadata.labels, before.metadata.labels);
    assert_eq!(after.metadata.annotations, before.metadata.annotations);
    assert!(
        after
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .any(|m| m.manager.as_deref() == Some("meshgate")
                && m.operation.as_deref() == Some("Update")),
        "{:?}",
        after.metadata.managed_fields
    );

    let stored = wait_for_report(&client, "kyverno-outbound-existing").await;
    let r = report(&stored);
    assert!(!r.dry_run);
    assert_eq!(
        (r.matched, r.mutated, r.unchanged, r.failed),
        (1, 1, 0, 0),
        "{r:?}"
    );
    assert_eq!(r.changed, [format!("Deployment {ns}/web")]);
    assert_eq!(r.bare_pods, 1, "{r:?}");
    assert!(r.last_applied.is_some());
    assert_eq!(condition(&stored, "Valid").status, "True");
    let ready = condition(&stored, "Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "Applied"),
        "{ready:?}"
    );
    let note = wait_for_event(
        &client,
        Some("kyverno-outbound-existing"),
        "ExistingWorkloadsMutated",
    )
    .await;
    assert!(
        note.contains("1 mutated") && note.contains("1 bare pods"),
        "{note}"
    );

    // Outside the match: untouched.
    let outside_now = Api::<Deployment>::namespaced(client.clone(), &outside)
        .get("web")
        .await
        .unwrap();
    assert_eq!(
        outside_now.metadata.resource_version,
        untouched.metadata.resource_version
    );
    assert!(!template_annotations(&outside_now).contains_key(KEY));
    // The bare pod is reported, neither changed nor deleted.
    let bare_now = Api::<Pod>::namespaced(client.clone(), &ns)
        .get("bare")
        .await
        .unwrap();
    assert_eq!(bare_now.metadata.uid, bare.metadata.uid);
    assert!(bare_now.metadata.deletion_timestamp.is_none());
    assert!(!annotations(&bare_now.metadata).contains_key(KEY));
}

#[tokio::test]
async fn dry_run_reports_and_changes_nothing() {
    let (client, cp) = setup().await;
    let label = test_label("dryrun");
    let ns = cp
        .namespace("dryrun", &[(TEST_LABEL, &label)])
        .await
        .unwrap();
    let before = create_deployment(&client, &ns, "web").await;
    create_pod(&client, &ns, pod("bare")).await;

    let mut policy = annotation_policy(
        "dry-run-outbound",
        &label,
        &[(KEY, "0.0.0.0/0")],
        OnConflict::Overwrite,
    );
    policy.spec.existing = ExistingResources {
        enabled: true,
        dry_run: true,
        rate_per_second: 5,
    };
    create_policy(&client, &policy).await;

    let stored = wait_for_report(&client, "dry-run-outbound").await;
    let r = report(&stored);
    assert!(r.dry_run);
    assert_eq!((r.matched, r.mutated, r.failed), (1, 1, 0), "{r:?}");
    assert_eq!(r.changed, [format!("Deployment {ns}/web")]);
    assert_eq!(r.bare_pods, 1, "{r:?}");
    let ready = condition(&stored, "Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "DryRun"),
        "{ready:?}"
    );
    let note = wait_for_event(&client, Some("dry-run-outbound"), "ExistingWorkloadsDryRun").await;
    assert!(note.contains("1 would be mutated"), "{note}");

    let now = Api::<Deployment>::namespaced(client.clone(), &ns)
        .get("web")
        .await
        .unwrap();
    assert_eq!(
        now.metadata.resource_version, before.metadata.resource_version,
        "nothing written"
    );
    assert!(!template_annotations(&now).contains_key(KEY));
}

#[tokio::test]
async fn invalid_policy_is_marked_invalid_and_applies_to_nothing() {
    let (client, cp) = setup().await;
    let label = test_label("invalid");
    let ns = cp
        .namespace("invalid", &[(TEST_LABEL, &label)])
        .await
        .unwrap();
    let before = create_deployment(&client, &ns, "web").await;
    let mut policy = annotation_policy(
        "invalid-kinds",
        &label,
        &[(KEY, "0.0.0.0/0")],
        OnConflict::Overwrite,
    );
    // Passes the CRD's schema, not meshgate's validation.
    policy.spec.match_.kinds = vec!["Deployment".into(), "a/b/c/Service".into()];
    policy.spec.existing.enabled = true;
    create_policy(&client, &policy).await;

    let stored = wait_for_report(&client, "invalid-kinds").await;
    let valid = condition(&stored, "Valid");
    assert_eq!(valid.status, "False");
    assert!(valid.message.contains("spec.match.kinds[1]"), "{valid:?}");
    assert_eq!(condition(&stored, "Ready").status, "False");
    assert!(
        stored
            .status
            .as_ref()
            .and_then(|s| s.existing.as_ref())
            .is_none(),
        "no pass was made"
    );
    let now = Api::<Deployment>::namespaced(client.clone(), &ns)
        .get("web")
        .await
        .unwrap();
    assert_eq!(
        now.metadata.resource_version,
        before.metadata.resource_version
    );
}

/// The admission warning of a policy that changed the pod reaches the client (as an HTTP
/// `Warning` header; kube's typed API drops it, so the request is sent raw).
#[tokio::test]
async fn policy_warning_is_returned_to_the_client() {
    let (client, cp) = setup().await;
    let label = test_label("warning");
    let mut policy = annotation_policy(
        "warn-outbound",
        &label,
        &[(KEY, "0.0.0.0/0")],
        OnConflict::Overwrite,
    );
    policy.spec.warning = Some("all outbound traffic of the pod bypasses the mesh".into());
    create_policy(&client, &policy).await;
    let ns = cp
        .namespace("warning", &[(TEST_LABEL, &label)])
        .await
        .unwrap();
    wait_until_active(&client, &ns, KEY).await;

    let request = kube::core::Request::new(format!("/api/v1/namespaces/{ns}/pods"))
        .create(
            &PostParams::default(),
            serde_json::to_vec(&pod("warned")).unwrap(),
        )
        .unwrap();
    let response = client
        .send(request.map(kube::client::Body::from))
        .await
        .unwrap();
    assert!(response.status().is_success(), "{:?}", response.status());
    let warnings: Vec<String> = response
        .headers()
        .get_all("warning")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("warn-outbound: all outbound traffic of the pod bypasses the mesh")),
        "{warnings:?}"
    );
    drop(response);
    let stored = Api::<Pod>::namespaced(client.clone(), &ns)
        .get("warned")
        .await
        .unwrap();
    assert_eq!(
        annotations(&stored.metadata).get(KEY).map(String::as_str),
        Some("0.0.0.0/0")
    );
}

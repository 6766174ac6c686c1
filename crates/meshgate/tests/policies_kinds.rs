//! MutationPolicies for any kind, on the real API server: Services, ConfigMaps, a custom
//! resource, Namespaces and a `*` rule. The controller keeps the policies webhook's rules in line
//! with the kinds the policies name (discovery resolves them), so the API server calls meshgate
//! for exactly those; and one policy failing on an object takes no other policy down.
//!
//! Run: `cargo test -p meshgate --test policies_kinds`.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, PostParams};
use kube::discovery::ApiResource;
use meshgate_api::MutationPolicy;
use serde_json::{Value, json};

fn policy(name: &str, spec: Value) -> MutationPolicy {
    serde_json::from_value(json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy",
        "metadata": {"name": name}, "spec": spec,
    }))
    .expect("policy")
}

/// The resources the policies webhook's rules name (`group/version/resource`).
async fn registered(client: &kube::Client) -> Vec<String> {
    let mwc = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get(POLICIES_CONFIGURATION)
        .await
        .expect("configuration");
    mwc.webhooks
        .unwrap_or_default()
        .iter()
        .flat_map(|h| h.rules.iter().flatten())
        .flat_map(|r| {
            let groups = r.api_groups.clone().unwrap_or_default();
            let versions = r.api_versions.clone().unwrap_or_default();
            let resources = r.resources.clone().unwrap_or_default();
            let mut out = Vec::new();
            for g in &groups {
                for v in &versions {
                    for res in &resources {
                        out.push(format!("{g}/{v}/{res}"));
                    }
                }
            }
            out
        })
        .collect()
}

#[tokio::test]
async fn policies_mutate_any_kind_and_fail_on_their_own() {
    let cp = control_plane(false).await;
    serve_policies(&cp).await;
    let client = cp.client().await.expect("client");
    let label = format!("kinds-{}", std::process::id());

    // A custom resource of the test's own.
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                 "versions": [{"name": "v1", "served": true, "storage": true,
                               "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]},
    }))
    .expect("crd");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.create(&PostParams::default(), &crd)
        .await
        .expect("crd");
    wait_for(
        "the CRD to be established",
        Duration::from_secs(30),
        || async {
            crds.get("widgets.example.com").await.ok().is_some_and(|c| {
                c.status.and_then(|s| s.conditions).is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                })
            })
        },
    )
    .await;

    let ns = cp
        .namespace("kinds", &[("e2e.meshgate.dev/kinds", label.as_str())])
        .await
        .expect("namespace");
    let in_test = json!({"matchLabels": {"e2e.meshgate.dev/kinds": label}});
    let policies: Api<MutationPolicy> = Api::all(client.clone());
    for p in [
        policy(
            "kinds-core",
            json!({
                "match": {"kinds": ["Service", "v1/ConfigMap"], "namespaceSelector": in_test},
                "mutations": [{"annotations": {"values": {"meshgate.test/core": "yes"}}}],
            }),
        ),
        policy(
            "kinds-custom",
            json!({
                "match": {"kinds": ["example.com/v1/Widget"], "namespaceSelector": in_test},
                "mutations": [{"strategicMerge": {"spec": {"size": 3}}}],
            }),
        ),
        policy(
            "kinds-namespace",
            json!({
                "match": {"kinds": ["Namespace"], "objectSelector": {"matchLabels": {"e2e.meshgate.dev/ns": label}}},
                "mutations": [{"labels": {"values": {"meshgate.test/seen": "on"}}}],
            }),
        ),
        // Fails on every ConfigMap (no such path): the other policies still apply.
        policy(
            "kinds-failing",
            json!({
                "match": {"kinds": ["ConfigMap"], "namespaceSelector": in_test},
                "mutations": [{"jsonPatch": [{"op": "replace", "path": "/data/missing", "value": "x"}]}],
            }),
        ),
    ] {
        policies
            .create(&PostParams::default(), &p)
            .await
            .expect("policy");
    }
    // The controller registers exactly the named kinds besides Pods and workloads.
    wait_for(
        "the policies webhook's rules to name the policies' kinds",
        Duration::from_secs(30),
        || async {
            let r = registered(&client).await;
            [
                "/v1/services",
                "/v1/configmaps",
                "example.com/v1/widgets",
                "/v1/namespaces",
            ]
            .iter()
            .all(|want| r.iter().any(|x| x == want))
        },
    )
    .await;
    let rules = registered(&client).await;
    assert!(!rules.iter().any(|r| r.ends_with("/secrets")), "{rules:?}");

    // Objects as created are mutated by the API server's call to meshgate. The API server
    // follows a changed webhook configuration asynchronously: dry-run creates until it calls
    // meshgate for Services.
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]},
    }))
    .expect("service");
    let services = Api::<Service>::namespaced(client.clone(), &ns);
    wait_for(
        "the API server to call meshgate for Services",
        Duration::from_secs(30),
        || async {
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            services.create(&dry, &svc).await.is_ok_and(|s| {
                s.metadata
                    .annotations
                    .unwrap_or_default()
                    .contains_key("meshgate.test/core")
            })
        },
    )
    .await;
    let svc = Api::<Service>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &svc)
        .await
        .expect("service");
    assert_eq!(
        svc.metadata
            .annotations
            .unwrap_or_default()
            .get("meshgate.test/core")
            .map(String::as_str),
        Some("yes")
    );
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"a": "b"}}))
            .expect("configmap");
    let cm = Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &cm)
        .await
        .expect("the ConfigMap is admitted although one policy fails on it");
    assert_eq!(
        cm.metadata
            .annotations
            .unwrap_or_default()
            .get("meshgate.test/core")
            .map(String::as_str),
        Some("yes"),
        "the other policy applied"
    );
    assert_eq!(cm.data.unwrap_or_default().get("missing"), None);
    let widgets: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
            "example.com",
            "v1",
            "Widget",
        )),
    );
    let w: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 1, "color": "red"},
    }))
    .expect("widget");
    let w = widgets
        .create(&PostParams::default(), &w)
        .await
        .expect("widget");
    assert_eq!(w.data["spec"], json!({"size": 3, "color": "red"}));
    let other: Namespace = serde_json::from_value(json!({
        "metadata": {"name": format!("{label}-labelled"), "labels": {"e2e.meshgate.dev/ns": label}},
    }))
    .expect("namespace");
    let created = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &other)
        .await
        .expect("namespace");
    assert_eq!(
        created
            .metadata
            .labels
            .unwrap_or_default()
            .get("meshgate.test/seen")
            .map(String::as_str),
        Some("on")
    );

    // A `*` rule: every kind, as the object itself; registered as a wildcard rule.
    policies
        .create(
            &PostParams::default(),
            &policy(
                "kinds-star",
                json!({
                    "match": {"kinds": ["*"], "namespaceSelector": in_test,
                              "objectSelector": {"matchLabels": {"e2e.meshgate.dev/star": "yes"}}},
                    "mutations": [{"annotations": {"values": {"meshgate.test/star": "yes"}}}],
                }),
            ),
        )
        .await
        .expect("policy");
    wait_for("a wildcard rule", Duration::from_secs(30), || async {
        registered(&client).await.iter().any(|r| r == "*/*/*")
    })
    .await;
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": "s", "labels": {"e2e.meshgate.dev/star": "yes"}}, "stringData": {"k": "v"},
    }))
    .expect("secret");
    let secret = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("secret");
    assert_eq!(
        secret
            .metadata
            .annotations
            .unwrap_or_default()
            .get("meshgate.test/star")
            .map(String::as_str),
        Some("yes")
    );

    // Removing the policies takes their kinds out of the registration again.
    for name in [
        "kinds-core",
        "kinds-custom",
        "kinds-namespace",
        "kinds-failing",
        "kinds-star",
    ] {
        policies
            .delete(name, &Default::default())
            .await
            .expect("delete");
    }
    wait_for(
        "the rules to shrink back",
        Duration::from_secs(30),
        || async {
            let r = registered(&client).await;
            !r.iter().any(|x| x.ends_with("/services") || x == "*/*/*")
        },
    )
    .await;
}

/// A NamespacedMutationPolicy acts in its own namespace only, through the API server too: a
/// ConfigMap in its namespace is mutated, one in another namespace is not, and a policy that
/// names another namespace is not applied at all. A tenant bound (RoleBinding) to the role
/// `install` aggregates into `admin` and `edit` may manage them in that namespace only, and may
/// not create cluster-wide MutationPolicies.
#[tokio::test]
async fn namespaced_policies_stay_in_their_namespace() {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    use meshgate_api::NamespacedMutationPolicy;
    let cp = control_plane(false).await;
    serve_policies(&cp).await;
    let client = cp.client().await.expect("client");
    let tenant = cp.namespace("tenant", &[]).await.expect("namespace");
    let other = cp.namespace("other", &[]).await.expect("namespace");
    let namespaced: Api<NamespacedMutationPolicy> = Api::namespaced(client.clone(), &tenant);
    let create = |name: &str, spec: Value| {
        let p: NamespacedMutationPolicy = serde_json::from_value(json!({
            "apiVersion": "meshgate.dev/v1alpha1", "kind": "NamespacedMutationPolicy",
            "metadata": {"name": name}, "spec": spec,
        }))
        .expect("policy");
        let api = namespaced.clone();
        async move {
            api.create(&PostParams::default(), &p)
                .await
                .expect("policy")
        }
    };
    // The policy that reaches out first: the webhook's watch delivers policies in order, so once
    // the tenant's own policy applies (waited for below), the other one has been seen too.
    create(
        "reaching-out",
        json!({"match": {"kinds": ["ConfigMap"], "namespaces": [other]},
        "mutations": [{"annotations": {"values": {"meshgate.test/reach": "yes"}}}]}),
    )
    .await;
    create(
        "own",
        json!({"match": {"kinds": ["ConfigMap"]},
        "mutations": [{"annotations": {"values": {"meshgate.test/tenant": "own"}}}]}),
    )
    .await;
    wait_for(
        "the policies webhook to cover ConfigMaps",
        Duration::from_secs(30),
        || async {
            registered(&client)
                .await
                .iter()
                .any(|r| r == "/v1/configmaps")
        },
    )
    .await;
    let cm = |name: &str| -> ConfigMap {
        serde_json::from_value(json!({"metadata": {"name": name}})).expect("configmap")
    };
    // The webhook's cache may lag the policy's creation: wait until a dry run shows it applies.
    let mut n = 0;
    wait_for(
        "the tenant's policy to apply",
        Duration::from_secs(30),
        || {
            n += 1;
            let (api, probe) = (
                Api::<ConfigMap>::namespaced(client.clone(), &tenant),
                cm(&format!("probe-{n}")),
            );
            async move {
                let dry = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                api.create(&dry, &probe).await.ok().is_some_and(|c| {
                    c.metadata
                        .annotations
                        .unwrap_or_default()
                        .contains_key("meshgate.test/tenant")
                })
            }
        },
    )
    .await;
    let own = Api::<ConfigMap>::namespaced(client.clone(), &tenant)
        .create(&PostParams::default(), &cm("c"))
        .await
        .expect("configmap");
    let annotations = own.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get("meshgate.test/tenant").map(String::as_str),
        Some("own")
    );
    assert!(
        !annotations.contains_key("meshgate.test/reach"),
        "a policy naming another namespace applies nowhere"
    );
    let theirs = Api::<ConfigMap>::namespaced(client.clone(), &other)
        .create(&PostParams::default(), &cm("c"))
        .await
        .expect("configmap");
    assert!(
        theirs.metadata.annotations.unwrap_or_default().is_empty(),
        "no tenant policy reaches another namespace"
    );

    // The tenant's permissions, through the role `install` ships.
    let docs = meshgate::install::render(&meshgate::install::InstallOptions {
        profile: "istio-ambient".into(),
        namespace: "meshgate-system".into(),
        image: "meshgate/meshgate:0.1.0".into(),
        node_taint: meshgate::install::NodeTaint::Webhook,
        pod_gate: meshgate::install::PodGate::Webhook,
        strategy: meshgate::install::Strategy::Pod,
        taint_key: meshgate_api::names::STARTUP_TAINT_KEY.into(),
        node_paths: Default::default(),
        repair: None,
        webhook_ingress_from: Vec::new(),
        context_config_maps: Vec::new(),
        context_api_reads: Vec::new(),
        existing_kinds: Vec::new(),
        policies: Default::default(),
    })
    .expect("install renders");
    let role: Vec<Value> = docs
        .into_iter()
        .filter(|d| d["metadata"]["name"] == "meshgate-namespaced-policies-edit")
        .collect();
    assert_eq!(role.len(), 1);
    assert_eq!(
        role[0]["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"],
        "true"
    );
    meshgate::install::apply(&client, &role, false, |_| {})
        .await
        .expect("role");
    let binding: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "tenant-policies"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "meshgate-namespaced-policies-edit"},
        "subjects": [{"kind": "User", "name": "tenant-owner", "apiGroup": "rbac.authorization.k8s.io"}],
    }))
    .expect("binding");
    Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(client.clone(), &tenant)
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding");
    let may = |resource: &'static str, namespace: Option<String>| {
        let client = client.clone();
        async move {
            let review = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: Some("tenant-owner".into()),
                    resource_attributes: Some(ResourceAttributes {
                        verb: Some("create".into()),
                        group: Some("meshgate.dev".into()),
                        resource: Some(resource.into()),
                        namespace,
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            Api::<SubjectAccessReview>::all(client)
                .create(&Default::default(), &review)
                .await
                .expect("review")
                .status
                .is_some_and(|s| s.allowed)
        }
    };
    wait_for(
        "the tenant's binding to take effect",
        Duration::from_secs(20),
        || may("namespacedmutationpolicies", Some(tenant.clone())),
    )
    .await;
    assert!(!may("namespacedmutationpolicies", Some(other.clone())).await);
    assert!(!may("mutationpolicies", None).await);
}

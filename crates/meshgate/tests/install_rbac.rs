//! meshgate's components under the identities `install` creates, on the real API server: the
//! RBAC of `meshgate install --profile istio-ambient --repair delete` (the install with every
//! feature) is applied, and the controller (all of it: leader election, certificates, node gate,
//! policy status and backfill, native policies, the policies webhook's rules, repair) and the
//! webhook run as their ServiceAccounts (impersonated). Every write path is made to happen and
//! its effect is awaited, so a missing permission fails a test; and every permission the install
//! grants must be one this test exercises (the `EXERCISED` table), so an extra one fails too.
//!
//! Run: `cargo test -p meshgate --test install_rbac`.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingAdmissionPolicy, MutatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use meshgate::install::{InstallOptions, NodeTaint, RepairAction};
use meshgate_api::{MutationPolicy, NodeGate};
use serde_json::{Value, json};

const NS: &str = "meshgate-system";

/// Every permission `install --repair delete` grants, and what in this test exercises it
/// (`component verb group/resource[/subresource]`).
const EXERCISED: &[(&str, &str)] = &[
    // The controller.
    ("controller list /nodes", "node gate: node cache"),
    ("controller watch /nodes", "node gate: node cache"),
    ("controller patch /nodes", "node gate: the taint comes off"),
    (
        "controller patch /nodes/status",
        "node gate: the gate resource is advertised",
    ),
    ("controller list /pods", "node gate and repair: pod caches"),
    ("controller watch /pods", "node gate and repair: pod caches"),
    ("controller patch /pods", "repair: a bare pod is labelled"),
    (
        "controller create /pods/eviction",
        "repair: a ReplicaSet's pod is evicted",
    ),
    ("controller list /limitranges", "native gate: its routes"),
    ("controller watch /limitranges", "native gate: its routes"),
    ("controller list /namespaces", "policies: namespace labels"),
    ("controller watch /namespaces", "policies: namespace labels"),
    (
        "controller get apps/deployments",
        "backfill: a workload read again after a conflict",
    ),
    ("controller list apps/deployments", "backfill"),
    ("controller watch apps/deployments", "backfill"),
    (
        "controller patch apps/deployments",
        "backfill of a Deployment",
    ),
    ("controller get apps/statefulsets", "backfill"),
    ("controller list apps/statefulsets", "backfill"),
    ("controller watch apps/statefulsets", "backfill"),
    (
        "controller patch apps/statefulsets",
        "backfill of a StatefulSet",
    ),
    (
        "controller get apps/daemonsets",
        "backfill; agents' DaemonSets",
    ),
    (
        "controller list apps/daemonsets",
        "backfill; agents' DaemonSets",
    ),
    (
        "controller watch apps/daemonsets",
        "backfill; agents' DaemonSets",
    ),
    (
        "controller patch apps/daemonsets",
        "backfill of a DaemonSet",
    ),
    ("controller get apps/replicasets", "backfill"),
    ("controller list apps/replicasets", "backfill"),
    ("controller watch apps/replicasets", "backfill"),
    (
        "controller patch apps/replicasets",
        "backfill of a ReplicaSet",
    ),
    ("controller get batch/jobs", "backfill"),
    ("controller list batch/jobs", "backfill"),
    ("controller watch batch/jobs", "backfill"),
    ("controller patch batch/jobs", "backfill of a Job"),
    ("controller get batch/cronjobs", "backfill"),
    ("controller list batch/cronjobs", "backfill"),
    ("controller watch batch/cronjobs", "backfill"),
    ("controller patch batch/cronjobs", "backfill of a CronJob"),
    (
        "controller list meshgate.dev/mutationpolicies",
        "policy controller",
    ),
    (
        "controller watch meshgate.dev/mutationpolicies",
        "policy controller",
    ),
    (
        "controller list meshgate.dev/namespacedmutationpolicies",
        "webhook rules",
    ),
    (
        "controller watch meshgate.dev/namespacedmutationpolicies",
        "webhook rules",
    ),
    (
        "controller list resource.k8s.io/resourceslices",
        "node gate: the slices of DRA gates, watched wherever DRA is served",
    ),
    (
        "controller watch resource.k8s.io/resourceslices",
        "node gate: the slices of DRA gates",
    ),
    ("controller list meshgate.dev/nodegates", "node gate"),
    ("controller watch meshgate.dev/nodegates", "node gate"),
    (
        "controller patch meshgate.dev/nodegates",
        "node gate: its finalizer",
    ),
    (
        "controller patch meshgate.dev/nodegates/status",
        "node gate: its status",
    ),
    (
        "controller patch meshgate.dev/mutationpolicies/status",
        "policy status",
    ),
    (
        "controller get apiextensions.k8s.io/customresourcedefinitions",
        "--manage-crds: a CRD read before it is written",
    ),
    (
        "controller patch apiextensions.k8s.io/customresourcedefinitions",
        "--manage-crds: meshgate's CRDs at the controller's schema",
    ),
    (
        "controller create events.k8s.io/events",
        "Events on nodes and policies",
    ),
    (
        "controller get admissionregistration.k8s.io/mutatingwebhookconfigurations",
        "caBundle and policy rules",
    ),
    (
        "controller patch admissionregistration.k8s.io/mutatingwebhookconfigurations",
        "caBundle and the policies webhook's rules",
    ),
    (
        "controller create admissionregistration.k8s.io/mutatingadmissionpolicies",
        "native policies: compiled",
    ),
    (
        "controller patch admissionregistration.k8s.io/mutatingadmissionpolicies",
        "native policies: kept",
    ),
    (
        "controller delete admissionregistration.k8s.io/mutatingadmissionpolicies",
        "native policies: back to the webhook",
    ),
    (
        "controller create admissionregistration.k8s.io/mutatingadmissionpolicybindings",
        "native policies: compiled",
    ),
    (
        "controller patch admissionregistration.k8s.io/mutatingadmissionpolicybindings",
        "native policies: kept",
    ),
    (
        "controller delete admissionregistration.k8s.io/mutatingadmissionpolicybindings",
        "native policies: back to the webhook",
    ),
    (
        "controller get coordination.k8s.io/leases",
        "leader election",
    ),
    (
        "controller create coordination.k8s.io/leases",
        "leader election",
    ),
    (
        "controller patch coordination.k8s.io/leases",
        "leader election",
    ),
    ("controller get /secrets", "certificates"),
    ("controller patch /secrets", "certificates (rotation)"),
    ("controller create /secrets", "certificates: created"),
    // The webhook: reads only.
    ("webhook list /namespaces", "webhook caches"),
    (
        "webhook get /namespaces",
        "a namespace not cached yet, read once (the admission_hardening test creates pods in namespaces made the same instant)",
    ),
    ("webhook watch /namespaces", "webhook caches"),
    ("webhook list /limitranges", "webhook caches"),
    ("webhook watch /limitranges", "webhook caches"),
    (
        "webhook list meshgate.dev/mutationpolicies",
        "webhook caches",
    ),
    (
        "webhook watch meshgate.dev/mutationpolicies",
        "webhook caches",
    ),
    (
        "webhook list meshgate.dev/namespacedmutationpolicies",
        "webhook caches",
    ),
    (
        "webhook watch meshgate.dev/namespacedmutationpolicies",
        "webhook caches",
    ),
    ("webhook list meshgate.dev/nodegates", "webhook caches"),
    ("webhook watch meshgate.dev/nodegates", "webhook caches"),
];

/// The permissions the rendered RBAC grants each component.
fn granted(docs: &[Value]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for d in docs {
        let kind = d["kind"].as_str().unwrap_or_default();
        if kind != "ClusterRole" && kind != "Role" {
            continue;
        }
        let component = d["metadata"]["labels"]["app.kubernetes.io/component"]
            .as_str()
            .unwrap_or_default();
        if component != "controller" && component != "webhook" {
            continue; // the aggregated roles for people
        }
        for rule in d["rules"].as_array().into_iter().flatten() {
            for group in rule["apiGroups"].as_array().into_iter().flatten() {
                for resource in rule["resources"].as_array().into_iter().flatten() {
                    for verb in rule["verbs"].as_array().into_iter().flatten() {
                        out.insert(format!(
                            "{component} {} {}/{}",
                            verb.as_str().unwrap_or_default(),
                            group.as_str().unwrap_or_default(),
                            resource.as_str().unwrap_or_default()
                        ));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn every_granted_permission_is_exercised_and_nothing_more() {
    let docs = meshgate::install::render(&InstallOptions {
        profile: "istio-ambient".into(),
        namespace: NS.into(),
        image: "meshgate/meshgate:test".into(),
        node_taint: NodeTaint::Webhook,
        pod_gate: meshgate::install::PodGate::Native(meshgate_core::registration::PolicyApi::V1),
        strategy: meshgate::install::Strategy::Pod,
        taint_key: meshgate_api::names::STARTUP_TAINT_KEY.into(),
        node_paths: Default::default(),
        repair: Some(RepairAction::Delete),
        webhook_ingress_from: Vec::new(),
        context_config_maps: Vec::new(),
        context_api_reads: Vec::new(),
        existing_kinds: Vec::new(),
        policies: Default::default(),
    })
    .expect("render");
    let granted = granted(&docs);
    let exercised: BTreeSet<String> = EXERCISED.iter().map(|(p, _)| (*p).to_owned()).collect();
    let extra: Vec<&String> = granted.difference(&exercised).collect();
    assert!(
        extra.is_empty(),
        "granted but exercised by no path of this test (remove it, or exercise it): {extra:#?}"
    );
    let missing: Vec<&String> = exercised.difference(&granted).collect();
    assert!(
        missing.is_empty(),
        "exercised but not granted (this table is stale): {missing:#?}"
    );
}

async fn create<K>(api: &Api<K>, value: Value) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let obj: K = serde_json::from_value(value).expect("object");
    api.create(&PostParams::default(), &obj)
        .await
        .expect("created")
}

fn template(app: &str) -> Value {
    json!({"metadata": {"labels": {"app": app}},
           "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}],
                    "restartPolicy": "Always"}})
}

#[tokio::test]
async fn the_components_do_everything_under_their_installed_identities() {
    let cp = control_plane(false).await;
    let admin = cp.client().await.expect("client");
    let docs = meshgate::install::render(&InstallOptions {
        profile: "istio-ambient".into(),
        namespace: NS.into(),
        image: "meshgate/meshgate:test".into(),
        node_taint: NodeTaint::Webhook,
        pod_gate: meshgate::install::PodGate::Native(meshgate_core::registration::PolicyApi::V1),
        strategy: meshgate::install::Strategy::Pod,
        taint_key: meshgate_api::names::STARTUP_TAINT_KEY.into(),
        node_paths: Default::default(),
        repair: Some(RepairAction::Delete),
        webhook_ingress_from: Vec::new(),
        context_config_maps: Vec::new(),
        context_api_reads: Vec::new(),
        existing_kinds: Vec::new(),
        policies: Default::default(),
    })
    .expect("render");
    // Everything but the Deployments (the components run here, as their ServiceAccounts).
    apply_but_deployments(&admin, docs).await;

    // What the components will act on, made by the admin.
    let app_ns = cp.namespace("rbac-apps", &[]).await.expect("namespace");
    let agents_ns = cp.namespace("rbac-agents", &[]).await.expect("namespace");
    let gates: Api<NodeGate> = Api::all(admin.clone());
    create(
        &gates,
        json!({"apiVersion": "meshgate.dev/v1alpha1", "kind": "NodeGate", "metadata": {"name": "rbac-gate"},
               "spec": {"agents": [{"name": "cni", "namespace": agents_ns, "selector": {"matchLabels": {"app": "rbac-cni"}}}],
                        "nodeSelector": {"matchLabels": {"pool": "rbac"}},
                        "taint": {"key": "node.meshgate.dev/rbac-not-ready"},
                        "resource": {"name": "meshgate.dev/rbac-ready", "count": 10}}}),
    )
    .await;
    let nodes: Api<Node> = Api::all(admin.clone());
    create(
        &nodes,
        json!({"metadata": {"name": "rbac-node", "labels": {"pool": "rbac"}},
               "spec": {"taints": [{"key": "node.meshgate.dev/rbac-not-ready", "effect": "NoSchedule"}]}}),
    )
    .await;
    meshgate_testenv::make_node_ready(&admin, "rbac-node")
        .await
        .expect("node ready");
    let agent_pods: Api<Pod> = Api::namespaced(admin.clone(), &agents_ns);
    create(
        &agent_pods,
        json!({"metadata": {"name": "cni-rbac-node", "labels": {"app": "rbac-cni"}},
               "spec": {"nodeName": "rbac-node", "tolerations": [{"operator": "Exists"}],
                        "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}]}}),
    )
    .await;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    agent_pods
        .patch_status(
            "cni-rbac-node",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": now}]}})),
        )
        .await
        .expect("agent ready");
    // Workloads of every kind the backfill writes.
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), &app_ns);
    create(&deployments, json!({"metadata": {"name": "d"}, "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "d"}}, "template": template("d")}})).await;
    let statefulsets: Api<StatefulSet> = Api::namespaced(admin.clone(), &app_ns);
    create(&statefulsets, json!({"metadata": {"name": "s"}, "spec": {"replicas": 0, "serviceName": "s", "selector": {"matchLabels": {"app": "s"}}, "template": template("s")}})).await;
    let daemonsets: Api<DaemonSet> = Api::namespaced(admin.clone(), &app_ns);
    create(&daemonsets, json!({"metadata": {"name": "ds"}, "spec": {"selector": {"matchLabels": {"app": "ds"}}, "template": template("ds")}})).await;
    let replicasets: Api<ReplicaSet> = Api::namespaced(admin.clone(), &app_ns);
    let rs = create(&replicasets, json!({"metadata": {"name": "rs"}, "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "rs"}}, "template": template("rs")}})).await;
    let jobs: Api<Job> = Api::namespaced(admin.clone(), &app_ns);
    let mut job_template = template("j");
    job_template["spec"]["restartPolicy"] = json!("Never");
    create(
        &jobs,
        json!({"metadata": {"name": "j"}, "spec": {"suspend": true, "template": job_template}}),
    )
    .await;
    let cronjobs: Api<CronJob> = Api::namespaced(admin.clone(), &app_ns);
    create(
        &cronjobs,
        json!({"metadata": {"name": "c"}, "spec": {"schedule": "0 3 * * *", "suspend": true,
        "jobTemplate": {"spec": {"template": job_template}}}}),
    )
    .await;
    // Pods whose gate timed out: one a ReplicaSet recreates (deleted), one bare (labelled).
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &app_ns);
    let owner = json!([{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
                        "uid": rs.metadata.uid.clone().expect("uid"), "controller": true}]);
    for (name, owners) in [("owned", owner), ("bare", json!([]))] {
        create(
            &pods,
            json!({"metadata": {"name": name, "ownerReferences": owners},
                   "spec": {"initContainers": [{"name": "meshgate-wait", "image": "meshgate/meshgate:test"}],
                            "containers": [{"name": "app", "image": "registry.invalid/app:1"}]}}),
        )
        .await;
        pods.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Pending", "initContainerStatuses": [
                {"name": "meshgate-wait", "ready": false, "restartCount": 1, "image": "meshgate/meshgate:test",
                 "imageID": "", "state": {"terminated": {"exitCode": 1}}}]}})),
        )
        .await
        .expect("gate timed out");
    }

    // The webhook, as its ServiceAccount: ready means its caches listed.
    let kubeconfig = cp.kubeconfig_path.clone();
    let ca = meshgate_pki::Ca::new("rbac-ca", Duration::from_secs(3600)).expect("ca");
    let serving = ca
        .issue_server(&["127.0.0.1"], Duration::from_secs(3600))
        .expect("cert");
    let dir = tempfile::tempdir().expect("tempdir");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &serving.cert_pem).expect("cert");
    std::fs::write(&key, &serving.key_pem).expect("key");
    let webhook_kubeconfig = kubeconfig.clone();
    let webhook = background()
        .spawn(async move {
            let client =
                client_as_service_account(&webhook_kubeconfig, NS, "meshgate-webhook").await;
            meshgate::run::start_webhook(
                client,
                meshgate::run::WebhookSettings {
                    config: meshgate::install::gate_config_for(
                        "istio-ambient",
                        NS,
                        "x",
                        meshgate::install::Strategy::Pod,
                        meshgate_api::names::STARTUP_TAINT_KEY,
                    )
                    .expect("config"),
                    addr: "127.0.0.1:0".parse().expect("addr"),
                    health_addr: "127.0.0.1:0".parse().expect("addr"),
                    cert,
                    key,
                    cert_poll_interval: Duration::from_secs(5),
                    request_timeout: Duration::from_secs(10),
                    max_in_flight: meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT,
                },
            )
            .await
            .expect("webhook starts")
        })
        .await
        .expect("webhook task");
    let health = webhook.health_addr;
    wait_for(
        "the webhook, as its ServiceAccount, to list its caches",
        Duration::from_secs(60),
        || async {
            http_get(health, "/readyz")
                .await
                .is_some_and(|(code, _)| code == 200)
        },
    )
    .await;

    // The controller, as its ServiceAccount, with every feature.
    let controller = ControllerTask::start(
        &cp,
        NS,
        meshgate::run::ControllerSettings {
            lease: Some(meshgate_controller::leader::LeaseSettings {
                namespace: NS.into(),
                name: "meshgate-controller".into(),
                identity: "rbac-test".into(),
                duration: 15,
                grace: 5,
            }),
            certs: Some(meshgate_controller::certs::CertSettings::new(NS)),
            repair: meshgate_core::repair::RepairSettings {
                enabled: true,
                action: meshgate_core::repair::RepairAction::Delete,
                ..Default::default()
            },
            policy_webhook: Some("meshgate".into()),
            native_policies: true,
            manage_crds: true,
            native_gate: Some((
                meshgate::install::gate_config_for(
                    "istio-ambient",
                    NS,
                    "meshgate/meshgate:test",
                    meshgate::install::Strategy::Pod,
                    meshgate_api::names::STARTUP_TAINT_KEY,
                )
                .expect("config"),
                "meshgate".into(),
            )),
            ..Default::default()
        },
    );

    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(admin.clone());
    wait_for(
        "the controller to write meshgate's CRDs (--manage-crds)",
        Duration::from_secs(60),
        || async {
            let mut written = 0;
            for name in [
                "nodegates.meshgate.dev",
                "mutationpolicies.meshgate.dev",
                "namespacedmutationpolicies.meshgate.dev",
            ] {
                let annotated = crds.get(name).await.ok().is_some_and(|c| {
                    c.metadata
                        .annotations
                        .unwrap_or_default()
                        .get(meshgate_core::object::crd::VERSION_ANNOTATION)
                        .map(String::as_str)
                        == Some(meshgate_controller::crds::VERSION)
                });
                written += usize::from(annotated);
            }
            written == 3
        },
    )
    .await;
    let leases: Api<Lease> = Api::namespaced(admin.clone(), NS);
    wait_for(
        "the controller to lead",
        Duration::from_secs(60),
        || async {
            leases
                .get_opt("meshgate-controller")
                .await
                .ok()
                .flatten()
                .is_some_and(|l| {
                    l.spec.and_then(|s| s.holder_identity).as_deref() == Some("rbac-test")
                })
        },
    )
    .await;
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(admin.clone());

    // The native gate: install routed every namespace to the webhook; the controller, once it
    // has listed the LimitRanges, routes only those with one (none yet), then this one.
    let maps: Api<MutatingAdmissionPolicy> = Api::all(admin.clone());
    // The routes are requirements on the namespace's name label (besides the exclusions of
    // `kube-system` and the like, which every selector carries).
    let routing =
        |selector: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>| {
            selector
                .and_then(|s| s.match_expressions)
                .unwrap_or_default()
                .into_iter()
                .filter(|r| r.key == "kubernetes.io/metadata.name")
                .filter(|r| !r.values.iter().flatten().any(|v| v == "kube-system"))
                .map(|r| format!("{} {:?}", r.operator, r.values.unwrap_or_default()))
                .collect::<Vec<_>>()
        };
    let routes_are = |webhook: Vec<String>, policy: Vec<String>| {
        let (maps, mwcs) = (maps.clone(), mwcs.clone());
        async move {
            let map = maps.get_opt("meshgate-pod-gate").await.ok().flatten();
            let policy_routes = map
                .and_then(|p| p.spec?.match_constraints?.namespace_selector)
                .map(|s| routing(Some(s)));
            let hooks = mwcs.get_opt("meshgate").await.ok().flatten();
            let ambient: Vec<_> = hooks
                .into_iter()
                .flat_map(|m| m.webhooks.unwrap_or_default())
                .filter(|h| h.name.starts_with("istio-ambient"))
                .map(|h| {
                    (
                        routing(h.namespace_selector),
                        h.match_conditions.unwrap_or_default(),
                    )
                })
                .collect();
            policy_routes.as_ref() == Some(&policy)
                && ambient.len() == 2
                && ambient
                    .iter()
                    .all(|(r, conditions)| *r == webhook && conditions.is_empty())
        }
    };
    wait_for(
        "the native gate's routes: none",
        Duration::from_secs(60),
        || routes_are(vec!["DoesNotExist []".into()], vec![]),
    )
    .await;
    let ranges: Api<k8s_openapi::api::core::v1::LimitRange> =
        Api::namespaced(admin.clone(), &app_ns);
    ranges
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "limits"},
                "spec": {"limits": [{"type": "Container", "min": {"memory": "32Mi"}}]}}))
            .expect("limit range"),
        )
        .await
        .expect("limit range created");
    wait_for(
        "the native gate's routes: the namespace with a LimitRange",
        Duration::from_secs(60),
        || {
            routes_are(
                vec![format!("In [{app_ns:?}]")],
                vec![format!("NotIn [{app_ns:?}]")],
            )
        },
    )
    .await;
    wait_for(
        "the certificates and caBundle",
        Duration::from_secs(60),
        || async {
            secrets
                .get_opt("meshgate-ca")
                .await
                .ok()
                .flatten()
                .is_some()
                && secrets
                    .get_opt("meshgate-webhook-tls")
                    .await
                    .ok()
                    .flatten()
                    .is_some()
                && mwcs.get("meshgate").await.ok().is_some_and(|m| {
                    m.webhooks.unwrap_or_default().iter().all(|h| {
                        h.client_config
                            .ca_bundle
                            .as_ref()
                            .is_some_and(|b| !b.0.is_empty())
                    })
                })
        },
    )
    .await;
    wait_for(
        "the node gate to lift its taint, advertise its resource and hold its finalizer",
        Duration::from_secs(60),
        || async {
            let node = nodes.get("rbac-node").await.expect("node");
            let tainted = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| {
                    t.iter()
                        .any(|t| t.key == "node.meshgate.dev/rbac-not-ready")
                });
            let advertised = node
                .status
                .as_ref()
                .and_then(|s| s.capacity.as_ref())
                .is_some_and(|c| c.contains_key("meshgate.dev/rbac-ready"));
            let gate = gates.get("rbac-gate").await.expect("gate");
            !tainted
                && advertised
                && gate
                    .metadata
                    .finalizers
                    .unwrap_or_default()
                    .iter()
                    .any(|f| f == "meshgate.dev/node-gate")
                && gate.status.is_some()
        },
    )
    .await;

    // Policies: backfill of every workload kind, status, native compile, the webhook's rules.
    let policies: Api<MutationPolicy> = Api::all(admin.clone());
    create(
        &policies,
        json!({"apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy", "metadata": {"name": "rbac-labels"},
               "spec": {"match": {"kinds": ["Pod", "Service"], "namespaces": [app_ns]}, "podTemplates": true,
                        "mutations": [{"labels": {"values": {"rbac": "yes"}}}],
                        "existing": {"enabled": true, "ratePerSecond": 100}}}),
    )
    .await;
    let labelled = |t: Option<&k8s_openapi::api::core::v1::PodTemplateSpec>| {
        t.and_then(|t| t.metadata.as_ref())
            .and_then(|m| m.labels.as_ref())
            .and_then(|l| l.get("rbac"))
            .is_some_and(|v| v == "yes")
    };
    wait_for(
        "the backfill of every workload kind",
        Duration::from_secs(60),
        || async {
            labelled(
                deployments
                    .get("d")
                    .await
                    .ok()
                    .and_then(|d| d.spec)
                    .map(|s| s.template)
                    .as_ref(),
            ) && labelled(
                statefulsets
                    .get("s")
                    .await
                    .ok()
                    .and_then(|d| d.spec)
                    .map(|s| s.template)
                    .as_ref(),
            ) && labelled(
                daemonsets
                    .get("ds")
                    .await
                    .ok()
                    .and_then(|d| d.spec)
                    .map(|s| s.template)
                    .as_ref(),
            ) && labelled(
                replicasets
                    .get("rs")
                    .await
                    .ok()
                    .and_then(|d| d.spec)
                    .and_then(|s| s.template)
                    .as_ref(),
            ) && labelled(
                jobs.get("j")
                    .await
                    .ok()
                    .and_then(|d| d.spec)
                    .map(|s| s.template)
                    .as_ref(),
            ) && labelled(
                cronjobs
                    .get("c")
                    .await
                    .ok()
                    .map(|d| d.spec)
                    .and_then(|s| s.job_template.spec)
                    .map(|s| s.template)
                    .as_ref(),
            )
        },
    )
    .await;
    let maps: Api<MutatingAdmissionPolicy> = Api::all(admin.clone());
    wait_for(
        "the policy's status and its compiled admission policy",
        Duration::from_secs(60),
        || async {
            let status_written = policies
                .get("rbac-labels")
                .await
                .ok()
                .and_then(|p| p.status)
                .is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.type_ == "Native" && c.status == "True")
                });
            status_written
                && maps
                    .get_opt("meshgate-policy-rbac-labels")
                    .await
                    .ok()
                    .flatten()
                    .is_some()
        },
    )
    .await;
    wait_for(
        "the policies webhook's rules to name services",
        Duration::from_secs(90),
        || async {
            mwcs.get("meshgate").await.ok().is_some_and(|m| {
                m.webhooks.unwrap_or_default().iter().any(|h| {
                    h.rules
                        .iter()
                        .flatten()
                        .any(|r| r.resources.iter().flatten().any(|res| res == "services"))
                })
            })
        },
    )
    .await;
    policies
        .patch(
            "rbac-labels",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"warning": "back to the webhook"}})),
        )
        .await
        .expect("policy changed");
    wait_for(
        "the compiled admission policy to be deleted",
        Duration::from_secs(60),
        || async {
            maps.get_opt("meshgate-policy-rbac-labels")
                .await
                .ok()
                .flatten()
                .is_none()
        },
    )
    .await;

    // Repair: the ReplicaSet's pod deleted, the bare pod labelled.
    wait_for("repair", Duration::from_secs(60), || async {
        let owned_gone = pods
            .get_opt("owned")
            .await
            .ok()
            .flatten()
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some());
        let bare_labelled = pods.get("bare").await.ok().is_some_and(|p| {
            p.metadata
                .labels
                .unwrap_or_default()
                .get("meshgate.dev/repair")
                .map(String::as_str)
                == Some("needed")
        });
        owned_gone && bare_labelled
    })
    .await;

    // Events, by the controller.
    let events: Api<DynamicObject> = Api::all_with(
        admin.clone(),
        &ApiResource {
            group: "events.k8s.io".into(),
            version: "v1".into(),
            api_version: "events.k8s.io/v1".into(),
            kind: "Event".into(),
            plural: "events".into(),
        },
    );
    wait_for(
        "the controller's Events",
        Duration::from_secs(30),
        || async {
            events
                .list(&ListParams::default())
                .await
                .ok()
                .is_some_and(|l| {
                    l.items
                        .iter()
                        .any(|e| e.data["reportingController"] == "meshgate-controller")
                })
        },
    )
    .await;

    controller.finish().await;
    drop(webhook);
}

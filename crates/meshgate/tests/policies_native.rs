//! Native mode on the real API server: every MutationPolicy of the corpus
//! (`fixtures/policies_native.yaml`) that a MutatingAdmissionPolicy can express is compiled by
//! the controller (running as meshgate's controller ServiceAccount, under the RBAC `install`
//! renders) into one, and the object the API server stores through it, with no webhook
//! registered, equals the object stored through meshgate's webhook and the one `meshgate render`
//! prints offline. The policies that cannot be expressed stay on the webhook and their `Native`
//! condition says why; a policy changed so that it no longer compiles loses its
//! MutatingAdmissionPolicy.
//!
//! Run: `cargo test -p meshgate --test policies_native`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use meshgate_api::MutationPolicy;
use meshgate_core::policy::native::native_name;
use meshgate_core::registration::{PolicyResource, policy_rules};
use serde::Deserialize;
use serde_json::{Value, json};

const CONFIGURATION: &str = "meshgate-native-test";
const CONTROLLER_NAMESPACE: &str = "meshgate-system";

#[derive(Deserialize)]
struct Corpus {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    /// `true`, or a piece of the reason the policy stays on the webhook.
    native: Value,
    spec: Value,
    objects: Vec<Value>,
}

impl Case {
    fn native(&self) -> bool {
        self.native == json!(true)
    }
}

fn corpus() -> Corpus {
    let path = meshgate_testenv::workspace_dir()
        .join("crates/meshgate/tests/fixtures/policies_native.yaml");
    let text = std::fs::read_to_string(path).expect("corpus readable");
    meshgate_api::yaml::from_str(&text).expect("corpus parses")
}

fn resource(kind: &str) -> ApiResource {
    let (group, version, plural) = match kind {
        "Pod" => ("", "v1", "pods"),
        "Service" => ("", "v1", "services"),
        "ConfigMap" => ("", "v1", "configmaps"),
        "Namespace" => ("", "v1", "namespaces"),
        "Deployment" => ("apps", "v1", "deployments"),
        "CronJob" => ("batch", "v1", "cronjobs"),
        other => panic!("no resource for kind {other} in this test"),
    };
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(group, version, kind),
        plural,
    )
}

/// One object of a case as created on one path: in `namespace`, a Namespace renamed with `tag`.
/// Returns the object and whether it must come out unchanged.
fn prepare(object: &Value, namespace: &str, tag: &str) -> (Value, bool) {
    let mut o = object.clone();
    let unchanged = o
        .as_object_mut()
        .and_then(|m| m.remove("unchanged"))
        .is_some_and(|v| v == json!(true));
    if o["kind"] == "Namespace" {
        let name = format!("{}-{tag}", o["metadata"]["name"].as_str().expect("name"));
        o["metadata"]["name"] = json!(name);
    } else {
        o["metadata"]["namespace"] = json!(namespace);
    }
    (o, unchanged)
}

/// What a policy of the corpus can change: the object's labels and annotations and those of
/// its pod template.
fn observed(o: &Value) -> Value {
    let kind = o["kind"].as_str().unwrap_or_default();
    let template = meshgate_core::policy::pod_template_path(kind)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let pointer = format!("/{}/metadata", p.join("/"));
            let meta = o.pointer(&pointer).cloned().unwrap_or(Value::Null);
            json!({"labels": meta.get("labels"), "annotations": meta.get("annotations")})
        });
    // The API server labels every Namespace with its name.
    let mut labels = o["metadata"].get("labels").cloned();
    if let Some(Value::Object(m)) = labels.as_mut() {
        m.remove("kubernetes.io/metadata.name");
    }
    json!({
        "labels": labels,
        "annotations": o["metadata"].get("annotations"),
        "template": template,
    })
}

/// The object's `spec` and `data`, which no metadata write may change (without the addresses
/// the API server allocates to a Service).
fn body(o: &Value) -> Value {
    let mut spec = o.get("spec").cloned().unwrap_or(Value::Null);
    if let Some(m) = spec.as_object_mut() {
        m.remove("clusterIP");
        m.remove("clusterIPs");
    }
    json!({"spec": spec, "data": o.get("data")})
}

async fn create(client: &kube::Client, object: &Value, dry_run: bool) -> Result<Value, String> {
    let ar = resource(object["kind"].as_str().expect("kind"));
    let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let obj: DynamicObject = serde_json::from_value(object.clone()).expect("object");
    let pp = PostParams {
        dry_run,
        ..Default::default()
    };
    api.create(&pp, &obj)
        .await
        .map(|o| serde_json::to_value(o).expect("json"))
        .map_err(|e| e.to_string())
}

/// Dry-run creates `object` (renamed each time) until what the API server returns differs from
/// it: the path under test (webhook registration, or compiled policy) is in effect.
async fn wait_served(client: &kube::Client, object: &Value, what: &str) {
    let mut n = 0;
    wait_for(what, Duration::from_secs(60), || {
        n += 1;
        let mut probe = object.clone();
        let name = format!(
            "{}-probe-{n}",
            probe["metadata"]["name"].as_str().expect("name")
        );
        probe["metadata"]["name"] = json!(name);
        async move {
            create(client, &probe, true)
                .await
                .is_ok_and(|stored| observed(&stored) != observed(&probe))
        }
    })
    .await;
}

/// Creates every object of every case on one path; returns `case -> object name -> stored`.
async fn create_all(
    client: &kube::Client,
    corpus: &Corpus,
    namespace: &str,
    tag: &str,
    only_native: bool,
) -> BTreeMap<String, BTreeMap<String, Value>> {
    let mut out = BTreeMap::new();
    for case in corpus.cases.iter().filter(|c| !only_native || c.native()) {
        let mut stored = BTreeMap::new();
        for object in &case.objects {
            let (o, unchanged) = prepare(object, namespace, tag);
            let s = create(client, &o, false)
                .await
                .unwrap_or_else(|e| panic!("{}: creating {}: {e}", case.name, o["metadata"]));
            if unchanged {
                assert_eq!(
                    observed(&s),
                    observed(&o),
                    "{}: {} must be left alone ({tag} path)",
                    case.name,
                    o["metadata"]["name"]
                );
            } else {
                assert_ne!(
                    observed(&s),
                    observed(&o),
                    "{}: {} must be changed by its policy ({tag} path)",
                    case.name,
                    o["metadata"]["name"]
                );
            }
            let key = object["metadata"]["name"]
                .as_str()
                .expect("name")
                .to_owned();
            stored.insert(key, s);
        }
        out.insert(case.name.clone(), stored);
    }
    out
}

/// The first object of a case that its policy changes.
fn changing_object(case: &Case) -> &Value {
    case.objects
        .iter()
        .find(|o| o.get("unchanged").is_none())
        .expect("every case has an object its policy changes")
}

fn native_condition(p: &MutationPolicy) -> Option<(String, String, String)> {
    let status = p.status.as_ref()?;
    let generation = p.metadata.generation?;
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "Native" && c.observed_generation == Some(generation))
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// `meshgate render` of `objects` with `policies` (any kinds `render --policy` reads), the
/// namespace `ns` labelled as the test's namespaces are; the rendered documents.
fn render_offline(objects: &[Value], policies: &[Value], ns: &str) -> Vec<Value> {
    let dir = tempfile::tempdir().expect("tempdir");
    let to_yaml = |docs: &[Value]| {
        docs.iter()
            .map(|d| meshgate_api::yaml::to_string(d).expect("yaml"))
            .collect::<Vec<_>>()
            .join("---\n")
    };
    let (pfile, ofile) = (dir.path().join("p.yaml"), dir.path().join("o.yaml"));
    std::fs::write(&pfile, to_yaml(policies)).expect("write");
    std::fs::write(&ofile, to_yaml(objects)).expect("write");
    let out = std::process::Command::new(meshgate_bin())
        .arg("render")
        .arg("-f")
        .arg(&ofile)
        .arg("--policy")
        .arg(&pfile)
        .arg("--namespace-label")
        .arg(format!("{ns}=native-tier=mesh"))
        .output()
        .expect("meshgate render runs");
    assert!(
        out.status.success(),
        "render: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    meshgate_api::yaml::documents(&String::from_utf8_lossy(&out.stdout)).expect("output")
}

/// Every object of the corpus (only the native cases' when `only_native`) as rendered equals,
/// in what a policy can change, the object the API server stored.
fn compare_rendered(
    corpus: &Corpus,
    rendered: &[Value],
    ns: &str,
    tag: &str,
    only_native: bool,
    stored: &BTreeMap<String, BTreeMap<String, Value>>,
    what: &str,
) {
    for case in corpus.cases.iter().filter(|c| !only_native || c.native()) {
        for object in &case.objects {
            let name = object["metadata"]["name"].as_str().expect("name");
            let (prepared, _) = prepare(object, ns, tag);
            let offline = rendered
                .iter()
                .find(|d| {
                    d["kind"] == prepared["kind"]
                        && d["metadata"]["name"] == prepared["metadata"]["name"]
                })
                .unwrap_or_else(|| panic!("{name} rendered"));
            assert_eq!(
                observed(offline),
                observed(&stored[&case.name][name]),
                "{}: {name}: {what}",
                case.name
            );
        }
    }
}

#[tokio::test]
async fn compiled_policies_store_what_the_webhook_and_render_give() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    install_crds(&client).await;
    let corpus = corpus();
    let pid = std::process::id();
    let (webhook_ns, native_ns) = (format!("native-{pid}-w"), format!("native-{pid}-n"));
    for ns in [&webhook_ns, &native_ns] {
        create(
            &client,
            &json!({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": ns, "labels": {"native-tier": "mesh"}}}),
            false,
        )
        .await
        .expect("namespace");
    }
    let policies: Api<MutationPolicy> = Api::all(client.clone());
    for case in &corpus.cases {
        let p: MutationPolicy = serde_json::from_value(json!({
            "apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy",
            "metadata": {"name": case.name}, "spec": case.spec,
        }))
        .unwrap_or_else(|e| panic!("{}: policy: {e}", case.name));
        policies
            .create(&PostParams::default(), &p)
            .await
            .expect("policy created");
    }

    // 1. The webhook path: meshgate's webhook registered for every kind of the corpus.
    let config = policies_only_config();
    let webhook = start_webhook(&cp, config.clone()).await;
    let mut mwc = webhook.registration(CONFIGURATION, &config, true, false);
    let extra: Vec<PolicyResource> = ["services", "configmaps", "namespaces"]
        .iter()
        .map(|r| PolicyResource {
            group: String::new(),
            version: "v1".into(),
            resource: (*r).into(),
        })
        .collect();
    mwc["webhooks"][0]["rules"] = policy_rules(&extra);
    register(&client, &mwc).await;
    for case in &corpus.cases {
        let (probe, _) = prepare(changing_object(case), &webhook_ns, "w");
        wait_served(
            &client,
            &probe,
            &format!("the webhook to serve {}", case.name),
        )
        .await;
    }
    let through_webhook = create_all(&client, &corpus, &webhook_ns, "w", false).await;

    // 2. The native path: no webhook registered; the controller, as its ServiceAccount,
    //    compiles the policies.
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .delete(CONFIGURATION, &DeleteParams::default())
        .await
        .expect("webhook registration deleted");
    install_identities(&client, "istio-sidecar", CONTROLLER_NAMESPACE).await;
    let controller = ControllerTask::start(
        &cp,
        CONTROLLER_NAMESPACE,
        meshgate::run::ControllerSettings {
            native_policies: true,
            ..Default::default()
        },
    );
    for case in &corpus.cases {
        wait_for(
            &format!("the Native condition of {}", case.name),
            Duration::from_secs(60),
            || async {
                policies
                    .get(&case.name)
                    .await
                    .ok()
                    .and_then(|p| native_condition(&p))
                    .is_some()
            },
        )
        .await;
        let p = policies.get(&case.name).await.expect("policy");
        let (status, reason, message) = native_condition(&p).expect("condition");
        if case.native() {
            assert_eq!(
                (status.as_str(), reason.as_str()),
                ("True", "MutatingAdmissionPolicy"),
                "{}: {message}",
                case.name
            );
        } else {
            let why = case.native.as_str().expect("a reason");
            assert_eq!(
                (status.as_str(), reason.as_str()),
                ("False", "NotExpressible"),
                "{}: {message}",
                case.name
            );
            assert!(
                message.contains(why),
                "{}: the reason names {why:?}: {message}",
                case.name
            );
        }
    }
    // The policy API this API server serves (v1beta1 on 1.34 and 1.35).
    let api = meshgate::discovery::policy_api(&client)
        .await
        .expect("the policy API is served");
    let version = api.api_version().rsplit('/').next().expect("group/version");
    let admission = |kind: &str, plural: &str| ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: version.into(),
        api_version: api.api_version().into(),
        kind: kind.into(),
        plural: plural.into(),
    };
    let maps: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &admission("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
    );
    let bindings: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &admission(
            "MutatingAdmissionPolicyBinding",
            "mutatingadmissionpolicybindings",
        ),
    );
    for case in &corpus.cases {
        let name = native_name(&case.name);
        let map = maps.get_opt(&name).await.expect("get policy");
        assert_eq!(map.is_some(), case.native(), "{}: {map:?}", case.name);
        if let Some(map) = map {
            let owner = &map.metadata.owner_references.expect("owned")[0];
            assert_eq!(
                (owner.kind.as_str(), owner.name.as_str()),
                ("MutationPolicy", case.name.as_str())
            );
            assert!(
                bindings
                    .get_opt(&name)
                    .await
                    .expect("get binding")
                    .is_some()
            );
        }
    }
    for case in corpus.cases.iter().filter(|c| c.native()) {
        let (probe, _) = prepare(changing_object(case), &native_ns, "n");
        wait_served(
            &client,
            &probe,
            &format!("the API server to apply the compiled {}", case.name),
        )
        .await;
    }
    let through_native = create_all(&client, &corpus, &native_ns, "n", true).await;
    for (case, objects) in &through_native {
        for (name, native) in objects {
            let webhook = &through_webhook[case][name];
            assert_eq!(
                observed(native),
                observed(webhook),
                "{case}: {name}: the compiled policy stores what the webhook stores"
            );
            assert_eq!(body(native), body(webhook), "{case}: {name}");
        }
    }

    // 2b. Offline: the compiled MutatingAdmissionPolicies as the cluster holds them, applied
    //     by `meshgate render` (its CEL evaluator), give what the API server stored.
    let mut map_docs = Vec::new();
    let raw_maps = maps.clone();
    for case in corpus.cases.iter().filter(|c| c.native()) {
        let map = raw_maps
            .get(&native_name(&case.name))
            .await
            .expect("policy");
        let mut doc = serde_json::to_value(&map).expect("json");
        doc["apiVersion"] = json!(api.api_version());
        doc["kind"] = json!("MutatingAdmissionPolicy");
        map_docs.push(doc);
    }
    let native_objects: Vec<Value> = corpus
        .cases
        .iter()
        .filter(|c| c.native())
        .flat_map(|c| c.objects.iter().map(|o| prepare(o, &native_ns, "n").0))
        .collect();
    let rendered = render_offline(&native_objects, &map_docs, &native_ns);
    compare_rendered(
        &corpus,
        &rendered,
        &native_ns,
        "n",
        true,
        &through_native,
        "the compiled admission policy applied offline gives what the API server stored",
    );

    // 3. Offline: `meshgate render` of the same policies and objects prints what the API
    //    server stored through the webhook.
    let mut policy_docs = Vec::new();
    let mut object_docs = Vec::new();
    for case in &corpus.cases {
        policy_docs.push(
            json!({"apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy",
            "metadata": {"name": case.name}, "spec": case.spec}),
        );
        for object in &case.objects {
            object_docs.push(prepare(object, &webhook_ns, "w").0);
        }
    }
    let rendered = render_offline(&object_docs, &policy_docs, &webhook_ns);
    assert_eq!(rendered.len(), object_docs.len());
    compare_rendered(
        &corpus,
        &rendered,
        &webhook_ns,
        "w",
        false,
        &through_webhook,
        "render prints what the API server stores",
    );

    // 4. A policy changed so that it no longer compiles goes back to the webhook: its
    //    MutatingAdmissionPolicy and binding are deleted and its condition says why.
    let changed = "keep-labels";
    policies
        .patch(
            changed,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"warning": "labels changed"}})),
        )
        .await
        .expect("policy changed");
    let name = native_name(changed);
    wait_for(
        "the changed policy to leave native mode",
        Duration::from_secs(60),
        || async {
            let condition = policies
                .get(changed)
                .await
                .ok()
                .and_then(|p| native_condition(&p));
            condition.is_some_and(|(s, r, m)| {
                s == "False" && r == "NotExpressible" && m.contains("warning")
            }) && maps.get_opt(&name).await.ok().flatten().is_none()
                && bindings.get_opt(&name).await.ok().flatten().is_none()
        },
    )
    .await;

    controller.finish().await;
    drop(webhook);
}

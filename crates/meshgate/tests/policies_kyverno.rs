//! Issue #30's causes on the real API server: every case of `tests/fixtures/kyverno_oracle` (the
//! cases the real Kyverno CLI checks `render` against in `kyverno_oracle`; each names the causes
//! it covers, and together they cover all eight) goes through three paths, which must agree:
//!
//! 1. **the webhook**: the case's Kyverno policies are converted by `meshgate import kyverno`
//!    and created as MutationPolicies; meshgate's webhook, running as its installed
//!    ServiceAccount (with `--context-config-map` for the ConfigMaps the cases read), serves
//!    them, and each object is created through the API server;
//! 2. **`meshgate render`** of the Kyverno policies as written, with `--allow-partial` (a policy
//!    that fails on an object is left out, as the webhook leaves it out). Where strict `render`
//!    refuses an object, the object is created for real, and the webhook must have counted the
//!    failure (`meshgate_webhook_policy_failures_total`);
//! 3. **the native path**, where a MutatingAdmissionPolicy can express a policy: the controller
//!    (as its installed ServiceAccount, `--native-policies`) compiles it, the webhook is no longer
//!    registered, and the API server alone applies it; the object must be what `render` gives with
//!    those policies (and what the webhook gave, when every policy of the case compiled).
//!
//! The API server defaults what it stores (a container's `imagePullPolicy`, a Deployment's
//! `strategy`, ...), and the webhook sees and patches the defaulted object. So `render` is given
//! what the API server stores of the object with no policy applied, and its output is compared
//! once it too is defaulted (a dry-run create in a namespace no policy matches); the fields the
//! API server sets on every create (`uid`, `creationTimestamp`, ...) are left out.
//!
//! Each case's objects live in namespaces of its own (`k06-shop`), and its MutationPolicies are
//! limited to them (`match.namespaces`), so that all cases are served at once without one case's
//! policy changing another's objects.
//!
//! Run: `cargo test -p meshgate --test policies_kyverno`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use common::kyverno_cases::{Case, assert_same, object_id, read_cases, render};
use common::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use meshgate_api::MutationPolicy;
use serde_json::{Value, json};

const INSTALL_NS: &str = "meshgate-system";
const CONFIGURATION: &str = "meshgate-kyverno-test";
/// Where rendered objects are defaulted: no policy matches it.
const PLAIN_NS: &str = "kyverno-plain";

fn resource(kind: &str) -> ApiResource {
    let (group, plural) = match kind {
        "Pod" => ("", "pods"),
        "ConfigMap" => ("", "configmaps"),
        "Service" => ("", "services"),
        "Deployment" => ("apps", "deployments"),
        "StatefulSet" => ("apps", "statefulsets"),
        "Job" => ("batch", "jobs"),
        "CronJob" => ("batch", "cronjobs"),
        other => panic!("no resource for kind {other} in this test: add it"),
    };
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, "v1", kind), plural)
}

fn api(client: &kube::Client, object: &Value) -> Api<DynamicObject> {
    let ar = resource(object["kind"].as_str().expect("kind"));
    let ns = object["metadata"]["namespace"].as_str().expect("namespace");
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// Creates `object` (a dry run unless `real`): what the API server stores, or why not.
async fn create(client: &kube::Client, object: &Value, real: bool) -> Result<Value, String> {
    let obj: DynamicObject = serde_json::from_value(object.clone()).expect("object");
    let pp = PostParams {
        dry_run: !real,
        ..Default::default()
    };
    api(client, object)
        .create(&pp, &obj)
        .await
        .map(|o| serde_json::to_value(o).expect("json"))
        .map_err(|e| e.to_string())
}

/// The namespace a case's object lives in here: `k<case number>-<namespace>`.
fn case_namespace(case: &Case, ns: &str) -> String {
    format!("k{}-{ns}", &case.name[..2])
}

/// The object as this test creates it: in its case's namespace.
fn placed(case: &Case, object: &Value) -> Value {
    let mut o = object.clone();
    let ns = o["metadata"]["namespace"].as_str().unwrap_or("default");
    o["metadata"]["namespace"] = json!(case_namespace(case, ns));
    o
}

/// What the API server stored, without what it sets on every create, and with the object's own
/// `uid` (which a Job's generated selector and labels carry) written as `UID`.
fn stored(o: &Value) -> Value {
    let uid = o["metadata"]["uid"].as_str().map(str::to_owned);
    let mut o = o.clone();
    if let Some(meta) = o["metadata"].as_object_mut() {
        for field in [
            "uid",
            "creationTimestamp",
            "resourceVersion",
            "generation",
            "managedFields",
        ] {
            meta.remove(field);
        }
    }
    match uid {
        Some(uid) => {
            let text = serde_json::to_string(&o).expect("json");
            serde_json::from_str(&text.replace(&uid, "UID")).expect("json")
        }
        None => o,
    }
}

/// The case's MutationPolicies, as `meshgate import kyverno` converts its Kyverno policies,
/// limited to the case's namespaces. `only`: the names to keep (all when `None`).
fn imported(case: &Case, dir: &Path, only: Option<&BTreeSet<String>>) -> Vec<Value> {
    let file = dir.join("kyverno.yaml");
    std::fs::write(
        &file,
        meshgate::render::to_yaml_stream(&case.policies).expect("yaml"),
    )
    .expect("write");
    let out = std::process::Command::new(meshgate_bin())
        .args(["import", "kyverno"])
        .arg(&file)
        .output()
        .expect("meshgate import runs");
    assert!(
        out.status.success(),
        "{}: import kyverno: {}",
        case.name,
        String::from_utf8_lossy(&out.stderr)
    );
    let namespaces: BTreeSet<String> = case
        .objects
        .iter()
        .map(|o| placed(case, o)["metadata"]["namespace"].clone())
        .filter_map(|ns| ns.as_str().map(str::to_owned))
        .collect();
    meshgate::render::parse_documents("import", &String::from_utf8_lossy(&out.stdout))
        .expect("import prints YAML")
        .into_iter()
        .filter(|p| only.is_none_or(|o| o.contains(p["metadata"]["name"].as_str().unwrap_or(""))))
        .map(|mut p| {
            assert!(
                p["spec"]["match"].get("namespaces").is_none(),
                "{}: the case's policies match every namespace",
                case.name
            );
            p["spec"]["match"]["namespaces"] = json!(namespaces);
            p
        })
        .collect()
}

/// `render` of one object (with the case's ConfigMaps) under `policies`: strictly, and with the
/// failing policies left out.
struct Rendered {
    strict: Result<Value, String>,
    partial: Value,
}

fn render_object(dir: &Path, policies: &[Value], inputs: &[Value], object: &Value) -> Rendered {
    let policy = dir.join("policies.yaml");
    std::fs::write(
        &policy,
        meshgate::render::to_yaml_stream(policies).expect("yaml"),
    )
    .expect("write");
    let input = dir.join("input.yaml");
    let mut docs = inputs.to_vec();
    docs.push(object.clone());
    std::fs::write(
        &input,
        meshgate::render::to_yaml_stream(&docs).expect("yaml"),
    )
    .expect("write");
    Rendered {
        strict: render(&policy, &input, false),
        partial: render(&policy, &input, true)
            .unwrap_or_else(|e| panic!("render --allow-partial: {e}")),
    }
}

/// What the API server stores of `rendered` when no policy applies: created (dry run) in the
/// plain namespace. A Job's selector and its template's `controller-uid` and `job-name` labels
/// are left out first: the API server generates them again, from the new object's uid.
async fn defaulted(client: &kube::Client, rendered: &Value) -> Value {
    let ns = rendered["metadata"]["namespace"].clone();
    let mut o = rendered.clone();
    o["metadata"]["namespace"] = json!(PLAIN_NS);
    if o["kind"] == "Job" {
        if let Some(spec) = o["spec"].as_object_mut() {
            spec.remove("selector");
        }
        if let Some(labels) = o
            .pointer_mut("/spec/template/metadata/labels")
            .and_then(Value::as_object_mut)
        {
            labels.retain(|k, _| !k.ends_with("controller-uid") && !k.ends_with("job-name"));
        }
    }
    let mut s = create(client, &o, false)
        .await
        .unwrap_or_else(|e| panic!("{}: defaulting: {e}", object_id(rendered)));
    s["metadata"]["namespace"] = ns;
    stored(&s)
}

/// What `render` is given besides the object: the ConfigMaps the case's `configMap` entries
/// read, and the objects its `apiCall` entries GET (in the case's namespaces, as created).
fn given(case: &Case) -> Vec<Value> {
    let mut out = case.config_maps.clone();
    out.extend(case.data.iter().map(|d| placed(case, d)));
    out
}

/// The resources (`RESOURCE[.GROUP]`) the cases' `apiCall` entries GET: what the webhook and
/// the controller are granted (`meshgate install --context-api-read`).
fn api_reads(cases: &[Case]) -> Vec<String> {
    let mut out = BTreeSet::new();
    for case in cases {
        let text = serde_json::to_string(&case.policies).expect("json");
        for part in text.split("\"urlPath\":\"").skip(1) {
            let path = part.split('"').next().unwrap_or_default();
            // The variables stand for names; the resource is literal.
            let literal = path
                .split("{{")
                .enumerate()
                .map(|(i, s)| {
                    if i == 0 {
                        s
                    } else {
                        s.split_once("}}").map_or(s, |(_, r)| r)
                    }
                })
                .collect::<Vec<_>>()
                .join("x");
            let p = meshgate_core::policy::context::api_path(&literal)
                .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            out.insert(if p.group.is_empty() {
                p.resource
            } else {
                format!("{}.{}", p.resource, p.group)
            });
        }
    }
    out.into_iter().collect()
}

/// Dry-run creates `object` until what is stored satisfies `done` (registrations and compiled
/// policies take effect asynchronously); on timeout, says what was last stored.
async fn probe(client: &kube::Client, object: &Value, what: &str, done: impl Fn(&Value) -> bool) {
    let start = std::time::Instant::now();
    loop {
        let last = create(client, object, false).await.map(|s| stored(&s));
        if last.as_ref().is_ok_and(&done) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out after 60 s waiting for {what}; last stored: {last:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn native_condition(p: &MutationPolicy) -> Option<(String, String)> {
    let status = p.status.as_ref()?;
    let generation = p.metadata.generation?;
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "Native" && c.observed_generation == Some(generation))
        .map(|c| (c.status.clone(), c.message.clone()))
}

/// One object of a case: the object with no policy applied, and what `render` makes of it.
struct Expected {
    id: String,
    placed: Value,
    plain: Value,
    rendered: Rendered,
}

/// Each case with an object its policies change, and the first such object (what a probe
/// watches).
fn first_changed<'a>(
    cases: &'a [Case],
    expected: &'a BTreeMap<String, Vec<Expected>>,
) -> impl Iterator<Item = (&'a Case, &'a Expected)> + 'a {
    cases.iter().filter_map(|case| {
        let e = expected[&case.name]
            .iter()
            .find(|e| stored(&e.rendered.partial) != e.plain)?;
        Some((case, e))
    })
}

#[tokio::test]
async fn webhook_render_and_native_agree_on_every_cause() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let cases = read_cases();
    let causes: BTreeSet<u64> = cases.iter().flat_map(|c| c.causes.clone()).collect();
    assert_eq!(
        causes,
        (1..=8).collect::<BTreeSet<u64>>(),
        "every cause of issue #30 has a case"
    );
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    install_crds(&client).await;
    let dir = tempfile::tempdir().expect("tempdir");

    // The namespaces, and the ConfigMaps the cases' context entries read.
    let mut namespaces: BTreeSet<String> = [PLAIN_NS.to_owned()].into();
    let mut config_maps = Vec::new();
    for case in &cases {
        for o in &case.objects {
            namespaces.insert(
                placed(case, o)["metadata"]["namespace"]
                    .as_str()
                    .expect("ns")
                    .into(),
            );
        }
        for cm in &case.config_maps {
            let ns = cm["metadata"]["namespace"].as_str().unwrap_or("default");
            namespaces.insert(ns.to_owned());
            config_maps.push((ns.to_owned(), cm.clone()));
        }
    }
    for ns in &namespaces {
        let n: DynamicObject = serde_json::from_value(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        )
        .expect("namespace");
        let all: Api<DynamicObject> = Api::all_with(
            client.clone(),
            &ApiResource::from_gvk(&GroupVersionKind::gvk("", "v1", "Namespace")),
        );
        if all.get_opt(ns).await.expect("get namespace").is_none() {
            all.create(&PostParams::default(), &n)
                .await
                .expect("namespace created");
        }
    }
    for (ns, cm) in &config_maps {
        let mut cm = cm.clone();
        cm["metadata"]["namespace"] = json!(ns);
        create(&client, &cm, true).await.expect("ConfigMap created");
    }
    for case in &cases {
        for d in &case.data {
            create(&client, &placed(case, d), true)
                .await
                .unwrap_or_else(|e| panic!("{}: {}: {e}", case.name, object_id(d)));
        }
    }
    install_identities_of(
        &client,
        &meshgate::install::InstallOptions {
            context_config_maps: config_maps
                .iter()
                .map(|(ns, cm)| format!("{ns}/{}", cm["metadata"]["name"].as_str().expect("name")))
                .collect(),
            context_api_reads: api_reads(&cases),
            ..install_options("istio-sidecar", INSTALL_NS)
        },
    )
    .await;

    // What the API server stores of each object with no policy: `render`'s input.
    let mut expected: BTreeMap<String, Vec<Expected>> = BTreeMap::new();
    let mut not_creatable = Vec::new();
    for case in &cases {
        let case_dir = dir.path().join(&case.name);
        std::fs::create_dir(&case_dir).expect("dir");
        let mut list = Vec::new();
        for object in &case.objects {
            if object["spec"].get("ephemeralContainers").is_some() {
                // The API server refuses them on create: they are added to a running pod
                // through `pods/ephemeralcontainers`, which the policies webhook does not
                // serve. `kyverno_oracle` covers these objects through `render`.
                not_creatable.push(format!("{} {}", case.name, object_id(object)));
                continue;
            }
            let placed = placed(case, object);
            let plain = stored(
                &create(&client, &placed, false)
                    .await
                    .unwrap_or_else(|e| panic!("{}: {}: {e}", case.name, object_id(object))),
            );
            let rendered = render_object(&case_dir, &case.policies, &given(case), &plain);
            list.push(Expected {
                id: object_id(object),
                placed,
                plain,
                rendered,
            });
        }
        expected.insert(case.name.clone(), list);
    }

    // 1. The webhook, as its ServiceAccount, registered for every kind of the cases.
    let config = policies_only_config();
    let webhook = start_webhook_as(&cp, config.clone(), Some(INSTALL_NS)).await;
    let mut mwc = webhook.registration(CONFIGURATION, &config, true, false);
    mwc["webhooks"][0]["rules"] =
        meshgate_core::registration::policy_rules(&[meshgate_core::registration::PolicyResource {
            group: String::new(),
            version: "v1".into(),
            resource: "configmaps".into(),
        }]);
    register(&client, &mwc).await;
    let policies: Api<MutationPolicy> = Api::all(client.clone());
    let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for case in &cases {
        for p in imported(case, &dir.path().join(&case.name), None) {
            let p: MutationPolicy = serde_json::from_value(p).expect("MutationPolicy");
            let name = p.metadata.name.clone().expect("name");
            assert!(
                names.values().all(|n| !n.contains(&name)),
                "{}: policy {name} is another case's too",
                case.name
            );
            policies
                .create(&PostParams::default(), &p)
                .await
                .unwrap_or_else(|e| panic!("{}: {name}: {e}", case.name));
            names.entry(case.name.clone()).or_default().insert(name);
        }
    }
    // The webhook serves every case: each case's first object that its policies change comes
    // out changed.
    for (case, e) in first_changed(&cases, &expected) {
        probe(
            &client,
            &e.placed,
            &format!("the webhook to serve {}", case.name),
            |s| *s != e.plain,
        )
        .await;
    }
    let mut through_webhook: BTreeMap<(String, String), Value> = BTreeMap::new();
    let mut refused = 0;
    for case in &cases {
        for e in &expected[&case.name] {
            let s = if e.rendered.strict.is_ok() {
                create(&client, &e.placed, false).await
            } else {
                // A policy fails on this object: the webhook admits it without that policy,
                // and counts the failure (of real requests only).
                refused += 1;
                let case_policies: Vec<&str> =
                    names[&case.name].iter().map(String::as_str).collect();
                let before = webhook.policy_failures(&case_policies).await;
                let s = create(&client, &e.placed, true).await;
                let after = webhook.policy_failures(&case_policies).await;
                assert!(
                    after > before,
                    "{} {}: render refuses ({}), so the webhook must count a policy failure",
                    case.name,
                    e.id,
                    e.rendered.strict.as_ref().err().map_or("", String::as_str)
                );
                api(&client, &e.placed)
                    .delete(
                        e.placed["metadata"]["name"].as_str().expect("name"),
                        &DeleteParams::default(),
                    )
                    .await
                    .expect("deleted");
                s
            };
            let s = stored(&s.unwrap_or_else(|err| panic!("{} {}: {err}", case.name, e.id)));
            let rendered = defaulted(&client, &e.rendered.partial).await;
            assert_same(
                ("webhook", &s),
                ("render", &rendered),
                &format!(
                    "{} {}: what the API server stores through the webhook is what render gives",
                    case.name, e.id
                ),
            );
            through_webhook.insert((case.name.clone(), e.id.clone()), s);
        }
    }
    assert!(refused > 0, "some case makes a policy fail on an object");

    // 3. The native path: the webhook unregistered; the controller compiles what it can.
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .delete(CONFIGURATION, &DeleteParams::default())
        .await
        .expect("registration deleted");
    for (case, e) in first_changed(&cases, &expected) {
        probe(
            &client,
            &e.placed,
            &format!(
                "the API server to stop calling the webhook for {}",
                case.name
            ),
            |s| *s == e.plain,
        )
        .await;
    }
    let controller = ControllerTask::start(
        &cp,
        INSTALL_NS,
        meshgate::run::ControllerSettings {
            native_policies: true,
            ..Default::default()
        },
    );
    let mut native: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (case, list) in &names {
        for name in list {
            wait_for(
                &format!("the Native condition of {name}"),
                Duration::from_secs(60),
                || async {
                    policies
                        .get(name)
                        .await
                        .ok()
                        .and_then(|p| native_condition(&p))
                        .is_some()
                },
            )
            .await;
            let p = policies.get(name).await.expect("policy");
            let (status, _) = native_condition(&p).expect("condition");
            if status == "True" {
                native.entry(case.clone()).or_default().insert(name.clone());
            }
        }
    }
    assert!(
        !native.is_empty(),
        "some case's policies compile to a MutatingAdmissionPolicy"
    );
    let mut compared = 0;
    for case in cases.iter().filter(|c| native.contains_key(&c.name)) {
        let subset = &native[&case.name];
        let whole = subset == &names[&case.name];
        let case_dir = dir.path().join(&case.name).join("native");
        std::fs::create_dir(&case_dir).expect("dir");
        let policies = imported(case, &dir.path().join(&case.name), Some(subset));
        let mut served = false;
        for e in &expected[&case.name] {
            let rendered = render_object(&case_dir, &policies, &given(case), &e.plain);
            if !served && stored(&rendered.partial) != e.plain {
                let plain = e.plain.clone();
                probe(
                    &client,
                    &e.placed,
                    &format!("the API server to apply {}'s compiled policies", case.name),
                    |s| *s != plain,
                )
                .await;
                served = true;
            }
            let s = stored(
                &create(&client, &e.placed, false)
                    .await
                    .unwrap_or_else(|err| panic!("{} {}: {err}", case.name, e.id)),
            );
            assert_same(
                ("native", &s),
                ("render", &defaulted(&client, &rendered.partial).await),
                &format!(
                    "{} {}: the compiled policies store what render gives with them",
                    case.name, e.id
                ),
            );
            if whole {
                assert_same(
                    ("native", &s),
                    (
                        "webhook",
                        &through_webhook[&(case.name.clone(), e.id.clone())],
                    ),
                    &format!(
                        "{} {}: the compiled policies store what the webhook stored",
                        case.name, e.id
                    ),
                );
            }
            compared += 1;
        }
    }
    eprintln!(
        "policies_kyverno: {} cases, {} objects through the webhook ({refused} with a failing policy), {compared} through the native path ({} cases); not created (ephemeral containers): {}",
        cases.len(),
        through_webhook.len(),
        native.len(),
        not_creatable.join(", ")
    );
    controller.finish().await;
    drop(webhook);
}

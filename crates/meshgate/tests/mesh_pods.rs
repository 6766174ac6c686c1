//! The init gate on the pods the meshes' injectors produce, through the real API server and
//! meshgate's real webhook (server-side dry-run creates): every shape in
//! `tests/fixtures/mesh_pods.yaml` gets the verdict the design table gives it (the
//! `meshgate.dev/gate` annotation, the gate container or its absence, the gate's user and
//! resources), keeps its QoS class, and is admitted. Shapes marked `injectWith` are created
//! un-injected and a test webhook injects them the way the mesh's injector does, registered
//! once before and once after meshgate's: the verdict is the same either way. `meshgate render
//! --profile` gives the same verdict as the webhook for every shape. Then, on the same API
//! server, with the native gate installed (the MutatingAdmissionPolicy of the ambient clauses,
//! the webhook routed): every shape is admitted exactly as through the webhook alone.
//!
//! Run: `cargo test -p meshgate --test mesh_pods`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Json;
use axum::routing::post;
use common::*;
use k8s_openapi::api::core::v1::{LimitRange, Namespace, Pod};
use kube::api::{Api, PostParams};
use meshgate_api::{GateConfig, MutationPolicy, Profile};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::OnceCell;

const FIXTURES: &str = include_str!("fixtures/mesh_pods.yaml");
const VERDICT: &str = "meshgate.dev/gate";

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Case {
    name: String,
    #[serde(default)]
    about: String,
    #[serde(default)]
    namespace: NamespaceSpec,
    #[serde(default)]
    inject_with: Option<String>,
    expect: Value,
    pod: Value,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NamespaceSpec {
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    #[serde(default)]
    limit_range: Option<Value>,
}

fn cases() -> Vec<Case> {
    let cases: Vec<Case> = serde_saphyr::from_multiple(FIXTURES).expect("the cases");
    let mut names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), cases.len(), "case names are unique");
    cases
}

/// The webhook's configuration in this test: every mesh profile at once.
fn config() -> GateConfig {
    GateConfig {
        profiles: vec![
            Profile::IstioAmbient,
            Profile::IstioSidecar,
            Profile::Linkerd,
        ],
        ..GateConfig::default()
    }
}

const POLICIES: [&str; 2] = [
    include_str!("../../../deploy/policies/kubeflow.yaml"),
    include_str!("../../../deploy/policies/exclude-all-outbound.yaml"),
];

fn policy_files() -> Vec<std::path::PathBuf> {
    let dir = meshgate_testenv::workspace_dir().join("deploy/policies");
    vec![
        dir.join("kubeflow.yaml"),
        dir.join("exclude-all-outbound.yaml"),
    ]
}

// ---------------------------------------------------------------------------------------------
// A mesh injector, as the tests need it: the shapes the meshes' injectors write (see
// docs/design.md, "What the meshes do"), for a plain pod labelled `mesh-test/inject: MODE`.

fn container(name: &str, extra: Value) -> Value {
    let mut c = json!({"name": name, "image": "registry.invalid/mesh-proxy:1"});
    if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
        c.extend(extra.clone());
    }
    c
}

fn istio_validation() -> Value {
    container(
        "istio-validation",
        json!({"args": ["istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT",
                        "-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020",
                        "--run-validation", "--skip-rule-apply"],
               "securityContext": {"runAsUser": 1337, "runAsGroup": 1337, "runAsNonRoot": true,
                                   "allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                   "capabilities": {"drop": ["ALL"]}}}),
    )
}

fn istio_proxy(kind: &str, native: bool) -> Value {
    let mut c = container(
        "istio-proxy",
        json!({"args": ["proxy", kind, "--domain", "$(POD_NAMESPACE).svc.cluster.local"],
               "securityContext": {"runAsUser": 1337, "runAsGroup": 1337, "runAsNonRoot": true,
                                   "allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                   "capabilities": {"drop": ["ALL"]}}}),
    );
    if native {
        c["restartPolicy"] = json!("Always");
    }
    c
}

fn linkerd_proxy() -> Value {
    container(
        "linkerd-proxy",
        json!({"restartPolicy": "Always",
               "securityContext": {"runAsUser": 2102, "runAsNonRoot": true,
                                   "allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true}}),
    )
}

/// The pod after the test injector's `mode`, or `None` when it is already injected.
fn injected(mode: &str, pod: &Value) -> Option<Value> {
    let mut p = pod.clone();
    let names = |list: &Value| -> Vec<String> {
        list.as_array()
            .map(|l| {
                l.iter()
                    .filter_map(|c| c["name"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let all: Vec<String> = [
        names(&p["spec"]["initContainers"]),
        names(&p["spec"]["containers"]),
    ]
    .concat();
    if all
        .iter()
        .any(|n| n == "istio-proxy" || n == "linkerd-proxy")
    {
        return None;
    }
    let mut inits: Vec<Value> = p["spec"]["initContainers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut apps: Vec<Value> = p["spec"]["containers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let annotations = &mut p["metadata"]["annotations"];
    if !annotations.is_object() {
        *annotations = json!({});
    }
    let mut status = |init: &[&str], cont: &[&str]| {
        annotations["sidecar.istio.io/status"] = json!(
            json!({"initContainers": init, "containers": cont, "revision": "default"}).to_string()
        );
    };
    match mode {
        "istio-classic" => {
            status(&["istio-validation"], &["istio-proxy"]);
            inits.insert(0, istio_validation());
            apps.push(istio_proxy("sidecar", false));
        }
        "istio-native" => {
            status(&["istio-validation", "istio-proxy"], &[]);
            inits.insert(0, istio_proxy("sidecar", true));
            inits.insert(0, istio_validation());
        }
        "istio-init" => {
            status(&["istio-init"], &["istio-proxy"]);
            inits.push(container(
                "istio-init",
                json!({"args": ["istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337"],
                       "securityContext": {"runAsUser": 0, "runAsNonRoot": false,
                                           "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]}}}),
            ));
            apps.push(istio_proxy("sidecar", false));
        }
        "istio-gateway" => {
            status(&[], &["istio-proxy"]);
            apps.push(istio_proxy("router", false));
        }
        "linkerd-cni" | "linkerd-init" => {
            annotations["linkerd.io/created-by"] = json!("linkerd/proxy-injector test");
            p["metadata"]["labels"]["linkerd.io/control-plane-ns"] = json!("linkerd");
            inits.insert(0, linkerd_proxy());
            let first = if mode == "linkerd-cni" {
                container(
                    "linkerd-network-validator",
                    json!({"args": ["--log-format", "plain", "--log-level", "debug",
                                    "--connect-addr", "1.1.1.1:20001", "--listen-addr", "0.0.0.0:4140",
                                    "--timeout", "10s"],
                           "securityContext": {"runAsUser": 65534, "runAsNonRoot": true}}),
                )
            } else {
                container(
                    "linkerd-init",
                    json!({"args": ["--incoming-proxy-port", "4143", "--outgoing-proxy-port", "4140",
                                    "--proxy-uid", "2102", "--inbound-ports-to-ignore", "4190,4191,4567,4568",
                                    "--outbound-ports-to-ignore", "4567,4568"],
                           "securityContext": {"runAsUser": 65534, "runAsNonRoot": true,
                                               "capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}}}),
                )
            };
            inits.insert(0, first);
        }
        other => panic!("unknown injectWith {other:?}"),
    }
    p["spec"]["initContainers"] = Value::Array(inits);
    p["spec"]["containers"] = Value::Array(apps);
    Some(p)
}

async fn start_injector(client: &kube::Client) {
    let app = axum::Router::new().route(
        "/inject",
        post(|Json(review): Json<Value>| async move {
            let pod = &review["request"]["object"];
            let mode = pod["metadata"]["labels"]["mesh-test/inject"]
                .as_str()
                .unwrap_or("");
            let ops = match injected(mode, pod) {
                Some(after) => {
                    serde_json::to_value(meshgate_core::patch::JsonPatch::diff(pod, &after))
                        .unwrap_or(json!([]))
                }
                None => json!([]),
            };
            Json(review_patch(&review, &ops))
        }),
    );
    let (url, ca_pem, server) = serve_test_webhook(app).await;
    std::mem::forget(server);
    // One registration sorting before meshgate's ("meshgate"), one after: the API server calls
    // mutating webhooks in the order of their configurations' names.
    for (name, order) in [
        ("aaa-mesh-injector", "before"),
        ("zzz-mesh-injector", "after"),
    ] {
        register(
            client,
            &json!({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": name},
                "webhooks": [{
                    "name": format!("{order}.injector.mesh.test"),
                    "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                    // Like the meshes' injectors: never reinvoked.
                    "reinvocationPolicy": "Never",
                    "clientConfig": {"url": format!("{url}/inject"),
                                     "caBundle": k8s_openapi::ByteString(ca_pem.clone().into_bytes())},
                    "objectSelector": {"matchLabels": {"mesh-test/order": order}},
                    "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
                }],
            }),
        )
        .await;
    }
}

// ---------------------------------------------------------------------------------------------

struct Env {
    client: kube::Client,
    webhook: Webhook,
}

async fn setup() -> &'static Env {
    static ENV: OnceCell<Env> = OnceCell::const_new();
    ENV.get_or_init(|| async {
        let cp = control_plane(false).await;
        let client = cp.client().await.expect("client");
        install_crds(&client).await;
        let config = config();
        let webhook = start_webhook(&cp, config.clone()).await;
        register(
            &client,
            &webhook.registration("meshgate", &config, true, false),
        )
        .await;
        let policies: Api<MutationPolicy> = Api::all(client.clone());
        for text in POLICIES {
            let p: MutationPolicy = serde_saphyr::from_str(text).expect("policy");
            policies
                .create(&PostParams::default(), &p)
                .await
                .expect("policy created");
        }
        start_injector(&client).await;
        // Registrations and the webhook's policy cache take effect asynchronously: wait until a
        // pod gets the gate, the last resort policy and the injector.
        let ns = create_namespace(
            &client,
            "mp-warmup",
            &NamespaceSpec {
                labels: [("istio-injection".into(), "enabled".into())].into(),
                ..NamespaceSpec::default()
            },
        )
        .await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let mut n = 0;
        wait_for(
            "webhooks and policies active",
            Duration::from_secs(60),
            || {
                n += 1;
                let pods = pods.clone();
                async move {
                    let mut p = pod(&format!("probe-{n}"));
                    p["metadata"]["labels"] = json!({"mesh-test/inject": "istio-native",
                    "mesh-test/order": "after", "meshgate.dev/exclude-all-outbound": "true"});
                    let Ok(p) = serde_json::from_value::<Pod>(p) else {
                        return false;
                    };
                    let dry = PostParams {
                        dry_run: true,
                        ..Default::default()
                    };
                    pods.create(&dry, &p).await.ok().is_some_and(|p| {
                        let a = p.metadata.annotations.unwrap_or_default();
                        a.get(VERDICT)
                            .is_some_and(|v| v.starts_with("none: nothing-redirected"))
                    })
                }
            },
        )
        .await;
        Env { client, webhook }
    })
    .await
}

async fn create_namespace(client: &kube::Client, name: &str, spec: &NamespaceSpec) -> String {
    let ns: Namespace = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": spec.labels, "annotations": spec.annotations},
    }))
    .expect("namespace");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("namespace {name}: {e}"));
    if let Some(limits) = &spec.limit_range {
        let lr: LimitRange = serde_json::from_value(json!({
            "metadata": {"name": "limits", "namespace": name}, "spec": {"limits": limits},
        }))
        .expect("limit range");
        Api::<LimitRange>::namespaced(client.clone(), name)
            .create(&PostParams::default(), &lr)
            .await
            .unwrap_or_else(|e| panic!("limit range in {name}: {e}"));
    }
    name.to_owned()
}

/// A server-side dry-run create: what the API server would store.
async fn dry_run(client: &kube::Client, ns: &str, pod: &Value) -> Result<Pod, kube::Error> {
    let mut pod = pod.clone();
    pod["metadata"]["namespace"] = json!(ns);
    let p: Pod = serde_json::from_value(pod).expect("pod");
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&dry, &p)
        .await
}

fn label(pod: &Value, key: &str, value: &str) -> Value {
    let mut p = pod.clone();
    if !p["metadata"]["labels"].is_object() {
        p["metadata"]["labels"] = json!({});
    }
    p["metadata"]["labels"][key] = json!(value);
    p
}

/// The pods of a case: the pod as given, or, for a case injected by the test injector, the
/// plain pod labelled for the injector registered before meshgate's and after it.
fn case_pods(case: &Case) -> Vec<(&'static str, Value)> {
    match &case.inject_with {
        None => vec![("", case.pod.clone())],
        Some(mode) => ["before", "after"]
            .into_iter()
            .map(|order| {
                let pod = label(
                    &label(&case.pod, "mesh-test/inject", mode),
                    "mesh-test/order",
                    order,
                );
                (order, pod)
            })
            .collect(),
    }
}

/// Checks one admitted pod against the case; returns the verdict annotation.
fn check(
    case: &Case,
    admitted: &Pod,
    reference_qos: Option<&str>,
) -> Result<Option<String>, String> {
    let v = serde_json::to_value(admitted).map_err(|e| e.to_string())?;
    let verdict = v["metadata"]["annotations"][VERDICT]
        .as_str()
        .map(str::to_owned);
    let inits: Vec<&Value> = v["spec"]["initContainers"]
        .as_array()
        .map(|l| l.iter().collect())
        .unwrap_or_default();
    let gates: Vec<usize> = inits
        .iter()
        .enumerate()
        .filter(|(_, c)| c["name"] == "meshgate-wait")
        .map(|(i, _)| i)
        .collect();
    let want = case.expect["verdict"].as_str().unwrap_or_default();
    let fail = |m: String| {
        Err(format!(
            "{m}\n  verdict: {verdict:?}\n  init containers: {:?}",
            inits.iter().map(|c| &c["name"]).collect::<Vec<_>>()
        ))
    };
    if want == "not-selected" {
        if verdict.is_some() || !gates.is_empty() {
            return fail("expected the pod not to be selected".into());
        }
        return Ok(verdict);
    }
    let Some(got) = verdict.as_deref() else {
        return fail(format!("expected verdict {want:?}, got none"));
    };
    if want.starts_with("none: ") {
        if !got.starts_with(want) {
            return fail(format!("expected verdict {want:?}"));
        }
        if !gates.is_empty() {
            return fail("no gate expected".into());
        }
    } else {
        if got != want {
            return fail(format!("expected verdict {want:?}"));
        }
        if gates != [0] {
            return fail("expected exactly one gate, first".into());
        }
        let gate = inits[0];
        let mut args: Vec<&str> = want.trim_start_matches("gated: ").split(' ').collect();
        args.extend(["--timeout", "120s"]);
        if gate["args"] != json!(args) {
            return fail(format!("gate args {} != {args:?}", gate["args"]));
        }
        let sc = &gate["securityContext"];
        if let Some(u) = case.expect.get("gateUser")
            && &sc["runAsUser"] != u
        {
            return fail(format!("gate user {} != {u}", sc["runAsUser"]));
        }
        match case.expect.get("gateGroup") {
            Some(Value::Null) if sc.get("runAsGroup").is_some() => {
                return fail(format!("gate group {} should be absent", sc["runAsGroup"]));
            }
            Some(g) if !g.is_null() && &sc["runAsGroup"] != g => {
                return fail(format!("gate group {} != {g}", sc["runAsGroup"]));
            }
            _ => {}
        }
        if let Some(r) = case.expect.get("gateResources") {
            let have = gate.get("resources").cloned().unwrap_or(json!({}));
            if &have != r {
                return fail(format!("gate resources {have} != {r}"));
            }
        }
    }
    if let Some(q) = reference_qos {
        let got = v["status"]["qosClass"].as_str();
        if got != Some(q) {
            return fail(format!("QoS class {got:?}, without meshgate {q:?}"));
        }
    }
    Ok(verdict)
}

#[tokio::test]
async fn every_mesh_pod_shape_gets_its_verdict_and_is_admitted() {
    let env = setup().await;
    let client = &env.client;
    let cases = cases();
    assert!(cases.len() >= 30, "{} shapes", cases.len());
    let mut failures = Vec::new();
    let mut verdicts = BTreeMap::new();
    let mut admitted_pods = BTreeMap::new();
    for case in &cases {
        let ns = create_namespace(client, &format!("mp-{}", case.name), &case.namespace).await;
        // The same pod, opted out of meshgate, in the same namespace: its QoS class as the API
        // server computes it without the gate.
        for (order, pod) in case_pods(case) {
            let reference =
                dry_run(client, &ns, &label(&pod, "meshgate.dev/inject", "false")).await;
            let reference_qos = reference
                .ok()
                .and_then(|p| p.status.and_then(|s| s.qos_class));
            let what = format!(
                "{} ({}){}",
                case.name,
                case.about,
                if order.is_empty() {
                    String::new()
                } else {
                    format!(" [injector {order} meshgate]")
                }
            );
            match dry_run(client, &ns, &pod).await {
                Err(e) => failures.push(format!("{what}: refused by the API server: {e}")),
                Ok(admitted) => match check(case, &admitted, reference_qos.as_deref()) {
                    Err(e) => failures.push(format!("{what}: {e}")),
                    Ok(v) => {
                        admitted_pods.insert(
                            format!("{}{order}", case.name),
                            serde_json::to_value(&admitted).unwrap_or_default(),
                        );
                        // For the render comparison: the pod as admitted (injected), or as given.
                        let input = if case.inject_with.is_some() {
                            let mut a = serde_json::to_value(&admitted).unwrap_or_default();
                            if let Some(m) = a["metadata"].as_object_mut() {
                                m.retain(|k, _| {
                                    ["name", "namespace", "labels", "annotations"]
                                        .contains(&k.as_str())
                                });
                            }
                            if let Some(m) = a.as_object_mut() {
                                m.remove("status");
                            }
                            a
                        } else {
                            let mut p = pod.clone();
                            p["metadata"]["namespace"] = json!(ns);
                            p
                        };
                        verdicts.insert(format!("{}{order}", case.name), (v, input));
                    }
                },
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} shapes failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );

    // `meshgate render` with the same configuration gives the same verdict for every shape.
    let mut docs = Vec::new();
    for case in &cases {
        let mut ns = json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": format!("mp-{}", case.name), "labels": case.namespace.labels, "annotations": case.namespace.annotations}});
        ns["metadata"]["labels"]["kubernetes.io/metadata.name"] =
            json!(format!("mp-{}", case.name));
        docs.push(ns);
        if let Some(limits) = &case.namespace.limit_range {
            docs.push(json!({"apiVersion": "v1", "kind": "LimitRange",
                "metadata": {"name": "limits", "namespace": format!("mp-{}", case.name)}, "spec": {"limits": limits}}));
        }
    }
    let keys: Vec<String> = verdicts.keys().cloned().collect();
    for k in &keys {
        docs.push(verdicts[k].1.clone());
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("shapes.yaml");
    std::fs::write(
        &file,
        meshgate::render::to_yaml_stream(&docs).expect("yaml"),
    )
    .expect("write");
    let (out, _notes) = meshgate::render::render(
        std::slice::from_ref(&file),
        &policy_files(),
        &BTreeMap::new(),
        Some(&config()),
        Default::default(),
        false,
    )
    .expect("render");
    let rendered: Vec<Value> = meshgate::render::parse_documents("render output", &out)
        .expect("render output parses")
        .into_iter()
        .filter(|d| d["kind"] == "Pod")
        .collect();
    assert_eq!(rendered.len(), keys.len());
    let mut differ = Vec::new();
    for (k, r) in keys.iter().zip(&rendered) {
        let offline = r["metadata"]["annotations"][VERDICT]
            .as_str()
            .map(str::to_owned);
        if offline != verdicts[k].0 {
            differ.push(format!(
                "{k}: webhook {:?}, render {offline:?}",
                verdicts[k].0
            ));
        }
    }
    assert!(
        differ.is_empty(),
        "render disagrees with the webhook:\n{}",
        differ.join("\n")
    );

    native_gate_agrees(env, &cases, &admitted_pods).await;
}

/// The native gate (`meshgate_core::native_gate`) installed next to the webhook, on the same
/// API server: every shape is created again, in fresh namespaces, and must be admitted exactly
/// as through the webhook alone (the gate annotation, every init container as stored, the QoS
/// class) and meet the case. The ambient shapes in namespaces without a LimitRange must be
/// gated by the policy: the webhook, where it is called at all, changes nothing.
async fn native_gate_agrees(env: &Env, cases: &[Case], webhook: &BTreeMap<String, Value>) {
    use kube::api::DynamicObject;
    use meshgate_core::native_gate::{Routes, policy, routed_namespace};
    use meshgate_core::resources::ContainerLimits;
    let client = &env.client;
    let config = config();
    let mut routed: Vec<String> = cases
        .iter()
        .filter(|c| {
            c.namespace.limit_range.as_ref().is_some_and(|limits| {
                let lr: LimitRange =
                    serde_json::from_value(json!({"spec": {"limits": limits}})).expect("lr");
                routed_namespace(&ContainerLimits::of(&lr))
            })
        })
        .map(|c| format!("mn-{}", c.name))
        .collect();
    routed.sort();
    let routes = Routes::Namespaces(routed);
    let api = meshgate::discovery::policy_api(client)
        .await
        .expect("the API server serves MutatingAdmissionPolicies");
    for mut doc in policy(&config, api, &routes).expect("the native gate compiles") {
        // Fail, not the installed Ignore: an expression that errors on a shape refuses it here
        // instead of silently leaving it to the webhook.
        if doc["kind"] == "MutatingAdmissionPolicy" {
            doc["spec"]["failurePolicy"] = json!("Fail");
        }
        let obj: DynamicObject = serde_json::from_value(doc).expect("object");
        let gvk =
            kube::api::GroupVersionKind::try_from(obj.types.as_ref().expect("types")).expect("gvk");
        let ar = kube::api::ApiResource::from_gvk(&gvk);
        let name = obj.metadata.name.clone().expect("name");
        kube::Api::<DynamicObject>::all_with(client.clone(), &ar)
            .patch(
                &name,
                &kube::api::PatchParams::apply("meshgate-test").force(),
                &kube::api::Patch::Apply(&obj),
            )
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    register(
        client,
        &env.webhook
            .registration_native("meshgate", &config, &routes),
    )
    .await;
    // Both take effect asynchronously: wait until an ambient pod is gated without a review.
    let ns = create_namespace(
        client,
        "mn-warmup",
        &NamespaceSpec {
            labels: [("istio.io/dataplane-mode".into(), "ambient".into())].into(),
            ..NamespaceSpec::default()
        },
    )
    .await;
    let mut n = 0;
    wait_for(
        "the native gate active, the webhook routed",
        Duration::from_secs(60),
        || {
            n += 1;
            let probe = pod(&format!("probe-{n}"));
            let ns = ns.clone();
            async move {
                let before = env.webhook.pod_gate_reviews(Some("mutated")).await;
                let Ok(p) = dry_run(&env.client, &ns, &probe).await else {
                    return false;
                };
                let gated = p
                    .metadata
                    .annotations
                    .unwrap_or_default()
                    .get(VERDICT)
                    .is_some_and(|v| v.starts_with("gated: --tcp-listening"));
                gated && env.webhook.pod_gate_reviews(Some("mutated")).await == before
            }
        },
    )
    .await;

    let mut failures = Vec::new();
    let (mut unreviewed, mut expected_native) = (0, 0);
    for case in cases {
        let ns = create_namespace(client, &format!("mn-{}", case.name), &case.namespace).await;
        for (order, pod) in case_pods(case) {
            let key = format!("{}{order}", case.name);
            let reference = webhook.get(&key);
            let reference_qos = reference.and_then(|p| p["status"]["qosClass"].as_str());
            let before = env.webhook.pod_gate_reviews(None).await;
            let mutated_before = env.webhook.pod_gate_reviews(Some("mutated")).await;
            let admitted = match dry_run(client, &ns, &pod).await {
                Ok(p) => p,
                Err(e) => {
                    failures.push(format!("{key}: refused by the API server: {e}"));
                    continue;
                }
            };
            let reviewed = env.webhook.pod_gate_reviews(None).await - before;
            let mutated = env.webhook.pod_gate_reviews(Some("mutated")).await - mutated_before;
            let ambient_only = case.expect["verdict"]
                .as_str()
                .is_some_and(|v| v.starts_with("gated: --tcp-listening"))
                && case.namespace.limit_range.is_none();
            if ambient_only {
                expected_native += 1;
                if mutated > 0 {
                    failures.push(format!(
                        "{key}: the webhook added the gate ({mutated} reviews)"
                    ));
                }
            }
            if reviewed == 0 {
                unreviewed += 1;
            }
            if let Err(e) = check(case, &admitted, reference_qos) {
                failures.push(format!("{key}: {e}"));
            }
            let got = serde_json::to_value(&admitted).unwrap_or_default();
            let Some(want) = reference else {
                failures.push(format!("{key}: no webhook result to compare"));
                continue;
            };
            for pointer in [
                "/metadata/annotations/meshgate.dev~1gate",
                "/spec/initContainers",
                "/spec/containers",
                "/status/qosClass",
            ] {
                if got.pointer(pointer) != want.pointer(pointer) {
                    failures.push(format!(
                        "{key}: {pointer} differs\n  native:  {}\n  webhook: {}",
                        got.pointer(pointer).unwrap_or(&Value::Null),
                        want.pointer(pointer).unwrap_or(&Value::Null)
                    ));
                }
            }
        }
    }
    // With the Linkerd profile configured, its namespace clauses (selected by a namespace
    // annotation, which no webhook selector can see) still call the webhook for every pod; it
    // then finds the gate in place.
    println!(
        "native gate: {expected_native} ambient shapes gated by the policy, {unreviewed} shapes admitted without any pod-gate review"
    );
    assert!(
        failures.is_empty(),
        "the native gate disagrees with the webhook on {} shapes:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    assert!(expected_native >= 6, "{expected_native} ambient shapes");
}

//! The ready-made policies in `deploy/policies/`: each parses as `meshgate render` reads it and
//! does what its comments say to sample objects. No cluster.
//!
//! Run: `cargo test -p meshgate --test ready_made_policies`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use meshgate_api::MutationPolicySpec;
use meshgate_core::policy::{RenderedDoc, render};
use serde_json::{Value, json};

const RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
const PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";

fn policy_file(name: &str) -> PathBuf {
    meshgate_testenv::workspace_dir()
        .join("deploy/policies")
        .join(name)
}

/// The file's policies, read like `meshgate render --policy` does.
fn read(name: &str) -> Vec<(String, MutationPolicySpec)> {
    let (policies, notes) =
        meshgate::render::read_policies(&policy_file(name)).expect("the policy file reads");
    assert!(
        notes.partial.is_empty() && notes.notes.is_empty(),
        "{notes:?}"
    );
    policies
}

/// Namespaces: `injected` (istio-injection=enabled), `opted` (also the exclude-ranges label),
/// anything else unlabelled.
fn namespace_labels(ns: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    if ns == "injected" || ns == "opted" {
        labels.insert("istio-injection".to_owned(), "enabled".to_owned());
    }
    if ns == "opted" {
        labels.insert(
            "meshgate.dev/exclude-ranges".to_owned(),
            "enabled".to_owned(),
        );
    }
    labels
}

fn render_one(policies: &[(String, MutationPolicySpec)], doc: Value) -> RenderedDoc {
    let mut out = render(vec![doc], policies, &namespace_labels).expect("renders");
    assert_eq!(out.len(), 1);
    out.remove(0)
}

fn pod(ns: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": ns},
        "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    })
}

fn deployment(ns: &str, template_metadata: Value) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "d", "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": "d"}},
            "template": {
                "metadata": template_metadata,
                "spec": {
                    "initContainers": [{"name": "fetch", "image": "registry.invalid/fetch:1"}],
                    "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
                },
            },
        },
    })
}

/// Rendering the result again changes nothing.
fn assert_idempotent(policies: &[(String, MutationPolicySpec)], rendered: &RenderedDoc) {
    let again = render_one(policies, rendered.object.clone());
    assert!(again.patch.is_empty(), "{:?}", again.patch);
}

/// A pod as Istio's injector leaves it in CNI mode: classic (proxy as a container) or with the
/// proxy as a native sidecar, and the application's init containers after the mesh's.
fn injected_pod(ns: &str, native: bool) -> Value {
    let proxy = json!({"name": "istio-proxy", "image": "registry.invalid/proxy:1", "args": ["proxy", "sidecar"]});
    let validation = json!({"name": "istio-validation", "image": "registry.invalid/proxy:1",
                            "securityContext": {"runAsUser": 1337}});
    let mut inits = vec![validation];
    let mut containers = vec![json!({"name": "app", "image": "registry.invalid/app:1"})];
    if native {
        let mut p = proxy;
        p["restartPolicy"] = json!("Always");
        inits.push(p);
    } else {
        containers.push(proxy);
    }
    inits.push(json!({"name": "storage-initializer", "image": "registry.invalid/init:1"}));
    inits.push(
        json!({"name": "needs-root", "image": "registry.invalid/init:1",
                      "securityContext": {"runAsUser": 0}}),
    );
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": ns},
        "spec": {"initContainers": inits, "containers": containers},
    })
}

fn init_users(pod: &Value) -> Vec<(String, Value)> {
    pod["spec"]["initContainers"]
        .as_array()
        .expect("init containers")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().expect("a name").to_owned(),
                c["securityContext"]["runAsUser"].clone(),
            )
        })
        .collect()
}

#[test]
fn kubeflow_runs_application_init_containers_as_the_proxy_uid_unless_the_proxy_is_native() {
    let policies = read("kubeflow.yaml");
    assert_eq!(policies.len(), 1);
    let warning = policies[0].1.warning.clone().unwrap_or_default();
    assert!(
        warning.contains("1337"),
        "the warning names the trade-off: {warning}"
    );

    // Classic sidecar: the application's init container that sets no user runs as 1337; the
    // mesh's and one with an explicit user keep theirs; nothing is excluded.
    let r = render_one(&policies, injected_pod("injected", false));
    assert_eq!(
        init_users(&r.object),
        [
            ("istio-validation".to_owned(), json!(1337)),
            ("storage-initializer".to_owned(), json!(1337)),
            ("needs-root".to_owned(), json!(0)),
        ]
    );
    assert!(r.object["metadata"]["annotations"][RANGES].is_null());
    assert_eq!(r.policies, ["kubeflow"]);
    assert_idempotent(&policies, &r);

    // Native sidecar proxy: the application's init containers already have the network.
    let r = render_one(&policies, injected_pod("injected", true));
    assert!(r.patch.is_empty(), "{:?}", r.patch);

    // Pod templates are left alone (they have no proxy yet), and so are other namespaces.
    let r = render_one(
        &policies,
        deployment("injected", json!({"labels": {"app": "d"}})),
    );
    assert!(r.patch.is_empty(), "{:?}", r.patch);
    let r = render_one(&policies, injected_pod("plain", false));
    assert!(r.patch.is_empty() && r.warnings.is_empty());
}

#[test]
fn exclude_all_outbound_is_the_labelled_last_resort() {
    let policies = read("exclude-all-outbound.yaml");
    assert_eq!(policies.len(), 1);
    let warning = policies[0].1.warning.clone().unwrap_or_default();
    assert!(
        warning.contains("all outbound traffic") && warning.contains("whole life"),
        "the warning names the trade-off: {warning}"
    );
    let mut opted = pod("injected");
    opted["metadata"]["labels"] = json!({"meshgate.dev/exclude-all-outbound": "true"});
    let r = render_one(&policies, opted.clone());
    assert_eq!(r.object["metadata"]["annotations"][RANGES], "0.0.0.0/0");
    assert_eq!(r.warnings, [format!("exclude-all-outbound: {warning}")]);
    assert_idempotent(&policies, &r);
    // A value set on the pod is kept.
    opted["metadata"]["annotations"] = json!({RANGES: "10.0.0.0/8"});
    let r = render_one(&policies, opted);
    assert_eq!(r.object["metadata"]["annotations"][RANGES], "10.0.0.0/8");
    assert!(r.patch.is_empty());
    // Without the label, or outside injected namespaces: nothing.
    assert!(render_one(&policies, pod("injected")).patch.is_empty());
    let mut elsewhere = pod("plain");
    elsewhere["metadata"]["labels"] = json!({"meshgate.dev/exclude-all-outbound": "true"});
    assert!(render_one(&policies, elsewhere).patch.is_empty());
}

#[test]
fn init_uid_runs_the_init_containers_of_opted_in_pods_as_1337() {
    let policies = read("init-uid.yaml");
    assert_eq!(policies.len(), 1);
    let opted_in = json!({"meshgate.dev/init-containers-as-proxy-uid": "true"});

    let mut p = pod("anywhere");
    p["metadata"]["annotations"] = opted_in.clone();
    p["spec"]["initContainers"] = json!([
        {"name": "fetch", "image": "registry.invalid/fetch:1"},
        {"name": "istio-init", "image": "registry.invalid/proxy:1",
         "securityContext": {"runAsUser": 0, "capabilities": {"add": ["NET_ADMIN"]}}},
        {"name": "migrate", "image": "registry.invalid/db:1",
         "securityContext": {"readOnlyRootFilesystem": true}},
    ]);
    let r = render_one(&policies, p.clone());
    let inits = &r.object["spec"]["initContainers"];
    assert_eq!(inits[0]["securityContext"], json!({"runAsUser": 1337}));
    // An explicit runAsUser is kept; other security settings stay.
    assert_eq!(
        inits[1]["securityContext"],
        p["spec"]["initContainers"][1]["securityContext"]
    );
    assert_eq!(
        inits[2]["securityContext"],
        json!({"readOnlyRootFilesystem": true, "runAsUser": 1337})
    );
    // App containers are not touched.
    assert_eq!(r.object["spec"]["containers"], p["spec"]["containers"]);
    assert_eq!(r.policies, ["init-uid"]);
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    assert!(r.warnings[0].contains("1337"), "{:?}", r.warnings);
    assert_idempotent(&policies, &r);

    // Without the annotation: nothing.
    let mut not_opted = p.clone();
    not_opted["metadata"]["annotations"] = json!({});
    let r = render_one(&policies, not_opted);
    assert!(r.patch.is_empty() && r.warnings.is_empty());

    // A workload opts in through its pod template.
    let r = render_one(
        &policies,
        deployment("anywhere", json!({"annotations": opted_in})),
    );
    assert_eq!(
        r.object["spec"]["template"]["spec"]["initContainers"][0]["securityContext"]["runAsUser"],
        1337
    );
    let r = render_one(
        &policies,
        deployment("anywhere", json!({"labels": {"app": "d"}})),
    );
    assert!(r.patch.is_empty());
}

#[test]
fn exclude_ranges_sets_narrow_exclusions_in_opted_in_namespaces() {
    let policies = read("exclude-ranges.yaml");
    assert_eq!(policies.len(), 1);

    let r = render_one(&policies, pod("opted"));
    let annotations = &r.object["metadata"]["annotations"];
    let ranges = annotations[RANGES].as_str().expect("ranges set");
    assert!(
        !ranges.is_empty() && !ranges.split(',').any(|c| c.trim() == "0.0.0.0/0"),
        "{ranges}"
    );
    for cidr in ranges.split(',') {
        let (_, bits) = cidr.trim().split_once('/').expect("CIDR");
        assert!(
            bits.parse::<u8>().expect("prefix length") >= 8,
            "narrow: {cidr}"
        );
    }
    let ports = annotations[PORTS].as_str().expect("ports set");
    assert!(
        ports.split(',').all(|p| p.trim().parse::<u16>().is_ok()),
        "{ports}"
    );
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    assert_idempotent(&policies, &r);

    // The pod's own values win, key by key.
    let mut own = pod("opted");
    own["metadata"]["annotations"] = json!({PORTS: "3306"});
    let r = render_one(&policies, own);
    assert_eq!(r.object["metadata"]["annotations"][PORTS], "3306");
    assert_eq!(r.object["metadata"]["annotations"][RANGES], ranges);

    // Workloads' pod templates too.
    let r = render_one(
        &policies,
        deployment("opted", json!({"labels": {"app": "d"}})),
    );
    assert_eq!(
        r.object["spec"]["template"]["metadata"]["annotations"][PORTS],
        ports
    );

    // Injected namespaces that did not opt in, and other namespaces: nothing.
    for ns in ["injected", "plain"] {
        let r = render_one(&policies, pod(ns));
        assert!(r.patch.is_empty(), "{ns}: {:?}", r.patch);
    }
}

/// The CLI path (`meshgate render -f <manifest> --policy <file>`) accepts every file.
#[test]
fn every_ready_made_policy_renders_through_the_cli_path() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("pod.yaml");
    std::fs::write(&manifest, serde_saphyr::to_string(&pod("opted")).unwrap()).unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(policy_file(""))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for expected in [
        "exclude-all-outbound.yaml",
        "exclude-ranges.yaml",
        "init-uid.yaml",
        "kubeflow.yaml",
    ] {
        assert!(names.iter().any(|n| n == expected), "{names:?}");
    }
    for f in &files {
        let (out, _notes) = meshgate::render::render(
            std::slice::from_ref(&manifest),
            std::slice::from_ref(f),
            &BTreeMap::new(),
            None,
            Default::default(),
            false,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(out.contains("kind: Pod"), "{}: {out}", f.display());
    }
}

//! meshgate's YAML output read back by Kubernetes' own YAML library: `yamlcheck`
//! (tools/yamlcheck, built from the Go module proxy like the control plane) reads a stream as
//! kubectl does (sigs.k8s.io/yaml, YAML 1.1 resolution: `yes`, `on`, `y` are booleans, `1_000`
//! and `0777` numbers, a key `n` is `false`) and prints JSON. Every document meshgate writes
//! (`render`, `install`, the CRDs, and a corpus of every scalar YAML 1.1 and 1.2 resolve
//! differently) must read back as the JSON meshgate meant, by that reader and by meshgate's own.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::{Value, json};

/// Scalars that YAML 1.1 and YAML 1.2 readers resolve differently, or that either reader would
/// take for something other than a string: booleans (1.1's every spelling), nulls, integers
/// (underscores, octal both ways, hex, binary, sexagesimal, signs), floats, timestamps, the
/// merge and value keys, and strings that need quoting for syntax.
const SCALARS: &[&str] = &[
    "y",
    "Y",
    "yes",
    "Yes",
    "YES",
    "n",
    "N",
    "no",
    "No",
    "NO",
    "on",
    "On",
    "ON",
    "off",
    "Off",
    "OFF",
    "true",
    "True",
    "TRUE",
    "false",
    "False",
    "FALSE",
    "null",
    "Null",
    "NULL",
    "~",
    "",
    "1_000",
    "0777",
    "0o17",
    "0x1F",
    "0b101",
    "+12",
    "-0",
    "1:20",
    "190:20:30",
    "1.5e3",
    "1e3",
    ".5",
    "1.",
    ".inf",
    "-.Inf",
    "+.INF",
    ".nan",
    ".NaN",
    "2001-12-14",
    "2002-12-14t21:59:43.10-05:00",
    "2001-12-14 21:59:43.10 -5",
    "2020-09-21T12:56:35Z",
    "<<",
    "=",
    "- a",
    "a: b",
    "#x",
    "x #y",
    "'q'",
    "\"dq\"",
    "back\\slash",
    "tab\there",
    " lead",
    "trail ",
    "multi\nline",
    "multi\nline\n",
    "trailing\n\n",
    "@at",
    "`tick",
    "!tag",
    "&anchor",
    "*alias",
    "%pct",
    "{a}",
    "[a]",
    "|",
    ">",
    "?",
    "?x",
    ",",
    "ünï",
    "0",
    "1",
    "-1",
    "1.0",
    "3600.0",
    "a long line of more than eighty characters that a folding emitter might wrap across lines when writing it",
];

fn yamlcheck() -> PathBuf {
    if let Some(p) = std::env::var_os("MESHGATE_YAMLCHECK") {
        return PathBuf::from(p);
    }
    let script = meshgate_testenv::workspace_dir().join("tools/yamlcheck/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .expect("tools/yamlcheck/build.sh runs");
    assert!(out.status.success(), "tools/yamlcheck/build.sh failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The documents of `yaml` as kubectl reads them.
fn kubectl_reads(yaml: &str) -> Vec<Value> {
    use std::io::Write;
    let mut child = Command::new(yamlcheck())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("yamlcheck runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(yaml.as_bytes())
        .expect("yamlcheck's stdin");
    let out = child.wait_with_output().expect("yamlcheck's output");
    assert!(
        out.status.success(),
        "yamlcheck: {}\ninput:\n{yaml}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("yamlcheck prints JSON")
}

/// Numbers compared by value (`3600.0` and `3600` are the same JSON number to a reader).
fn normalized(v: &Value) -> Value {
    match v {
        Value::Number(n) => json!(n.as_f64()),
        Value::Array(a) => Value::Array(a.iter().map(normalized).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, v)| (k.clone(), normalized(v))).collect())
        }
        other => other.clone(),
    }
}

/// Both readers read `yaml` back as `want`; on a difference, names the first document, key or
/// value that differs.
fn assert_reads_back(yaml: &str, want: &[Value]) {
    let by_kubectl: Vec<Value> = kubectl_reads(yaml).iter().map(normalized).collect();
    let by_meshgate: Vec<Value> = meshgate_api::yaml::documents(yaml)
        .expect("meshgate reads its own output")
        .iter()
        .map(normalized)
        .collect();
    let want: Vec<Value> = want.iter().map(normalized).collect();
    for (reader, got) in [("kubectl's", &by_kubectl), ("meshgate's", &by_meshgate)] {
        assert_eq!(got.len(), want.len(), "{reader} reader: document count");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if g != w {
                let diff = first_difference(w, g, String::new());
                panic!("{reader} reader, document {i}: {diff}\nYAML:\n{yaml}");
            }
        }
    }
}

fn first_difference(want: &Value, got: &Value, path: String) -> String {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for (k, wv) in w {
                match g.get(k) {
                    Some(gv) if gv == wv => {}
                    Some(gv) => return first_difference(wv, gv, format!("{path}.{k}")),
                    None => {
                        let extra: Vec<&String> =
                            g.keys().filter(|k| !w.contains_key(*k)).collect();
                        return format!("{path}: key {k:?} missing; keys read instead: {extra:?}");
                    }
                }
            }
            format!(
                "{path}: extra keys {:?}",
                g.keys().filter(|k| !w.contains_key(*k)).collect::<Vec<_>>()
            )
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => w
            .iter()
            .zip(g)
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| first_difference(a, b, format!("{path}[{i}]")))
            .unwrap_or_default(),
        _ => format!("{path}: wrote {want}, read {got}"),
    }
}

/// A ConfigMap holding every scalar as a key and as a value, and labels/annotations made of them.
fn scalar_corpus() -> Value {
    let data: serde_json::Map<String, Value> = SCALARS
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            [
                ((*s).to_owned(), json!(s)),
                (format!("value-{i}"), json!(s)),
            ]
        })
        .collect();
    let annotations: serde_json::Map<String, Value> = SCALARS
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("example.com/a{i}"), json!(s)))
        .collect();
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "scalars", "annotations": annotations, "labels": {"n": "y", "on": "off"}},
           "data": data,
           "list": SCALARS})
}

#[test]
fn every_scalar_that_yaml_1_1_and_1_2_resolve_differently_reads_back_as_written() {
    let doc = scalar_corpus();
    let yaml = meshgate::render::to_yaml_stream(std::slice::from_ref(&doc)).expect("yaml");
    assert_reads_back(&yaml, &[doc]);
}

#[test]
fn render_output_reads_back_as_rendered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns",
                     "labels": {"version": "1_000", "enabled": "yes", "n": "on"},
                     "annotations": {"created": "2020-09-21T12:56:35Z", "mode": "0777"}},
        "spec": {"containers": [{"name": "app", "image": "app:1", "args": ["yes", "no", "1:20", "~"]}]}});
    // Written as JSON (itself YAML): the input holds the strings unambiguously.
    let manifests = dir.path().join("pods.json");
    std::fs::write(&manifests, pod.to_string()).expect("manifests");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "apiVersion: meshgate.dev/v1alpha1
kind: MutationPolicy
metadata: {name: p}
spec:
  match: {kinds: [Pod]}
  mutations:
  - annotations:
      values: {\"example.com/flag\": \"off\", \"example.com/when\": \"2001-12-14\", \"y\": \"n\"}
",
    )
    .expect("policy");
    let out = Command::new(env!("CARGO_BIN_EXE_meshgate"))
        .args(["render", "-f"])
        .arg(&manifests)
        .arg("--policy")
        .arg(&policy)
        .output()
        .expect("meshgate render");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let annotations = pod["metadata"]["annotations"]
        .as_object_mut()
        .expect("annotations");
    annotations.insert("example.com/flag".into(), json!("off"));
    annotations.insert("example.com/when".into(), json!("2001-12-14"));
    annotations.insert("y".into(), json!("n"));
    assert_reads_back(&String::from_utf8_lossy(&out.stdout), &[pod]);
}

#[test]
fn install_manifests_and_crds_read_back_as_meant() {
    for profile in meshgate::install::PROFILES {
        let docs = meshgate::install::render(&meshgate::install::InstallOptions {
            profile: profile.into(),
            namespace: "meshgate-system".into(),
            image: "meshgate/meshgate:0.1.0".into(),
            node_taint: meshgate::install::NodeTaint::Policy(
                meshgate_core::registration::PolicyApi::V1,
            ),
            // The native gate's policy (long CEL) where the profile has one.
            pod_gate: meshgate::install::PodGate::choose(
                "auto",
                Some(meshgate_core::registration::PolicyApi::V1),
                profile,
                meshgate::install::Strategy::Pod,
            )
            .expect("pod gate"),
            strategy: meshgate::install::Strategy::Pod,
            taint_key: meshgate_api::names::STARTUP_TAINT_KEY.into(),
            node_paths: Default::default(),
            repair: Some(meshgate::install::RepairAction::Delete),
            webhook_ingress_from: Vec::new(),
            context_config_maps: Vec::new(),
            context_api_reads: Vec::new(),
            existing_kinds: Vec::new(),
            policies: Default::default(),
        })
        .expect("install renders");
        let yaml = meshgate::render::to_yaml_stream(&docs).expect("yaml");
        assert_reads_back(&yaml, &docs);
    }
    use kube::CustomResourceExt;
    let crds = meshgate::crds::all_yaml().expect("crds");
    let want = [
        serde_json::to_value(meshgate_api::NodeGate::crd()).expect("json"),
        serde_json::to_value(meshgate_api::MutationPolicy::crd()).expect("json"),
        serde_json::to_value(meshgate_api::NamespacedMutationPolicy::crd()).expect("json"),
    ];
    assert_reads_back(&crds, &want);
}

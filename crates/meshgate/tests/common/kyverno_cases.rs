//! The Kyverno cases of issue #30 (`tests/fixtures/kyverno_oracle`, format in its README),
//! read by `kyverno_oracle` (against the real Kyverno CLI) and `policies_kyverno` (through the
//! webhook on the real API server, `render`, and the native path).

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// A documented deviation: meshgate differs from Kyverno on purpose for this object.
#[derive(Debug)]
pub struct Deviation {
    pub object: String,
    pub kind: String,
    pub reason: String,
}

pub struct Case {
    /// The file's stem (`06-workload-objects`).
    pub name: String,
    pub causes: Vec<u64>,
    pub policies: Vec<Value>,
    /// The ConfigMaps the policies' `configMap` context entries read (data, not objects to
    /// mutate): given to `render` with each object, and to the CLI as the entries' values.
    pub config_maps: Vec<Value>,
    /// The objects the policies' `apiCall` entries read (the header's `data`): given to
    /// `render` and to the CLI with each object, not compared.
    pub data: Vec<Value>,
    pub objects: Vec<Value>,
    pub deviations: Vec<Deviation>,
}

/// Every case of `tests/fixtures/kyverno_oracle`, in file order.
pub fn read_cases() -> Vec<Case> {
    let dir =
        meshgate_testenv::workspace_dir().join("crates/meshgate/tests/fixtures/kyverno_oracle");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|file| {
            let name = file
                .file_stem()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            let docs = meshgate::render::read_documents(file).unwrap_or_else(|e| panic!("{e}"));
            let (head, rest) = docs
                .split_first()
                .unwrap_or_else(|| panic!("{name}: empty"));
            let causes: Vec<u64> = head
                .get("cause")
                .and_then(Value::as_array)
                .unwrap_or_else(|| panic!("{name}: cause: a list of issue #30's cause numbers"))
                .iter()
                .map(|c| c.as_u64().unwrap_or_else(|| panic!("{name}: cause {c}")))
                .collect();
            assert!(
                head.get("about").and_then(Value::as_str).is_some(),
                "{name}: about: required"
            );
            let deviations = head
                .get("deviations")
                .and_then(Value::as_array)
                .map(|ds| {
                    ds.iter()
                        .map(|d| {
                            let field = |f: &str| {
                                d.get(f)
                                    .and_then(Value::as_str)
                                    .unwrap_or_else(|| panic!("{name}: deviations[].{f}"))
                                    .to_owned()
                            };
                            let dev = Deviation {
                                object: field("object"),
                                kind: field("kind"),
                                reason: field("reason"),
                            };
                            assert!(
                                ["differs", "refused", "accepted"].contains(&dev.kind.as_str()),
                                "{name}: deviation kind {:?}",
                                dev.kind
                            );
                            assert!(
                                dev.reason.len() > 20,
                                "{name}: a deviation needs its reason"
                            );
                            dev
                        })
                        .collect()
                })
                .unwrap_or_default();
            let (policies, objects): (Vec<Value>, Vec<Value>) =
                rest.iter().cloned().partition(|d| {
                    d.get("apiVersion")
                        .and_then(Value::as_str)
                        .is_some_and(|a| a.starts_with("kyverno.io/"))
                });
            // A ConfigMap a policy's `configMap` context entry names is data, not an object.
            let read: BTreeSet<String> = policies
                .iter()
                .flat_map(|p| p["spec"]["rules"].as_array().cloned().unwrap_or_default())
                .flat_map(|r| {
                    let mut entries = r["context"].as_array().cloned().unwrap_or_default();
                    for f in r["mutate"]["foreach"].as_array().into_iter().flatten() {
                        entries.extend(f["context"].as_array().cloned().unwrap_or_default());
                    }
                    entries
                })
                .filter_map(|e| {
                    let cm = e.get("configMap")?;
                    Some(format!(
                        "ConfigMap/{}/{}",
                        cm["namespace"].as_str().unwrap_or("default"),
                        cm["name"].as_str()?
                    ))
                })
                .collect();
            let (config_maps, objects): (Vec<Value>, Vec<Value>) = objects
                .into_iter()
                .partition(|d| d["apiVersion"] == "v1" && read.contains(&object_id(d)));
            // The objects the header names as `data` are what `apiCall` entries GET.
            let data_ids: BTreeSet<String> = head
                .get("data")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|d| {
                    d.as_str()
                        .unwrap_or_else(|| panic!("{name}: data: Kind/namespace/name"))
                        .to_owned()
                })
                .collect();
            let (data, objects): (Vec<Value>, Vec<Value>) = objects
                .into_iter()
                .partition(|d| data_ids.contains(&object_id(d)));
            assert_eq!(
                data.len(),
                data_ids.len(),
                "{name}: data names objects of the case"
            );
            assert!(!policies.is_empty(), "{name}: no Kyverno policy");
            assert!(!objects.is_empty(), "{name}: no object");
            Case {
                name,
                causes,
                policies,
                config_maps,
                data,
                objects,
                deviations,
            }
        })
        .collect()
}

/// `Kind/namespace/name`, or `Kind/name` without a namespace.
pub fn object_id(o: &Value) -> String {
    let s = |p: &str| o.pointer(p).and_then(Value::as_str).unwrap_or_default();
    match s("/metadata/namespace") {
        "" => format!("{}/{}", s("/kind"), s("/metadata/name")),
        ns => format!("{}/{ns}/{}", s("/kind"), s("/metadata/name")),
    }
}

/// `meshgate render --policy POLICY -f OBJECT` (the file holds the case's ConfigMaps, then the
/// object), strictly or with `--allow-partial` (the policies that fail on the object left out,
/// as the webhook leaves them out): the object, or the reason it refused.
pub fn render(policy: &Path, object: &Path, allow_partial: bool) -> Result<Value, String> {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_meshgate"));
    command
        .arg("render")
        .arg("--policy")
        .arg(policy)
        .arg("-f")
        .arg(object);
    if allow_partial {
        command.arg("--allow-partial");
    }
    let out = command.output().expect("run meshgate");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(stderr.trim().to_owned());
    }
    let docs = meshgate::render::parse_documents("render", &String::from_utf8_lossy(&out.stdout))
        .unwrap_or_else(|e| panic!("{e}"));
    // Documents come out in the order they went in: the object is the last.
    docs.into_iter()
        .next_back()
        .ok_or_else(|| "render printed no object".to_owned())
}

/// Where two values differ, as `path: <a's name> …, <b's name> …` lines (lists of the same
/// length element by element, others whole).
pub fn diff(path: &str, a: (&str, &Value), b: (&str, &Value), out: &mut Vec<String>) {
    let ((an, av), (bn, bv)) = (a, b);
    match (av, bv) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for key in keys {
                let p = format!("{path}/{}", key.replace('~', "~0").replace('/', "~1"));
                match (x.get(key), y.get(key)) {
                    (Some(x), Some(y)) => diff(&p, (an, x), (bn, y), out),
                    (x, y) => out.push(format!(
                        "{p}: {an} {}, {bn} {}",
                        x.map_or("absent".into(), Value::to_string),
                        y.map_or("absent".into(), Value::to_string)
                    )),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (x, y)) in x.iter().zip(y).enumerate() {
                diff(&format!("{path}/{i}"), (an, x), (bn, y), out);
            }
        }
        _ if av != bv => out.push(format!("{path}: {an} {av}, {bn} {bv}")),
        _ => {}
    }
}

/// Panics with the differences when `a` and `b` differ.
pub fn assert_same(a: (&str, &Value), b: (&str, &Value), what: &str) {
    let mut lines = Vec::new();
    diff("", a, b, &mut lines);
    assert!(lines.is_empty(), "{what}:\n    {}", lines.join("\n    "));
}

//! `meshgate render` and `meshgate import kyverno`: offline, no cluster.

use std::collections::BTreeMap;
use std::path::Path;

use meshgate_api::{MutationPolicy, MutationPolicySpec};
use meshgate_core::resources::ContainerLimits;
use meshgate_core::select::Meta;
use serde_json::Value;

/// An input problem, naming the file, the document and the field.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{file}: {source}")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: document {index}: {message}")]
    Document {
        file: String,
        index: usize,
        message: String,
    },
}

/// Reads a multi-document YAML (or JSON) file; empty documents are dropped.
pub fn read_documents(path: &Path) -> Result<Vec<Value>, InputError> {
    let file = path.display().to_string();
    let text = if file == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|source| InputError::Read {
        file: file.clone(),
        source,
    })?;
    parse_documents(&file, &text)
}

/// Parses a multi-document YAML string; `file` names it in errors.
pub fn parse_documents(file: &str, text: &str) -> Result<Vec<Value>, InputError> {
    meshgate_api::yaml::documents(text).map_err(|(index, e)| InputError::Document {
        file: file.to_owned(),
        index,
        message: e.to_string(),
    })
}

/// What `render` and `import` report beside their output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// What of the input policies is not applied as written: Kyverno features not converted,
    /// and policies that failed on a document. With any, the output is a half-applied result,
    /// which the CLI refuses unless `--allow-partial`.
    pub partial: Vec<String>,
    /// Everything else worth knowing: ignored non-mutate rules, the policies' warnings.
    pub notes: Vec<String>,
    /// Where each policy comes from (`file: document N`), by policy name.
    pub origins: BTreeMap<String, String>,
}

impl Report {
    fn extend(&mut self, other: Report) {
        self.partial.extend(other.partial);
        self.notes.extend(other.notes);
        self.origins.extend(other.origins);
    }
}

/// Named policy specs and the report of their conversion.
pub type Policies = (Vec<(String, MutationPolicySpec)>, Report);

/// Reads policies: meshgate `MutationPolicy` documents and Kyverno `ClusterPolicy`/`Policy`
/// documents (converted; what cannot be converted is returned as notes).
pub fn read_policies(path: &Path) -> Result<Policies, InputError> {
    policies_of(&path.display().to_string(), read_documents(path)?)
}

/// Policies from parsed documents; `file` names their source in errors.
pub fn policies_of(file: &str, docs: Vec<Value>) -> Result<Policies, InputError> {
    let file = file.to_owned();
    let mut policies = Vec::new();
    let mut report = Report::default();
    for (index, doc) in docs.into_iter().enumerate() {
        let err = |message: String| InputError::Document {
            file: file.clone(),
            index,
            message,
        };
        let api_version = doc
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
        if meshgate_core::policy::admission::is_admission_policy(&doc)
            || (api_version.starts_with("admissionregistration.k8s.io/")
                && kind == "MutatingAdmissionPolicyBinding")
        {
            // Applied by `render` itself (CEL; see `meshgate_core::policy::admission`);
            // bindings are not read.
        } else if api_version.starts_with("kyverno.io/") {
            let imported = meshgate_core::kyverno::import(&doc).map_err(|e| err(e.to_string()))?;
            let at = |n: String| format!("{file}: document {index}: {n}");
            report.partial.extend(imported.notes.into_iter().map(at));
            report.notes.extend(imported.ignored.into_iter().map(at));
            for (name, _) in &imported.policies {
                report
                    .origins
                    .insert(name.clone(), format!("{file}: document {index}"));
            }
            policies.extend(imported.policies);
        } else if api_version == "meshgate.dev/v1alpha1" && kind == "MutationPolicy" {
            let p: MutationPolicy = serde_path(&doc).map_err(err)?;
            let name = p.metadata.name.clone().unwrap_or_default();
            meshgate_core::policy::validate(&p.spec).map_err(|e| err(e.join("; ")))?;
            report
                .origins
                .insert(name.clone(), format!("{file}: document {index}"));
            policies.push((name, p.spec));
        } else if api_version == "meshgate.dev/v1alpha1" && kind == "NamespacedMutationPolicy" {
            let p: meshgate_api::NamespacedMutationPolicy = serde_path(&doc).map_err(err)?;
            let Some(ns) = p.metadata.namespace.clone().filter(|n| !n.is_empty()) else {
                return Err(err(
                    "metadata.namespace: required for a NamespacedMutationPolicy".to_owned(),
                ));
            };
            meshgate_core::policy::validate(&p.spec.policy).map_err(|e| err(e.join("; ")))?;
            let spec = meshgate_core::policy::confine(&p.spec.policy, &ns)
                .map_err(|e| err(e.join("; ")))?;
            let name = format!("{ns}/{}", p.metadata.name.clone().unwrap_or_default());
            report
                .origins
                .insert(name.clone(), format!("{file}: document {index}"));
            policies.push((name, spec));
        } else {
            return Err(err(format!(
                "apiVersion {api_version:?} kind {kind:?} is not a MutationPolicy or NamespacedMutationPolicy (meshgate.dev/v1alpha1) or a Kyverno policy (kyverno.io/v1)"
            )));
        }
    }
    Ok((policies, report))
}

/// Deserializes with the path of the failing field in the message (`spec.mutations[0]...`).
fn serde_path<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, String> {
    meshgate_api::yaml::from_value(v.clone()).map_err(|e| e.to_string())
}

/// Writes documents as a multi-document YAML stream.
pub fn to_yaml_stream(docs: &[Value]) -> Result<String, meshgate_api::yaml::YamlError> {
    let mut out = String::new();
    for d in docs {
        out.push_str("---\n");
        out.push_str(&meshgate_api::yaml::to_string(d)?);
    }
    Ok(out)
}

/// The `render` command: the mutated objects (or their patches) as YAML.
///
/// Policies apply first, then the init gate of `gate` (if given) decides on the result, as at
/// admission, where the gate is reinvoked after the policies changed a pod. Namespace objects
/// in the manifests supply their namespace's labels and annotations (`ns_labels` adds labels),
/// LimitRange objects their namespace's limits.
pub fn render(
    manifests: &[std::path::PathBuf],
    policy_files: &[std::path::PathBuf],
    ns_labels: &BTreeMap<String, BTreeMap<String, String>>,
    gate: Option<&meshgate_api::GateConfig>,
    builtin: Policies,
    patches: bool,
) -> anyhow::Result<(String, Report)> {
    let (policies, mut report, admission_policies) = load_policies(policy_files, builtin)?;
    let mut inputs = Vec::new();
    for m in manifests {
        inputs.push((m, read_documents(m)?));
    }
    let (namespaces, limits) = namespaces_and_limits(&inputs, ns_labels);
    let planner = gate.map(meshgate_core::gate::Planner::new);
    let mut out = Vec::new();
    for (m, docs) in inputs {
        let originals = docs.clone();
        // MutatingAdmissionPolicies first: the API server runs them before mutating webhooks.
        let mut docs = docs;
        apply_admission_policies(m, &mut docs, &admission_policies, &namespaces, &mut report)?;
        let rendered = meshgate_core::policy::render(docs, &policies, &|ns| {
            namespaces
                .get(ns)
                .map(|m| m.labels.clone())
                .unwrap_or_default()
        })
        .map_err(|e| anyhow::anyhow!("{}: {e}", m.display()))?;
        for r in rendered {
            for e in &r.failed {
                let origin = report
                    .origins
                    .get(e.policy())
                    .map(|o| format!(" (policy from {o})"))
                    .unwrap_or_default();
                report.partial.push(format!(
                    "{}: document {}: {e}{origin}",
                    m.display(),
                    r.index
                ));
            }
            for w in &r.warnings {
                report.notes.push(format!(
                    "{}: document {}: warning: {w}",
                    m.display(),
                    r.index
                ));
            }
            let mut object = r.object;
            // From the document as given (admission policies included).
            let mut patch = match originals.get(r.index) {
                Some(original) => meshgate_core::patch::JsonPatch::diff(original, &object),
                None => r.patch,
            };
            let mut verdict = None;
            if let Some(planner) = &planner
                && let Some(planned) = planner.plan_object(
                    &object,
                    &|ns| namespaces.get(ns).cloned().unwrap_or_default(),
                    &|ns| limits.get(ns).cloned().unwrap_or_default(),
                )
            {
                verdict = planned.plan.verdict().map(|v| match v {
                    Ok(plan) => plan.annotation(),
                    Err(no) => no.annotation(),
                });
                object = planned.object;
                if let Some(original) = originals.get(r.index) {
                    patch = meshgate_core::patch::JsonPatch::diff(original, &object);
                }
            }
            if patches {
                out.push(serde_json::json!({
                    "document": r.index,
                    "file": m.display().to_string(),
                    "policies": r.policies,
                    "gate": verdict,
                    "patch": patch,
                }));
            } else {
                out.push(object);
            }
        }
    }
    Ok((to_yaml_stream(&out)?, report))
}

/// The `import kyverno` command: MutationPolicy YAML and the report.
pub fn import_kyverno(path: &Path) -> anyhow::Result<(String, Report)> {
    let file = path.display().to_string();
    let mut out = Vec::new();
    let mut report = Report::default();
    for (index, doc) in read_documents(path)?.into_iter().enumerate() {
        let imported = meshgate_core::kyverno::import(&doc)
            .map_err(|e| anyhow::anyhow!("{file}: document {index}: {e}"))?;
        let at = |n: String| format!("{file}: document {index}: {n}");
        report.partial.extend(imported.notes.into_iter().map(at));
        report.notes.extend(imported.ignored.into_iter().map(at));
        for (name, spec) in imported.policies {
            let p = MutationPolicy::new(&name, spec);
            out.push(serde_json::to_value(p)?);
        }
    }
    Ok((to_yaml_stream(&out)?, report))
}

/// MutatingAdmissionPolicies by name.
type AdmissionPolicies = Vec<(String, Value)>;

/// The MutationPolicies read (by name), what was reported, and the MutatingAdmissionPolicies.
type Loaded = (Vec<(String, MutationPolicySpec)>, Report, AdmissionPolicies);

/// The policy files' MutationPolicies after `builtin`, and their MutatingAdmissionPolicies.
fn load_policies(policy_files: &[std::path::PathBuf], builtin: Policies) -> anyhow::Result<Loaded> {
    let (mut policies, mut report) = builtin;
    let mut admission_policies: Vec<(String, Value)> = Vec::new();
    for p in policy_files {
        let (ps, r) = read_policies(p)?;
        policies.extend(ps);
        report.extend(r);
        for doc in read_documents(p)? {
            if meshgate_core::policy::admission::is_admission_policy(&doc) {
                let name = doc
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                report.origins.insert(name.clone(), p.display().to_string());
                admission_policies.push((name, doc));
            }
        }
    }
    Ok((policies, report, admission_policies))
}

/// Namespaces by name, and their LimitRanges' container limits.
type Namespaces = (
    BTreeMap<String, Meta>,
    BTreeMap<String, Vec<ContainerLimits>>,
);

/// The namespaces (with `ns_labels` added) and the LimitRanges named anywhere in the input.
fn namespaces_and_limits(
    inputs: &[(&std::path::PathBuf, Vec<Value>)],
    ns_labels: &BTreeMap<String, BTreeMap<String, String>>,
) -> Namespaces {
    let mut namespaces: BTreeMap<String, Meta> = BTreeMap::new();
    let mut limits: BTreeMap<String, Vec<ContainerLimits>> = BTreeMap::new();
    for doc in inputs.iter().flat_map(|(_, docs)| docs) {
        let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
        let name = doc.pointer("/metadata/name").and_then(Value::as_str);
        match (kind, name) {
            ("Namespace", Some(name)) => {
                namespaces.insert(name.to_owned(), Meta::of(doc));
            }
            ("LimitRange", _) => {
                if let Ok(lr) =
                    serde_json::from_value::<k8s_openapi::api::core::v1::LimitRange>(doc.clone())
                {
                    let ns = lr
                        .metadata
                        .namespace
                        .clone()
                        .unwrap_or_else(|| "default".into());
                    limits
                        .entry(ns)
                        .or_default()
                        .extend(ContainerLimits::of(&lr));
                }
            }
            _ => {}
        }
    }
    for (ns, labels) in ns_labels {
        namespaces
            .entry(ns.clone())
            .or_default()
            .labels
            .extend(labels.clone());
    }
    (namespaces, limits)
}

/// MutatingAdmissionPolicies over `docs` (the API server runs them before mutating webhooks);
/// a policy skipped by its `failurePolicy: Ignore` is reported.
fn apply_admission_policies(
    m: &std::path::Path,
    docs: &mut [Value],
    admission_policies: &[(String, Value)],
    namespaces: &BTreeMap<String, Meta>,
    report: &mut Report,
) -> anyhow::Result<()> {
    if admission_policies.is_empty() {
        return Ok(());
    }

    for (index, doc) in docs.iter_mut().enumerate() {
        if !doc.is_object() {
            continue;
        }
        let (namespace, labels) = meshgate_core::policy::document_namespace(doc, &|ns| {
            namespaces
                .get(ns)
                .map(|m| m.labels.clone())
                .unwrap_or_default()
        });
        let request = meshgate_core::policy::admission::AdmissionRequest {
            operation: "CREATE",
            namespace: &namespace,
            namespace_labels: &labels,
        };
        let admitted = meshgate_core::policy::admission::apply(admission_policies, doc, &request)
            .map_err(|e| anyhow::anyhow!("{}: document {index}: {e}", m.display()))?;
        for e in &admitted.ignored {
            report.partial.push(format!(
                "{}: document {index}: {e} (skipped: failurePolicy Ignore)",
                m.display()
            ));
        }
        *doc = admitted.object;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_documents_are_named() {
        let err = parse_documents("m.yaml", "a: 1\n---\n: : :\n").unwrap_err();
        assert!(err.to_string().starts_with("m.yaml: document 1: "), "{err}");
    }

    #[test]
    fn bad_policy_fields_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.yaml");
        std::fs::write(
            &p,
            "apiVersion: meshgate.dev/v1alpha1\nkind: MutationPolicy\nmetadata: {name: x}\nspec:\n  match: {kinds: [Pod]}\n  mutations:\n  - annotations: {values: {a: 1}, onConflict: Sometimes}\n",
        )
        .unwrap();
        let err = read_policies(&p).unwrap_err().to_string();
        assert!(err.contains("p.yaml: document 0: "), "{err}");
        assert!(
            err.contains("onConflict") || err.contains("Sometimes"),
            "{err}"
        );
    }
}

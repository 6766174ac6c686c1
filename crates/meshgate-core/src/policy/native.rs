//! Native mode: a `MutationPolicy` compiled to a `MutatingAdmissionPolicy` (and its binding)
//! that the API server evaluates itself, with no call to meshgate's webhook.
//!
//! # What compiles ([`compile`])
//! A policy compiles when every mutation is one the API server applies exactly as the webhook
//! does, and cannot fail part-way:
//! * `labels` and `annotations` (both `onConflict` modes);
//! * a `strategicMerge` that sets only `metadata.labels` and `metadata.annotations` to strings,
//!   each key plain (overwrite) or with an add anchor `+(key)` (keep). This is the shape
//!   `meshgate import kyverno` gives the common Kyverno rules (the mesh's
//!   `traffic.sidecar.istio.io/...` annotations, for example).
//!
//! Everything else stays on the webhook, and [`NotNative`] says why:
//! * a `warning`: a MutatingAdmissionPolicy cannot return admission warnings;
//! * a `jsonPatch`: the API server keeps the mutations of a MutatingAdmissionPolicy that come
//!   before one that fails, and a JSON patch can fail (a `test`, a missing path); the webhook
//!   applies a policy whole or not at all. A failing policy must not half-apply;
//! * any other `strategicMerge` (lists, conditions, deletes): the API server's `ApplyConfiguration`
//!   is a server-side-apply merge, whose list semantics, anchors and atomic fields differ from
//!   the webhook's strategic merge;
//! * a name so long that `meshgate-policy-<name>` is no object name.
//!
//! # The compiled policy
//! Matching is the webhook's, written in CEL `matchConditions` over the admission request
//! (see `policy::matching`): `match` and `exclude` blocks (kinds with their wildcards,
//! operations, namespaces with wildcards, object selectors, with the same rules for
//! cluster-scoped objects and Namespaces), the opt-out (`meshgate.dev/inject: "false"` on the
//! object, and on a workload's pod template), and the namespaces the webhook never touches.
//! Match conditions cannot read a namespace's labels (the API server gives them no
//! `namespaceObject`), so `match.namespaceSelector` becomes the policy's
//! `matchConstraints.namespaceSelector` (with a condition that the object is namespaced or a
//! Namespace, as the webhook requires), and a policy with `exclude.namespaceSelector` stays on
//! the webhook.
//! `matchConstraints.resourceRules` name the resources of the policy's kinds (Pods and the
//! workloads from their names, other kinds as discovery resolved them); the CEL conditions make
//! the final decision, so rules wider than the kinds change nothing. Each write is one
//! `ApplyConfiguration` mutation on the object's or the pod template's metadata (with
//! `target: Object`, always the object's own: a workload's metadata, not its template's; a
//! patch of its `spec.template` stays on the webhook as any strategic merge beyond metadata
//! does). Failure policy
//! `Ignore` (policies are conveniences, as on the webhook), reinvocation `IfNeeded` (as the
//! webhook).
//!
//! The API server runs MutatingAdmissionPolicies before mutating webhooks, so the webhook, which
//! still applies every policy, finds a compiled policy's writes done and changes nothing.

use std::collections::BTreeMap;

use meshgate_api::mutation_policy::{
    MatchResources, Mutation, MutationPolicySpec, MutationTarget, OnConflict,
};
use meshgate_api::names;
use serde_json::{Value, json};

use super::matching::{SUPPORTED_KINDS, WORKLOAD_KINDS, parse_kind, pod_template_path};
use crate::object::cel::{PolicyApi, cel_list, cel_string, has_value, opted_out, selector_cel};

/// A resource a policy names, resolved (by discovery) for the policies webhook's rules. `*`
/// in a field matches everything (a wildcard kind).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PolicyResource {
    pub group: String,
    pub version: String,
    /// The plural resource name (`services`), or `*`.
    pub resource: String,
}

/// The prefix of the objects a compiled policy becomes.
pub const NAME_PREFIX: &str = "meshgate-policy-";
/// The label naming the MutationPolicy a compiled MutatingAdmissionPolicy comes from.
pub const POLICY_LABEL: &str = "meshgate.dev/mutation-policy";

/// Why a policy stays on the webhook.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotNative(pub String);

/// A compiled policy: the `MutatingAdmissionPolicy` and its binding.
#[derive(Clone, Debug, PartialEq)]
pub struct NativePolicy {
    pub policy: Value,
    pub binding: Value,
}

/// What [`compile`] needs besides the policy.
#[derive(Clone, Debug)]
pub struct NativeInput<'a> {
    /// The MutationPolicy's name.
    pub name: &'a str,
    pub spec: &'a MutationPolicySpec,
    /// Discovery's resolution of the policy's `kinds` entries other than Pods and the workloads
    /// (`registration::policy_kind_entries`).
    pub resources: &'a [PolicyResource],
    /// Namespaces in which nothing is ever mutated (the webhook's).
    pub excluded_namespaces: &'a [String],
    pub api: PolicyApi,
    /// Set as the objects' `ownerReferences` (the MutationPolicy), so that they go with it.
    pub owner: Option<Value>,
}

/// The name of the MutatingAdmissionPolicy and binding compiled from policy `name`.
pub fn native_name(name: &str) -> String {
    format!("{NAME_PREFIX}{name}")
}

/// One metadata write of a policy.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Write {
    /// Set every key of `field` (`labels` or `annotations`).
    Overwrite {
        field: &'static str,
        values: BTreeMap<String, String>,
    },
    /// Set `key` of `field` unless it is present.
    Keep {
        field: &'static str,
        key: String,
        value: String,
    },
}

/// The writes of a policy's mutations, in order, or why they do not compile.
fn writes(spec: &MutationPolicySpec) -> Result<Vec<Write>, NotNative> {
    if spec.warning.as_deref().is_some_and(|w| !w.is_empty()) {
        return Err(NotNative(
            "spec.warning: a MutatingAdmissionPolicy cannot return admission warnings".into(),
        ));
    }
    for (at, block) in [
        ("match", Some(&spec.match_)),
        ("exclude", spec.exclude.as_ref()),
    ] {
        if let Some(b) = block
            && (!b.names.is_empty() || !b.annotations.is_empty())
        {
            let field = if b.names.is_empty() {
                "annotations"
            } else {
                "names"
            };
            return Err(NotNative(format!(
                "spec.{at}.{field}: matching by names and annotations (Kyverno's wildcards) is done by the webhook"
            )));
        }
    }
    let mut out = Vec::new();
    for (i, m) in spec.mutations.iter().enumerate() {
        if m.preconditions.is_some()
            || m.foreach.is_some()
            || !m.mutations.is_empty()
            || !m.context.is_empty()
            || super::mutation_has_variables(m)
        {
            return Err(NotNative(format!(
                "spec.mutations[{i}]: variables, context, preconditions and foreach are evaluated by the webhook (JMESPath, Kyverno's semantics)"
            )));
        }
        match m {
            Mutation {
                labels: Some(meta),
                annotations: None,
                strategic_merge: None,
                json_patch: None,
                json_patch_options: None,
                ..
            }
            | Mutation {
                annotations: Some(meta),
                labels: None,
                strategic_merge: None,
                json_patch: None,
                json_patch_options: None,
                ..
            } => {
                let field = if m.labels.is_some() {
                    "labels"
                } else {
                    "annotations"
                };
                match meta.on_conflict {
                    OnConflict::Overwrite => {
                        if !meta.values.is_empty() {
                            out.push(Write::Overwrite {
                                field,
                                values: meta.values.clone(),
                            });
                        }
                    }
                    OnConflict::Keep => out.extend(meta.values.iter().map(|(k, v)| Write::Keep {
                        field,
                        key: k.clone(),
                        value: v.clone(),
                    })),
                }
            }
            Mutation {
                strategic_merge: Some(patch),
                labels: None,
                annotations: None,
                json_patch: None,
                json_patch_options: None,
                ..
            } => out.extend(metadata_merge(patch).map_err(|why| {
                NotNative(format!(
                    "spec.mutations[{i}].strategicMerge{why}: only string metadata.labels and metadata.annotations (plain keys or +(key)) compile to a MutatingAdmissionPolicy; the rest of a strategic merge (lists, conditions, deletes) differs from the API server's apply merge"
                ))
            })?),
            Mutation {
                json_patch: Some(_),
                ..
            } => {
                return Err(NotNative(format!(
                    "spec.mutations[{i}].jsonPatch: the API server keeps a MutatingAdmissionPolicy's mutations before one that fails, and a JSON patch can fail; the webhook applies a policy whole or not at all"
                )));
            }
            _ => {
                return Err(NotNative(format!(
                    "spec.mutations[{i}]: set exactly one of annotations, labels, strategicMerge, jsonPatch"
                )));
            }
        }
    }
    Ok(out)
}

/// The writes of a strategic merge that sets metadata labels and annotations only; else the
/// path (relative to the patch) of the first thing that is more.
fn metadata_merge(patch: &Value) -> Result<Vec<Write>, String> {
    let root = patch.as_object().ok_or_else(String::new)?;
    let mut out = Vec::new();
    for (key, value) in root {
        if key != "metadata" {
            return Err(format!(".{key}"));
        }
        let meta = value.as_object().ok_or(".metadata")?;
        for (field, values) in meta {
            let field: &'static str = match field.as_str() {
                "labels" => "labels",
                "annotations" => "annotations",
                other => return Err(format!(".metadata.{other}")),
            };
            let values = values
                .as_object()
                .ok_or_else(|| format!(".metadata.{field}"))?;
            let mut plain = BTreeMap::new();
            let mut keep = Vec::new();
            for (k, v) in values {
                let v = v.as_str().ok_or_else(|| format!(".metadata.{field}.{k}"))?;
                if let Some(inner) = k.strip_prefix("+(").and_then(|k| k.strip_suffix(')')) {
                    keep.push(Write::Keep {
                        field,
                        key: inner.to_owned(),
                        value: v.to_owned(),
                    });
                } else if k.starts_with('$')
                    || (["(", "<(", "=(", "X(", "^("]
                        .iter()
                        .any(|a| k.starts_with(a))
                        && k.ends_with(')'))
                {
                    return Err(format!(".metadata.{field}.{k}"));
                } else {
                    plain.insert(k.clone(), v.to_owned());
                }
            }
            // The strategic merge evaluates add anchors against the object before the patch,
            // then writes the plain keys: the keeps first gives the same result.
            out.extend(keep);
            if !plain.is_empty() {
                out.push(Write::Overwrite {
                    field,
                    values: plain,
                });
            }
        }
    }
    Ok(out)
}

/// Whether a policy compiles, and if not, why (the policy's writes only; see [`compile`]).
pub fn expressible(spec: &MutationPolicySpec) -> Result<(), NotNative> {
    writes(spec).map(|_| ())
}

/// The MutatingAdmissionPolicy and binding for a policy, or why it stays on the webhook.
pub fn compile(input: &NativeInput<'_>) -> Result<NativePolicy, NotNative> {
    let spec = input.spec;
    let writes = writes(spec)?;
    let name = native_name(input.name);
    if name.len() > 253 {
        return Err(NotNative(format!(
            "metadata.name: {name:?} (the compiled policy's name) is longer than 253 characters"
        )));
    }
    if spec
        .exclude
        .as_ref()
        .is_some_and(|e| e.namespace_selector.is_some())
    {
        return Err(NotNative(
            "spec.exclude.namespaceSelector: a MutatingAdmissionPolicy's match conditions cannot read a namespace's labels, and its namespaceSelector only selects".into(),
        ));
    }
    let pod_templates = spec.pod_templates && spec.target == MutationTarget::Pod;
    let mut kinds = kinds_cel(&spec.match_.kinds, pod_templates, true);
    if spec.target == MutationTarget::Object {
        // Every matched object is written as itself (`matching::policy_target`).
        kinds.pod_shaped = None;
    }
    let mut conditions = vec![json!({
        "name": "not-opted-out",
        "expression": format!(
            "!{} && !{}",
            opted_out("object.metadata"),
            template_opted_out_cel()
        ),
    })];
    if !input.excluded_namespaces.is_empty() {
        conditions.push(json!({
            "name": "namespace-not-excluded",
            "expression": format!("{NS_NAME} == \"\" || !({NS_NAME} in {})", cel_list(input.excluded_namespaces)),
        }));
    }
    conditions.push(json!({"name": "match", "expression": block_cel(&spec.match_, &kinds, false)}));
    if let Some(exclude) = &spec.exclude {
        let kinds = if exclude.kinds.is_empty() {
            Kinds {
                pod_shaped: None,
                any: "true".into(),
            }
        } else {
            kinds_cel(&exclude.kinds, pod_templates, false)
        };
        conditions.push(json!({"name": "not-excluded", "expression": format!("!({})", block_cel(exclude, &kinds, true))}));
    }
    let mutations: Vec<Value> = writes
        .iter()
        .map(|w| {
            let expression = match &kinds.pod_shaped {
                None => write_cel(w, &[]),
                Some(pod_shaped) => format!(
                    "({pod_shaped}) ? ({} ? {} : {} ? {} : {}) : {}",
                    kind_is("", "Pod"),
                    write_cel(w, &[]),
                    kind_is("batch", "CronJob"),
                    write_cel(w, &["spec", "jobTemplate", "spec", "template"]),
                    write_cel(w, &["spec", "template"]),
                    write_cel(w, &[]),
                ),
            };
            json!({"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": expression}})
        })
        .collect();
    let operations = operations(&spec.match_);
    let rules = resource_rules(spec, input.resources, &operations);
    let labels = json!({names::MANAGED_BY: "meshgate", POLICY_LABEL: input.name});
    let mut metadata = json!({"name": name, "labels": labels});
    if let Some(owner) = &input.owner {
        metadata["ownerReferences"] = json!([owner]);
    }
    let mut constraints = json!({"resourceRules": rules, "matchPolicy": "Equivalent"});
    if let Some(selector) = &spec.match_.namespace_selector {
        constraints["namespaceSelector"] = serde_json::to_value(selector).unwrap_or(Value::Null);
    }
    let policy = json!({
        "apiVersion": input.api.api_version(),
        "kind": "MutatingAdmissionPolicy",
        "metadata": metadata,
        "spec": {
            "matchConstraints": constraints,
            "matchConditions": conditions,
            "failurePolicy": "Ignore",
            "reinvocationPolicy": "IfNeeded",
            "mutations": mutations,
        },
    });
    let binding = json!({
        "apiVersion": input.api.api_version(),
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": metadata,
        "spec": {"policyName": name, "matchResources": {}},
    });
    Ok(NativePolicy { policy, binding })
}

/// The request's namespace as the webhook sees it: a Namespace is its own.
const NS_NAME: &str = "(request.kind.group == \"\" && request.kind.kind == \"Namespace\" ? object.metadata.name : request.namespace)";
/// The request is for a Namespace.
const IS_NAMESPACE: &str = "(request.kind.group == \"\" && request.kind.kind == \"Namespace\")";

fn operations(block: &MatchResources) -> Vec<&'static str> {
    let mut ops: Vec<&'static str> = block
        .operations
        .iter()
        .map(|o| match o {
            meshgate_api::mutation_policy::Operation::Create => "CREATE",
            meshgate_api::mutation_policy::Operation::Update => "UPDATE",
        })
        .collect();
    if ops.is_empty() {
        ops.push("CREATE");
    }
    ops.sort_unstable();
    ops.dedup();
    ops
}

/// The resource rules: Pods and workloads the kinds name (and, with `podTemplates`, the
/// workloads of a Pod policy), and the resolved other resources.
fn resource_rules(
    spec: &MutationPolicySpec,
    resolved: &[PolicyResource],
    operations: &[&str],
) -> Vec<Value> {
    let mut wanted: Vec<PolicyResource> = resolved.to_vec();
    let kinds: Vec<&str> = if spec.match_.kinds.is_empty() {
        vec!["Pod"]
    } else {
        spec.match_.kinds.iter().map(String::as_str).collect()
    };
    let mut names_pod = false;
    for entry in kinds {
        let Ok((group, _, kind)) = parse_kind(entry) else {
            continue;
        };
        if kind == "Pod" && group.is_none_or(str::is_empty) {
            names_pod = true;
        }
        if let Some(r) = pod_resource(kind) {
            wanted.push(r);
        }
    }
    if spec.pod_templates && spec.target == MutationTarget::Pod && names_pod {
        wanted.extend(WORKLOAD_KINDS.iter().filter_map(|k| pod_resource(k)));
    }
    wanted.sort();
    wanted.dedup();
    let mut grouped: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for r in wanted {
        grouped
            .entry((r.group, r.version))
            .or_default()
            .push(r.resource);
    }
    grouped
        .into_iter()
        .map(|((group, version), resources)| {
            json!({"apiGroups": [group], "apiVersions": [version], "operations": operations,
                   "resources": resources, "scope": "*"})
        })
        .collect()
}

fn pod_resource(kind: &str) -> Option<PolicyResource> {
    let (group, resource) = match kind {
        "Pod" => ("", "pods"),
        "Deployment" => ("apps", "deployments"),
        "StatefulSet" => ("apps", "statefulsets"),
        "DaemonSet" => ("apps", "daemonsets"),
        "ReplicaSet" => ("apps", "replicasets"),
        "Job" => ("batch", "jobs"),
        "CronJob" => ("batch", "cronjobs"),
        _ => return None,
    };
    Some(PolicyResource {
        group: group.into(),
        version: "v1".into(),
        resource: resource.into(),
    })
}

/// A kinds list in CEL: which requests it selects (`any`) and, of those, which as Pod-shaped
/// (`None`: none can be), following `matching::kind_selected`.
struct Kinds {
    pod_shaped: Option<String>,
    any: String,
}

fn api_group(kind: &str) -> &'static str {
    match kind {
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" => "apps",
        "Job" | "CronJob" => "batch",
        _ => "",
    }
}

fn kind_is(group: &str, kind: &str) -> String {
    format!(
        "(request.kind.group == {} && request.kind.kind == {})",
        cel_string(group),
        cel_string(kind)
    )
}

fn workload_cel() -> String {
    let terms: Vec<String> = WORKLOAD_KINDS
        .iter()
        .map(|k| kind_is(api_group(k), k))
        .collect();
    format!("({})", terms.join(" || "))
}

fn kinds_cel(kinds: &[String], pod_templates: bool, empty_means_pod: bool) -> Kinds {
    if kinds.is_empty() {
        if !empty_means_pod {
            return Kinds {
                pod_shaped: None,
                any: "false".into(),
            };
        }
        let mut pod = kind_is("", "Pod");
        if pod_templates {
            pod = format!("({pod} || {})", workload_cel());
        }
        return Kinds {
            pod_shaped: Some(pod.clone()),
            any: pod,
        };
    }
    let mut pod_terms = Vec::new();
    let mut itself_terms = Vec::new();
    let mut names_pod = false;
    for entry in kinds {
        let Ok((group, version, kind)) = parse_kind(entry) else {
            continue;
        };
        if kind == "Pod" && group.is_none_or(str::is_empty) {
            names_pod = true;
        }
        let mut fits = vec![pattern_cel("request.kind.kind", kind)];
        if let Some(g) = group {
            fits.push(pattern_cel("request.kind.group", g));
        }
        if let Some(v) = version {
            fits.push(pattern_cel("request.kind.version", v));
        }
        let exact = !kind.contains(['*', '?']);
        if exact && SUPPORTED_KINDS.contains(&kind) {
            fits.push(format!(
                "request.kind.group == {}",
                cel_string(api_group(kind))
            ));
            pod_terms.push(format!("({})", fits.join(" && ")));
        } else {
            itself_terms.push(format!("({})", fits.join(" && ")));
        }
    }
    let itself = or(&itself_terms);
    if pod_templates && names_pod {
        pod_terms.push(format!("(!{itself} && {})", workload_cel()));
    }
    let pod_shaped = (!pod_terms.is_empty()).then(|| or(&pod_terms));
    let any = match &pod_shaped {
        Some(p) => format!("({p} || {itself})"),
        None => itself,
    };
    Kinds { pod_shaped, any }
}

/// A workload whose pod template opts out (`matching::template_opted_out`).
fn template_opted_out_cel() -> String {
    let terms: Vec<String> = WORKLOAD_KINDS
        .iter()
        .filter_map(|k| {
            let path = pod_template_path(k).filter(|p| !p.is_empty())?;
            let mut guards = vec![kind_is(api_group(k), k)];
            let mut at = String::from("object");
            for segment in path.iter().copied().chain(["metadata"]) {
                guards.push(format!("has({at}.{segment})"));
                at = format!("{at}.{segment}");
            }
            guards.push(opted_out(&at));
            Some(format!("({})", guards.join(" && ")))
        })
        .collect();
    or(&terms)
}

fn or(terms: &[String]) -> String {
    if terms.is_empty() {
        "false".into()
    } else {
        format!("({})", terms.join(" || "))
    }
}

/// A `match` or `exclude` block in CEL (`matching::block_matches`).
fn block_cel(block: &MatchResources, kinds: &Kinds, exclude: bool) -> String {
    let mut terms = vec![kinds.any.clone()];
    if !block.operations.is_empty() || !exclude {
        terms.push(format!(
            "request.operation in {}",
            cel_list(&operations(block))
        ));
    }
    if !block.namespaces.is_empty() {
        let names: Vec<String> = block
            .namespaces
            .iter()
            .map(|n| pattern_cel(NS_NAME, n))
            .collect();
        terms.push(format!("({NS_NAME} != \"\" && {})", or(&names)));
    }
    if block.namespace_selector.is_some() {
        // The selector itself is the policy's `matchConstraints.namespaceSelector` (match
        // conditions cannot read the namespace's labels); the API server ignores it for
        // cluster-scoped objects, which match no namespace selector here. A Namespace is its
        // own namespace.
        terms.push(format!("(request.namespace != \"\" || {IS_NAMESPACE})"));
    }
    if let Some(selector) = &block.object_selector {
        terms.push(selector_cel("object.metadata", selector));
    }
    terms.join(" && ")
}

/// `text` matches the wildcard `pattern` (`*`, `?`).
fn pattern_cel(text: &str, pattern: &str) -> String {
    if !pattern.contains(['*', '?']) {
        return format!("{text} == {}", cel_string(pattern));
    }
    let mut re = String::from("(?s)^");
    for ch in pattern.chars() {
        match ch {
            '*' => re.push_str(".*"),
            '?' => re.push('.'),
            c if "\\.+()|[]{}^$".contains(c) => {
                re.push('\\');
                re.push(c);
            }
            c => re.push(c),
        }
    }
    re.push('$');
    format!("{text}.matches({})", cel_string(&re))
}

/// One write as an ApplyConfiguration expression on the object at `path` (empty: the object).
fn write_cel(write: &Write, path: &[&str]) -> String {
    let target = std::iter::once("object")
        .chain(path.iter().copied())
        .collect::<Vec<_>>()
        .join(".");
    let mut guards = Vec::new();
    // The template exists and is not opted out (the object's own opt-out is a match condition).
    for depth in 1..=path.len() {
        let prefix = std::iter::once("object")
            .chain(path[..depth - 1].iter().copied())
            .collect::<Vec<_>>()
            .join(".");
        guards.push(format!("has({prefix}.{})", path[depth - 1]));
    }
    if !path.is_empty() {
        guards.push(format!(
            "!(has({target}.metadata) && {})",
            opted_out(&format!("{target}.metadata"))
        ));
    }
    let (field, values) = match write {
        Write::Overwrite { field, values } => (*field, values.clone()),
        Write::Keep { field, key, value } => {
            guards.push(format!(
                "!(has({target}.metadata) && {})",
                has_value(&format!("{target}.metadata"), field, key)
            ));
            (*field, BTreeMap::from([(key.clone(), value.clone())]))
        }
    };
    let map: Vec<String> = values
        .iter()
        .map(|(k, v)| format!("{}: {}", cel_string(k), cel_string(v)))
        .collect();
    // Object{spec: Object.spec{template: Object.spec.template{metadata: ...{labels: {...}}}}}
    let mut fields: Vec<&str> = path.to_vec();
    fields.push("metadata");
    let mut inner = format!("{{{field}: {{{}}}}}", map.join(", "));
    for depth in (0..fields.len()).rev() {
        let type_name = std::iter::once("Object")
            .chain(fields[..=depth].iter().copied())
            .collect::<Vec<_>>()
            .join(".");
        inner = format!("{type_name}{inner}");
        if depth > 0 {
            inner = format!("{{{}: {inner}}}", fields[depth]);
        }
    }
    let patch = format!("Object{{{}: {inner}}}", fields[0]);
    if guards.is_empty() {
        patch
    } else {
        format!("(({}) ? {patch} : Object{{}})", guards.join(" && "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: Value) -> MutationPolicySpec {
        serde_json::from_value(v).expect("spec")
    }

    fn compiled(v: Value) -> Result<NativePolicy, NotNative> {
        let s = spec(v);
        compile(&NativeInput {
            name: "p",
            spec: &s,
            resources: &[],
            excluded_namespaces: &["kube-system".to_owned()],
            api: PolicyApi::V1,
            owner: None,
        })
    }

    #[test]
    fn metadata_writes_compile_and_everything_else_says_why() {
        let ok = [
            json!({"match": {}, "mutations": [{"labels": {"values": {"a": "b"}}}]}),
            json!({"match": {}, "mutations": [{"annotations": {"values": {"a": "b"}, "onConflict": "Keep"}}]}),
            json!({"match": {}, "mutations": [{"strategicMerge": {"metadata": {"annotations": {"+(a)": "b", "c": "d"}}}}]}),
        ];
        for s in ok {
            assert_eq!(expressible(&spec(s.clone())), Ok(()), "{s}");
        }
        let not = [
            (
                json!({"match": {}, "warning": "w", "mutations": [{"labels": {"values": {"a": "b"}}}]}),
                "spec.warning",
            ),
            (
                json!({"match": {}, "mutations": [{"jsonPatch": [{"op": "add", "path": "/metadata/labels/a", "value": "b"}]}]}),
                "spec.mutations[0].jsonPatch",
            ),
            (
                json!({"match": {}, "mutations": [{"labels": {"values": {"a": "b"}}}, {"strategicMerge": {"spec": {"hostNetwork": false}}}]}),
                "spec.mutations[1].strategicMerge.spec",
            ),
            (
                json!({"match": {}, "mutations": [{"strategicMerge": {"metadata": {"labels": {"(a)": "b"}}}}]}),
                "strategicMerge.metadata.labels.(a)",
            ),
            (
                json!({"match": {}, "mutations": [{"strategicMerge": {"metadata": {"labels": {"a": 1}}}}]}),
                "strategicMerge.metadata.labels.a",
            ),
            (
                json!({"match": {}, "mutations": [{"strategicMerge": {"metadata": {"finalizers": ["x"]}}}]}),
                "strategicMerge.metadata.finalizers",
            ),
        ];
        for (s, why) in not {
            let err = expressible(&spec(s.clone())).expect_err("not expressible");
            assert!(err.0.contains(why), "{s}: {err}");
        }
        let err = compiled(
            json!({"match": {}, "exclude": {"namespaceSelector": {"matchLabels": {"a": "b"}}},
            "mutations": [{"labels": {"values": {"a": "b"}}}]}),
        )
        .expect_err("exclude by namespace labels");
        assert!(err.0.contains("spec.exclude.namespaceSelector"), "{err}");
    }

    #[test]
    fn the_policy_matches_the_kinds_and_writes_each_value_once() {
        let c = compiled(json!({
            "match": {"kinds": ["Pod"], "operations": ["CREATE", "UPDATE"],
                      "namespaceSelector": {"matchLabels": {"mesh": "on"}}},
            "podTemplates": true,
            "mutations": [
                {"annotations": {"values": {"x": "1", "y": "2"}}},
                {"labels": {"values": {"k": "v"}, "onConflict": "Keep"}},
            ],
        }))
        .expect("compiles");
        let spec = &c.policy["spec"];
        let rules = spec["matchConstraints"]["resourceRules"]
            .as_array()
            .unwrap();
        let resources: Vec<String> = rules
            .iter()
            .flat_map(|r| {
                let g = r["apiGroups"][0].as_str().unwrap().to_owned();
                r["resources"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(move |x| format!("{g}/{}", x.as_str().unwrap()))
            })
            .collect();
        assert_eq!(
            resources,
            [
                "/pods",
                "apps/daemonsets",
                "apps/deployments",
                "apps/replicasets",
                "apps/statefulsets",
                "batch/cronjobs",
                "batch/jobs"
            ]
        );
        assert_eq!(rules[0]["operations"], json!(["CREATE", "UPDATE"]));
        assert_eq!(
            spec["matchConstraints"]["namespaceSelector"],
            json!({"matchLabels": {"mesh": "on"}})
        );
        assert_eq!(spec["failurePolicy"], "Ignore");
        // One mutation per overwrite, one per kept key; each writes under the template of a
        // workload and under the object of a Pod.
        let mutations = spec["mutations"].as_array().unwrap();
        assert_eq!(mutations.len(), 2);
        let first = mutations[0]["applyConfiguration"]["expression"]
            .as_str()
            .unwrap();
        assert!(
            first.contains(
                r#"Object{metadata: Object.metadata{annotations: {"x": "1", "y": "2"}}}"#
            ),
            "{first}"
        );
        assert!(
            first.contains("Object.spec.jobTemplate.spec.template.metadata{annotations:"),
            "{first}"
        );
        let keep = mutations[1]["applyConfiguration"]["expression"]
            .as_str()
            .unwrap();
        assert!(keep.contains(r#""k" in object.metadata.labels"#), "{keep}");
        let conditions: Vec<&str> = spec["matchConditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            conditions,
            ["not-opted-out", "namespace-not-excluded", "match"]
        );
        assert_eq!(c.binding["spec"]["policyName"], "meshgate-policy-p");
    }

    #[test]
    fn an_object_target_writes_the_workload_metadata_and_its_template_patch_stays() {
        let c = compiled(json!({
            "match": {"kinds": ["Deployment", "CronJob"]},
            "target": "Object",
            "mutations": [{"annotations": {"values": {"owner": "platform"}}}],
        }))
        .expect("compiles");
        let expression = c.policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
            .as_str()
            .unwrap();
        assert_eq!(
            expression,
            r#"Object{metadata: Object.metadata{annotations: {"owner": "platform"}}}"#
        );
        // The same policy with the default target writes the templates.
        let pod_shaped = compiled(json!({
            "match": {"kinds": ["Deployment", "CronJob"]},
            "mutations": [{"annotations": {"values": {"owner": "platform"}}}],
        }))
        .expect("compiles");
        let expression =
            pod_shaped.policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
                .as_str()
                .unwrap();
        assert!(
            expression.contains("Object.spec.template.metadata{annotations:"),
            "{expression}"
        );
        // A workload whose template opts out is not matched, whatever the target.
        let not_opted_out = c.policy["spec"]["matchConditions"][0]["expression"]
            .as_str()
            .unwrap();
        assert!(
            not_opted_out.contains("has(object.spec.jobTemplate.spec.template.metadata)"),
            "{not_opted_out}"
        );
        let err = expressible(&spec(json!({
            "match": {"kinds": ["Deployment"]},
            "target": "Object",
            "mutations": [{"strategicMerge": {"spec": {"template": {"spec": {"volumes": [{"name": "v", "emptyDir": {}}]}}}}}],
        })))
        .expect_err("a template patch");
        assert!(
            err.0.contains("spec.mutations[0].strategicMerge.spec"),
            "{err}"
        );
    }

    #[test]
    fn cel_strings_and_patterns_are_escaped() {
        assert_eq!(cel_string("a\"b\\c\nd"), r#""a\"b\\c\nd""#);
        assert_eq!(
            pattern_cel("x", "kube-*.a?"),
            r#"x.matches("(?s)^kube-.*\\.a.$")"#
        );
        assert_eq!(pattern_cel("x", "plain"), r#"x == "plain""#);
    }
}

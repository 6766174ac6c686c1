//! Which objects a `MutationPolicy` applies to, and where its mutations land.

use std::collections::BTreeMap;

use meshgate_api::mutation_policy::{
    MatchResources, MutationPolicySpec, MutationTarget, Operation,
};
use meshgate_api::names;
use serde_json::Value;

use super::pattern::wildcard_match;
pub use crate::object::pod_template_path;

/// Workload kinds whose pod template a policy can mutate, in Kyverno's autogen set (minus
/// ReplicationController).
pub const WORKLOAD_KINDS: [&str; 6] = [
    "Deployment",
    "StatefulSet",
    "DaemonSet",
    "ReplicaSet",
    "Job",
    "CronJob",
];

/// The kinds whose pod (template) a policy mutates when it names them: Pod and the workloads.
/// Any other kind (`Service`, `v1/ConfigMap`, `example.com/v1/Widget`, `*`) is mutated as the
/// object itself.
pub const SUPPORTED_KINDS: [&str; 7] = [
    "Pod",
    "Deployment",
    "StatefulSet",
    "DaemonSet",
    "ReplicaSet",
    "Job",
    "CronJob",
];

/// Kinds of Kubernetes' own API that are cluster-scoped (for offline rendering, where no
/// discovery tells the scope): their objects have no namespace.
pub const CLUSTER_SCOPED_KINDS: [&str; 16] = [
    "Namespace",
    "Node",
    "PersistentVolume",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "StorageClass",
    "PriorityClass",
    "RuntimeClass",
    "IngressClass",
    "CSIDriver",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "MutatingAdmissionPolicy",
    "ValidatingAdmissionPolicy",
    "APIService",
];

/// The API group of a supported kind (`""` is the core group).
fn api_group(kind: &str) -> &'static str {
    match kind {
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" => "apps",
        "Job" | "CronJob" => "batch",
        _ => "",
    }
}

/// The request a policy is matched against.
#[derive(Clone, Copy, Debug)]
pub struct MatchContext<'a> {
    /// The admission operation.
    pub operation: Operation,
    /// The object's namespace (the request's namespace: a Pod being created may not carry one).
    pub namespace: &'a str,
    /// The labels of that namespace.
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// Where `configMap` context entries are read.
    pub cluster: &'a dyn super::context::ClusterData,
}

/// An object's own `metadata.labels` (non-string values ignored).
pub fn object_labels(object: &Value) -> BTreeMap<String, String> {
    object
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// An object's type: its `apiVersion` split into group and version, and its `kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectType<'a> {
    pub group: &'a str,
    pub version: &'a str,
    pub kind: &'a str,
}

impl<'a> ObjectType<'a> {
    /// The type of `object` (`kind` required; a missing `apiVersion` leaves group and version
    /// empty, and then only the kind is compared).
    pub fn of(object: &'a Value) -> Option<Self> {
        let kind = object.get("kind")?.as_str().filter(|k| !k.is_empty())?;
        let api_version = object
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        Some(Self {
            group,
            version,
            kind,
        })
    }

    /// Whether this is one of the Pod-bearing kinds of [`SUPPORTED_KINDS`] in its own group.
    fn well_known(&self) -> bool {
        SUPPORTED_KINDS.contains(&self.kind)
            && (self.version.is_empty() || self.group == api_group(self.kind))
    }
}

/// A `kinds` entry: `Kind`, `version/Kind` (core group), `group/version/Kind`, each part a
/// wildcard pattern (`*`, `?`); `*` alone is every kind. Errors name what is wrong.
pub fn parse_kind(entry: &str) -> Result<(Option<&str>, Option<&str>, &str), String> {
    let parts: Vec<&str> = entry.split('/').collect();
    let (group, version, kind) = match parts.as_slice() {
        [k] => (None, None, *k),
        [v, k] => (Some(""), Some(*v), *k),
        [g, v, k] => (Some(*g), Some(*v), *k),
        _ => {
            return Err(format!(
                "{entry:?}: expected Kind, version/Kind or group/version/Kind"
            ));
        }
    };
    if kind.is_empty() || version == Some("") {
        return Err(format!("{entry:?}: empty kind or version"));
    }
    Ok((group, version, kind))
}

/// How a `kinds` list selects an object: not at all, as a Pod-shaped object (its pod template
/// for a workload), or as the object itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Selected {
    No,
    PodShaped,
    Itself,
}

fn kind_selected(
    kinds: &[String],
    t: &ObjectType<'_>,
    pod_templates: bool,
    empty_means_pod: bool,
) -> Selected {
    if kinds.is_empty() {
        let pod_shaped = t.kind == "Pod" || (pod_templates && WORKLOAD_KINDS.contains(&t.kind));
        return if empty_means_pod && pod_shaped && t.well_known() {
            Selected::PodShaped
        } else {
            Selected::No
        };
    }
    let mut selected = Selected::No;
    let mut names_pod = false;
    for entry in kinds {
        let Ok((group, version, kind)) = parse_kind(entry) else {
            continue;
        };
        if kind == "Pod" && group.is_none_or(|g| g.is_empty()) {
            names_pod = true;
        }
        let exact_name = !kind.contains(['*', '?']);
        let fits = wildcard_match(kind, t.kind)
            && group.is_none_or(|g| t.version.is_empty() || wildcard_match(g, t.group))
            && version.is_none_or(|v| t.version.is_empty() || wildcard_match(v, t.version));
        if !fits {
            continue;
        }
        if exact_name && SUPPORTED_KINDS.contains(&t.kind) {
            // A Pod or workload named as such: its group must be its own.
            if t.well_known() {
                return Selected::PodShaped;
            }
            continue;
        }
        selected = Selected::Itself;
    }
    if selected == Selected::No
        && pod_templates
        && names_pod
        && WORKLOAD_KINDS.contains(&t.kind)
        && t.well_known()
    {
        return Selected::PodShaped;
    }
    selected
}

/// One `match` or `exclude` block. In `match`, empty `kinds` means Pod and empty `operations`
/// means CREATE; in `exclude`, an empty field does not constrain.
fn block_matches(
    block: &MatchResources,
    exclude: bool,
    t: &ObjectType<'_>,
    object: &Value,
    labels: &BTreeMap<String, String>,
    pod_templates: bool,
    ctx: &MatchContext<'_>,
) -> Option<Selected> {
    let selected = if exclude && block.kinds.is_empty() {
        Selected::Itself
    } else {
        kind_selected(&block.kinds, t, pod_templates, !exclude)
    };
    let kinds_ok = selected != Selected::No;
    let operations_ok = if block.operations.is_empty() {
        exclude || ctx.operation == Operation::Create
    } else {
        block.operations.contains(&ctx.operation)
    };
    // Namespace constraints hold only for namespaced objects (`ctx.namespace` set): a
    // cluster-scoped object matches no `namespaces` or `namespaceSelector`.
    let holds = kinds_ok
        && operations_ok
        && (block.namespaces.is_empty()
            || (!ctx.namespace.is_empty()
                && block
                    .namespaces
                    .iter()
                    .any(|n| wildcard_match(n, ctx.namespace))))
        && block
            .namespace_selector
            .as_ref()
            .is_none_or(|s| !ctx.namespace.is_empty() && s.matches(ctx.namespace_labels))
        && block
            .object_selector
            .as_ref()
            .is_none_or(|s| s.matches(labels))
        && names_match(&block.names, object)
        && annotations_match(&block.annotations, object);
    holds.then_some(selected)
}

/// Kyverno's `names`: one pattern matches the object's name, or its `generateName` when it has
/// no name yet (`pkg/engine/utils/match.go`).
fn names_match(names: &[String], object: &Value) -> bool {
    if names.is_empty() {
        return true;
    }
    let meta = |f: &str| {
        object
            .pointer(&format!("/metadata/{f}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let name = match meta("name") {
        "" => meta("generateName"),
        n => n,
    };
    names.iter().any(|p| wildcard_match(p, name))
}

/// Kyverno's `annotations`: every expected pair matches some annotation of the object, key and
/// value as wildcard patterns (`pkg/utils/match/annotations.go`).
fn annotations_match(expected: &BTreeMap<String, String>, object: &Value) -> bool {
    if expected.is_empty() {
        return true;
    }
    let actual = object
        .pointer("/metadata/annotations")
        .and_then(Value::as_object);
    expected.iter().all(|(k, v)| {
        actual.into_iter().flatten().any(|(k1, v1)| {
            wildcard_match(k, k1) && v1.as_str().is_some_and(|v1| wildcard_match(v, v1))
        })
    })
}

/// Whether `object` is a workload (of its own API group) whose pod template opts out of
/// meshgate (`meshgate.dev/inject: "false"` on the template): no policy mutates it, whatever
/// its target.
pub fn template_opted_out(object: &Value) -> bool {
    let Some(t) = ObjectType::of(object) else {
        return false;
    };
    if !WORKLOAD_KINDS.contains(&t.kind) || !t.well_known() {
        return false;
    }
    pod_template_path(t.kind)
        .and_then(|path| path.iter().try_fold(object, |v, s| v.get(*s)))
        .is_some_and(opted_out)
}

/// Whether the object opts out of meshgate (`meshgate.dev/inject: "false"` label or
/// annotation).
pub fn opted_out(object: &Value) -> bool {
    ["labels", "annotations"].iter().any(|field| {
        object
            .get("metadata")
            .and_then(|m| m.get(*field))
            .and_then(|m| m.get(names::OPT_OUT))
            .and_then(Value::as_str)
            == Some("false")
    })
}

/// Where `spec`'s mutations land on `object` in this request, when it applies: `match` holds
/// and `exclude` (if set) does not. `[]` is the object itself (a Pod, any kind other than the
/// workloads named as such, and every object of a policy with `target: Object`); a workload
/// selected as Pod-shaped by a policy with `target: Pod` (the default) is mutated in its pod
/// template ([`pod_template_path`]). The object selector sees the object's own labels (a
/// workload's, not its pod template's).
pub fn policy_target(
    spec: &MutationPolicySpec,
    object: &Value,
    ctx: &MatchContext<'_>,
) -> Option<&'static [&'static str]> {
    let t = ObjectType::of(object)?;
    let labels = object_labels(object);
    // `podTemplates` is for Pod-shaped policies ([`validate`](super::validate) refuses it with
    // `target: Object`); with the object target it widens nothing.
    let pod_templates = spec.pod_templates && spec.target == MutationTarget::Pod;
    let selected = block_matches(&spec.match_, false, &t, object, &labels, pod_templates, ctx)?;
    if spec
        .exclude
        .as_ref()
        .and_then(|e| block_matches(e, true, &t, object, &labels, pod_templates, ctx))
        .is_some()
    {
        return None;
    }
    match (selected, spec.target) {
        (Selected::No, _) => None,
        (Selected::PodShaped, MutationTarget::Pod) => pod_template_path(t.kind),
        (Selected::PodShaped, MutationTarget::Object) | (Selected::Itself, _) => Some(&[]),
    }
}

/// Whether `spec` applies to `object` in this request (see [`policy_target`]).
pub fn policy_matches(spec: &MutationPolicySpec, object: &Value, ctx: &MatchContext<'_>) -> bool {
    policy_target(spec, object, ctx).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_api::LabelSelector;
    use serde_json::json;

    fn ctx<'a>(
        op: Operation,
        ns: &'a str,
        labels: &'a BTreeMap<String, String>,
    ) -> MatchContext<'a> {
        MatchContext {
            operation: op,
            namespace: ns,
            namespace_labels: labels,
            cluster: &crate::policy::context::NoCluster,
        }
    }

    fn spec(m: MatchResources) -> MutationPolicySpec {
        MutationPolicySpec {
            match_: m,
            exclude: None,
            pod_templates: false,
            target: Default::default(),
            mutations: Vec::new(),
            warning: None,
            existing: Default::default(),
        }
    }

    fn pod(labels: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": labels}})
    }

    #[test]
    fn defaults_are_pod_and_create() {
        let none = BTreeMap::new();
        let s = spec(MatchResources::default());
        assert!(policy_matches(
            &s,
            &pod(json!({})),
            &ctx(Operation::Create, "a", &none)
        ));
        assert!(!policy_matches(
            &s,
            &pod(json!({})),
            &ctx(Operation::Update, "a", &none)
        ));
        let deploy =
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "spec": {"template": {}}});
        assert!(!policy_matches(
            &s,
            &deploy,
            &ctx(Operation::Create, "a", &none)
        ));
    }

    #[test]
    fn api_group_must_fit_the_kind() {
        let none = BTreeMap::new();
        let s = spec(MatchResources {
            kinds: vec!["Deployment".into()],
            ..Default::default()
        });
        let c = ctx(Operation::Create, "a", &none);
        assert!(policy_matches(
            &s,
            &json!({"apiVersion": "apps/v1", "kind": "Deployment"}),
            &c
        ));
        assert!(policy_matches(&s, &json!({"kind": "Deployment"}), &c));
        assert!(!policy_matches(
            &s,
            &json!({"apiVersion": "example.com/v1", "kind": "Deployment"}),
            &c
        ));
    }

    #[test]
    fn selectors() {
        let ns_labels: BTreeMap<String, String> = [("mesh".to_owned(), "on".to_owned())].into();
        let s = spec(MatchResources {
            namespace_selector: Some(LabelSelector::labels([("mesh", "on")])),
            object_selector: Some(LabelSelector::labels([("app", "web")])),
            ..Default::default()
        });
        let none = BTreeMap::new();
        assert!(policy_matches(
            &s,
            &pod(json!({"app": "web"})),
            &ctx(Operation::Create, "a", &ns_labels)
        ));
        assert!(!policy_matches(
            &s,
            &pod(json!({"app": "db"})),
            &ctx(Operation::Create, "a", &ns_labels)
        ));
        assert!(!policy_matches(
            &s,
            &pod(json!({"app": "web"})),
            &ctx(Operation::Create, "a", &none)
        ));
    }
}

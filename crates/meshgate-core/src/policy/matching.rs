//! Which objects a `MutationPolicy` applies to, and where its mutations land.

use std::collections::BTreeMap;

use meshgate_api::mutation_policy::{MatchResources, MutationPolicySpec, Operation};
use serde_json::Value;

use super::pattern::wildcard_match;

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

/// Every kind a policy may name in `kinds`.
pub const SUPPORTED_KINDS: [&str; 7] = [
    "Pod",
    "Deployment",
    "StatefulSet",
    "DaemonSet",
    "ReplicaSet",
    "Job",
    "CronJob",
];

/// Where the Pod-shaped part of an object of `kind` lives: `[]` for a Pod (the object itself),
/// `spec.template` for Deployment/StatefulSet/DaemonSet/ReplicaSet/Job,
/// `spec.jobTemplate.spec.template` for CronJob. `None` for any other kind.
pub fn pod_template_path(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "Pod" => Some(&[]),
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
            Some(&["spec", "template"])
        }
        "CronJob" => Some(&["spec", "jobTemplate", "spec", "template"]),
        _ => None,
    }
}

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

/// The object's kind, when it is one meshgate mutates (`kind` set, `apiVersion` of the right
/// group when set).
pub fn supported_kind(object: &Value) -> Option<&str> {
    let kind = object.get("kind")?.as_str()?;
    pod_template_path(kind)?;
    if let Some(api_version) = object.get("apiVersion").and_then(Value::as_str) {
        let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
        if group != api_group(kind) {
            return None;
        }
    }
    Some(kind)
}

fn kind_selected(kinds: &[String], kind: &str, pod_templates: bool, empty_means_pod: bool) -> bool {
    let listed = |k: &str| {
        if kinds.is_empty() {
            empty_means_pod && k == "Pod"
        } else {
            kinds.iter().any(|x| x == k)
        }
    };
    listed(kind) || (pod_templates && WORKLOAD_KINDS.contains(&kind) && listed("Pod"))
}

/// One `match` or `exclude` block. In `match`, empty `kinds` means Pod and empty `operations`
/// means CREATE; in `exclude`, an empty field does not constrain.
fn block_matches(
    block: &MatchResources,
    exclude: bool,
    kind: &str,
    labels: &BTreeMap<String, String>,
    pod_templates: bool,
    ctx: &MatchContext<'_>,
) -> bool {
    let kinds_ok = (exclude && block.kinds.is_empty())
        || kind_selected(&block.kinds, kind, pod_templates, !exclude);
    let operations_ok = if block.operations.is_empty() {
        exclude || ctx.operation == Operation::Create
    } else {
        block.operations.contains(&ctx.operation)
    };
    kinds_ok
        && operations_ok
        && (block.namespaces.is_empty()
            || block
                .namespaces
                .iter()
                .any(|n| wildcard_match(n, ctx.namespace)))
        && block
            .namespace_selector
            .as_ref()
            .is_none_or(|s| s.matches(ctx.namespace_labels))
        && block
            .object_selector
            .as_ref()
            .is_none_or(|s| s.matches(labels))
}

/// Whether `spec` applies to `object` in this request: the kind is supported, `match` holds and
/// `exclude` (if set) does not. The object selector sees the object's own labels (a workload's,
/// not its pod template's).
pub fn policy_matches(spec: &MutationPolicySpec, object: &Value, ctx: &MatchContext<'_>) -> bool {
    let Some(kind) = supported_kind(object) else {
        return false;
    };
    let labels = object_labels(object);
    block_matches(&spec.match_, false, kind, &labels, spec.pod_templates, ctx)
        && !spec
            .exclude
            .as_ref()
            .is_some_and(|e| block_matches(e, true, kind, &labels, spec.pod_templates, ctx))
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
        }
    }

    fn spec(m: MatchResources) -> MutationPolicySpec {
        MutationPolicySpec {
            match_: m,
            exclude: None,
            pod_templates: false,
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

//! `MutationPolicy`: mutations applied to pods and pod templates.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::selector::LabelSelector;

/// Mutations applied at admission to matching objects and, when `existing.enabled`, to the pod
/// templates of workloads that exist already.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "meshgate.dev",
    version = "v1alpha1",
    kind = "MutationPolicy",
    plural = "mutationpolicies",
    shortname = "mpol",
    status = "MutationPolicyStatus",
    category = "meshgate",
    printcolumn = r#"{"name":"Kinds","type":"string","jsonPath":".spec.match.kinds"}"#,
    printcolumn = r#"{"name":"Existing","type":"integer","jsonPath":".status.existing.mutated"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Native","type":"string","jsonPath":".status.conditions[?(@.type==\"Native\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MutationPolicySpec {
    /// What the policy applies to.
    #[serde(rename = "match")]
    pub match_: MatchResources,
    /// What it never applies to, even when matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude: Option<MatchResources>,
    /// Apply the mutations of a Pod-matching policy to the pod templates of Deployments,
    /// StatefulSets, DaemonSets, ReplicaSets, Jobs and CronJobs as well (Kyverno's default).
    #[serde(default)]
    pub pod_templates: bool,
    /// What the mutations are written against. `Pod` (the default): a Pod — a Pod itself, and
    /// a workload (named in `kinds`, or through `podTemplates`) in its pod template; a kind
    /// without a pod template is the object itself. `Object`: every matched object itself,
    /// workloads included — a Deployment's patch paths start at the Deployment
    /// (`spec.template.spec.volumes`) and `request.object` is the Deployment, as in a Kyverno
    /// rule that names Deployment. Not with `podTemplates`.
    #[serde(default, skip_serializing_if = "MutationTarget::is_pod")]
    pub target: MutationTarget,
    /// Mutations, applied in order.
    #[schemars(length(min = 1, max = 64))]
    pub mutations: Vec<Mutation>,
    /// Shown as an admission warning whenever the policy changes an object: name the trade-off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// Apply to workloads that exist already.
    #[serde(default)]
    pub existing: ExistingResources,
}

/// What a MutationPolicy's mutations are written against (`spec.target`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MutationTarget {
    /// A Pod: a Pod itself, a workload's pod template (`spec.template`, a CronJob's
    /// `spec.jobTemplate.spec.template`); a kind without a pod template is the object itself.
    #[default]
    Pod,
    /// The matched object itself, whatever its kind: a workload is mutated as the workload.
    Object,
}

impl MutationTarget {
    /// Whether this is the default, `Pod`.
    fn is_pod(&self) -> bool {
        *self == MutationTarget::Pod
    }
}

/// `NamespacedMutationPolicy`: a MutationPolicy that a namespace's owner (a tenant, e.g. a
/// Kubeflow profile's owner) may create. It applies only to objects in its own namespace:
/// `match.namespaces` may name only that namespace and `namespaceSelector` is not allowed
/// (`meshgate_core::policy::confine`); cluster-scoped objects are never matched.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "meshgate.dev",
    version = "v1alpha1",
    kind = "NamespacedMutationPolicy",
    plural = "namespacedmutationpolicies",
    shortname = "nmpol",
    namespaced,
    status = "MutationPolicyStatus",
    category = "meshgate",
    printcolumn = r#"{"name":"Kinds","type":"string","jsonPath":".spec.match.kinds"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct NamespacedMutationPolicySpec {
    /// The same fields as a MutationPolicy's spec.
    #[serde(flatten)]
    pub policy: MutationPolicySpec,
}

/// A resource filter. Every field that is set must match.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MatchResources {
    /// Kinds: Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob. Empty: Pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kinds: Vec<String>,
    /// Namespace names (`*` and `?` wildcards allowed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_selector: Option<LabelSelector>,
    /// CREATE and/or UPDATE. Empty: CREATE.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operations: Vec<Operation>,
    /// Object names (`metadata.name`, or `metadata.generateName` when the name is empty;
    /// `*` and `?` wildcards allowed), as Kyverno's `names`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    /// Annotations the object must carry: each key and value a wildcard pattern (`*`, `?`),
    /// as Kyverno's `annotations`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum Operation {
    Create,
    Update,
}

/// One mutation. Exactly one of `annotations`, `labels`, `strategicMerge`, `jsonPatch` and
/// `mutations` is set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.annotations) ? 1 : 0) + (has(self.labels) ? 1 : 0) + (has(self.strategicMerge) ? 1 : 0) + (has(self.jsonPatch) ? 1 : 0) + (has(self.mutations) && size(self.mutations) > 0 ? 1 : 0) == 1",
    "message": "set exactly one of annotations, labels, strategicMerge, jsonPatch, mutations"
}]))]
pub struct Mutation {
    /// Set pod (or pod template) annotations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<MetadataMutation>,
    /// Set pod (or pod template) labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<MetadataMutation>,
    /// A strategic-merge patch of the pod, with Kyverno's anchors: `+(key)` adds when absent,
    /// `(key)` is a condition on the object, `<(key)` a condition on the whole mutation.
    /// Lists of objects are merged by their Kubernetes merge key (`name`, or e.g.
    /// `containerPort`, `mountPath`); lists of scalars are replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_object")]
    pub strategic_merge: Option<serde_json::Value>,
    /// RFC 6902 operations on the pod (paths relative to the Pod object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_patch: Option<Vec<JsonPatchOperation>>,
    /// With `jsonPatch`: the leniencies Kyverno applies to its JSON patches (set, all three, by
    /// `meshgate import kyverno`). Unset: RFC 6902, strictly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_patch_options: Option<JsonPatchOptions>,
    /// Conditions that must hold for the mutation to apply (Kyverno's `preconditions`),
    /// evaluated once, before `foreach`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preconditions: Option<Conditions>,
    /// Apply the mutation once per element of a list (Kyverno's `foreach`), with the variables
    /// `element` and `elementIndex`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub foreach: Option<ForEach>,
    /// Variables defined for this mutation (Kyverno's `context` entries of kind `variable`),
    /// evaluated before `preconditions`, in order, each visible to the later ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub context: Vec<ContextEntry>,
    /// Mutations applied in order instead of a patch, each to the result of the previous one,
    /// seeing this mutation's variables: once, after its `context` and `preconditions`
    /// (Kyverno's rule with several `foreach` entries), or, with `foreach`, once per element
    /// (Kyverno's nested `foreach`: inside, `element` and `elementIndex` are the inner
    /// element's, and `element0`, `elementIndex0`, `element1` … each level's). Each one's
    /// `request.object` is the object as the previous one left it when that one changed it,
    /// else as this mutation (or, with `foreach`, this element) found it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "any_object_list")]
    pub mutations: Vec<Mutation>,
}

/// A named variable (Kyverno's `context` entry): exactly one of `variable`, `configMap` and
/// `apiCall`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContextEntry {
    /// The variable's name, used as the root of expressions (`{{ name.field }}`).
    pub name: String,
    /// A value computed from the request and the earlier entries: `value` (with variables), or
    /// `jmesPath` over `value` or, without `value`, over all variables; `default` when that
    /// gives nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variable: Option<ContextVariable>,
    /// A ConfigMap's `data` and `metadata` (`{{ name.data.key }}`), read at admission from the
    /// webhook's watch cache of the ConfigMaps policies name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ContextConfigMap>,
    /// An object or list read from the API server at admission (`{{ name.spec.field }}`), as
    /// the webhook's ServiceAccount (grant it with `meshgate install --context-api-read`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_call: Option<ContextApiCall>,
}

/// A GET of the API server (Kyverno's `apiCall` entry with its default method): the response,
/// or `jmesPath` over it; `default` when the GET fails.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContextApiCall {
    /// The path, with variables: `/api/v1/namespaces/{{ request.namespace }}`,
    /// `/apis/apps/v1/namespaces/shop/deployments`. It must start with `/api/` or `/apis/`; a
    /// NamespacedMutationPolicy may read only under its own namespace.
    pub url_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jmes_path: Option<String>,
    /// The entry's value when the GET fails (not found, forbidden, timed out); `jmesPath` is
    /// not applied to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub default: Option<serde_json::Value>,
    /// The only namespace the call may read (a NamespacedMutationPolicy's own), set when the
    /// policy is confined to its namespace; not part of the API.
    #[serde(skip)]
    #[schemars(skip)]
    pub confined_to: Option<String>,
}

/// The ConfigMap a context entry reads: both names literal, as the webhook may read only the
/// ConfigMaps granted to it by name (`meshgate install --context-config-map NAMESPACE/NAME`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContextConfigMap {
    pub name: String,
    /// Required in a MutationPolicy (Kyverno's policy validation requires it too); in a
    /// NamespacedMutationPolicy, its own namespace when empty, and no other.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
}

/// A variable's value: `value` (with variables), or `jmesPath` over `value` or, without
/// `value`, over all variables; `default` when that gives nothing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContextVariable {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub value: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jmes_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub default: Option<serde_json::Value>,
}

/// The order in which a `foreach` visits its list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ForEachOrder {
    #[default]
    Ascending,
    /// Last element first (`elementIndex` keeps each element's position in the list).
    Descending,
}

/// `foreach`: the mutation applies once per element of `list`, in `order`, each time to the
/// result of the previous one.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForEach {
    /// A JMESPath expression over the variables (e.g. `request.object.spec.containers`); it
    /// must give a list (or nothing: no iteration). Evaluated once, before the first element.
    pub list: String,
    /// Conditions per element (`element`, `elementIndex` in scope); an element for which they
    /// do not hold is skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preconditions: Option<Conditions>,
    /// `Ascending` (the default) or `Descending`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<ForEachOrder>,
    /// Variables per element, evaluated after `element` is set and before `preconditions`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub context: Vec<ContextEntry>,
}

/// Conditions: every one of `all` and, when `any` is not empty, at least one of `any`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Conditions {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub any: Vec<PreCondition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub all: Vec<PreCondition>,
}

/// One condition: `key` `operator` `value`, both sides with variables (`{{ ... }}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreCondition {
    #[schemars(schema_with = "any_value")]
    pub key: serde_json::Value,
    pub operator: ConditionOperator,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub value: Option<serde_json::Value>,
    /// Why the condition matters (shown when it fails; informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Kyverno's condition operators (the ones meshgate evaluates).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ConditionOperator {
    Equals,
    NotEquals,
    In,
    NotIn,
    AnyIn,
    AllIn,
    AnyNotIn,
    AllNotIn,
    GreaterThan,
    GreaterThanOrEquals,
    LessThan,
    LessThanOrEquals,
}

/// Leniencies of a JSON patch, each off by default (RFC 6902).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JsonPatchOptions {
    /// A negative array index counts from the end: `-1` is the last element (for `add`, `-1`
    /// appends).
    #[serde(default)]
    pub negative_indices: bool,
    /// A `remove` of a path that does not exist does nothing.
    #[serde(default)]
    pub allow_missing_path_on_remove: bool,
    /// An `add` creates missing parents: an array when the next path segment is a number or
    /// `-`, otherwise an object.
    #[serde(default)]
    pub ensure_path_exists_on_add: bool,
}

/// Set metadata keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetadataMutation {
    pub values: BTreeMap<String, String>,
    /// What to do when the key has another value already.
    #[serde(default)]
    pub on_conflict: OnConflict,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum OnConflict {
    /// Replace the existing value.
    #[default]
    Overwrite,
    /// Leave the existing value.
    Keep,
}

/// One RFC 6902 operation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JsonPatchOperation {
    pub op: JsonPatchOp,
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub value: Option<serde_json::Value>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum JsonPatchOp {
    Add,
    Remove,
    Replace,
    Move,
    Copy,
    Test,
}

/// Backfill of existing objects: workloads (their pod templates, or with `target: Object`
/// themselves), and the objects of the other kinds `match.kinds` names that the controller may
/// list and patch (`meshgate install --existing-kind`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExistingResources {
    #[serde(default)]
    pub enabled: bool,
    /// Report what would change; change nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Writes per second at most.
    #[serde(default = "default_rate")]
    #[schemars(range(min = 1, max = 1000))]
    pub rate_per_second: u32,
}

fn default_rate() -> u32 {
    10
}

impl Default for ExistingResources {
    fn default() -> Self {
        Self {
            enabled: false,
            dry_run: false,
            rate_per_second: default_rate(),
        }
    }
}

/// What the controller did for existing workloads, and the policy's conditions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MutationPolicyStatus {
    #[serde(default)]
    pub observed_generation: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub existing: Option<ExistingReport>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The ConfigMaps the policy's `configMap` context entries read (`namespace/name`): the
    /// webhook reads only those granted to it (`meshgate install --context-config-map`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub config_maps: Vec<String>,
}

/// Result of the last pass over existing objects.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExistingReport {
    /// Objects that matched.
    pub matched: u32,
    /// Objects changed (or, in dry run, that would change).
    pub mutated: u32,
    /// Objects that already carried the mutation.
    pub unchanged: u32,
    /// Bare pods that match: reported, never changed or deleted.
    pub bare_pods: u32,
    pub failed: u32,
    pub dry_run: bool,
    /// `Kind namespace/name` (`Kind name` when cluster-scoped) of the changed objects (at most
    /// 50).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_applied: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

fn any_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

fn any_object_list(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "items": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": true
        }
    })
}

fn any_value(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "x-kubernetes-preserve-unknown-fields": true
    })
}

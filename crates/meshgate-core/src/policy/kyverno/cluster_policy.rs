//! Import of Kyverno `ClusterPolicy` (and namespaced `Policy`) mutate rules as MutationPolicies.
//!
//! [`import`] takes the policy as a `serde_json::Value` (parsed from YAML by the caller) of
//! `kyverno.io/v1` or `kyverno.io/v2beta1`, and turns **each mutate rule** into one
//! `MutationPolicySpec` named `<policy>-<rule>`, made a DNS-1123 label (lowercase alphanumerics
//! and `-`, at most 63 characters; longer names are cut and suffixed with a hash, duplicates get
//! `-2`, `-3`, ...). Everything of the mutate rules that cannot be converted faithfully (a rule
//! skipped, or a part of one dropped) is reported in [`KyvernoImport::notes`]: the policy would
//! be half-applied, and `meshgate render` and `import` refuse it unless `--allow-partial`.
//! Rules that are not mutate rules are listed in [`KyvernoImport::ignored`]. When no rule is
//! left the import fails with [`KyvernoError::NothingConvertible`]. Notes and errors name the
//! field (`spec.rules[0].mutate...`).
//!
//! # What converts
//! * `match` / `exclude` as `resources` (legacy), `any[].resources` or `all[].resources`, with
//!   `kinds`, `namespaces`, `namespaceSelector`, `selector` (→ `objectSelector`), `operations`.
//!   - `any` with several entries converts only when the entries differ in a single one of
//!     `kinds`, `namespaces`, `operations` (the union is then exact); a MutationPolicy has one
//!     block whose fields must all hold, so any other OR of entries cannot be expressed.
//!   - `all` entries are intersected (kinds, operations, literal namespaces; selectors are
//!     combined); namespace patterns in several entries cannot be intersected.
//!   - kinds `Pod`, `v1/Pod`, `*/Pod`, `apps/v1/Deployment`, ... become bare kinds; any other
//!     kind (`Service`, `v1/ConfigMap`, `example.com/v1/Widget`, `*`) stays as written and is
//!     mutated as the object itself, as Kyverno does; subresources are dropped with a note.
//!   - no `operations` means every operation in Kyverno: the policy gets `[CREATE, UPDATE]`;
//!     `DELETE` and `CONNECT` are dropped with a note.
//! * `mutate.patchStrategicMerge`, unchanged (meshgate implements Kyverno's anchors).
//! * `mutate.patchesJson6902`, a YAML/JSON string of operations or a list. Kyverno substitutes
//!   variables in the string before parsing it, so a value that is one quoted variable is text
//!   there (`"8080"`): such values become `{{ to_string(...) }}`. An `add` of a string
//!   to `/metadata/annotations/<key>` or `/metadata/labels/<key>` becomes an `annotations` /
//!   `labels` mutation, which, like Kyverno's JSON patch, creates the map when it is missing.
//!   Other operations stay JSON patch operations with Kyverno's leniencies on
//!   (`jsonPatchOptions`: negative indices, a `remove` of a missing path ignored, `add`
//!   creating missing parents; see `policy::json6902`).
//! * Pod controllers: Kyverno auto-generates rules for Deployment, StatefulSet, DaemonSet,
//!   ReplicaSet, Job, CronJob (and ReplicationController) from a rule that matches Pod, unless
//!   the policy annotation `pod-policies.kyverno.io/autogen-controllers` is `none`, or some rule
//!   of the policy prevents it (a generate rule, a JSON patch, a `name`/`names`/`selector`/
//!   `annotations` filter, or kinds mixing Pod with others). The conversion follows that:
//!   `podTemplates: true` when every controller is auto-generated, the listed controllers as
//!   explicit kinds when the annotation names some, nothing otherwise. (ReplicationController
//!   templates are never mutated by meshgate; their pods still are.)
//! * A rule that names a workload kind (Deployment, StatefulSet, DaemonSet, ReplicaSet, Job,
//!   CronJob; alone or with Pod or other kinds) mutates each matched object itself, as Kyverno
//!   applies a rule's patch to the resource it matched (`pkg/engine/mutate/mutation.go`): it
//!   converts with `target: Object`, its patch, variables (`request.object` is the workload,
//!   `images` point into its template), preconditions and `foreach` as written
//!   (`spec.template.spec.volumes`, `spec.ttlSecondsAfterFinished`, the Deployment's own
//!   `metadata.annotations`). Only the rules Kyverno generates from a Pod rule
//!   (`pkg/autogen/v1/rule.go`, wrapping the patch in `spec.template` and rewriting
//!   `request.object.spec` to `request.object.spec.template.spec`) write into pod templates:
//!   that is `podTemplates`, above.
//! * Variables (`{{ }}`, nested ones inner first) in `mutate`, over `request.object`,
//!   `request.operation`, `request.namespace`, `images`, context entries, `element` and
//!   `elementIndex`, with JMESPath and Kyverno's common string functions (`policy::variables`). In a rule auto-generated for pod controllers,
//!   `request.object` is the pod template, as Kyverno's autogen rewrites the paths.
//! * `preconditions` (`{any, all}` or a list) become the mutation's `preconditions`, evaluated
//!   once, on the object as the rule finds it; operators `Equals`, `NotEquals`, `In`, `NotIn`,
//!   `AnyIn`, `AllIn`, `AnyNotIn`, `AllNotIn` and the numeric comparisons (others are refused,
//!   named).
//! * `mutate.foreach` entries (`list`, `preconditions`, `context`, `order`, and
//!   `patchStrategicMerge` or `patchesJson6902`) become one mutation each with `foreach`. The
//!   order is Kyverno's (`pkg/engine/handlers/mutation/common.go`): `order` when set, else
//!   `Descending` for a strategic merge (Kyverno reverses those by default) and `Ascending` for
//!   a JSON patch.
//! * A foreach entry with a nested `foreach` becomes a mutation with the entry's `list` and
//!   `order` whose `mutations` are the nested entries, per element (`element0`, `element1` …
//!   per level, `element` the innermost); Kyverno refuses such an entry with its own context,
//!   preconditions or patch, and so does the conversion.
//! * Rule `preconditions` or `context` with several `foreach` entries: one mutation holding
//!   them, evaluated once on the object as the rule finds it, whose `mutations` are the
//!   entries (a failed precondition skips them all, as in Kyverno's `pkg/engine/engine.go`).
//! * `context` entries of kind `variable` (rule and foreach) become the mutations' `context`
//!   (`policy::variables`); `configMap`, `apiCall`, `globalReference` and `imageRegistry`
//!   entries need the cluster at admission: the rule is refused, naming the entry.
//! * `name`, `names` and `annotations` in `match`/`exclude` become `names`/`annotations` (they
//!   also turn Kyverno's autogen off, as Kyverno does).
//! * `spec.emitWarning: true` sets the MutationPolicy's `warning`.
//! * A namespaced `Policy` applies in its own namespace only: its namespace becomes the rule's
//!   `namespaces`.
//!
//! # What does not
//! Variables in `match`/`exclude`, references (`$( )`) anywhere in a rule; context entries
//! other than `variable`, `configMap` (named literally) and `apiCall` (a GET of the API): a
//! `globalReference` or `imageRegistry` entry, a ConfigMap named by a variable, an `apiCall`
//! that POSTs, sends `data` or calls a `service`: the rule is refused, naming the field;
//! `name` and `names` together; `celPreconditions`, `mutate.targets` / `mutateExistingOnPolicyUpdate`,
//! `match`/`exclude` on the requesting user (`subjects`, `roles`, `clusterRoles`), `spec.webhookConfiguration.matchConditions`, policies with
//! `spec.admission: false`. Validate, generate and verifyImages rules are ignored with a note.
//! `spec.applyRules: One` is not honoured (every converted rule applies; noted). Kyverno's
//! installation-wide `resourceFilters` (by default excluding `kube-system` and Kyverno's own
//! namespace) are not part of a policy and are not imported.

use std::collections::{BTreeMap, BTreeSet};

use meshgate_api::LabelSelector;
use meshgate_api::mutation_policy::{
    ConditionOperator, Conditions, ContextConfigMap, ContextEntry, ContextVariable, ForEach,
    ForEachOrder, JsonPatchOp, JsonPatchOperation, JsonPatchOptions, MatchResources,
    MetadataMutation, Mutation, MutationPolicySpec, MutationTarget, OnConflict, Operation,
    PreCondition,
};
use serde_json::Value;

use super::outcome::{KyvernoError, KyvernoImport, malformed};
use crate::policy::{SUPPORTED_KINDS, WORKLOAD_KINDS, validate, wildcard_match};

/// The policy annotation that selects Kyverno's auto-generated pod-controller rules.
pub const AUTOGEN_ANNOTATION: &str = "pod-policies.kyverno.io/autogen-controllers";

/// Converts the mutate rules of a Kyverno `ClusterPolicy` or `Policy`. See the module
/// documentation.
pub(super) fn import(doc: &Value) -> Result<KyvernoImport, KyvernoError> {
    let str_at = |p: &str| doc.pointer(p).and_then(Value::as_str).unwrap_or_default();
    let (api_version, kind) = (str_at("/apiVersion"), str_at("/kind"));
    if !matches!(api_version, "kyverno.io/v1" | "kyverno.io/v2beta1")
        || !matches!(kind, "ClusterPolicy" | "Policy")
    {
        return Err(KyvernoError::NotAPolicy {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
        });
    }
    let policy = str_at("/metadata/name");
    if policy.is_empty() {
        return Err(malformed("metadata.name", "required"));
    }
    let namespace = if kind == "Policy" {
        let ns = str_at("/metadata/namespace");
        if ns.is_empty() {
            return Err(malformed(
                "metadata.namespace",
                "a namespaced Kyverno Policy needs its namespace to be converted",
            ));
        }
        Some(ns)
    } else {
        None
    };
    let Some(spec) = doc.get("spec").filter(|s| s.is_object()) else {
        return Err(malformed("spec", "required"));
    };
    let Some(rules) = spec.get("rules").and_then(Value::as_array) else {
        return Err(malformed("spec.rules", "must be a list"));
    };

    let mut notes = Vec::new();
    let nothing = |notes: Vec<String>| KyvernoError::NothingConvertible {
        policy: policy.to_owned(),
        notes,
    };
    if spec.get("admission").and_then(Value::as_bool) == Some(false) {
        notes.push("spec.admission: false: the policy is not applied at admission, and meshgate only converts admission mutations".to_owned());
        return Err(nothing(notes));
    }
    if spec
        .pointer("/webhookConfiguration/matchConditions")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty())
    {
        notes.push("spec.webhookConfiguration.matchConditions: CEL match conditions are not supported (dropping them would widen every rule)".to_owned());
        return Err(nothing(notes));
    }
    if spec
        .get("mutateExistingOnPolicyUpdate")
        .and_then(Value::as_bool)
        == Some(true)
    {
        notes.push("spec.mutateExistingOnPolicyUpdate: mutating existing resources is not converted (see spec.existing of the MutationPolicy)".to_owned());
    }

    let autogen = autogen(doc, rules);
    let context = RuleContext {
        policy,
        namespace,
        autogen: &autogen,
        emit_warning: spec.get("emitWarning").and_then(Value::as_bool) == Some(true),
    };
    let mut policies: Vec<(String, MutationPolicySpec)> = Vec::new();
    let mut ignored = Vec::new();
    let mut names = BTreeSet::new();
    for (i, rule) in rules.iter().enumerate() {
        let path = format!("spec.rules[{i}]");
        let rule_name = rule.get("name").and_then(Value::as_str).unwrap_or_default();
        let label = if rule_name.is_empty() {
            path.clone()
        } else {
            format!("{path} ({rule_name})")
        };
        if rule.get("mutate").is_none_or(Value::is_null) {
            let what = ["validate", "generate", "verifyImages"]
                .into_iter()
                .find(|k| rule.get(*k).is_some())
                .unwrap_or("non-mutate");
            ignored.push(format!(
                "{label}: {what} rule ignored (only mutate rules are imported)"
            ));
            continue;
        }
        if rule_name.is_empty() {
            notes.push(format!("{path}.name: required; rule not converted"));
            continue;
        }
        match convert_rule(&context, rule, &path, &mut notes) {
            Ok(Some(spec)) => {
                let name = unique(dns1123_name(policy, rule_name), &mut names);
                policies.push((name, spec));
            }
            Ok(None) => {}
            Err(reasons) => notes.push(format!("{label}: not converted: {reasons}")),
        }
    }
    if policies.is_empty() {
        notes.extend(ignored);
        return Err(nothing(notes));
    }
    keep_rule_order(policy, &mut policies);
    if spec.get("applyRules").and_then(Value::as_str) == Some("One") && policies.len() > 1 {
        notes.push("spec.applyRules: One is not supported: every converted rule applies, not only the first that matches".to_owned());
    }
    Ok(KyvernoImport {
        policies,
        notes,
        ignored,
    })
}

struct RuleContext<'a> {
    policy: &'a str,
    namespace: Option<&'a str>,
    autogen: &'a Autogen,
    emit_warning: bool,
}

/// Kyverno's auto-generation of pod-controller rules for a policy.
#[derive(Clone, Debug, PartialEq)]
enum Autogen {
    /// Every controller.
    All,
    /// Only these (from the annotation).
    Only(Vec<String>),
    /// None.
    Off,
}

const KYVERNO_CONTROLLERS: [&str; 7] = [
    "DaemonSet",
    "Deployment",
    "Job",
    "StatefulSet",
    "ReplicaSet",
    "ReplicationController",
    "CronJob",
];

/// Every resource description (`resources` blocks) of a rule's match and exclude.
fn resource_descriptions(rule: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for block in ["match", "exclude"] {
        let Some(b) = rule.get(block) else { continue };
        out.extend(b.get("resources"));
        for list in ["any", "all"] {
            for entry in b.get(list).and_then(Value::as_array).into_iter().flatten() {
                out.extend(entry.get("resources"));
            }
        }
    }
    out
}

fn bare_kind(raw: &str) -> &str {
    // `apps/v1/Deployment` → `Deployment`; good enough for Kyverno's autogen checks.
    raw.split('/')
        .rev()
        .find(|s| s.starts_with(|c: char| c.is_ascii_uppercase()))
        .unwrap_or(raw)
}

/// Kyverno's `CanAutoGen` and the autogen annotation.
fn autogen(doc: &Value, rules: &[Value]) -> Autogen {
    let present = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    let mut needed = false;
    for rule in rules {
        if present(rule.get("generate")) {
            return Autogen::Off;
        }
        if let Some(m) = rule.get("mutate") {
            let json = |v: &Value| {
                v.get("patchesJson6902")
                    .is_some_and(|p| !p.is_null() && p.as_str() != Some(""))
            };
            let foreach_json = m
                .get("foreach")
                .and_then(Value::as_array)
                .is_some_and(|f| f.iter().any(json));
            if json(m) || foreach_json {
                return Autogen::Off;
            }
        }
        for desc in resource_descriptions(rule) {
            if ["name", "names", "selector", "annotations"]
                .iter()
                .any(|f| present(desc.get(*f)))
            {
                return Autogen::Off;
            }
            let kinds: Vec<&str> = desc
                .get("kinds")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(bare_kind)
                .collect();
            if kinds.len() > 1 && kinds.contains(&"Pod") {
                return Autogen::Off;
            }
            needed |= kinds
                .iter()
                .any(|k| *k == "Pod" || KYVERNO_CONTROLLERS.contains(k));
        }
    }
    if !needed {
        return Autogen::Off;
    }
    let annotation = doc
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(AUTOGEN_ANNOTATION))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .trim();
    match annotation {
        "" => Autogen::All,
        "none" => Autogen::Off,
        list => Autogen::Only(
            list.split(',')
                .map(str::trim)
                .filter(|k| KYVERNO_CONTROLLERS.contains(k))
                .map(str::to_owned)
                .collect(),
        ),
    }
}

/// `None`: not a mutate rule. `Err`: the reasons it cannot be converted.
fn convert_rule(
    ctx: &RuleContext<'_>,
    rule: &Value,
    path: &str,
    notes: &mut Vec<String>,
) -> Result<Option<MutationPolicySpec>, String> {
    let rule_name = rule.get("name").and_then(Value::as_str).unwrap_or_default();
    let Some(mutate) = rule.get("mutate").filter(|m| !m.is_null()) else {
        return Ok(None);
    };

    let mut reasons = Vec::new();
    let non_empty = |v: Option<&Value>| v.is_some_and(|v| !is_empty_value(v));
    if non_empty(rule.get("celPreconditions")) {
        reasons.push(format!(
            "{path}.celPreconditions: CEL preconditions are not supported"
        ));
    }
    let rule_context = match rule.get("context").filter(|v| !is_empty_value(v)) {
        Some(c) => match context_entries(c, &format!("{path}.context")) {
            Ok(entries) => entries,
            Err(e) => {
                reasons.push(e);
                Vec::new()
            }
        },
        None => Vec::new(),
    };
    let preconditions = match rule.get("preconditions").filter(|v| !is_empty_value(v)) {
        Some(p) => match conditions(p, &format!("{path}.preconditions")) {
            Ok(c) => Some(c),
            Err(e) => {
                reasons.push(e);
                None
            }
        },
        None => None,
    };
    let foreach = match mutate.get("foreach").filter(|v| !is_empty_value(v)) {
        Some(f) => match foreach_mutations(f, &format!("{path}.mutate.foreach")) {
            Ok(m) => Some(m),
            Err(e) => {
                reasons.push(e);
                None
            }
        },
        None => None,
    };
    if non_empty(mutate.get("targets")) {
        reasons.push(format!(
            "{path}.mutate.targets: mutating other existing resources is not supported"
        ));
    }
    if mutate
        .get("mutateExistingOnPolicyUpdate")
        .and_then(Value::as_bool)
        == Some(true)
    {
        reasons.push(format!(
            "{path}.mutate.mutateExistingOnPolicyUpdate: mutating existing resources is not supported"
        ));
    }
    for field in ["match", "exclude"] {
        if let Some(v) = rule.get(field)
            && let Some(at) = find_variable(v, &format!("{path}.{field}"), true)
        {
            reasons.push(format!(
                "{at}: variables ({{{{ }}}}) and references ($( )) in match and exclude are not supported"
            ));
        }
    }
    if let Some(at) = find_variable(mutate, &format!("{path}.mutate"), false) {
        reasons.push(format!("{at}: references ($( )) are not supported"));
    }
    let smp = mutate.get("patchStrategicMerge").filter(|v| !v.is_null());
    let json = mutate.get("patchesJson6902").filter(|v| !v.is_null());
    if smp.is_some() && json.is_some() {
        reasons.push(format!(
            "{path}.mutate: sets both patchStrategicMerge and patchesJson6902"
        ));
    }
    if foreach.is_some() && (smp.is_some() || json.is_some()) {
        reasons.push(format!(
            "{path}.mutate: sets foreach and a patch: Kyverno applies only one of them"
        ));
    }
    if smp.is_none() && json.is_none() && foreach.is_none() && reasons.is_empty() {
        reasons.push(format!(
            "{path}.mutate: no patchStrategicMerge or patchesJson6902 to convert"
        ));
    }
    if !reasons.is_empty() {
        return Err(reasons.join("; "));
    }
    let json_path = format!("{path}.mutate.patchesJson6902");
    let json_ops = json.map(|j| parse_json6902(j, &json_path)).transpose()?;

    let Some(match_block) = rule.get("match") else {
        return Err(format!("{path}.match: required"));
    };
    let mut matched = convert_block(match_block, &format!("{path}.match"), false, notes)?
        .ok_or_else(|| format!("{path}.match: matches no resources"))?;
    let exclude = match rule.get("exclude").filter(|e| !e.is_null()) {
        Some(e) => convert_block(e, &format!("{path}.exclude"), true, notes)?,
        None => None,
    };
    if matched.kinds.is_empty() {
        return Err(format!("{path}.match: no kinds"));
    }
    if let Some(ns) = ctx.namespace {
        if !matched.namespaces.is_empty()
            && !matched.namespaces.iter().any(|n| wildcard_match(n, ns))
        {
            return Err(format!(
                "{path}.match.namespaces: never matches the policy's namespace {ns:?}"
            ));
        }
        matched.namespaces = vec![ns.to_owned()];
    }

    // Kinds and where the patch applies. A rule that names a workload kind patches each
    // matched object itself, as Kyverno applies a rule's patch to the resource it matched
    // (`pkg/engine/mutate/mutation.go`); only its rules auto-generated from a Pod rule
    // (`pkg/autogen/v1/rule.go`) write into pod templates. Such a rule converts with
    // `target: Object`, every kind kept. Any other rule keeps the default target: Pods and
    // other kinds are the objects themselves either way, and Pod rules get `podTemplates`
    // below (the autogen).
    let names_workloads = matched
        .kinds
        .iter()
        .any(|k| WORKLOAD_KINDS.contains(&k.as_str()));
    let target = if names_workloads {
        MutationTarget::Object
    } else {
        let (pods, others): (Vec<String>, Vec<String>) = matched
            .kinds
            .drain(..)
            .partition(|k| SUPPORTED_KINDS.contains(&k.as_str()));
        matched.kinds = pods;
        matched.kinds.extend(others);
        MutationTarget::Pod
    };
    let only_pods = matched.kinds == ["Pod"];

    // Mutations.
    let mut mutations = match (smp, json_ops) {
        (Some(s), _) => {
            if !s.is_object() {
                return Err(format!(
                    "{path}.mutate.patchStrategicMerge: must be an object"
                ));
            }
            vec![Mutation {
                strategic_merge: Some(s.clone()),
                ..Default::default()
            }]
        }
        (None, Some(ops)) => {
            if preconditions.is_some() {
                // One mutation, so that the preconditions are evaluated once, on the object
                // as the rule finds it (as Kyverno does).
                vec![Mutation {
                    json_patch: Some(ops),
                    json_patch_options: Some(kyverno_json_options()),
                    ..Default::default()
                }]
            } else {
                json_mutations(ops)
            }
        }
        (None, None) => match foreach {
            // Several foreach entries with rule preconditions or context: one mutation that
            // evaluates them once, on the object as the rule finds it, then applies the
            // entries in order (Kyverno, `pkg/engine/engine.go`: the rule's context and
            // preconditions before its handler; a failed precondition skips every entry).
            Some(entries)
                if entries.len() > 1 && (preconditions.is_some() || !rule_context.is_empty()) =>
            {
                vec![Mutation {
                    mutations: entries,
                    ..Default::default()
                }]
            }
            other => other.unwrap_or_default(),
        },
    };
    if let Some(p) = preconditions {
        if mutations.len() > 1 {
            return Err(format!(
                "{path}: preconditions over several mutations are not converted (meshgate would evaluate them once per mutation)"
            ));
        }
        for m in &mut mutations {
            m.preconditions = Some(p.clone());
        }
    }

    if !rule_context.is_empty() {
        for m in &mut mutations {
            m.context = rule_context.clone();
        }
    }

    // Pod controllers.
    let mut pod_templates = false;
    if only_pods {
        match ctx.autogen {
            Autogen::All => pod_templates = true,
            Autogen::Off => {}
            Autogen::Only(list) => {
                let ours: Vec<&str> = WORKLOAD_KINDS
                    .iter()
                    .copied()
                    .filter(|k| list.iter().any(|l| l == k))
                    .collect();
                if ours.len() == WORKLOAD_KINDS.len() {
                    pod_templates = true;
                } else {
                    matched.kinds.extend(ours.iter().map(|k| (*k).to_owned()));
                }
                if list.iter().any(|l| l == "ReplicationController") {
                    notes.push(format!(
                        "{path}: ReplicationController pod templates are not mutated by meshgate (their pods are)"
                    ));
                }
            }
        }
    }

    let mut match_ = matched.into_match();
    if match_.operations.is_empty() {
        match_.operations = vec![Operation::Create, Operation::Update];
    }
    let mut spec = MutationPolicySpec {
        match_,
        exclude: exclude.map(Desc::into_match),
        pod_templates,
        target,
        mutations,
        warning: ctx
            .emit_warning
            .then(|| format!("applied Kyverno rule {}/{rule_name}", ctx.policy)),
        existing: Default::default(),
    };
    // A namespaced Policy's configMap entries read its own namespace when they name none
    // (Kyverno's loader); a ClusterPolicy's must name one (Kyverno's policy validation).
    if let Some(ns) = ctx.namespace {
        for cm in crate::policy::context::entries_mut(&mut spec)
            .into_iter()
            .filter_map(|e| e.config_map.as_mut())
        {
            if cm.namespace.is_empty() {
                cm.namespace = ns.to_owned();
            }
        }
    }
    validate(&spec)
        .map_err(|errors| format!("the converted policy is invalid: {}", errors.join("; ")))?;
    Ok(Some(spec))
}

/// `null`, `[]`, `{}`, or an object of such (`preconditions: {all: []}`).
fn is_empty_value(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_empty_value),
        _ => false,
    }
}

/// The path of the first string or key with `$(` (and, with `variables`, `{{`).
fn find_variable(value: &Value, path: &str, variables: bool) -> Option<String> {
    let has = |s: &str| (variables && s.contains("{{")) || s.contains("$(");
    match value {
        Value::String(s) if has(s) => Some(path.to_owned()),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            let p = format!("{path}.{k}");
            if has(k) {
                Some(p)
            } else {
                find_variable(v, &p, variables)
            }
        }),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| find_variable(v, &format!("{path}[{i}]"), variables)),
        _ => None,
    }
}

/// A Kyverno resource filter, normalized.
#[derive(Clone, Debug, Default, PartialEq)]
struct Desc {
    kinds: Vec<String>,
    namespaces: Vec<String>,
    namespace_selector: Option<LabelSelector>,
    selector: Option<LabelSelector>,
    operations: Vec<Operation>,
    names: Vec<String>,
    annotations: BTreeMap<String, String>,
    /// Every kind (or operation) it names is one meshgate never sees: it matches nothing.
    matches_nothing: bool,
}

impl Desc {
    fn into_match(self) -> MatchResources {
        MatchResources {
            kinds: self.kinds,
            namespaces: self.namespaces,
            namespace_selector: self.namespace_selector,
            object_selector: self.selector,
            operations: self.operations,
            names: self.names,
            annotations: self.annotations,
        }
    }
}

/// `match` or `exclude`. `Ok(None)`: matches nothing meshgate sees.
fn convert_block(
    block: &Value,
    path: &str,
    exclude: bool,
    notes: &mut Vec<String>,
) -> Result<Option<Desc>, String> {
    user_filters(block, path)?;
    let forms: Vec<&str> = ["resources", "any", "all"]
        .into_iter()
        .filter(|f| block.get(*f).is_some_and(|v| !v.is_null()))
        .collect();
    if forms.len() > 1 {
        return Err(format!(
            "{path}: sets {} together; only one of resources, any, all can be converted",
            forms.join(" and ")
        ));
    }
    match forms.first().copied() {
        None => {
            if exclude {
                Ok(None)
            } else {
                Err(format!("{path}: no resources"))
            }
        }
        Some("resources") => {
            let d = description(
                block.get("resources").unwrap_or(&Value::Null),
                &format!("{path}.resources"),
                notes,
            )?;
            Ok((!d.matches_nothing).then_some(d))
        }
        Some(list) => {
            let Some(items) = block.get(list).and_then(Value::as_array) else {
                return Err(format!("{path}.{list}: must be a list"));
            };
            let mut descs = Vec::new();
            for (i, entry) in items.iter().enumerate() {
                let p = format!("{path}.{list}[{i}]");
                user_filters(entry, &p)?;
                let d = match entry.get("resources") {
                    Some(r) => description(r, &format!("{p}.resources"), notes)?,
                    None => Desc::default(),
                };
                descs.push(d);
            }
            if list == "any" {
                let kept: Vec<Desc> = descs.into_iter().filter(|d| !d.matches_nothing).collect();
                if kept.is_empty() {
                    Ok(None)
                } else {
                    union(kept, &format!("{path}.any")).map(Some)
                }
            } else if descs.iter().any(|d| d.matches_nothing) || descs.is_empty() {
                Ok(None)
            } else {
                intersect(descs, &format!("{path}.all")).map(Some)
            }
        }
    }
}

/// Filters on the requesting user cannot be converted.
fn user_filters(v: &Value, path: &str) -> Result<(), String> {
    for f in ["subjects", "roles", "clusterRoles"] {
        if v.get(f)
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
        {
            return Err(format!(
                "{path}.{f}: matching on the requesting user is not supported"
            ));
        }
    }
    Ok(())
}

fn string_list(v: Option<&Value>, path: &str) -> Result<Vec<String>, String> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("{path}[{i}]: must be a string"))
            })
            .collect(),
        Some(_) => Err(format!("{path}: must be a list of strings")),
    }
}

fn selector(v: Option<&Value>, path: &str) -> Result<Option<LabelSelector>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(s) => serde_json::from_value(s.clone())
            .map(Some)
            .map_err(|e| format!("{path}: {e}")),
    }
}

/// One `resources` block.
fn description(r: &Value, path: &str, notes: &mut Vec<String>) -> Result<Desc, String> {
    let mut names = string_list(r.get("names"), &format!("{path}.names"))?;
    match r.get("name") {
        None | Some(Value::Null) => {}
        Some(Value::String(n)) if n.is_empty() => {}
        Some(Value::String(n)) => {
            if !names.is_empty() {
                return Err(format!(
                    "{path}.name: set together with names (both must hold); not converted"
                ));
            }
            names.push(n.clone());
        }
        Some(_) => return Err(format!("{path}.name: must be a string")),
    }
    let annotations = match r.get("annotations") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| {
                v.as_str()
                    .map(|v| (k.clone(), v.to_owned()))
                    .ok_or_else(|| format!("{path}.annotations[{k:?}]: must be a string"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(format!("{path}.annotations: must be a map of strings")),
    };
    let raw_kinds = string_list(r.get("kinds"), &format!("{path}.kinds"))?;
    let mut kinds = Vec::new();
    for (i, raw) in raw_kinds.iter().enumerate() {
        match normalize_kind(raw) {
            Ok(k) => {
                if !kinds.contains(&k) {
                    kinds.push(k);
                }
            }
            Err(why) => notes.push(format!("{path}.kinds[{i}]: {raw:?} dropped: {why}")),
        }
    }
    let raw_ops = string_list(r.get("operations"), &format!("{path}.operations"))?;
    let mut operations = Vec::new();
    for (i, op) in raw_ops.iter().enumerate() {
        match op.as_str() {
            "CREATE" => operations.push(Operation::Create),
            "UPDATE" => operations.push(Operation::Update),
            other => notes.push(format!(
                "{path}.operations[{i}]: {other:?} dropped: meshgate mutates on CREATE and UPDATE only"
            )),
        }
    }
    let namespaces = string_list(r.get("namespaces"), &format!("{path}.namespaces"))?;
    Ok(Desc {
        matches_nothing: (!raw_kinds.is_empty() && kinds.is_empty())
            || (!raw_ops.is_empty() && operations.is_empty()),
        kinds,
        namespaces,
        namespace_selector: selector(
            r.get("namespaceSelector"),
            &format!("{path}.namespaceSelector"),
        )?,
        selector: selector(r.get("selector"), &format!("{path}.selector"))?,
        operations,
        names,
        annotations,
    })
}

/// `Pod`, `v1/Pod`, `*/Pod`, `apps/v1/Deployment`, `batch/*/Job` → the bare kind; any other
/// kind → meshgate's entry (`Service`, `v1/ConfigMap`, `example.com/v1/Widget`, `*`).
fn normalize_kind(raw: &str) -> Result<String, String> {
    let upper = |s: &str| s.starts_with(|c: char| c.is_ascii_uppercase()) || s == "*";
    let parts: Vec<&str> = raw.split('/').collect();
    let (group, kind, subresource) = match parts.as_slice() {
        [k] => (None, *k, None),
        [_, k] if upper(k) => (None, *k, None),
        [k, s] => (None, *k, Some(*s)),
        [g, _, k] if upper(k) => (Some(*g), *k, None),
        [_, k, s] => (None, *k, Some(*s)),
        [g, _, k, s] => (Some(*g), *k, Some(*s)),
        _ => return Err("not a kind".to_owned()),
    };
    if subresource.is_some() {
        return Err("subresources are not mutated by meshgate".to_owned());
    }
    let Some(k) = SUPPORTED_KINDS
        .iter()
        .copied()
        .find(|k| *k == kind && !kind.contains(['*', '?']))
    else {
        // Any other kind: the entry as written (meshgate's syntax is Kyverno's).
        crate::policy::parse_kind(raw)?;
        return Ok(raw.to_owned());
    };
    let expected = match k {
        "Pod" => "",
        "Job" | "CronJob" => "batch",
        _ => "apps",
    };
    if let Some(g) = group
        && g != "*"
        && g != expected
        && !(expected.is_empty() && g == "core")
    {
        return Err(format!("group {g:?} is not the group of {k}"));
    }
    Ok(k.to_owned())
}

/// The fields in which several descriptions differ.
fn differing(descs: &[Desc]) -> Vec<&'static str> {
    let Some(first) = descs.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let all_equal = |f: &dyn Fn(&Desc) -> bool| descs.iter().all(f);
    if !all_equal(&|d| d.kinds == first.kinds) {
        out.push("kinds");
    }
    if !all_equal(&|d| d.namespaces == first.namespaces) {
        out.push("namespaces");
    }
    if !all_equal(&|d| d.namespace_selector == first.namespace_selector) {
        out.push("namespaceSelector");
    }
    if !all_equal(&|d| d.selector == first.selector) {
        out.push("selector");
    }
    if !all_equal(&|d| d.operations == first.operations) {
        out.push("operations");
    }
    if !all_equal(&|d| d.names == first.names) {
        out.push("names");
    }
    if !all_equal(&|d| d.annotations == first.annotations) {
        out.push("annotations");
    }
    out
}

fn union_list<T: Clone + PartialEq>(lists: impl Iterator<Item = Vec<T>>) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for list in lists {
        // An empty list does not constrain: the union does not either.
        if list.is_empty() {
            return Vec::new();
        }
        for item in list {
            if !out.contains(&item) {
                out.push(item);
            }
        }
    }
    out
}

/// `any`: an OR of entries, exact when they differ in one list field only.
fn union(descs: Vec<Desc>, path: &str) -> Result<Desc, String> {
    let diff = differing(&descs);
    let Some(first) = descs.first().cloned() else {
        return Err(format!("{path}: no entries"));
    };
    match diff.as_slice() {
        [] => Ok(first),
        [field @ ("kinds" | "namespaces" | "operations" | "names")] => {
            let mut out = first;
            match *field {
                "kinds" => out.kinds = union_list(descs.into_iter().map(|d| d.kinds)),
                "namespaces" => {
                    out.namespaces = union_list(descs.into_iter().map(|d| d.namespaces));
                }
                "names" => out.names = union_list(descs.into_iter().map(|d| d.names)),
                _ => out.operations = union_list(descs.into_iter().map(|d| d.operations)),
            }
            Ok(out)
        }
        fields => Err(format!(
            "{path}: its {} entries differ in {}; a MutationPolicy has one match block whose fields must all hold, so an OR of entries is only converted when they differ in kinds, namespaces, operations or names alone (split the Kyverno rule into one rule per entry)",
            descs.len(),
            fields.join(" and ")
        )),
    }
}

fn intersect_list<T: Clone + PartialEq>(a: Vec<T>, b: Vec<T>) -> Vec<T> {
    if a.is_empty() {
        return b;
    }
    if b.is_empty() {
        return a;
    }
    a.into_iter().filter(|x| b.contains(x)).collect()
}

fn combine_selectors(
    a: Option<LabelSelector>,
    b: Option<LabelSelector>,
    path: &str,
) -> Result<Option<LabelSelector>, String> {
    match (a, b) {
        (None, s) | (s, None) => Ok(s),
        (Some(mut a), Some(b)) => {
            for (k, v) in b.match_labels {
                if let Some(existing) = a.match_labels.get(&k)
                    && existing != &v
                {
                    return Err(format!(
                        "{path}: entries require label {k:?} to be both {existing:?} and {v:?}: never matches"
                    ));
                }
                a.match_labels.insert(k, v);
            }
            a.match_expressions.extend(b.match_expressions);
            Ok(Some(a))
        }
    }
}

/// `all`: an AND of entries.
fn intersect(descs: Vec<Desc>, path: &str) -> Result<Desc, String> {
    let mut out = Desc::default();
    for d in descs {
        let had_kinds = !out.kinds.is_empty() && !d.kinds.is_empty();
        out.kinds = intersect_list(out.kinds, d.kinds);
        if had_kinds && out.kinds.is_empty() {
            return Err(format!(
                "{path}: the entries have no kind in common: never matches"
            ));
        }
        let had_ops = !out.operations.is_empty() && !d.operations.is_empty();
        out.operations = intersect_list(out.operations, d.operations);
        if had_ops && out.operations.is_empty() {
            return Err(format!(
                "{path}: the entries have no operation in common: never matches"
            ));
        }
        if !out.namespaces.is_empty() && !d.namespaces.is_empty() {
            let patterns = |l: &[String]| l.iter().any(|n| n.contains(['*', '?']));
            if patterns(&out.namespaces) || patterns(&d.namespaces) {
                let same: BTreeSet<&String> = out.namespaces.iter().collect();
                if same != d.namespaces.iter().collect::<BTreeSet<_>>() {
                    return Err(format!(
                        "{path}: namespace patterns in several entries cannot be intersected"
                    ));
                }
            } else {
                out.namespaces = intersect_list(out.namespaces, d.namespaces);
                if out.namespaces.is_empty() {
                    return Err(format!(
                        "{path}: the entries have no namespace in common: never matches"
                    ));
                }
            }
        } else if out.namespaces.is_empty() {
            out.namespaces = d.namespaces;
        }
        if !out.names.is_empty() && !d.names.is_empty() && out.names != d.names {
            return Err(format!(
                "{path}: names in several entries cannot be intersected"
            ));
        }
        if out.names.is_empty() {
            out.names = d.names;
        }
        for (k, v) in d.annotations {
            if let Some(existing) = out.annotations.get(&k)
                && existing != &v
            {
                return Err(format!(
                    "{path}: entries require annotation {k:?} to match both {existing:?} and {v:?}; not converted"
                ));
            }
            out.annotations.insert(k, v);
        }
        out.namespace_selector =
            combine_selectors(out.namespace_selector, d.namespace_selector, path)?;
        out.selector = combine_selectors(out.selector, d.selector, path)?;
    }
    Ok(out)
}

/// `patchesJson6902`: a YAML or JSON string of operations, or a list.
///
/// Kyverno substitutes the variables of the string (its only form in Kyverno's schema) before
/// it parses it, so a value that is one variable in quotes (`value: "{{ element.port }}"`) is
/// text there: `"8080"`, not `8080`, and `null` is `"null"`. Such values become
/// `{{ to_string(...) }}`, which writes the same text (JMESPath's `to_string`: a string as is,
/// anything else as JSON), where meshgate would keep the value's type.
fn parse_json6902(v: &Value, path: &str) -> Result<Vec<JsonPatchOperation>, String> {
    let list = match v {
        Value::String(s) => {
            let mut list = meshgate_api::yaml::from_str::<Value>(s)
                .map_err(|e| format!("{path}: not YAML or JSON: {e}"))?;
            if let Value::Array(items) = &mut list {
                for value in items.iter_mut().filter_map(|op| op.get_mut("value")) {
                    whole_variables_as_text(value);
                }
            }
            list
        }
        other => other.clone(),
    };
    let Value::Array(items) = list else {
        return Err(format!("{path}: must be a list of operations"));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, op)| {
            serde_json::from_value::<JsonPatchOperation>(op)
                .map_err(|e| format!("{path}[{i}]: {e}"))
        })
        .collect()
}

/// Rewrites every string of `v` that is one variable (`{{ x }}`, `{{- x }}`, nested ones
/// included) to `{{ to_string(x) }}` (see [`parse_json6902`]).
fn whole_variables_as_text(v: &mut Value) {
    match v {
        Value::String(s) => {
            if let Some(inner) = whole_variable(s) {
                let (dash, expression) = match inner.trim_start().strip_prefix('-') {
                    Some(rest) => ("-", rest.trim()),
                    None => ("", inner.trim()),
                };
                *s = format!("{{{{{dash} to_string({expression}) }}}}");
            }
        }
        Value::Array(items) => items.iter_mut().for_each(whole_variables_as_text),
        Value::Object(map) => map.values_mut().for_each(whole_variables_as_text),
        _ => {}
    }
}

/// The text between the braces when `s` is one variable and nothing else: it opens with `{{`
/// and that variable (inner `{{ }}` nested in it) closes at its very end.
fn whole_variable(s: &str) -> Option<&str> {
    let inner = s.strip_prefix("{{")?.strip_suffix("}}")?;
    let mut depth = 1usize;
    let mut rest = inner;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("{{") {
            depth += 1;
            rest = r;
        } else if let Some(r) = rest.strip_prefix("}}") {
            depth -= 1;
            if depth == 0 {
                return None;
            }
            rest = r;
        } else {
            let mut chars = rest.chars();
            chars.next();
            rest = chars.as_str();
        }
    }
    (depth == 1 && !inner.trim().is_empty()).then_some(inner)
}

/// Unescapes one RFC 6901 segment.
fn unescape(segment: &str) -> String {
    segment.replace("~1", "/").replace("~0", "~")
}

/// JSON operations as mutations, in order: adds of one annotation or label become metadata
/// mutations (which create the map like Kyverno's lenient `add`), the rest stay JSON patches.
fn json_mutations(ops: Vec<JsonPatchOperation>) -> Vec<Mutation> {
    let mut out: Vec<Mutation> = Vec::new();
    for op in ops {
        let metadata = match (&op.op, &op.value) {
            (JsonPatchOp::Add, Some(Value::String(v))) => {
                let segments: Vec<&str> = op.path.split('/').collect();
                match segments.as_slice() {
                    ["", "metadata", field @ ("annotations" | "labels"), key] => {
                        Some((*field, unescape(key), v.clone()))
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        if let Some((field, key, value)) = metadata {
            if let Some(m) = out.last_mut().and_then(|m| metadata_slot(m, field)) {
                m.values.insert(key, value);
            } else {
                let meta = MetadataMutation {
                    values: [(key, value)].into(),
                    on_conflict: OnConflict::Overwrite,
                };
                out.push(if field == "annotations" {
                    Mutation {
                        annotations: Some(meta),
                        ..Default::default()
                    }
                } else {
                    Mutation {
                        labels: Some(meta),
                        ..Default::default()
                    }
                });
            }
            continue;
        }
        match out.last_mut().and_then(|m| m.json_patch.as_mut()) {
            Some(list) => list.push(op),
            // Kyverno's leniencies (evanphx/json-patch ApplyOptions as Kyverno sets them).
            None => out.push(Mutation {
                json_patch: Some(vec![op]),
                json_patch_options: Some(kyverno_json_options()),
                ..Default::default()
            }),
        }
    }
    out
}

/// Kyverno's leniencies (evanphx/json-patch ApplyOptions as Kyverno sets them).
fn kyverno_json_options() -> JsonPatchOptions {
    JsonPatchOptions {
        negative_indices: true,
        allow_missing_path_on_remove: true,
        ensure_path_exists_on_add: true,
    }
}

/// Kyverno `preconditions`: `{any, all}`, or a list (all of them).
fn conditions(v: &Value, path: &str) -> Result<Conditions, String> {
    let list = |v: Option<&Value>, at: &str| -> Result<Vec<PreCondition>, String> {
        v.filter(|v| !v.is_null())
            .map(|v| {
                v.as_array()
                    .ok_or_else(|| format!("{at}: must be a list"))?
                    .iter()
                    .enumerate()
                    .map(|(i, c)| condition(c, &format!("{at}[{i}]")))
                    .collect()
            })
            .transpose()
            .map(Option::unwrap_or_default)
    };
    match v {
        Value::Array(_) => Ok(Conditions {
            any: Vec::new(),
            all: list(Some(v), path)?,
        }),
        Value::Object(m) => {
            if let Some(other) = m.keys().find(|k| *k != "any" && *k != "all") {
                return Err(format!(
                    "{path}.{other}: not a precondition field (any, all)"
                ));
            }
            Ok(Conditions {
                any: list(m.get("any"), &format!("{path}.any"))?,
                all: list(m.get("all"), &format!("{path}.all"))?,
            })
        }
        _ => Err(format!("{path}: must be {{any, all}} or a list")),
    }
}

fn condition(v: &Value, path: &str) -> Result<PreCondition, String> {
    let op = v
        .get("operator")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{path}.operator: required"))?;
    let operator = serde_json::from_value::<ConditionOperator>(Value::String(op.to_owned()))
        .map_err(|_| {
            format!(
                "{path}.operator: {op:?} is not supported (Equals, NotEquals, In, NotIn, AnyIn, AllIn, AnyNotIn, AllNotIn, GreaterThan, GreaterThanOrEquals, LessThan, LessThanOrEquals)"
            )
        })?;
    let key = v
        .get("key")
        .cloned()
        .ok_or_else(|| format!("{path}.key: required"))?;
    Ok(PreCondition {
        key,
        operator,
        value: v.get("value").cloned(),
        message: v.get("message").and_then(Value::as_str).map(str::to_owned),
    })
}

/// Kyverno `context` entries: `variable`, `configMap` and `apiCall` (GET of an API path)
/// entries convert; the others are refused, naming the entry.
fn context_entries(v: &Value, path: &str) -> Result<Vec<ContextEntry>, String> {
    let list = v
        .as_array()
        .ok_or_else(|| format!("{path}: must be a list"))?;
    let mut out = Vec::new();
    for (i, e) in list.iter().enumerate() {
        let name = e.get("name").and_then(Value::as_str).unwrap_or_default();
        let at = format!("{path}[{i}]");
        if name.is_empty() {
            return Err(format!("{at}.name: required"));
        }
        let at = format!("{at} ({name})");
        if let Some(cm) = e.get("configMap").filter(|v| !v.is_null()) {
            out.push(config_map_entry(name, cm, &at)?);
            continue;
        }
        if let Some(call) = e.get("apiCall").filter(|v| !v.is_null()) {
            out.push(api_call_entry(name, call, &at)?);
            continue;
        }
        for (kind, why) in [
            ("globalReference", "reads a Kyverno GlobalContextEntry"),
            ("imageRegistry", "reads an image registry at admission"),
        ] {
            if e.get(kind).is_some_and(|v| !v.is_null()) {
                return Err(format!(
                    "{at}.{kind}: not converted: the entry {why}, which meshgate does not do (variable, configMap and apiCall entries convert)"
                ));
            }
        }
        let Some(var) = e.get("variable").filter(|v| v.is_object()) else {
            return Err(format!(
                "{at}: no variable, configMap or apiCall (the entries that convert)"
            ));
        };
        if let Some(other) = var
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
            .find(|k| !["value", "jmesPath", "default"].contains(&k.as_str()))
        {
            return Err(format!("{at}.variable.{other}: not a variable field"));
        }
        let jmes_path = match var.get("jmesPath") {
            None | Some(Value::Null) => None,
            Some(Value::String(p)) => Some(p.clone()),
            Some(_) => return Err(format!("{at}.variable.jmesPath: must be a string")),
        };
        out.push(ContextEntry {
            name: name.to_owned(),
            variable: Some(ContextVariable {
                value: var.get("value").filter(|v| !v.is_null()).cloned(),
                jmes_path,
                default: var.get("default").filter(|v| !v.is_null()).cloned(),
            }),
            config_map: None,
            api_call: None,
        });
    }
    Ok(out)
}

/// A Kyverno `configMap` context entry: `name` and `namespace`, both literal (the webhook reads
/// only the ConfigMaps granted to it by name).
fn config_map_entry(name: &str, cm: &Value, at: &str) -> Result<ContextEntry, String> {
    let field = |f: &str| -> Result<String, String> {
        match cm.get(f) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(v)) if v.contains("{{") => Err(format!(
                "{at}.configMap.{f}: {v:?}: not converted: a ConfigMap named by a variable could be any ConfigMap, and meshgate's webhook reads only the ConfigMaps granted to it by name"
            )),
            Some(Value::String(v)) => Ok(v.clone()),
            Some(_) => Err(format!("{at}.configMap.{f}: must be a string")),
        }
    };
    let config_map = ContextConfigMap {
        name: field("name")?,
        namespace: field("namespace")?,
    };
    if config_map.name.is_empty() {
        return Err(format!("{at}.configMap.name: required"));
    }
    Ok(ContextEntry {
        name: name.to_owned(),
        variable: None,
        config_map: Some(config_map),
        api_call: None,
    })
}

/// A Kyverno `apiCall` context entry: a GET of `urlPath` (with `jmesPath` and `default`). A
/// POST, `data` and a `service` call are refused, naming the field: meshgate's webhook reads the
/// API server only.
fn api_call_entry(name: &str, call: &Value, at: &str) -> Result<ContextEntry, String> {
    let Some(fields) = call.as_object() else {
        return Err(format!("{at}.apiCall: must be an object"));
    };
    for (field, value) in fields {
        match (field.as_str(), value) {
            (_, Value::Null) | ("urlPath" | "jmesPath" | "default", _) => {}
            ("method", Value::String(m)) if m == "GET" => {}
            ("method", other) => {
                return Err(format!(
                    "{at}.apiCall.method: not converted: {other}: meshgate's webhook only reads (GET)"
                ));
            }
            ("data", Value::Array(d)) if d.is_empty() => {}
            ("service", _) | ("data", _) => {
                return Err(format!(
                    "{at}.apiCall.{field}: not converted: meshgate's webhook calls only the API server, with GET"
                ));
            }
            (other, _) => return Err(format!("{at}.apiCall.{other}: not an apiCall field")),
        }
    }
    let text = |f: &str| match call.get(f) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(v)) => Ok(Some(v.clone())),
        Some(_) => Err(format!("{at}.apiCall.{f}: must be a string")),
    };
    let url_path = text("urlPath")?.filter(|p| !p.is_empty()).ok_or_else(|| {
        format!("{at}.apiCall.urlPath: required (a service call is not converted)")
    })?;
    Ok(ContextEntry {
        name: name.to_owned(),
        variable: None,
        config_map: None,
        api_call: Some(meshgate_api::mutation_policy::ContextApiCall {
            url_path,
            jmes_path: text("jmesPath")?,
            default: call.get("default").filter(|v| !v.is_null()).cloned(),
            confined_to: None,
        }),
    })
}

/// `mutate.foreach` entries as mutations, one each.
fn foreach_mutations(v: &Value, path: &str) -> Result<Vec<Mutation>, String> {
    let entries = v
        .as_array()
        .ok_or_else(|| format!("{path}: must be a list"))?;
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let at = format!("{path}[{i}]");
        if let Some(nested) = e.get("foreach").filter(|v| !is_empty_value(v)) {
            out.push(nested_foreach(e, nested, &at)?);
            continue;
        }
        let context = match e.get("context").filter(|v| !is_empty_value(v)) {
            Some(c) => context_entries(c, &format!("{at}.context"))?,
            None => Vec::new(),
        };
        // Kyverno (`pkg/engine/handlers/mutation/common.go`): a patchStrategicMerge foreach
        // visits its list last element first unless `order` says otherwise.
        let explicit = foreach_order(e, &at)?;
        let list = foreach_list(e, &at)?;
        let preconditions = e
            .get("preconditions")
            .filter(|v| !is_empty_value(v))
            .map(|p| conditions(p, &format!("{at}.preconditions")))
            .transpose()?;
        let smp = e.get("patchStrategicMerge").filter(|v| !v.is_null());
        let json = e.get("patchesJson6902").filter(|v| !v.is_null());
        let mut m = match (smp, json) {
            (Some(s), None) => {
                if !s.is_object() {
                    return Err(format!("{at}.patchStrategicMerge: must be an object"));
                }
                Mutation {
                    strategic_merge: Some(s.clone()),
                    ..Default::default()
                }
            }
            (None, Some(j)) => Mutation {
                json_patch: Some(parse_json6902(j, &format!("{at}.patchesJson6902"))?),
                json_patch_options: Some(kyverno_json_options()),
                ..Default::default()
            },
            _ => {
                return Err(format!(
                    "{at}: set one of patchStrategicMerge, patchesJson6902"
                ));
            }
        };
        let order = match explicit {
            Some(o) => o,
            None if m.strategic_merge.is_some() => ForEachOrder::Descending,
            None => ForEachOrder::Ascending,
        };
        m.foreach = Some(ForEach {
            list,
            preconditions,
            order: (order == ForEachOrder::Descending).then_some(order),
            context,
        });
        out.push(m);
    }
    Ok(out)
}

/// A foreach entry's `order` as written: `None` when unset.
fn foreach_order(e: &Value, at: &str) -> Result<Option<ForEachOrder>, String> {
    match e.get("order") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(o)) if o == "Ascending" => Ok(Some(ForEachOrder::Ascending)),
        Some(Value::String(o)) if o == "Descending" => Ok(Some(ForEachOrder::Descending)),
        Some(other) => Err(format!(
            "{at}.order: {other} is not an order (Ascending, Descending)"
        )),
    }
}

/// A foreach entry's `list` (a JMESPath expression), which Kyverno requires.
fn foreach_list(e: &Value, at: &str) -> Result<String, String> {
    e.get("list")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| format!("{at}.list: required"))
}

/// A foreach entry with a nested `foreach`: one mutation with the entry's `list` and `order`
/// whose `mutations` are the nested entries, applied per element (Kyverno,
/// `pkg/engine/handlers/mutation/common.go`: the nested entries run at the next nesting level,
/// `element<N>` per level; not reversed unless `order` says so, as the entry has no strategic
/// merge). Kyverno refuses such an entry with anything else ("a nested foreach cannot contain
/// other declarations", `pkg/policy/mutate/validate.go`), and so does the conversion.
fn nested_foreach(e: &Value, nested: &Value, at: &str) -> Result<Mutation, String> {
    for field in [
        "context",
        "preconditions",
        "patchStrategicMerge",
        "patchesJson6902",
    ] {
        if e.get(field).is_some_and(|v| !is_empty_value(v)) {
            return Err(format!(
                "{at}.{field}: an entry with a nested foreach cannot set {field} (Kyverno refuses it)"
            ));
        }
    }
    // Ascending is the model's default.
    let order = foreach_order(e, at)?.filter(|o| *o == ForEachOrder::Descending);
    let list = foreach_list(e, at)?;
    let mutations = foreach_mutations(nested, &format!("{at}.foreach"))?;
    if mutations.is_empty() {
        return Err(format!("{at}.foreach: no entries"));
    }
    Ok(Mutation {
        foreach: Some(ForEach {
            list,
            order,
            ..Default::default()
        }),
        mutations,
        ..Default::default()
    })
}

fn metadata_slot<'m>(m: &'m mut Mutation, field: &str) -> Option<&'m mut MetadataMutation> {
    if field == "annotations" {
        m.annotations.as_mut()
    } else {
        m.labels.as_mut()
    }
}

/// Kyverno applies a policy's mutate rules in the order they are written, each to the result of
/// the one before (`pkg/engine/mutation.go`); MutationPolicies apply in name order
/// (`policy::apply`). Where the rules' `<policy>-<rule>` names do not sort in rule order, each
/// name gets its rule's position: `<policy>-<NN>-<rule>`, zero-padded so that name order is rule
/// order.
fn keep_rule_order(policy: &str, policies: &mut [(String, MutationPolicySpec)]) {
    if policies.windows(2).all(|w| w[0].0 < w[1].0) {
        return;
    }
    let width = policies.len().to_string().len();
    let mut names = BTreeSet::new();
    for (i, (name, _)) in policies.iter_mut().enumerate() {
        let rule = name
            .strip_prefix(&dns1123_name(policy, ""))
            .unwrap_or(name)
            .trim_start_matches('-')
            .to_owned();
        *name = unique(
            dns1123_name(policy, &format!("{:0width$}-{rule}", i + 1)),
            &mut names,
        );
    }
}

/// `<policy>-<rule>` as a DNS-1123 label.
fn dns1123_name(policy: &str, rule: &str) -> String {
    let raw = format!("{policy}-{rule}").to_ascii_lowercase();
    let mut name = String::new();
    for c in raw.chars() {
        if c.is_ascii_alphanumeric() {
            name.push(c);
        } else if !name.is_empty() && !name.ends_with('-') {
            name.push('-');
        }
    }
    let name = name.trim_end_matches('-').to_owned();
    if name.is_empty() {
        return format!("kyverno-{:08x}", fnv1a(&raw));
    }
    if name.len() <= 63 {
        return name;
    }
    shorten(&name, &format!("{:08x}", fnv1a(&raw)))
}

/// `name` cut so that `<name>-<suffix>` fits 63 characters.
fn shorten(name: &str, suffix: &str) -> String {
    let room = 63 - suffix.len() - 1;
    let head: String = name.chars().take(room).collect();
    format!("{}-{suffix}", head.trim_end_matches('-'))
}

fn unique(name: String, taken: &mut BTreeSet<String>) -> String {
    let mut candidate = name.clone();
    let mut n = 2;
    while taken.contains(&candidate) {
        candidate = if name.len() + 1 + n.to_string().len() <= 63 {
            format!("{name}-{n}")
        } else {
            shorten(&name, &n.to_string())
        };
        n += 1;
    }
    taken.insert(candidate.clone());
    candidate
}

fn fnv1a(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod text_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_patch_string_values_of_one_variable_become_text() {
        assert_eq!(whole_variable("{{ a }}"), Some(" a "));
        assert_eq!(
            whole_variable(r#"{{ images.containers."{{ element.name }}".tag }}"#),
            Some(r#" images.containers."{{ element.name }}".tag "#)
        );
        assert_eq!(whole_variable("{{ a }}{{ b }}"), None);
        assert_eq!(whole_variable("x{{ a }}"), None);
        assert_eq!(whole_variable("{{ a }} "), None);
        assert_eq!(whole_variable("{{}}"), None);

        let ops = parse_json6902(
            &json!(
                "- op: add\n  path: /metadata/annotations/port\n  value: \"{{ element.containerPort }}\"\n- op: add\n  path: /spec/x\n  value:\n    name: \"{{- element.name }}\"\n    text: \"port {{ element.containerPort }}\"\n    n: 3\n"
            ),
            "p",
        )
        .unwrap();
        assert_eq!(
            ops[0].value,
            Some(json!("{{ to_string(element.containerPort) }}"))
        );
        assert_eq!(
            ops[1].value,
            Some(json!({
                "name": "{{- to_string(element.name) }}",
                "text": "port {{ element.containerPort }}",
                "n": 3
            }))
        );
        // A list (not Kyverno's form) keeps the value's type.
        let ops = parse_json6902(
            &json!([{"op": "add", "path": "/a", "value": "{{ element.containerPort }}"}]),
            "p",
        )
        .unwrap();
        assert_eq!(ops[0].value, Some(json!("{{ element.containerPort }}")));
    }
}

//! The `MutationPolicy` engine: which objects a policy applies to, and what its mutations do.
//!
//! Everything here is a pure function of `serde_json::Value`s and policy specs; the webhook, the
//! existing-workload controller and `meshgate render` all call the same functions.
//!
//! # Matching ([`policy_matches`])
//! * Every field set in `match` must hold. Empty `kinds` means `[Pod]`, empty `operations` means
//!   `[CREATE]`. `namespaces` entries are wildcard patterns (`*`, `?`). `namespaceSelector` sees
//!   the namespace's labels (given by the caller), `objectSelector` the object's own
//!   `metadata.labels` — for a workload, the workload's labels, not its pod template's (Kyverno
//!   does the same).
//! * `exclude` removes what its block matches; in `exclude`, an empty field does not constrain
//!   (an empty `kinds` does not mean Pod, an empty `operations` does not mean CREATE).
//! * `kinds` entries are `Kind`, `version/Kind` (core group) or `group/version/Kind`, each
//!   part a wildcard pattern; `*` is every kind ([`parse_kind`]). Pods and the workloads
//!   Deployment, StatefulSet, DaemonSet, ReplicaSet, Job and CronJob named as such are
//!   *Pod-shaped* (their `apiVersion`, when present, must be of the kind's group): a workload
//!   matches when its kind is named, or when `podTemplates` is set and the policy's kinds
//!   include Pod (Kyverno's auto-generated pod-controller rules; an `exclude` naming Pod then
//!   excludes those workloads too). Any other kind, any kind matched by a wildcard, and every
//!   object of a policy with `target: Object` is mutated as the object itself
//!   ([`policy_target`]).
//! * A cluster-scoped object (no namespace in the request) matches no `namespaces` and no
//!   `namespaceSelector`; a Namespace is its own namespace, with its own labels.
//! * An object labelled or annotated `meshgate.dev/inject: "false"`, and a workload whose pod
//!   template is ([`template_opted_out`]), is never mutated by a policy, whatever its target.
//!
//! # Where mutations apply (`spec.target`)
//! With `target: Pod` (the default), Pod-shaped matches are written against a Pod (`metadata`,
//! `spec`): for a Pod they apply to the object; for a workload to its pod template:
//! `spec.template`, or `spec.jobTemplate.spec.template` for a CronJob (see
//! [`pod_template_path`]). A workload without that template is left alone. For every other
//! match they apply to the object itself.
//!
//! With `target: Object`, every matched object is mutated as itself, workloads included: a
//! Deployment's patch paths start at the Deployment (`spec.template.spec.volumes`,
//! `metadata.annotations` are the Deployment's own), `request.object` is the Deployment and
//! `images` point into its template (`/spec/template/spec/containers/0/image`). That is what
//! a Kyverno rule naming a workload does (`pkg/engine/mutate/mutation.go` patches the resource
//! the rule matched); `import kyverno` converts such rules to it. The target is the policy's,
//! not each mutation's: its variables, preconditions and `foreach` lists read one
//! `request.object`. `podTemplates` (a Pod policy applied to pod templates) is refused with
//! it by [`validate`].
//!
//! # Applying ([`apply`])
//! Policies apply in the order of their names (a stable sort: equal names keep the caller's
//! order), each to the result of the previous ones, their mutations in order. A policy "changed"
//! the object when the object differs after its mutations; its name is reported and its
//! `warning` is returned as `"<name>: <warning>"`. Nothing applied: the object comes back
//! unchanged with empty lists. Each policy applies or fails on its own: a mutation that cannot
//! be applied leaves the object as that policy found it (none of its mutations is kept), the
//! other policies still apply, and the failure is returned in [`Applied::failed`] as a
//! [`PolicyError`] naming the policy, the mutation index and, for JSON patches, the operation.
//!
//! Every mutation kind is idempotent — applying the same policies to the result changes
//! nothing — except JSON patches, whose idempotency is the author's responsibility (`test`
//! operations help), and except anchor conditions that only hold because of what a mutation
//! writes (a `(name): "*"` template placed before an element that adds a container selects that
//! container on the next application; put such templates after the elements they should see).
//!
//! * Variables, `preconditions` and `foreach` (Kyverno's, with the variables that need no API
//!   call): see the `variables` module. A mutation with `preconditions` applies only when they
//!   hold; with `foreach`, once per element of its list (`null` elements skipped), in
//!   `order` (`Descending`: last first, each element keeping its `elementIndex`); `context`
//!   entries are evaluated first (a foreach's per element, before its preconditions); strings
//!   with `{{ }}` are substituted before the mutation applies. An evaluation error (a missing
//!   key, a list that is not a list) is the policy's failure, like any other. A mutation with
//!   `mutations` applies them in order instead of a patch: once (after its context and
//!   preconditions: Kyverno's rule preconditions over several foreach entries), or per element
//!   of its foreach (Kyverno's nested foreach, with `element0`, `element1` … per level).
//! * `match`/`exclude` `names` (the object's name, or `generateName`) and `annotations` (every
//!   pair matches some annotation) are wildcard patterns, as Kyverno's, on the object itself.
//! * `annotations` / `labels`: set each value; `onConflict: Keep` leaves a key that already has
//!   a value, `Overwrite` (the default) replaces it.
//! * `jsonPatch`: RFC 6902, strictly (an `add` under a missing parent, a `remove` of a missing
//!   path, a negative index and a failed `test` are errors), unless `jsonPatchOptions` turns on
//!   Kyverno's leniencies (see [`json6902`]; `import kyverno` sets them).
//! * `strategicMerge`: a strategic-merge patch with Kyverno's anchors:
//!   - maps merge recursively; a `null` value deletes the key; a map patch creates no empty map
//!     where there was none (a literal `{}` does);
//!   - lists of scalars are replaced;
//!   - lists of objects are merged by their merge key: for the Pod schema's associative lists the
//!     Kubernetes `patchMergeKey` (`name` for containers, initContainers, ephemeralContainers,
//!     volumes, env, imagePullSecrets, resourceClaims, schedulingGates; `containerPort` for
//!     ports; `mountPath` for volumeMounts; `devicePath` for volumeDevices; `ip` for
//!     hostAliases; `conditionType` for readinessGates; `topologyKey` for
//!     topologySpreadConstraints), for any other list `name`. An element with the key of an
//!     existing element is merged into it, a new one is added; two elements with the same
//!     key in one patch are an error. Order, as Kyverno's strategic merge (kustomize's, with
//!     list elements prepended): the elements the patch names by merge key come first, in
//!     patch order, then the list's other elements in their order; a container added to
//!     `containers` becomes the first, which kubectl takes as the pod's default container. An element of one of the Pod lists above without its
//!     merge key (and without a conditional anchor) is an error; any other list whose elements
//!     lack `name` is replaced, like a strategic merge of a list without merge key
//!     (`tolerations`, for example);
//!   - `+(key)`: add if absent — applied only when the resource has no `key` at that place
//!     (a key present with any value, `null` included, counts as present);
//!   - `(key)`: conditional anchor — the resource must have `key` with a value matching the
//!     anchor's value (see below). Inside a list element it makes the element a *template*: the
//!     element's other fields are merged into every resource element that satisfies all the
//!     element's conditions (conditions in nested maps count; if the template also names the
//!     list's merge key, only the element with that key qualifies). Outside any list element, a
//!     failed condition skips the whole mutation (Kyverno's behaviour: "processing stops");
//!   - `<(key)`: global anchor — if it does not hold, the whole mutation is skipped. A list
//!     element holding a global anchor is a pure condition: it holds when at least one resource
//!     element satisfies it, and it writes nothing (as in Kyverno);
//!   - anchors are evaluated against the object as it was before the mutation — in each map
//!     globals first, then conditions, then everything else — except that the elements of a
//!     list patch apply in order: each element's anchors see the earlier elements of that list
//!     applied.
//!
//!   Anchor values are Kyverno patterns: strings with `*`/`?` wildcards (also `a|b`, `a&b`,
//!   `!a`), compared with the value as text; objects must match key by key; see the `pattern`
//!   module.
//!
//! ## Deviations from Kyverno
//! * List elements apply in order (see above); Kyverno evaluates every element against the
//!   original object, so that e.g. a template setting `imagePullPolicy` followed by one with
//!   `+(imagePullPolicy)` for the same container gives a different result on the second
//!   application.
//! * Template elements patch the selected resource elements in place, also elements without a
//!   `name` (Kyverno can only patch named elements, and moves them to the front of the list:
//!   a template over application init containers would put them before the mesh's own).
//! * An add anchor inside a plain list element is evaluated against the element with the same
//!   merge key (Kyverno evaluates it against the first element of the list and retargets the
//!   element to every named element).
//! * A list element with a global anchor needs at least one resource element to satisfy it; an
//!   empty resource list does not (Kyverno passes vacuously on a present, empty list).
//! * A conditional anchor's value is only ever a condition: it is never written, and anchors
//!   inside it are rejected by [`validate`] (Kyverno: "nested conditional anchor tags are not
//!   supported").
//! * Merge keys are the Pod schema's, by field name, in every kind, except a Service's
//!   `spec.ports` (merged by `port`, as Kubernetes does); lists of fields outside the Pod
//!   schema merge by `name` or are replaced (an Ingress's rules, for example, whose Kubernetes
//!   merge is atomic).
//! * Kyverno's numeric operators (`>`, `<`, `>=`, `<=`) and ranges in anchor values are not
//!   supported ([`validate`] rejects the operators; ranges compare as text), nor the strategic
//!   merge directives (`$patch`, `$retainKeys`, ...; rejected by [`validate`]). Scalar lists are
//!   always replaced (Kubernetes merges a few, such as `metadata.finalizers`).
//!
//! # Validation ([`validate`]) and rendering ([`render`])
//! [`validate`] checks a spec and names the field of each problem
//! (`spec.mutations[2].jsonPatch[0].path: must start with '/'`). [`render`] applies policies to
//! documents offline, each as a CREATE of that object, with the patch the webhook would return.
//!
//! # Beside the engine
//! [`native`] compiles a policy to a `MutatingAdmissionPolicy` the API server evaluates itself;
//! [`kyverno`] imports Kyverno's mutate rules as policies. The domain uses only
//! [`crate::object`] (`tests/layers.rs`); the registrations that route policies are
//! [`crate::admission`]'s.

pub mod admission;
pub mod context;
mod images;
pub mod json6902;
pub mod kyverno;
mod matching;
pub mod native;
mod pattern;
mod render;
mod strategic;
mod validate;
pub mod variables;

use meshgate_api::mutation_policy::{
    ForEachOrder, MetadataMutation, Mutation, MutationPolicySpec, OnConflict,
};
use serde_json::{Map, Value};

use crate::object::patch::JsonPatch;

pub use matching::{
    MatchContext, ObjectType, SUPPORTED_KINDS, WORKLOAD_KINDS, object_labels, opted_out,
    parse_kind, pod_template_path, policy_matches, policy_target, template_opted_out,
};
pub use pattern::wildcard_match;
pub use render::{RenderError, RenderedDoc, document_namespace, render};
pub use validate::validate;

/// A mutation that cannot be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The mutation itself is malformed (a spec that [`validate`] would reject).
    #[error("policy {policy}: spec.mutations[{mutation}]: {message}")]
    InvalidMutation {
        policy: String,
        mutation: usize,
        message: String,
    },
    /// A strategic-merge patch is malformed at `path` (relative to the patch, e.g.
    /// `.spec.containers[0]`).
    #[error("policy {policy}: spec.mutations[{mutation}].strategicMerge{path}: {message}")]
    StrategicMerge {
        policy: String,
        mutation: usize,
        path: String,
        message: String,
    },
    /// A variable, a precondition or a `foreach` list could not be evaluated.
    #[error("policy {policy}: spec.mutations[{mutation}]: {message}")]
    Evaluation {
        policy: String,
        mutation: usize,
        message: String,
    },
    /// A JSON patch operation failed (bad path, failed `test`, ...) or is malformed.
    #[error("policy {policy}: spec.mutations[{mutation}].jsonPatch[{op}]: {message}")]
    JsonPatch {
        policy: String,
        mutation: usize,
        op: usize,
        message: String,
    },
}

impl PolicyError {
    /// The name of the policy that failed.
    pub fn policy(&self) -> &str {
        match self {
            PolicyError::InvalidMutation { policy, .. }
            | PolicyError::Evaluation { policy, .. }
            | PolicyError::StrategicMerge { policy, .. }
            | PolicyError::JsonPatch { policy, .. } => policy,
        }
    }
}

/// The spec a `NamespacedMutationPolicy` in `namespace` applies with: its own, confined to that
/// namespace (`match.namespaces` set to it, its `configMap` context entries' namespace when
/// they give none, and its `apiCall` entries limited to paths under it). Refused, naming the field: `match.namespaces` naming another namespace, a
/// `namespaceSelector` (it would read other namespaces' labels), a `configMap` entry of another
/// namespace, and `existing` (backfill is for cluster-wide policies).
pub fn confine(
    spec: &MutationPolicySpec,
    namespace: &str,
) -> Result<MutationPolicySpec, Vec<String>> {
    let mut errors = Vec::new();
    if let Some(other) = spec.match_.namespaces.iter().find(|n| *n != namespace) {
        errors.push(format!(
            "spec.match.namespaces: {other:?}: a NamespacedMutationPolicy applies in its own namespace ({namespace}) only"
        ));
    }
    if spec.match_.namespace_selector.is_some() {
        errors.push(
            "spec.match.namespaceSelector: not allowed in a NamespacedMutationPolicy (it applies in its own namespace only)"
                .to_owned(),
        );
    }
    if spec.existing.enabled {
        errors.push(
            "spec.existing: backfill of existing workloads is for cluster-wide MutationPolicies"
                .to_owned(),
        );
    }
    let mut confined = spec.clone();
    // A ConfigMap context entry reads the policy's own namespace, and no other, and an apiCall
    // only paths under it (Kyverno's rules for namespaced policies).
    for entry in context::entries_mut(&mut confined) {
        if let Some(call) = entry.api_call.as_mut() {
            call.confined_to = Some(namespace.to_owned());
        }
        let Some(cm) = entry.config_map.as_mut() else {
            continue;
        };
        if cm.namespace.is_empty() {
            cm.namespace = namespace.to_owned();
        } else if cm.namespace != namespace {
            errors.push(format!(
                "context configMap {}/{}: a NamespacedMutationPolicy reads ConfigMaps of its own namespace ({namespace}) only",
                cm.namespace, cm.name
            ));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    confined.match_.namespaces = vec![namespace.to_owned()];
    Ok(confined)
}

/// The outcome of [`apply`].
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    /// The object after every matching policy.
    pub object: Value,
    /// Names of the policies that changed the object, in the order they were applied.
    pub policies: Vec<String>,
    /// `"<policy>: <warning>"` for each policy that changed the object and has a warning.
    pub warnings: Vec<String>,
    /// Policies that matched but could not be applied (the object is as if they had not
    /// matched), in application order.
    pub failed: Vec<PolicyError>,
}

impl Applied {
    /// Whether any policy changed the object.
    pub fn changed(&self) -> bool {
        !self.policies.is_empty()
    }
}

/// Applies every policy that matches `object` in this request, in name order.
///
/// `policies` yields `(name, spec)` pairs, e.g.
/// `list.iter().map(|(n, s)| (n.as_str(), s))` for a `&[(String, MutationPolicySpec)]`.
pub fn apply<'a, I>(policies: I, object: &Value, ctx: &MatchContext<'_>) -> Applied
where
    I: IntoIterator<Item = (&'a str, &'a MutationPolicySpec)>,
{
    let mut ordered: Vec<(&str, &MutationPolicySpec)> = policies.into_iter().collect();
    ordered.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = Applied {
        object: object.clone(),
        policies: Vec::new(),
        warnings: Vec::new(),
        failed: Vec::new(),
    };
    if opted_out(object) {
        return out;
    }
    for (name, spec) in ordered {
        // Matching sees the object as the previous policies left it.
        let Some(path) = policy_target(spec, &out.object, ctx) else {
            continue;
        };
        // A workload whose pod template opts out is left alone, whatever the target.
        if template_opted_out(&out.object) {
            continue;
        }
        let Some(target) = value_at_mut(&mut out.object, path) else {
            continue;
        };
        let request = Request {
            operation: match ctx.operation {
                meshgate_api::mutation_policy::Operation::Create => "CREATE",
                meshgate_api::mutation_policy::Operation::Update => "UPDATE",
            },
            namespace: ctx.namespace,
            cluster: ctx.cluster,
        };
        match apply_mutations(name, spec, target, &request) {
            Ok(true) => {
                out.policies.push(name.to_owned());
                if let Some(w) = spec.warning.as_deref().filter(|w| !w.is_empty()) {
                    out.warnings.push(format!("{name}: {w}"));
                }
            }
            Ok(false) => {}
            Err(e) => out.failed.push(e),
        }
    }
    out
}

/// The patch the admission response carries: from `original` to `patched`
/// (`json_patch::diff`).
pub fn admission_patch(original: &Value, patched: &Value) -> JsonPatch {
    JsonPatch::diff(original, patched)
}

/// What the variables `request.operation` and `request.namespace` hold, and where `configMap`
/// context entries are read.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub operation: &'a str,
    pub namespace: &'a str,
    pub cluster: &'a dyn context::ClusterData,
}

/// Applies the mutations of one policy, in order, to its `target` (a Pod, a pod template, or
/// the object), without any matching. Returns whether `target` changed; on error `target` is
/// left as it was.
fn apply_mutations(
    policy: &str,
    spec: &MutationPolicySpec,
    target: &mut Value,
    request: &Request<'_>,
) -> Result<bool, PolicyError> {
    let mut work = target.clone();
    for (index, mutation) in spec.mutations.iter().enumerate() {
        if mutation.preconditions.is_none()
            && mutation.foreach.is_none()
            && mutation.context.is_empty()
            && mutation.mutations.is_empty()
            && !mutation_has_variables(mutation)
        {
            apply_mutation(policy, index, mutation, &mut work)?;
            continue;
        }
        // `request.object` is the target as this mutation finds it.
        let vars = variables::Vars::new(&work, request.operation, request.namespace);
        let at = Nested {
            policy,
            index,
            path: String::new(),
            depth: 0,
            cluster: request.cluster,
        };
        apply_evaluated(&at, mutation, &vars, &mut work)?;
    }
    if work == *target {
        return Ok(false);
    }
    *target = work;
    Ok(true)
}

/// Where a mutation with variables sits: its policy, its index in `spec.mutations`, its path
/// below it (`.mutations[1]` …, for messages), and the foreach loops around it.
struct Nested<'a> {
    policy: &'a str,
    index: usize,
    path: String,
    depth: usize,
    cluster: &'a dyn context::ClusterData,
}

impl Nested<'_> {
    fn failed(&self, message: String) -> PolicyError {
        let message = if self.path.is_empty() {
            message
        } else {
            format!("{}: {message}", self.path.trim_start_matches('.'))
        };
        PolicyError::Evaluation {
            policy: self.policy.to_owned(),
            mutation: self.index,
            message,
        }
    }
}

/// Applies one mutation with `outer`'s variables (`request.object` and, nested, the enclosing
/// mutations' variables and elements), as Kyverno applies a rule (`pkg/engine/engine.go`: the
/// context entries, then the preconditions, once) and its foreach entries
/// (`pkg/engine/handlers/mutation/common.go`).
fn apply_evaluated(
    at: &Nested<'_>,
    mutation: &Mutation,
    outer: &variables::Vars,
    work: &mut Value,
) -> Result<(), PolicyError> {
    // The context entries, before the preconditions (Kyverno loads a rule's context first).
    let vars = outer.with_context(&mutation.context, at.cluster);
    if let Some(p) = &mutation.preconditions
        && !vars
            .holds(p)
            .map_err(|e| at.failed(format!("preconditions: {e}")))?
    {
        return Ok(());
    }
    let Some(foreach) = &mutation.foreach else {
        if mutation.mutations.is_empty() {
            let m = substituted(mutation, &vars).map_err(|e| at.failed(e))?;
            return apply_mutation(at.policy, at.index, &m, work);
        }
        return apply_each(at, &mutation.mutations, &vars, at.depth, work);
    };
    // Kyverno's `EvaluateList` queries the context: a key missing on the path is an error
    // (its "Unknown key"), as in any variable.
    let list = match vars
        .query(&foreach.list)
        .map_err(|e| at.failed(format!("foreach.list: {e}")))?
    {
        Value::Null => Vec::new(),
        Value::Array(items) => items,
        other => {
            return Err(at.failed(format!(
                "foreach.list: {:?} gives {}, not a list",
                foreach.list,
                kind_of(&other)
            )));
        }
    };
    // Kyverno's order: `Descending` visits the last element first, each keeping its
    // `elementIndex`; `null` elements are skipped.
    let descending = foreach.order == Some(ForEachOrder::Descending);
    let order: Vec<usize> = if descending {
        (0..list.len()).rev().collect()
    } else {
        (0..list.len()).collect()
    };
    for i in order {
        let element = &list[i];
        if element.is_null() {
            continue;
        }
        // Each element starts from the variables as the foreach found them (Kyverno resets
        // its context per element): `request.object` is the object before the first element.
        let each = vars
            .with_element_at(element, i, at.depth)
            .with_context(&foreach.context, at.cluster);
        if let Some(p) = &foreach.preconditions
            && !each
                .holds(p)
                .map_err(|e| at.failed(format!("foreach.preconditions (element {i}): {e}")))?
        {
            continue;
        }
        if mutation.mutations.is_empty() {
            let m = substituted(mutation, &each)
                .map_err(|e| at.failed(format!("foreach (element {i}): {e}")))?;
            apply_mutation(at.policy, at.index, &m, work)?;
        } else {
            apply_each(at, &mutation.mutations, &each, at.depth + 1, work)?;
        }
    }
    Ok(())
}

/// Applies `mutations` in order with `base`'s variables. Each one's `request.object` is the
/// object as the previous one left it when that one changed it (Kyverno's `AddResource` after
/// a foreach entry that applied), else `base`'s.
fn apply_each(
    at: &Nested<'_>,
    mutations: &[Mutation],
    base: &variables::Vars,
    depth: usize,
    work: &mut Value,
) -> Result<(), PolicyError> {
    let mut current = base.clone();
    for (i, sub) in mutations.iter().enumerate() {
        let before = work.clone();
        let here = Nested {
            policy: at.policy,
            index: at.index,
            path: format!("{}.mutations[{i}]", at.path),
            depth,
            cluster: at.cluster,
        };
        apply_evaluated(&here, sub, &current, work)?;
        if *work != before {
            current = base.with_object(work);
        }
    }
    Ok(())
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Whether any string of the mutation holds a variable.
fn mutation_has_variables(m: &Mutation) -> bool {
    let meta = |v: &Option<MetadataMutation>| {
        v.as_ref().is_some_and(|m| {
            m.values
                .iter()
                .any(|(k, v)| k.contains("{{") || v.contains("{{"))
        })
    };
    meta(&m.labels)
        || meta(&m.annotations)
        || m.strategic_merge
            .as_ref()
            .is_some_and(variables::has_variables)
        || m.json_patch.as_ref().is_some_and(|ops| {
            ops.iter().any(|op| {
                op.path.contains("{{")
                    || op.from.as_deref().is_some_and(|f| f.contains("{{"))
                    || op.value.as_ref().is_some_and(variables::has_variables)
            })
        })
}

/// The mutation with its variables substituted (the preconditions and foreach dropped: they
/// were evaluated).
fn substituted(m: &Mutation, vars: &variables::Vars) -> Result<Mutation, String> {
    let text = |s: &str| -> Result<String, String> {
        Ok(match vars.substitute_str(s)? {
            Value::String(s) => s,
            other => other.to_string(),
        })
    };
    let meta = |v: &Option<MetadataMutation>| -> Result<Option<MetadataMutation>, String> {
        v.as_ref()
            .map(|m| {
                Ok(MetadataMutation {
                    values: m
                        .values
                        .iter()
                        .map(|(k, v)| Ok((text(k)?, text(v)?)))
                        .collect::<Result<_, String>>()?,
                    on_conflict: m.on_conflict,
                })
            })
            .transpose()
    };
    Ok(Mutation {
        annotations: meta(&m.annotations)?,
        labels: meta(&m.labels)?,
        strategic_merge: m
            .strategic_merge
            .as_ref()
            .map(|p| vars.substitute(p))
            .transpose()?,
        json_patch: m
            .json_patch
            .as_ref()
            .map(|ops| {
                ops.iter()
                    .map(|op| {
                        Ok(meshgate_api::mutation_policy::JsonPatchOperation {
                            op: op.op,
                            path: text(&op.path)?,
                            from: op.from.as_deref().map(text).transpose()?,
                            value: op.value.as_ref().map(|v| vars.substitute(v)).transpose()?,
                        })
                    })
                    .collect::<Result<Vec<_>, String>>()
            })
            .transpose()?,
        json_patch_options: m.json_patch_options.clone(),
        preconditions: None,
        foreach: None,
        context: Vec::new(),
        mutations: Vec::new(),
    })
}

fn apply_mutation(
    policy: &str,
    index: usize,
    mutation: &Mutation,
    target: &mut Value,
) -> Result<(), PolicyError> {
    let invalid = |message: String| PolicyError::InvalidMutation {
        policy: policy.to_owned(),
        mutation: index,
        message,
    };
    match mutation {
        Mutation {
            json_patch_options: Some(_),
            json_patch: None,
            ..
        } => Err(invalid("jsonPatchOptions needs jsonPatch".to_owned())),
        Mutation {
            annotations: Some(m),
            labels: None,
            strategic_merge: None,
            json_patch: None,
            ..
        } => set_metadata(target, "annotations", m).map_err(invalid),
        Mutation {
            annotations: None,
            labels: Some(m),
            strategic_merge: None,
            json_patch: None,
            ..
        } => set_metadata(target, "labels", m).map_err(invalid),
        Mutation {
            annotations: None,
            labels: None,
            strategic_merge: Some(patch),
            json_patch: None,
            ..
        } => {
            if !patch.is_object() {
                return Err(invalid("strategicMerge must be an object".to_owned()));
            }
            strategic::apply(target, patch)
                .map(|_| ())
                .map_err(|stop| match stop {
                    strategic::Stop::Invalid { path, message } => PolicyError::StrategicMerge {
                        policy: policy.to_owned(),
                        mutation: index,
                        path,
                        message,
                    },
                    // `apply` turns skips into Ok(false); nothing else can come back.
                    other => PolicyError::StrategicMerge {
                        policy: policy.to_owned(),
                        mutation: index,
                        path: String::new(),
                        message: format!("unexpected anchor outcome {other:?}"),
                    },
                })
        }
        Mutation {
            annotations: None,
            labels: None,
            strategic_merge: None,
            json_patch: Some(ops),
            json_patch_options,
            ..
        } => apply_json_patch(
            policy,
            index,
            ops,
            &json_patch_options.clone().unwrap_or_default(),
            target,
        ),
        _ => Err(invalid(
            "set exactly one of annotations, labels, strategicMerge, jsonPatch".to_owned(),
        )),
    }
}

fn set_metadata(target: &mut Value, field: &str, m: &MetadataMutation) -> Result<(), String> {
    if m.values.is_empty() {
        return Ok(());
    }
    let Value::Object(root) = target else {
        return Err("the target is not an object".to_owned());
    };
    let metadata = root
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !metadata.is_object() {
        *metadata = Value::Object(Map::new());
    }
    let Value::Object(metadata) = metadata else {
        return Err("metadata is not an object".to_owned());
    };
    let values = metadata
        .entry(field)
        .or_insert_with(|| Value::Object(Map::new()));
    if !values.is_object() {
        *values = Value::Object(Map::new());
    }
    let Value::Object(values) = values else {
        return Err(format!("metadata.{field} is not an object"));
    };
    for (k, v) in &m.values {
        match m.on_conflict {
            OnConflict::Keep if values.contains_key(k) => {}
            _ => {
                values.insert(k.clone(), Value::String(v.clone()));
            }
        }
    }
    Ok(())
}

fn apply_json_patch(
    policy: &str,
    index: usize,
    ops: &[meshgate_api::mutation_policy::JsonPatchOperation],
    options: &meshgate_api::mutation_policy::JsonPatchOptions,
    target: &mut Value,
) -> Result<(), PolicyError> {
    let mut work = target.clone();
    json6902::apply(&mut work, ops, options).map_err(|(op, message)| PolicyError::JsonPatch {
        policy: policy.to_owned(),
        mutation: index,
        op,
        message,
    })?;
    *target = work;
    Ok(())
}

fn value_at_mut<'v>(value: &'v mut Value, path: &[&str]) -> Option<&'v mut Value> {
    path.iter()
        .try_fold(value, |v, segment| v.get_mut(*segment))
        .filter(|v| v.is_object())
}

#[cfg(test)]
mod tests;

//! The native gate: the init gate of the clauses whose whole decision CEL can make, as one
//! `MutatingAdmissionPolicy` the API server evaluates in process, with no call to the webhook.
//!
//! # Which clauses go native, and why only those
//! A clause goes native when its verdict depends only on the pod as the API server holds it
//! during admission and on nothing a later admission step can change into a case CEL cannot
//! decide:
//! * **Istio ambient** ([`meshgate_api::Profile::IstioAmbient`]): Windows pods get no gate, pods
//!   with a sidecar (the injection status annotation or the proxy container) get none, every
//!   other selected pod gets the node-proxy check; the gate runs as the pod's user (no uid is
//!   exempt from capture).
//! * the configuration's own `selectors` (no profile): the configured checks on every Linux pod.
//!
//! The sidecar profiles (Istio sidecar, Linkerd) stay on the webhook, for two reasons found in
//! the API server's admission chain and the meshes' rules:
//! 1. their verdict reads the **injected** pod, and the meshes inject with mutating webhooks,
//!    which the API server always runs after every admission policy. The policy would decide on
//!    the pod before injection and again on reinvocation; but the webhook, should the injected
//!    pod need it, is only reinvoked when it was called on the first pass. Routing by the pod's
//!    shape at the first pass cannot know the injected shape, so it cannot be made safe.
//! 2. the verdict reads the traffic annotations (`traffic.sidecar.istio.io/*`,
//!    `config.linkerd.io/skip-outbound-ports`, also on the namespace), which need CIDR and port
//!    range arithmetic to find a redirected destination.
//!
//! A pod that a webhook clause selects is the webhook's entirely (the policy leaves it alone),
//! so that "the first gate wins, else the first reason" is decided in one place for it.
//!
//! # Namespaces with LimitRanges stay on the webhook
//! The gate's cpu and memory must fit the namespace's `Container` LimitRanges
//! ([`crate::pod_gate::resources`]); CEL cannot read them. A namespace in which a LimitRange
//! constrains cpu or memory ([`routed_namespace`]) is routed to the webhook: its name is in the webhook's
//! `matchConditions` and excluded by the policy's. The controller keeps that list
//! (`meshgate_controller::native_gate`); until it has listed every LimitRange the list is
//! [`Routes::All`]: every pod goes to the webhook, as without the native gate. The residual
//! window: a LimitRange created while the controller is down (or in the milliseconds before it
//! reacts) is not yet in the list; a gate whose configured resources violate it gets the pod
//! refused by the API server until the controller routes the namespace. The webhook's own
//! LimitRange cache has the same milliseconds.
//!
//! # What the policy computes
//! Everything the webhook's [`crate::pod_gate::gate::Planner`] computes for these clauses, from the
//! same code: the notes (`meshgate.dev/gate` values), the arguments and the container come from the
//! core functions run on representative pods; CEL chooses among them by the pod's shape:
//! selection (the clauses' label selectors and annotations over the namespace and the pod),
//! opt-out, `hostNetwork`, Windows, sidecar pods, the QoS class (the kubelet's rule: no cpu or
//! memory anywhere is BestEffort; every container with cpu and memory limits equal to its
//! requests is Guaranteed; pod-level `spec.resources` means no gate resources), the gate's user
//! (the pod's, else the first container's, never root, else `initGate.runAsUser`), the gate
//! first and exactly once (a stale `meshgate-wait` is replaced, one an injector pushed back is
//! moved to the front on reinvocation), and the note. `mesh_pods` proves on every pod shape of
//! its corpus that the policy and the webhook agree.

use meshgate_api::config::GateConfig;
use meshgate_api::{LabelSelector, Profile, SelectorOperator, names};
use serde_json::{Value, json};

use crate::object::Meta;
use crate::object::cel::{PolicyApi, cel_list, cel_string, has_value, opted_out, selector_cel};
use crate::object::view::PodView;
use crate::pod_gate::gate::Planner;
use crate::pod_gate::mesh::{NoGate, Verdict};
use crate::pod_gate::resources::ContainerLimits;
use crate::policy::native::NotNative;

/// The name of the policy and its binding.
pub const POLICY_NAME: &str = "meshgate-pod-gate";
/// The label the API server puts on every namespace, its name (immutable).
const NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// The namespaces whose pods the webhook decides, for the native clauses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Routes {
    /// Every namespace: the policy does nothing (before the controller's first full list).
    All,
    /// These namespaces (sorted).
    Namespaces(Vec<String>),
}

impl Routes {
    /// `selector` (a native clause's webhook entry's) narrowed to the routed namespaces.
    pub fn webhook_selector(&self, selector: LabelSelector) -> LabelSelector {
        match self {
            Routes::All => selector,
            // Every namespace has the label: none is selected.
            Routes::Namespaces(names) if names.is_empty() => {
                selector.with(NAME_LABEL, SelectorOperator::DoesNotExist, &[])
            }
            Routes::Namespaces(names) => {
                selector.with(NAME_LABEL, SelectorOperator::In, &strs(names))
            }
        }
    }

    /// `selector` (the policy's) without the routed namespaces.
    fn policy_selector(&self, selector: LabelSelector) -> LabelSelector {
        match self {
            Routes::All => selector.with(NAME_LABEL, SelectorOperator::DoesNotExist, &[]),
            Routes::Namespaces(names) if names.is_empty() => selector,
            Routes::Namespaces(names) => {
                selector.with(NAME_LABEL, SelectorOperator::NotIn, &strs(names))
            }
        }
    }
}

fn strs(names: &[String]) -> Vec<&str> {
    names.iter().map(String::as_str).collect()
}

/// Whether a profile's clauses can go native (module documentation).
fn native_profile(profile: Profile) -> bool {
    matches!(profile, Profile::IstioAmbient)
}

/// The names of the clauses that go native, in the configuration's order.
pub fn native_clauses(config: &GateConfig) -> Vec<String> {
    crate::pod_gate::gate::profile_clauses(config)
        .into_iter()
        .filter(|(_, p)| p.is_none_or(native_profile))
        .map(|(c, _)| c.name)
        .collect()
}

/// Whether a namespace's pods must go to the webhook: one of its LimitRanges constrains the
/// gate's cpu or memory.
pub fn routed_namespace(limit_ranges: &[ContainerLimits]) -> bool {
    !limit_ranges.is_empty()
}

/// Whether the configuration can have a native gate at all.
pub fn expressible(config: &GateConfig) -> Result<(), NotNative> {
    if !config.init_gate.enabled {
        return Err(NotNative("the init gate is disabled".into()));
    }
    if config.resource_gate.enabled {
        return Err(NotNative(
            "the resource gate adds an extended resource request to the pod's first container, which the webhook does".into(),
        ));
    }
    if config.init_gate.scope == meshgate_api::config::InitGateScope::TaintExempt {
        return Err(NotNative(
            "the init gate's scope TaintExempt decides per pod from its tolerations and nodeName, which the webhook does".into(),
        ));
    }
    if native_clauses(config).is_empty() {
        return Err(NotNative(
            "no clause can go native (the sidecar profiles decide on the injected pod)".into(),
        ));
    }
    Ok(())
}

/// The verdict of a clause on a representative pod, with the gate container the webhook would
/// add to it.
fn representative(
    planner: &Planner,
    profile: Option<Profile>,
    pod: &Value,
) -> Result<(Verdict, Option<Value>), NotNative> {
    let view = PodView::of(pod);
    let spec = view
        .spec
        .get()
        .ok_or_else(|| NotNative("representative pod".into()))?;
    let verdict = crate::pod_gate::gate::clause_verdict(
        planner.config(),
        profile,
        spec,
        view.meta(),
        &Meta::default(),
    );
    let container = match &verdict {
        Ok(plan) => {
            if !plan.avoid_uids.is_empty() || !plan.avoid_gids.is_empty() {
                return Err(NotNative(
                    "the gate's user depends on uids the mesh exempts".into(),
                ));
            }
            let resources =
                crate::pod_gate::resources::gate_resources(&planner.config().init_gate, spec, &[])
                    .map_err(|e| NotNative(e.0))?;
            Some(planner.gate_container(spec, plan, &resources).to_json())
        }
        Err(_) => None,
    };
    Ok((verdict, container))
}

fn note(verdict: &Verdict) -> String {
    match verdict {
        Ok(plan) => plan.annotation(),
        Err(no) => no.annotation(),
    }
}

/// A raw CEL expression inside a JSON value given to [`typed`].
const RAW: char = '\u{1}';

fn raw(expr: &str) -> Value {
    Value::String(format!("{RAW}{expr}"))
}

/// A JSON value as a CEL value of the object's type `ty` (`Object.spec.initContainers`); the
/// fields named in `maps` are maps; a key `?name` is an optional field with a raw value.
fn typed(ty: &str, v: &Value) -> String {
    const MAPS: [&str; 2] = ["requests", "limits"];
    match v {
        Value::String(s) => match s.strip_prefix(RAW) {
            Some(expr) => expr.to_owned(),
            None => cel_string(s),
        },
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(|i| typed(ty, i)).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(fields) => {
            let fields: Vec<String> = fields
                .iter()
                .map(|(k, v)| {
                    if MAPS.contains(&k.as_str()) {
                        let entries: Vec<String> = v
                            .as_object()
                            .into_iter()
                            .flatten()
                            .map(|(mk, mv)| format!("{}: {}", cel_string(mk), typed(ty, mv)))
                            .collect();
                        format!("{k}: {{{}}}", entries.join(", "))
                    } else if let Some(name) = k.strip_prefix('?') {
                        format!("?{name}: {}", typed(ty, v))
                    } else {
                        format!("{k}: {}", typed(&format!("{ty}.{k}"), v))
                    }
                })
                .collect();
            format!("{ty}{{{}}}", fields.join(", "))
        }
        other => other.to_string(),
    }
}

const INITS: &str = "Object.spec.initContainers";
/// Gates at a higher init container index than this are not found by the policy (no pod has
/// that many init containers in practice; the webhook has no such limit).
const MAX_INIT_INDEX: usize = 64;

/// The `MutatingAdmissionPolicy` and binding of the native gate.
pub fn policy(
    config: &GateConfig,
    api: PolicyApi,
    routes: &Routes,
) -> Result<[Value; 2], NotNative> {
    expressible(config)?;
    let planner = Planner::new(config);
    let plain = json!({"metadata": {}, "spec": {"containers": [{"name": "app"}]}});
    let qos_pods = [
        (
            "Guaranteed",
            json!({"spec": {"containers": [{"name": "app", "resources": {
            "requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}}]}}),
        ),
        (
            "Burstable",
            json!({"spec": {"containers": [{"name": "app", "resources": {
            "requests": {"cpu": "1"}}}]}}),
        ),
        ("BestEffort", plain.clone()),
        (
            "Pod",
            json!({"spec": {"resources": {"limits": {"cpu": "1"}}, "containers": [{"name": "app"}]}}),
        ),
    ];

    let mut variables = vec![
        ("ann", "has(object.metadata.annotations) ? object.metadata.annotations : {}".to_owned()),
        (
            "inits",
            "has(object.spec.initContainers) ? object.spec.initContainers : []".to_owned(),
        ),
        (
            "containers",
            "object.spec.containers + (has(object.spec.initContainers) ? object.spec.initContainers : [])"
                .to_owned(),
        ),
        ("windows", "has(object.spec.os) && object.spec.os.name == \"windows\"".to_owned()),
    ];
    // The QoS class (crate::pod_gate::resources::qos_class), and the gate's resources for it. The
    // type checker declares quantities, the object holds strings: `quantity(dyn(..))` takes both.
    let positive = |c: &str, field: &str, r: &str| {
        format!(
            "(has({c}.resources) && has({c}.resources.{field}) && {r} in {c}.resources.{field} && quantity(dyn({c}.resources.{field}[{r}])).isGreaterThan(quantity(\"0\")))"
        )
    };
    let none = ["requests", "limits"]
        .iter()
        .flat_map(|f| ["\"cpu\"", "\"memory\""].map(|r| format!("!{}", positive("c", f, r))))
        .collect::<Vec<_>>()
        .join(" && ");
    let equal = format!(
        "[\"cpu\", \"memory\"].all(r, {} && {} && quantity(dyn(c.resources.requests[r])).compareTo(quantity(dyn(c.resources.limits[r]))) == 0)",
        positive("c", "limits", "r"),
        positive("c", "requests", "r")
    );
    variables.push((
        "qos",
        format!(
            "has(object.spec.resources) ? \"Pod\" : variables.containers.all(c, {none}) ? \"BestEffort\" : variables.containers.all(c, {equal}) ? \"Guaranteed\" : \"Burstable\""
        ),
    ));
    // The gate's user (gate::gate_user with no exempt uid): the pod's, else the first app
    // container's with its group, else the default with the default group.
    let default_user = config.init_gate.run_as_user;
    let usable = |u: &str| format!("({u} != 0)");
    let pod_user = format!(
        "(has(object.spec.securityContext) && has(object.spec.securityContext.runAsUser) && {})",
        usable("object.spec.securityContext.runAsUser")
    );
    variables.push((
        "userContainers",
        format!(
            "object.spec.containers.filter(c, has(c.securityContext) && has(c.securityContext.runAsUser) && {})",
            usable("c.securityContext.runAsUser")
        ),
    ));
    variables.push((
        "user",
        format!(
            "{pod_user} ? object.spec.securityContext.runAsUser : size(variables.userContainers) > 0 ? variables.userContainers[0].securityContext.runAsUser : {default_user}"
        ),
    ));
    variables.push((
        "group",
        format!(
            "{pod_user} ? -1 : size(variables.userContainers) > 0 ? (has(variables.userContainers[0].securityContext.runAsGroup) ? variables.userContainers[0].securityContext.runAsGroup : -1) : {default_user}"
        ),
    ));

    // Per clause: selected, and its verdict by the pod's shape.
    let all = crate::pod_gate::gate::profile_clauses(config);
    let mut webhook_selected = Vec::new();
    let mut verdicts = Vec::new();
    let mut args_lists = Vec::new();
    let mut resources_by_qos: Option<Vec<(String, String)>> = None;
    for (clause, profile) in &all {
        let mut sel = vec![
            selector_cel("namespaceObject.metadata", &clause.namespace_selector),
            selector_cel("object.metadata", &clause.object_selector),
        ];
        for (k, v) in &clause.namespace_annotations {
            sel.push(format!(
                "({} && namespaceObject.metadata.annotations[{}] == {})",
                has_value("namespaceObject.metadata", "annotations", k),
                cel_string(k),
                cel_string(v)
            ));
        }
        for (k, v) in &clause.pod_annotations {
            sel.push(format!(
                "({k} in variables.ann && variables.ann[{k}] == {v})",
                k = cel_string(k),
                v = cel_string(v)
            ));
        }
        for (k, v) in &clause.pod_annotations_absent {
            sel.push(format!(
                "!({k} in variables.ann && variables.ann[{k}] == {v})",
                k = cel_string(k),
                v = cel_string(v)
            ));
        }
        let selected = format!("({})", sel.join(" && "));
        if profile.is_some_and(|p| !native_profile(p)) {
            webhook_selected.push(selected);
            continue;
        }
        let (gated, container) = representative(&planner, *profile, &plain)?;
        let Some(container) = container else {
            return Err(NotNative(format!(
                "clause {}: no gate on a plain pod ({})",
                clause.name,
                note(&gated)
            )));
        };
        if resources_by_qos.is_none() {
            let mut by = Vec::new();
            for (qos, pod) in &qos_pods {
                let (_, c) = representative(&planner, *profile, pod)?;
                let r = c.map(|c| c["resources"].clone()).unwrap_or(json!({}));
                by.push(((*qos).to_owned(), typed(&format!("{INITS}.resources"), &r)));
            }
            resources_by_qos = Some(by);
        }
        let args = container["args"].clone();
        args_lists.push(typed(INITS, &args));
        let windows = cel_string(&NoGate::Windows.annotation());
        let gated_note = cel_string(&note(&gated));
        let verdict = match profile {
            Some(p) => {
                let record = p.record();
                // mesh::verdict for ambient: a sidecar pod is left alone.
                let sidecar = format!(
                    "(\"sidecar.istio.io/status\" in variables.ann || variables.containers.exists(c, c.name == {}))",
                    cel_string(record.proxy_container)
                );
                let sidecar_note = cel_string(&NoGate::SidecarPod.annotation());
                format!("variables.windows ? {windows} : {sidecar} ? {sidecar_note} : {gated_note}")
            }
            None => format!("variables.windows ? {windows} : {gated_note}"),
        };
        verdicts.push(format!("{selected} ? ({verdict}) : \"\""));
    }
    let n = verdicts.len();
    let resources_by_qos = resources_by_qos.unwrap_or_default();
    let indices = cel_list(&(0..n).map(|i| i.to_string()).collect::<Vec<_>>()).replace('"', "");
    variables.push(("verdicts", format!("[{}]", verdicts.join(", "))));
    variables.push((
        "gatedAt",
        format!("{indices}.filter(i, variables.verdicts[i].startsWith(\"gated:\"))"),
    ));
    variables.push((
        "reasonAt",
        format!("{indices}.filter(i, variables.verdicts[i] != \"\")"),
    ));
    variables.push((
        "chosen",
        "size(variables.gatedAt) > 0 ? variables.gatedAt[0] : size(variables.reasonAt) > 0 ? variables.reasonAt[0] : -1"
            .into(),
    ));
    variables.push((
        "note",
        "variables.chosen < 0 ? \"\" : variables.verdicts[variables.chosen]".into(),
    ));
    variables.push((
        "args",
        format!(
            "variables.chosen < 0 ? [] : [{}][variables.chosen]",
            args_lists.join(", ")
        ),
    ));
    let mut res = "Object.spec.initContainers.resources{}".to_owned();
    for (qos, r) in resources_by_qos.iter().rev() {
        res = format!("variables.qos == {} ? {r} : {res}", cel_string(qos));
    }
    // Object types are declared for the mutation only, not for variables.

    // The gate container: the webhook's, with the user, group, arguments and resources chosen
    // in CEL.
    let (_, container) = representative(&planner, None, &plain)?;
    let mut gate = container.ok_or_else(|| NotNative("no gate container".into()))?;
    gate["args"] = raw("variables.args");
    gate["resources"] = raw(&format!("({res})"));
    if let Some(sc) = gate["securityContext"].as_object_mut() {
        sc.insert("runAsUser".into(), raw("variables.user"));
        sc.remove("runAsGroup");
        sc.insert(
            "?runAsGroup".into(),
            raw("variables.group >= 0 ? optional.of(variables.group) : optional.none()"),
        );
    }
    let gate_cel = typed(INITS, &gate);
    let wait = cel_string(names::GATE_CONTAINER);
    let command = typed(INITS, &gate["command"]);
    let image = cel_string(gate["image"].as_str().unwrap_or_default());
    // The gate in place: first, exactly once, the same in what meshgate decides (as the webhook
    // compares: image, command, arguments, user, group, resources).
    let in_place = format!(
        "size(variables.inits.filter(c, c.name == {wait})) == 1 && variables.inits[0].name == {wait} && \
         variables.inits[0].image == {image} && has(variables.inits[0].command) && variables.inits[0].command == {command} && \
         has(variables.inits[0].args) && variables.inits[0].args == variables.args && \
         has(variables.inits[0].securityContext) && has(variables.inits[0].securityContext.runAsUser) && \
         variables.inits[0].securityContext.runAsUser == variables.user && \
         (variables.group < 0 ? !has(variables.inits[0].securityContext.runAsGroup) : \
          has(variables.inits[0].securityContext.runAsGroup) && variables.inits[0].securityContext.runAsGroup == variables.group) && \
         has(variables.inits[0].resources) && variables.inits[0].resources == ({res})"
    );
    // The API server's JSON patch cannot carry a list of objects built in CEL (kube-apiserver
    // 1.36.3 panics converting it to JSON, in the request), so the gate is added alone at index
    // 0 (to an empty list first when the pod has none), and existing gates are removed one by
    // one, from the highest index.
    let descending: Vec<String> = (0..MAX_INIT_INDEX).rev().map(|i| i.to_string()).collect();
    let removals = format!(
        "[{}].filter(i, i < size(variables.inits) && variables.inits[i].name == {wait}).map(i, JSONPatch{{op: \"remove\", path: \"/spec/initContainers/\" + string(i)}})",
        descending.join(", ")
    );
    let container_ops = format!(
        "(variables.note.startsWith(\"gated:\") ? \
           (({in_place}) ? [] : has(object.spec.initContainers) ? \
              {removals} + [JSONPatch{{op: \"add\", path: \"/spec/initContainers/0\", value: {gate_cel}}}] : \
              [JSONPatch{{op: \"add\", path: \"/spec/initContainers\", value: []}}, JSONPatch{{op: \"add\", path: \"/spec/initContainers/0\", value: {gate_cel}}}]) : \
           {removals})"
    );
    let key = cel_string(names::GATE_VERDICT);
    let note_path = cel_string(&format!(
        "/metadata/annotations/{}",
        crate::object::patch::escape(names::GATE_VERDICT)
    ));
    let note_ops = format!(
        "(({key} in variables.ann && variables.ann[{key}] == variables.note) ? [] : \
          has(object.metadata.annotations) ? [JSONPatch{{op: \"add\", path: {note_path}, value: variables.note}}] : \
          [JSONPatch{{op: \"add\", path: \"/metadata/annotations\", value: {{{key}: variables.note}}}}])"
    );
    let webhooks = if webhook_selected.is_empty() {
        "false".to_owned()
    } else {
        format!("({})", webhook_selected.join(" || "))
    };
    let expression = format!(
        "(variables.chosen < 0 || {webhooks} || {} || (has(object.spec.hostNetwork) && object.spec.hostNetwork)) ? [] : \
         {container_ops} + {note_ops}",
        opted_out("object.metadata")
    );

    let namespace_selector = routes.policy_selector(crate::admission::scope::with_exclusions(
        LabelSelector::default(),
        &config.excluded_namespaces,
    ));
    let object_selector = meshgate_api::LabelSelector::default().with(
        names::OPT_OUT,
        SelectorOperator::NotIn,
        &["false"],
    );
    let labels = json!({names::MANAGED_BY: "meshgate"});
    let failure = crate::admission::scope::failure_policy(config.failure_policy);
    let policy = json!({
        "apiVersion": api.api_version(),
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME, "labels": labels},
        "spec": {
            "matchConstraints": {
                "resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
                "namespaceSelector": namespace_selector.to_k8s(),
                "objectSelector": object_selector.to_k8s(),
            },
            "variables": variables.iter().map(|(name, e)| json!({"name": name, "expression": e})).collect::<Vec<_>>(),
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": expression}}],
            "failurePolicy": failure,
            "reinvocationPolicy": "IfNeeded",
        },
    });
    let binding = json!({
        "apiVersion": api.api_version(),
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME, "labels": labels},
        "spec": {"policyName": POLICY_NAME, "matchResources": {}},
    });
    Ok([policy, binding])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(profiles: Vec<Profile>) -> GateConfig {
        GateConfig {
            profiles,
            ..GateConfig::default()
        }
    }

    #[test]
    fn only_ambient_and_own_selectors_go_native() {
        let c = config(vec![
            Profile::IstioAmbient,
            Profile::IstioSidecar,
            Profile::Linkerd,
        ]);
        assert_eq!(native_clauses(&c), ["istio-ambient", "istio-ambient-pod"]);
        assert!(expressible(&config(vec![Profile::Linkerd])).is_err());
        let mut rg = config(vec![Profile::IstioAmbient]);
        rg.resource_gate.enabled = true;
        assert!(expressible(&rg).is_err());
    }

    #[test]
    fn the_policy_carries_the_webhooks_notes_and_routes() {
        let c = config(vec![Profile::IstioAmbient, Profile::IstioSidecar]);
        let routes = Routes::Namespaces(vec!["limited".into()]);
        let [policy, binding] = policy(&c, PolicyApi::V1, &routes).unwrap();
        let spec = &policy["spec"];
        assert!(
            spec.get("matchConditions").is_none(),
            "routes are selectors"
        );
        // The configuration's exclusions, then the routes.
        assert_eq!(
            spec["matchConstraints"]["namespaceSelector"]["matchExpressions"],
            json!([{"key": NAME_LABEL, "operator": "NotIn", "values": c.excluded_namespaces},
                   {"key": NAME_LABEL, "operator": "NotIn", "values": ["limited"]}])
        );
        let vars = spec["variables"].to_string();
        assert!(vars.contains("gated: --tcp-listening 15008"), "{vars}");
        assert!(vars.contains("none: sidecar-pod"), "{vars}");
        assert!(vars.contains("none: windows"), "{vars}");
        let expr = spec["mutations"][0]["jsonPatch"]["expression"]
            .as_str()
            .unwrap();
        // Pods a sidecar clause selects are the webhook's.
        assert!(expr.contains("istio-injection"), "{expr}");
        assert_eq!(binding["spec"]["policyName"], POLICY_NAME);
    }

    #[test]
    fn routes_select_namespaces_by_their_name_label() {
        let ns = |name: &str| {
            std::collections::BTreeMap::from([(NAME_LABEL.to_owned(), name.to_owned())])
        };
        let both = |r: &Routes, name: &str| {
            let base = LabelSelector::default();
            (
                r.webhook_selector(base.clone()).matches(&ns(name)),
                r.policy_selector(base).matches(&ns(name)),
            )
        };
        let limited = Routes::Namespaces(vec!["limited".into()]);
        // Exactly one of the two takes each namespace's pods.
        assert_eq!(both(&limited, "limited"), (true, false));
        assert_eq!(both(&limited, "apps"), (false, true));
        assert_eq!(both(&Routes::Namespaces(vec![]), "apps"), (false, true));
        assert_eq!(both(&Routes::All, "apps"), (true, false));
        // The webhook keeps the clause's own selection.
        let clause = LabelSelector::default().with("mesh", SelectorOperator::In, &["on"]);
        assert!(!limited.webhook_selector(clause).matches(&ns("limited")));
    }
}

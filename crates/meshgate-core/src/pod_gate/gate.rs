//! The init gate: the pod mutation that holds a pod's start until the node's mesh agent has set
//! the pod up, and the resource gate that keeps it off nodes whose agents are not Ready.
//!
//! # Whether a pod gets a gate
//! A pod a profile selects gets a gate only where its mesh will capture its traffic and a check
//! can see that happen: [`crate::pod_gate::mesh::verdict`] reads the pod as the mesh's injector left
//! it (the webhook is reinvoked after other injectors, so it decides on the injected pod). Every
//! selected pod carries the verdict in the annotation `meshgate.dev/gate`.
//!
//! # Where the gate goes
//! The gate is the **first** init container, before native sidecars (init containers with
//! `restartPolicy: Always`) too:
//! * every later container, sidecar proxies included, relies on traffic capture being in place,
//!   and init containers start strictly in order, so first is the only place that guards all;
//! * the sidecar-mode check listens on the proxy's outbound port to prove redirection, which it
//!   can only do before the proxy binds that port;
//! * a mesh injector that runs after meshgate (reinvocation) may put its own init containers in
//!   front; on the reinvocation meshgate moves its gate back to the front.
//!
//! The init container named `meshgate-wait` is meshgate's: on every review it is made what the
//! verdict says (replaced when it differs, removed when the verdict is no gate).
//!
//! # The container
//! Its user is the pod's (pod `securityContext`, else the first container that sets one) unless
//! that is root or a uid the mesh does not redirect; else `initGate.runAsUser`. Its resources
//! keep the pod's QoS class and fit the namespace's LimitRanges ([`crate::pod_gate::resources`]).
//!
//! # What is left alone
//! Operations other than CREATE, excluded namespaces, `hostNetwork` pods (they share the node's
//! network namespace: no per-pod capture exists to wait for), pods that opt out with the label or
//! annotation `meshgate.dev/inject: "false"`, pods no clause selects.

use meshgate_api::config::GateConfig;
use meshgate_api::{Profile, names};
use serde_json::{Value, json};

use meshgate_api::config::SelectorClause;

use crate::object::patch::{JsonPatch, escape};
use crate::object::quantity::Quantity;
use crate::object::view::{ContainerView, Obj, PodSpecView, PodView};
use crate::pod_gate::mesh::{GatePlan, NoGate, Options, Verdict};
use crate::pod_gate::resources::{ContainerLimits, GateResources, gate_resources};
use crate::pod_gate::select::{Meta, clause_matches};

/// Why a pod was left untouched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    Operation,
    ExcludedNamespace,
    HostNetwork,
    OptedOut,
    NotSelected,
    NotAPod,
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Operation => "operation",
            Skip::ExcludedNamespace => "excluded-namespace",
            Skip::HostNetwork => "host-network",
            Skip::OptedOut => "opted-out",
            Skip::NotSelected => "not-selected",
            Skip::NotAPod => "not-a-pod",
        }
    }
}

/// The outcome for one pod.
#[derive(Clone, Debug, PartialEq)]
pub enum PodPlan {
    /// Untouched, and why.
    Skip(Skip),
    /// Selected by `clause`; the verdict, and the patch that carries it out (empty when the pod
    /// is already as the verdict says).
    Mutate {
        clause: String,
        verdict: Verdict,
        patch: JsonPatch,
    },
}

impl PodPlan {
    /// A short word for logs and metrics.
    pub fn decision(&self) -> &'static str {
        match self {
            PodPlan::Skip(s) => s.as_str(),
            PodPlan::Mutate {
                verdict: Err(_), ..
            } => "no-gate",
            PodPlan::Mutate { patch, .. } if patch.is_empty() => "already-gated",
            PodPlan::Mutate { .. } => "mutated",
        }
    }

    /// The verdict, for a selected pod.
    pub fn verdict(&self) -> Option<&Verdict> {
        match self {
            PodPlan::Skip(_) => None,
            PodPlan::Mutate { verdict, .. } => Some(verdict),
        }
    }
}

/// One admission request for a pod, reduced to what the gate reads.
#[derive(Clone, Copy, Debug)]
pub struct PodRequest<'a> {
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    pub operation: &'a str,
    pub namespace: &'a str,
    /// The pod as JSON (the review's `request.object`).
    pub pod: &'a Value,
    /// The namespace's labels and annotations.
    pub namespace_meta: &'a Meta,
    /// The `Container` items of the namespace's LimitRanges.
    pub limit_ranges: &'a [ContainerLimits],
}

/// Whether the pod opts out of meshgate by label or annotation.
pub fn opted_out(pod: &Meta) -> bool {
    pod.labels.get(names::OPT_OUT).map(String::as_str) == Some("false")
        || pod.annotations.get(names::OPT_OUT).map(String::as_str) == Some("false")
}

/// Plans the gate and the resource gate for one pod.
///
/// Builds a [`Planner`] for `config` on every call; a server answering many reviews keeps one
/// [`Planner`] instead.
pub fn plan_pod(config: &GateConfig, req: &PodRequest<'_>) -> PodPlan {
    Planner::new(config).plan(req)
}

/// The init gate's planning for one [`GateConfig`], with everything that does not depend on the
/// pod (the selector clauses and the profile each belongs to) computed once.
#[derive(Clone, Debug)]
pub struct Planner {
    config: GateConfig,
    clauses: Vec<(SelectorClause, Option<Profile>)>,
}

impl Planner {
    pub fn new(config: &GateConfig) -> Self {
        Self {
            config: config.clone(),
            clauses: profile_clauses(config),
        }
    }

    pub fn config(&self) -> &GateConfig {
        &self.config
    }

    /// Plans for a pod given as a `Value`.
    pub fn plan(&self, req: &PodRequest<'_>) -> PodPlan {
        self.plan_view(
            req.operation,
            req.namespace,
            req.namespace_meta,
            req.limit_ranges,
            &PodView::of(req.pod),
        )
    }

    /// Plans for a pod given as a [`PodView`] (see [`crate::object::view::read_pod`]): the same
    /// decision as [`Planner::plan`] on the `Value` of the same JSON.
    pub fn plan_view(
        &self,
        operation: &str,
        namespace: &str,
        namespace_meta: &Meta,
        limit_ranges: &[ContainerLimits],
        pod: &PodView<'_>,
    ) -> PodPlan {
        let config = &self.config;
        if operation != "CREATE" {
            return PodPlan::Skip(Skip::Operation);
        }
        if config.excluded_namespaces.iter().any(|n| n == namespace) {
            return PodPlan::Skip(Skip::ExcludedNamespace);
        }
        let Some(spec) = pod.spec.get() else {
            return PodPlan::Skip(Skip::NotAPod);
        };
        if spec.host_network.0 == Some(true) {
            return PodPlan::Skip(Skip::HostNetwork);
        }
        let meta = pod.meta();
        if opted_out(meta) {
            return PodPlan::Skip(Skip::OptedOut);
        }
        // Every clause that selects the pod gives a verdict; the first gate wins, else the
        // first reason.
        let mut chosen: Option<(&str, Verdict)> = None;
        for (clause, profile) in &self.clauses {
            if !clause_matches(clause, namespace_meta, meta) {
                continue;
            }
            let verdict = clause_verdict(config, *profile, spec, meta, namespace_meta);
            let gated = verdict.is_ok();
            if chosen.as_ref().is_none_or(|(_, v)| v.is_err() && gated) {
                chosen = Some((clause.name.as_str(), verdict));
            }
            if gated {
                break;
            }
        }
        let Some((clause, verdict)) = chosen else {
            return PodPlan::Skip(Skip::NotSelected);
        };
        // Some layer must be able to hold the pod, and an init gate's resources must fit. No
        // init gate goes in front of the mesh's own validator.
        let mut layers = layers(config, spec);
        let mesh_validates = verdict.as_ref().is_ok_and(|plan| plan.mesh_validates);
        layers.init &= !mesh_validates;
        let gate = verdict.and_then(|plan| {
            if !layers.init && !layers.resource && !layers.taint {
                return Err(if mesh_validates {
                    NoGate::MeshValidates
                } else {
                    NoGate::NodeBound
                });
            }
            if !layers.init {
                return Ok((plan, GateResources::default()));
            }
            gate_resources(&config.init_gate, spec, limit_ranges)
                .map(|resources| (plan, resources))
                .map_err(|e| NoGate::Resources(e.0))
        });
        let mut patch = JsonPatch::default();
        if config.init_gate.enabled {
            let desired = gate
                .as_ref()
                .ok()
                .filter(|_| layers.init)
                .map(|(plan, resources)| self.gate_container(spec, plan, resources));
            patch.extend(place_gate(spec, desired.as_ref()));
        }
        if layers.resource && gate.is_ok() {
            patch.extend(plan_resource_request(&config.resource_gate.resource, spec));
        }
        let verdict = gate.map(|(plan, _)| plan);
        let note = match &verdict {
            Ok(plan) => layers.annotation(
                plan,
                &config.resource_gate.resource,
                config.node_taint_keys.first().map_or("", String::as_str),
            ),
            Err(no) => no.annotation(),
        };
        if meta.annotations.get(names::GATE_VERDICT) != Some(&note) {
            if pod.metadata.get().is_some_and(|m| m.annotations_present()) {
                patch.add(
                    format!("/metadata/annotations/{}", escape(names::GATE_VERDICT)),
                    json!(note),
                );
            } else if pod.metadata.get().is_some() {
                patch.add("/metadata/annotations", json!({names::GATE_VERDICT: note}));
            }
        }
        PodPlan::Mutate {
            clause: clause.to_owned(),
            verdict,
            patch,
        }
    }

    /// The gate container for a pod.
    pub(crate) fn gate_container(
        &self,
        spec: &PodSpecView<'_>,
        plan: &GatePlan,
        resources: &GateResources,
    ) -> DesiredGate {
        let gate = &self.config.init_gate;
        let mut args = plan.args();
        args.push("--timeout".into());
        args.push(format!("{}s", gate.timeout_seconds));
        let (user, group) = gate_user(spec, plan, gate.run_as_user);
        DesiredGate {
            image: gate.image.clone(),
            image_pull_policy: gate.image_pull_policy.clone(),
            command: gate.command.clone(),
            args,
            resources: resources.clone(),
            user,
            group,
        }
    }
}

/// Every selection clause of a configuration with the profile it belongs to (`None`: one of
/// the configuration's own `selectors`), in the order the planner tries them.
pub(crate) fn profile_clauses(config: &GateConfig) -> Vec<(SelectorClause, Option<Profile>)> {
    config
        .profiles
        .iter()
        .flat_map(|p| p.clauses().into_iter().map(|c| (c, Some(*p))))
        .chain(config.selectors.iter().cloned().map(|c| (c, None)))
        .collect()
}

/// The verdict of one selecting clause: its profile's rule, or for a clause of the
/// configuration's own `selectors` (no profile) a gate with the configured checks on every
/// Linux pod.
pub(crate) fn clause_verdict(
    config: &GateConfig,
    profile: Option<Profile>,
    spec: &PodSpecView<'_>,
    meta: &Meta,
    namespace_meta: &Meta,
) -> Verdict {
    let options = Options {
        checks: &config.init_gate.checks,
        primary_family: config.init_gate.primary_ip_family,
    };
    match profile {
        Some(p) => crate::pod_gate::mesh::verdict(p.record(), spec, meta, namespace_meta, options),
        None if spec.os() == Some("windows") => Err(NoGate::Windows),
        None => Ok(GatePlan {
            checks: config.checks(),
            targets: Vec::new(),
            avoid_uids: Vec::new(),
            avoid_gids: Vec::new(),
            mesh_validates: false,
        }),
    }
}

/// The gate applied offline to one object, as the webhook would at the creation of its pods.
#[derive(Clone, Debug, PartialEq)]
pub struct ObjectPlan {
    /// The object with its pod (or pod template) as the gate leaves it.
    pub object: Value,
    /// The plan for the pod.
    pub plan: PodPlan,
}

impl Planner {
    /// Plans for a Pod, or for the pod template of a workload (Deployment, StatefulSet,
    /// DaemonSet, ReplicaSet, Job, CronJob): what its pods will get at creation. `None` for
    /// other kinds. The pod's namespace is the object's (`default` when it names none).
    pub fn plan_object(
        &self,
        object: &Value,
        namespace_meta: &dyn Fn(&str) -> Meta,
        limit_ranges: &dyn Fn(&str) -> Vec<ContainerLimits>,
    ) -> Option<ObjectPlan> {
        let kind = object.get("kind").and_then(Value::as_str)?;
        let path = crate::object::pod_template_path(kind)?;
        let namespace = object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("default");
        let pointer: String = path.iter().map(|p| format!("/{p}")).collect();
        let template = object.pointer(&pointer)?;
        let pod = if path.is_empty() {
            template.clone()
        } else {
            json!({"metadata": template.get("metadata").cloned().unwrap_or_else(|| json!({})),
                   "spec": template.get("spec").cloned().unwrap_or(Value::Null)})
        };
        let ns = namespace_meta(namespace);
        let limits = limit_ranges(namespace);
        let plan = self.plan(&PodRequest {
            operation: "CREATE",
            namespace,
            pod: &pod,
            namespace_meta: &ns,
            limit_ranges: &limits,
        });
        let mut out = object.clone();
        if let PodPlan::Mutate { patch, .. } = &plan
            && !patch.is_empty()
            && let Ok(mutated) = patch.apply(&pod)
        {
            if path.is_empty() {
                out = mutated;
            } else if let Some(t) = out.pointer_mut(&pointer) {
                for field in ["metadata", "spec"] {
                    if let Some(v) = mutated.get(field) {
                        t[field] = v.clone();
                    }
                }
            }
        }
        Some(ObjectPlan { object: out, plan })
    }
}

/// The user and group the gate runs as: the pod's, where it sets a usable one (OpenShift-style
/// uid ranges admit only those), else `default`. Never root, never a uid or gid whose traffic
/// the mesh leaves alone.
fn gate_user(spec: &PodSpecView<'_>, plan: &GatePlan, default: i64) -> (i64, Option<i64>) {
    let usable = |u: &i64| *u != 0 && !plan.avoid_uids.contains(u);
    let pod = spec.security_context.get().copied().unwrap_or_default();
    let from_container = spec
        .apps()
        .filter_map(|c| c.security_context.get().copied())
        .find(|sc| sc.run_as_user.0.is_some_and(|u| usable(&u)));
    let (user, group) = match (pod.run_as_user.0.filter(usable), from_container) {
        (Some(u), _) => (u, None),
        (None, Some(sc)) => (sc.run_as_user.0.unwrap_or(default), sc.run_as_group.0),
        (None, None) => return (default, Some(default)),
    };
    // The group the gate would run with: its own, else the pod's.
    let effective = group.or(pod.run_as_group.0);
    match effective {
        Some(g) if plan.avoid_gids.contains(&g) => (user, Some(default)),
        _ => (user, group),
    }
}

/// The gate container meshgate wants in a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DesiredGate {
    image: String,
    image_pull_policy: String,
    command: String,
    args: Vec<String>,
    resources: GateResources,
    user: i64,
    group: Option<i64>,
}

impl DesiredGate {
    pub(crate) fn to_json(&self) -> Value {
        let mut sc = json!({
            "runAsNonRoot": true,
            "runAsUser": self.user,
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "privileged": false,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        });
        if let Some(g) = self.group {
            sc["runAsGroup"] = json!(g);
        }
        // Built field by field: `json!` copies every `Value` it is given (through `to_value`),
        // and the resources and security context are `Value`s (a fifth of planning a pod).
        let mut container = serde_json::Map::with_capacity(8);
        for (key, value) in [
            ("name", Value::from(names::GATE_CONTAINER)),
            ("image", Value::from(self.image.as_str())),
            (
                "imagePullPolicy",
                Value::from(self.image_pull_policy.as_str()),
            ),
            ("command", Value::from(vec![self.command.as_str()])),
            ("args", Value::from(self.args.as_slice())),
            ("resources", self.resources.to_json()),
            ("securityContext", sc),
            (
                "terminationMessagePolicy",
                Value::from("FallbackToLogsOnError"),
            ),
        ] {
            container.insert(key.to_owned(), value);
        }
        Value::Object(container)
    }

    /// Whether an existing gate container is this one (in what meshgate decides: the API
    /// server adds defaults to the rest).
    fn matches(&self, c: &ContainerView<'_>) -> bool {
        let strs =
            |l: &crate::object::view::List<crate::object::view::Str<'_>>| -> Option<Vec<String>> {
                l.get()?
                    .iter()
                    .map(|s| s.as_deref().map(str::to_owned))
                    .collect()
            };
        let (req, lim) = c.resources();
        let same = |have: &[crate::object::view::Member<'_>],
                    want: &std::collections::BTreeMap<&'static str, Quantity>| {
            have.len() == want.len()
                && want.iter().all(|(k, q)| {
                    have.iter().any(|(hk, hv)| {
                        hk == k && hv.as_deref().and_then(Quantity::parse) == Some(*q)
                    })
                })
        };
        let sc = c.security_context.get().copied().unwrap_or_default();
        c.image.as_deref() == Some(self.image.as_str())
            && strs(&c.command) == Some(vec![self.command.clone()])
            && strs(&c.args).as_ref() == Some(&self.args)
            && same(req, &self.resources.requests)
            && same(lim, &self.resources.limits)
            && sc.run_as_user.0 == Some(self.user)
            && sc.run_as_group.0 == self.group
    }
}

/// The patch that makes the gate container what `desired` says: first, and exactly once; or
/// gone.
fn place_gate(spec: &PodSpecView<'_>, desired: Option<&DesiredGate>) -> JsonPatch {
    let mut patch = JsonPatch::default();
    let existing: Vec<(usize, &ContainerView<'_>)> = spec
        .inits()
        .filter(|(_, c)| c.name() == Some(names::GATE_CONTAINER))
        .collect();
    match (desired, existing.as_slice()) {
        (None, []) => {}
        (Some(d), [(0, c)]) if d.matches(c) => {}
        (Some(d), []) if spec.init_containers.get().is_none() => {
            patch.add("/spec/initContainers", Value::Array(vec![d.to_json()]));
        }
        (desired, existing) => {
            // From the end, so that earlier indices stay valid.
            for (i, _) in existing.iter().rev() {
                patch.remove(format!("/spec/initContainers/{i}"));
            }
            if let Some(d) = desired {
                patch.add("/spec/initContainers/0", d.to_json());
            }
        }
    }
    patch
}

/// Requests (and limits, as the API server requires for extended resources) one unit of the
/// gate resource in the first app container, unless it asks for it already.
/// Which layers guard a gated pod (the verdict annotation names them).
///
/// * The **taint**: a pod the scheduler places and that does not tolerate the gate's startup
///   taint never lands on a node whose agents are not Ready: no cost on a ready node, and an
///   autoscaler that knows the key provisions for the pod as without meshgate
///   (docs/design.md, "Autoscalers").
/// * The **resource** request holds a pod in the scheduler until a ready node offers the gate
///   resource (node status or DRA): no cost on a ready node. It is never given to a pod created
///   with `spec.nodeName`: such a pod never meets the scheduler, so the request can only make
///   the kubelet reject it, never hold it.
/// * The **init** container holds the pod on its node until the mesh captures it, also where
///   nothing else can (a pod bound by `nodeName`), at about half a second of start on every
///   node. With `initGate.scope: NodeBound` and the resource gate on, only node-bound pods get
///   it; with `TaintExempt`, only pods the taint cannot hold (node-bound, or tolerating it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layers {
    pub init: bool,
    pub resource: bool,
    /// Held by the startup taint alone (the annotation names it when no other layer does).
    pub taint: bool,
}

pub(crate) fn layers(config: &GateConfig, spec: &PodSpecView<'_>) -> Layers {
    use meshgate_api::config::InitGateScope;
    let bound = spec.node_name.as_deref().is_some_and(|n| !n.is_empty());
    let resource = config.resource_gate.enabled && !bound;
    let tolerated =
        || config.node_taint_keys.iter().any(|k| spec.tolerates(k)) || spec.tolerates("");
    let held_by_taint =
        config.init_gate.scope == InitGateScope::TaintExempt && !bound && !tolerated();
    let init = config.init_gate.enabled
        && match config.init_gate.scope {
            InitGateScope::All => true,
            InitGateScope::NodeBound => !config.resource_gate.enabled || bound,
            InitGateScope::TaintExempt => !held_by_taint,
        };
    Layers {
        init,
        resource,
        taint: held_by_taint,
    }
}

impl Layers {
    /// `gated: <the init gate's arguments>`, `gated: resource <name>`, `gated: taint <key>`,
    /// or the init gate and the resource together (`gated: <arguments>; resource <name>`).
    fn annotation(self, plan: &GatePlan, resource: &str, taint: &str) -> String {
        match (self.init, self.resource) {
            (true, true) => format!("{}; resource {resource}", plan.annotation()),
            (false, true) => format!("gated: resource {resource}"),
            (false, false) if self.taint => format!("gated: taint {taint}"),
            _ => plan.annotation(),
        }
    }
}

fn plan_resource_request(resource: &str, spec: &PodSpecView<'_>) -> JsonPatch {
    let mut patch = JsonPatch::default();
    let Some(container) = spec
        .containers
        .get()
        .and_then(|c| c.first())
        .and_then(Obj::get)
    else {
        return patch;
    };
    let res = escape(resource);
    let base = "/spec/containers/0/resources";
    let Some(resources) = container.resources.get() else {
        patch.add(
            base,
            json!({"requests": {resource: "1"}, "limits": {resource: "1"}}),
        );
        return patch;
    };
    for (field, keys) in [
        ("requests", &resources.requests),
        ("limits", &resources.limits),
    ] {
        match keys.get() {
            None => patch.add(format!("{base}/{field}"), json!({resource: "1"})),
            Some(k) if !k.contains(resource) => {
                patch.add(format!("{base}/{field}/{res}"), json!("1"));
            }
            Some(_) => {}
        }
    }
    patch
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_api::Profile;
    use meshgate_api::config::GateCheck;

    fn config() -> GateConfig {
        GateConfig {
            profiles: vec![Profile::IstioAmbient],
            ..GateConfig::default()
        }
    }

    fn ambient() -> Meta {
        Meta {
            labels: [("istio.io/dataplane-mode".to_owned(), "ambient".to_owned())].into(),
            ..Meta::default()
        }
    }

    fn plan(config: &GateConfig, ns: &str, ns_meta: &Meta, pod: &Value) -> PodPlan {
        plan_pod(
            config,
            &PodRequest {
                operation: "CREATE",
                namespace: ns,
                pod,
                namespace_meta: ns_meta,
                limit_ranges: &[],
            },
        )
    }

    fn mutated(config: &GateConfig, pod: &Value) -> Value {
        match plan(config, "apps", &ambient(), pod) {
            PodPlan::Mutate { patch, .. } => patch.apply(pod).unwrap(),
            other => panic!("expected a mutation, got {other:?}"),
        }
    }

    fn pod() -> Value {
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app", "image": "app"}]}})
    }

    fn init_names(pod: &Value) -> Vec<&str> {
        pod["spec"]["initContainers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect()
    }

    #[test]
    fn pod_without_init_containers_gets_the_gate() {
        let out = mutated(&config(), &pod());
        assert_eq!(init_names(&out), ["meshgate-wait"]);
        let gate = &out["spec"]["initContainers"][0];
        assert_eq!(gate["command"], json!(["/meshgate-wait"]));
        assert_eq!(
            gate["args"],
            json!(["--tcp-listening", "15008", "--timeout", "120s"])
        );
        let sc = &gate["securityContext"];
        assert_eq!(sc["runAsNonRoot"], true);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
        // A BestEffort pod stays BestEffort: the gate asks for nothing.
        assert_eq!(gate["resources"], json!({}));
        let mut burstable = pod();
        burstable["spec"]["containers"][0]["resources"] = json!({"requests": {"cpu": "1"}});
        let b = mutated(&config(), &burstable);
        let r = &b["spec"]["initContainers"][0]["resources"];
        assert_eq!(r["limits"], json!({"cpu": "100m", "memory": "16Mi"}));
        assert_eq!(r["requests"], json!({"cpu": "10m", "memory": "8Mi"}));
        assert_eq!(
            out["spec"]["containers"],
            pod()["spec"]["containers"],
            "app untouched"
        );
    }

    #[test]
    fn gate_goes_before_existing_init_containers_and_native_sidecars() {
        let mut p = pod();
        p["spec"]["initContainers"] = json!([
            {"name": "migrate", "image": "db"},
            {"name": "proxy", "image": "proxy", "restartPolicy": "Always"},
        ]);
        let out = mutated(&config(), &p);
        assert_eq!(init_names(&out), ["meshgate-wait", "migrate", "proxy"]);
        assert_eq!(out["spec"]["initContainers"][2]["restartPolicy"], "Always");
    }

    #[test]
    fn reinvocation_adds_no_second_gate_and_moves_it_first() {
        let once = mutated(&config(), &pod());
        let again = plan(&config(), "apps", &ambient(), &once);
        assert!(
            matches!(&again, PodPlan::Mutate { clause, verdict: Ok(_), patch } if clause == "istio-ambient" && patch.is_empty()),
            "{again:?}"
        );
        // Another injector put its container in front after meshgate ran.
        let mut moved = once.clone();
        moved["spec"]["initContainers"]
            .as_array_mut()
            .unwrap()
            .insert(0, json!({"name": "mesh-init", "image": "x"}));
        let out = mutated(&config(), &moved);
        assert_eq!(init_names(&out), ["meshgate-wait", "mesh-init"]);
        assert_eq!(mutated(&config(), &out), out, "idempotent");
    }

    #[test]
    fn left_untouched() {
        let c = config();
        let none = Meta::default();
        assert_eq!(
            plan(&c, "apps", &none, &pod()),
            PodPlan::Skip(Skip::NotSelected)
        );
        assert_eq!(
            plan(&c, "kube-system", &ambient(), &pod()),
            PodPlan::Skip(Skip::ExcludedNamespace)
        );
        let mut host = pod();
        host["spec"]["hostNetwork"] = json!(true);
        assert_eq!(
            plan(&c, "apps", &ambient(), &host),
            PodPlan::Skip(Skip::HostNetwork)
        );
        let mut out = pod();
        out["metadata"]["labels"] = json!({"meshgate.dev/inject": "false"});
        assert_eq!(
            plan(&c, "apps", &ambient(), &out),
            PodPlan::Skip(Skip::OptedOut)
        );
        let mut out = pod();
        out["metadata"]["annotations"] = json!({"meshgate.dev/inject": "false"});
        assert_eq!(
            plan(&c, "apps", &ambient(), &out),
            PodPlan::Skip(Skip::OptedOut)
        );
        let mut none_mode = pod();
        none_mode["metadata"]["labels"] = json!({"istio.io/dataplane-mode": "none"});
        assert_eq!(
            plan(&c, "apps", &ambient(), &none_mode),
            PodPlan::Skip(Skip::NotSelected)
        );
        for op in ["UPDATE", "DELETE", "CONNECT"] {
            let req = PodRequest {
                operation: op,
                namespace: "apps",
                pod: &pod(),
                namespace_meta: &ambient(),
                limit_ranges: &[],
            };
            assert_eq!(plan_pod(&c, &req), PodPlan::Skip(Skip::Operation));
        }
    }

    #[test]
    fn missing_fields_do_not_break_planning() {
        let c = config();
        assert_eq!(
            plan(&c, "apps", &ambient(), &json!({})),
            PodPlan::Skip(Skip::NotAPod)
        );
        assert_eq!(
            plan(&c, "apps", &ambient(), &json!({"spec": 3})),
            PodPlan::Skip(Skip::NotAPod)
        );
        // No metadata, no containers: the gate still goes in, the resource gate has no target.
        let mut rc = c.clone();
        rc.resource_gate.enabled = true;
        let p = json!({"spec": {}});
        let out = mutated(&rc, &p);
        assert_eq!(init_names(&out), ["meshgate-wait"]);
        // Labels that are not strings are ignored, not a crash.
        let odd = json!({"metadata": {"labels": {"a": 1}}, "spec": {"containers": []}});
        assert!(matches!(
            plan(&c, "apps", &ambient(), &odd),
            PodPlan::Mutate { .. }
        ));
    }

    #[test]
    fn ephemeral_containers_are_left_alone() {
        let mut p = pod();
        p["spec"]["ephemeralContainers"] = json!([{"name": "debug", "image": "busybox"}]);
        let out = mutated(&config(), &p);
        assert_eq!(
            out["spec"]["ephemeralContainers"],
            p["spec"]["ephemeralContainers"]
        );
    }

    #[test]
    fn resource_gate_requests_one_unit_once() {
        let mut c = config();
        c.resource_gate.enabled = true;
        let out = mutated(&c, &pod());
        let r = &out["spec"]["containers"][0]["resources"];
        assert_eq!(r["requests"]["meshgate.dev/mesh-ready"], "1");
        assert_eq!(r["limits"]["meshgate.dev/mesh-ready"], "1");
        assert_eq!(mutated(&c, &out), out, "idempotent");

        let mut p = pod();
        p["spec"]["containers"][0]["resources"] = json!({"requests": {"cpu": "1"}});
        let out = mutated(&c, &p);
        let r = &out["spec"]["containers"][0]["resources"];
        assert_eq!(
            r["requests"],
            json!({"cpu": "1", "meshgate.dev/mesh-ready": "1"})
        );
        assert_eq!(r["limits"], json!({"meshgate.dev/mesh-ready": "1"}));
    }

    #[test]
    fn no_init_gate_goes_in_front_of_the_mesh_validator() {
        let mut c = GateConfig {
            profiles: vec![Profile::IstioSidecar],
            ..GateConfig::default()
        };
        let ns = Meta {
            labels: [("istio-injection".to_owned(), "enabled".to_owned())].into(),
            ..Meta::default()
        };
        let injected = |inits: Value| {
            json!({
                "metadata": {"name": "p", "annotations": {"sidecar.istio.io/status": "{}"}},
                "spec": {
                    "initContainers": inits,
                    "containers": [
                        {"name": "app", "image": "app"},
                        {"name": "istio-proxy", "image": "proxyv2", "args": ["proxy", "sidecar"]},
                    ],
                },
            })
        };
        let validation = json!({"name": "istio-validation", "image": "proxyv2"});
        let user = json!({"name": "migrate", "image": "app"});
        let outcome = |c: &GateConfig, p: &Value| match plan(c, "apps", &ns, p) {
            PodPlan::Mutate { patch, .. } => {
                let out = patch.apply(p).unwrap();
                let note = out["metadata"]["annotations"][names::GATE_VERDICT].clone();
                (init_names(&out).join(","), note)
            }
            other => panic!("expected a mutation, got {other:?}"),
        };
        // The validator first (native and classic injection): it holds the pod, and the
        // mesh's repair acts on its failure; nothing goes in front of it.
        let first = injected(json!([validation, user]));
        assert_eq!(
            outcome(&c, &first),
            (
                "istio-validation,migrate".to_owned(),
                json!("none: mesh-validates")
            )
        );
        // A stale gate in front of it (a reinvocation) is taken out again.
        let stale = outcome(
            &c,
            &injected(json!([{"name": "meshgate-wait", "image": "x"}, validation])),
        );
        assert_eq!(
            stale,
            ("istio-validation".to_owned(), json!("none: mesh-validates"))
        );
        // A user init container before the validator runs unprotected by it: gated.
        let (inits, note) = outcome(&c, &injected(json!([user, validation])));
        assert_eq!(inits, "meshgate-wait,migrate,istio-validation");
        assert!(
            note.as_str()
                .is_some_and(|n| n.starts_with("gated: --redirect-check 15001"))
        );
        // With the resource gate, a scheduled pod still gets the request.
        c.resource_gate.enabled = true;
        c.init_gate.scope = meshgate_api::config::InitGateScope::NodeBound;
        assert_eq!(
            outcome(&c, &first).1,
            json!("gated: resource meshgate.dev/mesh-ready")
        );
    }

    #[test]
    fn with_the_resource_gate_the_init_gate_guards_only_pods_bound_to_a_node() {
        let mut c = config();
        c.resource_gate.enabled = true;
        c.init_gate.scope = meshgate_api::config::InitGateScope::NodeBound;
        let note = |out: &Value| out["metadata"]["annotations"][names::GATE_VERDICT].clone();
        // Scheduled: the request alone, no init container, and the verdict says so.
        let out = mutated(&c, &pod());
        assert!(out["spec"]["initContainers"].is_null(), "{out}");
        assert_eq!(
            out["spec"]["containers"][0]["resources"]["requests"]["meshgate.dev/mesh-ready"],
            "1"
        );
        assert_eq!(note(&out), "gated: resource meshgate.dev/mesh-ready");
        assert_eq!(mutated(&c, &out), out, "idempotent");
        // Bound by nodeName: never meets the scheduler, so the init gate and no request.
        let mut bound = pod();
        bound["spec"]["nodeName"] = json!("node-1");
        let out = mutated(&c, &bound);
        assert_eq!(init_names(&out), ["meshgate-wait"]);
        assert!(out["spec"]["containers"][0]["resources"].is_null(), "{out}");
        assert!(
            note(&out)
                .as_str()
                .is_some_and(|n| n.starts_with("gated: --") && !n.contains("resource")),
            "{out}"
        );
        // Without the init gate a bound pod has no layer, and the verdict names why.
        c.init_gate.enabled = false;
        assert_eq!(note(&mutated(&c, &bound)), "none: node-bound");
        // Scope All: both layers, both named.
        let mut all = config();
        all.resource_gate.enabled = true;
        let out = mutated(&all, &pod());
        assert_eq!(init_names(&out), ["meshgate-wait"]);
        assert!(
            note(&out)
                .as_str()
                .is_some_and(|n| n.ends_with("; resource meshgate.dev/mesh-ready")),
            "{out}"
        );
    }

    #[test]
    fn with_the_taint_strategy_the_init_gate_guards_only_pods_the_taint_cannot_hold() {
        let mut c = config();
        c.init_gate.scope = meshgate_api::config::InitGateScope::TaintExempt;
        c.node_taint_keys = vec![
            "readiness.k8s.io/mesh-agents".into(),
            "node.meshgate.dev/agent-not-ready".into(),
        ];
        let note = |out: &Value| out["metadata"]["annotations"][names::GATE_VERDICT].clone();
        // Scheduled and held by the taint: nothing but the verdict.
        let out = mutated(&c, &pod());
        assert!(out["spec"]["initContainers"].is_null(), "{out}");
        assert!(out["spec"]["containers"][0]["resources"].is_null(), "{out}");
        assert_eq!(note(&out), "gated: taint readiness.k8s.io/mesh-agents");
        assert_eq!(mutated(&c, &out), out, "idempotent");
        // The taint cannot hold these: the init gate.
        let tolerating = |tolerations: Value| {
            let mut p = pod();
            p["spec"]["tolerations"] = tolerations;
            p
        };
        let mut bound = pod();
        bound["spec"]["nodeName"] = json!("node-1");
        for held_not in [
            bound,
            tolerating(json!([{"operator": "Exists"}])),
            tolerating(json!([{"key": "readiness.k8s.io/mesh-agents", "operator": "Exists"}])),
            tolerating(
                json!([{"key": "node.meshgate.dev/agent-not-ready", "effect": "NoSchedule"}]),
            ),
        ] {
            let out = mutated(&c, &held_not);
            assert_eq!(init_names(&out), ["meshgate-wait"], "{held_not}");
            assert!(
                note(&out)
                    .as_str()
                    .is_some_and(|n| n.starts_with("gated: --")),
                "{out}"
            );
        }
        // Tolerations that do not cover the gate's NoSchedule taint change nothing.
        for still_held in [
            tolerating(json!([{"key": "example.com/gpu", "operator": "Exists"}])),
            tolerating(json!([{"operator": "Exists", "effect": "NoExecute"}])),
            tolerating(json!([{"key": "readiness.k8s.io/mesh-agents", "effect": "NoExecute"}])),
        ] {
            let out = mutated(&c, &still_held);
            assert!(out["spec"]["initContainers"].is_null(), "{still_held}");
            assert_eq!(note(&out), "gated: taint readiness.k8s.io/mesh-agents");
        }
        // Without its keys the scope is refused.
        c.node_taint_keys.clear();
        assert!(c.validate().is_err());
    }

    #[test]
    fn configured_checks_are_combined_in_the_arguments() {
        let mut c = config();
        c.init_gate.checks = vec![
            GateCheck::TcpListening { port: 15008 },
            GateCheck::File {
                path: "/var/run/ready".into(),
            },
        ];
        c.init_gate.timeout_seconds = 30;
        let out = mutated(&c, &pod());
        let gate = &out["spec"]["initContainers"][0];
        assert_eq!(
            gate["args"],
            json!([
                "--tcp-listening",
                "15008",
                "--file",
                "/var/run/ready",
                "--timeout",
                "30s"
            ])
        );
    }
}

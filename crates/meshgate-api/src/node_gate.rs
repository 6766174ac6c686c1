//! `NodeGate`: hold nodes back until their mesh agents are Ready.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::selector::LabelSelector;

/// A rule for the node gate controller.
///
/// Every node that `nodeSelector` picks carries `taint` until every agent listed in `agents` has a
/// Ready pod on it. In `Continuous` mode the taint comes back (after `gracePeriodSeconds`) when an
/// agent stops being Ready; in `Bootstrap` mode it is removed once and the node is marked done.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "meshgate.dev",
    version = "v1alpha1",
    kind = "NodeGate",
    plural = "nodegates",
    shortname = "ng",
    status = "NodeGateStatus",
    category = "meshgate",
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.mode"}"#,
    printcolumn = r#"{"name":"Nodes","type":"integer","jsonPath":".status.nodes"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyNodes"}"#,
    printcolumn = r#"{"name":"Held","type":"integer","jsonPath":".status.heldNodes"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.taint.effect != 'NoExecute' || self.allowNoExecute",
    "message": "taint.effect NoExecute evicts running pods: set allowNoExecute: true to opt in"
}]))]
pub struct NodeGateSpec {
    /// The startup taint this gate owns. meshgate never touches another taint. Keys of
    /// Kubernetes, the kubelet, cloud providers and autoscalers are refused, except the startup
    /// taint prefixes autoscalers know: the cluster autoscaler's
    /// (`startup-taint.cluster-autoscaler.kubernetes.io/`) and the node readiness prefix that
    /// Karpenter treats as startup taints (`readiness.k8s.io/`).
    #[serde(default)]
    pub taint: GateTaint,
    /// `taint.effect: NoExecute` evicts the pods already running on a node when the taint is
    /// put back: it must be chosen explicitly.
    #[serde(default)]
    pub allow_no_execute: bool,
    /// The agents that must be Ready on a node (e.g. the CNI agent and the node proxy).
    #[schemars(length(min = 1))]
    pub agents: Vec<Agent>,
    /// Nodes this gate applies to; empty selects every node.
    #[serde(default, skip_serializing_if = "LabelSelector::is_empty")]
    pub node_selector: LabelSelector,
    #[serde(default)]
    pub mode: GateMode,
    /// Continuous mode: how long an agent may be unready before the taint is put back.
    #[serde(default = "default_grace")]
    #[schemars(range(min = 0, max = 3600))]
    pub grace_period_seconds: u32,
    /// Wait this long after the agents are Ready before the taint is removed.
    #[serde(default)]
    #[schemars(range(min = 0, max = 3600))]
    pub removal_delay_seconds: u32,
    /// meshgate puts the startup taint on new nodes: at creation (its webhook or a generated
    /// admission policy, so no kubelet flag is needed) and, for a node that registered without
    /// it, from the controller. `false`: the taint comes from elsewhere (kubelet flags, node pool
    /// settings) or not at all (a resource-only gate); meshgate only removes it.
    #[serde(default = "yes")]
    pub taint_on_create: bool,
    /// Advertise an extended resource on nodes whose agents are Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<GateResource>,
    /// Continuous mode: the most nodes the gate keeps re-tainted at once (agents failed after
    /// the node was released), as a number (`"3"`) or a percentage of the gate's nodes
    /// (`"10%"`, rounded down, at least 1), like a `maxUnavailable`. Beyond it the gate reports
    /// (condition `RetaintBudgetExhausted`, Events) instead of tainting more nodes.
    #[serde(default = "default_max_retainted")]
    #[schemars(regex(pattern = r"^([0-9]+|[0-9]+%)$"))]
    pub max_retainted: String,
    /// Decide and report (status, Events) but write nothing to nodes.
    #[serde(default)]
    pub dry_run: bool,
    /// How long a node waits for an agent that has no pod on it (or whose DaemonSet does not
    /// exist) before `onMissingAgent` applies. The gate is `Degraded` meanwhile.
    #[serde(default = "default_missing_agent_timeout")]
    #[schemars(range(min = 0, max = 86400))]
    pub missing_agent_timeout_seconds: u32,
    /// What happens to a node after `missingAgentTimeoutSeconds`: `Release` it (default: a
    /// missing agent never holds nodes forever) or keep it held (`Wait`).
    #[serde(default)]
    pub on_missing_agent: MissingAgentPolicy,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn default_max_retainted() -> String {
    "10%".into()
}

fn default_missing_agent_timeout() -> u32 {
    600
}

/// What the gate does with a node whose agent stays missing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MissingAgentPolicy {
    /// Stop holding the node (the gate stays `Degraded`).
    #[default]
    Release,
    /// Keep holding the node.
    Wait,
}

/// Domains of taint keys that belong to Kubernetes, the kubelet, cloud providers, autoscalers
/// and other node add-ons (a key `D/name` or `sub.D/name`).
pub const RESERVED_TAINT_DOMAINS: &[&str] = &[
    "kubernetes.io",
    "k8s.io",
    "karpenter.sh",
    "amazonaws.com",
    "cloud.google.com",
    "gke.io",
    "azure.com",
    "cilium.io",
];

/// Taint keys without a domain that others set (the cluster autoscaler, managed add-on pools).
pub const RESERVED_TAINT_KEYS: &[&str] = &[
    "ToBeDeletedByClusterAutoscaler",
    "DeletionCandidateOfClusterAutoscaler",
    "CriticalAddonsOnly",
];

/// The prefix the cluster autoscaler treats as a startup taint (ignored when it simulates
/// scale-up from zero): allowed for gate keys.
pub const AUTOSCALER_STARTUP_TAINT_PREFIX: &str = "startup-taint.cluster-autoscaler.kubernetes.io/";

/// The node readiness prefix: Karpenter treats taints with it as known startup taints (no
/// `startupTaints` to configure), and the SIG node-readiness-controller keys its rules' taints
/// with it. Allowed for gate keys; a key of it that another controller put on a node is left
/// alone, as any key meshgate did not add.
pub const READINESS_TAINT_PREFIX: &str = "readiness.k8s.io/";

/// The prefixes of reserved domains a gate key may have.
pub const ALLOWED_TAINT_PREFIXES: [&str; 2] =
    [AUTOSCALER_STARTUP_TAINT_PREFIX, READINESS_TAINT_PREFIX];

/// Why a taint key may not be a gate's: it belongs to someone else. `None` when it may.
pub fn reserved_taint_key(key: &str) -> Option<String> {
    if ALLOWED_TAINT_PREFIXES.iter().any(|p| key.starts_with(p)) {
        return None;
    }
    if RESERVED_TAINT_KEYS.contains(&key) {
        return Some(format!(
            "taint key {key:?} is set by others (the cluster autoscaler, add-on node pools)"
        ));
    }
    let domain = key.split_once('/').map(|(d, _)| d)?;
    RESERVED_TAINT_DOMAINS
        .iter()
        .find(|r| domain == **r || domain.ends_with(&format!(".{r}")))
        .map(|r| {
            format!(
                "taint key {key:?} is in the {r} domain, which belongs to Kubernetes, the kubelet, cloud providers or autoscalers (allowed prefixes: {AUTOSCALER_STARTUP_TAINT_PREFIX}, {READINESS_TAINT_PREFIX})"
            )
        })
}

/// Whether `name` is an extended resource name, as the API server defines one: `<domain>/<name>`
/// with the domain outside `kubernetes.io` (`cpu`, `memory`, `pods`, `hugepages-2Mi` and
/// `kubernetes.io/...` are the node's own), not a quota name (`requests.`).
pub fn is_extended_resource(name: &str) -> bool {
    name.split_once('/').is_some_and(|(domain, rest)| {
        !domain.is_empty()
            && !rest.is_empty()
            && !rest.contains('/')
            && !name.contains("kubernetes.io/")
            && !name.starts_with("requests.")
    })
}

impl Default for NodeGateSpec {
    fn default() -> Self {
        Self {
            taint: GateTaint::default(),
            allow_no_execute: false,
            agents: Vec::new(),
            node_selector: LabelSelector::default(),
            mode: GateMode::default(),
            grace_period_seconds: default_grace(),
            removal_delay_seconds: 0,
            taint_on_create: true,
            resource: None,
            max_retainted: default_max_retainted(),
            dry_run: false,
            missing_agent_timeout_seconds: default_missing_agent_timeout(),
            on_missing_agent: MissingAgentPolicy::default(),
        }
    }
}

impl NodeGateSpec {
    /// Problems that make the controller leave the gate alone (the API server refuses them too,
    /// by the CRD's rules; a gate stored before those rules existed is still caught here).
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(why) = reserved_taint_key(&self.taint.key) {
            out.push(format!("taint.key: {why}"));
        }
        if self.taint.effect == TaintEffect::NoExecute && !self.allow_no_execute {
            out.push("taint.effect: NoExecute needs allowNoExecute: true".into());
        }
        if let Some(r) = &self.resource
            && !is_extended_resource(&r.name)
        {
            out.push(format!(
                "resource.name: {:?} is not an extended resource name (`<domain>/<name>` outside kubernetes.io); a gate must not advertise or withdraw a node's own resources",
                r.name
            ));
        }
        if parse_budget(&self.max_retainted).is_none() {
            out.push(format!(
                "maxRetainted: {:?} is not a number or a percentage",
                self.max_retainted
            ));
        }
        out
    }

    /// The re-taint budget for a gate that selects `nodes` nodes.
    pub fn retaint_budget(&self, nodes: usize) -> usize {
        match parse_budget(&self.max_retainted) {
            Some(Budget::Count(n)) => n,
            Some(Budget::Percent(p)) => (nodes * p / 100).max(1),
            None => 1,
        }
    }
}

enum Budget {
    Count(usize),
    Percent(usize),
}

fn parse_budget(s: &str) -> Option<Budget> {
    match s.strip_suffix('%') {
        Some(p) => p.parse().ok().filter(|p| *p <= 100).map(Budget::Percent),
        None => s.parse().ok().map(Budget::Count),
    }
}

fn default_grace() -> u32 {
    10
}

fn yes() -> bool {
    true
}

/// The taint a gate owns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GateTaint {
    #[serde(default = "default_taint_key")]
    #[schemars(length(min = 1, max = 316))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self.startsWith('startup-taint.cluster-autoscaler.kubernetes.io/') || self.startsWith('readiness.k8s.io/') || !(self.matches('^([^/]*[.])?(kubernetes[.]io|k8s[.]io|karpenter[.]sh|amazonaws[.]com|cloud[.]google[.]com|gke[.]io|azure[.]com|cilium[.]io)/') || self in ['ToBeDeletedByClusterAutoscaler', 'DeletionCandidateOfClusterAutoscaler', 'CriticalAddonsOnly'])",
        "message": "the taint key belongs to Kubernetes, the kubelet, a cloud provider or an autoscaler; use your own domain, or the prefix startup-taint.cluster-autoscaler.kubernetes.io/ or readiness.k8s.io/"
    }]))]
    pub key: String,
    #[serde(default)]
    pub effect: TaintEffect,
}

fn default_taint_key() -> String {
    crate::names::DEFAULT_TAINT_KEY.into()
}

impl Default for GateTaint {
    fn default() -> Self {
        Self {
            key: default_taint_key(),
            effect: TaintEffect::default(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum TaintEffect {
    #[default]
    NoSchedule,
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// A node agent: the pods in `namespace` that `selector` picks, one per node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Agent {
    /// A short name for status and events, e.g. `cni` or `node-proxy`.
    pub name: String,
    pub namespace: String,
    pub selector: LabelSelector,
    /// The DaemonSet that runs the agent. When set, a node the DaemonSet cannot target (node
    /// selector, required node affinity, taints it does not tolerate) does not wait for this
    /// agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon_set: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum GateMode {
    /// Remove the taint once; never add it back.
    #[default]
    Bootstrap,
    /// Put the taint back when an agent stops being Ready.
    Continuous,
}

/// An extended resource advertised in `status.capacity` of ready nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GateResource {
    /// An extended resource name, `<domain>/<name>` outside `kubernetes.io`: never one of the
    /// node's own resources (`cpu`, `memory`, `pods`, ...).
    #[serde(default = "default_resource")]
    #[schemars(length(min = 3, max = 316))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self.matches('^[^/]+/[^/]+$') && !self.contains('kubernetes.io/') && !self.startsWith('requests.')",
        "message": "the resource must be an extended resource, <domain>/<name> outside kubernetes.io, not one of the node's own"
    }]))]
    pub name: String,
    /// `NodeStatus`: units of the resource in the node's `status.capacity`. `DRA`: devices in
    /// a `ResourceSlice` of the node (at most one per pod the node can run, and at most
    /// [`DRA_MAX_DEVICES`]); the controller keeps a `DeviceClass` whose `extendedResourceName`
    /// is `name`, so pods keep the same request.
    #[serde(default = "default_count")]
    pub count: u32,
    /// How ready nodes offer the resource.
    #[serde(default)]
    pub provider: ResourceProvider,
}

/// How a gate's resource is offered on ready nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ResourceProvider {
    /// An extended resource in the node's `status.capacity` and `status.allocatable`, written
    /// by the controller. The scheduler and the kubelet's admission count it.
    #[default]
    NodeStatus,
    /// Dynamic resource allocation (`resource.k8s.io/v1`): a `DeviceClass` with
    /// `extendedResourceName` and one `ResourceSlice` per ready node, published by the
    /// controller; the node plugin (`meshgate node`) confirms on the node, before the pod's
    /// sandbox exists, that the mesh will capture the pod. Where the API server does not
    /// serve DRA extended resources the gate falls back to `NodeStatus` and says so
    /// (condition `ResourceProvider`).
    #[serde(rename = "DRA")]
    Dra,
}

/// The most devices a DRA gate publishes for one node: one `ResourceSlice` holds at most 128
/// (`resource.k8s.io/v1` validation).
pub const DRA_MAX_DEVICES: u32 = 128;

fn default_resource() -> String {
    crate::names::DEFAULT_RESOURCE.into()
}

fn default_count() -> u32 {
    1000
}

/// Observed state of a gate.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeGateStatus {
    #[serde(default)]
    pub observed_generation: i64,
    /// Nodes the gate selects.
    #[serde(default)]
    pub nodes: u32,
    /// Nodes whose agents are all Ready.
    #[serde(default)]
    pub ready_nodes: u32,
    /// Nodes that carry the taint.
    #[serde(default)]
    pub held_nodes: u32,
    /// `dryRun`: nodes the gate would taint now.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub would_taint: u32,
    /// `dryRun`: nodes the gate would release now.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub would_untaint: u32,
    /// Nodes whose re-taint the `maxRetainted` budget holds back.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retaint_deferred: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names_are_told_from_a_nodes_own() {
        for ok in [
            "meshgate.dev/mesh-ready",
            "example.com/gpu",
            "mesh.example/ready",
        ] {
            assert!(is_extended_resource(ok), "{ok}");
        }
        for own in [
            "cpu",
            "memory",
            "pods",
            "hugepages-2Mi",
            "ephemeral-storage",
            "kubernetes.io/batch",
            "node.kubernetes.io/x",
            "requests.example.com/x",
            "/x",
            "example.com/",
            "a/b/c",
        ] {
            assert!(!is_extended_resource(own), "{own}");
        }
    }

    #[test]
    fn the_autoscalers_startup_prefixes_are_allowed_and_the_rest_of_their_domains_reserved() {
        for ok in [
            "startup-taint.cluster-autoscaler.kubernetes.io/mesh",
            "readiness.k8s.io/mesh",
            "node.meshgate.dev/agent-not-ready",
            "example.com/mesh",
        ] {
            assert_eq!(reserved_taint_key(ok), None, "{ok}");
        }
        for reserved in [
            "node.kubernetes.io/not-ready",
            "k8s.io/mesh",
            "other.k8s.io/mesh",
            "sub.readiness.k8s.io/mesh",
            "karpenter.sh/disrupted",
            "CriticalAddonsOnly",
        ] {
            assert!(reserved_taint_key(reserved).is_some(), "{reserved}");
        }
    }

    #[test]
    fn a_gate_advertising_a_nodes_own_resource_is_a_problem() {
        let mut spec = NodeGateSpec {
            resource: Some(GateResource {
                name: "cpu".into(),
                count: 1,
                provider: ResourceProvider::NodeStatus,
            }),
            ..NodeGateSpec::default()
        };
        let problems = spec.problems();
        assert!(
            problems.iter().any(|p| p.starts_with("resource.name:")),
            "{problems:?}"
        );
        spec.resource = Some(GateResource {
            name: default_resource(),
            count: 1,
            provider: ResourceProvider::Dra,
        });
        assert_eq!(spec.problems(), Vec::<String>::new());
    }
}

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
pub struct NodeGateSpec {
    /// The startup taint this gate owns. meshgate never touches another taint.
    #[serde(default)]
    pub taint: GateTaint,
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
    #[serde(default = "default_resource")]
    pub name: String,
    #[serde(default = "default_count")]
    pub count: u32,
}

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
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

//! Node gate decisions: given what a node and its agent pods look like now, what the node's
//! startup taint and gate resource should be, and when to look again.
//!
//! # Rules
//! * A node is **ready** when every agent of the gate has a pod on it whose `Ready` condition is
//!   `True`, or cannot have one (below). Its ready time is the latest of those pods' Ready
//!   transitions.
//! * **Not targeted:** an agent that names its DaemonSet is not waited for on a node that
//!   DaemonSet would never run on: the node fails the template's `nodeSelector` or required node
//!   affinity, or has a `NoSchedule`/`NoExecute` taint the template does not tolerate (the gate's
//!   own taint and the taints every DaemonSet pod tolerates automatically do not count). Without a
//!   DaemonSet name an agent is always waited for: meshgate cannot know it will never come.
//! * **Untaint:** a ready node loses the taint `removalDelaySeconds` after its ready time.
//! * **Re-taint:** in `Continuous` mode a node whose agents have been not ready for
//!   `gracePeriodSeconds` gets the taint back (`NoSchedule`). In `Bootstrap` mode a node that was
//!   ready once (annotation `meshgate.dev/agents-ready-since`) never gets it back, and loses a
//!   taint it still carries only while its agents are Ready; a node never ready that lacks the
//!   taint (registered while the webhook was down, or existing before meshgate) gets it, when
//!   the gate has `taintOnCreate`. Without `taintOnCreate` the startup taint comes from elsewhere
//!   (kubelet flags, node pool settings) or not at all (a resource-only gate), and the
//!   controller only removes it.
//! * **Resource:** the gate resource is advertised while the node is ready; in `Continuous` mode
//!   it is withdrawn together with the re-taint.
//! * Only the taint with the gate's key is ever added or removed; the patch carries a `test` of
//!   the whole taint list it read, so a concurrent change to any taint makes the write fail and the
//!   controller re-reads instead of overwriting.
//! * **Ownership:** meshgate removes only taints it owns: keys in its own domain
//!   (`*.meshgate.dev/`), keys it recorded on the node when it added them (annotation
//!   `meshgate.dev/owned-taints`), and the key of a gate without `taintOnCreate` (its taint comes
//!   from elsewhere — kubelet flags, node pool or Karpenter startup taints — and the gate is the
//!   one that lifts it). Gate keys of Kubernetes, the kubelet, providers and autoscalers are
//!   refused ([`meshgate_api::node_gate::reserved_taint_key`]).
//! * **Missing agents:** an agent without a pod on the node (or whose DaemonSet does not exist)
//!   holds the node at most `missingAgentTimeoutSeconds` after the node's creation; then, with
//!   `onMissingAgent: Release`, it no longer counts (the gate reports itself `Degraded`).
//! * **Re-taint budget:** a re-taint (Continuous mode, a node released before) is marked
//!   [`NodeDecision::retaint`]; the controller applies it only within the gate's
//!   `maxRetainted` budget.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelectorRequirement, PodTemplateSpec, Taint, Toleration};
use meshgate_api::GateNode;
use meshgate_api::node_gate::{GateMode, NodeGateSpec};
use serde_json::{Value, json};

use crate::object::patch::JsonPatch;

/// The state of one agent on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentState {
    /// A pod of the agent is Ready on the node since this time (Unix seconds).
    Ready { since: i64 },
    /// A pod exists but is not Ready, since this time.
    NotReady { since: i64 },
    /// No pod of the agent is on the node.
    Missing,
    /// The agent's DaemonSet would never run on this node.
    NotTargeted,
}

/// What the controller observed of one node.
#[derive(Clone, Debug)]
pub struct NodeObservation<'a> {
    /// The gate's name (its bootstrap mark on the node is per gate).
    pub gate: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub annotations: &'a BTreeMap<String, String>,
    pub taints: &'a [Taint],
    /// Node creation time, Unix seconds.
    pub created: i64,
    /// Per agent of the gate, in the gate's order.
    pub agents: &'a [AgentState],
    /// Whether `status.capacity` carries the gate resource.
    pub resource_advertised: bool,
    pub now: i64,
}

/// What the gate needs of one agent pod (a summary: the controller keeps these, not pods).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentPod {
    pub namespace: String,
    pub name: String,
    /// Shared: the agent pods of one DaemonSet revision carry the same labels, and an index of
    /// thousands of them keeps one copy (`meshgate_controller::agents`).
    pub labels: std::sync::Arc<BTreeMap<String, String>>,
    /// Ready, and not being deleted.
    pub ready: bool,
    /// When the Ready condition last changed (else the pod's creation), Unix seconds; for a pod
    /// being deleted, when its deletion began (a rollout's old pod is not ready from then, and
    /// the gate's grace period counts from then, not from when it became Ready long ago).
    pub since: i64,
}

impl AgentPod {
    /// The pod's node and summary; `None` for a pod not bound to a node.
    pub fn of(pod: &k8s_openapi::api::core::v1::Pod) -> Option<(String, AgentPod)> {
        let node = pod.spec.as_ref()?.node_name.clone()?;
        let ready_cond = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
        let created = pod
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(0, |t| t.0.as_second());
        // A pod being deleted is not counted as Ready.
        let ready = pod.metadata.deletion_timestamp.is_none()
            && ready_cond.is_some_and(|c| c.status == "True");
        // `deletionTimestamp` is when the pod will be gone: its deletion began its grace period
        // before that.
        let deleting_since = pod
            .metadata
            .deletion_timestamp
            .as_ref()
            .map(|t| t.0.as_second() - pod.metadata.deletion_grace_period_seconds.unwrap_or(0));
        let since = deleting_since.unwrap_or_else(|| {
            ready_cond
                .and_then(|c| c.last_transition_time.as_ref())
                .map_or(created, |t| t.0.as_second())
        });
        Some((
            node,
            AgentPod {
                namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                name: pod.metadata.name.clone().unwrap_or_default(),
                labels: std::sync::Arc::new(pod.metadata.labels.clone().unwrap_or_default()),
                ready,
                since,
            },
        ))
    }
}

/// What is known of an agent's DaemonSet.
#[derive(Clone, Copy, Debug)]
pub enum DaemonSetView<'a> {
    /// The agent names no DaemonSet.
    Unnamed,
    /// The named DaemonSet does not exist.
    Absent,
    /// The DaemonSet's pod template.
    Template(&'a PodTemplateSpec),
}

/// An agent's state on a node, from the agent pods on that node and its DaemonSet: Ready if
/// any of its pods is Ready (since the earliest), NotReady if it has pods but none Ready, else
/// NotTargeted if its DaemonSet would never run there, else Missing.
pub fn agent_state<'p>(
    agent: &meshgate_api::node_gate::Agent,
    pods_on_node: impl IntoIterator<Item = &'p AgentPod>,
    daemonset: DaemonSetView<'_>,
    node: &GateNode,
    gate_taint: &str,
) -> AgentState {
    let pods: Vec<&AgentPod> = pods_on_node
        .into_iter()
        .filter(|p| p.namespace == agent.namespace && agent.selector.matches(&p.labels))
        .collect();
    if let Some(since) = pods.iter().filter(|p| p.ready).map(|p| p.since).min() {
        return AgentState::Ready { since };
    }
    if let Some(since) = pods.iter().map(|p| p.since).min() {
        return AgentState::NotReady { since };
    }
    if let DaemonSetView::Template(template) = daemonset {
        let empty = BTreeMap::new();
        let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
        let name = node.metadata.name.as_deref().unwrap_or_default();
        if !daemonset_targets(template, name, labels, node.taints(), gate_taint) {
            return AgentState::NotTargeted;
        }
    }
    AgentState::Missing
}

/// A copy of the node's taints (none when it has no spec).
pub fn taints_of(node: &GateNode) -> Vec<Taint> {
    node.taints().to_vec()
}

/// How the gate's resource is offered on a node, as the caller sees it: in the node's status,
/// or (DRA, where the API server serves it) by the gate's `ResourceSlice` for the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    NodeStatus,
    Dra { slice: bool },
}

/// The gate's decision for a node as it is now, from the node and its agents' states: the one
/// place that turns a Node into a [`NodeObservation`] (the controller's reconcile and status,
/// and `meshgate status`, all call it). Returns the node's taints too.
pub fn decide_node(
    gate: &str,
    spec: &NodeGateSpec,
    node: &GateNode,
    agents: &[AgentState],
    offer: Offer,
    now: i64,
) -> (Vec<Taint>, NodeDecision) {
    let empty = BTreeMap::new();
    let taints = taints_of(node);
    let resource_advertised = spec.resource.as_ref().is_some_and(|r| match offer {
        Offer::NodeStatus => node.advertises(&r.name),
        Offer::Dra { slice } => slice,
    });
    let decision = decide(
        spec,
        &NodeObservation {
            gate,
            labels: node.metadata.labels.as_ref().unwrap_or(&empty),
            annotations: node.metadata.annotations.as_ref().unwrap_or(&empty),
            taints: &taints,
            created: node
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(now, |t| t.0.as_second()),
            agents,
            resource_advertised,
            now,
        },
    );
    (taints, decision)
}

/// The node condition a gate publishes (`meshgate.dev/<gate>Ready`): `True` when the gate lets
/// the node run mesh pods (its state is Ready, Releasing or Released), with a reason, and a
/// message naming the agents that are not ready.
pub fn node_condition(
    spec: &NodeGateSpec,
    gate: &str,
    agents: &[AgentState],
    d: &NodeDecision,
) -> (String, &'static str, &'static str, String) {
    let unready: Vec<String> = spec
        .agents
        .iter()
        .zip(agents)
        .enumerate()
        .filter(|(_, (_, s))| matches!(s, AgentState::NotReady { .. } | AgentState::Missing))
        .map(|(i, (a, s))| {
            let what = match s {
                AgentState::Missing if d.given_up.contains(&i) => "missing, no longer waited for",
                AgentState::Missing => "missing",
                _ => "not ready",
            };
            format!(
                "{} ({}/{}): {what}",
                a.name,
                a.namespace,
                a.daemon_set.as_deref().unwrap_or("-")
            )
        })
        .collect();
    let ctype = format!("{}/{gate}Ready", meshgate_api::DOMAIN);
    let agents_note = if unready.is_empty() {
        "every agent is Ready".to_owned()
    } else {
        unready.join(", ")
    };
    let (status, reason) = match d.state {
        NodeState::Ready | NodeState::Releasing if unready.is_empty() => ("True", "AgentsReady"),
        NodeState::Ready | NodeState::Releasing => ("True", "MissingAgentsReleased"),
        NodeState::Released if unready.is_empty() => ("True", "AgentsReady"),
        // Bootstrap mode: released once, not held again.
        NodeState::Released => ("True", "ReleasedOnce"),
        NodeState::Degraded => ("False", "AgentsNotReadyGrace"),
        NodeState::Waiting | NodeState::Ignored => ("False", "AgentsNotReady"),
    };
    (
        ctype,
        status,
        reason,
        format!("node gate {gate}: {agents_note}"),
    )
}

/// The node's state in the gate's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NodeState {
    /// Not selected by the gate.
    Ignored,
    /// Agents not all Ready; node held (tainted) or about to be.
    Waiting,
    /// Agents Ready, taint removal pending the removal delay.
    Releasing,
    /// Agents Ready (or not targeted), node released.
    Ready,
    /// Bootstrap mode, released once; no longer watched for agent failures.
    Released,
    /// Continuous mode, agents not Ready, within the grace period.
    Degraded,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Ignored => "ignored",
            NodeState::Waiting => "waiting",
            NodeState::Releasing => "releasing",
            NodeState::Ready => "ready",
            NodeState::Released => "released",
            NodeState::Degraded => "degraded",
        }
    }
}

/// What to change on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeDecision {
    pub state: NodeState,
    /// `Some(true)`: the taint must be present; `Some(false)`: absent; `None`: leave as is.
    pub taint: Option<bool>,
    /// Same for the gate resource (only when the gate has one).
    pub resource: Option<bool>,
    /// Record the agents' ready time on the node (bootstrap completion), Unix seconds.
    pub mark_ready_since: Option<i64>,
    /// Look again after this many seconds (delays and grace periods).
    pub requeue_after: Option<i64>,
    /// When the agents became ready (for the ready-to-untaint histogram).
    pub ready_since: Option<i64>,
    /// The taint is put back on a node released before (Continuous mode): subject to the
    /// gate's re-taint budget.
    pub retaint: bool,
    /// Agents that no longer hold the node: missing past `missingAgentTimeoutSeconds`.
    pub given_up: Vec<usize>,
    /// The taint should go but meshgate does not own it: it is left alone.
    pub not_owned: bool,
}

/// Node annotation listing the taint keys meshgate added (comma-separated), outside its own
/// domain.
pub const OWNED_TAINTS: &str = "meshgate.dev/owned-taints";

/// Keys recorded in the node's ownership annotation.
fn recorded_owned(annotations: &BTreeMap<String, String>) -> Vec<&str> {
    annotations
        .get(OWNED_TAINTS)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether meshgate may remove the taint `key` from a node with these annotations (see the
/// module docs): its own domain, or recorded when it was added.
pub fn owns_key(key: &str, annotations: &BTreeMap<String, String>) -> bool {
    meshgate_api::in_domain(key) || recorded_owned(annotations).contains(&key)
}

/// Whether the gate may remove its taint from the node: it owns the key, or the gate lifts a
/// taint that others put on (no `taintOnCreate`).
pub fn may_remove(spec: &NodeGateSpec, annotations: &BTreeMap<String, String>) -> bool {
    !spec.taint_on_create || owns_key(&spec.taint.key, annotations)
}

/// Whether the node carries the gate's taint as a re-taint: released once (bootstrap mark)
/// and tainted again.
pub fn is_retainted(
    gate: &str,
    spec: &NodeGateSpec,
    annotations: &BTreeMap<String, String>,
    taints: &[Taint],
) -> bool {
    bootstrapped(gate, annotations) && has_taint(spec, taints)
}

/// The node annotation that marks `gate`'s bootstrap done on a node:
/// `agents-ready-since.meshgate.dev/<gate>`; a name longer than an annotation name may be (63)
/// is cut to 54 characters and followed by `-` and 8 hex digits of its FNV-1a hash.
pub fn ready_since_key(gate: &str) -> String {
    const MAX: usize = 63;
    let prefix = meshgate_api::names::GATE_READY_SINCE_PREFIX;
    if gate.len() <= MAX {
        return format!("{prefix}{gate}");
    }
    let hash = gate.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    // Gate names are DNS subdomains (ASCII): any byte index is a char boundary.
    let head = gate.get(..MAX - 9).unwrap_or(gate);
    format!("{prefix}{head}-{hash:08x}")
}

/// Whether `gate` has released the node once: the gate's own mark, or, on a node marked before
/// marks were per gate (the node's mark and no gate's), that one.
fn bootstrapped(gate: &str, annotations: &BTreeMap<String, String>) -> bool {
    annotations.contains_key(&ready_since_key(gate))
        || (annotations.contains_key(meshgate_api::names::NODE_READY_SINCE)
            && !annotations
                .keys()
                .any(|k| k.starts_with(meshgate_api::names::GATE_READY_SINCE_PREFIX)))
}

/// Whether the gate selects the node.
pub fn selects(spec: &NodeGateSpec, labels: &BTreeMap<String, String>) -> bool {
    spec.node_selector.matches(labels)
}

/// Whether the node carries the gate's taint.
pub fn has_taint(spec: &NodeGateSpec, taints: &[Taint]) -> bool {
    taints.iter().any(|t| t.key == spec.taint.key)
}

/// Decides the node's taint and resource.
pub fn decide(spec: &NodeGateSpec, node: &NodeObservation<'_>) -> NodeDecision {
    let mut d = decide_taint(spec, node);
    if d.taint == Some(false) && !may_remove(spec, node.annotations) {
        d.taint = None;
        d.not_owned = true;
    }
    d
}

fn decide_taint(spec: &NodeGateSpec, node: &NodeObservation<'_>) -> NodeDecision {
    let tainted = has_taint(spec, node.taints);
    let mut d = NodeDecision {
        state: NodeState::Ignored,
        taint: None,
        resource: None,
        mark_ready_since: None,
        requeue_after: None,
        ready_since: None,
        retaint: false,
        given_up: Vec::new(),
        not_owned: false,
    };
    let has_resource = spec.resource.is_some();
    if !selects(spec, node.labels) {
        // Several gates may share a taint key: releasing nodes no gate selects any more is
        // decided across all gates, by `orphaned_taints`.
        return d;
    }
    let bootstrapped = bootstrapped(node.gate, node.annotations);
    if spec.mode == GateMode::Bootstrap && bootstrapped {
        // Released once: never tainted again. A gate taint still present (its removal failed
        // after the node was marked, or another gate marked the node: the annotation is the
        // node's) goes only once the agents are Ready: an unready agent never untaints.
        let unready = node
            .agents
            .iter()
            .any(|a| matches!(a, AgentState::NotReady { .. } | AgentState::Missing));
        if tainted && unready {
            d.state = NodeState::Waiting;
            return d;
        }
        d.state = NodeState::Released;
        d.taint = tainted.then_some(false);
        d.resource = (has_resource && !node.resource_advertised).then_some(true);
        return d;
    }

    let mut ready_since: Option<i64> = None;
    let mut unready_since: Option<i64> = None;
    let timeout = i64::from(spec.missing_agent_timeout_seconds);
    let missing_expired = node.now >= node.created + timeout;
    for (i, a) in node.agents.iter().enumerate() {
        if *a == AgentState::Missing && missing_expired {
            d.given_up.push(i);
            if spec.on_missing_agent == meshgate_api::node_gate::MissingAgentPolicy::Release {
                continue;
            }
        }
        match a {
            AgentState::Ready { since } => {
                ready_since = Some(ready_since.map_or(*since, |r| r.max(*since)))
            }
            AgentState::NotTargeted => {}
            AgentState::NotReady { since } => {
                unready_since = Some(unready_since.map_or(*since, |u| u.min(*since)));
            }
            AgentState::Missing => {
                unready_since = Some(unready_since.map_or(node.created, |u| u.min(node.created)));
            }
        }
    }

    match unready_since {
        None => {
            // Every agent Ready (or not targeted).
            let since = ready_since.unwrap_or(node.created);
            d.ready_since = Some(since);
            let release_at = since + i64::from(spec.removal_delay_seconds);
            if tainted && node.now < release_at {
                d.state = NodeState::Releasing;
                d.requeue_after = Some(release_at - node.now);
                return d;
            }
            d.state = NodeState::Ready;
            d.taint = tainted.then_some(false);
            d.resource = (has_resource && !node.resource_advertised).then_some(true);
            if !bootstrapped {
                d.mark_ready_since = Some(since);
            }
        }
        Some(since) => {
            d.state = NodeState::Waiting;
            if !missing_expired
                && node.agents.contains(&AgentState::Missing)
                && spec.on_missing_agent == meshgate_api::node_gate::MissingAgentPolicy::Release
            {
                d.requeue_after = Some(node.created + timeout - node.now);
            }
            let never_ready = !bootstrapped;
            match spec.mode {
                GateMode::Bootstrap => {
                    d.taint = (!tainted && spec.taint_on_create).then_some(true);
                    d.resource = (has_resource && node.resource_advertised).then_some(false);
                }
                GateMode::Continuous if tainted || never_ready => {
                    d.taint = (!tainted && spec.taint_on_create).then_some(true);
                    d.resource = (has_resource && node.resource_advertised).then_some(false);
                }
                GateMode::Continuous => {
                    let due = since + i64::from(spec.grace_period_seconds);
                    if node.now < due {
                        d.state = NodeState::Degraded;
                        d.requeue_after = Some(due - node.now);
                    } else {
                        d.taint = Some(true);
                        d.retaint = true;
                        d.resource = (has_resource && node.resource_advertised).then_some(false);
                    }
                }
            }
        }
    }
    d
}

/// Gate taint keys on the node that no gate selecting the node holds (it no longer selects the
/// node) and that meshgate owns: the controller removes them, so a node is never held by a rule
/// that does not apply to it. Keys of no known gate, and keys meshgate does not own, are never
/// touched. (A deleted gate's taints are removed by its finalizer.)
pub fn orphaned_taints<'s>(
    gates: impl IntoIterator<Item = &'s NodeGateSpec> + Clone,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    taints: &[Taint],
) -> Vec<String> {
    let held: Vec<&str> = gates
        .clone()
        .into_iter()
        .filter(|g| selects(g, labels))
        .map(|g| g.taint.key.as_str())
        .collect();
    let mut out: Vec<String> = gates
        .into_iter()
        .map(|g| g.taint.key.as_str())
        .filter(|k| !held.contains(k) && taints.iter().any(|t| t.key == *k))
        .filter(|k| owns_key(k, annotations))
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Taints meshgate put on a node ([`owns_key`]: in its own domain, or recorded in
/// `meshgate.dev/owned-taints`) whose key no gate holds any more, on a node that a gate selects:
/// an upgrade changed the gate's key (`meshgate install` keyed its gate
/// [`meshgate_api::names::DEFAULT_TAINT_KEY`] until it used a startup-taint prefix autoscalers
/// know; `--taint-key` or the chart's `taintKey` changed; a node registered while the admission
/// policy still had the old key). The controller lifts them after the gates selecting the node
/// have made their own decisions in the same reconcile, so their keys are on the node wherever
/// their agents are not ready and the node is never left unprotected. Not while a selecting gate
/// is in dry run (its key is not written). A key another component put on is never touched.
pub fn superseded_taints<'s>(
    gates: impl IntoIterator<Item = &'s NodeGateSpec> + Clone,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    taints: &[Taint],
) -> Vec<String> {
    let selecting: Vec<&NodeGateSpec> = gates
        .clone()
        .into_iter()
        .filter(|g| selects(g, labels))
        .collect();
    if selecting.is_empty() || selecting.iter().any(|g| g.dry_run) {
        return Vec::new();
    }
    let held: Vec<&str> = gates.into_iter().map(|g| g.taint.key.as_str()).collect();
    let mut out: Vec<String> = taints
        .iter()
        .map(|t| t.key.as_str())
        .filter(|k| !held.contains(k) && owns_key(k, annotations))
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The JSON patch that makes the node's taints `want_present` for the gate's taint, conditional
/// on what it was computed from (optimistic lock): a `test` of the whole list it read, or, when
/// it read no taint (the field absent or empty, which a JSON Patch `test` cannot tell apart
/// from a list that appeared since), a `test` of the node's `resourceVersion` as read. Either
/// way a list another controller changed in between (a kubelet's or cloud provider's taint, the
/// node lifecycle controller's `unreachable`) makes the patch fail, and is never overwritten.
/// `None` when nothing changes.
pub fn taint_patch(
    spec: &NodeGateSpec,
    current: &[Taint],
    resource_version: &str,
    want_present: bool,
) -> Option<JsonPatch> {
    let present = has_taint(spec, current);
    if present == want_present {
        return None;
    }
    let key = spec.taint.key.as_str();
    let mut desired: Vec<Value> = current
        .iter()
        .filter(|t| t.key != key)
        .map(|t| serde_json::to_value(t).unwrap_or(Value::Null))
        .collect();
    if want_present {
        desired.push(json!({"key": key, "effect": spec.taint.effect.as_str()}));
    }
    let mut ops = Vec::new();
    if current.is_empty() {
        // The field may be absent or an empty list: `add` works for both, and replaces a list
        // that appeared since: only on the node as read.
        ops.push(
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": resource_version}),
        );
        ops.push(json!({"op": "add", "path": "/spec/taints", "value": desired}));
    } else {
        let observed: Vec<Value> = current
            .iter()
            .map(|t| serde_json::to_value(t).unwrap_or(Value::Null))
            .collect();
        ops.push(json!({"op": "test", "path": "/spec/taints", "value": observed}));
        ops.push(json!({"op": "replace", "path": "/spec/taints", "value": desired}));
    }
    Some(JsonPatch(ops))
}

/// The merge patch of the node's ownership annotation after the gate's key is added
/// (`added`) or removed; `None` when it does not change (keys in meshgate's own domain are
/// never recorded). Written before a taint is added and after it is removed, so a recorded key
/// is never missing for a taint meshgate added.
pub fn owned_annotation_patch(
    key: &str,
    annotations: &BTreeMap<String, String>,
    added: bool,
) -> Option<Value> {
    let value = owned_after(key, annotations, added)?.map_or(Value::Null, Value::from);
    Some(json!({"metadata": {"annotations": {OWNED_TAINTS: value}}}))
}

/// The ownership annotation's value after the gate's key is added or removed (`None` inside:
/// the annotation goes); `None` when it does not change.
fn owned_after(
    key: &str,
    annotations: &BTreeMap<String, String>,
    added: bool,
) -> Option<Option<String>> {
    if meshgate_api::in_domain(key) {
        return None;
    }
    let mut owned = recorded_owned(annotations);
    if owned.contains(&key) == added {
        return None;
    }
    owned.retain(|k| *k != key);
    if added {
        owned.push(key);
    }
    Some((!owned.is_empty()).then(|| owned.join(",")))
}

/// The marks a gate writes when its agents became ready at `since` (RFC 3339): its own
/// ([`ready_since_key`]), and the node's (the first gate's time) if the node has none.
pub fn ready_marks(
    gate: &str,
    annotations: &BTreeMap<String, String>,
    since: &str,
) -> BTreeMap<String, String> {
    let mut marks = BTreeMap::from([(ready_since_key(gate), since.to_owned())]);
    if !annotations.contains_key(meshgate_api::names::NODE_READY_SINCE) {
        marks.insert(
            meshgate_api::names::NODE_READY_SINCE.to_owned(),
            since.to_owned(),
        );
    }
    marks
}

/// The one JSON patch that releases a node: the gate's taint removed ([`taint_patch`], with its
/// `test`), the ready `marks` added and the ownership record updated, so the release, the
/// bootstrap mark it rests on and the record land together in one write. The record's change is
/// conditional on its value as read (`test`). A node read with no annotations gets the marks as a
/// new map, conditional on its `resourceVersion` as read (a map that appeared since is never
/// replaced). `None` when the taint is not there, or when a node without annotations has no
/// `resourceVersion` to test: the caller writes them apart.
pub fn release_patch(
    spec: &NodeGateSpec,
    node: &GateNode,
    marks: &BTreeMap<String, String>,
) -> Option<JsonPatch> {
    let rv = node
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or_default();
    let mut patch = taint_patch(spec, node.taints(), rv, false)?;
    let Some(annotations) = node.metadata.annotations.as_ref() else {
        if marks.is_empty() {
            return Some(patch);
        }
        if rv.is_empty() {
            return None;
        }
        let tested = patch
            .0
            .iter()
            .any(|op| op["path"] == "/metadata/resourceVersion");
        if !tested {
            patch.0.insert(
                0,
                json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv}),
            );
        }
        patch.add("/metadata/annotations", json!(marks));
        return Some(patch);
    };
    let path = |k: &str| format!("/metadata/annotations/{}", crate::object::patch::escape(k));
    for (k, v) in marks {
        patch.add(path(k), json!(v));
    }
    if let (Some(owned), Some(read)) = (
        owned_after(&spec.taint.key, annotations, false),
        annotations.get(OWNED_TAINTS),
    ) {
        let at = path(OWNED_TAINTS);
        patch
            .0
            .push(json!({"op": "test", "path": at, "value": read}));
        match owned {
            Some(v) => patch
                .0
                .push(json!({"op": "replace", "path": at, "value": v})),
            None => patch.remove(at),
        }
    }
    Some(patch)
}

/// The merge patch for the Node `status` subresource that advertises (`count` units) or
/// withdraws the gate resource in `capacity` and `allocatable`.
pub fn resource_patch(resource: &str, count: u32, advertise: bool) -> Value {
    let value = if advertise {
        json!(count.to_string())
    } else {
        Value::Null
    };
    json!({"status": {"capacity": {resource: value}, "allocatable": {resource: value}}})
}

/// What `meshgate uninstall` changes on one node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UninstallPlan {
    /// The JSON patch of `spec.taints` (with a `test` of the list it was computed from).
    pub taints: Option<JsonPatch>,
    /// The taint keys it removes.
    pub removed: Vec<String>,
    /// The merge patch that drops meshgate's annotations (ownership record, release mark).
    pub annotations: Option<Value>,
    /// The merge patch of `status` that withdraws the gate resources.
    pub resources: Option<Value>,
}

/// What uninstalling meshgate takes off a node: of the taints whose key is a gate's (any gate:
/// all go) or meshgate's default, those meshgate owns ([`owns_key`]: its own domain, or recorded
/// as added by meshgate) — a taint with a gate's key that another component added (a gate that
/// only lifts it) is left; meshgate's annotations; and the gates' resources (names of the gates,
/// or in meshgate's domain) that the node advertises.
pub fn uninstall_patches(
    gates: &[&NodeGateSpec],
    annotations: &BTreeMap<String, String>,
    taints: &[Taint],
    capacity: &[String],
) -> UninstallPlan {
    let mut keys: Vec<&str> = gates.iter().map(|g| g.taint.key.as_str()).collect();
    keys.push(meshgate_api::names::DEFAULT_TAINT_KEY);
    let removed: Vec<String> = taints
        .iter()
        .map(|t| t.key.as_str())
        .filter(|k| (keys.contains(k) || meshgate_api::in_domain(k)) && owns_key(k, annotations))
        .map(str::to_owned)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut plan = UninstallPlan::default();
    if !removed.is_empty() {
        let observed: Vec<Value> = taints
            .iter()
            .map(|t| serde_json::to_value(t).unwrap_or(Value::Null))
            .collect();
        let desired: Vec<Value> = taints
            .iter()
            .filter(|t| !removed.contains(&t.key))
            .map(|t| serde_json::to_value(t).unwrap_or(Value::Null))
            .collect();
        plan.taints = Some(JsonPatch(vec![
            json!({"op": "test", "path": "/spec/taints", "value": observed}),
            json!({"op": "replace", "path": "/spec/taints", "value": desired}),
        ]));
    }
    plan.removed = removed;
    let ours: serde_json::Map<String, Value> = annotations
        .keys()
        .filter(|k| {
            [OWNED_TAINTS, meshgate_api::names::NODE_READY_SINCE].contains(&k.as_str())
                || k.starts_with(meshgate_api::names::GATE_READY_SINCE_PREFIX)
        })
        .map(|k| (k.clone(), Value::Null))
        .collect();
    if !ours.is_empty() {
        plan.annotations = Some(json!({"metadata": {"annotations": ours}}));
    }
    let resources: serde_json::Map<String, Value> = capacity
        .iter()
        .filter(|r| {
            gates
                .iter()
                .any(|g| g.resource.as_ref().is_some_and(|res| &res.name == *r))
                || meshgate_api::in_domain(r)
                || r.as_str() == meshgate_api::names::DEFAULT_RESOURCE
        })
        .map(|r| (r.clone(), Value::Null))
        .collect();
    if !resources.is_empty() {
        plan.resources =
            Some(json!({"status": {"capacity": resources.clone(), "allocatable": resources}}));
    }
    plan
}

/// Taints every DaemonSet pod tolerates (added by the DaemonSet controller).
const DAEMONSET_TOLERATED: &[&str] = &[
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/disk-pressure",
    "node.kubernetes.io/memory-pressure",
    "node.kubernetes.io/pid-pressure",
    "node.kubernetes.io/unschedulable",
    "node.kubernetes.io/network-unavailable",
];

/// Whether a DaemonSet with this pod template would run a pod on the node. `ignore_taint` is the
/// gate's own taint key, which must not keep the agent off the node it gates; so is meshgate's
/// earlier default key, which a node tainted before an upgrade carries until the gate's own key
/// replaces it ([`superseded_taints`]).
fn daemonset_targets(
    template: &PodTemplateSpec,
    node_name: &str,
    labels: &BTreeMap<String, String>,
    taints: &[Taint],
    ignore_taint: &str,
) -> bool {
    let Some(spec) = template.spec.as_ref() else {
        return true;
    };
    if let Some(sel) = &spec.node_selector
        && !sel.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return false;
    }
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    if let Some(required) = required {
        // Terms are ORed, the requirements of a term ANDed.
        let any = required.node_selector_terms.iter().any(|term| {
            term.match_expressions
                .iter()
                .flatten()
                .all(|r| requirement_matches(r, |k| labels.get(k).map(String::as_str)))
                && term.match_fields.iter().flatten().all(|r| {
                    requirement_matches(r, |k| (k == "metadata.name").then_some(node_name))
                })
        });
        if !any {
            return false;
        }
    }
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .filter(|t| {
            t.key != ignore_taint
                && t.key != meshgate_api::names::DEFAULT_TAINT_KEY
                && !DAEMONSET_TOLERATED.contains(&t.key.as_str())
        })
        .all(|t| tolerations.iter().any(|tol| tolerates(tol, t)))
}

fn requirement_matches<'v>(
    r: &NodeSelectorRequirement,
    get: impl Fn(&str) -> Option<&'v str>,
) -> bool {
    let value = get(&r.key);
    let values = r.values.as_deref().unwrap_or_default();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(|v| v.parse::<i64>().ok()),
                values.first().and_then(|b| b.parse::<i64>().ok()),
            ) else {
                return false;
            };
            if r.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

/// Kubernetes' toleration semantics.
pub fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = tol.effect.as_deref()
        && !effect.is_empty()
        && effect != taint.effect
    {
        return false;
    }
    let key = tol.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match tol.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" => {
            key == taint.key
                && tol.value.as_deref().unwrap_or_default()
                    == taint.value.as_deref().unwrap_or_default()
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_api::LabelSelector;
    use meshgate_api::node_gate::{Agent, GateResource, GateTaint, TaintEffect};

    fn spec(mode: GateMode) -> NodeGateSpec {
        NodeGateSpec {
            taint: GateTaint::default(),
            agents: vec![Agent {
                name: "cni".into(),
                namespace: "kube-system".into(),
                selector: LabelSelector::labels([("app", "cni")]),
                daemon_set: None,
            }],
            node_selector: LabelSelector::default(),
            mode,
            grace_period_seconds: 10,
            removal_delay_seconds: 0,
            taint_on_create: true,
            resource: Some(GateResource {
                name: "meshgate.dev/mesh-ready".into(),
                count: 100,
                provider: Default::default(),
            }),
            ..NodeGateSpec::default()
        }
    }

    fn gate_taint() -> Taint {
        Taint {
            key: meshgate_api::names::DEFAULT_TAINT_KEY.into(),
            effect: "NoSchedule".into(),
            ..Taint::default()
        }
    }

    fn foreign() -> Taint {
        Taint {
            key: "example.com/dedicated".into(),
            value: Some("gpu".into()),
            effect: "NoSchedule".into(),
            ..Taint::default()
        }
    }

    struct Fixture {
        labels: BTreeMap<String, String>,
        annotations: BTreeMap<String, String>,
        taints: Vec<Taint>,
        agents: Vec<AgentState>,
        advertised: bool,
        now: i64,
    }

    impl Fixture {
        fn new(taints: Vec<Taint>, agents: Vec<AgentState>) -> Self {
            Self {
                labels: BTreeMap::new(),
                annotations: BTreeMap::new(),
                taints,
                agents,
                advertised: false,
                now: 1000,
            }
        }
        fn decide(&self, spec: &NodeGateSpec) -> NodeDecision {
            decide(
                spec,
                &NodeObservation {
                    gate: "g",
                    labels: &self.labels,
                    annotations: &self.annotations,
                    taints: &self.taints,
                    created: 900,
                    agents: &self.agents,
                    resource_advertised: self.advertised,
                    now: self.now,
                },
            )
        }
    }

    #[test]
    fn ready_agents_release_the_node() {
        let f = Fixture::new(
            vec![gate_taint(), foreign()],
            vec![AgentState::Ready { since: 990 }],
        );
        let d = f.decide(&spec(GateMode::Bootstrap));
        assert_eq!(d.state, NodeState::Ready);
        assert_eq!(d.taint, Some(false));
        assert_eq!(d.resource, Some(true));
        assert_eq!(d.mark_ready_since, Some(990));
        assert_eq!(d.ready_since, Some(990));
    }

    #[test]
    fn unready_agent_keeps_the_node_held() {
        for agents in [
            vec![AgentState::Missing],
            vec![AgentState::NotReady { since: 950 }],
        ] {
            let f = Fixture::new(vec![gate_taint()], agents);
            let d = f.decide(&spec(GateMode::Continuous));
            assert_eq!(d.state, NodeState::Waiting);
            assert_eq!(d.taint, None, "already tainted");
        }
        // A node registered without the taint (webhook down) gets it.
        let f = Fixture::new(vec![], vec![AgentState::Missing]);
        assert_eq!(f.decide(&spec(GateMode::Bootstrap)).taint, Some(true));
        // Unless the gate leaves the startup taint to others (or is resource-only).
        let mut resource_only = spec(GateMode::Bootstrap);
        resource_only.taint_on_create = false;
        assert_eq!(f.decide(&resource_only).taint, None);
        assert_eq!(f.decide(&resource_only).state, NodeState::Waiting);
    }

    #[test]
    fn removal_delay_is_honoured() {
        let mut s = spec(GateMode::Bootstrap);
        s.removal_delay_seconds = 30;
        let f = Fixture::new(vec![gate_taint()], vec![AgentState::Ready { since: 990 }]);
        let d = f.decide(&s);
        assert_eq!(d.state, NodeState::Releasing);
        assert_eq!(d.taint, None);
        assert_eq!(d.requeue_after, Some(20));
    }

    #[test]
    fn continuous_mode_retaints_after_grace() {
        let s = spec(GateMode::Continuous);
        let mut f = Fixture::new(vec![foreign()], vec![AgentState::NotReady { since: 995 }]);
        f.annotations
            .insert(meshgate_api::names::NODE_READY_SINCE.into(), "x".into());
        f.advertised = true;
        let d = f.decide(&s);
        assert_eq!(d.state, NodeState::Degraded);
        assert_eq!(d.taint, None);
        assert_eq!(d.requeue_after, Some(5));
        f.now = 1005;
        let d = f.decide(&s);
        assert_eq!(d.taint, Some(true));
        assert_eq!(d.resource, Some(false));
    }

    #[test]
    fn bootstrap_mode_never_retaints() {
        let s = spec(GateMode::Bootstrap);
        let mut f = Fixture::new(vec![], vec![AgentState::NotReady { since: 100 }]);
        f.annotations
            .insert(meshgate_api::names::NODE_READY_SINCE.into(), "x".into());
        f.advertised = true;
        let d = f.decide(&s);
        assert_eq!(d.state, NodeState::Released);
        assert_eq!(d.taint, None);
        assert_eq!(d.resource, None);
    }

    #[test]
    fn each_gate_has_its_own_bootstrap_mark() {
        // Another gate released the node (its mark and the node's): this gate's agent is not
        // ready and the node lacks its taint, so this gate taints it (one shared mark made
        // this gate skip its taint).
        let s = spec(GateMode::Bootstrap);
        let mut f = Fixture::new(vec![], vec![AgentState::NotReady { since: 950 }]);
        f.annotations
            .insert(meshgate_api::names::NODE_READY_SINCE.into(), "x".into());
        f.annotations.insert(ready_since_key("another"), "x".into());
        let d = f.decide(&s);
        assert_eq!(d.taint, Some(true));
        assert_eq!(d.state, NodeState::Waiting);
        // Its own mark: released once, never tainted again.
        f.annotations.insert(ready_since_key("g"), "x".into());
        assert_eq!(f.decide(&s).taint, None);
        assert_eq!(f.decide(&s).state, NodeState::Released);
    }

    #[test]
    fn a_node_marked_before_per_gate_marks_counts_as_released_by_every_gate() {
        // Upgrade: the node's mark alone (written by a meshgate without per-gate marks) still
        // means "released once", so an upgrade re-taints no node.
        let s = spec(GateMode::Bootstrap);
        let mut f = Fixture::new(vec![], vec![AgentState::NotReady { since: 950 }]);
        f.annotations
            .insert(meshgate_api::names::NODE_READY_SINCE.into(), "x".into());
        assert_eq!(f.decide(&s).taint, None);
        assert_eq!(f.decide(&s).state, NodeState::Released);
        // Ready agents on a legacy-marked node: no new mark is needed.
        let mut ready = Fixture::new(vec![], vec![AgentState::Ready { since: 950 }]);
        ready
            .annotations
            .insert(meshgate_api::names::NODE_READY_SINCE.into(), "x".into());
        assert_eq!(ready.decide(&s).mark_ready_since, None);
    }

    #[test]
    fn ready_since_keys_are_valid_annotation_names() {
        assert_eq!(
            ready_since_key("mesh"),
            "agents-ready-since.meshgate.dev/mesh"
        );
        let long = "a".repeat(63);
        assert_eq!(
            ready_since_key(&long),
            format!("agents-ready-since.meshgate.dev/{long}")
        );
        let longer = format!("{}.b-c", "a".repeat(80));
        let key = ready_since_key(&longer);
        let name = key.rsplit_once('/').map(|(_, n)| n).unwrap_or_default();
        assert_eq!(name.len(), 63, "{key}");
        assert!(name.ends_with(|c: char| c.is_ascii_hexdigit()));
        assert_ne!(key, ready_since_key(&format!("{}.b-d", "a".repeat(80))));
    }

    #[test]
    fn released_node_keeps_a_leftover_taint_while_an_agent_is_unready() {
        // Marked ready (by this gate before its untaint failed, or by another gate), still
        // tainted, agent not ready: the taint stays until the agent is Ready.
        let s = spec(GateMode::Bootstrap);
        let mut f = Fixture::new(
            vec![gate_taint()],
            vec![AgentState::NotReady { since: 950 }],
        );
        f.annotations
            .insert(meshgate_api::names::NODE_READY_SINCE.into(), "x".into());
        let d = f.decide(&s);
        assert_eq!(d.state, NodeState::Waiting);
        assert_eq!(d.taint, None);
        f.agents = vec![AgentState::Ready { since: 990 }];
        let d = f.decide(&s);
        assert_eq!(d.state, NodeState::Released);
        assert_eq!(d.taint, Some(false));
    }

    #[test]
    fn not_targeted_agents_do_not_hold_the_node() {
        let f = Fixture::new(vec![gate_taint()], vec![AgentState::NotTargeted]);
        assert_eq!(f.decide(&spec(GateMode::Bootstrap)).taint, Some(false));
    }

    #[test]
    fn unselected_nodes_lose_only_the_gate_taint() {
        let mut s = spec(GateMode::Bootstrap);
        s.node_selector = LabelSelector::labels([("pool", "mesh")]);
        let f = Fixture::new(vec![gate_taint(), foreign()], vec![AgentState::Missing]);
        let d = f.decide(&s);
        assert_eq!(d.state, NodeState::Ignored);
        assert_eq!(d.taint, None, "decided across gates");
        // Another gate with the same key selects the node: the taint is its, not an orphan.
        let mut other = s.clone();
        other.node_selector = LabelSelector::default();
        assert!(orphaned_taints([&s, &other], &f.labels, &f.annotations, &f.taints).is_empty());
        assert_eq!(
            orphaned_taints([&s], &f.labels, &f.annotations, &f.taints),
            [meshgate_api::names::DEFAULT_TAINT_KEY]
        );
        let p = taint_patch(&s, &f.taints, "1", false).unwrap();
        let node = json!({"spec": {"taints": f.taints}});
        let out = p.apply(&node).unwrap();
        assert_eq!(out["spec"]["taints"], json!([foreign()]));
    }

    #[test]
    fn a_key_meshgate_put_on_comes_off_once_no_gate_holds_it() {
        let mut new = spec(GateMode::Bootstrap);
        new.taint.key = meshgate_api::names::STARTUP_TAINT_KEY.into();
        let labels = BTreeMap::new();
        let none = BTreeMap::new();
        let legacy = gate_taint();
        let fresh = Taint {
            key: new.taint.key.clone(),
            ..gate_taint()
        };
        // Upgraded: the gate's key is on the node (agents not ready), the old one goes.
        assert_eq!(
            superseded_taints(
                [&new],
                &labels,
                &none,
                &[legacy.clone(), fresh.clone(), foreign()]
            ),
            [meshgate_api::names::DEFAULT_TAINT_KEY]
        );
        // A key outside meshgate's domain goes only where meshgate recorded adding it.
        let mut other = new.clone();
        other.taint.key = "startup-taint.cluster-autoscaler.kubernetes.io/mesh-agents".into();
        let recorded: BTreeMap<String, String> = [(
            OWNED_TAINTS.to_owned(),
            meshgate_api::names::STARTUP_TAINT_KEY.to_owned(),
        )]
        .into();
        assert_eq!(
            superseded_taints([&other], &labels, &recorded, std::slice::from_ref(&fresh)),
            [meshgate_api::names::STARTUP_TAINT_KEY]
        );
        assert!(
            superseded_taints([&other], &labels, &none, std::slice::from_ref(&fresh)).is_empty()
        );
        assert!(superseded_taints([&other], &labels, &none, &[foreign()]).is_empty());
        // A gate still keyed with it holds it: not superseded.
        let old = spec(GateMode::Bootstrap);
        assert!(
            superseded_taints([&new, &old], &labels, &none, std::slice::from_ref(&legacy))
                .is_empty()
        );
        // No gate selects the node, or one selecting it is in dry run: left alone.
        let mut elsewhere = new.clone();
        elsewhere.node_selector = LabelSelector::labels([("pool", "mesh")]);
        assert!(
            superseded_taints([&elsewhere], &labels, &none, std::slice::from_ref(&legacy))
                .is_empty()
        );
        let mut dry = new.clone();
        dry.dry_run = true;
        assert!(
            superseded_taints([&new, &dry], &labels, &none, std::slice::from_ref(&legacy))
                .is_empty()
        );
        // Nothing to lift.
        assert!(superseded_taints([&new], &labels, &none, &[fresh, foreign()]).is_empty());
    }

    #[test]
    fn taint_patch_tests_the_list_it_read() {
        let s = spec(GateMode::Continuous);
        let p = taint_patch(&s, &[foreign()], "7", true).unwrap();
        assert_eq!(p.0[0]["op"], "test");
        let node = json!({"spec": {"taints": [foreign()]}});
        let out = p.apply(&node).unwrap();
        assert_eq!(out["spec"]["taints"], json!([foreign(), gate_taint()]));
        // The list changed under us: the patch does not apply.
        let changed =
            json!({"spec": {"taints": [foreign(), {"key": "new", "effect": "NoSchedule"}]}});
        assert!(p.apply(&changed).is_err());
        // Nothing to do.
        assert!(taint_patch(&s, &[foreign(), gate_taint()], "7", true).is_none());
        // No taints yet: only on the node as read (its resourceVersion), the field absent or
        // an empty list.
        let p = taint_patch(&s, &[], "7", true).unwrap();
        for read in [json!({}), json!({"taints": []})] {
            let node = json!({"metadata": {"resourceVersion": "7"}, "spec": read});
            assert_eq!(
                p.apply(&node).unwrap()["spec"]["taints"],
                json!([gate_taint()])
            );
        }
        // Another controller's taint landed since (a newer resourceVersion): no write, and its
        // taint stays.
        let since = json!({"metadata": {"resourceVersion": "8"},
                           "spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]}});
        assert!(p.apply(&since).is_err());
        let mut s2 = s.clone();
        s2.taint = GateTaint {
            key: "custom/key".into(),
            effect: TaintEffect::NoExecute,
        };
        let p = taint_patch(&s2, &[], "7", true).unwrap();
        assert_eq!(
            p.0[1]["value"][0],
            json!({"key": "custom/key", "effect": "NoExecute"})
        );
    }

    #[test]
    fn a_release_is_one_write_with_its_marks_and_record() {
        let mut s = spec(GateMode::Bootstrap);
        s.taint.key = "readiness.k8s.io/mesh-agents".into();
        let ours = json!({"key": "readiness.k8s.io/mesh-agents", "effect": "NoSchedule"});
        let read = |owned: &str| -> Value {
            json!({"metadata": {"name": "n", "resourceVersion": "7",
                                "annotations": {OWNED_TAINTS: owned, "other": "kept"}},
                   "spec": {"taints": [foreign(), ours.clone()]}})
        };
        let node = |v: &Value| -> GateNode { serde_json::from_value(v.clone()).unwrap() };
        let doc = read("readiness.k8s.io/mesh-agents");
        let marks = ready_marks("g", &BTreeMap::new(), "2026-12-05T00:00:00Z");
        assert_eq!(marks.len(), 2, "the gate's mark and the node's: {marks:?}");
        let p = release_patch(&s, &node(&doc), &marks).unwrap();
        let out = p.apply(&doc).unwrap();
        assert_eq!(out["spec"]["taints"], json!([foreign()]));
        let a = &out["metadata"]["annotations"];
        assert_eq!(a[ready_since_key("g")], "2026-12-05T00:00:00Z");
        assert_eq!(
            a[meshgate_api::names::NODE_READY_SINCE],
            "2026-12-05T00:00:00Z"
        );
        assert_eq!(a["other"], "kept");
        assert!(
            a.get(OWNED_TAINTS).is_none(),
            "the record goes with the taint: {a}"
        );
        // Another key meshgate owns stays recorded.
        let doc = read("example.com/x,readiness.k8s.io/mesh-agents");
        let out = release_patch(&s, &node(&doc), &BTreeMap::new())
            .unwrap()
            .apply(&doc)
            .unwrap();
        assert_eq!(
            out["metadata"]["annotations"][OWNED_TAINTS],
            "example.com/x"
        );
        // Conditional on what was read: a taint list or a record that changed since fails it.
        let p = release_patch(&s, &node(&doc), &marks).unwrap();
        let mut moved = doc.clone();
        moved["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": "new", "effect": "NoSchedule"}));
        assert!(p.apply(&moved).is_err());
        let mut moved = doc.clone();
        moved["metadata"]["annotations"][OWNED_TAINTS] = json!("readiness.k8s.io/mesh-agents");
        assert!(p.apply(&moved).is_err());
        // No annotations map: the marks as a new map, only on the node as read (its
        // resourceVersion); one that appeared since is not replaced.
        let mut bare = doc.clone();
        bare["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("annotations");
        let p = release_patch(&s, &node(&bare), &marks).unwrap();
        let out = p.apply(&bare).unwrap();
        assert_eq!(out["spec"]["taints"], json!([foreign()]));
        assert_eq!(
            out["metadata"]["annotations"][ready_since_key("g")],
            "2026-12-05T00:00:00Z"
        );
        let mut appeared = bare.clone();
        appeared["metadata"]["annotations"] = json!({"other": "kept"});
        appeared["metadata"]["resourceVersion"] = json!("8");
        assert!(p.apply(&appeared).is_err());
        let mut unversioned = bare.clone();
        unversioned["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("resourceVersion");
        assert!(release_patch(&s, &node(&unversioned), &marks).is_none());
        // No taint to lift: nothing.
        let mut lifted = doc.clone();
        lifted["spec"]["taints"] = json!([foreign()]);
        assert!(release_patch(&s, &node(&lifted), &marks).is_none());
        // A node with the node-wide mark keeps its time: only the gate's own is written.
        let had = BTreeMap::from([(
            meshgate_api::names::NODE_READY_SINCE.to_owned(),
            "earlier".to_owned(),
        )]);
        assert_eq!(ready_marks("g", &had, "now").len(), 1);
    }

    #[test]
    fn daemonset_targeting() {
        let tpl: PodTemplateSpec = serde_json::from_value(json!({"spec": {
            "containers": [],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "NotIn", "values": ["gpu"]}]}]}}},
            "tolerations": [{"key": "example.com/dedicated", "operator": "Exists"}],
        }})).unwrap();
        let l = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>()
        };
        let key = meshgate_api::names::DEFAULT_TAINT_KEY;
        assert!(daemonset_targets(
            &tpl,
            "n",
            &l(&[("kubernetes.io/os", "linux")]),
            &[gate_taint(), foreign()],
            key
        ));
        assert!(!daemonset_targets(
            &tpl,
            "n",
            &l(&[("kubernetes.io/os", "windows")]),
            &[],
            key
        ));
        assert!(!daemonset_targets(
            &tpl,
            "n",
            &l(&[("kubernetes.io/os", "linux"), ("pool", "gpu")]),
            &[],
            key
        ));
        let other = Taint {
            key: "example.com/other".into(),
            effect: "NoExecute".into(),
            ..Taint::default()
        };
        assert!(!daemonset_targets(
            &tpl,
            "n",
            &l(&[("kubernetes.io/os", "linux")]),
            &[other],
            key
        ));
        let prefer = Taint {
            key: "x".into(),
            effect: "PreferNoSchedule".into(),
            ..Taint::default()
        };
        assert!(daemonset_targets(
            &tpl,
            "n",
            &l(&[("kubernetes.io/os", "linux")]),
            &[prefer],
            key
        ));
    }

    #[test]
    fn resource_patch_advertises_and_withdraws() {
        let p = resource_patch("meshgate.dev/mesh-ready", 100, true);
        assert_eq!(p["status"]["capacity"]["meshgate.dev/mesh-ready"], "100");
        assert_eq!(p["status"]["allocatable"]["meshgate.dev/mesh-ready"], "100");
        let p = resource_patch("meshgate.dev/mesh-ready", 100, false);
        assert!(p["status"]["capacity"]["meshgate.dev/mesh-ready"].is_null());
    }
}

/// The admission mutation of a Node CREATE: the startup taint of every gate that selects the
/// node and asks for `taintOnCreate`, unless the node carries it already.
pub fn taints_on_create<'s>(
    gates: impl IntoIterator<Item = &'s NodeGateSpec>,
    node: &Value,
) -> JsonPatch {
    let labels = crate::object::Meta::of(node).labels;
    let existing: Vec<&str> = node
        .pointer("/spec/taints")
        .and_then(Value::as_array)
        .map(|ts| ts.iter().filter_map(|t| t.get("key")?.as_str()).collect())
        .unwrap_or_default();
    let mut new: Vec<Value> = Vec::new();
    for gate in gates {
        let key = gate.taint.key.as_str();
        if gate.taint_on_create
            && !gate.dry_run
            && gate.problems().is_empty()
            && selects(gate, &labels)
            && !existing.contains(&key)
            && !new.iter().any(|t| t["key"] == key)
        {
            new.push(json!({"key": key, "effect": gate.taint.effect.as_str()}));
        }
    }
    let mut patch = JsonPatch::default();
    if new.is_empty() {
        return patch;
    }
    if node
        .pointer("/spec/taints")
        .and_then(Value::as_array)
        .is_some()
    {
        for t in new {
            patch.add("/spec/taints/-", t);
        }
    } else if node.get("spec").is_some_and(Value::is_object) {
        patch.add("/spec/taints", Value::Array(new));
    } else {
        patch.add("/spec", json!({"taints": new}));
    }
    // Keys outside meshgate's domain are recorded as meshgate's (see the module docs).
    let meta = crate::object::Meta::of(node);
    let added = new_keys(&patch);
    let mut owned: Vec<&str> = recorded_owned(&meta.annotations);
    let before = owned.len();
    for t in &added {
        if !meshgate_api::in_domain(t) && !owned.contains(&t.as_str()) {
            owned.push(t);
        }
    }
    if owned.len() != before {
        let value = owned.join(",");
        if node
            .pointer("/metadata/annotations")
            .is_some_and(Value::is_object)
        {
            patch.add(
                format!(
                    "/metadata/annotations/{}",
                    crate::object::patch::escape(OWNED_TAINTS)
                ),
                json!(value),
            );
        } else if node.get("metadata").is_some_and(Value::is_object) {
            patch.add("/metadata/annotations", json!({OWNED_TAINTS: value}));
        }
    }
    patch
}

/// The taint keys a patch of [`taints_on_create`] adds.
fn new_keys(patch: &JsonPatch) -> Vec<String> {
    let mut out = Vec::new();
    for op in &patch.0 {
        let v = &op["value"];
        let taints: Vec<&Value> = match v {
            Value::Array(a) => a.iter().collect(),
            Value::Object(o) if o.contains_key("taints") => v["taints"]
                .as_array()
                .map(|a| a.iter().collect())
                .unwrap_or_default(),
            Value::Object(_) => vec![v],
            _ => Vec::new(),
        };
        out.extend(
            taints
                .iter()
                .filter_map(|t| t["key"].as_str().map(str::to_owned)),
        );
    }
    out
}

#[cfg(test)]
mod create_tests {
    use super::*;
    use meshgate_api::LabelSelector;
    use meshgate_api::node_gate::{Agent, GateTaint};

    fn gate(key: &str, selector: LabelSelector) -> NodeGateSpec {
        NodeGateSpec {
            taint: GateTaint {
                key: key.into(),
                ..GateTaint::default()
            },
            agents: vec![Agent {
                name: "cni".into(),
                namespace: "kube-system".into(),
                selector: LabelSelector::default(),
                daemon_set: None,
            }],
            node_selector: selector,
            mode: GateMode::Bootstrap,
            grace_period_seconds: 0,
            removal_delay_seconds: 0,
            taint_on_create: true,
            resource: None,
            ..NodeGateSpec::default()
        }
    }

    #[test]
    fn node_create_gets_each_selecting_gates_taint_once() {
        let a = gate("a/not-ready", LabelSelector::default());
        let b = gate("b/not-ready", LabelSelector::labels([("pool", "mesh")]));
        let node = json!({"metadata": {"name": "n", "labels": {"pool": "other"}}, "spec": {}});
        let out = taints_on_create([&a, &b], &node).apply(&node).unwrap();
        assert_eq!(
            out["spec"]["taints"],
            json!([{"key": "a/not-ready", "effect": "NoSchedule"}])
        );
        assert!(taints_on_create([&a, &b], &out).is_empty(), "idempotent");
        let node = json!({"metadata": {"labels": {"pool": "mesh"}},
                          "spec": {"taints": [{"key": "x", "effect": "NoExecute"}]}});
        let out = taints_on_create([&a, &b], &node).apply(&node).unwrap();
        assert_eq!(out["spec"]["taints"].as_array().unwrap().len(), 3);
        assert_eq!(out["spec"]["taints"][0]["key"], "x");
        let bare = json!({"metadata": {"name": "n"}});
        let out = taints_on_create([&a], &bare).apply(&bare).unwrap();
        assert_eq!(out["spec"]["taints"][0]["key"], "a/not-ready");
    }
}

#[cfg(test)]
mod uninstall_tests {
    use super::*;
    use meshgate_api::node_gate::GateTaint;

    fn taint(key: &str) -> Taint {
        Taint {
            key: key.into(),
            effect: "NoSchedule".into(),
            ..Taint::default()
        }
    }

    #[test]
    fn uninstall_takes_only_what_meshgate_owns() {
        let foreign = NodeGateSpec {
            taint: GateTaint {
                key: "example.com/cni-not-ready".into(),
                ..GateTaint::default()
            },
            ..NodeGateSpec::default()
        };
        let gates = [&foreign];
        let taints = [
            taint(meshgate_api::names::DEFAULT_TAINT_KEY),
            taint("example.com/cni-not-ready"),
            taint("node.kubernetes.io/not-ready"),
        ];
        // The foreign gate key was put on by someone else (not recorded): it stays.
        let none = BTreeMap::new();
        let plan = uninstall_patches(&gates, &none, &taints, &["pods".into()]);
        assert_eq!(plan.removed, [meshgate_api::names::DEFAULT_TAINT_KEY]);
        assert_eq!(plan.annotations, None);
        assert_eq!(plan.resources, None);
        let desired = &plan.taints.expect("patch").0[1]["value"];
        assert_eq!(
            desired,
            &json!([
                {"key": "example.com/cni-not-ready", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
            ])
        );
        // Recorded as meshgate's: it goes, and so do the bookkeeping and the resource.
        let recorded = BTreeMap::from([
            (
                OWNED_TAINTS.to_owned(),
                "example.com/cni-not-ready".to_owned(),
            ),
            (
                meshgate_api::names::NODE_READY_SINCE.to_owned(),
                "t".to_owned(),
            ),
        ]);
        let plan = uninstall_patches(
            &gates,
            &recorded,
            &taints,
            &["pods".into(), meshgate_api::names::DEFAULT_RESOURCE.into()],
        );
        assert_eq!(
            plan.removed,
            [
                "example.com/cni-not-ready",
                meshgate_api::names::DEFAULT_TAINT_KEY
            ]
        );
        assert!(plan.annotations.is_some());
        assert_eq!(
            plan.resources,
            Some(json!({"status": {
                "capacity": {meshgate_api::names::DEFAULT_RESOURCE: null},
                "allocatable": {meshgate_api::names::DEFAULT_RESOURCE: null}}}))
        );
        // Nothing of meshgate's: nothing to do.
        let plan = uninstall_patches(&gates, &none, &[taint("x/y")], &[]);
        assert_eq!(plan, UninstallPlan::default());
    }
}

#[cfg(test)]
mod terminating_agent_tests {
    use super::AgentPod;
    use serde_json::json;

    /// An agent pod being deleted (a DaemonSet rollout) counts as not ready from when its
    /// deletion began, not from when it became Ready: the gate's grace period covers the
    /// rollout instead of re-tainting the node at once.
    #[test]
    fn a_terminating_agent_is_not_ready_since_its_deletion_began() {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": "cni-1", "namespace": "istio-system",
                         "creationTimestamp": "2026-01-01T00:00:00Z",
                         "deletionTimestamp": "2026-06-01T00:00:30Z",
                         "deletionGracePeriodSeconds": 30},
            "spec": {"nodeName": "n1", "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": "True",
                                       "lastTransitionTime": "2026-01-01T00:01:00Z"}]},
        }))
        .expect("pod");
        let (_, agent) = AgentPod::of(&pod).expect("bound");
        assert!(!agent.ready);
        let deletion_began = "2026-06-01T00:00:00Z"
            .parse::<k8s_openapi::jiff::Timestamp>()
            .expect("time")
            .as_second();
        assert_eq!(agent.since, deletion_began);
        // Not being deleted: since its Ready condition changed.
        let mut live = pod.clone();
        live.metadata.deletion_timestamp = None;
        let (_, agent) = AgentPod::of(&live).expect("bound");
        assert!(agent.ready);
        assert_eq!(
            agent.since,
            "2026-01-01T00:01:00Z"
                .parse::<k8s_openapi::jiff::Timestamp>()
                .expect("time")
                .as_second()
        );
    }
}

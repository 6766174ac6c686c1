//! The node gate controller.
//!
//! Reconciles Nodes. For each NodeGate it reads the node's agent states from the
//! [`AgentIndex`], asks [`meshgate_core::nodegate::decide`] what the taint and resource should be,
//! and writes the difference:
//! * the taint by a JSON patch that `test`s the taint list it read (a concurrent change to any
//!   taint fails the write, and the node is reconciled again from a fresh read);
//! * the resource by a merge patch of the `status` subresource;
//! * the first-ready time as a node annotation.
//!
//! Every write is preceded by a leadership check; a replica that is not the leader keeps its
//! caches warm and writes nothing. Each NodeGate's status (counts, conditions) is refreshed
//! every few seconds by the leader.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Resource, ResourceExt};
use meshgate_api::node_gate::NodeGateStatus;
use meshgate_api::{NodeGate, names};
use meshgate_core::nodegate::{
    NodeDecision, NodeObservation, NodeState, decide, orphaned_taints, resource_patch, taint_patch,
};
use tokio::sync::{mpsc, watch};

use crate::agents::{AgentIndex, RESYNC_ALL};
use crate::metrics::{GateStateLabels, Metrics, OperationLabels};

/// Errors of one reconcile; the node is retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("writing node {node}: {source}")]
    Write {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("building a patch: {0}")]
    Patch(String),
}

/// Controller settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How often gate statuses are refreshed.
    pub status_interval: Duration,
    /// Reconcile every node at least this often.
    pub resync: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            status_interval: Duration::from_secs(5),
            resync: Duration::from_secs(300),
        }
    }
}

struct Ctx {
    client: kube::Client,
    gates: Store<NodeGate>,
    agents: AgentIndex,
    leader: watch::Receiver<bool>,
    recorder: Recorder,
    metrics: Metrics,
    settings: Settings,
}

/// Runs the node gate controller until `shutdown` resolves.
pub async fn run(
    client: kube::Client,
    leader: watch::Receiver<bool>,
    metrics: Metrics,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let (gates, gate_writer) = reflector::store::<NodeGate>();
    let (trigger_tx, trigger_rx) = mpsc::unbounded_channel::<ObjectRef<Node>>();
    let agents = AgentIndex::default();

    // Gates: keep the store, watch the namespaces their agents live in, resync all nodes.
    let gate_stream = {
        let agents = agents.clone();
        let client = client.clone();
        let trigger = trigger_tx.clone();
        let gate_store = gates.clone();
        let mut seen: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
        reflector::reflector(
            gate_writer,
            watcher(
                Api::<NodeGate>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .touched_objects()
        .for_each(move |g| {
            if let Ok(gate) = g {
                for a in &gate.spec.agents {
                    agents.ensure_watch(&client, &a.namespace, &trigger);
                }
                // Every node is reconciled again when a gate's spec changes (a new generation)
                // or the gate is gone (the reflector has removed it from the store); the gate's
                // own status writes change neither and trigger nothing.
                let uid = gate.metadata.uid.clone().unwrap_or_default();
                let generation = gate.metadata.generation.unwrap_or_default();
                let deleted = gate_store.get(&ObjectRef::from_obj(&gate)).is_none();
                let changed = seen.get(&uid) != Some(&generation);
                if deleted {
                    seen.remove(&uid);
                } else {
                    seen.insert(uid, generation);
                }
                if deleted || changed {
                    let _ = trigger.send(ObjectRef::new(RESYNC_ALL));
                }
            }
            futures::future::ready(())
        })
    };

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "meshgate-controller".into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    // Nodes are cached slimmed to what the gate reads (see `slim_node`).
    let (nodes, node_writer) = reflector::store::<Node>();
    let node_stream = reflector::reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .modify(slim_node),
    )
    .applied_objects();
    let controller = Controller::for_stream(node_stream, nodes.clone());

    // Leadership gained: every node is reconciled again.
    let mut leader_rx = leader.clone();
    let resync_trigger = trigger_tx.clone();
    let metrics_leader = metrics.clone();
    let leadership = async move {
        loop {
            let is_leader = *leader_rx.borrow_and_update();
            metrics_leader.leader.set(i64::from(is_leader));
            if is_leader {
                let _ = resync_trigger.send(ObjectRef::new(RESYNC_ALL));
            }
            if leader_rx.changed().await.is_err() {
                break;
            }
        }
    };

    let fan_out_nodes = nodes.clone();
    let triggers =
        tokio_stream::wrappers::UnboundedReceiverStream::new(trigger_rx).flat_map(move |r| {
            let refs: Vec<ObjectRef<Node>> = if r.name == RESYNC_ALL {
                fan_out_nodes
                    .state()
                    .iter()
                    .map(|n| ObjectRef::from_obj(n.as_ref()))
                    .collect()
            } else {
                vec![r]
            };
            futures::stream::iter(refs)
        });

    let ctx = Arc::new(Ctx {
        client: client.clone(),
        gates: gates.clone(),
        agents: agents.clone(),
        leader,
        recorder,
        metrics: metrics.clone(),
        settings: settings.clone(),
    });
    let status_loop = status_loop(ctx.clone(), nodes.clone());
    let main = controller
        .reconcile_on(triggers)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| {
            if let Err(e) = r {
                tracing::debug!(error = %e, "reconcile failed");
            }
            futures::future::ready(())
        });
    tokio::select! {
        _ = main => {},
        _ = gate_stream => {},
        _ = leadership => {},
        _ = status_loop => {},
    }
    agents.stop();
}

/// Drops from a Node what the gate never reads, before it is cached: `managedFields`, the
/// status other than `capacity` (images, conditions, addresses, node info, volumes) and
/// annotations outside meshgate's domain. A real node carries tens of KiB of these; the
/// controller caches every node.
pub fn slim_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    if let Some(annotations) = node.metadata.annotations.as_mut() {
        annotations.retain(|k, _| {
            k.split_once('/').is_some_and(|(domain, _)| {
                domain == meshgate_api::DOMAIN
                    || domain
                        .strip_suffix(meshgate_api::DOMAIN)
                        .is_some_and(|sub| sub.ends_with('.'))
            })
        });
    }
    node.status = node.status.take().map(|s| NodeStatus {
        capacity: s.capacity,
        ..NodeStatus::default()
    });
}

fn error_policy(_node: Arc<Node>, err: &Error, ctx: Arc<Ctx>) -> Action {
    tracing::warn!(error = %err, "node reconcile failed; retrying");
    let _ = &ctx;
    Action::requeue(Duration::from_millis(500))
}

async fn reconcile(node: Arc<Node>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if !*ctx.leader.borrow() {
        return Ok(Action::await_change());
    }
    ctx.metrics.reconciles.inc();
    let mut node = (*node).clone();
    let name = node.name_any();
    let api = Api::<Node>::all(ctx.client.clone());
    let mut requeue = ctx.settings.resync;
    let gates = ctx.gates.state();
    for gate in &gates {
        let gate_name = gate.name_any();
        let (taints, decision) = decide_for(&ctx.agents, gate, &node, crate::now());
        tracing::debug!(node = %name, gate = %gate_name, state = decision.state.as_str(), ?decision, "decided");
        node = apply(&ctx, &api, gate, node, &taints, &decision).await?;
        if let Some(after) = decision.requeue_after {
            requeue = requeue.min(Duration::from_secs(
                u64::try_from(after.max(1)).unwrap_or(1),
            ));
        }
    }
    // Taints of gates that no longer apply to this node.
    let empty = BTreeMap::new();
    let taints = taints_of(&node);
    let orphans = orphaned_taints(
        gates.iter().map(|g| &g.spec),
        node.metadata.labels.as_ref().unwrap_or(&empty),
        &taints,
    );
    for key in orphans {
        if let Some(gate) = gates.iter().find(|g| g.spec.taint.key == key)
            && let Some(patch) = taint_patch(&gate.spec, &taints, false)
        {
            let patch: json_patch::Patch =
                serde_json::from_value(serde_json::Value::Array(patch.0))
                    .map_err(|e| Error::Patch(e.to_string()))?;
            api.patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
                .map_err(|source| Error::Write {
                    node: name.clone(),
                    source,
                })?;
            ctx.metrics
                .operations
                .get_or_create(&OperationLabels {
                    operation: "untaint",
                })
                .inc();
            tracing::info!(node = %name, taint = %key, "removed the taint of a gate that no longer selects the node");
            // One write per reconcile: the next one starts from a fresh read.
            return Ok(Action::requeue(Duration::from_millis(10)));
        }
    }
    Ok(Action::requeue(requeue))
}

/// A copy of the node's taints (none when it has no spec).
fn taints_of(node: &Node) -> Vec<k8s_openapi::api::core::v1::Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

/// The node's taints and the gate's decision for the node as it is now: the one place that
/// turns observed objects into a `NodeObservation` (reconcile and status share it).
fn decide_for(
    agents: &AgentIndex,
    gate: &NodeGate,
    node: &Node,
    now: i64,
) -> (Vec<k8s_openapi::api::core::v1::Taint>, NodeDecision) {
    let spec = &gate.spec;
    let states: Vec<_> = spec
        .agents
        .iter()
        .map(|a| agents.state(a, node, &spec.taint.key))
        .collect();
    let empty = BTreeMap::new();
    let taints = taints_of(node);
    let resource_advertised = spec.resource.as_ref().is_some_and(|r| {
        node.status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .is_some_and(|c| c.contains_key(&r.name))
    });
    let decision = decide(
        spec,
        &NodeObservation {
            labels: node.metadata.labels.as_ref().unwrap_or(&empty),
            annotations: node.metadata.annotations.as_ref().unwrap_or(&empty),
            taints: &taints,
            created: node
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(now, |t| t.0.as_second()),
            agents: &states,
            resource_advertised,
            now,
        },
    );
    (taints, decision)
}

async fn apply(
    ctx: &Ctx,
    api: &Api<Node>,
    gate: &NodeGate,
    mut node: Node,
    taints: &[k8s_openapi::api::core::v1::Taint],
    d: &NodeDecision,
) -> Result<Node, Error> {
    let name = node.name_any();
    let spec = &gate.spec;
    let pp = PatchParams::default();
    let write_err = |source| Error::Write {
        node: name.clone(),
        source,
    };
    let count = |op: &'static str| {
        ctx.metrics
            .operations
            .get_or_create(&OperationLabels { operation: op })
            .inc()
    };
    let count_err = |op: &'static str| {
        ctx.metrics
            .errors
            .get_or_create(&OperationLabels { operation: op })
            .inc()
    };

    if let Some(since) = d.mark_ready_since {
        let ts = k8s_openapi::jiff::Timestamp::from_second(since)
            .unwrap_or_default()
            .to_string();
        let patch = serde_json::json!({"metadata": {"annotations": {names::NODE_READY_SINCE: ts}}});
        node = api
            .patch(&name, &pp, &Patch::Merge(&patch))
            .await
            .map_err(|e| {
                count_err("mark-ready");
                write_err(e)
            })?;
        count("mark-ready");
    }
    if let Some(want) = d.taint
        && let Some(patch) = taint_patch(spec, taints, want)
    {
        let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(patch.0))
            .map_err(|e| Error::Patch(e.to_string()))?;
        let op = if want { "taint" } else { "untaint" };
        node = api
            .patch(&name, &pp, &Patch::<()>::Json(patch))
            .await
            .map_err(|e| {
                count_err(op);
                write_err(e)
            })?;
        count(op);
        if !want && let Some(since) = d.ready_since {
            let waited = (crate::now_precise() - since as f64).max(0.0);
            ctx.metrics.ready_to_untaint.observe(waited);
        }
        let (reason, note) = if want {
            (
                "TaintAdded",
                format!(
                    "node gate {}: agents not ready; added taint {}",
                    gate.name_any(),
                    spec.taint.key
                ),
            )
        } else {
            (
                "TaintRemoved",
                format!(
                    "node gate {}: agents ready; removed taint {}",
                    gate.name_any(),
                    spec.taint.key
                ),
            )
        };
        event(ctx, &node, reason, note).await;
    }
    if let (Some(want), Some(res)) = (d.resource, &spec.resource) {
        let patch = resource_patch(&res.name, res.count, want);
        let op = if want { "advertise" } else { "withdraw" };
        node = api
            .patch_status(&name, &pp, &Patch::Merge(&patch))
            .await
            .map_err(|e| {
                count_err(op);
                write_err(e)
            })?;
        count(op);
        let (reason, note) = if want {
            (
                "ResourceAdvertised",
                format!(
                    "node gate {}: advertising {}={}",
                    gate.name_any(),
                    res.name,
                    res.count
                ),
            )
        } else {
            (
                "ResourceWithdrawn",
                format!("node gate {}: withdrew {}", gate.name_any(), res.name),
            )
        };
        event(ctx, &node, reason, note).await;
    }
    Ok(node)
}

async fn event(ctx: &Ctx, node: &Node, reason: &str, note: String) {
    let ev = KubeEvent {
        type_: EventType::Normal,
        reason: reason.into(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &node.object_ref(&())).await {
        tracing::debug!(error = %e, "event not recorded");
    }
}

/// Refreshes each gate's status and the per-state node gauges.
async fn status_loop(ctx: Arc<Ctx>, nodes: Store<Node>) {
    let mut tick = tokio::time::interval(ctx.settings.status_interval);
    let mut seen_states: HashSet<GateStateLabels> = HashSet::new();
    loop {
        tick.tick().await;
        if !*ctx.leader.borrow() {
            continue;
        }
        let all_nodes = nodes.state();
        for gate in ctx.gates.state() {
            let gate_name = gate.name_any();
            let mut status = NodeGateStatus {
                observed_generation: gate.metadata.generation.unwrap_or_default(),
                ..NodeGateStatus::default()
            };
            let mut by_state: BTreeMap<NodeState, i64> = BTreeMap::new();
            let now = crate::now();
            for node in &all_nodes {
                let empty = BTreeMap::new();
                let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
                if !gate.spec.node_selector.matches(labels) {
                    continue;
                }
                status.nodes += 1;
                let (taints, d) = decide_for(&ctx.agents, &gate, node, now);
                if meshgate_core::nodegate::has_taint(&gate.spec, &taints) {
                    status.held_nodes += 1;
                }
                if matches!(
                    d.state,
                    NodeState::Ready | NodeState::Released | NodeState::Releasing
                ) {
                    status.ready_nodes += 1;
                }
                *by_state.entry(d.state).or_default() += 1;
            }
            for labels in &seen_states {
                if labels.gate == gate_name {
                    ctx.metrics.nodes.get_or_create(labels).set(0);
                }
            }
            for (state, n) in by_state {
                let labels = GateStateLabels {
                    gate: gate_name.clone(),
                    state: state.as_str(),
                };
                ctx.metrics.nodes.get_or_create(&labels).set(n);
                seen_states.insert(labels);
            }
            let message = format!(
                "{} of {} nodes ready, {} held by taint {}",
                status.ready_nodes, status.nodes, status.held_nodes, gate.spec.taint.key
            );
            let old = gate.status.clone().unwrap_or_default();
            let previous = old.conditions.iter().find(|c| c.type_ == "Ready");
            let condition_status = if status.ready_nodes == status.nodes {
                "True"
            } else {
                "False"
            };
            let transition = previous
                .filter(|c| c.status == condition_status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
            status.conditions = vec![Condition {
                type_: "Ready".into(),
                status: condition_status.into(),
                reason: if condition_status == "True" {
                    "AllNodesReady".into()
                } else {
                    "NodesWaiting".into()
                },
                message,
                observed_generation: gate.metadata.generation,
                last_transition_time: transition,
            }];
            let unchanged = old.nodes == status.nodes
                && old.ready_nodes == status.ready_nodes
                && old.held_nodes == status.held_nodes
                && old.observed_generation == status.observed_generation
                && old.conditions.first().map(|c| (&c.status, &c.message))
                    == status.conditions.first().map(|c| (&c.status, &c.message));
            if unchanged {
                continue;
            }
            let patch = serde_json::json!({"status": status});
            if let Err(e) = Api::<NodeGate>::all(ctx.client.clone())
                .patch_status(&gate_name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                tracing::warn!(gate = %gate_name, error = %e, "status not written");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slim_node_keeps_what_the_gate_reads() {
        let mut node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "n1",
                "labels": {"pool": "mesh"},
                "annotations": {
                    names::NODE_READY_SINCE: "2026-01-01T00:00:00Z",
                    "x.meshgate.dev/note": "kept",
                    "notmeshgate.dev/x": "dropped",
                    "node.alpha.kubernetes.io/ttl": "0",
                },
                "managedFields": [{"manager": "kubelet", "operation": "Update",
                                   "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}],
            },
            "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {
                "capacity": {"cpu": "2", "mesh.example/ready": "1"},
                "images": [{"names": ["registry.example/app:1"], "sizeBytes": 1}],
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }))
        .expect("node");
        let before = node.clone();
        slim_node(&mut node);
        assert_eq!(node.metadata.name, before.metadata.name);
        assert_eq!(node.metadata.labels, before.metadata.labels);
        assert_eq!(node.spec, before.spec, "taints kept");
        assert!(node.metadata.managed_fields.is_none());
        let kept: Vec<&str> = node
            .metadata
            .annotations
            .iter()
            .flatten()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(kept, [names::NODE_READY_SINCE, "x.meshgate.dev/note"]);
        let status = node.status.expect("status");
        assert_eq!(
            status.capacity,
            before.status.and_then(|s| s.capacity),
            "capacity kept"
        );
        assert!(status.images.is_none() && status.conditions.is_none());
    }
}

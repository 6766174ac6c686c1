//! The node gate controller.
//!
//! Reconciles Nodes. For each NodeGate it reads the node's agent states from the
//! [`AgentIndex`], asks [`meshgate_core::nodegate::decide_node`] what the taint and resource
//! should be, and writes the difference:
//! * the taint by a JSON patch that `test`s the taint list it read (a concurrent change to any
//!   taint fails the write, and the node is reconciled again from a fresh read); the ownership
//!   annotation for keys outside meshgate's domain is written before a taint is added and after
//!   it is removed;
//! * the resource by a merge patch of the `status` subresource, and the gate's node condition
//!   (`meshgate.dev/<gate>Ready`) by a strategic merge patch of it, written after the
//!   reconcile by a writer of its own (the newest decision per node, a few at a time), as are
//!   the Events: a release is one write on the reconcile's path;
//! * the first-ready time as a node annotation.
//!
//! Safety:
//! * **No decision before sync.** Nothing is decided until Nodes, NodeGates and the agents' pods
//!   and DaemonSets (every namespace a gate names) have all been listed; the metric
//!   `meshgate_controller_synced` says when. A leader change or a restart starts from there.
//! * Every write is preceded by a leadership check; a replica that is not the leader keeps its
//!   caches warm and writes nothing.
//! * Re-taints are limited by the gate's `maxRetainted` budget; `dryRun` gates write nothing to
//!   nodes; gates with a reserved taint key or an unconfirmed `NoExecute` are left alone.
//! * A gate carries a finalizer: when it is deleted its taint (where meshgate owns it and no
//!   other gate holds the key) and its resource are removed from every node, then it goes.
//!
//! Each NodeGate's status (counts, conditions) is refreshed every few seconds by the leader.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::events::{EventType, Events};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Resource, ResourceExt};
use meshgate_api::node_gate::{NodeGateStatus, ResourceProvider};
use meshgate_api::{GateNode, NodeGate};
use meshgate_core::nodegate::{
    AgentState, NodeDecision, NodeState, Offer, decide_node, has_taint, is_retainted, may_remove,
    node_condition, orphaned_taints, owned_annotation_patch, resource_patch, selects,
    superseded_taints, taint_patch, taints_of,
};
use tokio::sync::mpsc;

use crate::leader::Leader;

use crate::agents::{AgentIndex, RESYNC_ALL};
use crate::metrics::{GateStateLabels, Metrics, OperationLabels};

/// The finalizer meshgate puts on every NodeGate.
pub const FINALIZER: &str = "meshgate.dev/node-gate";

/// Events written at a time ([`event`]).
const EVENT_WRITES: usize = 2;

/// Node conditions written at a time ([`condition_writer`]).
const CONDITION_WRITES: usize = 2;

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
    /// How often gate statuses are refreshed (and deleted gates finalized).
    pub status_interval: Duration,
    /// Reconcile every node at least this often.
    pub resync: Duration,
    /// Nodes reconciled at once. Each reconcile in flight holds an API request, and an HTTP/1.1
    /// client holds one connection (TLS and read buffers, tens of KiB) per request in flight:
    /// unbounded, a burst of agents becoming ready on thousands of nodes opened a connection per
    /// node (measured: ~2,000 connections, most of the controller's peak memory, at 2,000
    /// nodes; `tools/bench/controller-heap.sh`). A handful of connections already keeps the
    /// API server busy: a node's writes take milliseconds.
    pub concurrency: u16,
    /// The pods of meshgate's node plugin (`meshgate node`): a DRA gate offers its resource on
    /// a node only while the plugin's pod there is Ready (registered with the kubelet), since
    /// the kubelet cannot start a pod whose claim's driver has no plugin.
    pub node_plugin: meshgate_api::node_gate::Agent,
    /// How often whether the API server serves DRA (`resource.k8s.io/v1`) and its version are
    /// asked again (one discovery request and one `/version` each time).
    pub dra_discovery: Duration,
}

/// The node plugin's pods in `namespace`, as `meshgate install` runs them.
pub fn node_plugin_agent(namespace: &str) -> meshgate_api::node_gate::Agent {
    meshgate_api::node_gate::Agent {
        name: "node-plugin".into(),
        namespace: namespace.into(),
        selector: meshgate_api::LabelSelector {
            match_labels: [
                ("app.kubernetes.io/name".to_owned(), "meshgate".to_owned()),
                ("app.kubernetes.io/component".to_owned(), "node".to_owned()),
            ]
            .into(),
            ..Default::default()
        },
        daemon_set: Some(NODE_PLUGIN_DAEMONSET.into()),
    }
}

/// The node plugin's DaemonSet.
pub const NODE_PLUGIN_DAEMONSET: &str = "meshgate-node";

/// [`Settings::dra_discovery`] by default.
pub const DRA_DISCOVERY: Duration = Duration::from_secs(60);

/// [`Settings::concurrency`] by default.
pub const DEFAULT_CONCURRENCY: u16 = 16;

impl Default for Settings {
    fn default() -> Self {
        Self {
            status_interval: Duration::from_secs(5),
            resync: Duration::from_secs(300),
            concurrency: DEFAULT_CONCURRENCY,
            node_plugin: node_plugin_agent("meshgate-system"),
            dra_discovery: DRA_DISCOVERY,
        }
    }
}

struct Ctx {
    client: kube::Client,
    gates: Store<NodeGate>,
    nodes: Store<GateNode>,
    agents: AgentIndex,
    leader: Leader,
    events: Events,
    /// Events in flight ([`event`]).
    event_slots: Arc<tokio::sync::Semaphore>,
    /// Node conditions waiting to be written ([`condition_writer`]).
    conditions: PendingConditions,
    metrics: Metrics,
    settings: Settings,
    /// Set once every cache has its first list.
    synced: AtomicBool,
    /// Nodes reconciled since the last sync or leadership gain, until all were.
    initial: Mutex<Option<HashSet<String>>>,
    /// DRA gates: their slices and classes.
    dra: crate::dra::Dra,
    /// Reconciles a node again.
    resync: mpsc::UnboundedSender<ObjectRef<GateNode>>,
    /// Re-taints reserved within a gate's budget (gate uid → nodes), so that reconciles running
    /// at the same time never exceed it before the node cache shows their writes.
    retaints: Mutex<std::collections::HashMap<String, HashSet<String>>>,
    /// Nodes whose reconcile failed, with their failures in a row (backoff and one warning per
    /// streak, `meshgate_core::node_gate::retry`).
    failures: Mutex<std::collections::HashMap<String, meshgate_core::node_gate::retry::Streak>>,
}

impl Ctx {
    fn ready(&self) -> bool {
        self.synced.load(Ordering::Acquire) && self.leader.is_leader()
    }

    /// Starts counting the nodes reconciled (after a sync or a leadership gain).
    fn restart_initial(&self) {
        self.metrics.initial_reconcile_done.set(0);
        *self
            .initial
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(HashSet::new());
    }

    fn reconciled(&self, node: &str) {
        let mut guard = self
            .initial
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(seen) = guard.as_mut() {
            seen.insert(node.to_owned());
            // Cheap count first (this runs on every reconcile of the first pass); the full
            // check only once as many nodes were seen as are cached.
            let all = seen.len() >= self.nodes.len()
                && self
                    .nodes
                    .state()
                    .iter()
                    .all(|n| seen.contains(n.metadata.name.as_deref().unwrap_or_default()));
            if all {
                *guard = None;
                self.metrics.initial_reconcile_done.set(1);
                tracing::info!("every node reconciled after the caches synced");
            }
        }
    }
}

/// Runs the node gate controller until `shutdown` resolves.
pub async fn run(
    client: kube::Client,
    leader: Leader,
    metrics: Metrics,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let shutdown = futures::FutureExt::shared(shutdown);
    let (gates, gate_writer) = reflector::store::<NodeGate>();
    let (trigger_tx, trigger_rx) = mpsc::unbounded_channel::<ObjectRef<GateNode>>();
    let agents = AgentIndex::default();

    // Gates: keep the store, watch the namespaces their agents live in, resync all nodes.
    let gate_stream = gate_watch(&client, gate_writer, &gates, &agents, &trigger_tx);

    let events = Events::new(client.clone());
    // Nodes are read as `GateNode`s and cached slimmed to what the gates read (`GateNode::slim`).
    let (nodes, node_writer) = reflector::store::<GateNode>();
    let node_stream = reflector::reflector(
        node_writer,
        watcher(
            Api::<GateNode>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(GateNode::slim),
    )
    .applied_objects();
    // DRA gates: the slices meshgate wrote, where the API server serves them (asked now, then
    // every `dra_discovery`). A slice that changes or goes (the kubelet deletes its node's
    // slices when it starts) reconciles its node.
    let (slice_store, slice_task) = if crate::dra::served(&client).await {
        let (store, stream) = slice_watch(&client, &trigger_tx);
        (Some(store), Some(Task(tokio::spawn(stream))))
    } else {
        (None, None)
    };
    let controller = Controller::for_stream(node_stream, nodes.clone()).with_config(
        kube::runtime::controller::Config::default().concurrency(settings.concurrency.max(1)),
    );

    let ctx = Arc::new(Ctx {
        client: client.clone(),
        gates: gates.clone(),
        nodes: nodes.clone(),
        agents: agents.clone(),
        leader: leader.clone(),
        events,
        event_slots: Arc::new(tokio::sync::Semaphore::new(EVENT_WRITES)),
        conditions: PendingConditions::default(),
        metrics: metrics.clone(),
        settings: settings.clone(),
        synced: AtomicBool::new(false),
        initial: Mutex::new(None),
        dra: crate::dra::Dra::new(slice_store),
        resync: trigger_tx.clone(),
        retaints: Mutex::new(std::collections::HashMap::new()),
        failures: Mutex::new(std::collections::HashMap::new()),
    });

    // No decision before every cache has its first list.
    let sync = sync_caches(ctx.clone(), trigger_tx.clone(), client.clone());

    // Leadership gained: every node is reconciled again.
    let leadership = follow_leadership(leader.clone(), ctx.clone(), trigger_tx.clone());

    let fan_out_nodes = nodes.clone();
    let triggers =
        tokio_stream::wrappers::UnboundedReceiverStream::new(trigger_rx).flat_map(move |r| {
            let refs: Vec<ObjectRef<GateNode>> = if r.name == RESYNC_ALL {
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

    let status_loop = status_loop(ctx.clone());
    let condition_writer = condition_writer(ctx.clone());
    let dra_discovery = follow_dra(
        ctx.clone(),
        trigger_tx.clone(),
        slice_task,
        settings.dra_discovery,
    );
    let main = controller
        .reconcile_on(triggers)
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile_counted, error_policy, ctx)
        .for_each(|r| {
            match r {
                Err(kube::runtime::controller::Error::QueueError(e)) => {
                    meshgate_kube::watch::log("nodes", &e);
                }
                Err(e) => tracing::debug!(error = %e, "reconcile failed"),
                Ok(_) => {}
            }
            futures::future::ready(())
        });
    let main = crate::drain::until_drained(main, shutdown);
    tokio::select! {
        _ = main => {},
        _ = gate_stream => {},
        _ = leadership => {},
        _ = status_loop => {},
        _ = condition_writer => {},
        _ = sync => {},
        _ = dra_discovery => {},
    }
    agents.stop();
}

/// The slices meshgate wrote: their store, and a watch that reconciles a slice's node when the
/// slice changes or goes (the kubelet deletes its node's slices when it starts).
fn slice_watch(
    client: &kube::Client,
    trigger: &mpsc::UnboundedSender<ObjectRef<GateNode>>,
) -> (
    Store<k8s_openapi::api::resource::v1::ResourceSlice>,
    impl Future<Output = ()> + Send + use<>,
) {
    let (store, writer) = reflector::store::<k8s_openapi::api::resource::v1::ResourceSlice>();
    let trigger = trigger.clone();
    let stream = reflector::reflector(
        writer,
        watcher(
            Api::all(client.clone()),
            watcher::Config::default().labels(&crate::dra::managed_selector()),
        )
        .default_backoff(),
    )
    .touched_objects()
    .for_each(move |s| {
        if let Ok(slice) = s
            && let Some(node) = slice.spec.node_name.as_deref()
        {
            let _ = trigger.send(ObjectRef::new(node));
        }
        futures::future::ready(())
    });
    (store, stream)
}

/// A spawned task that stops when this is dropped (with the controller).
struct Task(tokio::task::JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Asks again, every `interval`, whether the API server serves DRA, and follows the answer:
/// the slices are watched from the moment it does (decisions use them once listed) and
/// dropped when it stops; the DRA gates' classes are checked again after the API server's
/// version changed (an upgrade may turn DRA extended resources on or off). Either way every
/// node is decided again; the gates' `ResourceProvider` conditions say the provider in effect
/// (and their change makes the Event, [`provider_change`]).
async fn follow_dra(
    ctx: Arc<Ctx>,
    trigger: mpsc::UnboundedSender<ObjectRef<GateNode>>,
    mut watch: Option<Task>,
    interval: Duration,
) {
    let version = |client: kube::Client| async move {
        client.apiserver_version().await.ok().map(|v| v.git_version)
    };
    let mut known = version(ctx.client.clone()).await;
    loop {
        tokio::time::sleep(interval).await;
        let served = crate::dra::served(&ctx.client).await;
        let now = version(ctx.client.clone()).await;
        let upgraded = known.is_some() && now.is_some() && now != known;
        if now.is_some() {
            known = now;
        }
        if served && !ctx.dra.served() {
            let (store, stream) = slice_watch(&ctx.client, &trigger);
            let task = Task(tokio::spawn(stream));
            // Decisions wait for the first list; a watch that cannot list is asked again at
            // the next tick.
            if tokio::time::timeout(interval, store.wait_until_ready())
                .await
                .is_err()
            {
                drop(task);
                tracing::debug!(
                    "resource.k8s.io/v1 is served, but its slices could not be listed yet"
                );
                continue;
            }
            drop(watch.replace(task));
            ctx.dra.set_slices(Some(store));
            ctx.agents
                .ensure_watch(&ctx.client, &ctx.settings.node_plugin.namespace, &trigger);
            tracing::info!(
                "resource.k8s.io/v1 is served now: DRA gates offer their resource through DRA"
            );
        } else if !served && ctx.dra.served() {
            drop(watch.take());
            ctx.dra.set_slices(None);
            tracing::warn!(
                "resource.k8s.io/v1 is no longer served: DRA gates advertise their resource in the node status"
            );
        } else if upgraded {
            ctx.dra.forget_classes();
            tracing::info!(
                version = known.as_deref().unwrap_or_default(),
                "the API server's version changed: the DRA gates' classes are checked again"
            );
        } else {
            continue;
        }
        let _ = trigger.send(ObjectRef::new(RESYNC_ALL));
    }
}

/// The NodeGates' watch: keeps `gates`' store, watches the namespaces their agents live in,
/// and reconciles every node again when a gate's spec changes or a gate goes.
fn gate_watch(
    client: &kube::Client,
    gate_writer: reflector::store::Writer<NodeGate>,
    gates: &Store<NodeGate>,
    agents: &AgentIndex,
    trigger: &mpsc::UnboundedSender<ObjectRef<GateNode>>,
) -> impl Future<Output = ()> + Send + use<> {
    let agents = agents.clone();
    let client = client.clone();
    let trigger = trigger.clone();
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
        if let Err(e) = &g {
            meshgate_kube::watch::log("NodeGates", e);
        }
        if let Ok(gate) = g {
            for a in &gate.spec.agents {
                agents.ensure_watch(&client, &a.namespace, &trigger);
            }
            // Every node is reconciled again when a gate's spec changes (a new generation)
            // or the gate is gone or going; the gate's own status writes trigger nothing.
            let uid = gate.metadata.uid.clone().unwrap_or_default();
            let generation = gate.metadata.generation.unwrap_or_default();
            let deleted = gate_store.get(&ObjectRef::from_obj(&gate)).is_none()
                || gate.metadata.deletion_timestamp.is_some();
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
}

/// Marks the caches synced once each has its first list: nodes, gates, then the agents' pods
/// and DaemonSets of every namespace a gate names; then reconciles every node. Never ends.
async fn sync_caches(
    ctx: Arc<Ctx>,
    trigger: mpsc::UnboundedSender<ObjectRef<GateNode>>,
    client: kube::Client,
) {
    let _ = ctx.nodes.wait_until_ready().await;
    let _ = ctx.gates.wait_until_ready().await;
    ctx.dra.wait_until_ready().await;
    if ctx.dra.served() {
        ctx.agents
            .ensure_watch(&client, &ctx.settings.node_plugin.namespace, &trigger);
    }
    for gate in ctx.gates.state() {
        for a in &gate.spec.agents {
            ctx.agents.ensure_watch(&client, &a.namespace, &trigger);
        }
    }
    while !ctx.agents.synced() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Before the first decision: whether each DRA gate's class keeps its resource name (a
    // restart on a fallback cluster must not act as DRA until its first status pass).
    for gate in ctx.gates.state() {
        ctx.dra.check_class(&client, &gate).await;
    }
    ctx.restart_initial();
    ctx.synced.store(true, Ordering::Release);
    ctx.metrics.synced.set(1);
    tracing::info!("caches synced: nodes, node gates, agent pods and DaemonSets, resource slices");
    let _ = trigger.send(ObjectRef::new(RESYNC_ALL));
    futures::future::pending::<()>().await;
}

/// Follows leadership into the gauge; each time it is gained, every node is reconciled again.
async fn follow_leadership(
    mut leader_rx: Leader,
    leader_ctx: Arc<Ctx>,
    resync_trigger: mpsc::UnboundedSender<ObjectRef<GateNode>>,
) {
    loop {
        let is_leader = leader_rx.update();
        leader_ctx.metrics.leader.set(i64::from(is_leader));
        if is_leader {
            leader_ctx.restart_initial();
            let _ = resync_trigger.send(ObjectRef::new(RESYNC_ALL));
        }
        if leader_rx.changed().await.is_err() {
            break;
        }
    }
}

/// Retries a failed node with capped exponential backoff; warns once per streak of failures
/// (a stale refusal only when it persists: `meshgate_core::node_gate::retry`).
fn error_policy(node: Arc<GateNode>, err: &Error, ctx: Arc<Ctx>) -> Action {
    use meshgate_core::node_gate::retry::Failure;
    let name = node.name_any();
    let kind = if stale(err) {
        Failure::Stale
    } else {
        Failure::Other
    };
    let (failures, retry, warn) = {
        let mut streaks = ctx
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let streak = streaks.entry(name.clone()).or_default();
        let (retry, warn) = streak.fail(kind);
        (streak.failures, retry, warn)
    };
    if warn {
        tracing::warn!(node = %name, error = %err, failures, retry_in = ?retry, "node reconcile failed; retrying with backoff (further failures of this node are logged at debug level until it succeeds)");
    } else if kind == Failure::Stale {
        tracing::debug!(node = %name, error = %err, failures, retry_in = ?retry, "the node changed since it was read; reconciling it again from the newer copy");
    } else {
        tracing::debug!(node = %name, error = %err, failures, retry_in = ?retry, "node reconcile failed again");
    }
    Action::requeue(retry)
}

/// Whether the API server refused a conditional write because the node changed since it was
/// read: a JSON patch whose `test` operation (on the taints, the ownership record or the
/// resourceVersion read) no longer holds does not apply, and the server answers 422 `Invalid`
/// with no kind and no causes (`apiserver/pkg/endpoints/handlers/patch.go`), where a node that
/// fails validation is answered with its kind and the causes; or 409 `Conflict`, a write
/// conditional on a resourceVersion.
fn stale(err: &Error) -> bool {
    let Error::Write {
        source: kube::Error::Api(status),
        ..
    } = err
    else {
        return false;
    };
    status.code == 409
        || status.code == 422
            && status.reason == "Invalid"
            && status
                .details
                .as_ref()
                .is_none_or(|d| d.kind.is_empty() && d.causes.is_empty())
}

/// [`reconcile`], ending a node's streak of failures when it succeeds.
async fn reconcile_counted(node: Arc<GateNode>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let name = node.name_any();
    let result = reconcile(node, ctx.clone()).await;
    if result.is_ok() {
        let ended = ctx
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&name);
        match ended {
            Some(streak) if streak.warned => {
                tracing::info!(node = %name, failures = streak.failures, "node reconcile succeeded after failing");
            }
            Some(streak) => {
                tracing::debug!(node = %name, failures = streak.failures, "node reconcile succeeded after stale refusals");
            }
            None => {}
        }
    }
    result
}

/// Gates the controller acts on: not being deleted, and valid.
fn live(gate: &NodeGate) -> bool {
    gate.metadata.deletion_timestamp.is_none() && gate.spec.problems().is_empty()
}

fn json_patch(patch: meshgate_core::patch::JsonPatch) -> Result<json_patch::Patch, Error> {
    serde_json::from_value(serde_json::Value::Array(patch.0))
        .map_err(|e| Error::Patch(e.to_string()))
}

async fn reconcile(node: Arc<GateNode>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if !ctx.ready() {
        // Before sync, or not the leader: nothing is decided. Sync and leadership both
        // trigger a reconcile of every node.
        return Ok(Action::await_change());
    }
    ctx.metrics.reconciles.inc();
    let mut node = (*node).clone();
    let name = node.name_any();
    let api = Api::<GateNode>::all(ctx.client.clone());
    let mut requeue = ctx.settings.resync;
    let gates: Vec<Arc<NodeGate>> = ctx.gates.state().into_iter().filter(|g| live(g)).collect();
    for gate in &gates {
        let states = agent_states(&ctx.agents, gate, &node);
        let offer = ctx.dra.offer(gate, &node);
        let (taints, mut decision) = decide_node(
            &gate.name_any(),
            &gate.spec,
            &node,
            &states,
            offer,
            crate::now(),
        );
        if let Offer::Dra { slice } = offer {
            // No slice without a registered node plugin: the kubelet could not prepare the
            // pods' claims. A slice whose plugin is gone is withdrawn.
            let plugin = ctx
                .agents
                .state(&ctx.settings.node_plugin, &node, &gate.spec.taint.key);
            if !matches!(plugin, AgentState::Ready { .. }) {
                decision.resource = slice.then_some(false);
            }
        }
        tracing::debug!(node = %name, gate = %gate.name_any(), state = decision.state.as_str(), ?decision, "decided");
        if let Some(after) = decision.requeue_after {
            requeue = requeue.min(Duration::from_secs(
                u64::try_from(after.max(1)).unwrap_or(1),
            ));
        }
        if gate.spec.dry_run {
            dry_run_events(&ctx, gate, &node, &decision);
            continue;
        }
        let retaint = decision.retaint && decision.taint == Some(true);
        if retaint && !reserve_retaint(&ctx, gate, &name) {
            ctx.metrics.retaints_deferred.inc();
            event(
                &ctx,
                &node.object_ref(&()),
                EventType::Warning,
                "RetaintDeferred",
                format!(
                    "node gate {}: agents not ready, but {} nodes are re-tainted already (maxRetainted {}); not tainting",
                    gate.name_any(),
                    retainted_count(&ctx, gate),
                    gate.spec.max_retainted
                ),
            );
            decision.taint = None;
            decision.resource = None;
            requeue = requeue.min(Duration::from_secs(u64::from(
                gate.spec.grace_period_seconds.max(1),
            )));
        }
        let applied = apply(&ctx, &api, gate, node, &taints, &states, &decision).await;
        if (retaint && applied.is_err()) || decision.taint == Some(false) {
            release_retaint(&ctx, gate, &name);
        }
        node = applied?;
    }
    // Taints of gates that no longer select this node (and that meshgate owns).
    let empty = BTreeMap::new();
    let taints = taints_of(&node);
    let orphans = orphaned_taints(
        gates.iter().map(|g| &g.spec),
        node.metadata.labels.as_ref().unwrap_or(&empty),
        node.metadata.annotations.as_ref().unwrap_or(&empty),
        &taints,
    );
    if let Some(key) = orphans.first()
        && let Some(gate) = gates.iter().find(|g| g.spec.taint.key == *key)
    {
        if gate.spec.dry_run {
            return Ok(Action::requeue(requeue));
        }
        remove_taint(&ctx, &api, &node, gate, &taints, &BTreeMap::new()).await?;
        tracing::info!(node = %name, taint = %key, "removed the taint of a gate that no longer selects the node");
        // One write per reconcile: the next one starts from a fresh read.
        return Ok(Action::requeue(Duration::from_millis(10)));
    }
    // A key meshgate put on that no gate holds any more (an upgrade changed the gate's): the
    // gates above have put their own keys where their agents are not ready, so it comes off.
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
    let superseded = superseded_taints(gates.iter().map(|g| &g.spec), labels, annotations, &taints);
    if let Some(key) = superseded.first()
        && let Some(gate) = gates.iter().find(|g| selects(&g.spec, labels))
    {
        let mut old = (**gate).clone();
        old.spec.taint.key.clone_from(key);
        remove_taint(&ctx, &api, &node, &old, &taints, &BTreeMap::new()).await?;
        tracing::info!(node = %name, taint = %key, gate = %gate.name_any(), "removed a taint key of meshgate's that no gate holds any more; the gate's own key holds the node now");
        return Ok(Action::requeue(Duration::from_millis(10)));
    }
    ctx.reconciled(&name);
    Ok(Action::requeue(requeue))
}

/// The gate's agents' states on a node.
fn agent_states(agents: &AgentIndex, gate: &NodeGate, node: &GateNode) -> Vec<AgentState> {
    gate.spec
        .agents
        .iter()
        .map(|a| agents.state(a, node, &gate.spec.taint.key))
        .collect()
}

fn gate_nodes<'n>(
    gate: &NodeGate,
    nodes: &'n [Arc<GateNode>],
) -> impl Iterator<Item = &'n Arc<GateNode>> {
    let empty = BTreeMap::new();
    let spec = gate.spec.clone();
    nodes.iter().filter(move |n| {
        spec.node_selector
            .matches(n.metadata.labels.as_ref().unwrap_or(&empty))
    })
}

/// Nodes of the gate that carry a re-taint (as cached), plus re-taints reserved but not yet
/// seen in the cache.
fn retainted(ctx: &Ctx, gate: &NodeGate, reserved: &HashSet<String>) -> HashSet<String> {
    let nodes = ctx.nodes.state();
    let empty = BTreeMap::new();
    let mut out: HashSet<String> = gate_nodes(gate, &nodes)
        .filter(|n| {
            is_retainted(
                &gate.name_any(),
                &gate.spec,
                n.metadata.annotations.as_ref().unwrap_or(&empty),
                &taints_of(n),
            )
        })
        .map(|n| n.name_any())
        .collect();
    out.extend(reserved.iter().cloned());
    out
}

fn retainted_count(ctx: &Ctx, gate: &NodeGate) -> usize {
    let guard = ctx
        .retaints
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let empty = HashSet::new();
    let reserved = guard.get(&gate.uid().unwrap_or_default()).unwrap_or(&empty);
    retainted(ctx, gate, reserved).len()
}

/// Reserves a re-taint of `node` within the gate's budget; `false` when the budget is used up.
/// The check and the reservation happen under one lock, so concurrent reconciles cannot both
/// take the last slot.
fn reserve_retaint(ctx: &Ctx, gate: &NodeGate, node: &str) -> bool {
    let nodes = ctx.nodes.state();
    let total = gate_nodes(gate, &nodes).count();
    let mut guard = ctx
        .retaints
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let reserved = guard.entry(gate.uid().unwrap_or_default()).or_default();
    // A reservation whose taint the cache shows is counted from the cache from now on. (One
    // pass over the cache, not one per reservation: with every node of a large pool re-tainted
    // at once that was quadratic, and kept the controller CPU-bound for minutes at 5,000 nodes.)
    if !reserved.is_empty() {
        let shown: HashSet<&str> = nodes
            .iter()
            .filter(|x| has_taint(&gate.spec, &taints_of(x)))
            .filter_map(|x| x.metadata.name.as_deref())
            .collect();
        reserved.retain(|n| !shown.contains(n.as_str()));
    }
    let current = retainted(ctx, gate, reserved);
    if current.contains(node) {
        return true;
    }
    if current.len() >= gate.spec.retaint_budget(total) {
        return false;
    }
    reserved.insert(node.to_owned());
    true
}

/// Drops a node's re-taint reservation (its taint was removed, or the write failed).
fn release_retaint(ctx: &Ctx, gate: &NodeGate, node: &str) {
    let mut guard = ctx
        .retaints
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(r) = guard.get_mut(&gate.uid().unwrap_or_default()) {
        r.remove(node);
    }
}

fn dry_run_events(ctx: &Ctx, gate: &NodeGate, node: &GateNode, d: &NodeDecision) {
    let what = match d.taint {
        Some(true) => "would add",
        Some(false) => "would remove",
        None => return,
    };
    event(
        ctx,
        &node.object_ref(&()),
        EventType::Normal,
        "DryRun",
        format!(
            "node gate {} (dryRun): {what} taint {}",
            gate.name_any(),
            gate.spec.taint.key
        ),
    );
}

async fn remove_taint(
    ctx: &Ctx,
    api: &Api<GateNode>,
    node: &GateNode,
    gate: &NodeGate,
    taints: &[k8s_openapi::api::core::v1::Taint],
    marks: &BTreeMap<String, String>,
) -> Result<GateNode, Error> {
    let name = node.name_any();
    let write_err = write_error(&name);
    // One write where it can be: the release, its ready marks and the ownership record.
    if let Some(patch) = meshgate_core::nodegate::release_patch(&gate.spec, node, marks) {
        let node = untaint_write(ctx, api, &name, patch).await?;
        if !marks.is_empty() {
            count(ctx, false, "mark-ready");
        }
        return Ok(node);
    }
    let mut node = node.clone();
    if !marks.is_empty() {
        node = mark_ready(ctx, api, node, marks).await?;
    }
    let annotations = node.metadata.annotations.clone().unwrap_or_default();
    // Conditional on the node as read: its taints (or, with none, its resourceVersion).
    let rv = node.metadata.resource_version.clone().unwrap_or_default();
    if let Some(patch) = taint_patch(&gate.spec, taints, &rv, false) {
        node = untaint_write(ctx, api, &name, patch).await?;
    }
    if let Some(p) = owned_annotation_patch(&gate.spec.taint.key, &annotations, false) {
        node = api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&p))
            .await
            .map_err(&write_err)?;
    }
    Ok(node)
}

/// The JSON patch that lifts a gate's taint from node `name`, counted as `untaint`.
async fn untaint_write(
    ctx: &Ctx,
    api: &Api<GateNode>,
    name: &str,
    patch: meshgate_core::patch::JsonPatch,
) -> Result<GateNode, Error> {
    let write_err = write_error(name);
    let node = api
        .patch(
            name,
            &PatchParams::default(),
            &Patch::<()>::Json(json_patch(patch)?),
        )
        .await
        .map_err(counted(ctx, "untaint", &write_err))?;
    count(ctx, false, "untaint");
    Ok(node)
}

fn count(ctx: &Ctx, error: bool, op: &'static str) {
    let family = if error {
        &ctx.metrics.errors
    } else {
        &ctx.metrics.operations
    };
    family
        .get_or_create(&OperationLabels { operation: op })
        .inc();
}

async fn apply(
    ctx: &Ctx,
    api: &Api<GateNode>,
    gate: &NodeGate,
    mut node: GateNode,
    taints: &[k8s_openapi::api::core::v1::Taint],
    states: &[AgentState],
    d: &NodeDecision,
) -> Result<GateNode, Error> {
    let empty = BTreeMap::new();
    let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
    let marks = d.mark_ready_since.map_or_else(BTreeMap::new, |since| {
        let ts = k8s_openapi::jiff::Timestamp::from_second(since)
            .unwrap_or_default()
            .to_string();
        meshgate_core::nodegate::ready_marks(&gate.name_any(), annotations, &ts)
    });
    // A release writes the marks with the untaint (the bootstrap mark a re-taint rests on lands
    // with it); otherwise they go first, alone.
    let releases = d.taint == Some(false)
        && has_taint(&gate.spec, taints)
        && may_remove(&gate.spec, annotations);
    if !releases && !marks.is_empty() {
        node = mark_ready(ctx, api, node, &marks).await?;
    }
    let marks = if releases { marks } else { BTreeMap::new() };
    node = apply_taint(ctx, api, gate, node, taints, d, &marks).await?;
    node = apply_resource(ctx, api, gate, node, d).await?;
    if d.state != NodeState::Ignored {
        publish_condition(ctx, gate, &node, states, d);
    }
    Ok(node)
}

/// `err`, with the failed write counted under `op`.
fn counted<'a>(
    ctx: &'a Ctx,
    op: &'static str,
    err: &'a impl Fn(kube::Error) -> Error,
) -> impl FnOnce(kube::Error) -> Error + 'a {
    move |e| {
        count(ctx, true, op);
        err(e)
    }
}

/// A failed write to node `name`.
fn write_error(name: &str) -> impl Fn(kube::Error) -> Error + '_ {
    move |source| Error::Write {
        node: name.to_owned(),
        source,
    }
}

/// Marks when the node's agents became ready ([`meshgate_core::nodegate::ready_marks`]).
async fn mark_ready(
    ctx: &Ctx,
    api: &Api<GateNode>,
    node: GateNode,
    marks: &BTreeMap<String, String>,
) -> Result<GateNode, Error> {
    let name = node.name_any();
    let write_err = write_error(&name);
    let patch = serde_json::json!({"metadata": {"annotations": marks}});
    let node = api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(counted(ctx, "mark-ready", &write_err))?;
    count(ctx, false, "mark-ready");
    Ok(node)
}

/// Adds or removes the gate's taint as decided, with its Event.
async fn apply_taint(
    ctx: &Ctx,
    api: &Api<GateNode>,
    gate: &NodeGate,
    mut node: GateNode,
    taints: &[k8s_openapi::api::core::v1::Taint],
    d: &NodeDecision,
    marks: &BTreeMap<String, String>,
) -> Result<GateNode, Error> {
    let name = node.name_any();
    let spec = &gate.spec;
    let pp = PatchParams::default();
    let write_err = write_error(&name);
    if let Some(want) = d.taint
        && has_taint(spec, taints) != want
    {
        let empty = BTreeMap::new();
        if want {
            // Ownership first: a taint meshgate added is always recorded as its own.
            let annotations = node.metadata.annotations.clone().unwrap_or_default();
            if let Some(p) = owned_annotation_patch(&spec.taint.key, &annotations, true) {
                node = api
                    .patch(&name, &pp, &Patch::Merge(&p))
                    .await
                    .map_err(&write_err)?;
            }
            // From the node as this reconcile last wrote it (the annotation patch returns it
            // whole), conditional on that: its taints, or, with none, its resourceVersion.
            let latest = taints_of(&node);
            let rv = node.metadata.resource_version.clone().unwrap_or_default();
            if let Some(patch) = taint_patch(spec, &latest, &rv, true) {
                node = api
                    .patch(&name, &pp, &Patch::<()>::Json(json_patch(patch)?))
                    .await
                    .map_err(counted(ctx, "taint", &write_err))?;
                count(ctx, false, "taint");
            }
        } else if may_remove(spec, node.metadata.annotations.as_ref().unwrap_or(&empty)) {
            node = remove_taint(ctx, api, &node, gate, taints, marks).await?;
            if let Some(since) = d.ready_since {
                let waited = (crate::now_precise() - since as f64).max(0.0);
                ctx.metrics.ready_to_untaint.observe(waited);
            }
        }
        let (reason, note) = if want {
            let why = if d.retaint {
                "agents stopped being ready"
            } else {
                "agents not ready"
            };
            (
                "TaintAdded",
                format!(
                    "node gate {}: {why}; added taint {}",
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
        event(ctx, &node.object_ref(&()), EventType::Normal, reason, note);
    }
    Ok(node)
}

/// Offers or withdraws the gate's resource as decided (through DRA, or in the node status),
/// with its Event; the other provider's offer goes.
async fn apply_resource(
    ctx: &Ctx,
    api: &Api<GateNode>,
    gate: &NodeGate,
    mut node: GateNode,
    d: &NodeDecision,
) -> Result<GateNode, Error> {
    let name = node.name_any();
    let spec = &gate.spec;
    let pp = PatchParams::default();
    let write_err = write_error(&name);
    let provider = ctx.dra.provider_on(gate, &node);
    let dra = provider == Ok(ResourceProvider::Dra);
    if let Some(res) = &spec.resource {
        // The other provider's offer goes: a node that advertises the name natively is served
        // natively (the scheduler prefers it, and the node plugin never sees the pod), and a
        // gate that fell back to the node status keeps no slice.
        if dra && node.advertises(&res.name) {
            node = api
                .patch_status(
                    &name,
                    &pp,
                    &Patch::Merge(&resource_patch(&res.name, 0, false)),
                )
                .await
                .map_err(&write_err)?;
        }
        if !dra && res.provider == ResourceProvider::Dra && ctx.dra.has_slice(gate, &name) {
            ctx.dra
                .write_slice(&ctx.client, gate, &node, false)
                .await
                .map_err(&write_err)?;
        }
    }
    if let (Some(want), Some(res)) = (d.resource, &spec.resource) {
        let op = if want { "advertise" } else { "withdraw" };
        if dra {
            ctx.dra
                .write_slice(&ctx.client, gate, &node, want)
                .await
                .map_err(counted(ctx, op, &write_err))?;
        } else {
            let patch = resource_patch(&res.name, res.count, want);
            node = api
                .patch_status(&name, &pp, &Patch::Merge(&patch))
                .await
                .map_err(counted(ctx, op, &write_err))?;
        }
        count(ctx, false, op);
        let via = if dra { " (ResourceSlice)" } else { "" };
        let (reason, note) = if want {
            (
                "ResourceAdvertised",
                if dra {
                    format!(
                        "node gate {}: offering {} through DRA{via}",
                        gate.name_any(),
                        res.name
                    )
                } else {
                    let why = match &provider {
                        Err(why) => format!(" in the node status: {why}"),
                        Ok(_) => String::new(),
                    };
                    format!(
                        "node gate {}: advertising {}={}{why}",
                        gate.name_any(),
                        res.name,
                        res.count
                    )
                },
            )
        } else {
            (
                "ResourceWithdrawn",
                format!("node gate {}: withdrew {}{via}", gate.name_any(), res.name),
            )
        };
        event(ctx, &node.object_ref(&()), EventType::Normal, reason, note);
    }
    Ok(node)
}

/// A gate's node condition as decided: type, status, reason, message.
#[derive(Clone, Debug, PartialEq)]
struct NodeCondition {
    type_: String,
    status: &'static str,
    reason: &'static str,
    message: String,
}

impl NodeCondition {
    /// Whether `node` (as cached) carries it already.
    fn on(&self, node: &GateNode) -> bool {
        current_condition(node, &self.type_).is_some_and(|c| {
            c.status == self.status
                && c.reason.as_deref() == Some(self.reason)
                && c.message.as_deref() == Some(self.message.as_str())
        })
    }
}

fn current_condition<'n>(
    node: &'n GateNode,
    type_: &str,
) -> Option<&'n k8s_openapi::api::core::v1::NodeCondition> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == type_))
}

/// Node conditions decided and not yet written: the newest per node and type.
#[derive(Default)]
struct PendingConditions {
    queue: Mutex<std::collections::HashMap<(String, String), NodeCondition>>,
    wake: tokio::sync::Notify,
    /// What the writer wrote in the last [`WRITTEN_TRUSTED`], per node and type: a reconcile
    /// that ran before the node cache saw the write decides the same again, and is not
    /// written twice.
    written:
        Mutex<std::collections::HashMap<(String, String), (NodeCondition, std::time::Instant)>>,
}

/// How long the writer trusts its own record of a write over the node cache (which shows it
/// within milliseconds; a write by another leader since is caught by the next decision).
const WRITTEN_TRUSTED: Duration = Duration::from_secs(10);

/// Keeps the gate's node condition current (written only when it changes): queued for
/// [`condition_writer`], off the reconcile's path.
fn publish_condition(
    ctx: &Ctx,
    gate: &NodeGate,
    node: &GateNode,
    states: &[AgentState],
    d: &NodeDecision,
) {
    let (type_, status, reason, message) = node_condition(&gate.spec, &gate.name_any(), states, d);
    let want = NodeCondition {
        type_,
        status,
        reason,
        message,
    };
    let key = (node.name_any(), want.type_.clone());
    let mut queue = ctx
        .conditions
        .queue
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if want.on(node) {
        // A newer decision stands: nothing older may be written after it.
        queue.remove(&key);
        return;
    }
    queue.insert(key, want);
    ctx.conditions.wake.notify_one();
}

/// Writes the queued node conditions, [`CONDITION_WRITES`] at a time, the newest decision per
/// node and type, each only where the cached node does not carry it already. A release is then
/// one write in its reconcile (the condition follows), and in a burst the releases go first.
/// A node's condition is written once at a time (a batch holds each node and type once), so an
/// older decision never lands after a newer one. Not the leader: nothing is written (the
/// leader's reconciles decide again). A failed write is queued again unless a newer decision
/// came, after a pause.
async fn condition_writer(ctx: Arc<Ctx>) {
    // Batches in a row with a failed write: the third warns (once a streak).
    let mut failing = 0u32;
    loop {
        ctx.conditions.wake.notified().await;
        loop {
            let batch: Vec<((String, String), NodeCondition)> = std::mem::take(
                &mut *ctx
                    .conditions
                    .queue
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            )
            .into_iter()
            .collect();
            if batch.is_empty() {
                break;
            }
            if !ctx.ready() {
                ctx.conditions
                    .written
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clear();
                continue;
            }
            ctx.conditions
                .written
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .retain(|_, (_, at)| at.elapsed() < WRITTEN_TRUSTED);
            let failed = futures::stream::iter(batch)
                .map(|((node, type_), want)| {
                    let ctx = ctx.clone();
                    async move {
                        match write_condition(&ctx, &node, &want).await {
                            Ok(()) => None,
                            Err(e) => {
                                tracing::debug!(%node, error = %e, "node condition not written; retrying");
                                Some(((node, type_), want))
                            }
                        }
                    }
                })
                .buffer_unordered(CONDITION_WRITES)
                .filter_map(futures::future::ready)
                .collect::<Vec<_>>()
                .await;
            if failed.is_empty() {
                failing = 0;
            } else {
                failing += 1;
                if failing == 3 {
                    tracing::warn!(
                        nodes = failed.len(),
                        "node conditions not written three times in a row; retrying every second"
                    );
                }
                {
                    let mut queue = ctx
                        .conditions
                        .queue
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    for (key, want) in failed {
                        queue.entry(key).or_insert(want);
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Writes one node condition by a strategic merge patch of the node's status (its type is the
/// merge key: no other condition is touched), keeping its transition time where the status is
/// unchanged. A node gone, or carrying it already, is left alone.
async fn write_condition(ctx: &Ctx, name: &str, want: &NodeCondition) -> Result<(), kube::Error> {
    let Some(node) = ctx.nodes.get(&ObjectRef::new(name)) else {
        return Ok(());
    };
    let key = (name.to_owned(), want.type_.clone());
    let written_now = ctx
        .conditions
        .written
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&key)
        .is_some_and(|(w, at)| w == want && at.elapsed() < WRITTEN_TRUSTED);
    if want.on(&node) || written_now {
        return Ok(());
    }
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let transition = current_condition(&node, &want.type_)
        .filter(|c| c.status == want.status)
        .and_then(|c| c.last_transition_time.as_ref())
        .map_or_else(|| now.clone(), |t| t.0.to_string());
    let patch = serde_json::json!({"status": {"conditions": [{
        "type": want.type_, "status": want.status, "reason": want.reason,
        "message": want.message, "lastHeartbeatTime": now, "lastTransitionTime": transition,
    }]}});
    match Api::<GateNode>::all(ctx.client.clone())
        .patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
    {
        Ok(_) => {
            count(ctx, false, "condition");
            ctx.conditions
                .written
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(key, (want.clone(), std::time::Instant::now()));
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => {
            count(ctx, true, "condition");
            Err(e)
        }
    }
}

/// Records an Event off the caller's path, at most [`EVENT_WRITES`] at a time (in the order
/// asked): a release is not held behind its own Event, and in a burst the releases go before
/// the Events that follow them. Best effort, as Events are: one not written when the process
/// stops is lost.
fn event(
    ctx: &Ctx,
    object: &k8s_openapi::api::core::v1::ObjectReference,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let (events, slots) = (ctx.events.clone(), ctx.event_slots.clone());
    let (object, reason) = (object.clone(), reason.to_owned());
    tokio::spawn(async move {
        let Ok(_slot) = slots.acquire_owned().await else {
            return;
        };
        if let Err(e) = events
            .publish(type_, "Reconcile", &reason, &note, &object)
            .await
        {
            tracing::debug!(error = %e, "event not recorded");
        }
    });
}

/// A deleted gate: its taints (owned, not held by another live gate with the same key) and its
/// resource come off every node; then its finalizer goes. Any failure leaves the finalizer for
/// the next round.
async fn finalize(ctx: &Ctx, gate: &NodeGate) -> Result<(), Error> {
    let api = Api::<GateNode>::all(ctx.client.clone());
    let others: Vec<Arc<NodeGate>> = ctx
        .gates
        .state()
        .into_iter()
        .filter(|g| live(g) && g.metadata.uid != gate.metadata.uid)
        .collect();
    let empty = BTreeMap::new();
    for node in ctx.nodes.state() {
        // Leadership can end during the pass: the next leader finishes it (the finalizer stays).
        if !ctx.ready() {
            return Ok(());
        }
        let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
        let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
        let taints = taints_of(&node);
        let shared = |f: &dyn Fn(&NodeGate) -> bool| {
            others
                .iter()
                .any(|g| g.spec.node_selector.matches(labels) && f(g))
        };
        let mut current = (*node).clone();
        if has_taint(&gate.spec, &taints)
            && meshgate_core::nodegate::owns_key(&gate.spec.taint.key, annotations)
            && !shared(&|g| g.spec.taint.key == gate.spec.taint.key)
        {
            current = remove_taint(ctx, &api, &current, gate, &taints, &BTreeMap::new()).await?;
            event(
                ctx,
                &current.object_ref(&()),
                EventType::Normal,
                "TaintRemoved",
                format!(
                    "node gate {} deleted; removed taint {}",
                    gate.name_any(),
                    gate.spec.taint.key
                ),
            );
        }
        if let Some(res) = &gate.spec.resource {
            let advertised = node.advertises(&res.name);
            if advertised
                && !shared(&|g| g.spec.resource.as_ref().is_some_and(|r| r.name == res.name))
            {
                api.patch_status(
                    &current.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&resource_patch(&res.name, res.count, false)),
                )
                .await
                .map_err(|source| Error::Write {
                    node: current.name_any(),
                    source,
                })?;
                count(ctx, false, "withdraw");
            }
        }
    }
    ctx.dra
        .remove_gate(&ctx.client, gate)
        .await
        .map_err(|source| Error::Write {
            node: format!("(gate {} slices)", gate.name_any()),
            source,
        })?;
    if !ctx.ready() {
        return Ok(());
    }
    let finalizers: Vec<String> = gate
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    let patch = serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": gate.resource_version()}});
    Api::<NodeGate>::all(ctx.client.clone())
        .patch(
            &gate.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(|source| Error::Write {
            node: format!("(gate {})", gate.name_any()),
            source,
        })?;
    tracing::info!(gate = %gate.name_any(), "node gate deleted: its taints and resource are off every node");
    Ok(())
}

async fn ensure_finalizer(ctx: &Ctx, gate: &NodeGate) {
    if gate.finalizers().iter().any(|f| f == FINALIZER) {
        return;
    }
    let mut finalizers = gate.finalizers().to_vec();
    finalizers.push(FINALIZER.to_owned());
    let patch = serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": gate.resource_version()}});
    if let Err(e) = Api::<NodeGate>::all(ctx.client.clone())
        .patch(
            &gate.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        tracing::debug!(gate = %gate.name_any(), error = %e, "finalizer not added yet");
    }
}

/// Refreshes each gate's status and the per-state node gauges; adds finalizers and finalizes
/// deleted gates.
/// The Event for a change of the gate's `ResourceProvider` condition, as the status pass
/// found it against the status stored: `DRAUnavailable` when the gate falls back to the node
/// status (at its first status too), `DRAServed` when a gate that had fallen back offers its
/// resource through DRA again. Made by whichever replica leads when the status changes, so a
/// change noticed while leadership moved still gets its Event.
fn provider_change(
    old: &NodeGateStatus,
    new: &NodeGateStatus,
) -> Option<(EventType, &'static str, String)> {
    let provider = |s: &NodeGateStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == "ResourceProvider")
            .map(|c| (c.reason.clone(), c.message.clone()))
    };
    let before = provider(old).map(|(reason, _)| reason);
    let (now, message) = provider(new)?;
    match (before.as_deref(), now.as_str()) {
        (Some(b), n) if b == n => None,
        (_, "NodeStatusFallback") => Some((
            EventType::Warning,
            "DRAUnavailable",
            format!("falling back to the node status: {message}"),
        )),
        (Some("NodeStatusFallback"), "DRA") => Some((EventType::Normal, "DRAServed", message)),
        _ => None,
    }
}

async fn status_loop(ctx: Arc<Ctx>) {
    let mut tick = tokio::time::interval(ctx.settings.status_interval);
    let mut seen_states: HashSet<GateStateLabels> = HashSet::new();
    loop {
        tick.tick().await;
        if !ctx.ready() {
            continue;
        }
        let all_nodes = ctx.nodes.state();
        for gate in ctx.gates.state() {
            if gate.metadata.deletion_timestamp.is_some() {
                if gate.finalizers().iter().any(|f| f == FINALIZER)
                    && let Err(e) = finalize(&ctx, &gate).await
                {
                    tracing::warn!(gate = %gate.name_any(), error = %e, "finalizing the gate failed; retrying");
                }
                continue;
            }
            ensure_finalizer(&ctx, &gate).await;
            let gate_name = gate.name_any();
            if ctx.dra.ensure_class(&ctx.client, &gate).await.is_some() {
                // Nodes are decided again with the provider in effect (the condition below
                // says which, and its change makes the Event).
                for n in gate_nodes(&gate, &all_nodes) {
                    let _ = ctx.resync.send(ObjectRef::from_obj(n.as_ref()));
                }
            }
            let status = gate_status(&ctx, &gate, &all_nodes, &mut seen_states);
            let old = gate.status.clone().unwrap_or_default();
            let degraded_now = status
                .conditions
                .iter()
                .any(|c| c.type_ == "Degraded" && c.status == "True");
            let degraded_before = old
                .conditions
                .iter()
                .any(|c| c.type_ == "Degraded" && c.status == "True");
            if degraded_now
                && !degraded_before
                && let Some(c) = status.conditions.iter().find(|c| c.type_ == "Degraded")
            {
                event(
                    &ctx,
                    &gate.object_ref(&()),
                    EventType::Warning,
                    "Degraded",
                    c.message.clone(),
                );
            }
            if let Some((type_, reason, message)) = provider_change(&old, &status) {
                event(&ctx, &gate.object_ref(&()), type_, reason, message);
            }
            let same = |a: &NodeGateStatus, b: &NodeGateStatus| {
                let key = |s: &NodeGateStatus| {
                    (
                        s.nodes,
                        s.ready_nodes,
                        s.held_nodes,
                        s.would_taint,
                        s.would_untaint,
                        s.retaint_deferred,
                        s.observed_generation,
                        s.conditions
                            .iter()
                            .map(|c| (c.type_.clone(), c.status.clone(), c.message.clone()))
                            .collect::<Vec<_>>(),
                    )
                };
                key(a) == key(b)
            };
            if same(&old, &status) {
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

fn condition(
    old: &NodeGateStatus,
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    crate::conditions::condition(&old.conditions, type_, status, reason, &message, generation)
}

/// A gate's status from the nodes it selects, and the per-state gauges.
fn gate_status(
    ctx: &Ctx,
    gate: &NodeGate,
    all_nodes: &[Arc<GateNode>],
    seen_states: &mut HashSet<GateStateLabels>,
) -> NodeGateStatus {
    let gate_name = gate.name_any();
    let old = gate.status.clone().unwrap_or_default();
    let generation = gate.metadata.generation;
    let mut status = NodeGateStatus {
        observed_generation: generation.unwrap_or_default(),
        ..NodeGateStatus::default()
    };
    let problems = gate.spec.problems();
    if !problems.is_empty() {
        status.conditions = vec![condition(
            &old,
            "Invalid",
            true,
            "InvalidSpec",
            problems.join("; "),
            generation,
        )];
        return status;
    }
    let Tally {
        by_state,
        given_up,
        retainted,
        want_retaint,
    } = tally(ctx, gate, all_nodes, &mut status);
    if !gate.spec.dry_run {
        let budget = gate.spec.retaint_budget(status.nodes as usize);
        status.retaint_deferred = want_retaint.min(
            u32::try_from((retainted + want_retaint as usize).saturating_sub(budget))
                .unwrap_or(u32::MAX),
        );
    }
    for labels in seen_states.iter() {
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
    let mut conditions = Vec::new();
    let all_ready = status.ready_nodes == status.nodes;
    conditions.push(condition(
        &old,
        "Ready",
        all_ready,
        if all_ready {
            "AllNodesReady"
        } else {
            "NodesWaiting"
        },
        format!(
            "{} of {} nodes ready, {} held by taint {}",
            status.ready_nodes, status.nodes, status.held_nodes, gate.spec.taint.key
        ),
        generation,
    ));
    conditions.push(degraded(ctx, gate, &old, &given_up, generation));
    if status.retaint_deferred > 0 {
        conditions.push(condition(
            &old,
            "RetaintBudgetExhausted",
            true,
            "MaxRetainted",
            format!(
                "{} nodes re-tainted (maxRetainted {}); {} more would be: not tainted, reported",
                retainted, gate.spec.max_retainted, status.retaint_deferred
            ),
            generation,
        ));
    }
    conditions.extend(resource_provider(ctx, gate, all_nodes, &old, generation));
    if gate.spec.dry_run {
        conditions.push(condition(
            &old,
            "DryRun",
            true,
            "DryRun",
            format!(
                "writes nothing to nodes; would taint {} and release {} now",
                status.would_taint, status.would_untaint
            ),
            generation,
        ));
    }
    status.conditions = conditions;
    status
}

/// What a gate's nodes add up to.
struct Tally {
    by_state: BTreeMap<NodeState, i64>,
    /// Per agent (index), the nodes where it was given up on.
    given_up: BTreeMap<usize, u32>,
    /// Nodes the gate re-tainted.
    retainted: usize,
    /// Nodes it would re-taint now.
    want_retaint: u32,
}

/// The gate's decision on each node it selects, counted into `status` and a [`Tally`].
fn tally(
    ctx: &Ctx,
    gate: &NodeGate,
    all_nodes: &[Arc<GateNode>],
    status: &mut NodeGateStatus,
) -> Tally {
    let mut by_state: BTreeMap<NodeState, i64> = BTreeMap::new();
    let mut given_up: BTreeMap<usize, u32> = BTreeMap::new();
    let now = crate::now();
    let mut retainted = 0usize;
    let mut want_retaint = 0u32;
    for node in gate_nodes(gate, all_nodes) {
        status.nodes += 1;
        let states = agent_states(&ctx.agents, gate, node);
        let offer = ctx.dra.offer(gate, node);
        let (taints, d) = decide_node(&gate.name_any(), &gate.spec, node, &states, offer, now);
        let tainted = has_taint(&gate.spec, &taints);
        if tainted {
            status.held_nodes += 1;
        }
        let empty = BTreeMap::new();
        if is_retainted(
            &gate.name_any(),
            &gate.spec,
            node.metadata.annotations.as_ref().unwrap_or(&empty),
            &taints,
        ) {
            retainted += 1;
        }
        if d.retaint && d.taint == Some(true) {
            want_retaint += 1;
        }
        if gate.spec.dry_run {
            match d.taint {
                Some(true) => status.would_taint += 1,
                Some(false) => status.would_untaint += 1,
                None => {}
            }
        }
        if matches!(
            d.state,
            NodeState::Ready | NodeState::Released | NodeState::Releasing
        ) {
            status.ready_nodes += 1;
        }
        for i in &d.given_up {
            *given_up.entry(*i).or_default() += 1;
        }
        *by_state.entry(d.state).or_default() += 1;
    }
    Tally {
        by_state,
        given_up,
        retainted,
        want_retaint,
    }
}

/// `Degraded`: an agent's DaemonSet is missing, or agents missing past the timeout.
fn degraded(
    ctx: &Ctx,
    gate: &NodeGate,
    old: &NodeGateStatus,
    given_up: &BTreeMap<usize, u32>,
    generation: Option<i64>,
) -> Condition {
    let mut why = Vec::new();
    for (i, a) in gate.spec.agents.iter().enumerate() {
        if ctx.agents.daemonset_absent(a) {
            why.push(format!(
                "agent {}: DaemonSet {}/{} does not exist",
                a.name,
                a.namespace,
                a.daemon_set.as_deref().unwrap_or_default()
            ));
        }
        if let Some(n) = given_up.get(&i) {
            let action = match gate.spec.on_missing_agent {
                meshgate_api::node_gate::MissingAgentPolicy::Release => "released",
                meshgate_api::node_gate::MissingAgentPolicy::Wait => "still held",
            };
            why.push(format!(
                "agent {}: no pod on {n} nodes after {}s ({action})",
                a.name, gate.spec.missing_agent_timeout_seconds
            ));
        }
    }
    let degraded = !why.is_empty();
    condition(
        old,
        "Degraded",
        degraded,
        if degraded {
            "AgentsMissing"
        } else {
            "AgentsPresent"
        },
        if degraded {
            why.join("; ")
        } else {
            "every agent's DaemonSet exists and has pods".into()
        },
        generation,
    )
}

/// `ResourceProvider`, for a gate whose resource is offered through DRA: whether DRA works on
/// this cluster, or the node status carries the resource instead.
fn resource_provider(
    ctx: &Ctx,
    gate: &NodeGate,
    all_nodes: &[Arc<GateNode>],
    old: &NodeGateStatus,
    generation: Option<i64>,
) -> Option<Condition> {
    let res = gate
        .spec
        .resource
        .as_ref()
        .filter(|r| r.provider == ResourceProvider::Dra)?;
    let (ok, reason, message) = match ctx.dra.provider(gate) {
        Ok(_) => {
            // Nodes whose kubelet does not prepare the claim carry the resource in their status.
            let old_kubelets = gate_nodes(gate, all_nodes)
                .filter(|n| ctx.dra.provider_on(gate, n).is_err())
                .count();
            let also = if old_kubelets == 0 {
                String::new()
            } else {
                format!(
                    "; {old_kubelets} node(s) whose kubelet is older than {}.{} advertise it in the node status instead",
                    meshgate_core::dra::EXTENDED_RESOURCE_KUBELET.0,
                    meshgate_core::dra::EXTENDED_RESOURCE_KUBELET.1
                )
            };
            (
                true,
                "DRA",
                format!(
                    "{} is offered through DRA: DeviceClass {} and a ResourceSlice per ready node; the node plugin confirms the mesh before each pod's sandbox{also}",
                    res.name,
                    meshgate_core::dra::device_class_name(&gate.name_any())
                ),
            )
        }
        Err(why) => (
            false,
            "NodeStatusFallback",
            format!(
                "{} is advertised in the node status instead: {why}",
                res.name
            ),
        ),
    };
    Some(condition(
        old,
        "ResourceProvider",
        ok,
        reason,
        message,
        generation,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: serde_json::Value) -> Error {
        Error::Write {
            node: "n".into(),
            source: kube::Error::Api(
                serde_json::from_value::<kube::core::Status>(body)
                    .expect("a Status")
                    .boxed(),
            ),
        }
    }

    #[test]
    fn a_json_patch_whose_test_failed_is_a_stale_refusal_and_a_validation_error_is_not() {
        // What kube-apiserver answers when a JSON patch does not apply (its `test` failed).
        let not_applied = refused(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "the server rejected our request due to an error in our request",
            "reason": "Invalid", "details": {}, "code": 422
        }));
        assert!(stale(&not_applied));
        // A node the patch made invalid: the kind, the name and the causes.
        let invalid = refused(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "Node \"n\" is invalid: spec.taints[0].effect: Unsupported value",
            "reason": "Invalid", "code": 422,
            "details": {"name": "n", "kind": "Node", "causes": [
                {"reason": "FieldValueNotSupported", "message": "Unsupported value", "field": "spec.taints[0].effect"}]}
        }));
        assert!(!stale(&invalid));
        let conflict = refused(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "Operation cannot be fulfilled", "reason": "Conflict", "code": 409
        }));
        assert!(stale(&conflict));
        assert!(!stale(&Error::Patch("x".into())));
    }
}

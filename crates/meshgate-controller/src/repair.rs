//! The repair loop: finds pods that started before their node's mesh agent was ready, and
//! deletes them (when a controller recreates them) or labels them.
//!
//! The rules are [`meshgate_core::repair`]'s; this module watches, keeps a small summary per
//! pod, paces the actions and writes them.
//!
//! # Waiting gates
//! With a waiting threshold (`RepairSettings::waiting_threshold`, `install` sets 120 s) the same
//! watch also reports, even with repair off: every 10 s the pods whose gate has been running
//! longer than the threshold are counted (`gates_waiting`) and each gets one Warning Event
//! `GateWaiting` naming its node and `meshgate status pod`; with repair off, a gate that timed
//! out gets a Warning Event `GateTimedOut` (with repair on, the repair's own Event says it). No
//! pod is changed unless repair is on.
//!
//! # What is watched, and why
//! * **Pods**, with the configured label selector when there is one, else all pods; terminal
//!   pods (`Succeeded`/`Failed`) are excluded by a field selector on `status.phase`. The gate's
//!   exit code lives in `status.initContainerStatuses`, which no field selector reaches, so the
//!   watch carries whole pods; each event is summarized at once into a [`PodSummary`] (a few
//!   strings and numbers) and the pod dropped. Only pods that can matter are kept: those carrying
//!   the gate, and, for the started-early rule, those the selector picks. There is no reflector
//!   store of full pods.
//! * **Node metadata** (`PartialObjectMeta<Node>`: no spec, no status), only when the
//!   started-early rule is on: the agents-ready time is the node annotation
//!   `meshgate.dev/agents-ready-since`; one number per annotated node is kept. When it appears or
//!   changes, the pods on that node are judged again.
//!
//! # Pacing and safety
//! * One work queue, deduplicated by pod UID, processed in order by one task; a pod is queued
//!   when its summary changes, when its node's ready time changes, and when this replica becomes
//!   the leader.
//! * Each action is admitted by a [`Limiter`]: at most `rate_per_second` (bursts of `burst`),
//!   and never the same pod (UID) twice within `window`. A pod held back by the rate waits at the
//!   head of the queue; one within its window is skipped. The window lives in this replica's
//!   memory: a new leader may act once more on a pod (a deleted pod is gone, a labelled pod
//!   carries the label, so that is at most one extra Event).
//! * Deletion goes through the Eviction API, so the pod's PodDisruptionBudgets hold: an eviction
//!   a budget refuses (429) is retried every 5 s, counted as `skipped_total{reason=
//!   "disruption-budget"}`, not as an error. It carries a UID precondition; the label patch carries the UID (immutable, so a pod
//!   re-created under the same name is not touched). Bare pods are never deleted.
//! * Every write (Events included) happens only while `leader.is_leader()` is true.
//! * Dry run: no pod is changed; the loop logs and records `MeshRepairDryRun` Events saying what
//!   it would do, paced and windowed like real actions.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::events::{EventType, Events};
use crate::leader::Leader;
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::{Api, DeleteParams, EvictParams, Patch, PatchParams, Preconditions};
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_core::repair::{
    Admission, Decision, Limiter, PodSummary, REPAIR_LABEL, REPAIR_LABEL_VALUE,
    REPAIR_REASON_ANNOTATION, Reason, decide, explain, node_ready_since,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

pub use meshgate_core::repair::{RepairAction, RepairSettings};

/// Event reason of a deleted pod.
pub const EVENT_DELETED: &str = "MeshRepairDeleted";
/// Event reason of a labelled pod.
pub const EVENT_LABELLED: &str = "MeshRepairLabelled";
/// Event reason in dry-run mode.
pub const EVENT_DRY_RUN: &str = "MeshRepairDryRun";

/// Pods are phase-filtered on the server: finished pods need no repair.
const NOT_FINISHED: &str = "status.phase!=Succeeded,status.phase!=Failed";
/// Wait after a failed write before the queue moves on.
const ERROR_BACKOFF: Duration = Duration::from_secs(1);
/// How long a pod whose eviction a PodDisruptionBudget refused waits before the next try.
const BUDGET_RETRY: Duration = Duration::from_secs(5);

/// What a repair write did.
enum Done {
    Yes,
    /// The eviction was refused by a PodDisruptionBudget (429).
    HeldByBudget,
}
/// How often expired window entries are dropped.
const PRUNE_INTERVAL: Duration = Duration::from_secs(60);
/// How often pods are checked for gates waiting longer than the threshold.
const WAITING_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Detections: `gate-timed-out`, `started-early`. Skips: `bare`, `window`, `rate`,
    /// `disruption-budget`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// `delete`, `label`, and in dry-run mode `would-delete`, `would-label`.
    pub action: &'static str,
}

/// The repair loop's metrics, under the `meshgate_controller_repair` prefix.
///
/// * `detections_total{reason}`: pods found, once per pod and reason.
/// * `actions_total{action}`: actions taken (or, in dry-run mode, that would have been).
/// * `skipped_total{reason}`: `bare` (a bare pod labelled instead of deleted), `window` (already
///   acted on within the window), `rate` (held back by the rate limit; counted per hold),
///   `disruption-budget` (an eviction a PodDisruptionBudget refused; counted per try, retried
///   every 5 s).
/// * `errors_total{action}`: failed writes.
/// * `pods`: pod summaries kept.
#[derive(Clone)]
pub struct RepairMetrics {
    pub detections: Family<ReasonLabels, Counter>,
    pub actions: Family<ActionLabels, Counter>,
    pub skipped: Family<ReasonLabels, Counter>,
    pub errors: Family<ActionLabels, Counter>,
    pub pods: Gauge,
    /// Pods whose gate has run longer than the waiting threshold.
    pub gates_waiting: Gauge,
    /// `GateWaiting` Events written.
    pub gate_waiting_events: Counter,
    registry: Option<Arc<Registry>>,
}

impl std::fmt::Debug for RepairMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RepairMetrics").finish_non_exhaustive()
    }
}

impl Default for RepairMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RepairMetrics {
    /// Metrics with a registry of their own (see [`RepairMetrics::encode`]).
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("meshgate_controller_repair");
        let mut m = Self::register(&mut registry);
        m.registry = Some(Arc::new(registry));
        m
    }

    /// Metrics registered in `registry` (give it the prefix `meshgate_controller_repair`, e.g. a
    /// `sub_registry_with_prefix("repair")` of the controller's registry).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            detections: Family::default(),
            actions: Family::default(),
            skipped: Family::default(),
            errors: Family::default(),
            pods: Gauge::default(),
            gates_waiting: Gauge::default(),
            gate_waiting_events: Counter::default(),
            registry: None,
        };
        registry.register(
            "detections",
            "Pods found needing a repair, by reason",
            m.detections.clone(),
        );
        registry.register(
            "actions",
            "Repair actions taken (would-*: dry run), by action",
            m.actions.clone(),
        );
        registry.register(
            "skipped",
            "Repairs not done: bare pods labelled instead of deleted, pods within the window, holds by the rate limit",
            m.skipped.clone(),
        );
        registry.register(
            "errors",
            "Failed repair writes, by action",
            m.errors.clone(),
        );
        registry.register(
            "pods",
            "Pod summaries kept by the repair loop",
            m.pods.clone(),
        );
        registry.register(
            "gates_waiting",
            "Pods whose gate has been running longer than the waiting threshold",
            m.gates_waiting.clone(),
        );
        registry.register(
            "gate_waiting_events",
            "GateWaiting Events written (one per pod)",
            m.gate_waiting_events.clone(),
        );
        m
    }

    /// The text exposition of the metrics' own registry (empty when they were registered
    /// elsewhere).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Some(r) = &self.registry
            && prometheus_client::encoding::text::encode(&mut out, r).is_err()
        {
            out.clear();
        }
        out
    }

    fn skip(&self, reason: &'static str) {
        self.skipped.get_or_create(&ReasonLabels { reason }).inc();
    }
}

/// A client for pod evictions that does not retry a `429 Too Many Requests` itself.
///
/// A PodDisruptionBudget refuses an eviction with 429; kube's default client retries a 429
/// fifteen times with a backoff that grows to minutes, which would stall the repair loop on
/// one pod. Build it from the controller's configuration with `default_retry: false`; the loop
/// retries a refused eviction itself, every 5 s, between its other pods.
#[derive(Clone)]
pub struct EvictionClient(pub kube::Client);

impl std::fmt::Debug for EvictionClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EvictionClient")
    }
}

/// Runs the repair loop until `shutdown` resolves. It writes (pods, Events) only while
/// `leader.is_leader()` is true. Disabled or invalid settings: nothing runs (invalid ones are
/// logged), and the call returns at shutdown. Evictions go through `evictions`.
pub async fn run(
    client: kube::Client,
    evictions: EvictionClient,
    leader: Leader,
    settings: RepairSettings,
    metrics: RepairMetrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    if !settings.enabled && settings.waiting_threshold.is_none() {
        shutdown.await;
        return;
    }
    if let Err(e) = settings.validate() {
        tracing::error!(error = %e, "repair loop not started: invalid settings");
        shutdown.await;
        return;
    }
    tracing::info!(
        action = settings.action.as_str(),
        dry_run = settings.dry_run,
        rate_per_second = settings.rate_per_second,
        burst = settings.burst,
        window_seconds = settings.window.as_secs(),
        detect_started_early = settings.detect_started_early,
        selector = settings.selector.as_deref().unwrap_or(""),
        "repair loop starting"
    );

    let mut inputs = inputs(&client, &settings);

    let events = Events::new(client.clone());
    let origin = Instant::now();
    let mut state = State {
        limiter: Limiter::new(
            settings.rate_per_second,
            settings.burst,
            settings.window,
            Duration::ZERO,
        ),
        client,
        evictions: evictions.0,
        leader: leader.clone(),
        settings,
        metrics,
        events,
        origin,
        pods: HashMap::new(),
        by_node: HashMap::new(),
        ready_since: HashMap::new(),
        detected: HashMap::new(),
        queue: VecDeque::new(),
        queued: HashSet::new(),
        pods_relist: None,
        nodes_relist: None,
        waiting_reported: HashSet::new(),
    };

    let mut leader_rx = leader;
    let mut is_leader = leader_rx.update();
    let mut leader_open = true;
    let mut wake: Option<Instant> = None;
    let mut prune = tokio::time::interval(PRUNE_INTERVAL);
    let mut waiting = tokio::time::interval(WAITING_INTERVAL);
    let shutdown = shutdown;
    tokio::pin!(shutdown);
    loop {
        let can_work = is_leader && !state.queue.is_empty();
        let wake_at = wake.unwrap_or_else(Instant::now);
        tokio::select! {
            () = &mut shutdown => break,
            input = inputs.next() => match input {
                Some(input) => state.handle(input),
                None => break,
            },
            changed = leader_rx.changed(), if leader_open => match changed {
                Ok(()) => {
                    let now_leader = leader_rx.update();
                    if now_leader && !is_leader {
                        tracing::info!("repair loop: leading; judging every pod again");
                        state.enqueue_all();
                    }
                    is_leader = now_leader;
                }
                Err(_) => leader_open = false,
            },
            () = tokio::time::sleep_until(wake_at), if can_work => {
                wake = state.process_next().await.map(|d| Instant::now() + d);
            }
            _ = prune.tick() => {
                let now = state.now();
                state.limiter.prune(now);
            }
            _ = waiting.tick(), if state.settings.waiting_threshold.is_some() => {
                state.report_waiting().await;
            }
        }
    }
    tracing::info!("repair loop stopped");
}

/// The pods the loop watches (summarized as they arrive), and with `detect_started_early` the
/// nodes, as one stream.
fn inputs(client: &kube::Client, settings: &RepairSettings) -> BoxStream<'static, Input> {
    let mut pod_config = watcher::Config::default().fields(NOT_FINISHED);
    if let Some(selector) = &settings.selector {
        pod_config = pod_config.labels(selector);
    }
    // Each pod is summarized as it arrives and dropped.
    let selected = settings.selector.is_some();
    let pods = watcher(Api::<Pod>::all(client.clone()), pod_config)
        .default_backoff()
        .map(move |e| {
            Input::Pod(e.map(|e| summarize_event(e, |p| PodSummary::from_pod(&p, selected))))
        })
        .boxed();
    let nodes: BoxStream<'static, Input> = if settings.detect_started_early {
        watcher(
            Api::<PartialObjectMeta<Node>>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .map(|e| Input::Node(e.map(|e| summarize_event(e, node_summary))))
        .boxed()
    } else {
        futures::stream::pending().boxed()
    };
    futures::stream::select(pods, nodes).boxed()
}

enum Input {
    Pod(Result<watcher::Event<PodSummary>, watcher::Error>),
    Node(Result<watcher::Event<NodeSummary>, watcher::Error>),
}

/// A node's name and agents-ready time (Unix seconds).
struct NodeSummary {
    name: String,
    ready_since: Option<i64>,
}

fn node_summary(n: PartialObjectMeta<Node>) -> NodeSummary {
    NodeSummary {
        ready_since: n.metadata.annotations.as_ref().and_then(node_ready_since),
        name: n.metadata.name.unwrap_or_default(),
    }
}

fn summarize_event<K, S>(e: watcher::Event<K>, f: impl Fn(K) -> S) -> watcher::Event<S> {
    match e {
        watcher::Event::Apply(k) => watcher::Event::Apply(f(k)),
        watcher::Event::Delete(k) => watcher::Event::Delete(f(k)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(k) => watcher::Event::InitApply(f(k)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

struct State {
    client: kube::Client,
    /// [`EvictionClient`].
    evictions: kube::Client,
    leader: Leader,
    settings: RepairSettings,
    metrics: RepairMetrics,
    events: Events,
    limiter: Limiter,
    origin: Instant,
    /// Pod UID → summary, for the pods that can matter.
    pods: HashMap<String, PodSummary>,
    /// Node → UIDs of its pods (started-early rule only).
    by_node: HashMap<String, HashSet<String>>,
    /// Node → agents-ready time, Unix seconds (annotated nodes only).
    ready_since: HashMap<String, i64>,
    /// Pod UID → reason it was counted under, so each detection is counted once.
    detected: HashMap<String, Reason>,
    queue: VecDeque<String>,
    queued: HashSet<String>,
    /// UIDs seen since a pod watch (re)list started.
    pods_relist: Option<HashSet<String>>,
    /// Nodes seen since a node watch (re)list started.
    nodes_relist: Option<HashSet<String>>,
    /// Pods already reported as waiting too long (one Event per pod).
    waiting_reported: HashSet<String>,
}

impl State {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn handle(&mut self, input: Input) {
        match input {
            Input::Pod(Ok(event)) => self.pod_event(event),
            Input::Node(Ok(event)) => self.node_event(event),
            Input::Pod(Err(e)) => meshgate_kube::watch::log("pods (repair loop)", &e),
            Input::Node(Err(e)) => {
                meshgate_kube::watch::log("nodes (repair loop)", &e);
            }
        }
        self.metrics
            .pods
            .set(i64::try_from(self.pods.len()).unwrap_or(i64::MAX));
    }

    fn pod_event(&mut self, event: watcher::Event<PodSummary>) {
        match event {
            watcher::Event::Init => self.pods_relist = Some(HashSet::new()),
            watcher::Event::InitApply(pod) => {
                if let Some(seen) = &mut self.pods_relist {
                    seen.insert(pod.uid.clone());
                }
                self.pod_applied(pod);
            }
            watcher::Event::Apply(pod) => self.pod_applied(pod),
            watcher::Event::Delete(pod) => self.pod_removed(&pod.uid),
            watcher::Event::InitDone => {
                if let Some(seen) = self.pods_relist.take() {
                    let gone: Vec<String> = self
                        .pods
                        .keys()
                        .filter(|uid| !seen.contains(*uid))
                        .cloned()
                        .collect();
                    for uid in gone {
                        self.pod_removed(&uid);
                    }
                }
            }
        }
    }

    fn pod_applied(&mut self, summary: PodSummary) {
        if summary.uid.is_empty() {
            return;
        }
        if !summary.is_relevant(self.settings.detect_started_early) {
            self.pod_removed(&summary.uid);
            return;
        }
        let uid = summary.uid.clone();
        let old = self.pods.get(&uid);
        if old == Some(&summary) {
            return;
        }
        let old_node = old.and_then(|o| o.node.clone());
        if self.settings.detect_started_early && old_node != summary.node {
            self.unindex(&uid, old_node.as_deref());
            if let Some(node) = &summary.node {
                self.by_node
                    .entry(node.clone())
                    .or_default()
                    .insert(uid.clone());
            }
        }
        self.pods.insert(uid.clone(), summary);
        self.enqueue(uid);
    }

    fn pod_removed(&mut self, uid: &str) {
        if let Some(old) = self.pods.remove(uid) {
            self.unindex(uid, old.node.as_deref());
        }
        self.detected.remove(uid);
        self.waiting_reported.remove(uid);
        // A queued UID without a summary is dropped when it comes up.
    }

    fn unindex(&mut self, uid: &str, node: Option<&str>) {
        if let Some(node) = node
            && let Some(uids) = self.by_node.get_mut(node)
        {
            uids.remove(uid);
            if uids.is_empty() {
                self.by_node.remove(node);
            }
        }
    }

    fn node_event(&mut self, event: watcher::Event<NodeSummary>) {
        match event {
            watcher::Event::Init => self.nodes_relist = Some(HashSet::new()),
            watcher::Event::InitApply(n) => {
                if let Some(seen) = &mut self.nodes_relist {
                    seen.insert(n.name.clone());
                }
                self.node_changed(&n.name, n.ready_since);
            }
            watcher::Event::Apply(n) => self.node_changed(&n.name, n.ready_since),
            watcher::Event::Delete(n) => self.node_changed(&n.name, None),
            watcher::Event::InitDone => {
                if let Some(seen) = self.nodes_relist.take() {
                    let gone: Vec<String> = self
                        .ready_since
                        .keys()
                        .filter(|n| !seen.contains(*n))
                        .cloned()
                        .collect();
                    for name in gone {
                        self.node_changed(&name, None);
                    }
                }
            }
        }
    }

    fn node_changed(&mut self, name: &str, since: Option<i64>) {
        if name.is_empty() || self.ready_since.get(name).copied() == since {
            return;
        }
        match since {
            Some(s) => self.ready_since.insert(name.to_owned(), s),
            None => self.ready_since.remove(name),
        };
        let uids: Vec<String> = self
            .by_node
            .get(name)
            .map(|u| u.iter().cloned().collect())
            .unwrap_or_default();
        for uid in uids {
            self.enqueue(uid);
        }
    }

    fn enqueue(&mut self, uid: String) {
        if self.queued.insert(uid.clone()) {
            self.queue.push_back(uid);
        }
    }

    fn enqueue_all(&mut self) {
        let uids: Vec<String> = self.pods.keys().cloned().collect();
        for uid in uids {
            self.enqueue(uid);
        }
    }

    /// Judges the pod at the head of the queue and acts on it. Returns how long to wait before
    /// the next one (rate limit, error backoff).
    /// Counts and logs a pod that needs a repair, once per reason; with repair off, a timed-out
    /// gate is told on the pod.
    async fn note_detection(
        &mut self,
        uid: &str,
        pod: &PodSummary,
        decision: &Decision,
        ready: Option<i64>,
    ) {
        if let Some(reason) = decision.detected()
            && self.detected.get(uid) != Some(&reason)
        {
            self.detected.insert(uid.to_owned(), reason);
            self.metrics
                .detections
                .get_or_create(&ReasonLabels {
                    reason: reason.as_str(),
                })
                .inc();
            tracing::info!(namespace = %pod.namespace, pod = %pod.name, reason = reason.as_str(),
                "repair: pod needs a repair");
            if !self.settings.enabled && reason == Reason::GateTimedOut {
                // Repair is off: say so on the pod, once.
                let note = format!(
                    "{}; repair is off (meshgate controller --repair), so the pod stays until someone recreates it",
                    explain(pod, reason, ready)
                );
                self.event(pod, EventType::Warning, "GateTimedOut", note)
                    .await;
            }
        }
    }

    async fn process_next(&mut self) -> Option<Duration> {
        let uid = self.queue.pop_front()?;
        self.queued.remove(&uid);
        let pod = self.pods.get(&uid)?.clone();
        let ready = if self.settings.detect_started_early {
            pod.node
                .as_ref()
                .and_then(|n| self.ready_since.get(n))
                .copied()
        } else {
            None
        };
        let decision = decide(&pod, ready, self.settings.action);
        self.note_detection(&uid, &pod, &decision, ready).await;
        // Watching for waiting gates only: repair changes nothing.
        if !self.settings.enabled {
            return None;
        }
        let (reason, delete, instead_of_delete) = match decision {
            Decision::Skip(skip) => {
                tracing::debug!(namespace = %pod.namespace, pod = %pod.name, skip = skip.as_str(),
                    "repair: nothing to do");
                return None;
            }
            Decision::Delete(reason) => (reason, true, false),
            Decision::Label {
                reason,
                instead_of_delete,
            } => (reason, false, instead_of_delete),
        };
        // Only the leader acts, Events included.
        if !self.leader.is_leader() {
            return None;
        }
        match self.limiter.admit(&uid, self.now()) {
            Admission::Allowed => {}
            Admission::Window => {
                self.metrics.skip("window");
                tracing::debug!(namespace = %pod.namespace, pod = %pod.name,
                    "repair: acted on within the window; skipped");
                return None;
            }
            Admission::Rate { retry_after } => {
                self.metrics.skip("rate");
                self.queued.insert(uid.clone());
                self.queue.push_front(uid);
                return Some(retry_after);
            }
        }
        if instead_of_delete {
            self.metrics.skip("bare");
        }
        let why = explain(&pod, reason, ready);
        let result = if self.settings.dry_run {
            self.dry_run(&pod, reason, delete, instead_of_delete, &why)
                .await;
            Ok(Done::Yes)
        } else if delete {
            self.evict(&pod, reason, &why).await
        } else {
            self.label(&pod, reason, instead_of_delete, &why)
                .await
                .map(|()| Done::Yes)
        };
        match result {
            Ok(Done::Yes) => None,
            Ok(Done::HeldByBudget) => {
                // Not a failure: the budget allows no disruption now; try again later.
                self.metrics.skip("disruption-budget");
                tracing::debug!(namespace = %pod.namespace, pod = %pod.name,
                    "repair: a PodDisruptionBudget allows no eviction now; retrying");
                self.limiter.forget(&uid);
                self.enqueue(uid);
                Some(BUDGET_RETRY)
            }
            Err(e) => {
                let action = if delete { "delete" } else { "label" };
                self.metrics
                    .errors
                    .get_or_create(&ActionLabels { action })
                    .inc();
                tracing::warn!(namespace = %pod.namespace, pod = %pod.name, action, error = %e,
                    "repair: write failed; will retry");
                self.limiter.forget(&uid);
                self.enqueue(uid);
                Some(ERROR_BACKOFF)
            }
        }
    }

    async fn dry_run(
        &self,
        pod: &PodSummary,
        reason: Reason,
        delete: bool,
        instead_of_delete: bool,
        why: &str,
    ) {
        let (action, what) = if delete {
            ("would-delete", "would delete the pod".to_owned())
        } else if instead_of_delete {
            (
                "would-label",
                format!(
                    "would label the pod {REPAIR_LABEL}={REPAIR_LABEL_VALUE} instead of deleting it: no controller would recreate it"
                ),
            )
        } else {
            (
                "would-label",
                format!("would label the pod {REPAIR_LABEL}={REPAIR_LABEL_VALUE}"),
            )
        };
        self.count(action);
        let note = format!("dry run: {what} ({}: {why})", reason.as_str());
        tracing::info!(namespace = %pod.namespace, pod = %pod.name, reason = reason.as_str(), "repair: {note}");
        self.event(pod, EventType::Normal, EVENT_DRY_RUN, note)
            .await;
    }

    /// Deletes the pod through the Eviction API, so that its PodDisruptionBudgets hold.
    async fn evict(
        &mut self,
        pod: &PodSummary,
        reason: Reason,
        why: &str,
    ) -> Result<Done, kube::Error> {
        let api = Api::<Pod>::namespaced(self.evictions.clone(), &pod.namespace);
        let params = EvictParams {
            delete_options: Some(DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(pod.uid.clone()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            }),
            ..EvictParams::default()
        };
        match api.evict(&pod.name, &params).await {
            Ok(_) => {}
            // Gone already, or a new pod under the same name: nothing to repair.
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => {
                tracing::debug!(namespace = %pod.namespace, pod = %pod.name, error = %e,
                    "repair: pod already gone");
                return Ok(Done::Yes);
            }
            // A PodDisruptionBudget allows no disruption now (or is not computed yet).
            Err(e) if is_status(&e, 429) => return Ok(Done::HeldByBudget),
            Err(e) => return Err(e),
        }
        self.count("delete");
        if let Some(p) = self.pods.get_mut(&pod.uid) {
            p.terminating = true;
        }
        let owner = pod.owner.as_ref().map_or("", |o| o.kind.as_str());
        let note = format!(
            "deleted the pod for its {owner} to recreate it ({}: {why})",
            reason.as_str()
        );
        tracing::info!(namespace = %pod.namespace, pod = %pod.name, reason = reason.as_str(), "repair: {note}");
        self.event(pod, EventType::Normal, EVENT_DELETED, note)
            .await;
        Ok(Done::Yes)
    }

    async fn label(
        &mut self,
        pod: &PodSummary,
        reason: Reason,
        instead_of_delete: bool,
        why: &str,
    ) -> Result<(), kube::Error> {
        let annotation = format!("{}: {why}", reason.as_str());
        // The UID is immutable: a pod re-created under the same name fails the patch.
        let patch = serde_json::json!({"metadata": {
            "uid": pod.uid,
            "labels": {REPAIR_LABEL: REPAIR_LABEL_VALUE},
            "annotations": {REPAIR_REASON_ANNOTATION: annotation},
        }});
        let api = Api::<Pod>::namespaced(self.client.clone(), &pod.namespace);
        match api
            .patch(&pod.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(updated) => {
                let selected = self.settings.selector.is_some();
                self.pods
                    .insert(pod.uid.clone(), PodSummary::from_pod(&updated, selected));
            }
            Err(e) if is_status(&e, 404) || is_status(&e, 409) || is_status(&e, 422) => {
                tracing::debug!(namespace = %pod.namespace, pod = %pod.name, error = %e,
                    "repair: pod gone or replaced; not labelled");
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        self.count("label");
        let note = if instead_of_delete {
            format!(
                "labelled {REPAIR_LABEL}={REPAIR_LABEL_VALUE}, not deleted: no controller would recreate the pod ({annotation})"
            )
        } else {
            format!("labelled {REPAIR_LABEL}={REPAIR_LABEL_VALUE} ({annotation})")
        };
        tracing::info!(namespace = %pod.namespace, pod = %pod.name, reason = reason.as_str(), "repair: {note}");
        self.event(pod, EventType::Warning, EVENT_LABELLED, note)
            .await;
        Ok(())
    }

    fn count(&self, action: &'static str) {
        self.metrics
            .actions
            .get_or_create(&ActionLabels { action })
            .inc();
    }

    /// Pods whose gate has run longer than the threshold: the gauge, and one Warning Event per
    /// pod (`GateWaiting`), written by the leader.
    async fn report_waiting(&mut self) {
        let Some(threshold) = self.settings.waiting_threshold else {
            return;
        };
        let now = crate::now();
        let waiting: Vec<PodSummary> = self
            .pods
            .values()
            .filter(|p| p.gate_waiting_too_long(now, threshold))
            .cloned()
            .collect();
        self.metrics
            .gates_waiting
            .set(i64::try_from(waiting.len()).unwrap_or(i64::MAX));
        if !self.leader.is_leader() {
            return;
        }
        for pod in waiting {
            if self.waiting_reported.contains(&pod.uid) {
                continue;
            }
            let since = pod.gate_running_since.unwrap_or(now);
            let note = format!(
                "the gate ({}) has been waiting {}s for the mesh agent of node {} to set the pod up; `meshgate status pod {}/{}` says why",
                meshgate_api::names::GATE_CONTAINER,
                now - since,
                pod.node.as_deref().unwrap_or("?"),
                pod.namespace,
                pod.name
            );
            self.event(&pod, EventType::Warning, "GateWaiting", note)
                .await;
            self.metrics.gate_waiting_events.inc();
            self.waiting_reported.insert(pod.uid.clone());
        }
    }

    async fn event(&self, pod: &PodSummary, type_: EventType, reason: &str, note: String) {
        if !self.leader.is_leader() {
            return;
        }
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            uid: Some(pod.uid.clone()),
            ..ObjectReference::default()
        };
        if let Err(e) = self
            .events
            .publish(type_, "Repair", reason, &note, &reference)
            .await
        {
            tracing::debug!(error = %e, "repair: event not recorded");
        }
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_under_the_repair_prefix() {
        let m = RepairMetrics::new();
        m.skip("bare");
        m.actions
            .get_or_create(&ActionLabels { action: "delete" })
            .inc();
        let text = m.encode();
        assert!(
            text.contains("meshgate_controller_repair_skipped_total{reason=\"bare\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("meshgate_controller_repair_actions_total{action=\"delete\"} 1"),
            "{text}"
        );
        let mut shared = Registry::default();
        let other = RepairMetrics::register(shared.sub_registry_with_prefix("repair"));
        assert_eq!(other.encode(), "");
    }
}

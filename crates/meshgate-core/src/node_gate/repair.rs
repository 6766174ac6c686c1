//! Repair decisions: which pods started before the node's mesh agent was ready, and what to do
//! about them.
//!
//! # Detection
//! * **Gate timed out** ([`Reason::GateTimedOut`]): the pod's gate init container
//!   (`meshgate-wait`) terminated with exit code 1 (not ready in time), in its current state or
//!   its last state (a restarted gate that failed before).
//! * **Started early** ([`Reason::StartedEarly`], only when [`RepairSettings::detect_started_early`]
//!   is set): a mesh pod (one carrying the gate, or picked by the configured selector) whose start
//!   is earlier than the node's `meshgate.dev/agents-ready-since` annotation. The start is the
//!   pod's `status.startTime`, except when the gate passed (exit 0): the app containers only ran
//!   after the gate finished, so the gate's `finishedAt` counts. Pods on nodes without the
//!   annotation, or without a start time, are not judged by this rule. The annotation has
//!   whole seconds, so a start in the same second is not early.
//!
//! A pod that has finished (`Succeeded`/`Failed`) or is being deleted is left alone; so is a pod
//! that already carries the label `meshgate.dev/repair=needed` when the action is to label.
//!
//! # Action
//! [`RepairAction::Delete`] deletes only pods that a controller recreates: a controlling owner
//! reference to an `apps` ReplicaSet, StatefulSet or DaemonSet or a `batch` Job. Any other pod
//! (a bare pod, or one owned by something else) is never deleted: it is labelled instead
//! ([`Decision::Label`] with `instead_of_delete`). [`RepairAction::Label`] adds the label
//! `meshgate.dev/repair=needed` and the annotation `meshgate.dev/repair-reason`.
//!
//! # Pacing
//! [`Limiter`] admits actions: never the same pod (by UID) twice within the window, and at most
//! `rate_per_second` on average with bursts of `burst` (a token bucket). Its clock is injected:
//! every call takes `now` as the time since an arbitrary origin.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use meshgate_api::names;

/// Label put on pods that need a repair.
pub const REPAIR_LABEL: &str = "meshgate.dev/repair";
/// Value of [`REPAIR_LABEL`].
pub const REPAIR_LABEL_VALUE: &str = "needed";
/// Annotation with the reason a pod was labelled.
pub const REPAIR_REASON_ANNOTATION: &str = "meshgate.dev/repair-reason";
/// Exit code of `meshgate-wait` when the checks did not pass in time.
pub const GATE_EXIT_NOT_READY: i32 = 1;
/// Exit code of `meshgate-wait` when every check passed.
pub const GATE_EXIT_READY: i32 = 0;

/// What to do with a pod that needs a repair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RepairAction {
    /// Delete pods that a controller recreates; label the others.
    Delete,
    /// Label (and annotate) the pod; a person or another tool acts on it.
    #[default]
    Label,
}

impl RepairAction {
    pub fn as_str(self) -> &'static str {
        match self {
            RepairAction::Delete => "delete",
            RepairAction::Label => "label",
        }
    }
}

impl std::str::FromStr for RepairAction {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "delete" => Ok(RepairAction::Delete),
            "label" => Ok(RepairAction::Label),
            other => Err(format!(
                "unknown repair action {other:?}: expected delete or label"
            )),
        }
    }
}

/// Settings of the repair loop.
#[derive(Clone, Debug, PartialEq)]
pub struct RepairSettings {
    /// Run the repair loop at all.
    pub enabled: bool,
    pub action: RepairAction,
    /// Change nothing: log and record Events saying what would be done.
    pub dry_run: bool,
    /// Average actions per second (token bucket refill rate); must be positive.
    pub rate_per_second: f64,
    /// Actions allowed at once (token bucket size); at least 1.
    pub burst: u32,
    /// Never act on the same pod (UID) twice within this window.
    pub window: Duration,
    /// Also judge mesh pods by their start time against the node's agents-ready time.
    pub detect_started_early: bool,
    /// Label selector of the pods to watch (and, for the started-early rule, the mesh pods
    /// besides those carrying the gate). `None`: every pod is watched.
    pub selector: Option<String>,
    /// Report (an Event, a gauge) pods whose gate has run longer than this. The pod watch runs
    /// for it even when repair is off (`enabled: false`); it never changes a pod.
    pub waiting_threshold: Option<Duration>,
}

impl Default for RepairSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            action: RepairAction::Label,
            dry_run: false,
            rate_per_second: 1.0,
            burst: 5,
            window: Duration::from_secs(3600),
            detect_started_early: false,
            selector: None,
            waiting_threshold: None,
        }
    }
}

impl RepairSettings {
    /// Checks the values the loop cannot work with.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.rate_per_second.is_finite() && self.rate_per_second > 0.0) {
            return Err(format!(
                "repair rate must be a positive number of actions per second, not {}",
                self.rate_per_second
            ));
        }
        if self.burst == 0 {
            return Err("repair burst must be at least 1".into());
        }
        if self
            .selector
            .as_deref()
            .is_some_and(|s| s.trim().is_empty())
        {
            return Err("repair selector must not be empty (omit it to watch every pod)".into());
        }
        Ok(())
    }
}

/// Why a pod needs a repair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The gate init container exited 1: the agent was not ready in time.
    GateTimedOut,
    /// The pod started before the node's agents were Ready.
    StartedEarly,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::GateTimedOut => "gate-timed-out",
            Reason::StartedEarly => "started-early",
        }
    }
}

/// Why a pod is left alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Skip {
    /// No rule finds anything wrong.
    Healthy,
    /// The pod has finished (`Succeeded` or `Failed`): nothing runs that could be repaired.
    Finished,
    /// The pod is being deleted already.
    Terminating,
    /// The pod already carries the repair label; labelling again changes nothing.
    AlreadyLabelled(Reason),
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Healthy => "healthy",
            Skip::Finished => "finished",
            Skip::Terminating => "terminating",
            Skip::AlreadyLabelled(_) => "already-labelled",
        }
    }
}

/// The outcome for one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Skip(Skip),
    /// Delete the pod: its controller recreates it.
    Delete(Reason),
    /// Label the pod. `instead_of_delete`: the action is `Delete` but no controller would
    /// recreate the pod, so it is labelled instead.
    Label {
        reason: Reason,
        instead_of_delete: bool,
    },
}

impl Decision {
    /// The rule that found the pod, whether or not anything is done about it.
    pub fn detected(self) -> Option<Reason> {
        match self {
            Decision::Skip(Skip::AlreadyLabelled(r)) => Some(r),
            Decision::Skip(_) => None,
            Decision::Delete(r) | Decision::Label { reason: r, .. } => Some(r),
        }
    }
}

/// The controller that owns a pod (its owner reference with `controller: true`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub api_version: String,
    pub kind: String,
}

impl Owner {
    /// Whether this owner creates the pod again when it is deleted.
    pub fn recreates(&self) -> bool {
        let group = self
            .api_version
            .rsplit_once('/')
            .map_or("", |(group, _)| group);
        matches!(
            (group, self.kind.as_str()),
            ("apps", "ReplicaSet" | "StatefulSet" | "DaemonSet") | ("batch", "Job")
        )
    }
}

/// What the repair rules need of one pod: small, so the controller can keep one per pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodSummary {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// The controlling owner, if any.
    pub owner: Option<Owner>,
    /// Carries the gate init container.
    pub has_gate: bool,
    /// Picked by the configured mesh pod selector.
    pub selected: bool,
    /// Exit code of the gate in `state.terminated`.
    pub gate_exit: Option<i32>,
    /// Exit code of the gate in `lastState.terminated`.
    pub gate_last_exit: Option<i32>,
    /// When the gate finished with exit 0 (`state.terminated.finishedAt`), Unix seconds.
    pub gate_passed_at: Option<i64>,
    /// When the running gate started (`state.running.startedAt`), Unix seconds.
    pub gate_running_since: Option<i64>,
    /// `status.startTime`, Unix seconds.
    pub started: Option<i64>,
    /// Phase `Succeeded` or `Failed`.
    pub finished: bool,
    /// `metadata.deletionTimestamp` is set.
    pub terminating: bool,
    /// Carries `meshgate.dev/repair=needed`.
    pub labelled: bool,
}

impl PodSummary {
    /// Summarizes a pod. `selected`: the pod matches the configured mesh pod selector.
    pub fn from_pod(pod: &Pod, selected: bool) -> Self {
        let meta = &pod.metadata;
        let status = pod.status.as_ref();
        let (has_gate, gate_status) = gate_container(pod);
        let terminated = gate_status
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.terminated.as_ref());
        let last_terminated = gate_status
            .and_then(|c| c.last_state.as_ref())
            .and_then(|s| s.terminated.as_ref());
        let gate_exit = terminated.map(|t| t.exit_code);
        Self {
            uid: meta.uid.clone().unwrap_or_default(),
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            owner: meta.owner_references.as_ref().and_then(|refs| {
                refs.iter()
                    .find(|r| r.controller == Some(true))
                    .map(|r| Owner {
                        api_version: r.api_version.clone(),
                        kind: r.kind.clone(),
                    })
            }),
            has_gate,
            selected,
            gate_exit,
            gate_last_exit: last_terminated.map(|t| t.exit_code),
            gate_running_since: gate_status
                .and_then(|c| c.state.as_ref())
                .and_then(|s| s.running.as_ref())
                .and_then(|r| r.started_at.as_ref())
                .map(|t| t.0.as_second()),
            gate_passed_at: terminated
                .filter(|t| t.exit_code == GATE_EXIT_READY)
                .and_then(|t| t.finished_at.as_ref())
                .map(|t| t.0.as_second()),
            started: status
                .and_then(|s| s.start_time.as_ref())
                .map(|t| t.0.as_second()),
            finished: status
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|p| p == "Succeeded" || p == "Failed"),
            terminating: meta.deletion_timestamp.is_some(),
            labelled: meta
                .labels
                .as_ref()
                .and_then(|l| l.get(REPAIR_LABEL))
                .is_some_and(|v| v == REPAIR_LABEL_VALUE),
        }
    }

    /// Whether the pod is a mesh pod for the started-early rule.
    fn is_mesh_pod(&self) -> bool {
        self.has_gate || self.selected
    }

    /// When the pod's app containers could first have run: the gate's pass when it passed,
    /// else the pod's start.
    fn effective_start(&self) -> Option<i64> {
        self.gate_passed_at.or(self.started)
    }

    /// Whether the pod's gate has been running for `threshold` or longer at `now` (a live pod,
    /// not terminating).
    pub fn gate_waiting_too_long(&self, now: i64, threshold: Duration) -> bool {
        !self.finished
            && !self.terminating
            && self.gate_running_since.is_some_and(|since| {
                now.saturating_sub(since) >= i64::try_from(threshold.as_secs()).unwrap_or(i64::MAX)
            })
    }

    /// Whether the gate timed out, now or in its last run.
    pub fn gate_timed_out(&self) -> bool {
        self.gate_exit == Some(GATE_EXIT_NOT_READY)
            || self.gate_last_exit == Some(GATE_EXIT_NOT_READY)
    }

    /// Whether the pod could be relevant to any rule; the controller keeps only these.
    pub fn is_relevant(&self, detect_started_early: bool) -> bool {
        self.has_gate || (detect_started_early && self.selected)
    }
}

/// Parses the node annotation `meshgate.dev/agents-ready-since` (RFC 3339) to Unix seconds.
fn parse_ready_since(value: &str) -> Option<i64> {
    value
        .trim()
        .parse::<k8s_openapi::jiff::Timestamp>()
        .ok()
        .map(|t| t.as_second())
}

/// The node's agents-ready time from its annotations, Unix seconds.
pub fn node_ready_since(annotations: &BTreeMap<String, String>) -> Option<i64> {
    annotations
        .get(names::NODE_READY_SINCE)
        .and_then(|v| parse_ready_since(v))
}

/// Which rule, if any, finds the pod. `node_ready_since`: the agents-ready time of the pod's
/// node (`None` when the node has no annotation, or the rule is off).
pub fn detect(pod: &PodSummary, node_ready_since: Option<i64>) -> Option<Reason> {
    if pod.gate_timed_out() {
        return Some(Reason::GateTimedOut);
    }
    let ready = node_ready_since?;
    let start = pod.effective_start()?;
    (pod.is_mesh_pod() && start < ready).then_some(Reason::StartedEarly)
}

/// Decides what to do with one pod.
///
/// `node_ready_since` is the agents-ready time of the pod's node, or `None` when the node has
/// none or the started-early rule is off.
pub fn decide(pod: &PodSummary, node_ready_since: Option<i64>, action: RepairAction) -> Decision {
    if pod.finished {
        return Decision::Skip(Skip::Finished);
    }
    if pod.terminating {
        return Decision::Skip(Skip::Terminating);
    }
    let Some(reason) = detect(pod, node_ready_since) else {
        return Decision::Skip(Skip::Healthy);
    };
    let recreated = pod.owner.as_ref().is_some_and(Owner::recreates);
    match action {
        RepairAction::Delete if recreated => Decision::Delete(reason),
        _ if pod.labelled => Decision::Skip(Skip::AlreadyLabelled(reason)),
        RepairAction::Delete => Decision::Label {
            reason,
            instead_of_delete: true,
        },
        RepairAction::Label => Decision::Label {
            reason,
            instead_of_delete: false,
        },
    }
}

fn rfc3339(secs: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(secs)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| secs.to_string())
}

/// A one-line explanation of why the pod needs a repair (for the annotation and Events).
pub fn explain(pod: &PodSummary, reason: Reason, node_ready_since: Option<i64>) -> String {
    match reason {
        Reason::GateTimedOut => format!(
            "init container {} exited {GATE_EXIT_NOT_READY}: the mesh agent was not ready in time",
            names::GATE_CONTAINER
        ),
        Reason::StartedEarly => {
            let node = pod.node.as_deref().unwrap_or("?");
            let start = pod.effective_start().map_or_else(|| "?".into(), rfc3339);
            let ready = node_ready_since.map_or_else(|| "?".into(), rfc3339);
            format!(
                "pod started at {start}, before the mesh agents of node {node} were ready at {ready}"
            )
        }
    }
}

/// Whether an action may go ahead now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Admission {
    /// Go ahead; the pod is remembered for the window and a token is spent.
    Allowed,
    /// The pod was acted on less than a window ago: never again within the window.
    Window,
    /// No token left: try again after this long.
    Rate { retry_after: Duration },
}

/// The rate limit (token bucket) and the once-per-window rule, on an injected clock: every
/// call takes `now`, the time since an arbitrary fixed origin, which must not go backwards.
#[derive(Clone, Debug)]
pub struct Limiter {
    rate: f64,
    burst: f64,
    tokens: f64,
    refilled_at: Duration,
    window: Duration,
    acted: HashMap<String, Duration>,
}

impl Limiter {
    /// A full bucket. A rate that is not a positive number is taken as one per hour, a burst of
    /// zero as one ([`RepairSettings::validate`] rejects both).
    pub fn new(rate_per_second: f64, burst: u32, window: Duration, now: Duration) -> Self {
        let rate = if rate_per_second.is_finite() && rate_per_second > 0.0 {
            rate_per_second
        } else {
            1.0 / 3600.0
        };
        let burst = f64::from(burst.max(1));
        Self {
            rate,
            burst,
            tokens: burst,
            refilled_at: now,
            window,
            acted: HashMap::new(),
        }
    }

    fn refill(&mut self, now: Duration) {
        let elapsed = now.saturating_sub(self.refilled_at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.refilled_at = self.refilled_at.max(now);
    }

    /// Whether acting on pod `uid` now is allowed; when it is, the action is counted.
    pub fn admit(&mut self, uid: &str, now: Duration) -> Admission {
        if self.within_window(uid, now) {
            return Admission::Window;
        }
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            self.acted.insert(uid.to_owned(), now);
            return Admission::Allowed;
        }
        let missing = 1.0 - self.tokens;
        let secs = missing / self.rate;
        // At least a millisecond, so a caller never spins.
        let retry_after = Duration::try_from_secs_f64(secs)
            .unwrap_or(Duration::from_secs(3600))
            .max(Duration::from_millis(1));
        Admission::Rate { retry_after }
    }

    /// Whether pod `uid` was acted on less than a window before `now`.
    fn within_window(&self, uid: &str, now: Duration) -> bool {
        self.acted
            .get(uid)
            .is_some_and(|at| now.saturating_sub(*at) < self.window)
    }

    /// Forgets an action that did not happen (the write failed): the pod may be acted on again
    /// and the token is given back.
    pub fn forget(&mut self, uid: &str) {
        if self.acted.remove(uid).is_some() {
            self.tokens = (self.tokens + 1.0).min(self.burst);
        }
    }

    /// Drops the pods whose window has passed; returns how many are still remembered.
    pub fn prune(&mut self, now: Duration) -> usize {
        let window = self.window;
        self.acted.retain(|_, at| now.saturating_sub(*at) < window);
        self.acted.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const READY: i64 = 1_000_000;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    /// A pod with the gate, bound to node `n1`, with `status`.
    fn gated(owner: Option<(&str, &str)>, status: serde_json::Value) -> Pod {
        let mut p = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "namespace": "apps", "uid": "u-1"},
            "spec": {
                "nodeName": "n1",
                "initContainers": [{"name": "meshgate-wait", "image": "meshgate-wait:1"}],
                "containers": [{"name": "app", "image": "app:1"}],
            },
            "status": status,
        });
        if let Some((api_version, kind)) = owner {
            p["metadata"]["ownerReferences"] = json!([
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "other", "uid": "c"},
                {"apiVersion": api_version, "kind": kind, "name": "owner", "uid": "o", "controller": true},
            ]);
        }
        pod(p)
    }

    fn gate_status(state: serde_json::Value, last: serde_json::Value) -> serde_json::Value {
        json!({"initContainerStatuses": [
            {"name": "other", "ready": false, "restartCount": 0, "image": "x", "imageID": "",
             "state": {"terminated": {"exitCode": 1}}},
            {"name": "meshgate-wait", "ready": false, "restartCount": 1, "image": "meshgate-wait:1",
             "imageID": "", "state": state, "lastState": last},
        ]})
    }

    fn timed_out() -> serde_json::Value {
        gate_status(
            json!({"terminated": {"exitCode": 1, "finishedAt": "2026-01-01T00:00:00Z"}}),
            json!({}),
        )
    }

    fn ts(secs: i64) -> String {
        rfc3339(secs)
    }

    #[test]
    fn summary_of_a_pod() {
        let s = PodSummary::from_pod(
            &gated(
                Some(("apps/v1", "ReplicaSet")),
                gate_status(
                    json!({"terminated": {"exitCode": 0, "finishedAt": ts(READY + 5)}}),
                    json!({"terminated": {"exitCode": 1}}),
                ),
            ),
            false,
        );
        assert_eq!(s.uid, "u-1");
        assert_eq!((s.namespace.as_str(), s.name.as_str()), ("apps", "web"));
        assert_eq!(s.node.as_deref(), Some("n1"));
        assert_eq!(
            s.owner,
            Some(Owner {
                api_version: "apps/v1".into(),
                kind: "ReplicaSet".into()
            }),
            "the controlling owner, not the first"
        );
        assert!(s.has_gate && !s.selected && s.is_mesh_pod());
        assert_eq!((s.gate_exit, s.gate_last_exit), (Some(0), Some(1)));
        assert_eq!(s.gate_passed_at, Some(READY + 5));
        assert!(!s.finished && !s.terminating && !s.labelled);

        let bare = PodSummary::from_pod(
            &pod(json!({
                "metadata": {"name": "b", "uid": "u-2", "labels": {"meshgate.dev/repair": "needed"},
                             "deletionTimestamp": "2026-01-01T00:00:00Z"},
                "spec": {"containers": [{"name": "app"}]},
                "status": {"phase": "Failed", "startTime": ts(READY)},
            })),
            true,
        );
        assert_eq!(bare.owner, None);
        assert!(!bare.has_gate && bare.selected && bare.is_mesh_pod());
        assert_eq!((bare.gate_exit, bare.gate_last_exit), (None, None));
        assert_eq!(bare.started, Some(READY));
        assert!(bare.finished && bare.terminating && bare.labelled);
        assert!(
            !bare.is_relevant(false),
            "no gate: only the started-early rule can find it"
        );
        assert!(bare.is_relevant(true));
    }

    #[test]
    fn gate_exit_1_is_detected_in_state_and_last_state() {
        let now = PodSummary::from_pod(&gated(None, timed_out()), false);
        assert_eq!(detect(&now, None), Some(Reason::GateTimedOut));
        let before = PodSummary::from_pod(
            &gated(
                None,
                gate_status(
                    json!({"running": {}}),
                    json!({"terminated": {"exitCode": 1}}),
                ),
            ),
            false,
        );
        assert_eq!(detect(&before, None), Some(Reason::GateTimedOut));
        // Ready (0), bad usage (2), still running: not a timeout.
        for state in [
            json!({"terminated": {"exitCode": 0}}),
            json!({"terminated": {"exitCode": 2}}),
            json!({"running": {}}),
        ] {
            let s = PodSummary::from_pod(&gated(None, gate_status(state, json!({}))), false);
            assert_eq!(detect(&s, None), None, "{s:?}");
        }
        // Another init container exiting 1 is not the gate.
        let s = PodSummary::from_pod(&gated(None, gate_status(json!({}), json!({}))), false);
        assert_eq!(detect(&s, None), None);
    }

    #[test]
    fn started_early_compares_start_with_the_node_annotation() {
        let started = |start: i64| {
            PodSummary::from_pod(
                &gated(None, json!({"startTime": ts(start), "phase": "Running"})),
                false,
            )
        };
        assert_eq!(
            detect(&started(READY - 60), Some(READY)),
            Some(Reason::StartedEarly)
        );
        assert_eq!(detect(&started(READY + 60), Some(READY)), None);
        assert_eq!(
            detect(&started(READY), Some(READY)),
            None,
            "same second: not early"
        );
        // No annotation on the node: not judged.
        assert_eq!(detect(&started(READY - 60), None), None);
        // No start time: not judged.
        let mut unstarted = started(0);
        unstarted.started = None;
        assert_eq!(detect(&unstarted, Some(READY)), None);
    }

    #[test]
    fn started_early_applies_to_mesh_pods_only() {
        let plain = |selected: bool| {
            PodSummary::from_pod(
                &pod(json!({
                    "metadata": {"name": "p", "uid": "u"},
                    "spec": {"nodeName": "n1", "containers": [{"name": "app"}]},
                    "status": {"startTime": ts(READY - 60)},
                })),
                selected,
            )
        };
        assert_eq!(
            detect(&plain(false), Some(READY)),
            None,
            "no gate, not selected"
        );
        assert_eq!(
            detect(&plain(true), Some(READY)),
            Some(Reason::StartedEarly),
            "picked by the selector"
        );
    }

    #[test]
    fn a_gate_that_passed_after_the_agents_were_ready_vouches_for_the_pod() {
        let passed = |at: i64| {
            let mut status = gate_status(
                json!({"terminated": {"exitCode": 0, "finishedAt": ts(at)}}),
                json!({}),
            );
            status["startTime"] = json!(ts(READY - 60));
            PodSummary::from_pod(&gated(None, status), false)
        };
        assert_eq!(detect(&passed(READY + 1), Some(READY)), None);
        // A gate that passed before the agents were Ready did not hold the pod long enough.
        assert_eq!(
            detect(&passed(READY - 1), Some(READY)),
            Some(Reason::StartedEarly)
        );
    }

    #[test]
    fn timeout_wins_over_started_early() {
        let mut status = timed_out();
        status["startTime"] = json!(ts(READY - 60));
        let s = PodSummary::from_pod(&gated(None, status), false);
        assert_eq!(detect(&s, Some(READY)), Some(Reason::GateTimedOut));
    }

    #[test]
    fn only_pods_a_controller_recreates_are_deleted() {
        for (api_version, kind) in [
            ("apps/v1", "ReplicaSet"),
            ("apps/v1", "StatefulSet"),
            ("apps/v1", "DaemonSet"),
            ("batch/v1", "Job"),
        ] {
            let s = PodSummary::from_pod(&gated(Some((api_version, kind)), timed_out()), false);
            assert_eq!(
                decide(&s, None, RepairAction::Delete),
                Decision::Delete(Reason::GateTimedOut),
                "{kind}"
            );
        }
        let relabel = Decision::Label {
            reason: Reason::GateTimedOut,
            instead_of_delete: true,
        };
        // Bare, another kind, a look-alike kind of another group: labelled, never deleted.
        for owner in [
            None,
            Some(("v1", "ReplicationController")),
            Some(("example.com/v1", "ReplicaSet")),
            Some(("batch/v1", "CronJob")),
        ] {
            let s = PodSummary::from_pod(&gated(owner, timed_out()), false);
            assert_eq!(decide(&s, None, RepairAction::Delete), relabel, "{owner:?}");
        }
        // A non-controlling owner reference does not count.
        let mut p = gated(None, timed_out());
        p.metadata.owner_references = Some(vec![
            serde_json::from_value(json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": "rs", "uid": "o", "controller": false}))
            .unwrap(),
        ]);
        let s = PodSummary::from_pod(&p, false);
        assert_eq!(decide(&s, None, RepairAction::Delete), relabel);
    }

    #[test]
    fn label_action_labels_every_pod_once() {
        let owned =
            PodSummary::from_pod(&gated(Some(("apps/v1", "ReplicaSet")), timed_out()), false);
        assert_eq!(
            decide(&owned, None, RepairAction::Label),
            Decision::Label {
                reason: Reason::GateTimedOut,
                instead_of_delete: false
            }
        );
        let mut labelled = owned.clone();
        labelled.labelled = true;
        let d = decide(&labelled, None, RepairAction::Label);
        assert_eq!(
            d,
            Decision::Skip(Skip::AlreadyLabelled(Reason::GateTimedOut))
        );
        assert_eq!(
            d.detected(),
            Some(Reason::GateTimedOut),
            "still a detection"
        );
        // A labelled bare pod under Delete is not labelled again; a labelled owned pod is
        // deleted.
        let mut bare = PodSummary::from_pod(&gated(None, timed_out()), false);
        bare.labelled = true;
        assert_eq!(
            decide(&bare, None, RepairAction::Delete),
            Decision::Skip(Skip::AlreadyLabelled(Reason::GateTimedOut))
        );
        assert_eq!(
            decide(&labelled, None, RepairAction::Delete),
            Decision::Delete(Reason::GateTimedOut)
        );
    }

    #[test]
    fn finished_terminating_and_healthy_pods_are_skipped() {
        let mut s =
            PodSummary::from_pod(&gated(Some(("apps/v1", "ReplicaSet")), timed_out()), false);
        s.finished = true;
        assert_eq!(
            decide(&s, None, RepairAction::Delete),
            Decision::Skip(Skip::Finished)
        );
        s.finished = false;
        s.terminating = true;
        assert_eq!(
            decide(&s, None, RepairAction::Delete),
            Decision::Skip(Skip::Terminating)
        );
        let healthy = PodSummary::from_pod(&gated(None, json!({})), false);
        let d = decide(&healthy, Some(READY), RepairAction::Delete);
        assert_eq!(d, Decision::Skip(Skip::Healthy));
        assert_eq!(d.detected(), None);
    }

    #[test]
    fn annotation_parsing_and_explanations() {
        assert_eq!(
            parse_ready_since("2026-01-01T00:00:00Z"),
            Some(1_767_225_600)
        );
        assert_eq!(
            parse_ready_since(" 2026-01-01T01:00:00+01:00 "),
            Some(1_767_225_600)
        );
        assert_eq!(parse_ready_since("yesterday"), None);
        let mut annotations = BTreeMap::new();
        assert_eq!(node_ready_since(&annotations), None);
        annotations.insert(
            names::NODE_READY_SINCE.to_owned(),
            "2026-01-01T00:00:00Z".to_owned(),
        );
        assert_eq!(node_ready_since(&annotations), Some(1_767_225_600));

        let s = PodSummary::from_pod(
            &gated(None, json!({"startTime": "2025-12-31T23:59:00Z"})),
            false,
        );
        assert_eq!(
            explain(&s, Reason::StartedEarly, Some(1_767_225_600)),
            "pod started at 2025-12-31T23:59:00Z, before the mesh agents of node n1 were ready \
             at 2026-01-01T00:00:00Z"
        );
        assert!(explain(&s, Reason::GateTimedOut, None).contains("meshgate-wait exited 1"));
    }

    #[test]
    fn settings_validation_and_action_parsing() {
        assert!(RepairSettings::default().validate().is_ok());
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let s = RepairSettings {
                rate_per_second: rate,
                ..RepairSettings::default()
            };
            assert!(s.validate().is_err(), "{rate}");
        }
        let s = RepairSettings {
            burst: 0,
            ..RepairSettings::default()
        };
        assert!(s.validate().is_err());
        let s = RepairSettings {
            selector: Some(" ".into()),
            ..RepairSettings::default()
        };
        assert!(s.validate().is_err());
        assert_eq!("Delete".parse::<RepairAction>(), Ok(RepairAction::Delete));
        assert_eq!("label".parse::<RepairAction>(), Ok(RepairAction::Label));
        assert!("evict".parse::<RepairAction>().is_err());
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn rate_limit_allows_a_burst_then_the_rate() {
        let mut l = Limiter::new(2.0, 3, Duration::from_secs(3600), secs(100.0));
        for uid in ["a", "b", "c"] {
            assert_eq!(
                l.admit(uid, secs(100.0)),
                Admission::Allowed,
                "{uid}: burst"
            );
        }
        match l.admit("d", secs(100.0)) {
            Admission::Rate { retry_after } => {
                assert_eq!(retry_after, secs(0.5), "one token at 2/s takes 0.5s");
            }
            other => panic!("expected Rate, got {other:?}"),
        }
        // Half a token after 0.25 s: still limited, for the remaining 0.25 s.
        assert_eq!(
            l.admit("d", secs(100.25)),
            Admission::Rate {
                retry_after: secs(0.25)
            }
        );
        assert_eq!(l.admit("d", secs(100.5)), Admission::Allowed);
        assert!(matches!(l.admit("e", secs(100.5)), Admission::Rate { .. }));
        // A long pause refills up to the burst, not beyond.
        let mut allowed = 0;
        for i in 0..10 {
            if l.admit(&format!("late-{i}"), secs(1000.0)) == Admission::Allowed {
                allowed += 1;
            }
        }
        assert_eq!(allowed, 3);
    }

    #[test]
    fn limited_attempts_do_not_spend_tokens() {
        let mut l = Limiter::new(1.0, 1, Duration::from_secs(60), secs(0.0));
        assert_eq!(l.admit("a", secs(0.0)), Admission::Allowed);
        for _ in 0..5 {
            assert!(matches!(l.admit("b", secs(0.5)), Admission::Rate { .. }));
        }
        assert_eq!(l.admit("b", secs(1.0)), Admission::Allowed);
    }

    #[test]
    fn a_pod_is_acted_on_once_per_window() {
        let window = Duration::from_secs(60);
        let mut l = Limiter::new(100.0, 100, window, secs(0.0));
        assert_eq!(l.admit("a", secs(0.0)), Admission::Allowed);
        assert_eq!(l.admit("a", secs(1.0)), Admission::Window);
        assert_eq!(l.admit("a", secs(59.9)), Admission::Window);
        assert!(l.within_window("a", secs(59.9)));
        assert_eq!(l.admit("b", secs(59.9)), Admission::Allowed, "another pod");
        // The window skip spends no token.
        let mut tight = Limiter::new(1.0, 1, window, secs(0.0));
        assert_eq!(tight.admit("a", secs(0.0)), Admission::Allowed);
        assert_eq!(tight.admit("a", secs(1.0)), Admission::Window);
        assert_eq!(tight.admit("b", secs(1.0)), Admission::Allowed);
        // After the window the pod may be acted on again.
        assert_eq!(l.admit("a", secs(60.0)), Admission::Allowed);
        assert_eq!(l.admit("a", secs(61.0)), Admission::Window);
    }

    #[test]
    fn forget_and_prune() {
        let mut l = Limiter::new(1.0, 1, Duration::from_secs(10), secs(0.0));
        assert_eq!(l.admit("a", secs(0.0)), Admission::Allowed);
        // The write failed: the pod may be tried again at once, with the token given back.
        l.forget("a");
        assert_eq!(l.admit("a", secs(0.0)), Admission::Allowed);
        assert_eq!(l.prune(secs(5.0)), 1);
        assert_eq!(l.prune(secs(10.0)), 0);
        assert_eq!(
            l.admit("a", secs(10.0)),
            Admission::Allowed,
            "pruned: window over"
        );
    }

    #[test]
    fn invalid_rates_are_made_safe() {
        let mut l = Limiter::new(f64::NAN, 0, Duration::from_secs(10), secs(0.0));
        assert_eq!(
            l.admit("a", secs(0.0)),
            Admission::Allowed,
            "burst of at least one"
        );
        match l.admit("b", secs(0.0)) {
            Admission::Rate { retry_after } => assert_eq!(retry_after, secs(3600.0)),
            other => panic!("expected Rate, got {other:?}"),
        }
    }
}

/// Where a pod's gate is (`meshgate status pod`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GateProgress {
    /// The pod has no gate container.
    NotGated,
    /// The gate has not started yet (`reason`: the kubelet's, e.g. `PodInitializing`).
    NotStarted { reason: Option<String> },
    /// The gate runs (since `since`, Unix seconds); `restarts` times restarted, the last run
    /// timed out when `last_timed_out`.
    Waiting {
        since: Option<i64>,
        restarts: i32,
        last_timed_out: bool,
    },
    /// The gate passed (at `at`).
    Passed { at: Option<i64> },
    /// The gate timed out (exit 1) and waits for its restart.
    TimedOut { restarts: i32 },
    /// The gate ended with another exit code (a usage or internal error).
    Failed { exit: i32 },
}

/// Whether the pod carries meshgate's gate init container, and that container's status.
fn gate_container(pod: &Pod) -> (bool, Option<&ContainerStatus>) {
    let gate = names::GATE_CONTAINER;
    let has_gate = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.name == gate));
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == gate));
    (has_gate, status)
}

/// Reads the gate container's status of a pod.
pub fn gate_progress(pod: &Pod) -> GateProgress {
    let (has_gate, status) = gate_container(pod);
    if !has_gate {
        return GateProgress::NotGated;
    }
    let Some(status) = status else {
        return GateProgress::NotStarted { reason: None };
    };
    let state = status.state.as_ref();
    let last_timed_out = status
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .is_some_and(|t| t.exit_code == GATE_EXIT_NOT_READY);
    if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
        return match t.exit_code {
            GATE_EXIT_READY => GateProgress::Passed {
                at: t.finished_at.as_ref().map(|t| t.0.as_second()),
            },
            GATE_EXIT_NOT_READY => GateProgress::TimedOut {
                restarts: status.restart_count,
            },
            exit => GateProgress::Failed { exit },
        };
    }
    if let Some(r) = state.and_then(|s| s.running.as_ref()) {
        return GateProgress::Waiting {
            since: r.started_at.as_ref().map(|t| t.0.as_second()),
            restarts: status.restart_count,
            last_timed_out,
        };
    }
    let reason = state
        .and_then(|s| s.waiting.as_ref())
        .and_then(|w| w.reason.clone());
    if last_timed_out && reason.as_deref() == Some("CrashLoopBackOff") {
        return GateProgress::TimedOut {
            restarts: status.restart_count,
        };
    }
    GateProgress::NotStarted { reason }
}

#[cfg(test)]
mod progress_tests {
    use super::*;
    use serde_json::json;

    fn pod(statuses: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"initContainers": [{"name": "meshgate-wait", "image": "g"}],
                     "containers": [{"name": "app", "image": "a"}]},
            "status": {"initContainerStatuses": statuses},
        }))
        .expect("pod")
    }

    #[test]
    fn the_gate_container_says_where_the_pod_is() {
        let status = |state: serde_json::Value, last: serde_json::Value, restarts: i32| {
            json!([{"name": "meshgate-wait", "ready": false, "restartCount": restarts, "image": "g",
                    "imageID": "", "state": state, "lastState": last}])
        };
        assert_eq!(
            gate_progress(&pod(status(
                json!({"running": {"startedAt": "2026-11-30T10:00:00Z"}}),
                json!({"terminated": {"exitCode": 1}}),
                1
            ))),
            GateProgress::Waiting {
                since: Some(1_796_032_800),
                restarts: 1,
                last_timed_out: true
            }
        );
        assert_eq!(
            gate_progress(&pod(status(
                json!({"terminated": {"exitCode": 0, "finishedAt": "2026-11-30T10:00:00Z"}}),
                json!({}),
                0
            ))),
            GateProgress::Passed {
                at: Some(1_796_032_800)
            }
        );
        assert_eq!(
            gate_progress(&pod(status(
                json!({"waiting": {"reason": "CrashLoopBackOff"}}),
                json!({"terminated": {"exitCode": 1}}),
                3
            ))),
            GateProgress::TimedOut { restarts: 3 }
        );
        assert_eq!(
            gate_progress(&pod(status(
                json!({"terminated": {"exitCode": 2}}),
                json!({}),
                0
            ))),
            GateProgress::Failed { exit: 2 }
        );
        assert_eq!(
            gate_progress(&pod(json!([]))),
            GateProgress::NotStarted { reason: None }
        );
        let mut plain = pod(json!([]));
        plain.spec.as_mut().expect("spec").init_containers = None;
        assert_eq!(gate_progress(&plain), GateProgress::NotGated);
    }
}

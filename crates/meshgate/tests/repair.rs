//! The repair loop end to end on the real API server: pods whose gate timed out, pods that
//! started before their node's agents were ready, the bare-pod rule, the rate limit, the window,
//! dry run and leadership. No kubelet and no controller manager run: the tests set pod and node
//! status themselves, and a ReplicaSet is only an object for pods to be owned by.
//!
//! Each test has its own namespace and its own repair loop, restricted to a label selector of
//! its own, so the tests do not see each other's pods.
//!
//! Run: `cargo test -p meshgate --test repair`.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use meshgate_controller::leader;
use meshgate_controller::repair::{
    ActionLabels, ReasonLabels, RepairAction, RepairMetrics, RepairSettings,
};
use serde_json::{Value, json};

const TEST_LABEL: &str = "meshgate-repair-test";
const REPAIR_LABEL: &str = "meshgate.dev/repair";
const REASON_ANNOTATION: &str = "meshgate.dev/repair-reason";
const TIMEOUT: Duration = Duration::from_secs(30);

/// A repair loop running on the background runtime.
struct Repair {
    metrics: RepairMetrics,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Repair {
    fn action(&self, action: &'static str) -> u64 {
        self.metrics
            .actions
            .get_or_create(&ActionLabels { action })
            .get()
    }
    fn skipped(&self, reason: &'static str) -> u64 {
        self.metrics
            .skipped
            .get_or_create(&ReasonLabels { reason })
            .get()
    }
    fn errors(&self, action: &'static str) -> u64 {
        self.metrics
            .errors
            .get_or_create(&ActionLabels { action })
            .get()
    }
    fn detected(&self, reason: &'static str) -> u64 {
        self.metrics
            .detections
            .get_or_create(&ReasonLabels { reason })
            .get()
    }
}

impl Drop for Repair {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Settings for the pods of `ns` only.
fn settings(ns: &str, action: RepairAction) -> RepairSettings {
    RepairSettings {
        enabled: true,
        action,
        dry_run: false,
        rate_per_second: 100.0,
        burst: 100,
        window: Duration::from_secs(3600),
        detect_started_early: false,
        selector: Some(format!("{TEST_LABEL}={ns}")),
        waiting_threshold: None,
    }
}

async fn start(
    cp: &meshgate_testenv::ControlPlane,
    settings: RepairSettings,
    leader: leader::Leader,
) -> Repair {
    let metrics = RepairMetrics::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let m = metrics.clone();
    let kubeconfig = cp.kubeconfig_path.clone();
    background().spawn(async move {
        let client = client_from(&kubeconfig).await;
        // As `meshgate controller` builds it: no retry of a 429 in the client.
        let kc = kube::config::Kubeconfig::read_from(&kubeconfig).expect("kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("config");
        let mut config = config;
        config.default_retry = false;
        let evictions = kube::Client::try_from(config).expect("client");
        meshgate_controller::repair::run(
            client,
            meshgate_controller::repair::EvictionClient(evictions),
            leader,
            settings,
            m,
            async move {
                let _ = stopped.await;
            },
        )
        .await;
    });
    Repair {
        metrics,
        stop: Some(stop),
    }
}

async fn setup(
    prefix: &str,
) -> (
    kube::Client,
    std::sync::Arc<meshgate_testenv::ControlPlane>,
    String,
) {
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    let ns = cp.namespace(prefix, &[]).await.expect("namespace");
    (client, cp, ns)
}

fn ts(secs: i64) -> String {
    Timestamp::from_second(secs).expect("timestamp").to_string()
}

fn now() -> i64 {
    Timestamp::now().as_second()
}

/// A pod of the test (label `TEST_LABEL=ns`), with the gate init container when `gate`, owned
/// by `owner` as its controller, bound to `node`.
async fn create_pod(
    client: &kube::Client,
    ns: &str,
    name: &str,
    gate: bool,
    owner: Option<&ReplicaSet>,
    node: Option<&str>,
) -> Pod {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {TEST_LABEL: ns, "app": "web"}},
        "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    });
    if gate {
        pod["spec"]["initContainers"] = json!([
            {"name": "meshgate-wait", "image": "registry.invalid/meshgate-wait:1"}
        ]);
    }
    if let Some(rs) = owner {
        pod["metadata"]["ownerReferences"] = json!([{
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "name": rs.metadata.name, "uid": rs.metadata.uid,
            "controller": true, "blockOwnerDeletion": true,
        }]);
    }
    if let Some(node) = node {
        pod["spec"]["nodeName"] = json!(node);
    }
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(pod).expect("pod"),
        )
        .await
        .expect("pod created")
}

/// A ReplicaSet object for pods to be owned by (no controller manager runs: it creates nothing).
async fn create_replicaset(client: &kube::Client, ns: &str) -> ReplicaSet {
    let rs = json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
            },
        },
    });
    Api::<ReplicaSet>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(rs).expect("rs"),
        )
        .await
        .expect("replicaset created")
}

/// A gate status: `state` and `last_state` of the `meshgate-wait` init container.
fn gate_status(state: Value, last_state: Value) -> Value {
    json!({"initContainerStatuses": [{
        "name": "meshgate-wait", "ready": false, "restartCount": 1,
        "image": "registry.invalid/meshgate-wait:1", "imageID": "",
        "state": state, "lastState": last_state,
    }]})
}

fn terminated(exit_code: i32, finished: i64) -> Value {
    json!({"terminated": {"exitCode": exit_code, "reason": if exit_code == 0 { "Completed" } else { "Error" },
                          "startedAt": ts(finished - 30), "finishedAt": ts(finished)}})
}

/// Sets the pod's status as kubelet would (merge patch of the `status` subresource).
async fn set_status(client: &kube::Client, ns: &str, name: &str, mut status: Value) {
    if status.get("phase").is_none() {
        status["phase"] = json!("Pending");
    }
    Api::<Pod>::namespaced(client.clone(), ns)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .expect("pod status");
}

/// The gate exited 1 (timed out) just now.
async fn gate_timed_out(client: &kube::Client, ns: &str, name: &str) {
    set_status(
        client,
        ns,
        name,
        gate_status(terminated(1, now()), json!({})),
    )
    .await;
}

async fn get_pod(client: &kube::Client, ns: &str, name: &str) -> Option<Pod> {
    Api::<Pod>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .expect("pod get")
}

fn repair_label(pod: &Pod) -> Option<String> {
    pod.metadata.labels.as_ref()?.get(REPAIR_LABEL).cloned()
}

fn reason_annotation(pod: &Pod) -> String {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(REASON_ANNOTATION).cloned())
        .unwrap_or_default()
}

async fn is_labelled(client: &kube::Client, ns: &str, name: &str) -> bool {
    get_pod(client, ns, name)
        .await
        .is_some_and(|p| repair_label(&p).as_deref() == Some("needed"))
}

/// Names of the pods of `ns` that carry the repair label, from one list.
async fn labelled(client: &kube::Client, ns: &str) -> Vec<String> {
    Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("{REPAIR_LABEL}=needed")))
        .await
        .expect("pod list")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect()
}

/// (reason, note) of the Events about pod `name`.
async fn events(client: &kube::Client, ns: &str, name: &str) -> Vec<(String, String)> {
    Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .expect("event list")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

async fn has_event(client: &kube::Client, ns: &str, name: &str, reason: &str) -> bool {
    events(client, ns, name)
        .await
        .iter()
        .any(|(r, _)| r == reason)
}

async fn create_node(client: &kube::Client, name: &str, ready_since: Option<i64>) {
    let mut node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
    if let Some(since) = ready_since {
        node["metadata"]["annotations"] = json!({"meshgate.dev/agents-ready-since": ts(since)});
    }
    Api::<Node>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(node).expect("node"),
        )
        .await
        .expect("node created");
}

#[tokio::test]
async fn timed_out_gates_owned_pods_are_deleted_and_bare_pods_labelled() {
    let (client, cp, ns) = setup("repair-delete").await;
    let repair = start(&cp, settings(&ns, RepairAction::Delete), leader::always()).await;
    let rs = create_replicaset(&client, &ns).await;

    // Healthy pods first: the loop judges pods in the order their changes arrive, so they have
    // been judged by the time the failing ones are handled.
    create_pod(&client, &ns, "gate-ready", true, Some(&rs), None).await;
    set_status(
        &client,
        &ns,
        "gate-ready",
        gate_status(terminated(0, now()), json!({})),
    )
    .await;
    create_pod(&client, &ns, "gate-usage", true, Some(&rs), None).await;
    set_status(
        &client,
        &ns,
        "gate-usage",
        gate_status(terminated(2, now()), json!({})),
    )
    .await;
    create_pod(&client, &ns, "no-gate", false, Some(&rs), None).await;
    set_status(&client, &ns, "no-gate", json!({"startTime": ts(now())})).await;

    create_pod(&client, &ns, "timed-out", true, Some(&rs), None).await;
    gate_timed_out(&client, &ns, "timed-out").await;
    // Restarted gate: running again, timed out before.
    create_pod(&client, &ns, "retrying", true, Some(&rs), None).await;
    set_status(
        &client,
        &ns,
        "retrying",
        gate_status(
            json!({"running": {"startedAt": ts(now())}}),
            terminated(1, now()),
        ),
    )
    .await;
    create_pod(&client, &ns, "bare", true, None, None).await;
    gate_timed_out(&client, &ns, "bare").await;

    for name in ["timed-out", "retrying"] {
        wait_for(&format!("owned pod {name} deleted"), TIMEOUT, || async {
            get_pod(&client, &ns, name).await.is_none()
        })
        .await;
        // The Event follows the eviction's answer.
        wait_for(&format!("the Event of {name}"), TIMEOUT, || {
            has_event(&client, &ns, name, "MeshRepairDeleted")
        })
        .await;
    }
    wait_for("the bare pod labelled", TIMEOUT, || {
        is_labelled(&client, &ns, "bare")
    })
    .await;
    let bare = get_pod(&client, &ns, "bare")
        .await
        .expect("a bare pod is never deleted");
    assert!(
        reason_annotation(&bare).starts_with("gate-timed-out: "),
        "{:?}",
        bare.metadata.annotations
    );
    wait_for("the bare pod's Event", TIMEOUT, || {
        has_event(&client, &ns, "bare", "MeshRepairLabelled")
    })
    .await;
    let notes = events(&client, &ns, "bare").await;
    assert!(
        notes.iter().any(|(_, note)| note.contains("not deleted")),
        "{notes:?}"
    );

    for name in ["gate-ready", "gate-usage", "no-gate"] {
        let pod = get_pod(&client, &ns, name).await;
        assert!(
            pod.as_ref().is_some_and(|p| repair_label(p).is_none()),
            "{name} untouched"
        );
        assert!(
            events(&client, &ns, name).await.is_empty(),
            "{name}: no Event"
        );
    }
    assert_eq!(repair.detected("gate-timed-out"), 3);
    assert_eq!(repair.action("delete"), 2);
    assert_eq!(repair.action("label"), 1);
    assert_eq!(repair.skipped("bare"), 1);
    assert!(
        repair
            .metrics
            .encode()
            .contains("meshgate_controller_repair_actions_total{action=\"delete\"} 2"),
        "{}",
        repair.metrics.encode()
    );
}

#[tokio::test]
async fn pods_started_before_their_node_was_ready_are_labelled() {
    let (client, cp, ns) = setup("repair-early").await;
    let ready = now() - 600;
    let (annotated, unannotated, later) = (
        format!("{ns}-annotated"),
        format!("{ns}-unannotated"),
        format!("{ns}-later"),
    );
    create_node(&client, &annotated, Some(ready)).await;
    create_node(&client, &unannotated, None).await;
    create_node(&client, &later, None).await;
    let mut s = settings(&ns, RepairAction::Label);
    s.detect_started_early = true;
    let repair = start(&cp, s, leader::always()).await;

    // Not early: started after the agents were ready.
    create_pod(&client, &ns, "late", true, None, Some(&annotated)).await;
    set_status(
        &client,
        &ns,
        "late",
        json!({"phase": "Running", "startTime": ts(ready + 60)}),
    )
    .await;
    // Started before, but its gate passed after the agents were ready: the app ran after.
    create_pod(&client, &ns, "vouched", true, None, Some(&annotated)).await;
    let mut status = gate_status(terminated(0, ready + 5), json!({}));
    status["startTime"] = json!(ts(ready - 60));
    status["phase"] = json!("Running");
    set_status(&client, &ns, "vouched", status).await;
    // A node without the annotation: not judged.
    create_pod(&client, &ns, "unjudged", false, None, Some(&unannotated)).await;
    set_status(
        &client,
        &ns,
        "unjudged",
        json!({"phase": "Running", "startTime": ts(ready - 60)}),
    )
    .await;
    create_pod(&client, &ns, "later", false, None, Some(&later)).await;
    set_status(
        &client,
        &ns,
        "later",
        json!({"phase": "Running", "startTime": ts(ready - 60)}),
    )
    .await;
    // Early, picked by the selector (no gate).
    create_pod(&client, &ns, "early", false, None, Some(&annotated)).await;
    set_status(
        &client,
        &ns,
        "early",
        json!({"phase": "Running", "startTime": ts(ready - 60)}),
    )
    .await;

    wait_for("the early pod labelled", TIMEOUT, || {
        is_labelled(&client, &ns, "early")
    })
    .await;
    let early = get_pod(&client, &ns, "early").await.expect("pod");
    let why = reason_annotation(&early);
    assert!(why.starts_with("started-early: "), "{why}");
    assert!(
        why.contains(&ts(ready)),
        "names the node's ready time: {why}"
    );
    wait_for("the Event", TIMEOUT, || {
        has_event(&client, &ns, "early", "MeshRepairLabelled")
    })
    .await;
    assert_eq!(labelled(&client, &ns).await, vec!["early".to_owned()]);
    assert_eq!(repair.detected("started-early"), 1);

    // The node's agents become ready (annotation written): its pod is judged again.
    Api::<Node>::all(client.clone())
        .patch(
            &later,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {
                "meshgate.dev/agents-ready-since": ts(ready)}}})),
        )
        .await
        .expect("annotate node");
    wait_for(
        "the pod on the newly annotated node labelled",
        TIMEOUT,
        || is_labelled(&client, &ns, "later"),
    )
    .await;
    let mut names = labelled(&client, &ns).await;
    names.sort();
    assert_eq!(names, vec!["early".to_owned(), "later".to_owned()]);
    assert_eq!(repair.detected("started-early"), 2);
    assert_eq!(repair.detected("gate-timed-out"), 0);
    assert_eq!(repair.action("label"), 2);
}

/// Deleting repair goes through the Eviction API: a running pod that started early, covered by
/// a PodDisruptionBudget that allows no disruption (none is computed here: no controller
/// manager runs), stays, counted as held by the budget; once the budget is gone it is evicted.
/// A pod whose gate timed out is Pending, and the API server evicts Pending pods whatever the
/// budgets say (`canIgnorePDB`): the other test deletes those.
#[tokio::test]
async fn a_disruption_budget_holds_the_eviction_of_a_running_pod() {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    let (client, cp, ns) = setup("repair-pdb").await;
    let ready = now() - 600;
    let node = format!("{ns}-node");
    create_node(&client, &node, Some(ready)).await;
    let budgets = Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns);
    budgets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}},
            }))
            .expect("budget"),
        )
        .await
        .expect("budget created");
    let rs = create_replicaset(&client, &ns).await;
    let mut s = settings(&ns, RepairAction::Delete);
    s.detect_started_early = true;
    let repair = start(&cp, s, leader::always()).await;
    create_pod(&client, &ns, "early", false, Some(&rs), Some(&node)).await;
    set_status(
        &client,
        &ns,
        "early",
        json!({"phase": "Running", "startTime": ts(ready - 60)}),
    )
    .await;

    // Twice refused: the loop has tried, been refused, and tried again.
    wait_for(
        "the budget to refuse the eviction twice",
        TIMEOUT,
        || async { repair.skipped("disruption-budget") >= 2 },
    )
    .await;
    assert!(
        get_pod(&client, &ns, "early").await.is_some(),
        "the pod was removed although its budget allows no disruption"
    );
    assert_eq!(repair.action("delete"), 0);
    assert_eq!(
        repair.errors("delete"),
        0,
        "a refusal by a budget is not an error"
    );

    budgets
        .delete("web", &Default::default())
        .await
        .expect("budget deleted");
    // Bound to a node, the evicted pod stays Terminating (no kubelet confirms it here).
    wait_for(
        "the pod evicted once its budget is gone",
        TIMEOUT,
        || async {
            get_pod(&client, &ns, "early")
                .await
                .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
        },
    )
    .await;
    assert_eq!(repair.action("delete"), 1);
    eprintln!(
        "measured: evictions refused by the budget before it was deleted: {}",
        repair.skipped("disruption-budget")
    );
}

#[tokio::test]
async fn actions_are_rate_limited_and_a_pod_is_handled_once_per_window() {
    let (client, cp, ns) = setup("repair-rate").await;
    // Failing pods before the loop starts: its first list hands it all three at once.
    let names = ["a", "b", "c"];
    for name in names {
        create_pod(&client, &ns, name, true, None, None).await;
        gate_timed_out(&client, &ns, name).await;
    }
    let mut s = settings(&ns, RepairAction::Label);
    s.rate_per_second = 0.5;
    s.burst = 1;
    let repair = start(&cp, s, leader::always()).await;

    // One action per 2 s: the first list with a labelled pod cannot have all three.
    let began = std::time::Instant::now();
    let first = loop {
        let names = labelled(&client, &ns).await;
        if !names.is_empty() {
            break names;
        }
        assert!(
            began.elapsed() < TIMEOUT,
            "timed out waiting for a first pod labelled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(first.len() < 3, "not all at once: {first:?}");
    wait_for("all three labelled", TIMEOUT, || async {
        labelled(&client, &ns).await.len() == 3
    })
    .await;
    assert!(repair.skipped("rate") >= 1, "the rate limit held some back");
    assert_eq!(repair.action("label"), 3);

    // Someone removes the label; the pod still fails, but it was handled within the window.
    let window_skips = repair.skipped("window");
    Api::<Pod>::namespaced(client.clone(), &ns)
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": {REPAIR_LABEL: null}}})),
        )
        .await
        .expect("unlabel");
    wait_for("the loop to see the pod again", TIMEOUT, || async {
        repair.skipped("window") > window_skips || is_labelled(&client, &ns, "a").await
    })
    .await;
    assert!(
        !is_labelled(&client, &ns, "a").await,
        "not labelled twice within the window"
    );
    assert_eq!(repair.action("label"), 3);
    let labelled_events = events(&client, &ns, "a")
        .await
        .into_iter()
        .filter(|(r, _)| r == "MeshRepairLabelled")
        .count();
    assert_eq!(labelled_events, 1);
}

#[tokio::test]
async fn dry_run_changes_nothing() {
    let (client, cp, ns) = setup("repair-dry").await;
    let mut s = settings(&ns, RepairAction::Delete);
    s.dry_run = true;
    let repair = start(&cp, s, leader::always()).await;
    let rs = create_replicaset(&client, &ns).await;
    create_pod(&client, &ns, "owned", true, Some(&rs), None).await;
    gate_timed_out(&client, &ns, "owned").await;
    create_pod(&client, &ns, "bare", true, None, None).await;
    gate_timed_out(&client, &ns, "bare").await;

    for (name, would) in [("owned", "would delete"), ("bare", "would label")] {
        wait_for(&format!("the dry-run Event of {name}"), TIMEOUT, || {
            has_event(&client, &ns, name, "MeshRepairDryRun")
        })
        .await;
        let evs = events(&client, &ns, name).await;
        assert!(evs.iter().any(|(_, note)| note.contains(would)), "{evs:?}");
        assert!(evs.iter().all(|(r, _)| r == "MeshRepairDryRun"), "{evs:?}");
        let pod = get_pod(&client, &ns, name).await.expect("still there");
        assert_eq!(repair_label(&pod), None);
        assert_eq!(reason_annotation(&pod), "");
    }
    assert_eq!(repair.action("would-delete"), 1);
    assert_eq!(repair.action("would-label"), 1);
    assert_eq!(repair.action("delete") + repair.action("label"), 0);
}

#[tokio::test]
async fn a_replica_that_does_not_lead_writes_nothing_until_it_leads() {
    let (client, cp, ns) = setup("repair-leader").await;
    let (lead, leader_rx) = leader::manual(false);
    let repair = start(&cp, settings(&ns, RepairAction::Label), leader_rx).await;
    create_pod(&client, &ns, "bare", true, None, None).await;
    gate_timed_out(&client, &ns, "bare").await;
    wait_for("the loop to know the pod", TIMEOUT, || async {
        repair.metrics.pods.get() == 1
    })
    .await;
    // Give a wrongly acting follower time to act.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !is_labelled(&client, &ns, "bare").await,
        "the follower wrote"
    );
    assert!(events(&client, &ns, "bare").await.is_empty());

    lead.set(true);
    wait_for("the new leader to label the pod", TIMEOUT, || {
        is_labelled(&client, &ns, "bare")
    })
    .await;
}

/// With repair off and a waiting threshold, the controller only reports: a pod whose gate has
/// been running longer than the threshold gets one `GateWaiting` Event and counts in the gauge;
/// a pod whose gate timed out gets a `GateTimedOut` Event; neither pod is changed.
#[tokio::test]
async fn waiting_and_timed_out_gates_are_reported_without_repair() {
    let (client, cp, ns) = setup("gate-waiting").await;
    let mut s = settings(&ns, RepairAction::Delete);
    s.enabled = false;
    s.waiting_threshold = Some(Duration::from_secs(60));
    let repair = start(&cp, s, meshgate_controller::leader::always()).await;

    create_pod(&client, &ns, "waiting", true, None, Some("node-a")).await;
    set_status(
        &client,
        &ns,
        "waiting",
        gate_status(
            json!({"running": {"startedAt": ts(now() - 600)}}),
            json!({}),
        ),
    )
    .await;
    create_pod(&client, &ns, "fresh", true, None, Some("node-a")).await;
    set_status(
        &client,
        &ns,
        "fresh",
        gate_status(json!({"running": {"startedAt": ts(now())}}), json!({})),
    )
    .await;
    create_pod(&client, &ns, "timed-out", true, None, Some("node-a")).await;
    gate_timed_out(&client, &ns, "timed-out").await;

    wait_for(
        "the GateWaiting and GateTimedOut Events",
        Duration::from_secs(60),
        || async {
            has_event(&client, &ns, "waiting", "GateWaiting").await
                && has_event(&client, &ns, "timed-out", "GateTimedOut").await
        },
    )
    .await;
    let note = events(&client, &ns, "waiting")
        .await
        .into_iter()
        .find(|(r, _)| r == "GateWaiting")
        .map(|(_, n)| n)
        .unwrap_or_default();
    assert!(
        note.contains("node-a") && note.contains(&format!("meshgate status pod {ns}/waiting")),
        "{note}"
    );
    assert_eq!(
        repair.metrics.gates_waiting.get(),
        1,
        "only the pod over the threshold"
    );
    assert_eq!(repair.metrics.gate_waiting_events.get(), 1);
    assert!(
        !has_event(&client, &ns, "fresh", "GateWaiting").await,
        "the pod under the threshold (checked after the gauge counted the other one)"
    );
    // Nothing was changed.
    for name in ["waiting", "timed-out"] {
        let pod = get_pod(&client, &ns, name).await.expect("still there");
        assert_eq!(repair_label(&pod), None, "{name}");
    }
    assert_eq!(repair.action("delete") + repair.action("label"), 0);
}

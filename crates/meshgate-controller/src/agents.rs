//! An index of mesh agent pods (and their DaemonSets) by node.
//!
//! Agent pods live in a few namespaces; the index watches pods and DaemonSets in exactly the
//! namespaces that some NodeGate names, and keeps per pod only what the gate reads (labels,
//! node, readiness), so memory grows with agent pods, not with all pods in the cluster. Label
//! maps are interned: the pods of one DaemonSet revision share one copy (at 10,000 agent pods
//! a label map per pod was a third of the controller's heap). Every change to an agent pod
//! triggers a reconcile of its node.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{watcher, watcher::Event};
use meshgate_api::GateNode;
use meshgate_api::node_gate::Agent;
use meshgate_core::nodegate::{AgentPod, AgentState, DaemonSetView, agent_state};
use tokio::sync::mpsc::UnboundedSender;

fn summarize(pod: &Pod) -> Option<(String, AgentPod)> {
    AgentPod::of(pod)
}

fn key_of(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// A pod as the index keeps it: its key, and its node and summary when bound to one.
type Summary = ((String, String), Option<(String, AgentPod)>);

#[derive(Default)]
struct Inner {
    by_node: HashMap<String, Vec<AgentPod>>,
    /// (namespace, pod) → node, to find a pod again on delete.
    pod_node: HashMap<(String, String), String>,
    daemonsets: HashMap<(String, String), PodTemplateSpec>,
    /// Every label map an indexed pod carries, once.
    labels: HashSet<Arc<BTreeMap<String, String>>>,
    watched: HashSet<String>,
    /// Namespaces whose pods, and whose DaemonSets, have been listed.
    synced: HashSet<String>,
    daemonsets_synced: HashSet<String>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Inner {
    /// The shared copy of a label map.
    fn intern(&mut self, labels: Arc<BTreeMap<String, String>>) -> Arc<BTreeMap<String, String>> {
        match self.labels.get(&labels) {
            Some(shared) => shared.clone(),
            None => {
                self.labels.insert(labels.clone());
                labels
            }
        }
    }
}

/// The shared index.
#[derive(Clone, Default)]
pub struct AgentIndex(Arc<RwLock<Inner>>);

impl std::fmt::Debug for AgentIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentIndex").finish_non_exhaustive()
    }
}

impl AgentIndex {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A pod's summary with its labels interned at once: a re-list of every agent pod holds
    /// the summaries until it ends, and each with its own label map was the controller's peak
    /// at startup. A re-list that ends early (the watch restarts) leaves maps nobody holds;
    /// [`AgentIndex::replace_namespace`] drops them.
    fn summarize_interned(&self, pod: &Pod) -> Summary {
        let summary = summarize(pod).map(|(node, mut summary)| {
            summary.labels = self.write().intern(summary.labels);
            (node, summary)
        });
        (key_of(pod), summary)
    }

    /// Inserts or updates a pod; returns the nodes whose agents changed.
    fn upsert(&self, pod: &Pod) -> Vec<String> {
        self.upsert_summary(key_of(pod), summarize(pod))
    }

    fn upsert_summary(
        &self,
        key: (String, String),
        summary: Option<(String, AgentPod)>,
    ) -> Vec<String> {
        let mut touched = self.remove_key(&key);
        if let Some((node, mut summary)) = summary {
            let mut inner = self.write();
            summary.labels = inner.intern(summary.labels);
            inner.pod_node.insert(key, node.clone());
            inner.by_node.entry(node.clone()).or_default().push(summary);
            touched.push(node);
        }
        touched
    }

    /// Removes a pod; returns its node.
    pub fn remove(&self, pod: &Pod) -> Vec<String> {
        self.remove_key(&key_of(pod))
    }

    fn remove_key(&self, key: &(String, String)) -> Vec<String> {
        let mut inner = self.write();
        let Some(node) = inner.pod_node.remove(key) else {
            return Vec::new();
        };
        let mut gone = None;
        if let Some(pods) = inner.by_node.get_mut(&node) {
            if let Some(i) = pods
                .iter()
                .position(|p| p.namespace == key.0 && p.name == key.1)
            {
                gone = Some(pods.swap_remove(i));
            }
            if pods.is_empty() {
                inner.by_node.remove(&node);
            }
        }
        // The last pod with these labels: the interned copy goes too.
        if let Some(pod) = gone
            && Arc::strong_count(&pod.labels) == 2
        {
            inner.labels.remove(&pod.labels);
        }
        vec![node]
    }

    /// Replaces every pod of `namespace` (after a re-list); returns the nodes touched.
    fn replace_namespace(&self, namespace: &str, pods: Vec<Summary>) -> Vec<String> {
        let old: Vec<(String, String)> = self
            .read()
            .pod_node
            .keys()
            .filter(|(ns, _)| ns == namespace)
            .cloned()
            .collect();
        let mut touched: Vec<String> = old.iter().flat_map(|k| self.remove_key(k)).collect();
        for (key, summary) in pods {
            touched.extend(self.upsert_summary(key, summary));
        }
        let mut inner = self.write();
        inner.synced.insert(namespace.to_owned());
        inner.labels.retain(|l| Arc::strong_count(l) > 1);
        drop(inner);
        touched.sort();
        touched.dedup();
        touched
    }

    /// Label maps held (interned), for tests.
    #[cfg(test)]
    fn label_maps(&self) -> usize {
        self.read().labels.len()
    }

    /// The agent's state on a node ([`meshgate_core::nodegate::agent_state`]).
    pub fn state(&self, agent: &Agent, node: &GateNode, gate_taint: &str) -> AgentState {
        let node_name = node.metadata.name.as_deref().unwrap_or_default();
        let inner = self.read();
        let daemonset = match &agent.daemon_set {
            None => DaemonSetView::Unnamed,
            Some(ds) => match inner.daemonsets.get(&(agent.namespace.clone(), ds.clone())) {
                Some(template) => DaemonSetView::Template(template),
                None => DaemonSetView::Absent,
            },
        };
        agent_state(
            agent,
            inner.by_node.get(node_name).into_iter().flatten(),
            daemonset,
            node,
            gate_taint,
        )
    }

    /// Whether the agent's DaemonSet is named and absent (after its namespace was listed).
    pub fn daemonset_absent(&self, agent: &Agent) -> bool {
        let inner = self.read();
        agent.daemon_set.as_ref().is_some_and(|ds| {
            inner.daemonsets_synced.contains(&agent.namespace)
                && !inner
                    .daemonsets
                    .contains_key(&(agent.namespace.clone(), ds.clone()))
        })
    }

    /// Whether the first list of pods and of DaemonSets of every watched namespace has arrived.
    pub fn synced(&self) -> bool {
        let inner = self.read();
        inner
            .watched
            .iter()
            .all(|ns| inner.synced.contains(ns) && inner.daemonsets_synced.contains(ns))
    }

    /// Starts watching pods and DaemonSets in `namespace` unless already watched. Node names
    /// whose agents change are sent to `trigger`.
    pub fn ensure_watch(
        &self,
        client: &kube::Client,
        namespace: &str,
        trigger: &UnboundedSender<ObjectRef<GateNode>>,
    ) {
        if !self.write().watched.insert(namespace.to_owned()) {
            return;
        }
        tracing::info!(namespace, "watching agent pods");
        let pods = tokio::spawn(watch_pods(
            self.clone(),
            client.clone(),
            namespace.to_owned(),
            trigger.clone(),
        ));
        let daemonsets = tokio::spawn(watch_daemonsets(
            self.clone(),
            client.clone(),
            namespace.to_owned(),
            trigger.clone(),
        ));
        self.write().tasks.extend([pods, daemonsets]);
    }

    /// Stops every watch (the controller is shutting down).
    pub fn stop(&self) {
        for task in self.write().tasks.drain(..) {
            task.abort();
        }
    }

    /// Every node that has agent pods (for a resync).
    pub fn nodes(&self) -> Vec<String> {
        self.read().by_node.keys().cloned().collect()
    }
}

fn send_all(trigger: &UnboundedSender<ObjectRef<GateNode>>, nodes: Vec<String>) {
    for n in nodes {
        let _ = trigger.send(ObjectRef::new(&n));
    }
}

async fn watch_pods(
    index: AgentIndex,
    client: kube::Client,
    namespace: String,
    trigger: UnboundedSender<ObjectRef<GateNode>>,
) {
    let api = Api::<Pod>::namespaced(client, &namespace);
    // A re-list is summarised as it arrives: the full pods are not held until it ends.
    let mut relist: Vec<Summary> = Vec::new();
    let mut stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(Event::Apply(pod)) => send_all(&trigger, index.upsert(&pod)),
            Ok(Event::Delete(pod)) => send_all(&trigger, index.remove(&pod)),
            Ok(Event::Init) => relist.clear(),
            Ok(Event::InitApply(pod)) => relist.push(index.summarize_interned(&pod)),
            Ok(Event::InitDone) => {
                let pods = std::mem::take(&mut relist);
                send_all(&trigger, index.replace_namespace(&namespace, pods));
            }
            Err(e) => meshgate_kube::watch::log(&format!("agent pods in {namespace}"), &e),
        }
    }
}

async fn watch_daemonsets(
    index: AgentIndex,
    client: kube::Client,
    namespace: String,
    trigger: UnboundedSender<ObjectRef<GateNode>>,
) {
    let api = Api::<DaemonSet>::namespaced(client, &namespace);
    let mut stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    while let Some(event) = stream.next().await {
        let changed = match event {
            Ok(Event::InitDone) => {
                index.write().daemonsets_synced.insert(namespace.clone());
                true
            }
            Ok(Event::Apply(ds) | Event::InitApply(ds)) => {
                let key = (
                    namespace.clone(),
                    ds.metadata.name.clone().unwrap_or_default(),
                );
                let template = ds.spec.map(|s| s.template).unwrap_or_default();
                index.write().daemonsets.insert(key, template);
                true
            }
            Ok(Event::Delete(ds)) => {
                let key = (
                    namespace.clone(),
                    ds.metadata.name.clone().unwrap_or_default(),
                );
                index.write().daemonsets.remove(&key);
                true
            }
            Ok(_) => false,
            Err(e) => {
                meshgate_kube::watch::log(&format!("agent DaemonSets in {namespace}"), &e);
                false
            }
        };
        if changed {
            // Targeting may change for any node: the node controller resyncs all of them.
            let _ = trigger.send(ObjectRef::new(RESYNC_ALL));
        }
    }
}

/// A node name no node can have: asks the controller to reconcile every node.
pub const RESYNC_ALL: &str = "*resync*";

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, node: &str, app: &str, ready: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "mesh", "name": name,
                         "labels": {"app": app, "controller-revision-hash": "abc"}},
            "spec": {"nodeName": node, "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
        }))
        .expect("pod")
    }

    fn agent(app: &str) -> Agent {
        serde_json::from_value(serde_json::json!({
            "name": app, "namespace": "mesh", "selector": {"matchLabels": {"app": app}},
        }))
        .expect("agent")
    }

    fn node(name: &str) -> GateNode {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).expect("node")
    }

    #[test]
    fn pods_with_the_same_labels_share_one_map_until_the_last_goes() {
        let index = AgentIndex::default();
        for i in 0..100 {
            index.upsert(&pod(&format!("cni-{i}"), &format!("n{i}"), "cni", true));
            index.upsert(&pod(
                &format!("proxy-{i}"),
                &format!("n{i}"),
                "proxy",
                i % 2 == 0,
            ));
        }
        assert_eq!(index.label_maps(), 2);
        // The shared labels still select each agent's pods, on their own node only.
        let ready = |app: &str, n: &str| {
            matches!(
                index.state(&agent(app), &node(n), "taint"),
                AgentState::Ready { .. }
            )
        };
        assert!(ready("cni", "n1") && ready("proxy", "n2") && !ready("proxy", "n1"));
        // An update keeps the count; labels of a new revision add a map.
        index.upsert(&pod("proxy-1", "n1", "proxy", true));
        assert!(ready("proxy", "n1"));
        assert_eq!(index.label_maps(), 2);
        let mut relabelled = pod("cni-0", "n0", "cni", true);
        relabelled
            .metadata
            .labels
            .as_mut()
            .expect("labels")
            .insert("controller-revision-hash".into(), "def".into());
        index.upsert(&relabelled);
        assert_eq!(index.label_maps(), 3);
        // Removing every pod of a label set removes its map.
        for i in 0..100 {
            index.remove(&pod(&format!("proxy-{i}"), &format!("n{i}"), "proxy", true));
        }
        assert_eq!(index.label_maps(), 2);
        index.remove(&relabelled);
        assert_eq!(index.label_maps(), 1);
        assert!(!ready("cni", "n0") && ready("cni", "n99"));
    }

    #[test]
    fn a_relist_shares_label_maps_as_it_arrives_and_drops_those_left_over() {
        let index = AgentIndex::default();
        // A re-list that ends early (the watch restarted): its summaries are dropped.
        let aborted: Vec<Summary> = (0..50)
            .map(|i| index.summarize_interned(&pod(&format!("old-{i}"), "n0", "old", true)))
            .collect();
        assert_eq!(index.label_maps(), 1, "one map for 50 summaries");
        drop(aborted);
        // The next re-list completes: only its maps are left.
        let relist: Vec<Summary> = (0..100)
            .map(|i| {
                let app = if i % 2 == 0 { "cni" } else { "proxy" };
                index.summarize_interned(&pod(&format!("{app}-{i}"), &format!("n{i}"), app, true))
            })
            .collect();
        let touched = index.replace_namespace("mesh", relist);
        assert_eq!(touched.len(), 100);
        assert_eq!(index.label_maps(), 2);
        assert!(matches!(
            index.state(&agent("proxy"), &node("n1"), "taint"),
            AgentState::Ready { .. }
        ));
    }
}

//! The Karpenter scenarios of the `karpenter` test and the `karpenter_scaleup` benchmark:
//! meshgate installed as users install it beside the real Karpenter on KWOK
//! (`meshgate_testenv::karpenter`), switched on and off between rounds, and what Karpenter, the
//! scheduler and KWOK did in each round, read from one watch of pods, nodes and NodeClaims (their
//! resourceVersions order the events).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_testenv::karpenter::{self, AGENT_LABEL, READY_AFTER};
use serde_json::json;

use super::{ControllerTask, Webhook};

/// How long after its pod is created an agent is Ready.
pub const AGENT_DELAY: &str = "5s";
/// Mesh pods of one round: one CPU each, one 8-CPU node's worth (with the agents' requests).
pub const PODS: usize = 6;
/// The burst.
pub const BURST: usize = 200;
pub const NS: &str = "meshgate-system";
pub const PROFILES: [&str; 3] = ["istio-ambient", "istio-sidecar", "linkerd"];

/// What the watch saw, each with the etcd revision (resourceVersion) and the moment it was seen.
#[derive(Default)]
pub struct Seen {
    /// Mesh pod uid -> (namespace, node, revision, seen) of its binding.
    pub bound: BTreeMap<String, (String, String, u64, Instant)>,
    /// Mesh pod uid -> first seen Running and Ready.
    pub running: BTreeMap<String, Instant>,
    /// (node, agent pod name) -> revision and moment first seen Ready.
    pub agent_ready: BTreeMap<(String, String), (u64, Instant)>,
    /// Node -> whether it ever carried the gate taint, and the revision it was first seen without
    /// it after that.
    pub tainted: BTreeMap<String, bool>,
    pub lifted: BTreeMap<String, (u64, Instant)>,
    /// Node -> first seen Ready with no `NoSchedule` or `NoExecute` taint: from then the
    /// scheduler may bind pods there (with meshgate or without).
    pub schedulable: BTreeMap<String, Instant>,
    /// NodeClaim -> (instance type, node, revision it became Initialized).
    pub claims: BTreeMap<String, Claim>,
}

#[derive(Clone, Debug, Default)]
pub struct Claim {
    pub instance_type: String,
    pub node: String,
    pub initialized: Option<u64>,
    pub created: Option<Instant>,
}

pub fn rv(meta: &kube::api::ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Watches pods, nodes and NodeClaims for the whole test into [`Seen`].
pub fn watch(client: &kube::Client, seen: &Arc<Mutex<Seen>>) -> Vec<tokio::task::JoinHandle<()>> {
    let key = meshgate_api::names::STARTUP_TAINT_KEY;
    let (c, s) = (client.clone(), seen.clone());
    let pods = tokio::spawn(async move {
        let stream = watcher(Api::<Pod>::all(c), watcher::Config::default()).applied_objects();
        futures::pin_mut!(stream);
        while let Some(Ok(p)) = stream.next().await {
            let now = Instant::now();
            let (uid, name) = (
                p.metadata.uid.clone().unwrap_or_default(),
                p.metadata.name.clone().unwrap_or_default(),
            );
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            let agent = p
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(AGENT_LABEL));
            let mesh = p
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.get("app").map(String::as_str) == Some("mesh-app"));
            let mut s = s.lock().expect("seen");
            match (node, agent, mesh) {
                (Some(node), true, _) if ready(&p) => {
                    s.agent_ready
                        .entry((node, name))
                        .or_insert((rv(&p.metadata), now));
                }
                (Some(node), _, true) => {
                    let ns = p.metadata.namespace.clone().unwrap_or_default();
                    s.bound
                        .entry(uid.clone())
                        .or_insert((ns, node, rv(&p.metadata), now));
                    if ready(&p) {
                        s.running.entry(uid).or_insert(now);
                    }
                }
                _ => {}
            }
        }
    });
    let (c, s) = (client.clone(), seen.clone());
    let nodes = tokio::spawn(async move {
        let stream = watcher(Api::<Node>::all(c), watcher::Config::default()).applied_objects();
        futures::pin_mut!(stream);
        while let Some(Ok(n)) = stream.next().await {
            let now = Instant::now();
            let name = n.metadata.name.clone().unwrap_or_default();
            let has = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|ts| ts.iter().any(|t| t.key == key));
            let open = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_none_or(|ts| ts.iter().all(|t| t.effect == "PreferNoSchedule"))
                && n.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let mut s = s.lock().expect("seen");
            if open {
                s.schedulable.entry(name.clone()).or_insert(now);
            }
            let was = s.tainted.get(&name).copied().unwrap_or(false);
            if has {
                s.tainted.insert(name, true);
            } else if was {
                s.lifted.entry(name).or_insert((rv(&n.metadata), now));
            }
        }
    });
    let (c, s) = (client.clone(), seen.clone());
    let claims = tokio::spawn(async move {
        let api = Api::<DynamicObject>::all_with(c, &karpenter::node_claims());
        let stream = watcher(api, watcher::Config::default()).applied_objects();
        futures::pin_mut!(stream);
        while let Some(Ok(claim)) = stream.next().await {
            let now = Instant::now();
            let name = claim.metadata.name.clone().unwrap_or_default();
            let mut s = s.lock().expect("seen");
            let entry = s.claims.entry(name).or_default();
            entry.created.get_or_insert(now);
            if let Some(t) = claim
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("node.kubernetes.io/instance-type"))
            {
                entry.instance_type.clone_from(t);
            }
            if let Some(n) = claim.data["status"]["nodeName"].as_str() {
                entry.node = n.to_owned();
            }
            let initialized = claim.data["status"]["conditions"]
                .as_array()
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "Initialized" && c["status"] == "True")
                });
            if initialized && entry.initialized.is_none() {
                entry.initialized = Some(rv(&claim.metadata));
            }
        }
    });
    vec![pods, nodes, claims]
}

/// The agents of every profile as DaemonSets that tolerate every taint, as the meshes' do.
pub async fn create_agents(client: &kube::Client) {
    let mut seen = BTreeSet::new();
    for profile in PROFILES {
        let record = meshgate::install::mesh_profile(profile)
            .expect("profile")
            .record();
        for a in record.agents {
            if !seen.insert((a.namespace, a.daemon_set)) {
                continue;
            }
            let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
            let _ = namespaces
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({"metadata": {"name": a.namespace}}))
                        .expect("ns"),
                )
                .await;
            let ds = json!({
                "apiVersion": "apps/v1", "kind": "DaemonSet",
                "metadata": {"name": a.daemon_set, "namespace": a.namespace},
                "spec": {
                    "selector": {"matchLabels": {a.label.0: a.label.1}},
                    "template": {
                        "metadata": {"labels": {a.label.0: a.label.1, AGENT_LABEL: "true"},
                                     "annotations": {READY_AFTER: AGENT_DELAY}},
                        "spec": {"tolerations": [{"operator": "Exists"}],
                                 "containers": [{"name": "agent", "image": "mesh/agent",
                                                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]},
                    },
                },
            });
            Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(client.clone(), a.namespace)
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(ds).expect("daemonset"),
                )
                .await
                .expect("agent DaemonSet");
        }
    }
}

/// meshgate as `install --apply` leaves it, with the webhook and the controller running out of
/// the cluster as their installed ServiceAccounts (the installed Deployments are scaled to 0:
/// these processes are them), and switched off and on between rounds.
pub struct Meshgate {
    pub controller: Option<ControllerTask>,
    pub webhook: Webhook,
    pub config: meshgate_api::GateConfig,
    /// The installed MutatingAdmissionPolicy and binding of the taint at registration.
    pub policies: Vec<serde_json::Value>,
}

pub fn admission_policies() -> [kube::discovery::ApiResource; 2] {
    [
        ("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
        (
            "MutatingAdmissionPolicyBinding",
            "mutatingadmissionpolicybindings",
        ),
    ]
    .map(|(kind, plural)| kube::discovery::ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    })
}

/// Waits until a dry-run Node create comes back with (`want`) or without the gate's taint.
pub async fn wait_taint_at_registration(client: &kube::Client, want: bool) {
    super::wait_registration_taint(client, meshgate_api::names::STARTUP_TAINT_KEY, want).await;
}

/// Runs the `meshgate` CLI off the test's runtime (its watches go on meanwhile).
pub async fn cli(cp: &meshgate_testenv::ControlPlane, args: &[&str]) -> std::process::Output {
    let kubeconfig = cp.kubeconfig_path.clone();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(super::meshgate_bin())
            .args(&args)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .output()
            .expect("meshgate runs")
    })
    .await
    .expect("cli")
}

impl Meshgate {
    /// `meshgate install --profile P --apply`, then its components out of the cluster.
    pub async fn install(cp: &meshgate_testenv::ControlPlane, profile: &str) -> (Self, String) {
        let out = cli(
            cp,
            &[
                "install",
                "--profile",
                profile,
                "--namespace",
                NS,
                "--apply",
            ],
        )
        .await;
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "install: {said}");
        let client = cp.client().await.expect("client");
        let deployments =
            Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), NS);
        for d in ["meshgate-webhook", "meshgate-controller"] {
            deployments
                .patch(
                    d,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(json!({"spec": {"replicas": 0}})),
                )
                .await
                .expect("scaled to 0");
        }
        let config_map =
            Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), NS)
                .get("meshgate-config")
                .await
                .expect("the installed configuration");
        let text = config_map
            .data
            .and_then(|d| d.get("config.yaml").cloned())
            .expect("config.yaml");
        let config = meshgate_api::GateConfig::from_yaml("meshgate-config", &text).expect("config");
        let mut policies = Vec::new();
        for ar in admission_policies() {
            let api = Api::<DynamicObject>::all_with(client.clone(), &ar);
            for mut p in api
                .list(&ListParams::default().labels("app.kubernetes.io/managed-by=meshgate"))
                .await
                .expect("policies")
                .items
            {
                p.metadata = kube::api::ObjectMeta {
                    name: p.metadata.name.clone(),
                    labels: p.metadata.labels.clone(),
                    ..Default::default()
                };
                let mut v = serde_json::to_value(&p).expect("policy");
                v["apiVersion"] = json!(ar.api_version);
                v["kind"] = json!(ar.kind);
                policies.push(v);
            }
        }
        assert_eq!(
            policies.len(),
            2,
            "the taint at registration: a policy and its binding"
        );
        let webhook = super::start_webhook_as(cp, config.clone(), Some(NS)).await;
        let mut mg = Self {
            controller: None,
            webhook,
            config,
            policies,
        };
        mg.on(cp, &client).await;
        (mg, said)
    }

    /// meshgate on: the taint at registration, the webhook (registered by URL: it runs out of
    /// the cluster; the installed registration names the in-cluster Service) and the controller.
    pub async fn on(&mut self, cp: &meshgate_testenv::ControlPlane, client: &kube::Client) {
        let pp = kube::api::PatchParams::apply("meshgate").force();
        for (p, ar) in self
            .policies
            .iter()
            .zip(admission_policies().iter().cycle())
        {
            let ar = admission_policies()
                .into_iter()
                .find(|a| a.kind == p["kind"])
                .unwrap_or(ar.clone());
            let obj: DynamicObject = serde_json::from_value(p.clone()).expect("policy");
            Api::<DynamicObject>::all_with(client.clone(), &ar)
                .patch(
                    p["metadata"]["name"].as_str().unwrap_or_default(),
                    &pp,
                    &kube::api::Patch::Apply(&obj),
                )
                .await
                .expect("policy applied");
        }
        let _ =
            Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
                client.clone(),
            )
            .delete("meshgate", &DeleteParams::default())
            .await;
        super::register(
            client,
            &self
                .webhook
                .registration("meshgate", &self.config, true, false),
        )
        .await;
        wait_taint_at_registration(client, true).await;
        self.controller = Some(ControllerTask::start(
            cp,
            NS,
            meshgate::run::ControllerSettings {
                excluded_namespaces: Some(self.config.excluded_namespaces.clone()),
                ..Default::default()
            },
        ));
    }

    /// meshgate off: its registrations gone (no taint at registration, no webhook call) and its
    /// controller stopped, as the first steps of `meshgate uninstall` leave a cluster.
    pub async fn off(&mut self, client: &kube::Client) {
        if let Some(c) = self.controller.take() {
            c.finish().await;
        }
        let dp = DeleteParams::default();
        let _ =
            Api::<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration>::all(
                client.clone(),
            )
            .delete("meshgate", &dp)
            .await;
        for ar in admission_policies() {
            let api = Api::<DynamicObject>::all_with(client.clone(), &ar);
            let _ = api
                .delete_collection(
                    &dp,
                    &ListParams::default().labels("app.kubernetes.io/managed-by=meshgate"),
                )
                .await;
        }
        wait_taint_at_registration(client, false).await;
    }
}

/// One round's outcome.
#[derive(Debug, Default)]
pub struct Round {
    /// Instance types of the NodeClaims launched, sorted.
    pub launched: Vec<String>,
    /// Mesh pods bound before every agent of their node was Ready.
    pub early: usize,
    /// From the last agent Ready on its node to the pod Running, per pod.
    pub release: Vec<Duration>,
    /// The release in its legs, per pod whose node meshgate tainted: the agents Ready to the
    /// taint seen lifted (meshgate), to the binding seen (the scheduler), to Running seen (KWOK).
    pub legs: Vec<[Duration; 3]>,
    /// From its node first seen schedulable to the pod Running, per pod: what the scheduler and
    /// the kubelets take once a node is open, with meshgate (the taint lifted) or without (the
    /// node Ready).
    pub from_schedulable: Vec<Duration>,
    /// NodeClaims Initialized before meshgate lifted the taint of their node.
    pub initialized_early: usize,
    /// NodeClaims created after the round's first mesh pod was seen bound: launched while the
    /// scheduler was already placing pods on the round's first nodes.
    pub launched_after_binding: usize,
    /// From the Deployment's creation to its last pod Running.
    pub elapsed: Duration,
}

pub fn agents_of(profile: &str) -> usize {
    meshgate::install::mesh_profile(profile)
        .expect("profile")
        .record()
        .agents
        .len()
}

/// Creates `pods` mesh pods in a new namespace, waits until all run, and reads the round from
/// what the watch saw; then removes the pods and the round's nodes.
pub async fn round(
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    seen: &Arc<Mutex<Seen>>,
    profile: &str,
    pods: usize,
    label: &str,
    consolidate: bool,
) -> Round {
    let started = Instant::now();
    let ns_labels: &[(&str, &str)] = match profile {
        "istio-ambient" => &[("istio.io/dataplane-mode", "ambient")],
        "linkerd" => &[],
        _ => &[("istio-injection", "enabled")],
    };
    let ns = cp.namespace("mesh", ns_labels).await.expect("namespace");
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "mesh-app", "namespace": ns},
        "spec": {"replicas": pods, "selector": {"matchLabels": {"app": "mesh-app"}},
                 "template": {"metadata": {"labels": {"app": "mesh-app"}},
                              "spec": {"terminationGracePeriodSeconds": 0,
                                       "containers": [{"name": "app", "image": "app", "resources": {"requests": {"cpu": "1"}}}]}}}});
    let deployments =
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), &ns);
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(deployment).expect("deployment"),
        )
        .await
        .expect("deployment");
    let pod_api = Api::<Pod>::namespaced(client.clone(), &ns);
    let limit = Duration::from_secs(if pods > 50 { 300 } else { 120 });
    let t = Instant::now();
    loop {
        let list = pod_api.list(&ListParams::default()).await.expect("pods");
        if list.items.len() == pods && list.items.iter().all(ready) {
            break;
        }
        assert!(
            t.elapsed() < limit,
            "{label}: {} of {pods} mesh pods Running after {limit:?}",
            list.items.iter().filter(|p| ready(p)).count()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let items = pod_api
        .list(&ListParams::default())
        .await
        .expect("pods")
        .items;
    // The verdict names the layer: the taint alone holds a scheduled ambient pod.
    if profile == "istio-ambient" && label.starts_with("default") {
        for p in &items {
            let verdict = p
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(meshgate_api::names::GATE_VERDICT));
            assert_eq!(
                verdict.map(String::as_str),
                Some("gated: taint readiness.k8s.io/mesh-agents"),
                "{label}"
            );
            assert!(
                p.spec.as_ref().is_some_and(|s| s.init_containers.is_none()),
                "{label}: no init container"
            );
        }
    }
    let uids: BTreeSet<String> = items
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    let agents = agents_of(profile);
    let daemon_sets: Vec<&str> = meshgate::install::mesh_profile(profile)
        .expect("profile")
        .record()
        .agents
        .iter()
        .map(|a| a.daemon_set)
        .collect();
    let mut out = Round {
        elapsed: started.elapsed(),
        ..Round::default()
    };
    {
        let s = seen.lock().expect("seen");
        let mut nodes = BTreeSet::new();
        for uid in &uids {
            let Some((_, node, bound_rv, bound_at)) = s.bound.get(uid) else {
                continue;
            };
            nodes.insert(node.clone());
            // The gate's agents on the node (every profile's agents run; each gate waits for its
            // own).
            let on_node: Vec<&(u64, Instant)> = s
                .agent_ready
                .iter()
                .filter(|((n, pod), _)| {
                    n == node
                        && daemon_sets
                            .iter()
                            .any(|ds| pod.starts_with(&format!("{ds}-")))
                })
                .map(|(_, v)| v)
                .collect();
            let last = on_node.iter().map(|(r, _)| *r).max().unwrap_or(u64::MAX);
            if on_node.len() < agents || last > *bound_rv {
                out.early += 1;
            }
            if let (Some(running), Some(open)) = (s.running.get(uid), s.schedulable.get(node)) {
                out.from_schedulable
                    .push(running.saturating_duration_since(*open));
            }
            if let (Some(running), Some(at)) =
                (s.running.get(uid), on_node.iter().map(|(_, at)| *at).max())
            {
                out.release.push(running.saturating_duration_since(at));
                if let Some((_, lifted)) = s.lifted.get(node) {
                    out.legs.push([
                        lifted.saturating_duration_since(at),
                        bound_at.saturating_duration_since(*lifted),
                        running.saturating_duration_since(*bound_at),
                    ]);
                }
            }
        }
        let first_bound = uids
            .iter()
            .filter_map(|uid| s.bound.get(uid).map(|b| b.3))
            .min();
        for claim in s
            .claims
            .values()
            .filter(|c| c.created.is_some_and(|c| c >= started))
        {
            out.launched.push(claim.instance_type.clone());
            if let (Some(created), Some(first)) = (claim.created, first_bound)
                && created > first
            {
                out.launched_after_binding += 1;
            }
            if let (Some(init), Some((lifted, _))) = (claim.initialized, s.lifted.get(&claim.node))
                && init < *lifted
            {
                out.initialized_early += 1;
            }
            if claim.initialized.is_some()
                && s.tainted.get(&claim.node) == Some(&true)
                && !s.lifted.contains_key(&claim.node)
            {
                out.initialized_early += 1;
            }
        }
        let _ = nodes;
    }
    out.launched.sort();
    // Clean up: the pods, then the round's nodes (deleting the NodeClaims is Karpenter's own
    // termination, quicker than waiting for consolidation).
    let _ = deployments
        .delete("mesh-app", &DeleteParams::default())
        .await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    super::wait_for(
        "the round's mesh pods to go",
        Duration::from_secs(120),
        || async {
            pod_api
                .list(&ListParams::default())
                .await
                .is_ok_and(|l| l.items.is_empty())
        },
    )
    .await;
    if consolidate {
        // Scale-down as Karpenter does it: its consolidation removes the empty nodes; nothing of
        // meshgate's (a taint, a finalizer) keeps one.
        let t = Instant::now();
        let claims = Api::<DynamicObject>::all_with(client.clone(), &karpenter::node_claims());
        let nodes: Api<Node> = Api::all(client.clone());
        super::wait_for(
            "consolidation to remove every node",
            Duration::from_secs(240),
            || async {
                let all = ListParams::default();
                claims.list(&all).await.is_ok_and(|l| l.items.is_empty())
                    && nodes.list(&all).await.is_ok_and(|l| l.items.is_empty())
            },
        )
        .await;
        eprintln!(
            "measured: {label}: consolidation removed every node {:.1?} after the pods went",
            t.elapsed()
        );
    } else {
        delete_all_nodes(client).await;
    }
    out
}

/// Deletes every NodeClaim and Node (Karpenter's termination takes them off; a Node whose
/// NodeClaim was deleted before the KWOK provider created it has no owner and goes at once) and
/// waits until none is left.
pub async fn delete_all_nodes(client: &kube::Client) {
    let claims = Api::<DynamicObject>::all_with(client.clone(), &karpenter::node_claims());
    let nodes: Api<Node> = Api::all(client.clone());
    super::wait_for(
        "every NodeClaim and Node to go",
        Duration::from_secs(180),
        || async {
            let (dp, all) = (DeleteParams::default(), ListParams::default());
            let _ = claims.delete_collection(&dp, &all).await;
            let _ = nodes.delete_collection(&dp, &all).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            claims.list(&all).await.is_ok_and(|l| l.items.is_empty())
                && nodes.list(&all).await.is_ok_and(|l| l.items.is_empty())
        },
    )
    .await;
}

pub fn percentile(xs: &[Duration], p: f64) -> Duration {
    let mut v = xs.to_vec();
    v.sort();
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

//! The demo's new node, launched by the real Karpenter (its KWOK provider: a Node without a
//! machine, whose pods' statuses KWOK writes) for a pending mesh pod, where Karpenter and the
//! node binaries are built and cached (`MESHGATE_KARPENTER`, `MESHGATE_NODE_BIN`: `tools/demo.sh`
//! sets them when `tools/test.sh` has built Karpenter; the demo never builds it). The mesh's
//! agents are DaemonSets on Karpenter's nodes that KWOK reports Ready a few seconds after they
//! start, as a slow agent would be.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use meshgate_testenv::karpenter::{self, AGENT_LABEL, Autoscaler, NODE_POOL, READY_AFTER};
use serde_json::json;

use super::{NodeStory, Story, poll, taint_keys};

/// How long after it starts KWOK reports each agent Ready.
const AGENT_DELAY: &str = "5s";

/// Whether the demo's autoscaler is the real Karpenter: both it and the node binaries (its
/// kube-controller-manager) are named by the environment, so nothing is built here.
pub fn available() -> bool {
    std::env::var_os(karpenter::KARPENTER_BIN_ENV).is_some()
        && std::env::var_os(meshgate_testenv::node::NODE_BIN_ENV).is_some()
}

/// Starts Karpenter, puts the mesh's agents on its nodes and creates a mesh pod no node can run;
/// tells what Karpenter launched, what the node carried at registration, and when meshgate and
/// the scheduler let the pod run. The [`Autoscaler`] keeps running in the returned story.
pub async fn launch(
    story: &mut Story,
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
    key: &str,
) -> anyhow::Result<NodeStory> {
    let autoscaler = start(story, cp, client).await?;

    story.say("A mesh pod is created in namespace shop (ambient mode); no node can run it yet");
    super::create_mesh_pod(story, client, json!({"requests": {"cpu": "500m"}})).await?;

    let claims = Api::<DynamicObject>::all_with(client.clone(), &karpenter::node_claims());
    let (claim, instance_type, node) = launched(story, client, &claims).await?;
    let nodes: Api<Node> = Api::all(client.clone());

    story.say(&format!(
        "The CNI agent and the node proxy on {node} become Ready (KWOK reports them Ready {AGENT_DELAY} after they start)"
    ));
    let agents: Api<Pod> = Api::namespaced(client.clone(), "mesh-system");
    let on_node = ListParams::default()
        .labels(AGENT_LABEL)
        .fields(&format!("spec.nodeName={node}"));
    // Whether Karpenter called the node initialized while meshgate's taint was still on it.
    let initialized_early = std::cell::Cell::new(false);
    poll("the agents to be Ready", Duration::from_secs(60), || {
        let (agents, on_node) = (agents.clone(), on_node.clone());
        async move {
            let list = agents.list(&on_node).await.ok()?;
            (list.items.len() == 2 && list.items.iter().all(ready)).then_some(())
        }
    })
    .await?;
    let ready_at = Instant::now();
    poll("the taint to be removed", Duration::from_secs(30), || {
        let (nodes, claims, node, claim) =
            (nodes.clone(), claims.clone(), node.clone(), claim.clone());
        let early = &initialized_early;
        async move {
            let n = nodes.get(&node).await.ok()?;
            let tainted = taint_keys(&n).iter().any(|t| t.starts_with(key));
            if tainted && initialized(&claims.get(&claim).await.ok()?) {
                early.set(true);
            }
            (!tainted).then_some(())
        }
    })
    .await?;
    let lifted_at = Instant::now();
    let untaint_ms = lifted_at.duration_since(ready_at).as_millis();
    story.detail(&format!(
        "meshgate removed the startup taint {untaint_ms} ms after the agents were Ready"
    ));
    let bound = super::wait_bound(story, client).await?;
    poll(
        "Karpenter to mark its NodeClaim Initialized",
        Duration::from_secs(60),
        || {
            let (claims, claim) = (claims.clone(), claim.clone());
            async move { initialized(&claims.get(&claim).await.ok()?).then_some(()) }
        },
    )
    .await?;
    story.detail(&if initialized_early.get() {
        format!("Karpenter marked NodeClaim {claim} Initialized while meshgate's taint was still on {node}")
    } else {
        format!(
            "Karpenter marked NodeClaim {claim} Initialized only once meshgate's taint was gone (seen {} ms after the taint): it waits for taints of the readiness.k8s.io/ prefix as for its startup taints",
            lifted_at.elapsed().as_millis()
        )
    });
    Ok(NodeStory {
        node: bound,
        launched: Some(format!(
            "Karpenter launched it ({instance_type}) for the pending pod"
        )),
        untaint_ms,
        autoscaler: Some(autoscaler),
    })
}

/// The real Karpenter and KWOK, and the mesh's agents as DaemonSets on every node it launches.
async fn start(
    story: &mut Story,
    cp: &meshgate_testenv::ControlPlane,
    client: &kube::Client,
) -> anyhow::Result<Autoscaler> {
    story.say("Starting the real Karpenter (its KWOK provider: nodes without machines) and KWOK");
    let autoscaler = Autoscaler::start(cp, &karpenter::Options::default()).await?;
    story.detail(&format!(
        "{}; NodePool {NODE_POOL} of instance types {}",
        autoscaler.version,
        karpenter::Options::default()
            .instance_types
            .iter()
            .map(karpenter::InstanceType::name)
            .collect::<Vec<_>>()
            .join(", ")
    ));
    // The agents run on every node Karpenter launches, as the meshes' DaemonSets do, and
    // tolerate every taint.
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), "mesh-system");
    for app in ["mesh-cni", "mesh-node-proxy"] {
        let ds: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": format!("{app}-autoscaled")},
            "spec": {
                "selector": {"matchLabels": {"app": app, AGENT_LABEL: "true"}},
                "template": {
                    "metadata": {"labels": {"app": app, AGENT_LABEL: "true"},
                                 "annotations": {READY_AFTER: AGENT_DELAY}},
                    "spec": {"nodeSelector": {"karpenter.sh/nodepool": NODE_POOL},
                             "tolerations": [{"operator": "Exists"}],
                             "containers": [{"name": "agent", "image": "registry.invalid/agent:1",
                                             "resources": {"requests": {"cpu": "10m"}}}]},
                },
            },
        }))?;
        daemonsets.create(&PostParams::default(), &ds).await?;
    }

    Ok(autoscaler)
}

/// The NodeClaim Karpenter launches for the pending pod, its instance type and its node, once
/// the node registered (its taints at registration told).
async fn launched(
    story: &mut Story,
    client: &kube::Client,
    claims: &Api<DynamicObject>,
) -> anyhow::Result<(String, String, String)> {
    story.say("Karpenter launches a node for it");
    let (claim, instance_type, node) = poll(
        "Karpenter to launch a node",
        Duration::from_secs(60),
        || {
            let claims = claims.clone();
            async move {
                let list = claims.list(&ListParams::default()).await.ok()?;
                let c = list.items.into_iter().next()?;
                let node = c.data["status"]["nodeName"].as_str()?.to_owned();
                let instance_type = c
                    .metadata
                    .labels
                    .as_ref()?
                    .get("node.kubernetes.io/instance-type")?
                    .clone();
                Some((c.metadata.name?, instance_type, node))
            }
        },
    )
    .await?;
    let nodes: Api<Node> = Api::all(client.clone());
    // The node as the API server stored it at registration: its first resourceVersion's taints
    // are what the admission policy added (nothing else writes before the kubelet fake).
    let registered = poll("the node to register", Duration::from_secs(60), || {
        let nodes = nodes.clone();
        let node = node.clone();
        async move { nodes.get_opt(&node).await.ok()? }
    })
    .await?;
    let taints_at_registration = taint_keys(&registered);
    story.detail(&format!(
        "NodeClaim {claim} ({instance_type}) became node {node}, first seen with taints {taints_at_registration:?}"
    ));

    Ok((claim, instance_type, node))
}

/// Deletes every pod on `node` but its DaemonSets' (the agents).
async fn remove_workload(client: &kube::Client, node: &str) -> anyhow::Result<()> {
    let all: Api<Pod> = Api::all(client.clone());
    for p in all
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
    {
        let daemon = p
            .metadata
            .owner_references
            .as_ref()
            .is_some_and(|os| os.iter().any(|o| o.kind == "DaemonSet"));
        let (Some(ns), Some(name)) = (p.metadata.namespace, p.metadata.name) else {
            continue;
        };
        if !daemon && p.metadata.deletion_timestamp.is_none() {
            match Api::<Pod>::namespaced(client.clone(), &ns)
                .delete(&name, &DeleteParams::default().grace_period(0))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// The workload leaves: Karpenter's consolidation removes the empty node (nothing of
/// meshgate's keeps it), then Karpenter, KWOK and their controller manager stop.
pub async fn scale_down(
    story: &mut Story,
    client: &kube::Client,
    autoscaler: Autoscaler,
    node: &str,
) -> anyhow::Result<()> {
    story.say(&format!(
        "The workload leaves: Karpenter consolidates the empty node {node}"
    ));
    let start = Instant::now();
    remove_workload(client, node).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let claims = Api::<DynamicObject>::all_with(client.clone(), &karpenter::node_claims());
    let removed = poll(
        "Karpenter to remove the node",
        Duration::from_secs(180),
        || {
            let (nodes, claims, node) = (nodes.clone(), claims.clone(), node.to_owned());
            async move {
                // A pod of the steps before that was bound after the first pass leaves too.
                remove_workload(client, &node).await.ok()?;
                let gone = nodes.get_opt(&node).await.ok()?.is_none();
                let none = claims
                    .list(&ListParams::default())
                    .await
                    .ok()?
                    .items
                    .is_empty();
                (gone && none).then_some(())
            }
        },
    )
    .await;
    if let Err(e) = removed {
        // What Karpenter said about disrupting it, and what is still on the node.
        let said: Vec<String> = autoscaler
            .karpenter_log(400)
            .lines()
            .filter(|l| l.contains("disrupt") || l.contains("consolidat") || l.contains(node))
            .map(str::to_owned)
            .collect();
        let left: Vec<String> = Api::<Pod>::all(client.clone())
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map(|l| {
                l.items
                    .into_iter()
                    .filter_map(|p| p.metadata.name)
                    .collect()
            })
            .unwrap_or_default();
        // Told, not fatal: the rest of the story does not need the node gone. Karpenter's own
        // termination (its NodeClaim deleted) then removes it.
        story.detail(&format!(
            "Karpenter had not consolidated {node} {:.0} s after its pods left ({e}); pods still on it {left:?}; Karpenter's last lines on disruption:",
            start.elapsed().as_secs_f64()
        ));
        for line in &said[said.len().saturating_sub(10)..] {
            story.detail(&format!("  {line}"));
        }
        let terminated = Instant::now();
        let _ = claims
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        poll(
            "Karpenter to terminate the node",
            Duration::from_secs(90),
            || {
                let (nodes, node) = (nodes.clone(), node.to_owned());
                async move { nodes.get_opt(&node).await.ok()?.is_none().then_some(()) }
            },
        )
        .await?;
        story.detail(&format!(
            "the demo deleted its NodeClaim: Karpenter drained and removed {node} in {:.1} s",
            terminated.elapsed().as_secs_f64()
        ));
    } else {
        story.detail(&format!(
            "{node} and its NodeClaim are gone {:.1} s after its pods left: no taint, resource or finalizer of meshgate's kept them",
            start.elapsed().as_secs_f64()
        ));
    }
    autoscaler.check_alive()?;
    drop(autoscaler);
    Ok(())
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn initialized(claim: &DynamicObject) -> bool {
    claim.data["status"]["conditions"]
        .as_array()
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Initialized" && c["status"] == "True")
        })
}

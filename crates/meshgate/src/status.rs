//! `meshgate status`: what meshgate is doing, per node, per policy, and for its webhook.

use std::collections::BTreeMap;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use meshgate_api::GateNode;
use meshgate_api::{MutationPolicy, NodeGate};
use meshgate_core::nodegate::{
    AgentPod, AgentState, DaemonSetView, agent_state, decide_node, has_taint,
};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRow {
    pub gate: String,
    pub node: String,
    /// Ready agents of all the gate's agents, e.g. `2/2`.
    pub agents_ready: String,
    pub state: String,
    pub tainted: bool,
    /// The gate resource's advertised count, if the gate has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyRow {
    pub policy: String,
    pub kinds: String,
    pub ready: String,
    /// Which path applies the policy at admission: `native` (a MutatingAdmissionPolicy the
    /// API server evaluates), `webhook`, or `-` (not reported yet).
    pub served_by: String,
    /// Why it is on the webhook (the `Native` condition's message), when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_by_reason: Option<String>,
    pub existing_matched: u32,
    pub existing_mutated: u32,
    pub last_applied: String,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookRow {
    pub configuration: String,
    pub webhook: String,
    pub target: String,
    pub failure_policy: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Status {
    pub nodes: Vec<NodeRow>,
    pub policies: Vec<PolicyRow>,
    pub webhooks: Vec<WebhookRow>,
    /// How new nodes get the startup taint at registration: the admission policies meshgate
    /// installed, the webhook, or (neither) the controller after registration.
    pub node_taint: String,
}

/// Reads the cluster.
pub async fn collect(client: &kube::Client) -> anyhow::Result<Status> {
    let gates = Api::<NodeGate>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let nodes = Api::<GateNode>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let rows = node_rows(
        client,
        &gates.items,
        &nodes.items,
        meshgate_controller::now(),
    )
    .await?;
    let policies = Api::<MutationPolicy>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|p| {
            let status = p.status.clone().unwrap_or_default();
            let existing = status.existing.clone().unwrap_or_default();
            let native = status.conditions.iter().find(|c| c.type_ == "Native");
            PolicyRow {
                policy: p.metadata.name.clone().unwrap_or_default(),
                kinds: if p.spec.match_.kinds.is_empty() {
                    "Pod".into()
                } else {
                    p.spec.match_.kinds.join(",")
                },
                ready: status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Ready")
                    .map_or_else(|| "-".into(), |c| c.status.clone()),
                served_by: native.map_or_else(
                    || "-".into(),
                    |c| {
                        if c.status == "True" {
                            "native"
                        } else {
                            "webhook"
                        }
                        .into()
                    },
                ),
                served_by_reason: native
                    .filter(|c| c.status != "True")
                    .map(|c| c.message.clone()),
                existing_matched: existing.matched,
                existing_mutated: existing.mutated,
                last_applied: existing
                    .last_applied
                    .map_or_else(|| "-".into(), |t| t.0.to_string()),
            }
        })
        .collect();
    let mut webhooks = Vec::new();
    for mwc in Api::<MutatingWebhookConfiguration>::all(client.clone())
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=meshgate"))
        .await?
    {
        for w in mwc.webhooks.unwrap_or_default() {
            let target = w.client_config.url.clone().unwrap_or_else(|| {
                w.client_config
                    .service
                    .as_ref()
                    .map(|s| {
                        format!(
                            "svc/{}.{}{}",
                            s.name,
                            s.namespace,
                            s.path.clone().unwrap_or_default()
                        )
                    })
                    .unwrap_or_default()
            });
            webhooks.push(WebhookRow {
                configuration: mwc.metadata.name.clone().unwrap_or_default(),
                webhook: w.name,
                target,
                failure_policy: w.failure_policy.unwrap_or_default(),
            });
        }
    }
    Ok(Status {
        node_taint: node_taint_path(client, &webhooks).await,
        nodes: rows,
        policies,
        webhooks,
    })
}

/// Which path taints nodes at registration (see docs/design.md, "Taint at registration"): the
/// node-taint admission policies (labelled with their gate, which Helm keeps) in the version the
/// API server serves (`v1beta1` on 1.34 and 1.35), else the webhook's node rule.
async fn node_taint_path(client: &kube::Client, webhooks: &[WebhookRow]) -> String {
    let policies: Vec<String> = match crate::discovery::policy_api(client).await {
        Some(api) => {
            let (group, version) = api
                .api_version()
                .split_once('/')
                .unwrap_or(("admissionregistration.k8s.io", "v1"));
            let resource = kube::api::ApiResource::from_gvk_with_plural(
                &kube::api::GroupVersionKind::gvk(group, version, "MutatingAdmissionPolicy"),
                "mutatingadmissionpolicies",
            );
            Api::<kube::api::DynamicObject>::all_with(client.clone(), &resource)
                .list_metadata(&ListParams::default().labels("meshgate.dev/node-gate"))
                .await
                .map(|l| {
                    l.items
                        .into_iter()
                        .filter_map(|p| p.metadata.name)
                        .collect()
                })
                .unwrap_or_default()
        }
        None => Vec::new(),
    };
    if !policies.is_empty() {
        format!("admission policy ({})", policies.join(", "))
    } else if webhooks.iter().any(|w| w.webhook.starts_with("nodes.")) {
        "webhook (/mutate/node-taint)".into()
    } else {
        "none at registration: the controller taints nodes after they register".into()
    }
}

fn table_of(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect::<Vec<_>>()
            .join("   ")
            .trim_end()
            .to_owned()
            + "\n"
    };
    let mut out = line(headers.iter().map(|h| (*h).to_owned()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

/// kubectl-style tables.
pub fn table(s: &Status) -> String {
    let mut out = String::from("NODES\n");
    out.push_str(&table_of(
        &["GATE", "NODE", "AGENTS", "STATE", "TAINTED", "RESOURCE"],
        s.nodes
            .iter()
            .map(|r| {
                vec![
                    r.gate.clone(),
                    r.node.clone(),
                    r.agents_ready.clone(),
                    r.state.clone(),
                    r.tainted.to_string(),
                    r.resource.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect(),
    ));
    out.push_str("\nPOLICIES\n");
    out.push_str(&table_of(
        &[
            "POLICY",
            "KINDS",
            "READY",
            "SERVED-BY",
            "EXISTING-MATCHED",
            "EXISTING-MUTATED",
            "LAST-APPLIED",
        ],
        s.policies
            .iter()
            .map(|r| {
                vec![
                    r.policy.clone(),
                    r.kinds.clone(),
                    r.ready.clone(),
                    r.served_by.clone(),
                    r.existing_matched.to_string(),
                    r.existing_mutated.to_string(),
                    r.last_applied.clone(),
                ]
            })
            .collect(),
    ));
    out.push_str(&format!("\nNODE TAINT AT REGISTRATION: {}\n", s.node_taint));
    out.push_str("\nWEBHOOKS\n");
    out.push_str(&table_of(
        &["CONFIGURATION", "WEBHOOK", "TARGET", "FAILURE-POLICY"],
        s.webhooks
            .iter()
            .map(|r| {
                vec![
                    r.configuration.clone(),
                    r.webhook.clone(),
                    r.target.clone(),
                    r.failure_policy.clone(),
                ]
            })
            .collect(),
    ));
    out
}

/// Per gate and selected node: the agents' states and the gate's decision, computed by the same
/// rule the controller applies (`meshgate_core::nodegate::agent_state` and `decide_node`), from
/// the agent pods and DaemonSets listed now.
pub async fn node_rows(
    client: &kube::Client,
    gates: &[NodeGate],
    nodes: &[GateNode],
    now: i64,
) -> anyhow::Result<Vec<NodeRow>> {
    let slices = dra_slices(client, gates).await;
    // As the controller decides: a DRA gate, where slices can be listed, on a node whose
    // kubelet prepares the claim; the node status elsewhere.
    let offer = |g: &NodeGate, node: &GateNode| match (&slices, &g.spec.resource) {
        (Some(names), Some(r))
            if r.provider == meshgate_api::node_gate::ResourceProvider::Dra
                && meshgate_core::dra::kubelet_falls_back(node.kubelet_version()).is_none() =>
        {
            meshgate_core::nodegate::Offer::Dra {
                slice: names.contains(&meshgate_core::dra::slice_name(
                    g.metadata.name.as_deref().unwrap_or_default(),
                    node.metadata.name.as_deref().unwrap_or_default(),
                )),
            }
        }
        _ => meshgate_core::nodegate::Offer::NodeStatus,
    };
    let (pods_by_node, daemonsets) = agents_listed(client, gates).await?;
    let mut rows = Vec::new();
    let empty = BTreeMap::new();
    for g in gates {
        for n in nodes {
            let labels = n.metadata.labels.as_ref().unwrap_or(&empty);
            if !g.spec.node_selector.matches(labels) {
                continue;
            }
            let name = n.metadata.name.clone().unwrap_or_default();
            let agents: Vec<AgentState> = g
                .spec
                .agents
                .iter()
                .map(|a| {
                    let daemonset = match &a.daemon_set {
                        None => DaemonSetView::Unnamed,
                        Some(ds) => match daemonsets
                            .get(&(a.namespace.clone(), ds.clone()))
                            .and_then(|d| d.spec.as_ref())
                        {
                            Some(spec) => DaemonSetView::Template(&spec.template),
                            None => DaemonSetView::Absent,
                        },
                    };
                    agent_state(
                        a,
                        pods_by_node.get(&name).into_iter().flatten(),
                        daemonset,
                        n,
                        &g.spec.taint.key,
                    )
                })
                .collect();
            let offered = offer(g, n);
            let (taints, d) = decide_node(&g.name_any(), &g.spec, n, &agents, offered, now);
            let resource = g.spec.resource.as_ref().map(|r| {
                let status = n
                    .status
                    .as_ref()
                    .and_then(|s| s.capacity.as_ref())
                    .and_then(|c| c.get(&r.name))
                    .map_or_else(|| "-".to_owned(), |q| q.0.clone());
                match offered {
                    meshgate_core::nodegate::Offer::Dra { slice: true } => "ResourceSlice".into(),
                    meshgate_core::nodegate::Offer::Dra { slice: false } => status,
                    // A DRA gate on a kubelet that does not prepare the claim: say why.
                    meshgate_core::nodegate::Offer::NodeStatus
                        if r.provider == meshgate_api::node_gate::ResourceProvider::Dra =>
                    {
                        if slices.is_some() {
                            format!(
                                "{status} (node status: kubelet {})",
                                n.kubelet_version().unwrap_or("version unknown")
                            )
                        } else {
                            format!("{status} (node status: DRA not served)")
                        }
                    }
                    meshgate_core::nodegate::Offer::NodeStatus => status,
                }
            });
            let ready_count = agents
                .iter()
                .filter(|a| matches!(a, AgentState::Ready { .. } | AgentState::NotTargeted))
                .count();
            rows.push(NodeRow {
                gate: g.metadata.name.clone().unwrap_or_default(),
                node: name,
                agents_ready: format!("{ready_count}/{}", agents.len()),
                state: d.state.as_str().to_owned(),
                tainted: has_taint(&g.spec, &taints),
                resource,
            });
        }
    }
    Ok(rows)
}

/// `meshgate status pod NS/NAME`: why a pod is waiting.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodReport {
    pub pod: String,
    pub node: Option<String>,
    pub phase: Option<String>,
    /// The webhook's verdict (`meshgate.dev/gate`): `gated: <checks>` or `none: <why>`; absent
    /// when no profile selected the pod (or meshgate did not see it).
    pub verdict: Option<String>,
    pub gated: bool,
    /// The gate's checks (its arguments), e.g. `tcp-listening 15008`.
    pub waits_for: Option<String>,
    /// `not-gated`, `not-started`, `waiting`, `passed`, `timed-out`, `failed`.
    pub gate: String,
    /// Seconds the gate has been running (waiting), when it runs.
    pub waiting_seconds: Option<i64>,
    pub restarts: i32,
    /// One sentence for a person.
    pub summary: String,
    /// The node gates that select the pod's node, with their state on it.
    pub node_gates: Vec<NodeRow>,
}

/// Reads one pod, its gate container and its node's gates.
pub async fn pod(client: &kube::Client, namespace: &str, name: &str) -> anyhow::Result<PodReport> {
    use meshgate_core::repair::{GateProgress, gate_progress};
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await?
        .ok_or_else(|| anyhow::anyhow!("pod {namespace}/{name} not found"))?;
    let now = meshgate_controller::now();
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let verdict = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(meshgate_api::names::GATE_VERDICT))
        .cloned();
    let waits_for = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.name == meshgate_api::names::GATE_CONTAINER)
        })
        .map(|c| c.args.clone().unwrap_or_default().join(" "));
    let progress = gate_progress(&pod);
    let (gate, waiting_seconds, restarts) = match &progress {
        GateProgress::NotGated => ("not-gated", None, 0),
        GateProgress::NotStarted { .. } => ("not-started", None, 0),
        GateProgress::Waiting {
            since, restarts, ..
        } => ("waiting", since.map(|s| (now - s).max(0)), *restarts),
        GateProgress::Passed { .. } => ("passed", None, 0),
        GateProgress::TimedOut { restarts } => ("timed-out", None, *restarts),
        GateProgress::Failed { .. } => ("failed", None, 0),
    };
    let mut node_gates = Vec::new();
    if let Some(n) = &node
        && let Some(node_obj) = Api::<GateNode>::all(client.clone()).get_opt(n).await?
    {
        let gates = Api::<NodeGate>::all(client.clone())
            .list(&ListParams::default())
            .await?;
        node_gates = node_rows(client, &gates.items, &[node_obj], now).await?;
    }
    let on = node.as_deref().unwrap_or("no node yet");
    let held: Vec<String> = node_gates
        .iter()
        .filter(|r| r.tainted || r.state != "Ready")
        .map(|r| format!("gate {} is {} (agents {})", r.gate, r.state, r.agents_ready))
        .collect();
    let node_note = if held.is_empty() {
        String::new()
    } else {
        format!("; on {on}: {}", held.join(", "))
    };
    let summary = match &progress {
        GateProgress::NotGated => match &verdict {
            Some(v) => format!("not gated ({v})"),
            None => "not gated: no profile selected the pod, or meshgate's webhook did not see it"
                .to_owned(),
        },
        GateProgress::NotStarted { reason } => format!(
            "the gate has not started yet{}{node_note}",
            reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        ),
        GateProgress::Waiting { last_timed_out, .. } => format!(
            "the gate has been waiting {}s for: {}{}{node_note}",
            waiting_seconds.unwrap_or(0),
            waits_for.as_deref().unwrap_or("?"),
            if *last_timed_out {
                " (its previous run timed out)"
            } else {
                ""
            }
        ),
        GateProgress::Passed { .. } => "the gate passed: the mesh had set the pod up".to_owned(),
        GateProgress::TimedOut { restarts } => format!(
            "the gate timed out ({restarts} restarts): the mesh did not set the pod up in time{node_note}"
        ),
        GateProgress::Failed { exit } => {
            format!("the gate failed with exit code {exit} (see its log)")
        }
    };
    Ok(PodReport {
        pod: format!("{namespace}/{name}"),
        node,
        phase: pod.status.as_ref().and_then(|s| s.phase.clone()),
        gated: waits_for.is_some(),
        verdict,
        waits_for,
        gate: gate.to_owned(),
        waiting_seconds,
        restarts,
        summary,
        node_gates,
    })
}

/// The pod report as text.
pub fn pod_text(r: &PodReport) -> String {
    let mut out = format!(
        "POD {}\nNODE {}\nPHASE {}\nVERDICT {}\nGATE {}{}\nWAITS FOR {}\n\n{}\n",
        r.pod,
        r.node.as_deref().unwrap_or("-"),
        r.phase.as_deref().unwrap_or("-"),
        r.verdict.as_deref().unwrap_or("-"),
        r.gate,
        r.waiting_seconds
            .map(|s| format!(" ({s}s)"))
            .unwrap_or_default(),
        r.waits_for.as_deref().unwrap_or("-"),
        r.summary
    );
    if !r.node_gates.is_empty() {
        out.push('\n');
        out.push_str(&table_of(
            &["GATE", "NODE", "AGENTS-READY", "STATE", "TAINTED"],
            r.node_gates
                .iter()
                .map(|n| {
                    vec![
                        n.gate.clone(),
                        n.node.clone(),
                        n.agents_ready.clone(),
                        n.state.clone(),
                        n.tainted.to_string(),
                    ]
                })
                .collect(),
        ));
    }
    out
}

/// The names of meshgate's ResourceSlices when a gate offers its resource through DRA; `None`
/// where none can be listed (DRA not served) or no gate uses DRA.
async fn dra_slices(
    client: &kube::Client,
    gates: &[NodeGate],
) -> Option<std::collections::BTreeSet<String>> {
    // DRA gates' slices, as the controller reads them; where none can be listed (DRA not
    // served), gates are decided as the controller then does: on the node status.
    let dra = gates.iter().any(|g| {
        g.spec
            .resource
            .as_ref()
            .is_some_and(|r| r.provider == meshgate_api::node_gate::ResourceProvider::Dra)
    });
    if dra {
        Api::<k8s_openapi::api::resource::v1::ResourceSlice>::all(client.clone())
            .list(
                &ListParams::default()
                    .labels(&format!("{}=meshgate", meshgate_api::names::MANAGED_BY)),
            )
            .await
            .ok()
            .map(|l| {
                l.items
                    .into_iter()
                    .filter_map(|s| s.metadata.name)
                    .collect()
            })
    } else {
        None
    }
}

/// The agent pods (by node) and DaemonSets (by namespace and name) of every gate's agents'
/// namespaces.
async fn agents_listed(
    client: &kube::Client,
    gates: &[NodeGate],
) -> anyhow::Result<(AgentPods, DaemonSets)> {
    let mut pods_by_node: BTreeMap<String, Vec<AgentPod>> = BTreeMap::new();
    let mut daemonsets: BTreeMap<(String, String), DaemonSet> = BTreeMap::new();
    let mut listed = std::collections::BTreeSet::new();
    for g in gates {
        for a in &g.spec.agents {
            if !listed.insert(a.namespace.clone()) {
                continue;
            }
            for pod in Api::<Pod>::namespaced(client.clone(), &a.namespace)
                .list(&ListParams::default())
                .await?
            {
                if let Some((node, summary)) = AgentPod::of(&pod) {
                    pods_by_node.entry(node).or_default().push(summary);
                }
            }
            for ds in Api::<DaemonSet>::namespaced(client.clone(), &a.namespace)
                .list(&ListParams::default())
                .await?
            {
                let name = ds.metadata.name.clone().unwrap_or_default();
                daemonsets.insert((a.namespace.clone(), name), ds);
            }
        }
    }
    Ok((pods_by_node, daemonsets))
}

/// Agent pods by node.
type AgentPods = BTreeMap<String, Vec<AgentPod>>;
/// DaemonSets by `(namespace, name)`.
type DaemonSets = BTreeMap<(String, String), DaemonSet>;

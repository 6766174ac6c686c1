//! `meshgate check`: is the install healthy? Each check passes or fails with a hint, like
//! `linkerd check`; any failure makes the command exit non-zero.
//!
//! * `api-server`: its version, and which admission paths it serves (MutatingAdmissionPolicy:
//!   node taint and native policies in process; else the webhook only). Informational.
//! * `crds`: meshgate's three CRDs exist and are Established.
//! * `webhook-configuration`: the `meshgate` MutatingWebhookConfiguration exists and every
//!   webhook in it has a caBundle.
//! * `webhook-certificate`: the serving certificate (Secret `meshgate-webhook-tls`) is valid now,
//!   signed by a CA in the configuration's caBundle and names the webhook Service
//!   (`meshgate_pki::verify_serving`, what the API server checks before calling the webhook).
//! * `components`: the webhook and controller Deployments have an available replica.
//! * `agents`: each NodeGate's agents exist (their DaemonSet, or pods matching the selector).
//! * `rbac`: SubjectAccessReviews of the components' ServiceAccounts for the writes and reads
//!   their paths need.
//! * `gates`: no NodeGate reports `Degraded`.
//! * `control-plane`: where a gate waits for an agent that needs the mesh's control plane
//!   (Istio's node proxy needs istiod), the control plane's pods tolerate the gate's taint;
//!   otherwise a node that only the gate's taint keeps the control plane from never becomes
//!   ready (docs/design.md, "Autoscalers and other controllers").
//! * `autoscalers`: for each node autoscaler found (Karpenter's NodePools, a Cluster
//!   Autoscaler's Deployment or status ConfigMap), each gate's taint is a startup taint to it and
//!   mesh pods request nothing it cannot provision for (`meshgate_core::autoscaler`); otherwise
//!   it launches no node for mesh pods, or one after another, and the check names the fix.

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, PostParams};
use meshgate_api::NodeGate;
use serde::Serialize;
use serde_json::json;

/// One check's result.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

fn pass(name: &str, message: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        ok: true,
        message: message.into(),
        hint: None,
    }
}

fn fail(name: &str, message: impl Into<String>, hint: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        ok: false,
        message: message.into(),
        hint: Some(hint.into()),
    }
}

/// Runs every check against the install in `namespace`.
pub async fn run(client: &kube::Client, namespace: &str) -> anyhow::Result<Vec<Check>> {
    let mut out = vec![api_server_check(client).await?, crds_check(client).await?];
    out.extend(webhook_checks(client, namespace).await?);
    out.extend(component_checks(client, namespace).await?);
    // Agents and gates.
    let gates = Api::<NodeGate>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    for gate in &gates {
        out.extend(gate_checks(client, gate).await?);
    }
    for gate in gates.iter().filter(|g| g.spec.taint_on_create) {
        out.push(registration_check(client, gate).await);
    }
    // Which layer offers each gate's resource on this cluster, as its controller found it.
    for gate in gates.iter().filter(|g| g.spec.resource.is_some()) {
        out.push(layers_check(gate, namespace));
    }
    out.extend(autoscaler_checks(client, namespace, &gates).await);
    out.push(rbac_check(client, namespace).await?);
    Ok(out)
}

/// The API server's version, and whether it serves the admission policy API.
async fn api_server_check(client: &kube::Client) -> anyhow::Result<Check> {
    let version = client.apiserver_version().await?;
    let paths = match crate::discovery::policy_api(client).await {
        Some(api) => format!(
            "MutatingAdmissionPolicy ({}) served: node taint at registration and native policies run in the API server",
            api.api_version()
        ),
        None => "no MutatingAdmissionPolicy API: node taint and policies go through the webhook"
            .to_owned(),
    };
    Ok(pass(
        "api-server",
        format!("Kubernetes {}; {paths}", version.git_version),
    ))
}

/// meshgate's CRDs, established.
async fn crds_check(client: &kube::Client) -> anyhow::Result<Check> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut missing = Vec::new();
    for name in [
        "nodegates.meshgate.dev",
        "mutationpolicies.meshgate.dev",
        "namespacedmutationpolicies.meshgate.dev",
    ] {
        let established = crds.get_opt(name).await?.is_some_and(|c| {
            c.status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
        if !established {
            missing.push(name);
        }
    }
    Ok(if missing.is_empty() {
        pass("crds", "3 CRDs established")
    } else {
        fail(
            "crds",
            format!("missing or not established: {}", missing.join(", ")),
            "run `meshgate install --profile <profile> --apply` (it applies the CRDs)",
        )
    })
}

/// The webhook configuration (each webhook with a caBundle) and the serving certificate.
async fn webhook_checks(client: &kube::Client, namespace: &str) -> anyhow::Result<Vec<Check>> {
    let mut out = Vec::new();
    let mwcs: Api<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration> =
        Api::all(client.clone());
    let mwc = mwcs.get_opt("meshgate").await?;
    let mut bundle = None;
    match &mwc {
        None => out.push(fail(
            "webhook-configuration",
            "MutatingWebhookConfiguration meshgate not found",
            "run `meshgate install --profile <profile> --apply`",
        )),
        Some(mwc) => {
            let hooks = mwc.webhooks.clone().unwrap_or_default();
            let without: Vec<&str> = hooks
                .iter()
                .filter(|h| {
                    h.client_config
                        .ca_bundle
                        .as_ref()
                        .is_none_or(|b| b.0.is_empty())
                })
                .map(|h| h.name.as_str())
                .collect();
            bundle = hooks
                .iter()
                .find_map(|h| h.client_config.ca_bundle.as_ref())
                .map(|b| String::from_utf8_lossy(&b.0).into_owned());
            out.push(if without.is_empty() {
                pass(
                    "webhook-configuration",
                    format!("{} webhooks, each with a caBundle", hooks.len()),
                )
            } else {
                fail(
                    "webhook-configuration",
                    format!("no caBundle in {}", without.join(", ")),
                    "the controller writes the caBundle when it has created the certificates; is meshgate-controller running (kubectl -n <ns> logs deploy/meshgate-controller)?",
                )
            });
        }
    }
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get_opt("meshgate-webhook-tls")
        .await?;
    let cert = secret
        .as_ref()
        .and_then(|s| s.data.as_ref())
        .and_then(|d| d.get("tls.crt"))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned());
    let dns = format!("meshgate-webhook.{namespace}.svc");
    out.push(match (cert, bundle) {
        (None, _) => fail(
            "webhook-certificate",
            format!("Secret {namespace}/meshgate-webhook-tls has no tls.crt"),
            "the controller creates it on its first start; is meshgate-controller running?",
        ),
        (Some(_), None) => fail(
            "webhook-certificate",
            "no caBundle to check the certificate against",
            "see webhook-configuration",
        ),
        (Some(cert), Some(bundle)) => {
            let now = meshgate_controller::now();
            match meshgate_pki::verify_serving(&cert, &bundle, &dns, now) {
                Ok(not_after) => pass(
                    "webhook-certificate",
                    format!(
                        "valid for {dns}, signed by the caBundle's CA, {} days left",
                        (not_after - now) / 86_400
                    ),
                ),
                Err(why) if why.contains("expired") => fail(
                    "webhook-certificate",
                    why,
                    "the controller renews the certificate before it expires: is meshgate-controller running and leading? Deleting the Secret makes it issue a new one",
                ),
                Err(why) if why.contains("caBundle") => fail(
                    "webhook-certificate",
                    why,
                    "the API server cannot verify the webhook (failure policy Ignore: pods are admitted ungated); the controller writes the caBundle of its CA: restart meshgate-controller, or re-run `meshgate install --apply`",
                ),
                Err(why) => fail(
                    "webhook-certificate",
                    why,
                    "delete the Secret meshgate-webhook-tls: the controller issues a new one",
                ),
            }
        }
    });

    Ok(out)
}

/// The webhook's and the controller's Deployments, each with an available replica.
async fn component_checks(client: &kube::Client, namespace: &str) -> anyhow::Result<Vec<Check>> {
    let mut out = Vec::new();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    for component in ["meshgate-webhook", "meshgate-controller"] {
        let available = deployments
            .get_opt(component)
            .await?
            .and_then(|d| d.status)
            .and_then(|s| s.available_replicas)
            .unwrap_or(0);
        out.push(if available > 0 {
            pass("components", format!("{component}: {available} available"))
        } else {
            fail(
                "components",
                format!("{component}: no available replica"),
                format!("kubectl -n {namespace} describe deployment {component}"),
            )
        });
    }

    Ok(out)
}

/// A gate's agents present, the mesh control plane they need tolerating its taint, and the
/// gate not Degraded.
async fn gate_checks(client: &kube::Client, gate: &NodeGate) -> anyhow::Result<Vec<Check>> {
    let mut out = Vec::new();
    let gname = gate.metadata.name.clone().unwrap_or_default();
    for agent in &gate.spec.agents {
        let found = match &agent.daemon_set {
            Some(ds) => Api::<DaemonSet>::namespaced(client.clone(), &agent.namespace)
                .get_opt(ds)
                .await?
                .is_some(),
            None => {
                let selector = agent
                    .selector
                    .match_labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",");
                !Api::<Pod>::namespaced(client.clone(), &agent.namespace)
                    .list_metadata(&ListParams::default().labels(&selector).limit(1))
                    .await?
                    .items
                    .is_empty()
            }
        };
        let what = match &agent.daemon_set {
            Some(ds) => format!("DaemonSet {}/{ds}", agent.namespace),
            None => format!("pods of agent {} in {}", agent.name, agent.namespace),
        };
        out.push(if found {
            pass("agents", format!("gate {gname}: {what} present"))
        } else {
            fail(
                "agents",
                format!("gate {gname}: {what} missing"),
                format!(
                    "install the mesh's agent, or fix the gate's spec.agents (`kubectl get nodegate {gname} -o yaml`); until it appears, new nodes wait at most missingAgentTimeoutSeconds"
                ),
            )
        });
    }
    let taint = k8s_openapi::api::core::v1::Taint {
        key: gate.spec.taint.key.clone(),
        effect: gate.spec.taint.effect.as_str().to_owned(),
        ..Default::default()
    };
    for needs in gate.spec.agents.iter().filter_map(|a| {
        meshgate_api::mesh::agent_record(&a.namespace, a.daemon_set.as_deref()?)?.needs
    }) {
        let Some(deployment) = Api::<Deployment>::namespaced(client.clone(), needs.namespace)
            .get_opt(needs.deployment)
            .await?
        else {
            continue;
        };
        let tolerated = deployment
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|s| s.tolerations)
            .unwrap_or_default()
            .iter()
            .any(|t| meshgate_core::nodegate::tolerates(t, &taint));
        let what = format!("{}/{}", needs.namespace, needs.deployment);
        out.push(if tolerated {
            pass(
                "control-plane",
                format!("gate {gname}: {what} tolerates {}", taint.key),
            )
        } else {
            fail(
                "control-plane",
                format!(
                    "gate {gname} waits for an agent that needs {what}, which does not tolerate the gate's taint {}: on nodes that only this taint keeps {what} from, the agent never becomes Ready and the taint never lifts",
                    taint.key
                ),
                format!(
                    "give {what} the toleration {{key: {}, operator: Exists, effect: {}}} ({} in the mesh's chart)",
                    taint.key, taint.effect, needs.tolerations_value
                ),
            )
        });
    }
    let degraded = gate
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Degraded" && c.status == "True");
    out.push(match degraded {
        None => pass("gates", format!("gate {gname}: not degraded")),
        Some(c) => fail(
            "gates",
            format!("gate {gname}: Degraded ({}): {}", c.reason, c.message),
            format!("kubectl describe nodegate {gname}"),
        ),
    });
    Ok(out)
}

/// Which layer offers a gate's resource on this cluster, as its controller found it.
fn layers_check(gate: &NodeGate, namespace: &str) -> Check {
    let gname = gate.metadata.name.clone().unwrap_or_default();
    let provider = gate
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "ResourceProvider"));
    let dra = gate
        .spec
        .resource
        .as_ref()
        .is_some_and(|r| r.provider == meshgate_api::node_gate::ResourceProvider::Dra);
    match (provider, dra) {
        (Some(c), _) => pass("layers", format!("gate {gname}: {}", c.message)),
        (None, false) => pass(
            "layers",
            format!("gate {gname}: the resource is advertised in ready nodes' status"),
        ),
        (None, true) => fail(
            "layers",
            format!(
                "gate {gname}: its controller has not reported whether DRA works on this cluster (no ResourceProvider condition)"
            ),
            format!(
                "the controller runs? `kubectl -n {namespace} get deployment meshgate-controller`"
            ),
        ),
    }
}

/// What the components' paths need of RBAC, asked of the API server.
async fn rbac_check(client: &kube::Client, namespace: &str) -> anyhow::Result<Check> {
    let reviews: Api<SubjectAccessReview> = Api::all(client.clone());
    let wants: [(&str, &str, &str, &str, &str); 6] = [
        ("meshgate-controller", "patch", "", "nodes", ""),
        (
            "meshgate-controller",
            "patch",
            "meshgate.dev",
            "nodegates",
            "status",
        ),
        ("meshgate-controller", "watch", "", "pods", ""),
        ("meshgate-webhook", "watch", "", "namespaces", ""),
        (
            "meshgate-webhook",
            "watch",
            "meshgate.dev",
            "mutationpolicies",
            "",
        ),
        ("meshgate-webhook", "list", "", "limitranges", ""),
    ];
    let mut denied = Vec::new();
    for (sa, verb, group, resource, sub) in wants {
        let review: SubjectAccessReview = serde_json::from_value(json!({
            "spec": {
                "user": format!("system:serviceaccount:{namespace}:{sa}"),
                "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{namespace}"), "system:authenticated"],
                "resourceAttributes": {"verb": verb, "group": group, "resource": resource, "subresource": sub},
            }
        }))?;
        let allowed = reviews
            .create(&PostParams::default(), &review)
            .await?
            .status
            .is_some_and(|s| s.allowed);
        if !allowed {
            let what = if sub.is_empty() {
                resource.to_owned()
            } else {
                format!("{resource}/{sub}")
            };
            denied.push(format!("{sa} may not {verb} {what}"));
        }
    }
    Ok(if denied.is_empty() {
        pass("rbac", "the components may do what their paths need")
    } else {
        fail(
            "rbac",
            denied.join("; "),
            "re-run `meshgate install --profile <profile> --apply` (it renders each component's RBAC)",
        )
    })
}

/// Whether a node registering now gets the gate's taint: a Node (with the labels of the gate's
/// node selector) created with `dryRun`, through every admission step the API server runs.
/// Served is not enforced: an admission-policy API whose feature gate is off stores the
/// node-taint policy and never runs it.
async fn registration_check(client: &kube::Client, gate: &NodeGate) -> Check {
    let gname = gate.metadata.name.clone().unwrap_or_default();
    let key = &gate.spec.taint.key;
    let probe = json!({"metadata": {"name": format!("meshgate-check-{gname}"),
                                    "labels": gate.spec.node_selector.match_labels}});
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let created = match serde_json::from_value::<k8s_openapi::api::core::v1::Node>(probe) {
        Ok(node) => {
            Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
                .create(&dry, &node)
                .await
        }
        Err(e) => return fail("registration", format!("gate {gname}: {e}"), "report a bug"),
    };
    match created {
        Ok(node) => {
            let tainted = node
                .spec
                .and_then(|s| s.taints)
                .unwrap_or_default()
                .iter()
                .any(|t| &t.key == key);
            if tainted {
                pass(
                    "registration",
                    format!("gate {gname}: a node registering now gets {key} (a dry-run Node)"),
                )
            } else {
                fail(
                    "registration",
                    format!(
                        "gate {gname}: a node registering now does not get {key} (a dry-run Node came back without it): new nodes run pods before their agents are Ready until the controller taints them"
                    ),
                    "`meshgate install --apply` again: it proves that the API server runs MutatingAdmissionPolicies before it uses one (off where their feature gate is), else the webhook taints nodes",
                )
            }
        }
        Err(e) => fail(
            "registration",
            format!("gate {gname}: could not dry-run a Node: {e}"),
            "run `meshgate check` as a user that may create nodes (nothing is stored: dry run)",
        ),
    }
}

/// Whether the autoscalers found can provision for each live gate: its taint and what the
/// webhook's configuration makes mesh pods request.
async fn autoscaler_checks(
    client: &kube::Client,
    namespace: &str,
    gates: &[NodeGate],
) -> Vec<Check> {
    use meshgate_api::node_gate::ResourceProvider;
    use meshgate_core::autoscaler::{PodRequest, problems};
    let (found, notes) = crate::autoscaler::detect(client).await;
    let mut out: Vec<Check> = notes
        .into_iter()
        .map(|n| {
            fail(
                "autoscalers",
                format!("not read: {n}"),
                "run check with a user that may list them",
            )
        })
        .collect();
    if found.is_empty() {
        out.push(pass(
            "autoscalers",
            "no node autoscaler found (Karpenter, the Cluster Autoscaler)",
        ));
        return out;
    }
    // Whether mesh pods request the gate resource: the webhook's configuration says.
    let config =
        Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), namespace)
            .get_opt("meshgate-config")
            .await
            .ok()
            .flatten()
            .and_then(|c| c.data?.get("config.yaml").cloned())
            .and_then(|text| meshgate_api::GateConfig::from_yaml("meshgate-config", &text).ok());
    let requested = config.as_ref().is_some_and(|c| c.resource_gate.enabled);
    for gate in gates
        .iter()
        .filter(|g| g.metadata.deletion_timestamp.is_none())
    {
        let gname = gate.metadata.name.clone().unwrap_or_default();
        let request = match &gate.spec.resource {
            Some(r)
                if requested
                    && r.name
                        == config
                            .as_ref()
                            .map_or("", |c| c.resource_gate.resource.as_str()) =>
            {
                match r.provider {
                    ResourceProvider::Dra => PodRequest::Dra(&r.name),
                    ResourceProvider::NodeStatus => PodRequest::Resource(&r.name),
                }
            }
            _ => PodRequest::Nothing,
        };
        for f in &found {
            let name = f.autoscaler.map_or("an autoscaler", |a| a.name());
            let found_problems = problems(f, &gate.spec.taint.key, request);
            if found_problems.is_empty() {
                out.push(pass(
                    "autoscalers",
                    format!("gate {gname}: {name} knows its taint {} as a startup taint and can provision for mesh pods", gate.spec.taint.key),
                ));
            }
            for p in found_problems {
                out.push(fail(
                    "autoscalers",
                    format!("gate {gname}: {}", p.message),
                    p.fix,
                ));
            }
        }
    }
    out
}

/// The checks as text: one line each, hints below failures, and a last line.
pub fn text(checks: &[Check]) -> String {
    let mut out = String::new();
    for c in checks {
        out.push_str(&format!(
            "{} {:<22} {}\n",
            if c.ok { "[ok]  " } else { "[FAIL]" },
            c.name,
            c.message
        ));
        if let Some(h) = &c.hint {
            out.push_str(&format!("       hint: {h}\n"));
        }
    }
    let failed = checks.iter().filter(|c| !c.ok).count();
    if failed == 0 {
        out.push_str(&format!("all {} checks passed\n", checks.len()));
    } else {
        out.push_str(&format!("{failed} of {} checks failed\n", checks.len()));
    }
    out
}

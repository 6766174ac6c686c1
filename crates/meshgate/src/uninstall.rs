//! `meshgate uninstall`: removes meshgate from a cluster in the order that never leaves a pod or
//! a node held by a component that is gone.
//!
//! 1. The admission registrations meshgate made (labelled `app.kubernetes.io/managed-by:
//!    meshgate`): the MutatingWebhookConfiguration (so no API request waits for a webhook that is
//!    going away, whatever its failure policy) and the MutatingAdmissionPolicies and bindings
//!    (the node taint at registration, native policies): from here on nothing new is gated or
//!    tainted.
//! 2. The controller and the webhook (their Deployments in the install namespace, then their
//!    ReplicaSets and pods, without waiting for the garbage collector), and a wait until the
//!    controller's pods are gone: a running controller would put taints back.
//! 3. Every node: the taints meshgate owns (`meshgate_core::nodegate::uninstall_taints`: a
//!    NodeGate's key that is in meshgate's domain or recorded as added by meshgate; a taint that
//!    another component put on is left), its bookkeeping annotations, and the gate resources it
//!    advertised; the DRA gates' ResourceSlices and DeviceClasses. Then meshgate's finalizer
//!    comes off every NodeGate (no controller is left to remove it).
//! 4. The rest of what `install` created: the node plugin's DaemonSet, Services, ConfigMaps, Secrets (the controller's
//!    certificates), ServiceAccounts, PodDisruptionBudgets, Roles and bindings in the namespace,
//!    the ClusterRoles and ClusterRoleBindings, and the namespace itself when `install` made it.
//! 5. With `--crds`: meshgate's CustomResourceDefinitions, and with them every NodeGate and
//!    MutationPolicy. Without it, policies and gates stay (they are the user's).
//!
//! Objects are meshgate's by their label `app.kubernetes.io/managed-by: meshgate`; Helm relabels
//! what it installs `Helm`, so for a Helm release `--helm-release` names the release whose
//! objects (by Helm's annotations) are meshgate's too (the chart's pre-delete hook passes it).
//!
//! Every step tolerates what is already gone, so running it again finishes an interrupted run and
//! then does nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use meshgate_api::GateNode;
use meshgate_api::{NodeGate, names};
use meshgate_core::nodegate::{taints_of, uninstall_patches};
use serde_json::json;

/// What to remove.
#[derive(Clone, Debug)]
pub struct UninstallOptions {
    /// The namespace `install` used.
    pub namespace: String,
    /// Remove the CRDs too (and every NodeGate and MutationPolicy with them).
    pub crds: bool,
    /// How long to wait for the controller's pods to go.
    pub wait: Duration,
    /// The Helm release that installed meshgate (the chart's uninstall hook gives it): its
    /// objects are meshgate's too. Helm labels what it creates `app.kubernetes.io/managed-by:
    /// Helm`, over the chart's `meshgate`, and annotates it with the release.
    pub helm_release: Option<String>,
}

/// Which objects are meshgate's: labelled `app.kubernetes.io/managed-by: meshgate`, or, for a
/// Helm release, labelled `Helm` and annotated as that release's (not its hooks).
#[derive(Clone, Copy, Debug)]
struct Ours<'a> {
    namespace: &'a str,
    helm_release: Option<&'a str>,
}

impl Ours<'_> {
    fn selector(self) -> &'static str {
        if self.helm_release.is_some() {
            "app.kubernetes.io/managed-by in (meshgate,Helm)"
        } else {
            MANAGED
        }
    }

    fn claims(self, meta: &kube::api::ObjectMeta) -> bool {
        let label = meta.labels.as_ref().and_then(|l| l.get(names::MANAGED_BY));
        let annotation = |key: &str| {
            meta.annotations
                .as_ref()
                .and_then(|a| a.get(key))
                .map(String::as_str)
        };
        match label.map(String::as_str) {
            Some("meshgate") => true,
            Some("Helm") => {
                self.helm_release.is_some()
                    && annotation("meta.helm.sh/release-name") == self.helm_release
                    && annotation("meta.helm.sh/release-namespace") == Some(self.namespace)
                    && annotation("helm.sh/hook").is_none()
            }
            _ => false,
        }
    }
}

const MANAGED: &str = "app.kubernetes.io/managed-by=meshgate";

/// The kinds `install` creates, in deletion order (after the registrations and Deployments).
const NAMESPACED: &[(&str, &str, &str, &str)] = &[
    // The DRA gate's node plugin: after its slices are gone.
    ("apps", "v1", "DaemonSet", "daemonsets"),
    ("", "v1", "Service", "services"),
    ("", "v1", "ConfigMap", "configmaps"),
    ("", "v1", "Secret", "secrets"),
    (
        "policy",
        "v1",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
    ),
    (
        "networking.k8s.io",
        "v1",
        "NetworkPolicy",
        "networkpolicies",
    ),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "RoleBinding",
        "rolebindings",
    ),
    ("rbac.authorization.k8s.io", "v1", "Role", "roles"),
    ("", "v1", "ServiceAccount", "serviceaccounts"),
];
const CLUSTER: &[(&str, &str, &str, &str)] = &[
    (
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRoleBinding",
        "clusterrolebindings",
    ),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRole",
        "clusterroles",
    ),
];

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(group, version, kind),
        plural,
    )
}

/// Deletes every object of meshgate's (`ours`) that `api` lists; returns how many.
async fn delete_ours(
    api: &Api<DynamicObject>,
    ours: Ours<'_>,
    what: &str,
    progress: &mut impl FnMut(&str),
) -> anyhow::Result<usize> {
    let list = match api
        .list(&ListParams::default().labels(ours.selector()))
        .await
    {
        Ok(l) => l,
        // A kind the server does not serve has nothing of meshgate's.
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(0),
        Err(e) => return Err(anyhow::anyhow!("listing {what}: {e}")),
    };
    let mut n = 0;
    for obj in list.items.into_iter().filter(|o| ours.claims(&o.metadata)) {
        let name = obj.name_any();
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => {
                n += 1;
                progress(&format!("deleted {what} {name}"));
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(anyhow::anyhow!("deleting {what} {name}: {e}")),
        }
    }
    Ok(n)
}

/// Removes meshgate (see the module documentation). `progress` gets one line per change.
pub async fn uninstall(
    client: &kube::Client,
    o: &UninstallOptions,
    mut progress: impl FnMut(&str),
) -> anyhow::Result<()> {
    let ns = o.namespace.as_str();
    let ours = Ours {
        namespace: ns,
        helm_release: o.helm_release.as_deref(),
    };
    if o.helm_release.is_none() {
        refuse_a_helm_release(client).await?;
    }
    // 1. Admission registrations.
    let mwc = resource(
        "admissionregistration.k8s.io",
        "v1",
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
    );
    delete_ours(
        &Api::all_with(client.clone(), &mwc),
        ours,
        "MutatingWebhookConfiguration",
        &mut progress,
    )
    .await?;
    delete_admission_policies(client, ours, &mut progress).await?;
    // 2. The components, and the controller's pods gone.
    stop_components(client, o, ours, &mut progress).await?;
    // The controller writes the native gate's policy (its routes) until it is gone: whatever
    // it wrote after step 1 goes now.
    delete_admission_policies(client, ours, &mut progress).await?;
    // 3. Nodes, then the gates' finalizers.
    // Not served (CRDs never installed, or just deleted: discovery can still list the group for
    // a moment, whose endpoint then answers 404): no gates.
    let gates: Vec<NodeGate> = match Api::<NodeGate>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => list.items,
        Err(kube::Error::Api(e)) if e.code == 404 => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    clean_nodes(client, &gates, &mut progress).await?;
    // DRA gates' slices, then their device classes (the controller that kept them is gone);
    // no new pod is placed against meshgate's devices from here on.
    for (kind, plural) in [
        ("ResourceSlice", "resourceslices"),
        ("DeviceClass", "deviceclasses"),
    ] {
        let ar = resource("resource.k8s.io", "v1", kind, plural);
        delete_ours(
            &Api::all_with(client.clone(), &ar),
            ours,
            kind,
            &mut progress,
        )
        .await?;
    }
    remove_finalizers(client, &gates, &mut progress).await?;
    // 4. The rest.
    delete_the_rest(client, ns, ours, &mut progress).await?;
    // 5. CRDs.
    if o.crds {
        delete_crds(client, &mut progress).await?;
    }
    Ok(())
}

/// The webhook and controller Deployments deleted, then waits until the controller's pods are
/// gone (a running controller would put taints back).
async fn stop_components(
    client: &kube::Client,
    o: &UninstallOptions,
    ours: Ours<'_>,
    progress: &mut impl FnMut(&str),
) -> anyhow::Result<()> {
    let ns = o.namespace.as_str();
    let deployments = resource("apps", "v1", "Deployment", "deployments");
    delete_ours(
        &Api::namespaced_with(client.clone(), ns, &deployments),
        ours,
        "Deployment",
        progress,
    )
    .await?;
    // Their ReplicaSets and pods too, without waiting for the garbage collector (which may be
    // slow to act, or not run): a ReplicaSet first, so that nothing recreates a pod.
    for (kind, plural) in [("ReplicaSet", "replicasets"), ("Pod", "pods")] {
        let group = if kind == "Pod" { "" } else { "apps" };
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), ns, &resource(group, "v1", kind, plural));
        for obj in api
            .list_metadata(&ListParams::default().labels(COMPONENTS))
            .await?
            .items
        {
            let name = obj.name_any();
            if obj.metadata.deletion_timestamp.is_some() {
                continue;
            }
            match api.delete(&name, &DeleteParams::background()).await {
                Ok(_) => progress(&format!("deleted {kind} {name}")),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(anyhow::anyhow!("deleting {kind} {name}: {e}")),
            }
        }
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let controller_pods = ListParams::default()
        .labels("app.kubernetes.io/name=meshgate,app.kubernetes.io/component=controller");
    let deadline = tokio::time::Instant::now() + o.wait;
    loop {
        let left: Vec<String> = pods
            .list_metadata(&controller_pods)
            .await?
            .items
            .iter()
            .map(|p| {
                format!(
                    "{}{}",
                    p.name_any(),
                    if p.metadata.deletion_timestamp.is_some() {
                        " (terminating)"
                    } else {
                        ""
                    }
                )
            })
            .collect();
        if left.is_empty() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "controller pod(s) still running in {ns} after {:?}: {}; nothing on the nodes was changed (run uninstall again)",
                o.wait,
                left.join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// The pods (and ReplicaSets) of meshgate's webhook and controller Deployments.
const COMPONENTS: &str =
    "app.kubernetes.io/name=meshgate,app.kubernetes.io/component in (webhook,controller)";

/// On every node, the taints, annotations and gate resources meshgate owns.
async fn clean_nodes(
    client: &kube::Client,
    gates: &[NodeGate],
    progress: &mut impl FnMut(&str),
) -> anyhow::Result<()> {
    let specs: Vec<&meshgate_api::NodeGateSpec> = gates.iter().map(|g| &g.spec).collect();
    let nodes: Api<GateNode> = Api::all(client.clone());
    let empty = BTreeMap::new();
    for node in nodes.list(&ListParams::default()).await?.items {
        let name = node.name_any();
        let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
        let capacity: Vec<String> = node
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .map(|c| c.keys().cloned().collect())
            .unwrap_or_default();
        let plan = uninstall_patches(&specs, annotations, &taints_of(&node), &capacity);
        if let Some(patch) = &plan.taints {
            nodes
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::<()>::Json(serde_json::from_value::<json_patch::Patch>(
                        serde_json::Value::Array(patch.0.clone()),
                    )?),
                )
                .await
                .map_err(|e| anyhow::anyhow!("node {name}: removing taints: {e}"))?;
            progress(&format!(
                "node {name}: removed taints {}",
                plan.removed.join(", ")
            ));
        }
        if let Some(patch) = &plan.annotations {
            nodes
                .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await
                .map_err(|e| anyhow::anyhow!("node {name}: annotations: {e}"))?;
        }
        if let Some(patch) = &plan.resources {
            nodes
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await
                .map_err(|e| anyhow::anyhow!("node {name}: withdrawing resources: {e}"))?;
            progress(&format!("node {name}: withdrew gate resources"));
        }
    }
    Ok(())
}

/// meshgate's finalizer off every gate (no controller is left to remove it).
async fn remove_finalizers(
    client: &kube::Client,
    gates: &[NodeGate],
    progress: &mut impl FnMut(&str),
) -> anyhow::Result<()> {
    let gate_api: Api<NodeGate> = Api::all(client.clone());
    for gate in gates {
        let finalizer = meshgate_controller::nodegate::FINALIZER;
        if gate.finalizers().iter().any(|f| f == finalizer) {
            let left: Vec<&String> = gate
                .finalizers()
                .iter()
                .filter(|f| *f != finalizer)
                .collect();
            let patch = json!({"metadata": {"finalizers": left, "resourceVersion": gate.resource_version()}});
            gate_api
                .patch(
                    &gate.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
                .map_err(|e| anyhow::anyhow!("NodeGate {}: finalizer: {e}", gate.name_any()))?;
            progress(&format!("NodeGate {}: finalizer removed", gate.name_any()));
        }
    }
    Ok(())
}

/// The rest of what `install` created, and the namespace when `install` made it.
async fn delete_the_rest(
    client: &kube::Client,
    ns: &str,
    ours: Ours<'_>,
    progress: &mut impl FnMut(&str),
) -> anyhow::Result<()> {
    for (g, v, kind, plural) in NAMESPACED {
        let ar = resource(g, v, kind, plural);
        delete_ours(
            &Api::namespaced_with(client.clone(), ns, &ar),
            ours,
            kind,
            progress,
        )
        .await?;
    }
    for (g, v, kind, plural) in CLUSTER {
        let ar = resource(g, v, kind, plural);
        delete_ours(&Api::all_with(client.clone(), &ar), ours, kind, progress).await?;
    }
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    if let Some(n) = namespaces.get_opt(ns).await?
        && n.labels().get(names::MANAGED_BY).map(String::as_str) == Some("meshgate")
        && n.meta().deletion_timestamp.is_none()
    {
        namespaces.delete(ns, &DeleteParams::background()).await?;
        progress(&format!("deleted Namespace {ns}"));
    }
    Ok(())
}

/// meshgate's CustomResourceDefinitions (and with them every gate and policy).
async fn delete_crds(client: &kube::Client, progress: &mut impl FnMut(&str)) -> anyhow::Result<()> {
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    for crd in crds.list(&ListParams::default()).await?.items {
        let name = crd.name_any();
        if crd.spec.group == meshgate_api::DOMAIN && crd.meta().deletion_timestamp.is_none() {
            crds.delete(&name, &DeleteParams::background()).await?;
            progress(&format!("deleted CustomResourceDefinition {name}"));
        }
    }
    Ok(())
}

/// Fails, naming the release, where Helm installed meshgate: without `--helm-release` none of
/// the release's objects would be taken as meshgate's (Helm labels them its own), and the
/// controller would be left running.
async fn refuse_a_helm_release(client: &kube::Client) -> anyhow::Result<()> {
    let mwcs: Api<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration> =
        Api::all(client.clone());
    let Some(mwc) = mwcs.get_opt("meshgate").await? else {
        return Ok(());
    };
    let helm = mwc.labels().get(names::MANAGED_BY).map(String::as_str) == Some("Helm");
    match mwc.annotations().get("meta.helm.sh/release-name") {
        Some(release) if helm => anyhow::bail!(
            "meshgate was installed by Helm release {release}: run `helm uninstall {release}` (its hook runs this command), or pass --helm-release {release}"
        ),
        _ => Ok(()),
    }
}

/// Deletes meshgate's MutatingAdmissionPolicies and bindings (node taint, native gate, native
/// policies), in every version the API server may serve.
async fn delete_admission_policies(
    client: &kube::Client,
    ours: Ours<'_>,
    progress: &mut impl FnMut(&str),
) -> anyhow::Result<()> {
    for version in ["v1", "v1beta1"] {
        for (kind, plural) in [
            (
                "MutatingAdmissionPolicyBinding",
                "mutatingadmissionpolicybindings",
            ),
            ("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
        ] {
            let ar = resource("admissionregistration.k8s.io", version, kind, plural);
            delete_ours(&Api::all_with(client.clone(), &ar), ours, kind, progress).await?;
        }
    }
    Ok(())
}

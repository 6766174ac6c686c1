//! `meshgate install`: every manifest meshgate needs in a cluster, for a profile.
//!
//! Rendered objects, in apply order: Namespace, CRDs, ServiceAccounts, least-privilege RBAC per
//! component, the gate ConfigMap, the webhook Service, Deployment (2 replicas) and
//! PodDisruptionBudget, the controller Deployment (2 replicas, leader election), the
//! MutatingWebhookConfiguration (without a caBundle), and the profile's default NodeGate and
//! policies.
//!
//! No key material is rendered: the controller creates the webhook's CA and serving certificate
//! in the cluster on its first start when they are absent (Secrets `meshgate-ca` and
//! `meshgate-webhook-tls`), writes the caBundle, and rotates both before expiry
//! (`meshgate_controller::certs`). Re-running `install` (or upgrading) leaves the Secrets and
//! the caBundle alone (they are not in the manifests, and the caBundle belongs to the
//! controller's field manager), so the API server keeps trusting the webhook.

use std::time::Duration;

use meshgate_api::config::GateConfig;
use meshgate_api::{NodeGate, Profile, names};
use meshgate_core::native_gate::Routes;
use meshgate_core::registration::{
    PolicyApi, Registration, WebhookTarget, node_taint_policy, webhook_configuration,
};
use serde_json::{Value, json};

/// What to render.
#[derive(Clone, Debug)]
pub struct InstallOptions {
    /// `istio-ambient`, `istio-sidecar`, `linkerd` or `kubeflow`.
    pub profile: String,
    pub namespace: String,
    pub image: String,
    /// How new nodes get the startup taint at registration.
    pub node_taint: NodeTaint,
    /// Where the init gate is decided (`--pod-gate`).
    pub pod_gate: PodGate,
    /// What holds mesh pods besides the startup taint (`--strategy`).
    pub strategy: Strategy,
    /// The key of the default gate's startup taint (`--taint-key`).
    pub taint_key: String,
    /// Where the node plugin finds the kubelet and the CNI configuration on the nodes.
    pub node_paths: NodePaths,
    /// The repair loop (`None`: off) and what it may do to pods: `label` them, or `delete`
    /// them. The controller's RBAC grants pod writes only for this.
    pub repair: Option<RepairAction>,
    /// With addresses (CIDRs): a NetworkPolicy that admits connections to the webhook's HTTPS
    /// port only from them (the API server's source addresses, which differ per cluster), and
    /// to its health and metrics port from anywhere. Empty: no NetworkPolicy.
    pub webhook_ingress_from: Vec<String>,
    /// `NAMESPACE/NAME` of ConfigMaps that policies' `configMap` context entries read: the
    /// webhook may list and watch them, the controller (backfill) get them, by name; no other
    /// ConfigMap.
    pub context_config_maps: Vec<String>,
    /// Resources (`RESOURCE` or `RESOURCE.GROUP`, as kubectl names them: `namespaces`,
    /// `deployments.apps`) that policies' `apiCall` context entries GET: the webhook and the
    /// controller may get and list them, cluster-wide.
    pub context_api_reads: Vec<String>,
    /// Kinds other than the workloads (`RESOURCE[.GROUP]`: `services`, `gateways.networking.istio.io`)
    /// whose existing objects policies' backfill (`spec.existing`) mutates: the controller may
    /// list and patch them, cluster-wide.
    pub existing_kinds: Vec<String>,
    /// The policy features whose grants are cluster-admin strong (`--workload-backfill`,
    /// `--native-policies`).
    pub policies: PolicyFeatures,
}

/// Policy features that each need a grant as strong as cluster-admin if the controller were
/// compromised; each grant is rendered only with its feature.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyFeatures {
    /// `--workload-backfill` (default on): policies with `spec.existing` patch existing
    /// workloads' pod templates; the controller may `patch` Deployments, StatefulSets,
    /// DaemonSets, ReplicaSets, Jobs and CronJobs, cluster-wide. Off: no such grant, and such
    /// policies apply at admission only (their `Ready` condition says so).
    pub workload_backfill: bool,
    /// `--native-policies` (default on): policies a MutatingAdmissionPolicy can express are
    /// compiled into one; the controller may `create`/`patch`/`delete` MutatingAdmissionPolicies
    /// and their bindings, cluster-wide. Off: no such grant (the native pod gate keeps `patch`
    /// on its own policy and binding, by name), and the webhook serves every policy.
    pub native: bool,
}

impl Default for PolicyFeatures {
    fn default() -> Self {
        Self {
            workload_backfill: true,
            native: true,
        }
    }
}

pub use meshgate_core::repair::RepairAction;

/// How new nodes get the startup taint at registration (`--node-taint`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeTaint {
    /// A `MutatingAdmissionPolicy` the API server evaluates itself: no webhook on Node CREATE
    /// (no circular dependency between nodes and the webhook that runs on them).
    Policy(PolicyApi),
    /// meshgate's webhook on Node CREATE (failure policy `Ignore`), for API servers that serve
    /// no admission policy API.
    Webhook,
}

impl NodeTaint {
    /// `--node-taint policy|webhook|auto`: `auto` picks the policy where the API server serves
    /// `MutatingAdmissionPolicy` (`served`, from discovery), else the webhook.
    pub fn choose(flag: &str, served: Option<PolicyApi>) -> anyhow::Result<Self> {
        Ok(match (flag, served) {
            ("webhook", _) => NodeTaint::Webhook,
            ("policy" | "auto", Some(api)) => NodeTaint::Policy(api),
            ("auto", None) => NodeTaint::Webhook,
            ("policy", None) => anyhow::bail!(
                "--node-taint policy: the API server serves no MutatingAdmissionPolicy API (admissionregistration.k8s.io/v1 or v1beta1); use --node-taint webhook"
            ),
            (other, _) => anyhow::bail!("--node-taint {other:?}: expected policy, webhook or auto"),
        })
    }

    pub fn describe(self) -> String {
        match self {
            NodeTaint::Policy(api) => format!("MutatingAdmissionPolicy ({})", api.api_version()),
            NodeTaint::Webhook => "webhook (/mutate/node-taint)".into(),
        }
    }
}

/// What holds a mesh pod back, besides the startup taint that every strategy puts on new nodes
/// (`--strategy`; docs/design.md "Choosing the layers", with the pod start each costs on a
/// ready node, BENCHMARKS.md, and what each lets an autoscaler do, "Autoscalers").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Strategy {
    /// The startup taint holds every mesh pod the scheduler places; the init gate
    /// (`meshgate-wait`) goes only into pods the taint cannot hold: created bound to a node, or
    /// tolerating the taint. The default: it costs a pod on a ready node nothing, and an
    /// autoscaler that knows the taint's key as a startup taint (Karpenter:
    /// `readiness.k8s.io/`; the Cluster Autoscaler:
    /// `startup-taint.cluster-autoscaler.kubernetes.io/`) launches the nodes it would launch
    /// without meshgate.
    #[default]
    Taint,
    /// Mesh pods request the gate resource, offered through DRA: a `DeviceClass` with
    /// `extendedResourceName` and a `ResourceSlice` per ready node, and the node plugin
    /// (`meshgate node`, a DaemonSet) confirms the mesh on the node before each pod's sandbox
    /// exists. Where the API server does not serve DRA the controller falls back to the node
    /// status. The init gate only for pods created bound to a node. Costs a pod on a ready node
    /// the scheduler's claim and the kubelet's prepare (about 50 ms here, BENCHMARKS.md).
    /// Autoscalers do not provision for the request (Karpenter ignores DRA requests by default).
    Dra,
    /// Mesh pods request the gate resource, which the controller advertises in ready nodes'
    /// status. The init gate only for pods created bound to a node. Costs a pod on a ready node
    /// nothing measurable, but an autoscaler provisions for the request only where its node
    /// templates carry the resource (Karpenter: a `NodeOverlay`, alpha): for clusters without
    /// one.
    Resource,
    /// The init gate (`meshgate-wait`) in every mesh pod: it sees the mesh capture the pod
    /// itself, on any node, at about half a second of start per pod.
    Pod,
}

impl Strategy {
    /// `--strategy taint|dra|resource|pod`.
    pub fn choose(flag: &str) -> anyhow::Result<Self> {
        Ok(match flag {
            "taint" => Strategy::Taint,
            "dra" => Strategy::Dra,
            "resource" => Strategy::Resource,
            "pod" => Strategy::Pod,
            other => anyhow::bail!("--strategy {other:?}: expected taint, dra, resource or pod"),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Taint => "taint",
            Strategy::Dra => "dra",
            Strategy::Resource => "resource",
            Strategy::Pod => "pod",
        }
    }

    pub fn describe(self) -> String {
        match self {
            Strategy::Taint => "taint: the startup taint holds mesh pods the scheduler places; meshgate-wait only in pods it cannot hold (bound to a node, or tolerating the taint)".into(),
            Strategy::Dra => format!(
                "DRA: mesh pods request {} (DeviceClass, a ResourceSlice per ready node, the node plugin checks before each sandbox); meshgate-wait only in pods bound to a node",
                names::DEFAULT_RESOURCE
            ),
            Strategy::Resource => format!(
                "resource: mesh pods request {}, advertised by ready nodes; meshgate-wait only in pods bound to a node",
                names::DEFAULT_RESOURCE
            ),
            Strategy::Pod => "pod: meshgate-wait in every mesh pod".into(),
        }
    }

    /// Whether mesh pods request the gate resource (which autoscalers cannot provision for
    /// without node templates that carry it).
    pub fn requests_resource(self) -> bool {
        matches!(self, Strategy::Dra | Strategy::Resource)
    }
}

/// The gate's taint key (`--taint-key`), and whether the autoscalers found (`None`: offline,
/// nothing could be looked for) can live with it and the strategy: the key given, else the
/// prefix the autoscaler found knows (`meshgate_core::autoscaler::choose_key`). Refuses a
/// configuration an autoscaler found cannot provision for or would over-provision for, naming
/// the fix; `say` gets one line per choice.
pub fn choose_taint_key(
    given: Option<String>,
    found: Option<&[meshgate_core::autoscaler::Found]>,
    strategy: Strategy,
    mut say: impl FnMut(&str),
) -> anyhow::Result<String> {
    use meshgate_core::autoscaler::{PodRequest, choose_key, problems};
    let key = match (given, found) {
        (Some(key), _) => {
            say(&format!("gate taint: {key} (--taint-key)"));
            key
        }
        (None, None) => {
            let (key, _) = choose_key(&[]);
            say(&format!(
                "gate taint: {key} (offline: no autoscaler can be looked for; a startup taint to Karpenter; under the Cluster Autoscaler give --taint-key {})",
                meshgate_core::autoscaler::Autoscaler::ClusterAutoscaler.gate_key()
            ));
            key
        }
        (None, Some(found)) => {
            let (key, why) = choose_key(found);
            say(&format!("gate taint: {key} ({why})"));
            key
        }
    };
    let request = match strategy {
        Strategy::Resource => PodRequest::Resource(names::DEFAULT_RESOURCE),
        Strategy::Dra => PodRequest::Dra(names::DEFAULT_RESOURCE),
        Strategy::Taint | Strategy::Pod => PodRequest::Nothing,
    };
    let mut refused = Vec::new();
    for f in found.unwrap_or_default() {
        for p in problems(f, &key, request) {
            refused.push(format!("{}; fix: {}", p.message, p.fix));
        }
        if let Some(a) = f.autoscaler {
            say(&format!("autoscaler found: {}", a.name()));
        }
    }
    if !refused.is_empty() {
        anyhow::bail!(
            "this configuration would stop the cluster from scaling:\n  {}",
            refused.join("\n  ")
        );
    }
    Ok(key)
}

/// Where the init gate is decided (`--pod-gate`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodGate {
    /// The native gate (`meshgate_core::native_gate`): a `MutatingAdmissionPolicy` for the
    /// clauses CEL can decide (Istio ambient), the webhook for the rest and for namespaces with
    /// LimitRanges (the controller keeps those routes; until its first full list, every pod goes
    /// to the webhook).
    Native(PolicyApi),
    /// meshgate's webhook for every pod.
    Webhook,
}

impl PodGate {
    /// `--pod-gate native|webhook|auto`: `auto` picks the native gate where the API server
    /// serves `MutatingAdmissionPolicy` (`served`, from discovery) and the profile has clauses
    /// CEL can decide, else the webhook.
    pub fn choose(
        flag: &str,
        served: Option<PolicyApi>,
        profile: &str,
        strategy: Strategy,
    ) -> anyhow::Result<Self> {
        let expressible = meshgate_core::native_gate::expressible(&gate_config_for(
            profile,
            "meshgate-system",
            "x",
            strategy,
            names::STARTUP_TAINT_KEY,
        )?);
        Ok(match (flag, served, expressible) {
            ("webhook", _, _) => PodGate::Webhook,
            ("native" | "auto", Some(api), Ok(())) => PodGate::Native(api),
            ("auto", _, _) => PodGate::Webhook,
            ("native", None, _) => anyhow::bail!(
                "--pod-gate native: the API server serves no MutatingAdmissionPolicy API (admissionregistration.k8s.io/v1 or v1beta1); use --pod-gate webhook"
            ),
            ("native", _, Err(e)) => anyhow::bail!("--pod-gate native: profile {profile}: {e}"),
            (other, _, _) => {
                anyhow::bail!("--pod-gate {other:?}: expected native, webhook or auto")
            }
        })
    }

    pub fn describe(self) -> String {
        match self {
            PodGate::Native(api) => format!(
                "native: MutatingAdmissionPolicy ({}), the webhook for namespaces with LimitRanges",
                api.api_version()
            ),
            PodGate::Webhook => "webhook (/mutate/pod-gate)".into(),
        }
    }
}

/// The profiles `install` knows.
pub const PROFILES: [&str; 4] = ["istio-ambient", "istio-sidecar", "linkerd", "kubeflow"];

const KUBEFLOW_POLICY: &str = include_str!("../../../deploy/policies/kubeflow.yaml");

fn labels(component: &str) -> Value {
    json!({
        "app.kubernetes.io/name": "meshgate",
        "app.kubernetes.io/component": component,
        names::MANAGED_BY: "meshgate",
    })
}

fn meta(name: &str, namespace: Option<&str>, component: &str) -> Value {
    let mut m = json!({"name": name, "labels": labels(component)});
    if let Some(ns) = namespace {
        m["namespace"] = json!(ns);
    }
    m
}

/// The Roles and RoleBindings that let the webhook (list, watch) and the controller (get) read
/// one ConfigMap, `NAMESPACE/NAME`, for policies' context entries.
pub fn context_config_map_rbac(install_ns: &str, entry: &str) -> anyhow::Result<Vec<Value>> {
    let Some((ns, name)) = entry.split_once('/') else {
        anyhow::bail!("--context-config-map {entry:?}: expected NAMESPACE/NAME");
    };
    let valid = |s: &str| {
        !s.is_empty()
            && s.len() <= 200
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
    };
    if !valid(ns) || !valid(name) {
        anyhow::bail!(
            "--context-config-map {entry:?}: NAMESPACE and NAME must be Kubernetes names (lowercase alphanumerics, '-' and '.')"
        );
    }
    let mut out = Vec::new();
    for (component, verbs) in [
        ("webhook", json!(["list", "watch"])),
        ("controller", json!(["get"])),
    ] {
        let role = format!("meshgate-{component}-context-{name}");
        out.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(&role, Some(ns), component),
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [name], "verbs": verbs}]}));
        out.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(&role, Some(ns), component),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": format!("meshgate-{component}"), "namespace": install_ns}]}));
    }
    Ok(out)
}

/// The ClusterRoles and bindings that let the webhook and the controller get and list the
/// resources (`RESOURCE[.GROUP]`) policies' `apiCall` context entries read; none for none.
pub fn context_api_read_rbac(install_ns: &str, reads: &[String]) -> anyhow::Result<Vec<Value>> {
    resource_grants(
        install_ns,
        "--context-api-read",
        reads,
        &["get", "list"],
        &["controller", "webhook"],
        "context-api-reads",
    )
}

/// The ClusterRole and binding that let the controller's backfill list and patch the objects of
/// other kinds than the workloads (`RESOURCE[.GROUP]`) that policies with `existing` name
/// (`get`: an object read again after a write conflict); none for none.
pub fn existing_kind_rbac(install_ns: &str, kinds: &[String]) -> anyhow::Result<Vec<Value>> {
    resource_grants(
        install_ns,
        "--existing-kind",
        kinds,
        &["get", "list", "patch"],
        &["controller"],
        "existing-kinds",
    )
}

/// One ClusterRole and binding per component (`meshgate-<component>-<suffix>`) with `verbs` on
/// the resources of `entries` (`RESOURCE` or `RESOURCE.GROUP`, as kubectl names them), one rule
/// per group, sorted; none for no entries.
fn resource_grants(
    install_ns: &str,
    flag: &str,
    entries: &[String],
    verbs: &[&str],
    components: &[&str],
    suffix: &str,
) -> anyhow::Result<Vec<Value>> {
    let mut groups: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    for entry in entries {
        let (resource, group) = entry.split_once('.').unwrap_or((entry, ""));
        let name = |s: &str| {
            s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        };
        if resource.is_empty() || !name(resource) || !name(group) {
            anyhow::bail!(
                "{flag} {entry:?}: expected RESOURCE or RESOURCE.GROUP (as kubectl names them: namespaces, deployments.apps)"
            );
        }
        groups
            .entry(group.to_owned())
            .or_default()
            .insert(resource.to_owned());
    }
    if groups.is_empty() {
        return Ok(Vec::new());
    }
    let rules: Vec<Value> = groups
        .iter()
        .map(|(group, resources)| json!({"apiGroups": [group], "resources": resources, "verbs": verbs}))
        .collect();
    let mut out = Vec::new();
    for component in components {
        let name = format!("meshgate-{component}-{suffix}");
        out.push(
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": meta(&name, None, component), "rules": rules}),
        );
        out.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": meta(&name, None, component),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": format!("meshgate-{component}"), "namespace": install_ns}]}));
    }
    Ok(out)
}

/// The mesh profile behind an install profile (`kubeflow` is Istio's sidecar mode with a
/// policy).
pub fn mesh_profile(profile: &str) -> anyhow::Result<Profile> {
    Ok(match profile {
        "istio-ambient" => Profile::IstioAmbient,
        "istio-sidecar" | "kubeflow" => Profile::IstioSidecar,
        "linkerd" => Profile::Linkerd,
        other => anyhow::bail!(
            "--profile {other:?}: expected one of {}",
            PROFILES.join(", ")
        ),
    })
}

/// The gate configuration of a profile, with the default strategy and taint key.
pub fn gate_config(profile: &str, namespace: &str, image: &str) -> anyhow::Result<GateConfig> {
    gate_config_for(
        profile,
        namespace,
        image,
        Strategy::default(),
        names::STARTUP_TAINT_KEY,
    )
}

/// The gate configuration of a profile, strategy and gate taint key.
pub fn gate_config_for(
    profile: &str,
    namespace: &str,
    image: &str,
    strategy: Strategy,
    taint_key: &str,
) -> anyhow::Result<GateConfig> {
    use meshgate_api::config::InitGateScope;
    let mut config = GateConfig {
        profiles: vec![mesh_profile(profile)?],
        ..GateConfig::default()
    };
    config.excluded_namespaces = vec!["kube-system".into(), namespace.into()];
    config.init_gate.image = image.into();
    config.node_taint_keys = taint_keys(taint_key);
    match strategy {
        Strategy::Taint => config.init_gate.scope = InitGateScope::TaintExempt,
        Strategy::Dra | Strategy::Resource => {
            config.resource_gate.enabled = true;
            config.init_gate.scope = InitGateScope::NodeBound;
        }
        Strategy::Pod => {}
    }
    config.validate()?;
    Ok(config)
}

/// The gate's key, then meshgate's earlier default key (nodes an earlier install tainted may
/// carry it until the controller replaces it), without repeats.
pub fn taint_keys(taint_key: &str) -> Vec<String> {
    let mut keys = vec![taint_key.to_owned()];
    if taint_key != names::DEFAULT_TAINT_KEY {
        keys.push(names::DEFAULT_TAINT_KEY.to_owned());
    }
    keys
}

/// The default NodeGate of a profile: the mesh's agents, from its record, the taint key, and the
/// strategy's resource. The taint strategy keeps the resource in the node status: no pod it
/// admits requests it, but pods admitted before an upgrade from the resource strategy still
/// find ready nodes that offer it (docs/design.md, "Upgrades").
pub(crate) fn default_gate(
    profile: &str,
    strategy: Strategy,
    taint_key: &str,
) -> anyhow::Result<NodeGate> {
    let record = mesh_profile(profile)?.record();
    let agents: Vec<Value> = record
        .agents
        .iter()
        .map(|a| {
            json!({"name": a.name, "namespace": a.namespace,
                   "selector": {"matchLabels": {a.label.0: a.label.1}}, "daemonSet": a.daemon_set})
        })
        .collect();
    let mut spec =
        json!({"agents": agents, "mode": record.node_gate_mode, "taint": {"key": taint_key}});
    match strategy {
        Strategy::Dra => {
            spec["resource"] = json!({"name": names::DEFAULT_RESOURCE, "provider": "DRA"});
        }
        Strategy::Resource | Strategy::Taint => {
            spec["resource"] = json!({"name": names::DEFAULT_RESOURCE, "provider": "NodeStatus"});
        }
        Strategy::Pod => {}
    }
    Ok(NodeGate::new("mesh-agents", serde_json::from_value(spec)?))
}

/// Every manifest, in apply order.
pub fn render(o: &InstallOptions) -> anyhow::Result<Vec<Value>> {
    let ns = o.namespace.as_str();
    let config = gate_config_for(&o.profile, ns, &o.image, o.strategy, &o.taint_key)?;
    let mut out = vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": meta(ns, None, "namespace")}),
    ];
    out.extend(crd_documents()?);
    // Identities and least-privilege RBAC, one per component.
    for c in ["webhook", "controller"] {
        out.push(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(&format!("meshgate-{c}"), Some(ns), c)}));
    }
    let webhook_rules = webhook_rules();
    let controller_rules = controller_rules(o, &config)?;
    for (c, rules) in [("webhook", webhook_rules), ("controller", controller_rules)] {
        let name = format!("meshgate-{c}");
        out.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": meta(&name, None, c), "rules": rules}));
        out.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": meta(&name, None, c),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]}));
    }
    // The ConfigMaps policies read in context entries, by name: the webhook watches each one
    // alone (a field selector on its name, which RBAC authorizes against `resourceNames`), the
    // controller's backfill reads it.
    for entry in &o.context_config_maps {
        out.extend(context_config_map_rbac(ns, entry)?);
    }
    // The resources policies' apiCall entries GET, cluster-wide.
    out.extend(context_api_read_rbac(ns, &o.context_api_reads)?);
    // The other kinds the backfill mutates.
    if !o.existing_kinds.is_empty() && !o.policies.workload_backfill {
        anyhow::bail!(
            "--existing-kind needs the backfill (--workload-backfill=false turns it off)"
        );
    }
    out.extend(existing_kind_rbac(ns, &o.existing_kinds)?);
    out.extend(tenant_and_lease_rbac(ns));

    // Configuration. The certificates are the controller's (see the module documentation).
    out.push(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta("meshgate-config", Some(ns), "webhook"),
        "data": {"config.yaml": meshgate_api::yaml::to_string(&config)?}}));

    // meshgate must run on nodes its own gate holds, or nothing lifts the taint, and on nodes
    // the mesh's own readiness taints (`MeshProfile::mesh_taints`), or meshgate and the mesh
    // wait on each other: istiod tolerates only Istio's taint, its untaint controller needs
    // istiod, and istiod meshgate's taint lifted.
    let mut tolerations: Vec<Value> = taint_keys(&o.taint_key)
        .iter()
        .map(|key| json!({"key": key, "operator": "Exists"}))
        .collect();
    tolerations.extend(
        mesh_profile(&o.profile)?
            .record()
            .mesh_taints
            .iter()
            .map(|key| json!({"key": key, "operator": "Exists"})),
    );
    let at = Placement {
        ns,
        image: &o.image,
        tolerations: Value::Array(tolerations),
    };

    out.extend(webhook_documents(o, &at));
    // The controller.
    out.push(deployment(
        &at,
        "controller",
        controller_args(o, &config),
        json!([{"name": "health", "containerPort": 8080}]),
        if let PodGate::Native(_) = o.pod_gate {
            json!([{"name": "config", "mountPath": "/etc/meshgate/config", "readOnly": true}])
        } else {
            json!([])
        },
        if let PodGate::Native(_) = o.pod_gate {
            json!([{"name": "config", "configMap": {"name": "meshgate-config"}}])
        } else {
            json!([])
        },
    ));
    if o.strategy == Strategy::Dra {
        out.push(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta("meshgate-node", Some(ns), "node"),
            "automountServiceAccountToken": false}));
        out.push(node_plugin(
            ns,
            &o.image,
            mesh_profile(&o.profile)?.record(),
            &o.node_paths,
        ));
    }
    out.extend(registration_documents(o, &config)?);
    Ok(out)
}

/// The webhook's ClusterRole rules. Exactly what the code paths use (`cargo test -p meshgate
/// --test install_rbac` fails on a permission no path exercises and on a path without its
/// permission): watches list and watch; `get` only where an object is read by name.
fn webhook_rules() -> Value {
    json!([
        {"apiGroups": [""], "resources": ["namespaces", "limitranges"], "verbs": ["list", "watch"]},
        // A namespace not in the watch cache yet (created a moment ago) is read once.
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]},
        {"apiGroups": ["meshgate.dev"], "resources": ["mutationpolicies", "namespacedmutationpolicies", "nodegates"], "verbs": ["list", "watch"]},
    ])
}

/// The controller's ClusterRole rules: what its paths use, and each option's own (see
/// [`webhook_rules`]).
fn controller_rules(o: &InstallOptions, config: &GateConfig) -> anyhow::Result<Value> {
    let mut controller_rules = json!([
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
        // Read: the agents' DaemonSets, and the workloads the backfill visits; `patch` only with
        // the backfill (below).
        {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets", "daemonsets", "replicasets"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["meshgate.dev"], "resources": ["mutationpolicies", "namespacedmutationpolicies"], "verbs": ["list", "watch"]},
        // patch: the gate's finalizer (taints come off every node before a gate goes).
        {"apiGroups": ["meshgate.dev"], "resources": ["nodegates"], "verbs": ["list", "watch", "patch"]},
        {"apiGroups": ["meshgate.dev"], "resources": ["nodegates/status", "mutationpolicies/status"], "verbs": ["patch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"], "resourceNames": ["meshgate"], "verbs": ["get", "patch"]},
        // --manage-crds: meshgate's CRDs at the controller's schema (by name: no other CRD).
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "resourceNames": ["nodegates.meshgate.dev", "mutationpolicies.meshgate.dev", "namespacedmutationpolicies.meshgate.dev"], "verbs": ["get", "patch"]},
    ]);
    if let Some(rules) = controller_rules.as_array_mut() {
        if o.policies.workload_backfill {
            // The backfill of existing workloads' pod templates (DaemonSets included).
            rules.push(json!({"apiGroups": ["apps"], "resources": ["deployments", "statefulsets", "daemonsets", "replicasets"], "verbs": ["patch"]}));
            rules.push(json!({"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"], "verbs": ["patch"]}));
        }
        if o.policies.native {
            // Native policies: the MutatingAdmissionPolicies (and bindings) compiled from
            // MutationPolicies, kept by server-side apply and deleted when a policy stops
            // compiling.
            rules.push(json!({"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingadmissionpolicies", "mutatingadmissionpolicybindings"], "verbs": ["create", "patch", "delete"]}));
        } else if let PodGate::Native(api) = o.pod_gate {
            // The native gate's own policy and binding (install creates them; the controller
            // keeps their routes), by name.
            let names: Vec<String> = meshgate_core::native_gate::policy(config, api, &Routes::All)
                .map_err(|e| anyhow::anyhow!("native gate: {e}"))?
                .iter()
                .filter_map(|d| d["metadata"]["name"].as_str().map(str::to_owned))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            rules.push(json!({"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingadmissionpolicies", "mutatingadmissionpolicybindings"], "resourceNames": names, "verbs": ["patch"]}));
        }
    }
    if let Some(rules) = controller_rules.as_array_mut() {
        // DRA gates: the controller watches the slices it wrote wherever the API server serves
        // them; it writes slices and device classes only for a DRA strategy.
        let verbs = if o.strategy == Strategy::Dra {
            json!(["list", "watch", "create", "update", "delete"])
        } else {
            json!(["list", "watch"])
        };
        rules.push(json!({"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": verbs}));
        if o.strategy == Strategy::Dra {
            // Server-side apply of a class that does not exist yet is authorized as `create`
            // too (k8s.io/apiserver handlers/patch.go).
            rules.push(json!({"apiGroups": ["resource.k8s.io"], "resources": ["deviceclasses"], "verbs": ["create", "patch", "delete"]}));
        }
    }
    if let PodGate::Native(_) = o.pod_gate
        && let Some(rules) = controller_rules.as_array_mut()
    {
        // The native gate's routes: namespaces with LimitRanges stay on the webhook.
        rules.push(
            json!({"apiGroups": [""], "resources": ["limitranges"], "verbs": ["list", "watch"]}),
        );
    }
    if let Some(action) = o.repair {
        // Only with the repair loop: label, or evict, pods whose gate timed out.
        // (`delete` evicts pods a controller recreates, through the Eviction API so that
        // PodDisruptionBudgets hold, and labels the others.)
        if let Some(rules) = controller_rules.as_array_mut() {
            rules.push(json!({"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}));
            if action == RepairAction::Delete {
                rules.push(
                    json!({"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}),
                );
            }
        }
    }
    Ok(controller_rules)
}

/// The ClusterRoles tenants are aggregated into, and the controller's Role in its namespace
/// (its Lease, its certificates' Secrets).
fn tenant_and_lease_rbac(ns: &str) -> Vec<Value> {
    let mut out = Vec::new();
    // Tenants: a namespace's admins and editors may manage the NamespacedMutationPolicies of
    // their namespace (aggregated into the built-in `admin` and `edit` roles), viewers read
    // them. Cluster-wide MutationPolicies are not aggregated anywhere: creating one is as strong
    // as cluster-admin (docs/security.md).
    out.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "meshgate-namespaced-policies-edit", "labels": {
            "app.kubernetes.io/name": "meshgate", names::MANAGED_BY: "meshgate",
            "rbac.authorization.k8s.io/aggregate-to-admin": "true",
            "rbac.authorization.k8s.io/aggregate-to-edit": "true"}},
        "rules": [{"apiGroups": ["meshgate.dev"], "resources": ["namespacedmutationpolicies"],
                   "verbs": ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]}]}));
    out.push(
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "meshgate-namespaced-policies-view", "labels": {
            "app.kubernetes.io/name": "meshgate", names::MANAGED_BY: "meshgate",
            "rbac.authorization.k8s.io/aggregate-to-view": "true"}},
        "rules": [{"apiGroups": ["meshgate.dev"], "resources": ["namespacedmutationpolicies"],
                   "verbs": ["get", "list", "watch"]}]}),
    );
    out.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta("meshgate-controller-lease", Some(ns), "controller"),
        "rules": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]},
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["meshgate-ca", "meshgate-webhook-tls"], "verbs": ["get", "patch"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        ]}));
    out.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta("meshgate-controller-lease", Some(ns), "controller"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "meshgate-controller-lease"},
        "subjects": [{"kind": "ServiceAccount", "name": "meshgate-controller", "namespace": ns}]}));
    out
}

/// The controller's command line for the options.
fn controller_args(o: &InstallOptions, config: &GateConfig) -> Value {
    let ns = o.namespace.as_str();
    let mut args = vec![
        "controller".to_owned(),
        "--lease-namespace".to_owned(),
        ns.to_owned(),
        "--manage-certs".to_owned(),
        "--manage-crds".to_owned(),
        "--policy-webhook-configuration".to_owned(),
        "meshgate".to_owned(),
    ];
    if o.policies.native {
        args.push("--native-policies".into());
    }
    args.extend([
        "--gate-wait-threshold".to_owned(),
        "120s".to_owned(),
        "--excluded-namespaces".to_owned(),
        config.excluded_namespaces.join(","),
    ]);
    if !o.policies.workload_backfill {
        args.push("--workload-backfill=false".into());
    }
    if let PodGate::Native(_) = o.pod_gate {
        args.push("--native-gate-config".into());
        args.push("/etc/meshgate/config/config.yaml".into());
    }
    if let Some(action) = o.repair {
        args.push("--repair".into());
        args.push("--repair-action".into());
        args.push(
            match action {
                RepairAction::Label => "label",
                RepairAction::Delete => "delete",
            }
            .into(),
        );
    }
    args.push(LOG_JSON.into());
    json!(args)
}

/// The webhook's Service, Deployment, PodDisruptionBudget and, with `--webhook-ingress-from`,
/// NetworkPolicy.
fn webhook_documents(o: &InstallOptions, at: &Placement<'_>) -> Vec<Value> {
    let ns = at.ns;
    let mut out = Vec::new();
    let selector =
        json!({"app.kubernetes.io/name": "meshgate", "app.kubernetes.io/component": "webhook"});
    out.push(json!({"apiVersion": "v1", "kind": "Service", "metadata": meta("meshgate-webhook", Some(ns), "webhook"),
        "spec": {"selector": selector, "ports": [{"name": "https", "port": 443, "targetPort": "https"}]}}));
    out.push(deployment(at, "webhook",
        json!(["webhook", "--config", "/etc/meshgate/config/config.yaml", "--cert", "/etc/meshgate/tls/tls.crt", "--key", "/etc/meshgate/tls/tls.key",
               "--max-in-flight", meshgate_webhook::server::DEFAULT_MAX_IN_FLIGHT.to_string(), LOG_JSON]),
        json!([{"name": "https", "containerPort": 8443}, {"name": "health", "containerPort": 8080}]),
        json!([{"name": "tls", "mountPath": "/etc/meshgate/tls", "readOnly": true}, {"name": "config", "mountPath": "/etc/meshgate/config", "readOnly": true}]),
        json!([{"name": "tls", "secret": {"secretName": "meshgate-webhook-tls"}}, {"name": "config", "configMap": {"name": "meshgate-config"}}])));
    if !o.webhook_ingress_from.is_empty() {
        // Only the API server may call the webhook; health and metrics stay reachable (kubelet
        // probes, Prometheus).
        let from: Vec<Value> = o
            .webhook_ingress_from
            .iter()
            .map(|cidr| json!({"ipBlock": {"cidr": cidr}}))
            .collect();
        out.push(json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta("meshgate-webhook", Some(ns), "webhook"),
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": from, "ports": [{"protocol": "TCP", "port": 8443}]},
                                 {"ports": [{"protocol": "TCP", "port": 8080}]}]}}));
    }
    out.push(json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta("meshgate-webhook", Some(ns), "webhook"),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": selector}}}));
    out
}

/// The webhook's registration, the profile's NodeGate and policies, and the admission policies
/// the API server runs for meshgate (the node taint, the native gate).
fn registration_documents(o: &InstallOptions, config: &GateConfig) -> anyhow::Result<Vec<Value>> {
    let ns = o.namespace.as_str();
    let mut out = Vec::new();
    let mut mwc = webhook_configuration(&Registration {
        name: "meshgate",
        config,
        target: WebhookTarget::Service {
            namespace: ns.into(),
            name: "meshgate-webhook".into(),
            port: 443,
        },
        ca_bundle_pem: "",
        policies: true,
        node_taint: o.node_taint == NodeTaint::Webhook,
        native_gate: match o.pod_gate {
            PodGate::Native(_) => Some(&Routes::All),
            PodGate::Webhook => None,
        },
    });
    mwc["metadata"]["labels"] = labels("webhook");
    out.push(mwc);
    // Defaults of the profile.
    let gate = default_gate(&o.profile, o.strategy, &o.taint_key)?;
    let mut g = serde_json::to_value(&gate)?;
    g["metadata"]["labels"] = labels("defaults");
    out.push(g);
    if let NodeTaint::Policy(api) = o.node_taint {
        let name = gate.metadata.name.clone().unwrap_or_default();
        out.extend(node_taint_policy(&name, &gate.spec, api));
    }
    if let PodGate::Native(api) = o.pod_gate {
        // Every pod on the webhook until the controller has listed the LimitRanges.
        out.extend(
            meshgate_core::native_gate::policy(config, api, &Routes::All)
                .map_err(|e| anyhow::anyhow!("native gate: {e}"))?,
        );
    }
    out.extend(profile_policies(&o.profile)?);
    Ok(out)
}

/// Where the node plugin finds the kubelet and the CNI configuration on the nodes
/// (`--kubelet-root`, `--cni-conf-dir`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePaths {
    /// The kubelet's root directory, where the node plugin registers (`plugins_registry`) and
    /// serves (`plugins/<driver>`).
    pub kubelet_root: String,
    /// The directory the container runtime reads CNI configuration from.
    pub cni_conf_dir: String,
    /// The mesh's CNI plugin type the node plugin looks for; `None`: the profile's.
    pub cni_plugin: Option<String>,
}

impl Default for NodePaths {
    fn default() -> Self {
        Self {
            kubelet_root: "/var/lib/kubelet".into(),
            cni_conf_dir: "/etc/cni/net.d".into(),
            cni_plugin: None,
        }
    }
}
/// The node plugin's health port (host network: it reads the agents' readiness on the host).
pub const NODE_PLUGIN_HEALTH_PORT: u16 = 9813;

/// The node plugin's DaemonSet (`meshgate node`): on every node, tolerating every taint (it
/// must run on held nodes), on the host network (where `--ready-url`s of host-network agents
/// answer; the profiles' agents are not on it, so the plugin checks the CNI configuration), as
/// root only to create its sockets in the kubelet's directories, with no capability, no API
/// token and a read-only root file system.
fn node_plugin(
    ns: &str,
    image: &str,
    record: &meshgate_api::MeshProfile,
    paths: &NodePaths,
) -> Value {
    let root = paths.kubelet_root.as_str();
    let selector =
        json!({"app.kubernetes.io/name": "meshgate", "app.kubernetes.io/component": "node"});
    let args = vec![
        "node".to_owned(),
        "--kubelet-root".to_owned(),
        root.to_owned(),
        "--cni-conf-dir".to_owned(),
        "/host/cni/net.d".to_owned(),
        "--cni-plugin".to_owned(),
        paths
            .cni_plugin
            .clone()
            .unwrap_or_else(|| record.cni_plugin.to_owned()),
        "--health-addr".to_owned(),
        format!("127.0.0.1:{NODE_PLUGIN_HEALTH_PORT}"),
        LOG_JSON.to_owned(),
    ];
    json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": meta(meshgate_controller::nodegate::NODE_PLUGIN_DAEMONSET, Some(ns), "node"),
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "meshgate", "app.kubernetes.io/component": "node", names::OPT_OUT: "false"}},
                "spec": {
                    "serviceAccountName": "meshgate-node",
                    "automountServiceAccountToken": false,
                    "hostNetwork": true,
                    "priorityClassName": "system-node-critical",
                    "nodeSelector": {"kubernetes.io/os": "linux"},
                    "tolerations": [{"operator": "Exists"}],
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "node",
                        "image": image,
                        "imagePullPolicy": PULL_POLICY,
                        "args": args,
                        "readinessProbe": {"httpGet": {"host": "127.0.0.1", "path": "/readyz", "port": NODE_PLUGIN_HEALTH_PORT}, "periodSeconds": 2},
                        "livenessProbe": {"httpGet": {"host": "127.0.0.1", "path": "/healthz", "port": NODE_PLUGIN_HEALTH_PORT}, "periodSeconds": 10},
                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
                        "securityContext": {"runAsUser": 0, "readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
                        "volumeMounts": [
                            {"name": "registry", "mountPath": format!("{root}/plugins_registry")},
                            {"name": "plugins", "mountPath": format!("{root}/plugins")},
                            {"name": "cni", "mountPath": "/host/cni/net.d", "readOnly": true},
                        ],
                    }],
                    "volumes": [
                        {"name": "registry", "hostPath": {"path": format!("{root}/plugins_registry"), "type": "DirectoryOrCreate"}},
                        {"name": "plugins", "hostPath": {"path": format!("{root}/plugins"), "type": "DirectoryOrCreate"}},
                        {"name": "cni", "hostPath": {"path": paths.cni_conf_dir, "type": "DirectoryOrCreate"}},
                    ],
                },
            },
        },
    })
}

/// The MutationPolicies a profile installs.
pub fn profile_policies(profile: &str) -> anyhow::Result<Vec<Value>> {
    Ok(match profile {
        "kubeflow" => {
            crate::render::parse_documents("deploy/policies/kubeflow.yaml", KUBEFLOW_POLICY)?
        }
        _ => Vec::new(),
    })
}

/// The webhook's pod: how long it keeps serving after it is told to stop (the preStop sleep,
/// while its endpoint leaves the Service) and its termination grace period (the sleep, then
/// the process's 20 s drain, with room).
pub const WEBHOOK_PRESTOP_SECONDS: u64 = 5;
pub const WEBHOOK_GRACE_SECONDS: u64 = 30;

/// The log flag every component gets (`--log-level` is left at its default, `info`).
const LOG_JSON: &str = "--log-json";
/// The containers' image pull policy (the chart's `image.pullPolicy` default; the init gate's is
/// `initGate.imagePullPolicy`, the same by default).
const PULL_POLICY: &str = "IfNotPresent";

/// Where and from what meshgate's Deployments run: their namespace, image and tolerations.
struct Placement<'a> {
    ns: &'a str,
    image: &'a str,
    tolerations: Value,
}

fn deployment(
    at: &Placement<'_>,
    component: &str,
    args: Value,
    ports: Value,
    mounts: Value,
    volumes: Value,
) -> Value {
    let selector =
        json!({"app.kubernetes.io/name": "meshgate", "app.kubernetes.io/component": component});
    // The webhook holds at most `--max-in-flight` request bodies of up to 3.5 MiB; its load test
    // (`bad_input`: overload_and_abuse...) peaks near 105 MiB at the default of 32.
    let memory_limit = if component == "webhook" {
        "256Mi"
    } else {
        "128Mi"
    };
    let mut d = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": meta(&format!("meshgate-{component}"), Some(at.ns), component),
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": selector},
            "template": {
                // meshgate never gates itself.
                "metadata": {"labels": {"app.kubernetes.io/name": "meshgate", "app.kubernetes.io/component": component, names::OPT_OUT: "false"}},
                "spec": {
                    "serviceAccountName": format!("meshgate-{component}"),
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
                    "tolerations": at.tolerations,
                    "containers": [{
                        "name": component,
                        "image": at.image,
                        "imagePullPolicy": PULL_POLICY,
                        "args": args,
                        "env": [
                            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                        ],
                        "ports": ports,
                        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "health"}, "periodSeconds": 5},
                        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "health"}, "periodSeconds": 10},
                        "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}, "limits": {"memory": memory_limit}},
                        "securityContext": {"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
                    }],
                },
            },
        },
    });
    // No empty lists: the chart leaves out what is not there.
    if component == "webhook" {
        // A rollout or a drain: the pod is Terminating and the endpoint controllers take it
        // out of the Service, but the API server may still send it reviews for a few seconds.
        // It keeps serving them all (the preStop sleep delays SIGTERM), then drains what is in
        // flight (`meshgate webhook` gives it 20 s) well inside the grace period.
        d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] =
            json!(WEBHOOK_GRACE_SECONDS);
        d["spec"]["template"]["spec"]["containers"][0]["lifecycle"] =
            json!({"preStop": {"sleep": {"seconds": WEBHOOK_PRESTOP_SECONDS}}});
    }
    if mounts.as_array().is_some_and(|m| !m.is_empty()) {
        d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = mounts;
        d["spec"]["template"]["spec"]["volumes"] = volumes;
    }
    d
}

/// The manifests with generated key material replaced by `<generated>`: stable text for review
/// (the golden files) and diffs.
pub fn masked(docs: &[Value]) -> Vec<Value> {
    docs.iter()
        .cloned()
        .map(|mut d| {
            if d["kind"] == "Secret"
                && let Some(data) = d["stringData"].as_object_mut()
            {
                for v in data.values_mut() {
                    *v = json!("<generated>");
                }
            }
            if d["kind"] == "MutatingWebhookConfiguration"
                && let Some(hooks) = d["webhooks"].as_array_mut()
            {
                for h in hooks {
                    h["clientConfig"]["caBundle"] = json!("<generated>");
                }
            }
            d
        })
        .collect()
}

/// meshgate's CRDs as documents, ready for [`apply`].
pub fn crd_documents() -> anyhow::Result<Vec<Value>> {
    crate::crds::manifests()?
        .into_iter()
        .map(|(_, yaml)| Ok(meshgate_api::yaml::from_str(&yaml)?))
        .collect()
}

/// Applies the manifests with server-side apply (field manager `meshgate`), printing progress;
/// `dry_run` asks the API server to validate without persisting.
pub async fn apply(
    client: &kube::Client,
    docs: &[Value],
    dry_run: bool,
    mut progress: impl FnMut(&str),
) -> anyhow::Result<()> {
    use kube::api::{Api, DynamicObject, Patch, PatchParams};
    use kube::discovery::{ApiCapabilities, ApiResource, Scope};
    let mut pp = PatchParams::apply("meshgate").force();
    pp.dry_run = dry_run;
    // Each kind is looked up in its own group version, not by discovering every group: an
    // aggregated API that is down (a metrics server) fails a full discovery, and has nothing
    // to do with meshgate's objects.
    let mut kinds: std::collections::BTreeMap<(String, String), (ApiResource, ApiCapabilities)> =
        Default::default();
    for doc in docs {
        let api_version = doc["apiVersion"].as_str().unwrap_or_default();
        let kind = doc["kind"].as_str().unwrap_or_default();
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = kube::core::GroupVersionKind::gvk(group, version, kind);
        let key = (api_version.to_owned(), kind.to_owned());
        let (ar, caps) = match kinds.get(&key) {
            Some(found) => found.clone(),
            None => {
                let found = match kube::discovery::pinned_kind(client, &gvk).await {
                    Ok(found) => found,
                    Err(kube::Error::Discovery(_)) => anyhow::bail!(
                        "{api_version} {kind} {name}: the API server does not serve this kind"
                    ),
                    Err(kube::Error::Api(e)) if e.code == 404 => anyhow::bail!(
                        "{api_version} {kind} {name}: the API server does not serve this kind"
                    ),
                    Err(e) => anyhow::bail!("{api_version} {kind} {name}: discovery: {e}"),
                };
                kinds.insert(key, found.clone());
                found
            }
        };
        let obj: DynamicObject = serde_json::from_value(doc.clone())?;
        let api: Api<DynamicObject> = match (caps.scope, doc["metadata"]["namespace"].as_str()) {
            (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &ar),
            _ => Api::all_with(client.clone(), &ar),
        };
        api.patch(name, &pp, &Patch::Apply(&obj))
            .await
            .map_err(|e| anyhow::anyhow!("{kind} {name}: {e}"))?;
        progress(&format!(
            "{kind}/{name} {}",
            if dry_run {
                "valid (dry run)"
            } else {
                "applied"
            }
        ));
        if kind == "CustomResourceDefinition" && !dry_run {
            let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
                Api::all(client.clone());
            let start = std::time::Instant::now();
            loop {
                let established = crds
                    .get(name)
                    .await
                    .ok()
                    .and_then(|c| c.status?.conditions)
                    .is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    });
                if established {
                    break;
                }
                if start.elapsed() > Duration::from_secs(60) {
                    anyhow::bail!("CRD {name} not established after 60s");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    Ok(())
}

//! The admission registrations meshgate needs, generated from its configuration: the
//! `MutatingWebhookConfiguration` (init gate, policies, node taint) and, where the API server
//! serves it, a `MutatingAdmissionPolicy` that taints new nodes without calling the webhook.
//!
//! # Self-deadlock
//! The webhook's own pods must never need the webhook: every namespaced rule excludes the
//! configured namespaces (meshgate's own and `kube-system`) by the immutable
//! `kubernetes.io/metadata.name` label, every pod rule skips pods labelled
//! `meshgate.dev/inject: "false"`, and the Node rule fails open (`Ignore`) so nodes — on which the
//! webhook itself must run — always register.

use meshgate_api::config::GateConfig;
use meshgate_api::node_gate::NodeGateSpec;
use meshgate_api::{LabelSelector, SelectorOperator, names};
use serde_json::{Value, json};

pub use crate::object::cel::PolicyApi;
use crate::object::cel::cel_string;
pub use crate::policy::native::PolicyResource;

/// Paths served by the webhook, one per purpose.
pub mod paths {
    pub const POD_GATE: &str = "/mutate/pod-gate";
    pub const POLICIES: &str = "/mutate/policies";
    pub const NODE_TAINT: &str = "/mutate/node-taint";
}

/// How long the webhook may take over a review, from the registrations' `timeoutSeconds`: the
/// API server stops waiting then (and applies the failure policy), so the webhook gives up a
/// quarter second before, answering `503` on a connection still open instead of working on for
/// nobody. At least half a second.
pub fn server_timeout(timeout_seconds: u8) -> std::time::Duration {
    std::time::Duration::from_millis((u64::from(timeout_seconds) * 1000).saturating_sub(250))
        .max(std::time::Duration::from_millis(500))
}

/// Where the API server reaches the webhook.
#[derive(Clone, Debug)]
pub enum WebhookTarget {
    /// An in-cluster Service.
    Service {
        namespace: String,
        name: String,
        port: u16,
    },
    /// A URL base, `https://host:port` (tests, out-of-cluster runs).
    Url(String),
}

/// Which registrations to generate.
#[derive(Clone, Debug)]
pub struct Registration<'a> {
    pub name: &'a str,
    pub config: &'a GateConfig,
    pub target: WebhookTarget,
    /// PEM of the CA that signed the webhook's serving certificate.
    pub ca_bundle_pem: &'a str,
    /// Register the policy path.
    pub policies: bool,
    /// Register the node-taint path (when admission policies are not used for it).
    pub node_taint: bool,
    /// The native gate is installed (`crate::admission::native_gate`): the webhook entries of the
    /// native clauses are called only for these namespaces.
    pub native_gate: Option<&'a crate::admission::native_gate::Routes>,
}

/// The webhook's client configuration; no `caBundle` when `ca_bundle_pem` is empty (the
/// controller writes it).
fn client_config(r: &Registration<'_>, path: &str) -> Value {
    let mut config = match &r.target {
        WebhookTarget::Service {
            namespace,
            name,
            port,
        } => json!({
            "service": {"namespace": namespace, "name": name, "path": path, "port": port},
        }),
        WebhookTarget::Url(base) => json!({
            "url": format!("{}{path}", base.trim_end_matches('/')),
        }),
    };
    if !r.ca_bundle_pem.is_empty() {
        config["caBundle"] = json!(k8s_openapi::ByteString(r.ca_bundle_pem.as_bytes().to_vec()));
    }
    config
}

/// The name of the policies webhook in the configuration.
pub fn policies_webhook_name() -> String {
    format!("policies.{}", meshgate_api::DOMAIN)
}

/// The `kinds` entries of `policies` that name other kinds than Pods and the workloads (those
/// are always registered): what discovery must resolve for the policies webhook. Entries of
/// `exclude` blocks are not needed: they only narrow.
pub fn policy_kind_entries<'a>(
    policies: impl IntoIterator<Item = &'a meshgate_api::MutationPolicySpec>,
) -> Vec<String> {
    let mut out: Vec<String> = policies
        .into_iter()
        .flat_map(|p| p.match_.kinds.iter())
        .filter(|entry| {
            crate::policy::parse_kind(entry).is_ok_and(|(_, _, kind)| {
                kind.contains(['*', '?']) || !crate::policy::SUPPORTED_KINDS.contains(&kind)
            })
        })
        .cloned()
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The policies webhook's rules: Pods and the workloads (CREATE, UPDATE), and `extra`
/// resources, one rule per group and version, sorted.
pub fn policy_rules(extra: &[PolicyResource]) -> Value {
    let mut rules = vec![
        json!({"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
               "resources": ["pods"], "scope": "Namespaced"}),
        json!({"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
               "resources": ["deployments", "statefulsets", "daemonsets", "replicasets"], "scope": "Namespaced"}),
        json!({"apiGroups": ["batch"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
               "resources": ["jobs", "cronjobs"], "scope": "Namespaced"}),
    ];
    let mut grouped: std::collections::BTreeMap<(&str, &str), Vec<&str>> = Default::default();
    for r in extra {
        grouped
            .entry((r.group.as_str(), r.version.as_str()))
            .or_default()
            .push(r.resource.as_str());
    }
    for ((group, version), mut resources) in grouped {
        resources.sort_unstable();
        resources.dedup();
        rules.push(json!({"apiGroups": [group], "apiVersions": [version],
                          "operations": ["CREATE", "UPDATE"], "resources": resources, "scope": "*"}));
    }
    Value::Array(rules)
}

/// The `MutatingWebhookConfiguration`.
pub fn webhook_configuration(r: &Registration<'_>) -> Value {
    let c = r.config;
    let mut webhooks = Vec::new();
    let pod_rule = json!([{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
        "resources": ["pods"], "scope": "Namespaced",
    }]);
    if c.init_gate.enabled || c.resource_gate.enabled {
        let native = match r.native_gate {
            Some(_) => crate::admission::native_gate::native_clauses(c),
            None => Vec::new(),
        };
        for clause in c.clauses() {
            let object = clause.object_selector.clone().with(
                names::OPT_OUT,
                SelectorOperator::NotIn,
                &["false"],
            );
            let hook = json!({
                "name": gate_entry_name(&clause.name),
                "admissionReviewVersions": ["v1"],
                "clientConfig": client_config(r, paths::POD_GATE),
                "rules": pod_rule,
                "namespaceSelector": gate_namespace_selector(c, &clause, r.native_gate.filter(|_| native.contains(&clause.name))),
                "objectSelector": object.to_k8s(),
                "failurePolicy": crate::admission::scope::failure_policy(c.failure_policy),
                "timeoutSeconds": c.timeout_seconds,
                "reinvocationPolicy": "IfNeeded",
                "sideEffects": "None",
                "matchPolicy": "Equivalent",
            });
            webhooks.push(hook);
        }
    }
    if r.policies {
        webhooks.push(json!({
            "name": policies_webhook_name(),
            "admissionReviewVersions": ["v1"],
            "clientConfig": client_config(r, paths::POLICIES),
            "rules": policy_rules(&[]),
            "namespaceSelector": crate::admission::scope::with_exclusions(LabelSelector::default(), &c.excluded_namespaces).to_k8s(),
            "objectSelector": LabelSelector::default().with(names::OPT_OUT, SelectorOperator::NotIn, &["false"]).to_k8s(),
            // Policies are conveniences; a webhook outage must not block deployments.
            "failurePolicy": "Ignore",
            "timeoutSeconds": c.timeout_seconds,
            "reinvocationPolicy": "IfNeeded",
            "sideEffects": "None",
            "matchPolicy": "Equivalent",
        }));
    }
    if r.node_taint {
        webhooks.push(json!({
            "name": format!("nodes.{}", meshgate_api::DOMAIN),
            "admissionReviewVersions": ["v1"],
            "clientConfig": client_config(r, paths::NODE_TAINT),
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["nodes"], "scope": "Cluster"}],
            // Nodes must register even when meshgate is down: the controller taints them later.
            "failurePolicy": "Ignore",
            "timeoutSeconds": c.timeout_seconds.min(5),
            "sideEffects": "None",
            "matchPolicy": "Equivalent",
        }));
    }
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": r.name, "labels": {names::MANAGED_BY: "meshgate"}},
        "webhooks": webhooks,
    })
}

/// The `namespaceSelector` of a clause's gate webhook entry: the clause's, without the
/// excluded namespaces, and for a native clause (`routes` given) only the routed namespaces
/// (`crate::admission::native_gate`).
fn gate_namespace_selector(
    c: &GateConfig,
    clause: &meshgate_api::config::SelectorClause,
    routes: Option<&crate::admission::native_gate::Routes>,
) -> Value {
    let selector = crate::admission::scope::with_exclusions(
        clause.namespace_selector.clone(),
        &c.excluded_namespaces,
    );
    let selector = match routes {
        Some(routes) => routes.webhook_selector(selector),
        None => selector,
    };
    json!(selector.to_k8s())
}

/// The gate webhook entries of the native clauses, by name, with their `namespaceSelector` for
/// `routes` (what the controller keeps current, `crate::admission::native_gate`).
pub fn native_gate_entries(
    c: &GateConfig,
    routes: &crate::admission::native_gate::Routes,
) -> Vec<(String, Value)> {
    let native = crate::admission::native_gate::native_clauses(c);
    c.clauses()
        .into_iter()
        .filter(|clause| native.contains(&clause.name))
        .map(|clause| {
            (
                gate_entry_name(&clause.name),
                gate_namespace_selector(c, &clause, Some(routes)),
            )
        })
        .collect()
}

/// The name of a clause's gate webhook entry.
fn gate_entry_name(clause: &str) -> String {
    format!("{clause}.gate.{}", meshgate_api::DOMAIN)
}

/// A `MutatingAdmissionPolicy` and its binding that add the gate's taint to new nodes the gate
/// selects, evaluated by the API server itself (no webhook call).
pub fn node_taint_policy(gate_name: &str, gate: &NodeGateSpec, api: PolicyApi) -> [Value; 2] {
    let name = format!("meshgate-node-taint-{gate_name}");
    let key = cel_string(&gate.taint.key);
    let effect = cel_string(gate.taint.effect.as_str());
    let taint = format!("Object.spec.taints{{key: {key}, effect: {effect}}}");
    // A node without taints gets an empty list first, then the taint appended: a list literal
    // holding an `Object{}` (`value: [Object.spec.taints{...}]`) makes kube-apiserver 1.36.3
    // abort the request (`policy_enforcement`: reachable when the TaintNodesByCondition
    // plugin, which always adds a taint first, is off).
    let add_taint = format!(
        "(!has(object.spec.taints) ? \
[JSONPatch{{op: \"add\", path: \"/spec/taints\", value: []}}] : []) + \
[JSONPatch{{op: \"add\", path: \"/spec/taints/-\", value: {taint}}}]"
    );
    // A key outside meshgate's domain is recorded as meshgate's when it is added (the
    // controller only removes keys it owns).
    let own_domain = meshgate_api::in_domain(&gate.taint.key);
    let record = if own_domain {
        String::new()
    } else {
        let ann = cel_string(crate::node_gate::nodegate::OWNED_TAINTS);
        let path = cel_string(&format!(
            "/metadata/annotations/{}",
            crate::object::patch::escape(crate::node_gate::nodegate::OWNED_TAINTS)
        ));
        format!(
            " + (!has(object.metadata.annotations) ? \
[JSONPatch{{op: \"add\", path: \"/metadata/annotations\", value: {{{ann}: {key}}}}}] : \
({ann} in object.metadata.annotations ? \
[JSONPatch{{op: \"replace\", path: {path}, value: object.metadata.annotations[{ann}] + \",\" + {key}}}] : \
[JSONPatch{{op: \"add\", path: {path}, value: {key}}}]))"
        )
    };
    let expression = format!(
        "has(object.spec.taints) && object.spec.taints.exists(t, t.key == {key}) ? [] : \
{add_taint}{record}"
    );
    let labels = json!({names::MANAGED_BY: "meshgate", "meshgate.dev/node-gate": gate_name});
    let mut match_resources = json!({});
    if !gate.node_selector.is_empty() {
        match_resources["objectSelector"] =
            serde_json::to_value(gate.node_selector.to_k8s()).unwrap_or(Value::Null);
    }
    create_policy(
        api,
        &name,
        &labels,
        "nodes",
        (
            "IfNeeded",
            json!({"patchType": "JSONPatch", "jsonPatch": {"expression": expression}}),
        ),
        match_resources,
    )
}

/// A MutatingAdmissionPolicy on CREATE of the core `resource` with `mutation` (and its
/// reinvocation policy), failure policy `Ignore`, and its binding of the same name.
fn create_policy(
    api: PolicyApi,
    name: &str,
    labels: &Value,
    resource: &str,
    (reinvocation, mutation): (&str, Value),
    match_resources: Value,
) -> [Value; 2] {
    let policy = json!({
        "apiVersion": api.api_version(),
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": [resource],
            }]},
            "failurePolicy": "Ignore",
            "reinvocationPolicy": reinvocation,
            "mutations": [mutation],
        },
    });
    let binding = json!({
        "apiVersion": api.api_version(),
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": labels},
        "spec": {"policyName": name, "matchResources": match_resources},
    });
    [policy, binding]
}

/// The label a policy-enforcement probe's Lease carries (its value the probe's token).
pub const PROBE_LABEL: &str = "meshgate.dev/policy-probe";
/// The label the probe's policy adds: seen on the dry-run Lease, it proves the API server
/// runs MutatingAdmissionPolicies, not only stores them.
pub const PROBE_APPLIED_LABEL: &str = "meshgate.dev/policy-probe-applied";

/// Proof that the API server *runs* MutatingAdmissionPolicies: discovery lists the API whenever
/// its storage is enabled (`--runtime-config`), but the admission plugin runs only with the
/// `MutatingAdmissionPolicy` feature gate (docs/design.md, "Kubernetes versions"). A policy and
/// binding (named after `token`, labelled meshgate's) that label a Lease carrying
/// [`PROBE_LABEL`]` = token`, and that Lease, to be created with `dryRun` in `namespace`:
/// [`probe_applied`] on what comes back. A Lease because every identity that proves it may
/// create one: the controller's in its own namespace (its leader election), `install` and
/// `check` as the cluster's administrator; nothing is stored (`dryRun`).
pub fn enforcement_probe(api: PolicyApi, token: &str, namespace: &str) -> ([Value; 2], Value) {
    let name = format!("meshgate-policy-probe-{token}");
    let labels = json!({names::MANAGED_BY: "meshgate", PROBE_LABEL: token});
    let mutation = format!(
        "Object{{metadata: Object.metadata{{labels: {{{}: \"true\"}}}}}}",
        cel_string(PROBE_APPLIED_LABEL)
    );
    let mut pair = create_policy(
        api,
        &name,
        &labels,
        "leases",
        (
            "Never",
            json!({"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": mutation}}),
        ),
        json!({"objectSelector": {"matchLabels": {PROBE_LABEL: token}}}),
    );
    pair[0]["spec"]["matchConstraints"]["resourceRules"][0]["apiGroups"] =
        json!(["coordination.k8s.io"]);
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name, "namespace": namespace, "labels": {PROBE_LABEL: token}},
    });
    (pair, lease)
}

/// Whether the probe's policy changed `object` (the Lease the API server returned).
pub fn probe_applied(object: &Value) -> bool {
    object["metadata"]["labels"][PROBE_APPLIED_LABEL] == "true"
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_api::Profile;

    #[test]
    fn the_enforcement_probe_selects_only_its_own_lease() {
        let ([policy, binding], cm) = enforcement_probe(PolicyApi::V1beta1, "abc123", "default");
        assert_eq!(cm["kind"], "Lease");
        assert_eq!(
            policy["spec"]["matchConstraints"]["resourceRules"][0]["apiGroups"],
            json!(["coordination.k8s.io"])
        );
        assert_eq!(
            policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"],
            json!(["leases"])
        );
        assert_eq!(policy["apiVersion"], "admissionregistration.k8s.io/v1beta1");
        assert_eq!(binding["spec"]["policyName"], policy["metadata"]["name"]);
        assert_eq!(
            binding["spec"]["matchResources"]["objectSelector"]["matchLabels"][PROBE_LABEL],
            "abc123"
        );
        assert_eq!(cm["metadata"]["labels"][PROBE_LABEL], "abc123");
        assert_eq!(policy["metadata"]["labels"][names::MANAGED_BY], "meshgate");
        assert!(!probe_applied(&cm));
        let mut applied = cm.clone();
        applied["metadata"]["labels"][PROBE_APPLIED_LABEL] = json!("true");
        assert!(probe_applied(&applied));
    }

    fn reg(config: &GateConfig) -> Registration<'_> {
        Registration {
            name: "meshgate",
            config,
            target: WebhookTarget::Service {
                namespace: "meshgate-system".into(),
                name: "meshgate-webhook".into(),
                port: 443,
            },
            ca_bundle_pem: "PEM",
            policies: true,
            node_taint: true,
            native_gate: None,
        }
    }

    #[test]
    fn one_webhook_per_clause_with_the_required_settings() {
        let config = GateConfig {
            profiles: vec![Profile::IstioSidecar],
            ..GateConfig::default()
        };
        let mwc = webhook_configuration(&reg(&config));
        let hooks = mwc["webhooks"].as_array().unwrap();
        let names: Vec<&str> = hooks.iter().map(|h| h["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "istio-injection.gate.meshgate.dev",
                "istio-revision.gate.meshgate.dev",
                "istio-pod.gate.meshgate.dev",
                "policies.meshgate.dev",
                "nodes.meshgate.dev"
            ]
        );
        let gate = &hooks[0];
        assert_eq!(gate["reinvocationPolicy"], "IfNeeded");
        assert_eq!(gate["sideEffects"], "None");
        assert_eq!(gate["matchPolicy"], "Equivalent");
        assert_eq!(gate["failurePolicy"], "Ignore");
        assert_eq!(gate["timeoutSeconds"], 5);
        assert_eq!(gate["clientConfig"]["service"]["path"], "/mutate/pod-gate");
        assert_eq!(
            gate["namespaceSelector"]["matchLabels"]["istio-injection"],
            "enabled"
        );
        let excl = &gate["namespaceSelector"]["matchExpressions"][0];
        assert_eq!(excl["key"], "kubernetes.io/metadata.name");
        assert_eq!(excl["values"], json!(["kube-system", "meshgate-system"]));
        assert_eq!(hooks[4]["failurePolicy"], "Ignore", "nodes always register");
    }

    #[test]
    fn the_generated_selectors_agree_with_the_webhooks_own_decision() {
        // For label-only clauses, the API server's pre-filter and the webhook's predicate are
        // the same selectors: check a few pods against both.
        use crate::pod_gate::select::{Meta, clause_matches};
        let config = GateConfig {
            profiles: vec![Profile::IstioAmbient],
            ..GateConfig::default()
        };
        let clause = &config.clauses()[0];
        let mwc = webhook_configuration(&reg(&config));
        let ns_sel: LabelSelector =
            serde_json::from_value(mwc["webhooks"][0]["namespaceSelector"].clone()).unwrap();
        let obj_sel: LabelSelector =
            serde_json::from_value(mwc["webhooks"][0]["objectSelector"].clone()).unwrap();
        let meta = |pairs: &[(&str, &str)]| Meta {
            labels: pairs
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            ..Meta::default()
        };
        let namespaces = [
            meta(&[
                ("istio.io/dataplane-mode", "ambient"),
                ("kubernetes.io/metadata.name", "a"),
            ]),
            meta(&[("kubernetes.io/metadata.name", "b")]),
        ];
        let pods = [meta(&[]), meta(&[("istio.io/dataplane-mode", "none")])];
        for ns in &namespaces {
            for pod in &pods {
                assert_eq!(
                    ns_sel.matches(&ns.labels) && obj_sel.matches(&pod.labels),
                    clause_matches(clause, ns, pod),
                    "{ns:?} {pod:?}"
                );
            }
        }
    }

    #[test]
    fn admission_policy_is_bound_to_the_gates_nodes() {
        let gate: NodeGateSpec = serde_json::from_value(json!({
            "agents": [{"name": "cni", "namespace": "kube-system", "selector": {"matchLabels": {"app": "cni"}}}],
            "nodeSelector": {"matchLabels": {"pool": "mesh"}},
        }))
        .unwrap();
        let [policy, binding] = node_taint_policy("default", &gate, PolicyApi::V1);
        assert_eq!(policy["apiVersion"], "admissionregistration.k8s.io/v1");
        let expr = policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
            .as_str()
            .unwrap();
        assert!(
            expr.contains("\"node.meshgate.dev/agent-not-ready\""),
            "{expr}"
        );
        assert_eq!(binding["spec"]["policyName"], "meshgate-node-taint-default");
        assert_eq!(
            binding["spec"]["matchResources"]["objectSelector"]["matchLabels"]["pool"],
            "mesh"
        );
        assert_eq!(cel_string("a\"b\\"), "\"a\\\"b\\\\\"");
    }
}

#[cfg(test)]
mod server_timeout_tests {
    use super::server_timeout;
    use std::time::Duration;

    #[test]
    fn the_webhook_gives_up_before_the_api_server_does() {
        assert_eq!(server_timeout(5), Duration::from_millis(4750));
        assert_eq!(server_timeout(30), Duration::from_millis(29750));
        assert_eq!(server_timeout(1), Duration::from_millis(750));
        assert_eq!(server_timeout(0), Duration::from_millis(500));
    }
}

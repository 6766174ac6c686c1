//! Property tests of the invariants meshgate's safety rests on:
//!
//! 1. taint operations never remove a foreign taint, and orphan detection only ever names keys
//!    a gate owns;
//! 2. a node with an unready agent is never untainted, and a node whose agents are all Ready
//!    (past the removal delay) is never tainted;
//! 3. every mutation is idempotent: the init gate, the node taint at registration, and the
//!    policy engine (annotations, labels, strategic merge).
//!
//! Inputs are built from small alphabets so that generated cases collide (same keys, same
//! container names) often enough to exercise the interesting paths.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Taint;
use meshgate_api::config::GateConfig;
use meshgate_api::mutation_policy::{
    MatchResources, MetadataMutation, Mutation, MutationPolicySpec, OnConflict, Operation,
};
use meshgate_api::node_gate::{
    Agent, GateMode, GateResource, GateTaint, NodeGateSpec, TaintEffect,
};
use meshgate_api::{LabelSelector, Profile, names};
use meshgate_core::node_gate::nodegate::{
    AgentState, NodeObservation, decide, orphaned_taints, selects, taint_patch, taints_on_create,
};
use meshgate_core::object::Meta;
use meshgate_core::object::view::read_pod;
use meshgate_core::pod_gate::gate::{Planner, PodPlan, PodRequest, plan_pod};
use meshgate_core::policy::{self, MatchContext};
use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::{Value, json};

const GATE_KEY: &str = names::DEFAULT_TAINT_KEY;

/// Taint keys: the default gate key, a second gate key, and foreign ones.
const TAINT_KEYS: &[&str] = &[
    GATE_KEY,
    "cni.meshgate.dev/not-ready",
    "example.com/dedicated",
    "node.kubernetes.io/not-ready",
    "a",
];

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        // Integration tests have no lib.rs to put regression files next to.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Generators: nodes and gates
// ---------------------------------------------------------------------------------------------

fn taint() -> impl Strategy<Value = Taint> {
    (
        select(TAINT_KEYS),
        select(&["NoSchedule", "NoExecute", "PreferNoSchedule"][..]),
        option::of(select(&["", "gpu", "true"][..])),
    )
        .prop_map(|(key, effect, value)| Taint {
            key: key.to_owned(),
            effect: effect.to_owned(),
            value: value.map(str::to_owned),
            ..Taint::default()
        })
}

fn node_labels() -> impl Strategy<Value = BTreeMap<String, String>> {
    btree_map(
        select(&["pool", "zone"][..]).prop_map(str::to_owned),
        select(&["mesh", "other"][..]).prop_map(str::to_owned),
        0..3,
    )
}

fn node_selector() -> impl Strategy<Value = LabelSelector> {
    prop_oneof![
        Just(LabelSelector::default()),
        Just(LabelSelector::labels([("pool", "mesh")])),
        Just(LabelSelector::labels([("zone", "other")])),
    ]
}

fn gate_spec() -> impl Strategy<Value = NodeGateSpec> {
    (
        select(&TAINT_KEYS[..2]),
        prop_oneof![Just(TaintEffect::NoSchedule), Just(TaintEffect::NoExecute)],
        node_selector(),
        prop_oneof![Just(GateMode::Bootstrap), Just(GateMode::Continuous)],
        0u32..=3600,
        0u32..=3600,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(key, effect, node_selector, mode, grace, delay, taint_on_create, resource)| {
                NodeGateSpec {
                    taint: GateTaint {
                        key: key.to_owned(),
                        effect,
                    },
                    agents: vec![Agent {
                        name: "cni".into(),
                        namespace: "kube-system".into(),
                        selector: LabelSelector::labels([("app", "cni")]),
                        daemon_set: None,
                    }],
                    node_selector,
                    mode,
                    grace_period_seconds: grace,
                    removal_delay_seconds: delay,
                    taint_on_create,
                    resource: resource.then(|| GateResource {
                        name: names::DEFAULT_RESOURCE.into(),
                        count: 100,
                        provider: Default::default(),
                    }),
                    ..NodeGateSpec::default()
                }
            },
        )
}

/// Unix seconds in a realistic range (2001 to 2033).
fn time() -> impl Strategy<Value = i64> {
    1_000_000_000i64..2_000_000_000
}

fn ready_or_untargeted() -> impl Strategy<Value = AgentState> {
    prop_oneof![
        time().prop_map(|since| AgentState::Ready { since }),
        Just(AgentState::NotTargeted),
    ]
}

fn unready() -> impl Strategy<Value = AgentState> {
    prop_oneof![
        time().prop_map(|since| AgentState::NotReady { since }),
        Just(AgentState::Missing),
    ]
}

/// Agent states with at least one agent NotReady or Missing, at any position.
fn agents_with_unready() -> impl Strategy<Value = Vec<AgentState>> {
    (
        vec(prop_oneof![ready_or_untargeted(), unready()], 0..4),
        unready(),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(mut agents, bad, at)| {
            let i = at.index(agents.len() + 1);
            agents.insert(i, bad);
            agents
        })
}

fn node_annotations() -> impl Strategy<Value = BTreeMap<String, String>> {
    (
        any::<bool>(),
        option::of(select(&["g", "another-gate"][..])),
        option::of(select(&["team", "note"][..])),
    )
        .prop_map(|(ready, gate_mark, other)| {
            let mut a = BTreeMap::new();
            if ready {
                a.insert(
                    names::NODE_READY_SINCE.to_owned(),
                    "2024-01-01T00:00:00Z".to_owned(),
                );
            }
            // The per-gate marks: this gate's ("g") or another gate's.
            if let Some(gate) = gate_mark {
                a.insert(
                    meshgate_core::nodegate::ready_since_key(gate),
                    "2024-01-01T00:00:00Z".to_owned(),
                );
            }
            if let Some(k) = other {
                a.insert(k.to_owned(), "x".to_owned());
            }
            a
        })
}

// ---------------------------------------------------------------------------------------------
// 1. Taint operations never remove a foreign taint
// ---------------------------------------------------------------------------------------------

fn without_key(taints: &[Taint], key: &str) -> Vec<Taint> {
    taints.iter().filter(|t| t.key != key).cloned().collect()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn taint_patch_keeps_foreign_taints(
        gate in gate_spec(),
        taints in vec(taint(), 0..6),
        want_present in any::<bool>(),
    ) {
        let node = json!({"metadata": {"resourceVersion": "41"}, "spec": {"taints": taints}});
        let patch = taint_patch(&gate, &taints, "41", want_present);
        let out = match &patch {
            Some(p) => p
                .apply(&node)
                .map_err(|e| TestCaseError::fail(format!("{e}: {p:?} on {node}")))?,
            None => node.clone(),
        };
        let after: Vec<Taint> = serde_json::from_value(out["spec"]["taints"].clone())
            .map_err(|e| TestCaseError::fail(format!("taints after the patch: {e}")))?;
        let key = gate.taint.key.as_str();
        prop_assert_eq!(without_key(&after, key), without_key(&taints, key));
        prop_assert_eq!(after.iter().any(|t| t.key == key), want_present);
        if patch.is_some() && want_present {
            prop_assert_eq!(
                after.iter().filter(|t| t.key == key).map(|t| t.effect.as_str()).collect::<Vec<_>>(),
                vec![gate.taint.effect.as_str()]
            );
        }
        // The patch is conditional on what it was computed from: another controller's taint
        // that landed since (the node written again: a newer resourceVersion) is never
        // overwritten, whether the list read was empty or not.
        if let Some(p) = &patch {
            let mut changed = taints.clone();
            changed.push(Taint {
                key: "concurrent.example.com/new".into(),
                effect: "NoSchedule".into(),
                ..Taint::default()
            });
            let concurrent =
                json!({"metadata": {"resourceVersion": "42"}, "spec": {"taints": changed}});
            prop_assert!(p.apply(&concurrent).is_err(), "applies to {}", concurrent);
        }
    }

    #[test]
    fn orphaned_taints_are_only_unheld_gate_keys(
        gates in vec(gate_spec(), 0..4),
        labels in node_labels(),
        taints in vec(taint(), 0..6),
        recorded in vec(select(TAINT_KEYS), 0..3),
    ) {
        let annotations: BTreeMap<String, String> = if recorded.is_empty() {
            BTreeMap::new()
        } else {
            [(meshgate_core::node_gate::nodegate::OWNED_TAINTS.to_owned(), recorded.join(","))].into()
        };
        let orphans = orphaned_taints(gates.iter(), &labels, &annotations, &taints);
        for key in &orphans {
            prop_assert!(gates.iter().any(|g| &g.taint.key == key), "{} is no gate's key", key);
            prop_assert!(
                !gates.iter().any(|g| &g.taint.key == key && selects(g, &labels)),
                "{} is held by a gate selecting the node", key
            );
            prop_assert!(taints.iter().any(|t| &t.key == key), "{} is not on the node", key);
            prop_assert!(
                meshgate_core::node_gate::nodegate::owns_key(key, &annotations),
                "{} is not meshgate's", key
            );
        }
        // ...and every such key meshgate owns is named.
        for g in &gates {
            let key = &g.taint.key;
            let held = gates.iter().any(|h| &h.taint.key == key && selects(h, &labels));
            let owned = meshgate_core::node_gate::nodegate::owns_key(key, &annotations);
            if !held && owned && taints.iter().any(|t| &t.key == key) {
                prop_assert!(orphans.contains(key), "{} is an orphan", key);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. A node with an unready agent is never untainted
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    #[test]
    fn unready_agent_never_untaints(
        gate in gate_spec(),
        labels in node_labels(),
        annotations in node_annotations(),
        taints in vec(taint(), 0..5),
        created in time(),
        now in time(),
        agents in agents_with_unready(),
        advertised in any::<bool>(),
    ) {
        // A node the gate selects.
        let mut labels = labels;
        labels.extend(gate.node_selector.match_labels.clone());
        prop_assert!(selects(&gate, &labels));
        let node = NodeObservation {
            gate: "g",
            labels: &labels,
            annotations: &annotations,
            taints: &taints,
            created,
            agents: &agents,
            resource_advertised: advertised,
            now,
        };
        let d = decide(&gate, &node);
        // The one documented exception: agents with no pod at all, past the gate's
        // missingAgentTimeoutSeconds, with onMissingAgent: Release, no longer hold the node
        // (a missing agent must not hold nodes forever). A NotReady agent always holds it.
        let unready_present = agents
            .iter()
            .any(|a| matches!(a, AgentState::NotReady { .. }));
        let missing_given_up = !d.given_up.is_empty()
            && gate.on_missing_agent == meshgate_api::node_gate::MissingAgentPolicy::Release
            && now >= created + i64::from(gate.missing_agent_timeout_seconds);
        if unready_present || !missing_given_up {
            prop_assert_ne!(d.taint, Some(false), "{:?}", d);
        }
    }

    #[test]
    fn ready_node_is_never_tainted_after_the_delay(
        gate in gate_spec(),
        labels in node_labels(),
        annotations in node_annotations(),
        taints in vec(taint(), 0..5),
        created in time(),
        agents in vec(ready_or_untargeted(), 0..4),
        after in 0i64..100_000,
        advertised in any::<bool>(),
    ) {
        // A node the gate selects.
        let mut labels = labels;
        labels.extend(gate.node_selector.match_labels.clone());
        prop_assert!(selects(&gate, &labels));
        let ready_at = agents
            .iter()
            .filter_map(|a| match a {
                AgentState::Ready { since } => Some(*since),
                _ => None,
            })
            .max()
            .unwrap_or(created);
        let now = ready_at + i64::from(gate.removal_delay_seconds) + after;
        let node = NodeObservation {
            gate: "g",
            labels: &labels,
            annotations: &annotations,
            taints: &taints,
            created,
            agents: &agents,
            resource_advertised: advertised,
            now,
        };
        let d = decide(&gate, &node);
        prop_assert_ne!(d.taint, Some(true), "{:?}", d);
        // And a taint it still carries is removed.
        let tainted = taints.iter().any(|t| t.key == gate.taint.key);
        prop_assert_eq!(d.taint, tainted.then_some(false), "{:?}", d);
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Every mutation is idempotent
// ---------------------------------------------------------------------------------------------

fn string_map(
    keys: &'static [&'static str],
    values: &'static [&'static str],
) -> BoxedStrategy<Value> {
    btree_map(select(keys), select(values), 0..3)
        .prop_map(|m| json!(m))
        .boxed()
}

fn resources() -> impl Strategy<Value = Option<Value>> {
    option::of(prop_oneof![
        Just(json!({})),
        Just(Value::Null),
        Just(json!({"requests": {"cpu": "100m"}})),
        Just(json!({"limits": {"memory": "1Gi"}, "requests": null})),
        Just(json!({"requests": {names::DEFAULT_RESOURCE: "1"}})),
        Just(
            json!({"requests": {names::DEFAULT_RESOURCE: "1"}, "limits": {names::DEFAULT_RESOURCE: "1"}})
        ),
    ])
}

fn container(container_names: &'static [&'static str]) -> impl Strategy<Value = Value> {
    (
        select(container_names),
        select(&["app:1", "app:2", "nginx:latest"][..]),
        option::of(select(&["Always", "IfNotPresent"][..])),
        resources(),
        option::of(vec(
            (select(&["MODE", "DEBUG"][..]), select(&["0", "1"][..])),
            0..3,
        )),
        option::of(select(&[80u16, 8080][..])),
    )
        .prop_map(|(name, image, pull, resources, env, port)| {
            let mut c = json!({"name": name, "image": image});
            if let Some(p) = pull {
                c["imagePullPolicy"] = json!(p);
            }
            if let Some(r) = resources {
                c["resources"] = r;
            }
            if let Some(env) = env {
                c["env"] = env
                    .into_iter()
                    .map(|(n, v)| json!({"name": n, "value": v}))
                    .collect();
            }
            if let Some(p) = port {
                c["ports"] = json!([{"containerPort": p}]);
            }
            c
        })
}

fn init_container() -> impl Strategy<Value = Value> {
    (
        select(
            &[
                "istio-init",
                "migrate",
                names::GATE_CONTAINER,
                "istio-proxy",
            ][..],
        ),
        any::<bool>(),
        option::of(select(&[0i64, 1000][..])),
    )
        .prop_map(|(name, sidecar, uid)| {
            let mut c = json!({"name": name, "image": "x"});
            if sidecar {
                c["restartPolicy"] = json!("Always");
            }
            if let Some(uid) = uid {
                c["securityContext"] = json!({"runAsUser": uid});
            }
            c
        })
}

/// A Pod as the API server would send it (kind and apiVersion set), with small alphabets.
fn pod() -> impl Strategy<Value = Value> {
    (
        option::of(string_map(
            &["istio.io/dataplane-mode", names::OPT_OUT, "app"],
            &["ambient", "none", "false", "true", "web"],
        )),
        option::of(string_map(
            &[
                names::OPT_OUT,
                "team",
                "meshgate.dev/init-containers-as-proxy-uid",
            ],
            &["false", "true", "payments"],
        )),
        option::of(any::<bool>()),
        option::of(vec(init_container(), 0..4)),
        vec(container(&["app", "web", "mesh-proxy"]), 0..3),
        option::of(select(&["default", "builder"][..])),
    )
        .prop_map(
            |(labels, annotations, host_network, inits, containers, sa)| {
                let mut metadata = json!({"name": "p"});
                if let Some(l) = labels {
                    metadata["labels"] = l;
                }
                if let Some(a) = annotations {
                    metadata["annotations"] = a;
                }
                let mut spec = json!({"containers": containers});
                if let Some(h) = host_network {
                    spec["hostNetwork"] = json!(h);
                }
                if let Some(i) = inits {
                    spec["initContainers"] = json!(i);
                }
                if let Some(sa) = sa {
                    spec["serviceAccountName"] = json!(sa);
                }
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
            },
        )
}

fn namespace_meta() -> impl Strategy<Value = Meta> {
    select(&["ambient", "none", ""][..]).prop_map(|mode| Meta {
        labels: if mode.is_empty() {
            BTreeMap::new()
        } else {
            [("istio.io/dataplane-mode".to_owned(), mode.to_owned())].into()
        },
        ..Meta::default()
    })
}

fn plan(config: &GateConfig, namespace: &str, ns: &Meta, pod: &Value) -> PodPlan {
    plan_pod(
        config,
        &PodRequest {
            operation: "CREATE",
            namespace,
            pod,
            namespace_meta: ns,
            limit_ranges: &[],
        },
    )
}

/// A node as a Node CREATE carries it: spec absent, empty, without taints, with a taint list.
fn node() -> impl Strategy<Value = Value> {
    (
        node_labels(),
        prop_oneof![
            Just(None),
            Just(Some(json!({}))),
            Just(Some(json!({"taints": null}))),
            Just(Some(json!({"podCIDR": "10.0.0.0/24"}))),
            vec(taint(), 0..4).prop_map(|t| Some(json!({"taints": t}))),
        ],
    )
        .prop_map(|(labels, spec)| {
            let mut node = json!({"apiVersion": "v1", "kind": "Node",
                                  "metadata": {"name": "n", "labels": labels}});
            if let Some(spec) = spec {
                node["spec"] = spec;
            }
            node
        })
}

// Policies: building blocks that are idempotent on their own and together, in any order (no
// condition reads what another block writes; see the idempotency note in `policy`).

const META_KEYS: &[&str] = &["app", "tier", names::OPT_OUT, "example.com/x"];
const META_VALUES: &[&str] = &["web", "false", "1", ""];

fn metadata_mutation() -> impl Strategy<Value = MetadataMutation> {
    (
        btree_map(
            select(META_KEYS).prop_map(str::to_owned),
            select(META_VALUES).prop_map(str::to_owned),
            1..3,
        ),
        prop_oneof![Just(OnConflict::Overwrite), Just(OnConflict::Keep)],
    )
        .prop_map(|(values, on_conflict)| MetadataMutation {
            values,
            on_conflict,
        })
}

fn strategic_merge() -> impl Strategy<Value = Value> {
    let name = || select(&["app", "web", "mesh-proxy", "new"][..]);
    let meta_key = || select(META_KEYS);
    let meta_value = || {
        prop_oneof![
            select(META_VALUES).prop_map(|v| json!(v)),
            Just(Value::Null)
        ]
    };
    prop_oneof![
        (meta_key(), meta_value()).prop_map(|(k, v)| json!({"metadata": {"labels": {k: v}}})),
        (meta_key(), select(META_VALUES))
            .prop_map(|(k, v)| json!({"metadata": {"annotations": {format!("+({k})"): v}}})),
        (name(), select(&["Always", "IfNotPresent"][..])).prop_map(|(n, p)| json!({"spec": {
            "containers": [{"name": n, "image": "proxy:1", "+(imagePullPolicy)": p}]}})),
        (name(), select(&["MODE", "MESH"][..]), meta_value())
            .prop_map(|(n, e, v)| json!({"spec": {
            "containers": [{"name": n, "env": [{"name": e, "value": v}]}]}})),
        name()
            .prop_map(|n| json!({"spec": {"containers": [{"name": n, "imagePullPolicy": null}]}})),
        (name(), select(&[80u16, 15090][..])).prop_map(|(n, p)| json!({"spec": {
            "containers": [{"name": n, "ports": [{"containerPort": p, "protocol": "TCP"}]}]}})),
        // Templates: conditions on values no block writes.
        Just(json!({"spec": {"containers": [
            {"(image)": "app*", "securityContext": {"runAsNonRoot": true}}]}})),
        Just(json!({"spec": {"containers": [
            {"name": "web", "(image)": "*:latest", "+(imagePullPolicy)": "Always"}]}})),
        Just(json!({"spec": {"initContainers": [
            {"(name)": "*", "securityContext": {"+(runAsUser)": 1337}}]}})),
        // Conditional and global anchors outside lists.
        Just(json!({"spec": {"(serviceAccountName)": "default", "dnsPolicy": "ClusterFirst"}})),
        Just(json!({"metadata": {"annotations": {"<(team)": "pay*"}},
                    "spec": {"priorityClassName": "high"}})),
        Just(json!({"spec": {"initContainers": [{"<(name)": "istio-*"}],
                    "terminationGracePeriodSeconds": 45}})),
        // Replaced lists, literal empty maps, deletions.
        select(&["a", "b"][..]).prop_map(|k| json!({"spec": {"tolerations": [
            {"key": k, "operator": "Exists"}]}})),
        Just(json!({"spec": {"volumes": [{"name": "cache", "emptyDir": {}}]}})),
        Just(json!({"spec": {"hostNetwork": null, "securityContext": {"fsGroup": 1337}}})),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        metadata_mutation().prop_map(|m| Mutation {
            annotations: Some(m),
            ..Mutation::default()
        }),
        metadata_mutation().prop_map(|m| Mutation {
            labels: Some(m),
            ..Mutation::default()
        }),
        strategic_merge().prop_map(|p| Mutation {
            strategic_merge: Some(p),
            ..Mutation::default()
        }),
    ]
}

fn policies() -> impl Strategy<Value = Vec<(String, MutationPolicySpec)>> {
    vec(
        (
            select(&["a", "b", "c"][..]),
            vec(mutation(), 1..4),
            any::<bool>(),
        )
            .prop_map(|(name, mutations, pod_templates)| {
                (
                    name.to_owned(),
                    MutationPolicySpec {
                        match_: MatchResources {
                            kinds: vec!["Pod".into()],
                            operations: vec![Operation::Create],
                            ..MatchResources::default()
                        },
                        exclude: None,
                        pod_templates,
                        target: Default::default(),
                        mutations,
                        warning: Some("w".into()),
                        existing: Default::default(),
                    },
                )
            }),
        1..4,
    )
}

/// The pod itself, or a Deployment with the pod (less kind and apiVersion) as its template.
fn object() -> impl Strategy<Value = Value> {
    (pod(), any::<bool>()).prop_map(|(mut pod, workload)| {
        if !workload {
            return pod;
        }
        if let Some(m) = pod.as_object_mut() {
            m.remove("kind");
            m.remove("apiVersion");
        }
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
               "spec": {"replicas": 1, "template": pod}})
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn init_gate_is_idempotent(
        pod in pod(),
        ns in namespace_meta(),
        namespace in select(&["apps", "kube-system"][..]),
        resource_gate in any::<bool>(),
    ) {
        let mut config = GateConfig {
            profiles: vec![Profile::IstioAmbient],
            ..GateConfig::default()
        };
        config.resource_gate.enabled = resource_gate;
        // The webhook plans from the review's bytes (a lean view decoded from the text): the
        // same plan as from the pod's `Value`.
        let from_value = plan(&config, namespace, &ns, &pod);
        let planner = Planner::new(&config);
        let from_text = read_pod(&pod.to_string(), |view| {
            planner.plan_view("CREATE", namespace, &ns, &[], view)
        })
        .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(&from_text, &from_value);
        let PodPlan::Mutate { patch, verdict, .. } = from_value else {
            return Ok(());
        };
        let once = patch
            .apply(&pod)
            .map_err(|e| TestCaseError::fail(format!("{e}: {patch:?} on {pod}")))?;
        let gates = once
            .pointer("/spec/initContainers")
            .and_then(Value::as_array)
            .map_or(0, |l| l.iter().filter(|c| c["name"] == names::GATE_CONTAINER).count());
        if verdict.is_ok() {
            prop_assert_eq!(
                once.pointer("/spec/initContainers/0/name"),
                Some(&json!(names::GATE_CONTAINER))
            );
            prop_assert_eq!(gates, 1);
        } else {
            prop_assert_eq!(gates, 0);
        }
        match plan(&config, namespace, &ns, &once) {
            PodPlan::Mutate { patch, .. } => prop_assert!(patch.is_empty(), "second patch {:?}", patch),
            other => prop_assert!(false, "second plan {:?}", other),
        }
    }

    #[test]
    fn node_taint_on_create_is_idempotent(gates in vec(gate_spec(), 0..4), node in node()) {
        let patch = taints_on_create(gates.iter(), &node);
        let once = patch
            .apply(&node)
            .map_err(|e| TestCaseError::fail(format!("{e}: {patch:?} on {node}")))?;
        let second = taints_on_create(gates.iter(), &once);
        prop_assert!(second.is_empty(), "second patch {:?} on {}", second, once);
        // Existing taints stay, in order, in front.
        if let Some(before) = node.pointer("/spec/taints").and_then(Value::as_array) {
            let after = once.pointer("/spec/taints").and_then(Value::as_array);
            prop_assert_eq!(after.map(|a| &a[..before.len()]), Some(&before[..]));
        }
    }

    #[test]
    fn policies_are_idempotent(policies in policies(), object in object()) {
        for (name, spec) in &policies {
            prop_assert_eq!(policy::validate(spec), Ok(()), "generated policy {} is invalid", name);
        }
        let labels = BTreeMap::new();
        let ctx = MatchContext {
            operation: Operation::Create,
            namespace: "apps",
            namespace_labels: &labels,
            cluster: &meshgate_core::policy::context::NoCluster,
        };
        let run = |object: &Value| {
            let applied =
                policy::apply(policies.iter().map(|(n, s)| (n.as_str(), s)), object, &ctx);
            match applied.failed.first() {
                Some(e) => Err(TestCaseError::fail(e.to_string())),
                None => Ok(applied),
            }
        };
        let once = run(&object)?;
        let twice = run(&once.object)?;
        prop_assert_eq!(&twice.object, &once.object);
        // (Policies that disagree about a value each still "change" it on the second run, only
        // to the same end result: the object, not the list of policies, is the invariant.)
    }
}

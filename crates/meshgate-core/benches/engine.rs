//! Engine micro-benchmarks: what one pod admission costs in meshgate's pure core.
//!
//! * `policies/{1,10,100}`: matching plus patch planning for one ~3 KB Pod against N
//!   MutationPolicies, as `/mutate/policies` does it: `policy::apply` (match every policy,
//!   apply the matching ones in name order) and `policy::admission_patch` (the JSON patch of the
//!   response). The policies are a realistic mix: annotation policies and strategic merges with
//!   anchors, each with a `namespaceSelector`, a few matching the pod's namespace, most not.
//! * `policies_match_only/100`: `policy_matches` alone over the 100 policies.
//! * `policies_clone/{1,10,100}`: a deep clone of the N `(name, spec)` pairs, which the webhook's
//!   `Sources::policies()` made on every review before it matched (it now shares one list).
//! * `plan_pod_ambient`: `gate::plan_pod` for the same Pod in an ambient namespace, from its
//!   `Value` (a `Planner` built per call, as `plan_pod` does).
//! * `plan_pod_view`: what `/mutate/pod-gate` does instead: a `Planner` built once, the Pod read
//!   from its JSON text as a lean `view::PodView` and planned.
//! * `decode_review`: `serde_json::from_slice` of the whole AdmissionReview into a `Value`, which
//!   the webhook did before either handler ran until it decoded reviews into borrowed views.
//!
//! Run: `cargo bench -p meshgate-core --bench engine` (2 s of measurement per benchmark).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use meshgate_api::mutation_policy::{MutationPolicySpec, Operation};
use meshgate_api::{GateConfig, Profile};
use meshgate_core::object::Meta;
use meshgate_core::object::view::read_pod;
use meshgate_core::pod_gate::gate::{self, PodPlan, PodRequest};
use meshgate_core::policy::{self, MatchContext};
use serde_json::{Value, json};

/// The Pod both benchmarks (this one and the webhook's) use: ~3.2 KB of JSON.
const POD: &str = include_str!("../../../tools/bench/pod.json");

fn pod() -> Value {
    serde_json::from_str(POD).expect("tools/bench/pod.json is JSON")
}

/// The labels of the pod's namespace `apps`.
fn namespace_labels() -> BTreeMap<String, String> {
    [
        ("kubernetes.io/metadata.name", "apps"),
        ("istio.io/dataplane-mode", "ambient"),
        ("team", "payments"),
        ("env", "prod"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// Policy `i` of a set: every policy selects namespaces by label; those with `i % 16 == 0` or
/// `i == 1` select the pod's namespace, the others another team's. Mutations rotate between
/// an annotation policy and two strategic merges with anchors.
fn policy(i: usize) -> (String, MutationPolicySpec) {
    let matching = i.is_multiple_of(16) || i == 1;
    let team = if matching {
        "payments".to_owned()
    } else {
        format!("team-{i}")
    };
    let mutations = match i % 3 {
        0 => json!([{
            "annotations": {
                "values": {
                    format!("policies.example.com/p{i}"): "applied",
                    "traffic.sidecar.istio.io/excludeOutboundPorts": "5432"
                },
                "onConflict": "Keep"
            }
        }]),
        1 => json!([{
            "strategicMerge": {
                "spec": {
                    "containers": [{
                        "(name)": "*",
                        "+(imagePullPolicy)": "IfNotPresent",
                        "securityContext": {"+(runAsUser)": 1000 + i},
                        "env": [{"name": format!("POLICY_{i}"), "value": "on"}]
                    }]
                }
            }
        }]),
        _ => json!([{
            "strategicMerge": {
                "metadata": {
                    "annotations": {
                        "<(prometheus.io/scrape)": "true",
                        format!("+(policies.example.com/scrape-{i})"): "9090"
                    }
                },
                "spec": {
                    "(serviceAccountName)": "?*",
                    "dnsConfig": {"options": [{"name": "ndots", "value": format!("{}", 2 + i % 3)}]}
                }
            }
        }]),
    };
    let spec: MutationPolicySpec = serde_json::from_value(json!({
        "match": {
            "kinds": ["Pod"],
            "namespaceSelector": {"matchLabels": {"team": team, "env": "prod"}},
        },
        "exclude": {"namespaces": ["kube-*"]},
        "podTemplates": true,
        "mutations": mutations,
        "warning": if i.is_multiple_of(5) { Some(format!("policy {i} changes pods")) } else { None },
    }))
    .expect("policy spec");
    if let Err(errors) = policy::validate(&spec) {
        panic!("policy {i} is invalid: {errors:?}");
    }
    (format!("policy-{i:03}"), spec)
}

fn policies(n: usize) -> Vec<(String, MutationPolicySpec)> {
    (0..n).map(policy).collect()
}

fn bench_policies(c: &mut Criterion) {
    let pod = pod();
    let labels = namespace_labels();
    let ctx = MatchContext {
        operation: Operation::Create,
        namespace: "apps",
        namespace_labels: &labels,
        cluster: &meshgate_core::policy::context::NoCluster,
    };
    let mut group = c.benchmark_group("policies");
    for n in [1usize, 10, 100] {
        let set = policies(n);
        // The set must do what it claims: some policies change the pod.
        let applied = policy::apply(set.iter().map(|(n, s)| (n.as_str(), s)), &pod, &ctx);
        assert!(applied.failed.is_empty(), "{:?}", applied.failed);
        assert!(applied.changed(), "no policy of {n} changed the pod");
        let ops = policy::admission_patch(&pod, &applied.object).len();
        eprintln!(
            "policies/{n}: {} of {n} changed the pod, {ops} patch operations",
            applied.policies.len()
        );
        group.bench_with_input(BenchmarkId::from_parameter(n), &set, |b, set| {
            b.iter(|| {
                let applied = policy::apply(
                    set.iter().map(|(n, s)| (n.as_str(), s)),
                    black_box(&pod),
                    &ctx,
                );
                policy::admission_patch(&pod, &applied.object)
            });
        });
    }
    group.finish();

    let set = policies(100);
    c.bench_function("policies_match_only/100", |b| {
        b.iter(|| {
            set.iter()
                .filter(|(_, s)| policy::policy_matches(s, black_box(&pod), &ctx))
                .count()
        });
    });

    let mut group = c.benchmark_group("policies_clone");
    for n in [1usize, 10, 100] {
        let set = policies(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &set, |b, set| {
            b.iter(|| black_box(set).clone());
        });
    }
    group.finish();
}

fn bench_plan_pod(c: &mut Criterion) {
    let pod = pod();
    let config = GateConfig {
        profiles: vec![Profile::IstioAmbient],
        ..Default::default()
    };
    let namespace = Meta {
        labels: namespace_labels(),
        annotations: BTreeMap::new(),
    };
    let req = PodRequest {
        operation: "CREATE",
        namespace: "apps",
        pod: &pod,
        namespace_meta: &namespace,
        limit_ranges: &[],
    };
    match gate::plan_pod(&config, &req) {
        PodPlan::Mutate { patch, .. } if !patch.is_empty() => {}
        other => panic!("the ambient pod is not gated: {other:?}"),
    }
    c.bench_function("plan_pod_ambient", |b| {
        b.iter(|| gate::plan_pod(&config, black_box(&req)));
    });
    let planner = gate::Planner::new(&config);
    let text = pod.to_string();
    let from_text = |text: &str| {
        read_pod(text, |view| {
            planner.plan_view("CREATE", "apps", &namespace, &[], view)
        })
        .expect("the pod is JSON")
    };
    assert_eq!(from_text(&text), gate::plan_pod(&config, &req));
    c.bench_function("plan_pod_view", |b| {
        b.iter(|| from_text(black_box(&text)));
    });
}

fn bench_decode(c: &mut Criterion) {
    let review = serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0f9c1d2e-3b4a-4c5d-8e6f-7a8b9c0d1e2f",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "apps",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod(),
            "dryRun": false
        }
    }))
    .expect("review JSON");
    c.bench_function("decode_review", |b| {
        b.iter(|| serde_json::from_slice::<Value>(black_box(&review)).expect("review"));
    });
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(50)
}

criterion_group! {
    name = engine;
    config = config();
    targets = bench_policies, bench_plan_pod, bench_decode
}
criterion_main!(engine);

//! Arbitrary bytes as an `AdmissionReview` body, through what the webhook does with it.
//!
//! Asserts:
//! * decoding never panics; an answerable review yields a well-formed response;
//! * the direct decode of the bytes reads what a `serde_json::Value` of the same bytes says
//!   (uid, namespace, dryRun, the object), and the init gate plans the same from the lean pod
//!   view of the object's text as from its `Value`;
//! * a Pod: the init gate (istio-ambient, resource gate on) plans a patch that applies to the
//!   very object it was planned for, and planning again on the result adds nothing;
//! * a Node CREATE: the startup-taint patch applies, and is empty the second time;
//! * any object: one fixed strategic-merge policy never fails (it is valid), and the admission
//!   patch (`json_patch::diff`) applied to the object gives exactly the engine's result.
#![no_main]

use std::collections::BTreeMap;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use meshgate_api::mutation_policy::{MutationPolicySpec, Operation};
use meshgate_api::node_gate::NodeGateSpec;
use meshgate_api::{GateConfig, Profile};
use meshgate_core::gate::{PodPlan, PodRequest, Planner};
use meshgate_core::nodegate::taints_on_create;
use meshgate_core::patch::JsonPatch;
use meshgate_core::policy::{self, MatchContext};
use meshgate_core::select::Meta;
use meshgate_core::view::read_pod;
use meshgate_webhook::admission::{self, ReviewError};
use serde_json::Value;

static CONFIG: LazyLock<GateConfig> = LazyLock::new(|| {
    let mut c = GateConfig {
        profiles: vec![Profile::IstioAmbient],
        ..GateConfig::default()
    };
    c.resource_gate.enabled = true;
    c
});

static PLANNER: LazyLock<Planner> = LazyLock::new(|| Planner::new(&CONFIG));

/// The namespace every review comes from: an ambient one, so that pods are selected.
static NAMESPACE: LazyLock<Meta> = LazyLock::new(|| Meta {
    labels: [("istio.io/dataplane-mode".to_owned(), "ambient".to_owned())].into(),
    ..Meta::default()
});

static POLICY: LazyLock<MutationPolicySpec> = LazyLock::new(|| {
    let spec: MutationPolicySpec = serde_saphyr::from_str(
        r#"
match:
  kinds: [Pod]
  operations: [CREATE, UPDATE]
podTemplates: true
mutations:
- strategicMerge:
    metadata:
      annotations:
        +(meshgate.dev/fuzz): "seen"
        traffic.sidecar.istio.io/excludeOutboundIPRanges: "0.0.0.0/0"
    spec:
      initContainers:
      - (name): "*"
        securityContext:
          +(runAsUser): 1337
      containers:
      - name: istio-proxy
        +(image): proxy:1
        env:
        - name: MESH
          value: "1"
        ports:
        - containerPort: 15090
          protocol: TCP
      volumes:
      - name: cache
        emptyDir: {}
- labels:
    values:
      meshgate.dev/fuzzed: "true"
"#,
    )
    .expect("the fixed policy parses");
    assert_eq!(policy::validate(&spec), Ok(()), "the fixed policy is valid");
    spec
});

static GATES: LazyLock<Vec<NodeGateSpec>> = LazyLock::new(|| {
    serde_json::from_value(serde_json::json!([
        {"agents": [{"name": "cni", "namespace": "kube-system", "selector": {}}]},
        {"agents": [{"name": "ztunnel", "namespace": "istio-system", "selector": {}}],
         "taint": {"key": "ztunnel.meshgate.dev/not-ready", "effect": "NoExecute"},
         "nodeSelector": {"matchLabels": {"pool": "mesh"}}},
    ]))
    .expect("the fixed gates parse")
});

fn applies(patch: &JsonPatch, object: &Value, what: &str) -> Value {
    patch
        .apply(object)
        .unwrap_or_else(|e| panic!("{what}: planned patch {patch:?} does not apply: {e}"))
}

fuzz_target!(|data: &[u8]| {
    let mut scratch = None;
    let req = match admission::decode(data, &mut scratch) {
        Ok(req) => req,
        Err(ReviewError::NotJson(_) | ReviewError::Unanswerable(_)) => return,
        Err(ReviewError::Invalid { uid, message }) => {
            let _ = admission::deny(&uid, 400, &message);
            return;
        }
    };
    let Ok(object) = req.object_value() else {
        // The object holds what only a skipped value may hold unchecked (a number out of
        // range, a lone surrogate escape): the body is no `Value` either. The gate still plans
        // from the view without failing.
        assert!(serde_json::from_slice::<Value>(data).is_err());
        let _ = read_pod(req.object.get(), |view| {
            PLANNER.plan_view(req.operation, &req.namespace, &NAMESPACE, view)
        });
        return;
    };

    // The direct decode agrees with a `Value` of the same bytes. (A body a `Value` refuses but
    // the decode answers holds a number out of range or a lone `\u` surrogate in a value nobody
    // reads: the documented difference, see `admission`.)
    if let Ok(value) = serde_json::from_slice::<Value>(data) {
        let field = |path: &str| value.pointer(path).and_then(Value::as_str);
        assert_eq!(field("/request/uid"), Some(&*req.uid), "uid");
        assert_eq!(field("/request/namespace").unwrap_or_default(), &*req.namespace, "namespace");
        assert_eq!(field("/request/kind/kind"), Some(&*req.kind), "kind");
        assert_eq!(
            value.pointer("/request/dryRun").and_then(Value::as_bool).unwrap_or(false),
            req.dry_run,
            "dryRun"
        );
        assert_eq!(value.pointer("/request/object").unwrap_or(&Value::Null), &object, "object");
    }
    let object = &object;

    if req.kind == "Pod" {
        let request = |pod| PodRequest {
            operation: req.operation,
            namespace: &req.namespace,
            pod,
            namespace_meta: &NAMESPACE,
        };
        let planned = PLANNER.plan(&request(object));
        let from_text = read_pod(req.object.get(), |view| {
            PLANNER.plan_view(req.operation, &req.namespace, &NAMESPACE, view)
        })
        .expect("the object is JSON text");
        assert_eq!(from_text, planned, "lean view and Value plan differently");
        if let PodPlan::Mutate { patch, .. } = planned {
            let _ = admission::allow(&req.uid, &patch, &[]);
            if !patch.is_empty() {
                let gated = applies(&patch, object, "init gate");
                match PLANNER.plan(&request(&gated)) {
                    PodPlan::Mutate { patch: again, .. } => assert!(
                        again.is_empty(),
                        "init gate not idempotent: second patch {again:?}"
                    ),
                    other => panic!("init gate: the gated pod is planned as {other:?}"),
                }
            }
        }
    }

    if req.kind == "Node" && req.operation == "CREATE" {
        let patch = taints_on_create(GATES.iter(), object);
        if !patch.is_empty() {
            let tainted = applies(&patch, object, "node taint");
            let again = taints_on_create(GATES.iter(), &tainted);
            assert!(
                again.is_empty(),
                "node taint not idempotent: second patch {again:?}"
            );
        }
    }

    let operation = match req.operation {
        "CREATE" => Operation::Create,
        "UPDATE" => Operation::Update,
        _ => return,
    };
    let labels = BTreeMap::new();
    let ctx = MatchContext {
        operation,
        namespace: &req.namespace,
        namespace_labels: &labels,
    };
    let applied = policy::apply([("fixed", &*POLICY)], object, &ctx)
        .unwrap_or_else(|e| panic!("a valid strategic-merge policy failed: {e}"));
    if applied.changed() {
        let patch = policy::admission_patch(object, &applied.object);
        let _ = admission::allow(&req.uid, &patch, &applied.warnings);
        let patched = applies(&patch, object, "admission patch");
        assert_eq!(
            patched, applied.object,
            "the admission patch does not reproduce the policy result"
        );
    }
});

//! Arbitrary bytes through the policy engine, three ways:
//!
//! * UTF-8 input is read as YAML (JSON is YAML): as a `MutationPolicySpec` (or a whole
//!   `MutationPolicy`, whose `spec` is taken) → `validate` → if valid, `apply` to a fixed Pod,
//!   to the document itself and to the document made a Pod. A valid policy without JSON patches
//!   never fails; whatever it returns, the admission patch reproduces it exactly.
//! * The same document through `kyverno::import`: never panics, and every policy it returns is
//!   valid.
//! * Input with a `0xFF` byte (never in UTF-8, so never in the documents above) is split there
//!   into a JSON target and a JSON strategic-merge patch, applied with `apply_mutations` (the
//!   strategic merge of one mutation): never panics, and on an error the target is unchanged.
#![no_main]

use std::collections::BTreeMap;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use meshgate_api::mutation_policy::{Mutation, MutationPolicySpec, Operation};
use meshgate_core::kyverno;
use meshgate_core::policy::{self, MatchContext};
use serde_json::{Value, json};

static POD: LazyLock<Value> = LazyLock::new(|| {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "shop",
                     "labels": {"app": "web"}, "annotations": {"team": "payments"}},
        "spec": {
            "initContainers": [{"name": "init-db", "image": "busybox:1.36"},
                               {"name": "proxy", "image": "proxy", "restartPolicy": "Always"}],
            "containers": [
                {"name": "web", "image": "nginx:latest",
                 "env": [{"name": "MODE", "value": "prod"}],
                 "ports": [{"containerPort": 8080, "name": "http"}],
                 "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]},
                {"name": "metrics", "image": "exporter:1.2",
                 "securityContext": {"runAsUser": 1000}},
            ],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "tolerations": [{"key": "a", "operator": "Exists"}],
        },
    })
});

fn run_policy(name: &str, spec: &MutationPolicySpec, object: &Value) {
    let labels: BTreeMap<String, String> = [("env".to_owned(), "prod".to_owned())].into();
    let has_json_patch = spec.mutations.iter().any(|m| m.json_patch.is_some());
    for operation in [Operation::Create, Operation::Update] {
        let ctx = MatchContext {
            operation,
            namespace: "shop",
            namespace_labels: &labels,
        };
        match policy::apply([(name, spec)], object, &ctx) {
            Ok(applied) => {
                let patch = policy::admission_patch(object, &applied.object);
                let patched = patch
                    .apply(object)
                    .unwrap_or_else(|e| panic!("admission patch {patch:?} does not apply: {e}"));
                assert_eq!(
                    patched, applied.object,
                    "the admission patch does not reproduce the policy result"
                );
            }
            Err(e) => assert!(has_json_patch, "a valid policy failed: {e}"),
        }
    }
}

fn policy_doc(doc: &Value) {
    // A whole MutationPolicy, or just its spec.
    let spec_value = match doc.get("spec") {
        Some(spec) if doc.get("kind").is_some() => spec.clone(),
        _ => doc.clone(),
    };
    if let Ok(spec) = serde_json::from_value::<MutationPolicySpec>(spec_value)
        && policy::validate(&spec).is_ok()
    {
        run_policy("fuzzed", &spec, &POD);
        run_policy("fuzzed", &spec, doc);
        if let Value::Object(m) = doc {
            let mut as_pod = m.clone();
            as_pod.insert("kind".into(), json!("Pod"));
            as_pod.remove("apiVersion");
            run_policy("fuzzed", &spec, &Value::Object(as_pod));
        }
    }
    if let Ok(imported) = kyverno::import(doc) {
        for (name, spec) in &imported.policies {
            assert_eq!(
                policy::validate(spec),
                Ok(()),
                "kyverno import produced an invalid policy {name}"
            );
            run_policy(name, spec, &POD);
        }
    }
}

fn strategic_pair(target: &[u8], patch: &[u8]) {
    let (Ok(target), Ok(patch)) = (
        serde_json::from_slice::<Value>(target),
        serde_json::from_slice::<Value>(patch),
    ) else {
        return;
    };
    let spec = MutationPolicySpec {
        match_: Default::default(),
        exclude: None,
        pod_templates: false,
        target: Default::default(),
        mutations: vec![Mutation {
            strategic_merge: Some(patch),
            ..Mutation::default()
        }],
        warning: None,
        existing: Default::default(),
    };
    let mut work = target.clone();
    match policy::apply_mutations("fuzzed", &spec, &mut work) {
        Ok(changed) => assert_eq!(changed, work != target, "wrong changed flag"),
        Err(_) => assert_eq!(work, target, "target changed by a failed mutation"),
    }
}

fuzz_target!(|data: &[u8]| {
    if let Some(i) = data.iter().position(|b| *b == 0xFF) {
        strategic_pair(&data[..i], &data[i + 1..]);
        return;
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(doc) = serde_saphyr::from_str::<Value>(text) else {
        return;
    };
    policy_doc(&doc);
});

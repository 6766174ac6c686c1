//! Engine tests on fixtures (`tests/fixtures/policy/`).

use std::collections::BTreeMap;

use meshgate_api::mutation_policy::{MutationPolicySpec, Operation};
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

const POD: &str = include_str!("../../tests/fixtures/policy/pod.yaml");
const DEPLOYMENT: &str = include_str!("../../tests/fixtures/policy/deployment.yaml");
const CRONJOB: &str = include_str!("../../tests/fixtures/policy/cronjob.yaml");
const SERVICE: &str = include_str!("../../tests/fixtures/policy/service.yaml");

fn yaml(s: &str) -> Value {
    serde_saphyr::from_str(s).unwrap()
}

fn spec(s: &str) -> MutationPolicySpec {
    let spec: MutationPolicySpec = serde_saphyr::from_str(s).unwrap();
    if let Err(e) = validate(&spec) {
        panic!("fixture policy invalid: {e:?}");
    }
    spec
}

fn no_labels() -> &'static BTreeMap<String, String> {
    static EMPTY: BTreeMap<String, String> = BTreeMap::new();
    &EMPTY
}

fn create_in(ns: &str) -> MatchContext<'_> {
    MatchContext {
        operation: Operation::Create,
        namespace: ns,
        namespace_labels: no_labels(),
        cluster: &crate::policy::context::NoCluster,
    }
}

/// Applies the named policies to `object` as a CREATE in `shop`.
fn run(policies: &[(&str, &MutationPolicySpec)], object: &Value) -> Applied {
    let applied = apply(policies.iter().copied(), object, &create_in("shop"));
    assert!(applied.failed.is_empty(), "{:?}", applied.failed);
    applied
}

/// The one failure of applying `policy` to `object` (as a CREATE in `shop`).
fn failure(name: &str, policy: &MutationPolicySpec, object: &Value) -> PolicyError {
    let applied = apply([(name, policy)], object, &create_in("shop"));
    assert_eq!(&applied.object, object, "a failed policy leaves the object");
    assert!(applied.policies.is_empty());
    match <[PolicyError; 1]>::try_from(applied.failed) {
        Ok([e]) => e,
        Err(all) => panic!("expected one failure, got {all:?}"),
    }
}

/// One policy, one strategic merge, on a Pod.
fn smp(patch: Value, object: &Value) -> Value {
    let s = MutationPolicySpec {
        mutations: vec![Mutation {
            strategic_merge: Some(patch),
            ..Default::default()
        }],
        ..spec("match: {}\nmutations: [{labels: {values: {x: y}}}]")
    };
    assert_eq!(validate(&s), Ok(()));
    let out = run(&[("p", &s)], object).object;
    // Idempotency: the same policy on the result changes nothing.
    assert_eq!(run(&[("p", &s)], &out).object, out, "not idempotent");
    out
}

// ---------------------------------------------------------------- metadata mutations

#[test]
fn annotations_overwrite_and_keep() {
    let pod = yaml(POD);
    let overwrite =
        spec("match: {}\nmutations:\n- annotations:\n    values: {team: mesh, new: \"1\"}\n");
    let keep = spec(
        "match: {}\nmutations:\n- annotations:\n    values: {team: mesh, other: \"2\"}\n    onConflict: Keep\n",
    );
    let out = run(&[("a", &overwrite)], &pod);
    assert_eq!(
        out.object["metadata"]["annotations"],
        json!({"team": "mesh", "new": "1"})
    );
    assert_eq!(out.policies, ["a"]);
    let out = run(&[("a", &keep)], &pod);
    assert_eq!(
        out.object["metadata"]["annotations"],
        json!({"team": "payments", "other": "2"})
    );
    for s in [&overwrite, &keep] {
        let once = run(&[("a", s)], &pod).object;
        let twice = run(&[("a", s)], &once);
        assert_eq!(twice.object, once);
        assert!(twice.policies.is_empty(), "second run reports no change");
    }
}

#[test]
fn labels_create_missing_maps() {
    let s = spec("match: {}\nmutations:\n- labels:\n    values: {mesh: istio}\n");
    let bare = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}});
    let out = run(&[("l", &s)], &bare).object;
    assert_eq!(out["metadata"]["labels"], json!({"mesh": "istio"}));
    assert_eq!(run(&[("l", &s)], &out).object, out);
}

// ---------------------------------------------------------------- strategic merge: anchors

#[test]
fn add_if_absent_anchor() {
    let pod = yaml(POD);
    let out = smp(
        json!({"metadata": {"annotations": {"+(team)": "mesh", "+(added)": "yes"}}}),
        &pod,
    );
    assert_eq!(
        out["metadata"]["annotations"],
        json!({"team": "payments", "added": "yes"})
    );
    // On maps that do not exist yet, and inside list elements per element.
    let out = smp(
        json!({"spec": {"securityContext": {"+(runAsNonRoot)": true},
                        "containers": [{"(name)": "*", "securityContext": {"+(runAsUser)": 2000}}]}}),
        &pod,
    );
    assert_eq!(
        out["spec"]["securityContext"],
        json!({"runAsNonRoot": true})
    );
    assert_eq!(
        out["spec"]["containers"][0]["securityContext"],
        json!({"runAsUser": 2000})
    );
    assert_eq!(
        out["spec"]["containers"][1]["securityContext"],
        json!({"runAsUser": 1000})
    );
}

#[test]
fn conditional_anchor_selects_list_elements() {
    let pod = yaml(POD);
    let out = smp(
        json!({"spec": {"containers": [{"(image)": "*:latest", "imagePullPolicy": "Always"}]}}),
        &pod,
    );
    assert_eq!(out["spec"]["containers"][0]["imagePullPolicy"], "Always");
    assert!(
        out["spec"]["containers"][1]
            .get("imagePullPolicy")
            .is_none()
    );
    // The anchor itself is never written.
    assert!(out["spec"]["containers"][0].get("(image)").is_none());
    assert_eq!(out["spec"]["containers"].as_array().unwrap().len(), 2);
}

#[test]
fn conditional_anchor_with_object_value_and_nested_condition() {
    let pod = yaml(POD);
    // Containers whose securityContext has runAsUser 1000.
    let out = smp(
        json!({"spec": {"containers": [{"(securityContext)": {"runAsUser": 1000}, "securityContext": {"runAsNonRoot": true}}]}}),
        &pod,
    );
    // The selected container is patched in place; the other is untouched.
    assert!(
        out["spec"]["containers"][0]
            .get("securityContext")
            .is_none()
    );
    assert_eq!(
        out["spec"]["containers"][1]["securityContext"],
        json!({"runAsUser": 1000, "runAsNonRoot": true})
    );
    // A condition in a nested map of the element restricts the element too.
    let out = smp(
        json!({"spec": {"containers": [{"securityContext": {"(runAsUser)": 1000}, "(name)": "*", "resources": {"limits": {"cpu": "1"}}}]}}),
        &pod,
    );
    assert!(out["spec"]["containers"][0].get("resources").is_none());
    assert_eq!(
        out["spec"]["containers"][1]["resources"],
        json!({"limits": {"cpu": "1"}})
    );
}

#[test]
fn failed_conditional_anchor_outside_lists_skips_the_whole_mutation() {
    let pod = yaml(POD);
    let patch = |app: &str| {
        json!({"metadata": {"labels": {"(app)": app}, "annotations": {"checked": "yes"}},
               "spec": {"priorityClassName": "high"}})
    };
    let out = smp(patch("web"), &pod);
    assert_eq!(out["metadata"]["annotations"]["checked"], "yes");
    assert_eq!(out["spec"]["priorityClassName"], "high");
    let out = smp(patch("d?"), &pod);
    assert_eq!(out, pod);
    // A missing key fails the condition too.
    let out = smp(
        json!({"spec": {"(hostNetwork)": false, "priorityClassName": "high"}}),
        &pod,
    );
    assert_eq!(out, pod);
}

#[test]
fn global_anchor_in_a_list_is_a_condition_on_the_whole_mutation() {
    let pod = yaml(POD);
    let patch = |registry: &str| {
        json!({"spec": {"containers": [{"<(image)": registry}],
                        "imagePullSecrets": [{"name": "regcred"}]}})
    };
    let out = smp(patch("corp.reg.com/*"), &pod);
    assert_eq!(
        out["spec"]["imagePullSecrets"],
        json!([{"name": "regcred"}])
    );
    // Containers are untouched: the element is only a condition.
    assert_eq!(out["spec"]["containers"], pod["spec"]["containers"]);
    let out = smp(patch("other.reg/*"), &pod);
    assert_eq!(out, pod);
}

#[test]
fn global_anchor_nested_in_a_list_element_is_a_condition_too() {
    let pod = yaml(POD);
    // The element holds only anchors (the global one in a nested map): valid, and a pure
    // condition on the whole mutation.
    let patch = |user: i64| {
        json!({"spec": {"containers": [{"securityContext": {"<(runAsUser)": user}}],
                        "priorityClassName": "high"}})
    };
    let out = smp(patch(1000), &pod);
    assert_eq!(out["spec"]["priorityClassName"], "high");
    assert_eq!(out["spec"]["containers"], pod["spec"]["containers"]);
    assert_eq!(smp(patch(0), &pod), pod);
    // With a field that writes, the element is refused (Kyverno would drop the field).
    let bad = spec("match: {}\nmutations: [{labels: {values: {x: y}}}]\n");
    let mut bad = bad;
    bad.mutations[0] = Mutation {
        strategic_merge: Some(
            json!({"spec": {"containers": [{"securityContext": {"<(runAsUser)": 1, "privileged": false}}]}}),
        ),
        ..Default::default()
    };
    let errors = validate(&bad).unwrap_err();
    assert!(
        errors.iter().any(|e| e.contains("a list element with a global anchor is only a condition; its other fields (securityContext)")),
        "{errors:?}"
    );
}

#[test]
fn global_anchor_on_a_map_and_on_a_missing_list() {
    let pod = yaml(POD);
    let out = smp(
        json!({"metadata": {"labels": {"<(app)": "web"}}, "spec": {"priorityClassName": "x"}}),
        &pod,
    );
    assert_eq!(out["spec"]["priorityClassName"], "x");
    let out = smp(
        json!({"metadata": {"labels": {"<(app)": "db"}}, "spec": {"priorityClassName": "x"}}),
        &pod,
    );
    assert_eq!(out, pod);
    let out = smp(
        json!({"spec": {"tolerations": [{"<(key)": "*"}], "priorityClassName": "x"}}),
        &pod,
    );
    assert_eq!(out, pod);
}

#[test]
fn global_and_add_anchor_safe_to_evict() {
    let pod = yaml(POD);
    let patch = json!({"metadata": {"annotations": {"+(cluster-autoscaler.kubernetes.io/safe-to-evict)": "true"}},
                       "spec": {"volumes": [{"<(emptyDir)": {}}]}});
    let out = smp(patch.clone(), &pod);
    assert_eq!(
        out["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"],
        "true"
    );
    assert_eq!(out["spec"]["volumes"], pod["spec"]["volumes"]);
    let mut no_empty_dir = pod.clone();
    no_empty_dir["spec"]["volumes"] = json!([{"name": "cfg", "configMap": {"name": "c"}}]);
    assert_eq!(smp(patch, &no_empty_dir), no_empty_dir);
}

// ---------------------------------------------------------------- strategic merge: lists, null

#[test]
fn containers_merge_by_name() {
    let pod = yaml(POD);
    let out = smp(
        json!({"spec": {"containers": [
            {"name": "web", "imagePullPolicy": "IfNotPresent"},
            {"name": "proxy", "image": "envoy:1.30"}
        ]}}),
        &pod,
    );
    let names: Vec<&str> = out["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    // As Kyverno orders them: the patch's elements first, in its order, then the others.
    assert_eq!(names, ["web", "proxy", "metrics"]);
    assert_eq!(
        out["spec"]["containers"][0]["imagePullPolicy"],
        "IfNotPresent"
    );
    assert_eq!(out["spec"]["containers"][0]["image"], "nginx:latest");
}

#[test]
fn init_containers_and_env_merge_by_name() {
    let pod = yaml(POD);
    let out = smp(
        json!({"spec": {
            "initContainers": [{"name": "gate", "image": "meshgate-wait"}, {"name": "init-db", "image": "busybox:1.37"}],
            "containers": [{"name": "web", "env": [{"name": "DEBUG", "value": "1"}, {"name": "MESH", "value": "on"}]}]
        }}),
        &pod,
    );
    assert_eq!(
        out["spec"]["initContainers"],
        json!([
            {"name": "gate", "image": "meshgate-wait"},
            {"name": "init-db", "image": "busybox:1.37", "args": ["wait", "db"]}
        ])
    );
    assert_eq!(
        out["spec"]["containers"][0]["env"],
        json!([{"name": "DEBUG", "value": "1"}, {"name": "MESH", "value": "on"}, {"name": "MODE", "value": "prod"}])
    );
}

#[test]
fn env_in_every_container_via_template() {
    let pod = yaml(POD);
    let out = smp(
        json!({"spec": {"containers": [{"(name)": "*", "env": [{"name": "MESH", "value": "on"}]}]}}),
        &pod,
    );
    for c in out["spec"]["containers"].as_array().unwrap() {
        assert!(
            c["env"]
                .as_array()
                .unwrap()
                .contains(&json!({"name": "MESH", "value": "on"}))
        );
    }
}

#[test]
fn list_elements_apply_in_order() {
    let pod = yaml(POD);
    // The second element's add anchor sees what the first one set.
    let out = smp(
        json!({"spec": {"containers": [
            {"(image)": "*", "imagePullPolicy": "Always"},
            {"(image)": "*", "+(imagePullPolicy)": "IfNotPresent", "+(stdin)": false}
        ]}}),
        &pod,
    );
    for c in out["spec"]["containers"].as_array().unwrap() {
        assert_eq!(c["imagePullPolicy"], "Always");
        assert_eq!(c["stdin"], false);
    }
    // A template after an added element selects it too.
    let out = smp(
        json!({"spec": {"containers": [
            {"name": "proxy", "image": "envoy"},
            {"(name)": "*", "+(terminationMessagePolicy)": "FallbackToLogsOnError"}
        ]}}),
        &pod,
    );
    assert_eq!(out["spec"]["containers"].as_array().unwrap().len(), 3);
    for c in out["spec"]["containers"].as_array().unwrap() {
        assert_eq!(c["terminationMessagePolicy"], "FallbackToLogsOnError");
    }
}

#[test]
fn scalar_lists_are_replaced() {
    let pod = yaml(POD);
    let out = smp(
        json!({"spec": {"containers": [{"name": "web", "args": ["--port", "9090"]}]}}),
        &pod,
    );
    assert_eq!(
        out["spec"]["containers"][0]["args"],
        json!(["--port", "9090"])
    );
}

#[test]
fn null_deletes() {
    let pod = yaml(POD);
    let out = smp(
        json!({"metadata": {"annotations": {"team": null, "absent": null}},
               "spec": {"containers": [{"name": "metrics", "securityContext": null}]}}),
        &pod,
    );
    assert!(out["metadata"]["annotations"].get("team").is_none());
    assert!(
        out["spec"]["containers"][1]
            .get("securityContext")
            .is_none()
    );
}

#[test]
fn malformed_patch_is_a_typed_error() {
    let pod = yaml(POD);
    let s = MutationPolicySpec {
        mutations: vec![
            Mutation {
                labels: Some(MetadataMutation {
                    values: [("a".to_owned(), "b".to_owned())].into(),
                    on_conflict: OnConflict::Overwrite,
                }),
                ..Default::default()
            },
            Mutation {
                strategic_merge: Some(json!({"spec": {"containers": [{"image": "x"}]}})),
                ..Default::default()
            },
        ],
        ..spec("match: {}\nmutations: [{labels: {values: {x: y}}}]")
    };
    let err = failure("bad", &s, &pod);
    assert!(
        matches!(&err, PolicyError::StrategicMerge { policy, mutation: 1, path, .. } if policy == "bad" && path == ".spec.containers[0]")
    );
    assert!(
        err.to_string()
            .starts_with("policy bad: spec.mutations[1].strategicMerge.spec.containers[0]: ")
    );
}

#[test]
fn a_failing_policy_takes_no_other_policy_down() {
    let pod = yaml(POD);
    // Sorted by name: `a` applies, `b` fails half-way (its first mutation is not kept), `c`
    // applies to what `a` left.
    let a = spec("match: {}\nmutations: [{labels: {values: {a: \"1\"}}}]\n");
    let b = spec(
        "match: {}\nmutations:\n- labels: {values: {b: \"1\"}}\n- jsonPatch: [{op: test, path: /metadata/labels/app, value: db}]\n",
    );
    let c = spec("match: {}\nmutations: [{annotations: {values: {c: \"1\"}}}]\n");
    let applied = apply([("c", &c), ("b", &b), ("a", &a)], &pod, &create_in("shop"));
    assert_eq!(applied.policies, ["a", "c"]);
    assert_eq!(applied.failed.len(), 1);
    assert!(
        matches!(&applied.failed[0], PolicyError::JsonPatch { policy, mutation: 1, op: 0, .. } if policy == "b"),
        "{:?}",
        applied.failed
    );
    let labels = &applied.object["metadata"]["labels"];
    assert_eq!(labels["a"], "1");
    assert!(
        labels.get("b").is_none(),
        "none of the failed policy's mutations is kept"
    );
    assert_eq!(applied.object["metadata"]["annotations"]["c"], "1");
}

// ---------------------------------------------------------------- JSON patch

fn json_policy(ops: Value) -> MutationPolicySpec {
    spec(&format!("match: {{}}\nmutations:\n- jsonPatch: {ops}\n"))
}

#[test]
fn json_patch_applies() {
    let pod = yaml(POD);
    let s = json_policy(json!([
        {"op": "test", "path": "/spec/containers/0/name", "value": "web"},
        {"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "X", "value": "1"}},
        {"op": "replace", "path": "/metadata/annotations/team", "value": "mesh"},
        {"op": "copy", "from": "/metadata/labels/app", "path": "/metadata/labels/copied"},
        {"op": "remove", "path": "/spec/volumes"}
    ]));
    let out = run(&[("j", &s)], &pod).object;
    assert_eq!(
        out["spec"]["containers"][0]["env"][2],
        json!({"name": "X", "value": "1"})
    );
    assert_eq!(out["metadata"]["annotations"]["team"], "mesh");
    assert_eq!(out["metadata"]["labels"]["copied"], "web");
    assert!(out["spec"].get("volumes").is_none());
}

#[test]
fn json_patch_errors_name_policy_mutation_and_operation() {
    let pod = yaml(POD);
    let s = spec(
        "match: {}\nmutations:\n- labels: {values: {a: b}}\n- jsonPatch:\n  - {op: add, path: /metadata/labels/ok, value: x}\n  - {op: add, path: /spec/missing/deep, value: x}\n",
    );
    let err = failure("jp", &s, &pod);
    match &err {
        PolicyError::JsonPatch {
            policy,
            mutation,
            op,
            message,
        } => {
            assert_eq!((policy.as_str(), *mutation, *op), ("jp", 1, 1));
            assert!(message.contains("/spec/missing/deep"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(
        err.to_string()
            .starts_with("policy jp: spec.mutations[1].jsonPatch[1]: ")
    );

    let failed_test = json_policy(json!([
        {"op": "test", "path": "/metadata/labels/app", "value": "db"},
        {"op": "add", "path": "/metadata/labels/x", "value": "1"}
    ]));
    let err = failure("t", &failed_test, &pod);
    assert!(matches!(err, PolicyError::JsonPatch { op: 0, .. }), "{err}");
    assert!(err.to_string().contains("value did not match"), "{err}");
}

#[test]
fn json_patch_with_test_guard_is_idempotent() {
    let pod = yaml(POD);
    let s = json_policy(json!([
        {"op": "replace", "path": "/spec/containers/0/image", "value": "nginx:1.27"}
    ]));
    let once = run(&[("j", &s)], &pod).object;
    assert_eq!(run(&[("j", &s)], &once).object, once);
}

// ---------------------------------------------------------------- ordering, results

#[test]
fn policies_apply_in_name_order_and_report_changes() {
    let pod = yaml(POD);
    let first =
        spec("match: {}\nwarning: adds a label\nmutations:\n- labels: {values: {step: one}}\n");
    let second =
        spec("match: {}\nwarning: overrides\nmutations:\n- labels: {values: {step: two}}\n");
    let noop =
        spec("match: {}\nwarning: never shown\nmutations:\n- labels: {values: {app: web}}\n");
    // Given in reverse order; applied a, b, c.
    let out = run(&[("c-noop", &noop), ("b", &second), ("a", &first)], &pod);
    assert_eq!(out.object["metadata"]["labels"]["step"], "two");
    assert_eq!(out.policies, ["a", "b"]);
    assert_eq!(out.warnings, ["a: adds a label", "b: overrides"]);
    // A later policy sees the earlier ones' result.
    let later = spec(
        "match:\n  objectSelector: {matchLabels: {step: two}}\nmutations:\n- annotations: {values: {seen: \"yes\"}}\n",
    );
    let out = run(&[("z", &later), ("b", &second)], &pod);
    assert_eq!(out.object["metadata"]["annotations"]["seen"], "yes");
}

#[test]
fn nothing_applied_returns_the_object_unchanged() {
    let pod = yaml(POD);
    let s = spec("match: {namespaces: [other]}\nmutations:\n- labels: {values: {x: y}}\n");
    let out = run(&[("p", &s)], &pod);
    assert_eq!(out.object, pod);
    assert!(out.policies.is_empty() && out.warnings.is_empty() && !out.changed());
    assert!(admission_patch(&pod, &out.object).is_empty());
}

#[test]
fn admission_patch_turns_the_original_into_the_result() {
    let pod = yaml(POD);
    let s = spec(
        "match: {}\nmutations:\n- annotations: {values: {traffic.sidecar.istio.io/excludeOutboundIPRanges: 0.0.0.0/0}}\n- strategicMerge: {spec: {containers: [{name: proxy, image: envoy}]}}\n",
    );
    let out = run(&[("p", &s)], &pod).object;
    let patch = admission_patch(&pod, &out);
    assert!(!patch.is_empty());
    assert_eq!(patch.apply(&pod).unwrap(), out);
}

// ---------------------------------------------------------------- matching

#[test]
fn namespaces_with_wildcards() {
    let s = spec(
        "match: {namespaces: [\"team-?\", \"prod-*\"]}\nmutations: [{labels: {values: {x: y}}}]\n",
    );
    let pod = yaml(POD);
    for (ns, expected) in [
        ("team-a", true),
        ("team-ab", false),
        ("prod-eu-1", true),
        ("prod-", true),
        ("staging", false),
    ] {
        assert_eq!(policy_matches(&s, &pod, &create_in(ns)), expected, "{ns}");
    }
}

#[test]
fn operations_default_to_create() {
    let pod = yaml(POD);
    let update = MatchContext {
        operation: Operation::Update,
        ..create_in("shop")
    };
    let default = spec("match: {}\nmutations: [{labels: {values: {x: y}}}]\n");
    assert!(policy_matches(&default, &pod, &create_in("shop")));
    assert!(!policy_matches(&default, &pod, &update));
    let both =
        spec("match: {operations: [CREATE, UPDATE]}\nmutations: [{labels: {values: {x: y}}}]\n");
    assert!(policy_matches(&both, &pod, &update));
    let only_update =
        spec("match: {operations: [UPDATE]}\nmutations: [{labels: {values: {x: y}}}]\n");
    assert!(!policy_matches(&only_update, &pod, &create_in("shop")));
}

#[test]
fn exclude_removes_what_it_matches() {
    let pod = yaml(POD);
    let s = spec(
        "match: {namespaces: [\"*\"]}\nexclude:\n  namespaces: [kube-*, shop]\n  objectSelector: {matchLabels: {app: web}}\nmutations: [{labels: {values: {x: y}}}]\n",
    );
    // Excluded only when every field of the exclude block holds.
    assert!(!policy_matches(&s, &pod, &create_in("shop")));
    assert!(policy_matches(&s, &pod, &create_in("other")));
    let mut db = pod.clone();
    db["metadata"]["labels"]["app"] = json!("db");
    assert!(policy_matches(&s, &db, &create_in("shop")));
    // Empty operations in exclude do not mean CREATE only.
    let s = spec(
        "match: {operations: [CREATE, UPDATE]}\nexclude: {namespaces: [shop]}\nmutations: [{labels: {values: {x: y}}}]\n",
    );
    let update = MatchContext {
        operation: Operation::Update,
        ..create_in("shop")
    };
    assert!(!policy_matches(&s, &pod, &update));
}

#[test]
fn namespace_selector_sees_the_namespace_labels() {
    let pod = yaml(POD);
    let s = spec(
        "match:\n  namespaceSelector: {matchLabels: {istio-injection: enabled}}\nmutations: [{labels: {values: {x: y}}}]\n",
    );
    let labels: BTreeMap<String, String> =
        [("istio-injection".to_owned(), "enabled".to_owned())].into();
    let ctx = MatchContext {
        namespace_labels: &labels,
        cluster: &crate::policy::context::NoCluster,
        ..create_in("shop")
    };
    assert!(policy_matches(&s, &pod, &ctx));
    assert!(!policy_matches(&s, &pod, &create_in("shop")));
}

#[test]
fn pod_templates_mutate_workload_templates() {
    let deployment = yaml(DEPLOYMENT);
    let annotate = "mutations:\n- annotations: {values: {mesh: \"on\"}}\n- strategicMerge: {spec: {containers: [{(name): \"*\", imagePullPolicy: Always}]}}\n";
    let without = spec(&format!("match: {{}}\n{annotate}"));
    let with = spec(&format!("match: {{}}\npodTemplates: true\n{annotate}"));
    assert!(!run(&[("p", &without)], &deployment).changed());
    let out = run(&[("p", &with)], &deployment);
    assert_eq!(out.policies, ["p"]);
    let template = &out.object["spec"]["template"];
    assert_eq!(template["metadata"]["annotations"], json!({"mesh": "on"}));
    assert_eq!(
        template["spec"]["containers"][0]["imagePullPolicy"],
        "Always"
    );
    // The workload's own metadata is untouched.
    assert_eq!(out.object["metadata"], deployment["metadata"]);
    assert_eq!(run(&[("p", &with)], &out.object).object, out.object);
}

#[test]
fn object_selector_sees_the_workload_labels() {
    let deployment = yaml(DEPLOYMENT);
    let s = spec(
        "match:\n  objectSelector: {matchLabels: {tier: frontend}}\npodTemplates: true\nmutations: [{labels: {values: {x: y}}}]\n",
    );
    // `tier` is on the Deployment, not on its template.
    assert!(run(&[("p", &s)], &deployment).changed());
}

#[test]
fn cronjob_template_path() {
    let cronjob = yaml(CRONJOB);
    let explicit =
        spec("match: {kinds: [CronJob]}\nmutations: [{labels: {values: {mesh: istio}}}]\n");
    let out = run(&[("p", &explicit)], &cronjob).object;
    assert_eq!(
        out["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"],
        json!({"app": "report", "mesh": "istio"})
    );
    assert!(out["metadata"].get("labels").is_none());
    let auto = spec(
        "match: {kinds: [Pod]}\npodTemplates: true\nmutations: [{labels: {values: {mesh: istio}}}]\n",
    );
    assert_eq!(run(&[("p", &auto)], &cronjob).object, out);
    // A Pod-only exclude excludes the auto-generated workloads too.
    let excluded = spec(
        "match: {kinds: [Pod]}\nexclude: {kinds: [Pod], namespaces: [shop]}\npodTemplates: true\nmutations: [{labels: {values: {mesh: istio}}}]\n",
    );
    assert!(!run(&[("p", &excluded)], &cronjob).changed());
}

#[test]
fn explicit_workload_kinds_do_not_match_pods() {
    let s = spec("match: {kinds: [Deployment]}\nmutations: [{labels: {values: {x: y}}}]\n");
    assert!(!run(&[("p", &s)], &yaml(POD)).changed());
    assert!(run(&[("p", &s)], &yaml(DEPLOYMENT)).changed());
    assert!(!run(&[("p", &s)], &yaml(CRONJOB)).changed());
}

#[test]
fn other_kinds_and_templateless_workloads_are_left_alone() {
    let s = spec("match: {}\npodTemplates: true\nmutations: [{labels: {values: {x: y}}}]\n");
    let service = yaml(SERVICE);
    assert!(!policy_matches(&s, &service, &create_in("shop")));
    assert_eq!(run(&[("p", &s)], &service).object, service);
    let bare = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}});
    assert!(!run(&[("p", &s)], &bare).changed());
}

#[test]
fn opted_out_objects_are_never_mutated() {
    let s = spec("match: {}\npodTemplates: true\nmutations: [{labels: {values: {x: y}}}]\n");
    let mut pod = yaml(POD);
    pod["metadata"]["annotations"]["meshgate.dev/inject"] = json!("false");
    assert!(!run(&[("p", &s)], &pod).changed());
    let mut deployment = yaml(DEPLOYMENT);
    deployment["spec"]["template"]["metadata"]["labels"]["meshgate.dev/inject"] = json!("false");
    assert!(!run(&[("p", &s)], &deployment).changed());
}

// ---------------------------------------------------------------- target: Object

#[test]
fn object_target_mutates_the_workload_itself() {
    let deployment = yaml(DEPLOYMENT);
    // The same mutations, written against the Deployment: its own annotations, a volume in its
    // pod template and a mount in every container.
    let s = spec(
        r#"
match: {kinds: [Deployment]}
target: Object
mutations:
- annotations: {values: {owner: platform}}
- strategicMerge:
    spec:
      template:
        spec:
          volumes: [{name: cache, emptyDir: {}}]
          containers: [{(name): "*", volumeMounts: [{name: cache, mountPath: /cache}]}]
"#,
    );
    let out = run(&[("p", &s)], &deployment);
    assert_eq!(out.policies, ["p"]);
    assert_eq!(
        out.object["metadata"]["annotations"],
        json!({"owner": "platform"})
    );
    let template = &out.object["spec"]["template"];
    assert_eq!(
        template["spec"]["volumes"],
        json!([{"name": "cache", "emptyDir": {}}])
    );
    assert_eq!(
        template["spec"]["containers"][0]["volumeMounts"],
        json!([{"name": "cache", "mountPath": "/cache"}])
    );
    // The template's own metadata is not where the annotation goes.
    assert_eq!(
        template["metadata"],
        deployment["spec"]["template"]["metadata"]
    );
    assert_eq!(run(&[("p", &s)], &out.object).object, out.object);

    // The default target keeps the Pod-shaped meaning: the same annotation lands on the
    // template, and a patch of `spec.template` is a patch of the pod's `spec.template`.
    let pod_shaped = spec(
        "match: {kinds: [Deployment]}
mutations: [{annotations: {values: {owner: platform}}}]
",
    );
    let out = run(&[("p", &pod_shaped)], &deployment).object;
    assert_eq!(
        out["spec"]["template"]["metadata"]["annotations"],
        json!({"owner": "platform"})
    );
    assert_eq!(out["metadata"], deployment["metadata"]);
}

#[test]
fn object_target_fields_of_the_workload_and_every_kind_named() {
    // A Job's own field, a CronJob's own field, and a Pod named beside them: each is
    // patched as the object it is.
    let s = spec(
        r#"
match: {kinds: [Pod, Job, CronJob]}
target: Object
mutations:
- strategicMerge: {metadata: {labels: {+(team): platform}}}
- strategicMerge: {spec: {+(ttlSecondsAfterFinished): 600}}
"#,
    );
    let job = json!({"apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "j", "namespace": "shop"},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}});
    let out = run(&[("p", &s)], &job).object;
    assert_eq!(out["spec"]["ttlSecondsAfterFinished"], 600);
    assert_eq!(out["metadata"]["labels"], json!({"team": "platform"}));
    assert!(out["spec"]["template"].get("metadata").is_none());
    let mut kept = job.clone();
    kept["spec"]["ttlSecondsAfterFinished"] = json!(60);
    assert_eq!(
        run(&[("p", &s)], &kept).object["spec"]["ttlSecondsAfterFinished"],
        60
    );
    let cronjob = run(&[("p", &s)], &yaml(CRONJOB)).object;
    assert_eq!(cronjob["spec"]["ttlSecondsAfterFinished"], 600);
    assert_eq!(cronjob["metadata"]["labels"], json!({"team": "platform"}));
    let pod = run(&[("p", &s)], &yaml(POD)).object;
    assert_eq!(pod["metadata"]["labels"]["team"], "platform");
    assert_eq!(pod["spec"]["ttlSecondsAfterFinished"], 600);
}

#[test]
fn object_target_variables_see_the_workload() {
    // `request.object` is the Deployment; `images` point into its template.
    let s = spec(
        r#"
match: {kinds: [Deployment]}
target: Object
mutations:
- preconditions:
    all:
    - {key: "{{ request.object.spec.replicas }}", operator: GreaterThan, value: 1}
  annotations:
    values:
      replicas: "{{ request.object.spec.replicas }}"
      image-at: "{{ images.containers.web.jsonPointer }}"
- foreach: {list: "request.object.spec.template.spec.containers"}
  jsonPatch:
  - {op: add, path: "/spec/template/spec/containers/{{ elementIndex }}/env", value: [{name: OWNER, value: "{{ request.object.metadata.name }}"}]}
"#,
    );
    let deployment = yaml(DEPLOYMENT);
    let out = run(&[("p", &s)], &deployment).object;
    assert_eq!(
        out["metadata"]["annotations"],
        json!({"replicas": "2", "image-at": "/spec/template/spec/containers/0/image"})
    );
    assert_eq!(
        out["spec"]["template"]["spec"]["containers"][0]["env"],
        json!([{"name": "OWNER", "value": "web"}])
    );
    let mut single = deployment.clone();
    single["spec"]["replicas"] = json!(1);
    let out = run(&[("p", &s)], &single).object;
    assert!(out["metadata"].get("annotations").is_none());
}

#[test]
fn object_target_respects_the_template_opt_out_and_refuses_pod_templates() {
    let s = spec(
        "match: {kinds: [Deployment]}
target: Object
mutations: [{labels: {values: {x: y}}}]
",
    );
    let mut deployment = yaml(DEPLOYMENT);
    deployment["spec"]["template"]["metadata"]["labels"]["meshgate.dev/inject"] = json!("false");
    assert!(!run(&[("p", &s)], &deployment).changed());
    // Also for a workload matched by a wildcard (mutated as itself).
    let any = spec(
        "match: {kinds: [\"apps/v1/*\"]}
mutations: [{labels: {values: {x: y}}}]
",
    );
    assert!(!run(&[("p", &any)], &deployment).changed());
    assert!(run(&[("p", &any)], &yaml(DEPLOYMENT)).changed());
    // A template-less workload is still the object it is.
    let bare = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}});
    assert!(run(&[("p", &s)], &bare).changed());

    let both: MutationPolicySpec = serde_saphyr::from_str(
        "match: {kinds: [Pod]}
podTemplates: true
target: Object
mutations: [{labels: {values: {x: y}}}]
",
    )
    .unwrap();
    let errors = validate(&both).expect_err("podTemplates with target: Object");
    assert!(errors[0].starts_with("spec.podTemplates:"), "{errors:?}");
}

// ---------------------------------------------------------------- any kind

#[test]
fn any_kind_is_mutated_as_the_object_itself() {
    let service = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "shop"},
                         "spec": {"ports": [{"port": 80}]}});
    let widget = json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": "shop"}});
    let label = |kinds: &str| {
        spec(&format!(
            "match: {{kinds: {kinds}}}\nmutations: [{{labels: {{values: {{m: \"1\"}}}}}}]\n"
        ))
    };
    let labelled = |s: &MutationPolicySpec, o: &Value| {
        run(&[("p", s)], o).object["metadata"]["labels"]["m"] == "1"
    };
    assert!(labelled(&label("[Service]"), &service));
    assert!(labelled(&label("[v1/Service]"), &service));
    assert!(!labelled(&label("[v2/Service]"), &service));
    assert!(labelled(&label("[example.com/v1/Widget]"), &widget));
    assert!(labelled(&label("[\"*.com/*/Wid*\"]"), &widget));
    assert!(!labelled(&label("[Service]"), &widget));
    assert!(labelled(&label("[\"*\"]"), &widget));
    // A Pod and a workload named as such stay Pod-shaped: a workload's template is mutated.
    let deployment = yaml(DEPLOYMENT);
    let out = run(&[("p", &label("[Deployment]"))], &deployment).object;
    assert_eq!(out["spec"]["template"]["metadata"]["labels"]["m"], "1");
    assert!(out["metadata"]["labels"].get("m").is_none());
    // `*` takes every object as itself, a workload included.
    let out = run(&[("p", &label("[\"*\"]"))], &deployment).object;
    assert_eq!(out["metadata"]["labels"]["m"], "1");
    assert!(
        out["spec"]["template"]["metadata"]["labels"]
            .get("m")
            .is_none()
    );
    // A strategic merge on a Service (maps merge; lists of other kinds merge by `name`).
    let s = spec(
        "match: {kinds: [Service]}\nmutations:\n- strategicMerge: {spec: {type: ClusterIP, selector: {app: web}}}\n",
    );
    let out = run(&[("p", &s)], &service).object;
    assert_eq!(out["spec"]["type"], "ClusterIP");
    assert_eq!(out["spec"]["selector"]["app"], "web");
    assert_eq!(out["spec"]["ports"], service["spec"]["ports"]);
}

#[test]
fn cluster_scoped_objects_match_no_namespace_constraint() {
    let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}});
    let cluster = MatchContext {
        operation: Operation::Create,
        namespace: "",
        namespace_labels: no_labels(),
        cluster: &crate::policy::context::NoCluster,
    };
    let applies = |m: &str| {
        let s = spec(&format!(
            "match: {m}\nmutations: [{{labels: {{values: {{m: \"1\"}}}}}}]\n"
        ));
        apply([("p", &s)], &node, &cluster).changed()
    };
    assert!(applies("{kinds: [Node]}"));
    assert!(!applies("{kinds: [Node], namespaces: [\"*\"]}"));
    assert!(!applies("{kinds: [Node], namespaceSelector: {}}"));
    // Rendering a Namespace: it is its own namespace, with its own labels.
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a", "labels": {"mesh": "on"}}});
    let s = spec(
        "match: {kinds: [Namespace], namespaces: [\"team-*\"], namespaceSelector: {matchLabels: {mesh: \"on\"}}}\nmutations: [{annotations: {values: {seen: \"yes\"}}}]\n",
    );
    let out = render(vec![ns, node], &[("p".to_owned(), s)], &|_: &str| {
        BTreeMap::new()
    })
    .expect("render");
    assert_eq!(out[0].policies, ["p"]);
    assert!(out[1].policies.is_empty());
}

// ---------------------------------------------------------------- validation

#[test]
fn validation_names_the_field() {
    let s: MutationPolicySpec = serde_saphyr::from_str(
        r#"
match:
  kinds: [Pod, a/b/c/Service]
  namespaces: ["", "Bad_NS"]
  objectSelector:
    matchExpressions: [{key: app, operator: In}]
exclude: {}
mutations:
- {}
- labels: {values: {"bad key!": "v", ok: "not valid/value"}}
  annotations: {values: {a: b}}
- strategicMerge:
    metadata:
      labels:
        (app: web
        =(x): y
      $patch: replace
    spec:
      containers:
      - image: nginx
      - <(image): "corp/*"
        imagePullPolicy: Always
      - {name: a}
      - {name: a, image: b}
      tolerations:
      - (key): ">3"
      - {key: a}
      - plain
- jsonPatch:
  - {op: add, path: metadata/labels/x, value: y}
  - {op: move, path: /a}
  - {op: remove, path: "/a~2", value: 1}
- strategicMerge: [not, an, object]
- jsonPatch: []
"#,
    )
    .unwrap();
    let errors = validate(&s).unwrap_err();
    let expected = [
        "spec.match.kinds[1]: \"a/b/c/Service\": expected Kind, version/Kind or group/version/Kind",
        "spec.match.namespaces[0]: must not be empty",
        "spec.match.namespaces[1]: \"Bad_NS\" is not a namespace name or pattern",
        "spec.match.objectSelector: matchExpressions key \"app\"",
        "spec.exclude: sets no field, so it would exclude everything",
        "spec.mutations[0]: set exactly one of annotations, labels, strategicMerge, jsonPatch, mutations (found: none)",
        "spec.mutations[1]: set exactly one of annotations, labels, strategicMerge, jsonPatch, mutations (found: annotations, labels)",
        "spec.mutations[1].labels.values[\"bad key!\"]: invalid key",
        "spec.mutations[1].labels.values[\"ok\"]: invalid label value \"not valid/value\"",
        "spec.mutations[2].strategicMerge.metadata.labels[\"(app\"]: malformed anchor (unbalanced parentheses)",
        "spec.mutations[2].strategicMerge.metadata.labels[\"=(x)\"]: equality anchor `=()` is a Kyverno validate anchor",
        "spec.mutations[2].strategicMerge.metadata[\"$patch\"]: strategic-merge directives ($patch) are not supported",
        "spec.mutations[2].strategicMerge.spec.containers[0]: needs the merge key `name` of `containers`",
        "spec.mutations[2].strategicMerge.spec.containers[1]: a list element with a global anchor is only a condition; its other fields (imagePullPolicy)",
        "spec.mutations[2].strategicMerge.spec.containers[3]: duplicate merge key name=\"a\" (also in element [2])",
        "spec.mutations[2].strategicMerge.spec.tolerations: mixes objects and other values",
        "spec.mutations[2].strategicMerge.spec.tolerations[0].(key): operator in \">3\" is not supported",
        "spec.mutations[3].jsonPatch[0].path: must start with '/'",
        "spec.mutations[3].jsonPatch[1].from: required for Move",
        "spec.mutations[3].jsonPatch[2].path: '~' must be followed by '0' or '1'",
        "spec.mutations[3].jsonPatch[2].value: not used by Remove",
        "spec.mutations[4].strategicMerge: must be an object",
        "spec.mutations[5].jsonPatch: at least one operation is required",
    ];
    for e in expected {
        assert!(
            errors.iter().any(|m| m.starts_with(e)),
            "missing {e:?} in {errors:#?}"
        );
    }
    assert_eq!(errors.len(), expected.len(), "{errors:#?}");
}

#[test]
fn validation_accepts_kyverno_style_patches() {
    let s = spec(
        r#"
match: {kinds: [Pod, Deployment], namespaces: ["team-*"]}
mutations:
- strategicMerge:
    metadata:
      annotations:
        +(cluster-autoscaler.kubernetes.io/safe-to-evict): "true"
    spec:
      volumes:
      - <(emptyDir): {}
      containers:
      - (name): "*"
        (image): "*:latest|*:dev"
        imagePullPolicy: Always
      - name: proxy
        image: envoy
      initContainers: []
- jsonPatch:
  - {op: test, path: /metadata/labels/app, value: web}
  - {op: move, from: /metadata/labels/a~1b, path: /metadata/labels/c}
"#,
    );
    assert_eq!(validate(&s), Ok(()));
}

#[test]
fn anchors_inside_conditions_and_duplicates_are_rejected() {
    let s: MutationPolicySpec = serde_saphyr::from_str(
        "match: {}\nmutations:\n- strategicMerge:\n    spec:\n      (securityContext): {(runAsUser): 0}\n      x: 1\n      +(x): 2\n",
    )
    .unwrap();
    let errors = validate(&s).unwrap_err();
    assert!(errors.iter().any(|e| e.starts_with(
        "spec.mutations[0].strategicMerge.spec.(securityContext).(runAsUser): anchors inside a condition's value are not supported"
    )), "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("\"x\" is also set by another key")),
        "{errors:?}"
    );
}

// ---------------------------------------------------------------- render

#[test]
fn render_applies_as_create_and_reports_per_document() {
    let policies = vec![(
        "mesh".to_owned(),
        spec(
            "match: {namespaces: [shop, default]}\npodTemplates: true\nwarning: adds mesh label\nmutations: [{labels: {values: {mesh: istio}}}]\n",
        ),
    )];
    let mut pod_default = yaml(POD);
    pod_default["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("namespace");
    let docs = vec![
        yaml(POD),
        Value::Null,
        yaml(SERVICE),
        yaml(DEPLOYMENT),
        pod_default,
    ];
    let labels = |ns: &str| -> BTreeMap<String, String> {
        [("kubernetes.io/metadata.name".to_owned(), ns.to_owned())].into()
    };
    let out = render(docs, &policies, &labels).unwrap();
    assert_eq!(out.len(), 5);
    assert_eq!(out[0].policies, ["mesh"]);
    assert_eq!(out[0].warnings, ["mesh: adds mesh label"]);
    assert_eq!(out[0].patch.apply(&yaml(POD)).unwrap(), out[0].object);
    assert!(out[1].object.is_null() && out[1].patch.is_empty());
    assert!(out[2].policies.is_empty() && out[2].patch.is_empty());
    assert_eq!(
        out[3].object["spec"]["template"]["metadata"]["labels"]["mesh"],
        "istio"
    );
    assert_eq!(out[4].policies, ["mesh"], "no namespace means default");
    assert_eq!(
        out.iter().map(|d| d.index).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
}

#[test]
fn render_reports_failed_policies_per_document() {
    let bad = spec(
        "match: {}\nmutations:\n- jsonPatch: [{op: replace, path: /spec/nothing, value: 1}]\n",
    );
    let good = spec("match: {}\nmutations: [{labels: {values: {ok: \"yes\"}}}]\n");
    let policies = vec![("bad".to_owned(), bad), ("good".to_owned(), good)];
    let labels = |_: &str| BTreeMap::new();
    let out = render(vec![yaml(SERVICE), yaml(POD)], &policies, &labels).expect("rendered");
    assert!(out[0].failed.is_empty(), "the Service is not matched");
    assert_eq!(out[1].failed.len(), 1);
    assert!(
        out[1].failed[0]
            .to_string()
            .starts_with("policy bad: spec.mutations[0].jsonPatch[0]"),
        "{}",
        out[1].failed[0]
    );
    assert_eq!(out[1].policies, ["good"], "the other policy still applies");
    assert_eq!(out[1].object["metadata"]["labels"]["ok"], "yes");

    let err = render(vec![json!("text")], &[], &labels).unwrap_err();
    assert_eq!(
        err,
        RenderError::Document {
            index: 0,
            message: "not a Kubernetes object (expected a mapping)".into()
        }
    );

    let invalid: MutationPolicySpec =
        serde_saphyr::from_str("match: {kinds: [v1/]}\nmutations: [{labels: {values: {x: y}}}]\n")
            .unwrap();
    let err = render(vec![], &[("n".to_owned(), invalid)], &labels).unwrap_err();
    assert!(
        matches!(err, RenderError::InvalidPolicy { ref name, .. } if name == "n"),
        "{err}"
    );
}

// ---------------------------------------------------------------- idempotency (property)

fn key() -> impl Strategy<Value = String> {
    prop_oneof![Just("a"), Just("b"), Just("c"), Just("d")].prop_map(str::to_owned)
}

fn values() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(key(), "[a-z]{0,3}", 1..4)
}

fn meta() -> impl Strategy<Value = MetadataMutation> {
    (values(), any::<bool>()).prop_map(|(values, keep)| MetadataMutation {
        values,
        on_conflict: if keep {
            OnConflict::Keep
        } else {
            OnConflict::Overwrite
        },
    })
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let container = (
        // A template conditions on `image`, which no generated patch writes: a condition that
        // selects what a patch adds is not idempotent (see the module documentation).
        prop_oneof![Just("web"), Just("proxy"), Just("(image)")],
        prop_oneof![Just("Always"), Just("IfNotPresent")],
        any::<bool>(),
    )
        .prop_map(|(name, policy, add_anchor)| {
            let mut c = serde_json::Map::new();
            if name == "(image)" {
                c.insert("(image)".into(), json!("*"));
            } else {
                c.insert("name".into(), json!(name));
            }
            let field = if add_anchor {
                "+(imagePullPolicy)"
            } else {
                "imagePullPolicy"
            };
            c.insert(field.into(), json!(policy));
            c.insert("env".into(), json!([{"name": "MESH", "value": policy}]));
            Value::Object(c)
        });
    let smp = (
        values(),
        prop::option::of(key()),
        prop::collection::vec(container, 0..3),
        prop::collection::vec("[a-z]{1,3}", 0..3),
    )
        .prop_map(|(annotations, deleted, mut containers, args)| {
            // Merge keys are unique in a patch list (validation rejects duplicates).
            let mut seen = Vec::new();
            containers.retain(|c| match c.get("name") {
                Some(n) if seen.contains(n) => false,
                Some(n) => {
                    seen.push(n.clone());
                    true
                }
                None => true,
            });
            let mut annotations: serde_json::Map<String, Value> = annotations
                .into_iter()
                .map(|(k, v)| (format!("+({k})"), json!(v)))
                .collect();
            if let Some(d) = deleted {
                annotations.insert(format!("x-{d}"), Value::Null);
            }
            json!({"metadata": {"annotations": annotations},
                   "spec": {"containers": containers, "nodeSelector": {"args": args.join(",")}}})
        });
    prop_oneof![
        meta().prop_map(|m| Mutation {
            annotations: Some(m),
            ..Default::default()
        }),
        meta().prop_map(|m| Mutation {
            labels: Some(m),
            ..Default::default()
        }),
        smp.prop_map(|p| Mutation {
            strategic_merge: Some(p),
            ..Default::default()
        }),
    ]
}

proptest! {
    // No regression files: they would land outside this module's directory.
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn applying_twice_changes_nothing(
        mutations in prop::collection::vec(prop::collection::vec(mutation(), 1..4), 1..4),
        labels in values(),
        templated in any::<bool>(),
    ) {
        let specs: Vec<(String, MutationPolicySpec)> = mutations
            .into_iter()
            .enumerate()
            .map(|(i, mutations)| {
                let spec = MutationPolicySpec {
                    match_: Default::default(),
                    exclude: None,
                    pod_templates: true,
                    target: Default::default(),
                    mutations,
                    warning: None,
                    existing: Default::default(),
                };
                (format!("p{i}"), spec)
            })
            .collect();
        for (_, s) in &specs {
            prop_assert_eq!(validate(s), Ok(()));
        }
        let mut object = if templated { yaml(DEPLOYMENT) } else { yaml(POD) };
        object["metadata"]["labels"] = serde_json::to_value(&labels).unwrap();
        let ctx = create_in("shop");
        let refs = || specs.iter().map(|(n, s)| (n.as_str(), s));
        let once = apply(refs(), &object, &ctx);
        let twice = apply(refs(), &once.object, &ctx);
        prop_assert_eq!(&twice.object, &once.object);
        // Policies that set the same field to different values converge, but each still
        // "changes" the other's result; a single policy reports no change the second time.
        if specs.len() == 1 {
            prop_assert!(twice.policies.is_empty());
        }
    }
}

#[test]
fn variables_are_checked_where_they_are_written_and_fail_their_policy_alone() {
    let bad: MutationPolicySpec = serde_saphyr::from_str(
        "
match: {}
mutations:
- labels:
    values: {sa: '{{ serviceAccountName }}'}
- strategicMerge:
    spec:
      containers: [{name: '{{ element.name }}', imagePullPolicy: Always}]
- annotations:
    values: {a: b}
  foreach: {list: 'request.object.spec.[', preconditions: {all: [{key: '{{ element.x }}', operator: Equals, value: y}]}}
",
    )
    .expect("parses");
    let errors = validate(&bad).expect_err("invalid");
    for expected in [
        "spec.mutations[0].labels.values[\"sa\"]: {{ serviceAccountName }}: variable \"serviceAccountName\" is not available",
        "spec.mutations[1].strategicMerge: {{ element.name }}: element is only defined inside a foreach",
        "spec.mutations[2].foreach.list: {{ request.object.spec.[ }}:",
    ] {
        assert!(
            errors.iter().any(|e| e.starts_with(expected)),
            "missing {expected:?} in {errors:#?}"
        );
    }
    assert_eq!(errors.len(), 3, "{errors:#?}");

    // A variable whose key is missing fails its policy (Kyverno's "Unknown key"); the other
    // policy still applies.
    let missing = spec(
        "
match: {}
mutations:
- labels:
    values: {owner: '{{ request.object.metadata.labels.team }}'}
",
    );
    let fine = spec("match: {}\nmutations:\n- labels:\n    values: {ok: 'yes'}\n");
    let pod =
        yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: a}]}\n");
    let applied = apply(
        [("a-missing", &missing), ("b-fine", &fine)],
        &pod,
        &create_in("shop"),
    );
    assert_eq!(
        applied.object["metadata"]["labels"],
        serde_json::json!({"ok": "yes"})
    );
    assert_eq!(applied.failed.len(), 1);
    let message = applied.failed[0].to_string();
    assert!(
        message.starts_with("policy a-missing: spec.mutations[0]: {{ request.object.metadata.labels.team }}: unknown key \"labels\""),
        "{message}"
    );
}

#[test]
fn a_services_ports_merge_by_port() {
    let policy = spec(
        "
match: {kinds: [Service]}
mutations:
- strategicMerge:
    spec:
      ports:
      - {port: 443, targetPort: 8443}
      - {port: 15021, name: status}
",
    );
    let svc = yaml(
        "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  ports:
  - {port: 80, targetPort: 8080}
  - {port: 443, targetPort: 443, name: https}
",
    );
    let out = run(&[("ports", &policy)], &svc).object;
    assert_eq!(
        out["spec"]["ports"],
        serde_json::json!([
            {"port": 443, "targetPort": 8443, "name": "https"},
            {"port": 15021, "name": "status"},
            {"port": 80, "targetPort": 8080},
        ])
    );
}

/// `mutations` inside a foreach (Kyverno's nested foreach): per element of the outer list, in
/// order, each seeing the outer element as `element0` and the object as the previous one left
/// it only when that one changed it; the next element starts again from the object as the
/// foreach found it (Kyverno resets its context per element).
#[test]
fn nested_mutations_see_their_levels_and_the_object_as_kyverno_does() {
    let policy = spec(
        r#"
match: {kinds: [Pod]}
mutations:
- foreach: {list: request.object.spec.containers}
  mutations:
  - labels:
      values: {"before-{{ element0.name }}": "{{ request.object.metadata.labels.last || 'none' }}"}
  - labels:
      values: {last: "{{ element.name }}"}
  - labels:
      values: {"after-{{ element.name }}": "{{ request.object.metadata.labels.last || 'none' }}"}
  - foreach: {list: "element.ports || `[]`"}
    annotations:
      values:
        "port-{{ elementIndex0 }}-{{ elementIndex1 }}": "{{ element0.name }}/{{ element1.name }}/{{ element.name }}/{{ elementIndex }}"
"#,
    );
    let pod = yaml(
        "
apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
  - {name: a, ports: [{name: http}, {name: admin}]}
  - {name: b}
",
    );
    let got = run(&[("nested", &policy)], &pod).object;
    let labels = &got["metadata"]["labels"];
    assert_eq!(labels["before-a"], "none");
    assert_eq!(
        labels["after-a"], "a",
        "sees the label the previous one set"
    );
    assert_eq!(
        labels["before-b"], "none",
        "the next element starts from the object as the foreach found it"
    );
    assert_eq!(labels["after-b"], "b");
    assert_eq!(labels["last"], "b");
    let annotations = &got["metadata"]["annotations"];
    assert_eq!(annotations["port-0-0"], "a/http/http/0");
    assert_eq!(annotations["port-0-1"], "a/admin/admin/1");
    assert_eq!(annotations.as_object().map(|a| a.len()), Some(2));
}

/// `mutations` without a foreach: its context and preconditions once, on the object as the
/// mutation finds it (Kyverno's rule preconditions over several foreach entries); an error in a
/// later one fails the policy with nothing applied.
#[test]
fn grouped_mutations_evaluate_preconditions_once_and_fail_whole() {
    let policy = spec(
        r#"
match: {kinds: [Pod]}
mutations:
- context:
  - {name: stage, variable: {jmesPath: "request.object.metadata.labels.stage || 'new'"}}
  preconditions:
    all: [{key: "{{ stage }}", operator: Equals, value: new}]
  mutations:
  - labels: {values: {stage: done}}
  - foreach: {list: request.object.spec.containers}
    annotations:
      values: {"seen-{{ element.name }}": "{{ stage }}/{{ request.object.metadata.labels.stage }}"}
"#,
    );
    let pod =
        yaml("{apiVersion: v1, kind: Pod, metadata: {name: p}, spec: {containers: [{name: a}]}}");
    let got = run(&[("group", &policy)], &pod).object;
    assert_eq!(got["metadata"]["labels"]["stage"], "done");
    // The precondition held once; the second mutation ran although the first changed what it
    // tests, and sees the object as the first left it.
    assert_eq!(got["metadata"]["annotations"]["seen-a"], "new/done");
    let mut done = pod.clone();
    done["metadata"]["labels"] = json!({"stage": "old"});
    assert_eq!(run(&[("group", &policy)], &done).object, done);

    let mut broken = policy.clone();
    if let Some(f) = broken.mutations[0].mutations[1].foreach.as_mut() {
        f.list = "request.object.metadata.name".into();
    }
    let e = failure("group", &broken, &pod);
    let text = e.to_string();
    assert!(text.contains("mutations[1]: foreach.list"), "{text}");
}

#[test]
fn nested_mutations_are_validated_with_their_scope() {
    let base = |m: Value| -> Result<(), Vec<String>> {
        let spec: MutationPolicySpec =
            serde_json::from_value(json!({"match": {"kinds": ["Pod"]}, "mutations": [m]}))
                .expect("a spec");
        validate(&spec)
    };
    assert_eq!(
        base(
            json!({"foreach": {"list": "request.object.spec.containers"},
            "labels": {"values": {"x": "{{ element0.name }}-{{ elementIndex0 }}"}}})
        ),
        Ok(())
    );
    let errors = base(
        json!({"foreach": {"list": "request.object.spec.containers"},
        "mutations": [{"labels": {"values": {"x": "{{ element1.name }}"}}}]}),
    )
    .expect_err("element1 needs two loops");
    assert!(
        errors[0].starts_with("spec.mutations[0].mutations[0].labels.values"),
        "{errors:?}"
    );
    let errors = base(json!({"mutations": [{"labels": {"values": {"x": "y"}}, "jsonPatch": []}]}))
        .expect_err("two kinds");
    assert!(
        errors[0].starts_with("spec.mutations[0].mutations[0]: set exactly one"),
        "{errors:?}"
    );
    let mut deep = json!({"labels": {"values": {"x": "y"}}});
    for _ in 0..=super::validate::MAX_NESTING {
        deep = json!({"mutations": [deep]});
    }
    let errors = base(deep).expect_err("too deep");
    assert!(
        errors.iter().any(|e| e.contains("nested more than")),
        "{errors:?}"
    );
    let errors = base(
        json!({"context": [{"name": "element2", "variable": {"value": 1}}],
        "labels": {"values": {"x": "y"}}}),
    )
    .expect_err("a built-in name");
    assert!(errors[0].contains("built-in"), "{errors:?}");
}

#[test]
fn imported_rules_apply_in_the_order_kyverno_applies_them() {
    // Kyverno applies a policy's rules as written, each to the result of the one before; the
    // second rule's name sorts first.
    let doc = json!({
        "apiVersion": "kyverno.io/v1", "kind": "ClusterPolicy",
        "metadata": {"name": "order"},
        "spec": {"rules": [
            {"name": "tag", "match": {"any": [{"resources": {"kinds": ["Pod"]}}]},
             "mutate": {"patchStrategicMerge": {"metadata": {"labels": {"step": "tagged"}}}}},
            {"name": "after-tag", "match": {"any": [{"resources": {"kinds": ["Pod"]}}]},
             "preconditions": {"all": [{"key": "{{ request.object.metadata.labels.step || '' }}",
                                        "operator": "Equals", "value": "tagged"}]},
             "mutate": {"patchStrategicMerge": {"metadata": {"labels": {"seen": "yes"}}}}},
        ]},
    });
    let imported = crate::policy::kyverno::import(&doc).expect("imports");
    let names: Vec<&str> = imported.policies.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["order-1-tag", "order-2-after-tag"]);
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                     "spec": {"containers": [{"name": "app", "image": "app"}]}});
    let policies: Vec<(&str, &MutationPolicySpec)> = imported
        .policies
        .iter()
        .map(|(n, s)| (n.as_str(), s))
        .collect();
    let applied = run(&policies, &pod);
    assert_eq!(
        applied.object["metadata"]["labels"],
        json!({"step": "tagged", "seen": "yes"})
    );

    // Rules whose names already sort in their order keep their plain names.
    let mut doc = doc;
    doc["spec"]["rules"][1]["name"] = json!("then-mark");
    let imported = crate::policy::kyverno::import(&doc).expect("imports");
    let names: Vec<&str> = imported.policies.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["order-tag", "order-then-mark"]);
}

/// A policy whose annotation comes from a ConfigMap (`context[].configMap`).
fn config_map_policy(namespace: &str) -> MutationPolicySpec {
    serde_saphyr::from_str(&format!(
        r#"
match: {{kinds: [Pod]}}
mutations:
- context:
  - name: mesh
    configMap: {{name: mesh-settings{namespace}}}
  annotations:
    values:
      traffic.sidecar.istio.io/excludeOutboundIPRanges: "{{{{ mesh.data.exclude }}}}"
      settings-from: "{{{{ mesh.metadata.namespace }}}}/{{{{ mesh.metadata.name }}}}"
"#
    ))
    .unwrap()
}

fn settings(namespace: &str, exclude: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "mesh-settings", "namespace": namespace},
           "data": {"exclude": exclude}})
}

#[test]
fn a_config_map_entry_reads_data_and_metadata_from_the_cluster_data() {
    use crate::policy::context::GivenObjects;
    let pod = yaml(POD);
    let policy = config_map_policy(", namespace: default");
    assert_eq!(validate(&policy), Ok(()));
    let mut maps = GivenObjects::read();
    maps.add(&settings("default", "10.96.0.1/32"));
    maps.add(&settings("other", "0.0.0.0/0"));
    let ctx = MatchContext {
        cluster: &maps,
        ..create_in("shop")
    };
    let applied = apply([("p", &policy)], &pod, &ctx);
    assert!(applied.failed.is_empty(), "{:?}", applied.failed);
    let annotations = &applied.object["metadata"]["annotations"];
    assert_eq!(
        annotations["traffic.sidecar.istio.io/excludeOutboundIPRanges"], "10.96.0.1/32",
        "the named namespace's, not another's"
    );
    assert_eq!(annotations["settings-from"], "default/mesh-settings");

    // Absent: the policy fails on the object, naming the ConfigMap; nothing else changes.
    let absent = apply(
        [("p", &policy)],
        &pod,
        &MatchContext {
            cluster: &GivenObjects::read(),
            ..create_in("shop")
        },
    );
    assert_eq!(absent.object, pod);
    let message = absent
        .failed
        .first()
        .map(ToString::to_string)
        .unwrap_or_default();
    assert!(
        message.contains("ConfigMap default/mesh-settings not found"),
        "{message}"
    );

    // Without a cluster (the controller's plan tests, the native compiler): it says so.
    let none = failure("p", &policy, &pod).to_string();
    assert!(none.contains("no cluster to read it from"), "{none}");
}

#[test]
fn a_config_map_entry_is_read_only_where_a_variable_names_it() {
    // Kyverno loads context entries lazily: an unreadable ConfigMap fails only the
    // expressions that name it.
    let policy = spec(
        r#"
match: {kinds: [Pod]}
mutations:
- context:
  - name: unused
    configMap: {name: absent, namespace: default}
  labels:
    values: {fixed: "yes"}
"#,
    );
    let applied = run(&[("p", &policy)], &yaml(POD));
    assert_eq!(applied.object["metadata"]["labels"]["fixed"], "yes");
}

#[test]
fn render_reads_the_config_maps_of_its_input_and_names_a_missing_one() {
    let policy = config_map_policy(", namespace: shop");
    let mut pod = yaml(POD);
    pod["metadata"]["namespace"] = json!("shop");
    let policies = vec![("p".to_owned(), policy)];
    let no_labels = |_: &str| BTreeMap::new();
    let out = render(
        vec![settings("shop", "10.0.0.0/8"), pod.clone()],
        &policies,
        &no_labels,
    )
    .expect("render");
    assert_eq!(
        out[1].object["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeOutboundIPRanges"],
        "10.0.0.0/8"
    );
    let out = render(vec![pod.clone()], &policies, &no_labels).expect("render");
    assert_eq!(out[0].object, pod);
    let message = out[0]
        .failed
        .first()
        .map(ToString::to_string)
        .unwrap_or_default();
    assert!(
        message.contains("ConfigMap shop/mesh-settings is not in the input"),
        "{message}"
    );
}

#[test]
fn config_map_entries_are_literal_and_a_namespaced_policy_reads_its_own_namespace() {
    let mut bad = config_map_policy("");
    if let Some(cm) = bad.mutations[0].context[0].config_map.as_mut() {
        cm.name = "{{ request.namespace }}-settings".into();
    }
    let errors = validate(&bad).expect_err("a variable name is refused");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("context[0].configMap.name") && e.contains("must be literal")),
        "{errors:?}"
    );
    // A cluster-wide policy names the namespace, as Kyverno's policy validation requires.
    let errors = validate(&config_map_policy("")).expect_err("no namespace");
    assert!(
        errors
            .iter()
            .any(|e| e.ends_with("context[0].configMap.namespace: required")),
        "{errors:?}"
    );

    let confined = confine(&config_map_policy(""), "team-a").expect("own namespace");
    assert_eq!(
        context::config_maps_named(&confined)
            .into_iter()
            .collect::<Vec<_>>(),
        vec![("team-a".to_owned(), "mesh-settings".to_owned())],
        "no namespace given: the policy's own"
    );
    let errors = confine(&config_map_policy(", namespace: other"), "team-a")
        .expect_err("another namespace is refused");
    assert!(
        errors.iter().any(|e| e.contains("other/mesh-settings")),
        "{errors:?}"
    );
}

/// A policy whose `apiCall` entries read the request's Namespace (a label, through `jmesPath`),
/// a Service's first port, and an absent ConfigMap with a `default`.
fn api_call_policy() -> MutationPolicySpec {
    spec(
        r#"
match: {kinds: [Pod]}
mutations:
- context:
  - name: team
    apiCall:
      urlPath: "/api/v1/namespaces/{{ request.namespace }}"
      jmesPath: "metadata.labels.team"
  - name: port
    apiCall:
      urlPath: "/api/v1/namespaces/{{ request.namespace }}/services/backend"
      jmesPath: "to_string(spec.ports[0].port)"
  - name: feature
    apiCall:
      urlPath: "/api/v1/namespaces/{{ request.namespace }}/configmaps/feature"
      default: {data: {mode: "off"}}
  annotations:
    values:
      example.com/team: "{{ team }}"
      example.com/backend-port: "{{ port }}"
      example.com/mode: "{{ feature.data.mode }}"
"#,
    )
}

#[test]
fn an_api_call_entry_reads_the_given_objects_with_jmespath_and_default() {
    use crate::policy::context::GivenObjects;
    let mut pod = yaml(POD);
    pod["metadata"]["namespace"] = "shop".into();
    let mut given = GivenObjects::default();
    given.add(&serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {"team": "payments"}}}));
    given.add(&serde_json::json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "backend", "namespace": "shop"},
        "spec": {"ports": [{"port": 8443}]}}));
    let ctx = MatchContext {
        cluster: &given,
        ..create_in("shop")
    };
    let applied = apply([("p", &api_call_policy())], &pod, &ctx);
    assert!(applied.failed.is_empty(), "{:?}", applied.failed);
    let a = &applied.object["metadata"]["annotations"];
    assert_eq!(a["example.com/team"], "payments");
    assert_eq!(a["example.com/backend-port"], "8443");
    assert_eq!(a["example.com/mode"], "off", "the default of a failed GET");

    // The Service not given: the entry fails, and with it the policy, naming the path.
    let mut without = GivenObjects::default();
    without.add(&serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {"team": "payments"}}}));
    let failed = apply(
        [("p", &api_call_policy())],
        &pod,
        &MatchContext {
            cluster: &without,
            ..create_in("shop")
        },
    );
    assert_eq!(failed.object, pod);
    let message = failed.failed[0].to_string();
    assert!(
        message.contains("/api/v1/namespaces/shop/services/backend")
            && message.contains("not in the input"),
        "{message}"
    );
}

#[test]
fn an_api_call_list_is_the_given_objects_of_the_resource() {
    use crate::policy::context::GivenObjects;
    let policy = spec(
        r#"
match: {kinds: [Pod]}
mutations:
- context:
  - name: deployments
    apiCall:
      urlPath: "/apis/apps/v1/namespaces/{{ request.namespace }}/deployments"
      jmesPath: "items[].metadata.name | join(',', @)"
  annotations:
    values: {example.com/deployments: "{{ deployments }}"}
"#,
    );
    let mut given = GivenObjects::default();
    for (ns, name) in [("shop", "web"), ("other", "db"), ("shop", "api")] {
        given.add(
            &serde_json::json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns}}),
        );
    }
    let applied = apply(
        [("p", &policy)],
        &yaml(POD),
        &MatchContext {
            cluster: &given,
            ..create_in("shop")
        },
    );
    assert!(applied.failed.is_empty(), "{:?}", applied.failed);
    assert_eq!(
        applied.object["metadata"]["annotations"]["example.com/deployments"], "api,web",
        "the namespace's, sorted by name"
    );
}

#[test]
fn api_call_paths_are_the_apis_and_a_namespaced_policy_reads_its_own_namespace() {
    use crate::policy::context::{GivenObjects, api_path};
    for bad in [
        "https://example.com/api/v1/pods",
        "/version",
        "/api/v1/namespaces/shop/pods/web/log",
        "/api/v1/../secrets",
        "api/v1/pods",
    ] {
        assert!(api_path(bad).is_err(), "{bad} is refused");
    }
    let p = api_path("/apis/apps/v1/namespaces/shop/deployments/web?x=1").unwrap();
    assert_eq!(
        (
            p.api_version(),
            p.namespace.as_deref(),
            p.resource.as_str(),
            p.name.as_deref()
        ),
        (
            "apps/v1".to_owned(),
            Some("shop"),
            "deployments",
            Some("web")
        )
    );
    // A literal path outside the API is a validation error, naming the field.
    let literal = spec(
        r#"
match: {kinds: [Pod]}
mutations:
- context:
  - name: v
    apiCall: {urlPath: "/api/v1/namespaces/shop"}
  labels: {values: {a: "{{ v.metadata.name }}"}}
"#,
    );
    let mut outside = literal.clone();
    outside.mutations[0].context[0]
        .api_call
        .as_mut()
        .unwrap()
        .url_path = "/healthz".into();
    let errors = validate(&outside).unwrap_err();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("context[0].apiCall.urlPath")),
        "{errors:?}"
    );
    // A NamespacedMutationPolicy in `team-a` may not read `shop`.
    let confined = crate::policy::confine(&literal, "team-a").unwrap();
    let mut given = GivenObjects::default();
    given.add(
        &serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}),
    );
    let applied = apply(
        [("team-a/p", &confined)],
        &yaml(POD),
        &MatchContext {
            cluster: &given,
            ..create_in("team-a")
        },
    );
    let message = applied.failed[0].to_string();
    assert!(
        message.contains("reads only under its own namespace (team-a)"),
        "{message}"
    );
}

//! Kyverno ClusterPolicy import, on fixtures, and the converted policies run through the engine.

use std::collections::BTreeMap;

use meshgate_api::mutation_policy::{MutationPolicySpec, MutationTarget, Operation};
use meshgate_core::policy::kyverno::{KyvernoError, import};
use meshgate_core::policy::{MatchContext, apply, validate};
use serde_json::{Value, json};

/// This crate's directory: `CARGO_MANIFEST_DIR` as Cargo sets it when it runs the test, else
/// where the test was compiled (a build directory shared between clones may hold a binary
/// compiled in another clone).
fn crate_dir() -> String {
    std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned())
}

fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/policy/{name}", crate_dir());
    let text = std::fs::read_to_string(&path).expect("fixture readable");
    serde_saphyr::from_str(&text).expect("fixture is YAML")
}

fn doc(yaml: &str) -> Value {
    serde_saphyr::from_str(yaml).expect("test document is YAML")
}

fn run(policies: &[(String, MutationPolicySpec)], object: &Value, op: Operation) -> Value {
    let labels = BTreeMap::new();
    let ctx = MatchContext {
        operation: op,
        namespace: "shop",
        namespace_labels: &labels,
        cluster: &meshgate_core::policy::context::NoCluster,
    };
    let applied = apply(policies.iter().map(|(n, s)| (n.as_str(), s)), object, &ctx);
    assert!(applied.failed.is_empty(), "{:?}", applied.failed);
    applied.object
}

#[test]
fn the_istio_outbound_policy_converts_and_works() {
    let out = import(&fixture("kyverno/istio-outbound.yaml")).unwrap();
    assert!(out.notes.is_empty(), "{:?}", out.notes);
    assert_eq!(out.policies.len(), 1);
    let (name, spec) = &out.policies[0];
    assert_eq!(
        name,
        "add-external-outbound-annotations-all-pods-in-cluster"
    );
    assert_eq!(validate(spec), Ok(()));
    assert_eq!(spec.match_.kinds, ["Pod"]);
    assert_eq!(
        spec.match_.operations,
        [Operation::Create, Operation::Update]
    );
    assert!(
        spec.pod_templates,
        "Kyverno auto-generates pod-controller rules"
    );
    assert_eq!(spec.exclude, None);
    assert_eq!(
        spec.mutations[0].strategic_merge,
        Some(json!({"metadata": {"annotations": {
            "traffic.sidecar.istio.io/excludeOutboundIPRanges": "0.0.0.0/0"
        }}}))
    );

    let annotation = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
    let pod = fixture("pod.yaml");
    let mutated = run(&out.policies, &pod, Operation::Create);
    assert_eq!(mutated["metadata"]["annotations"][annotation], "0.0.0.0/0");
    assert_eq!(mutated["metadata"]["annotations"]["team"], "payments");
    assert_eq!(run(&out.policies, &mutated, Operation::Create), mutated);

    let deployment = fixture("deployment.yaml");
    let mutated = run(&out.policies, &deployment, Operation::Update);
    assert_eq!(
        mutated["spec"]["template"]["metadata"]["annotations"][annotation],
        "0.0.0.0/0"
    );
    assert!(mutated["metadata"].get("annotations").is_none());

    let cronjob = fixture("cronjob.yaml");
    let mutated = run(&out.policies, &cronjob, Operation::Create);
    assert_eq!(
        mutated["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["annotations"][annotation],
        "0.0.0.0/0"
    );
}

#[test]
fn variables_foreach_and_context_entries_convert() {
    let out = import(&fixture("kyverno/variables-foreach.yaml")).unwrap();
    let names: Vec<&str> = out.policies.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "dynamic-things-1-label-with-namespace",
            "dynamic-things-2-pull-policy-per-container",
            "dynamic-things-3-with-context",
            "dynamic-things-4-with-api-call"
        ]
    );
    assert!(out.notes.is_empty(), "{:#?}", out.notes);
    let call = out.policies[3].1.mutations[0].context[0]
        .api_call
        .as_ref()
        .expect("an apiCall entry");
    assert_eq!(
        (call.url_path.as_str(), call.jmes_path.as_deref()),
        (
            "/api/v1/namespaces/{{ request.namespace }}/resourcequotas",
            Some("items | length(@)")
        )
    );
    assert_eq!(out.ignored.len(), 1);
    for (_, spec) in &out.policies {
        assert_eq!(validate(spec), Ok(()));
    }
    // The ConfigMap rule: its precondition reads the ConfigMap the cluster has.
    let (_, with_context) = &out.policies[2];
    let cm = |enabled: &str| {
        let mut maps = meshgate_core::policy::context::GivenObjects::read();
        maps.add(&doc(&format!(
            "{{apiVersion: v1, kind: ConfigMap, metadata: {{name: settings, namespace: default}}, data: {{enabled: \"{enabled}\"}}}}"
        )));
        maps
    };
    let labelled = |maps: &meshgate_core::policy::context::GivenObjects| {
        let ctx = MatchContext {
            operation: Operation::Create,
            namespace: "shop",
            namespace_labels: &BTreeMap::new(),
            cluster: maps,
        };
        let applied = meshgate_core::policy::apply(
            [("with-context", with_context)],
            &doc(
                "{apiVersion: v1, kind: Pod, metadata: {name: p}, spec: {containers: [{name: a, image: a}]}}",
            ),
            &ctx,
        );
        assert!(applied.failed.is_empty(), "{:?}", applied.failed);
        applied.object["metadata"]["labels"]["configured"].clone()
    };
    assert_eq!(labelled(&cm("true")), "yes");
    assert_eq!(labelled(&cm("false")), serde_json::Value::Null);
    let pod = doc("
apiVersion: v1
kind: Pod
metadata: {name: web}
spec:
  containers:
  - {name: app, image: app:1}
  - {name: log, image: log:1, imagePullPolicy: IfNotPresent}
");
    let got = run(&out.policies[..2], &pod, Operation::Create);
    assert_eq!(got["metadata"]["labels"]["origin-namespace"], "shop");
    assert_eq!(got["spec"]["containers"][0]["imagePullPolicy"], "Always");
    assert_eq!(got["spec"]["containers"][1]["imagePullPolicy"], "Always");
    // Kyverno's autogen: a Deployment's template, where request.object is the template.
    let deployment = doc("
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    spec:
      containers: [{name: app, image: app:1}]
");
    let got = run(&out.policies[..2], &deployment, Operation::Create);
    assert_eq!(
        got["spec"]["template"]["metadata"]["labels"]["origin-namespace"],
        "shop"
    );
    assert_eq!(
        got["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"],
        "Always"
    );
}

#[test]
fn preconditions_gate_a_rule_and_each_foreach_element() {
    let out = import(&fixture("kyverno/preconditions-foreach.yaml")).unwrap();
    assert!(out.notes.is_empty(), "{:#?}", out.notes);
    assert_eq!(out.policies.len(), 2);
    for (_, spec) in &out.policies {
        assert_eq!(validate(spec), Ok(()));
        // A JSON patch in any rule turns Kyverno's pod-controller rules off.
        assert!(!spec.pod_templates);
    }
    let pod = |annotations: &str| {
        doc(&format!(
            "
apiVersion: v1
kind: Pod
metadata: {{name: web, annotations: {annotations}}}
spec:
  initContainers:
  - {{name: fetch, image: curlimages/curl:8}}
  - {{name: migrate, image: app/migrate:1}}
  containers:
  - {{name: app, image: app:1}}
  - {{name: proxy, image: mesh/proxy:1}}
"
        ))
    };
    let got = run(&out.policies, &pod("{}"), Operation::Create);
    let init = &got["spec"]["initContainers"];
    assert_eq!(init[0]["name"], "fetch");
    assert_eq!(init[0]["securityContext"]["runAsUser"], 1337);
    assert_eq!(init[1]["name"], "migrate");
    assert!(init[1].get("securityContext").is_none(), "{init}");
    assert_eq!(
        got["metadata"]["annotations"],
        json!({"container-0": "app-create-shop", "container-1": "proxy-create-shop"})
    );
    // The rule's precondition: a pod that opts out of injection keeps its uids.
    let got = run(
        &out.policies,
        &pod("{sidecar.istio.io/inject: \"false\"}"),
        Operation::Update,
    );
    assert!(
        got["spec"]["initContainers"][0]
            .get("securityContext")
            .is_none()
    );
    assert_eq!(
        got["metadata"]["annotations"]["container-1"],
        "proxy-update-shop"
    );
}

#[test]
fn autogen_none_keeps_pods_only() {
    let out = import(&fixture("kyverno/autogen-none.yaml")).unwrap();
    let (name, spec) = &out.policies[0];
    assert_eq!(name, "add-safe-to-evict-annotate-empty-dir");
    assert!(!spec.pod_templates);
    assert_eq!(spec.match_.kinds, ["Pod"]);
    // The anchors survive and work.
    let pod = fixture("pod.yaml");
    let mutated = run(&out.policies, &pod, Operation::Create);
    assert_eq!(
        mutated["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"],
        "true"
    );
    let deployment = fixture("deployment.yaml");
    assert_eq!(
        run(&out.policies, &deployment, Operation::Create),
        deployment
    );
}

#[test]
fn autogen_list_json6902_match_all_and_exclude() {
    let out = import(&fixture("kyverno/autogen-some.yaml")).unwrap();
    assert_eq!(out.policies.len(), 1);
    let (name, spec) = &out.policies[0];
    assert_eq!(name, "mesh-defaults-hold-application-until-proxy-starts");
    // A JSON patch disables Kyverno's autogen for the whole policy, whatever the annotation says.
    assert!(!spec.pod_templates);
    assert_eq!(spec.match_.kinds, ["Pod"]);
    assert_eq!(spec.match_.namespaces, ["team-*"]);
    assert_eq!(spec.match_.operations, [Operation::Create]);
    assert_eq!(
        spec.match_
            .namespace_selector
            .as_ref()
            .unwrap()
            .match_labels,
        BTreeMap::from([("istio-injection".to_owned(), "enabled".to_owned())])
    );
    assert_eq!(spec.exclude.as_ref().unwrap().namespaces, ["team-legacy"]);
    assert_eq!(
        spec.warning.as_deref(),
        Some("applied Kyverno rule Mesh_Defaults/Hold Application Until Proxy Starts")
    );
    // Metadata adds became metadata mutations (which create the maps, like Kyverno's add).
    let m = &spec.mutations;
    assert_eq!(m.len(), 3, "{m:#?}");
    assert_eq!(
        m[0].annotations.as_ref().unwrap().values["proxy.istio.io/config"],
        "{\"holdApplicationUntilProxyStarts\": true}"
    );
    assert_eq!(m[1].labels.as_ref().unwrap().values["mesh"], "istio");
    assert_eq!(
        m[2].json_patch.as_ref().unwrap()[0].path,
        "/spec/containers/0/env/-"
    );
    // The other operations keep Kyverno's JSON patch leniencies.
    let options = m[2].json_patch_options.as_ref().expect("options");
    assert!(
        options.negative_indices
            && options.allow_missing_path_on_remove
            && options.ensure_path_exists_on_add
    );
    assert_eq!(
        out.notes,
        [
            "spec.rules[0].match.all[0].resources.operations[1]: \"DELETE\" dropped: meshgate mutates on CREATE and UPDATE only"
        ]
    );

    let labels = BTreeMap::from([("istio-injection".to_owned(), "enabled".to_owned())]);
    let ctx = |ns| MatchContext {
        operation: Operation::Create,
        namespace: ns,
        namespace_labels: &labels,
        cluster: &meshgate_core::policy::context::NoCluster,
    };
    let mut pod = fixture("pod.yaml");
    pod["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("annotations");
    let refs = || out.policies.iter().map(|(n, s)| (n.as_str(), s));
    let mutated = apply(refs(), &pod, &ctx("team-a"));
    assert_eq!(mutated.policies, [name.as_str()]);
    assert_eq!(mutated.object["metadata"]["labels"]["mesh"], "istio");
    assert_eq!(
        mutated.object["spec"]["containers"][0]["env"][2],
        json!({"name": "MESH", "value": "istio"})
    );
    assert!(!apply(refs(), &pod, &ctx("team-legacy")).changed());
    assert!(!apply(refs(), &pod, &ctx("shop")).changed());
}

#[test]
fn autogen_annotation_with_some_controllers_lists_them_as_kinds() {
    let out = import(&doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: p
  annotations:
    pod-policies.kyverno.io/autogen-controllers: "Deployment, StatefulSet,ReplicationController"
spec:
  rules:
  - name: r
    match:
      resources:
        kinds: [Pod]
    mutate:
      patchStrategicMerge:
        metadata:
          labels:
            +(mesh): istio
"#))
    .unwrap();
    let spec = &out.policies[0].1;
    assert!(!spec.pod_templates);
    assert_eq!(spec.match_.kinds, ["Pod", "Deployment", "StatefulSet"]);
    assert!(
        out.notes
            .iter()
            .any(|n| n.contains("ReplicationController pod templates are not mutated")),
        "{:?}",
        out.notes
    );
    let deployment = fixture("deployment.yaml");
    let mutated = run(&out.policies, &deployment, Operation::Create);
    assert_eq!(
        mutated["spec"]["template"]["metadata"]["labels"]["mesh"],
        "istio"
    );
    assert_eq!(
        run(&out.policies, &fixture("cronjob.yaml"), Operation::Create),
        fixture("cronjob.yaml")
    );
}

#[test]
fn a_selector_disables_autogen() {
    let out = import(&doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: p}
spec:
  rules:
  - name: r
    match:
      any:
      - resources:
          kinds: ["*/Pod"]
          selector: {matchLabels: {app: web}}
    mutate:
      patchStrategicMerge: {metadata: {labels: {mesh: istio}}}
"#))
    .unwrap();
    let spec = &out.policies[0].1;
    assert!(!spec.pod_templates);
    assert_eq!(
        spec.match_.object_selector.as_ref().unwrap().match_labels["app"],
        "web"
    );
}

#[test]
fn workload_rules_mutate_the_workload_objects() {
    let out = import(&fixture("kyverno/workloads.yaml")).unwrap();
    let names: Vec<&str> = out.policies.iter().map(|(n, _)| n.as_str()).collect();
    // Numbered: the plain names would sort `scale` first, and Kyverno applies the rules in
    // their order.
    assert_eq!(
        names,
        [
            "workload-rules-1-template-annotation",
            "workload-rules-2-scale",
            "workload-rules-3-union-any"
        ]
    );

    // Kyverno applies the rule's patch to every object it matched: the patch is kept as
    // written, every kind kept, each object patched as itself.
    let template = &out.policies[0].1;
    assert_eq!(
        template.match_.kinds,
        ["Deployment", "StatefulSet", "CronJob", "Service"]
    );
    assert_eq!(template.target, MutationTarget::Object);
    assert!(!template.pod_templates);
    assert_eq!(
        template.mutations[0].strategic_merge,
        Some(
            json!({"spec": {"template": {"metadata": {"annotations": {"sidecar.istio.io/proxyCPU": "100m"}}}}})
        )
    );
    let deployment = fixture("deployment.yaml");
    let mutated = run(&out.policies[..1], &deployment, Operation::Create);
    assert_eq!(
        mutated["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/proxyCPU"],
        "100m"
    );
    assert_eq!(mutated["metadata"], deployment["metadata"]);

    // A patch of the Deployment's own field converts too.
    let scale = &out.policies[1].1;
    assert_eq!(scale.match_.kinds, ["Deployment"]);
    assert_eq!(scale.target, MutationTarget::Object);
    let scaled = run(&out.policies[1..2], &deployment, Operation::Create);
    assert_eq!(scaled["spec"]["replicas"], 3);
    assert_eq!(scaled["spec"]["template"], deployment["spec"]["template"]);

    let union = &out.policies[2].1;
    assert_eq!(union.match_.namespaces, ["a", "b-*"]);
    assert!(union.pod_templates);
    assert_eq!(union.target, MutationTarget::Pod);

    let expected = [
        "spec.rules[2] (by-user): not converted: spec.rules[2].match.any[0].subjects: matching on the requesting user is not supported",
        "spec.rules[3] (mixed-any): not converted: spec.rules[3].match.any: its 2 entries differ in kinds and namespaces",
    ];
    for e in expected {
        assert!(
            out.notes.iter().any(|n| n.starts_with(e)),
            "missing {e:?} in {:#?}",
            out.notes
        );
    }
    assert_eq!(out.notes.len(), expected.len(), "{:#?}", out.notes);
}

#[test]
fn mixed_pod_and_workload_kinds_patch_each_object() {
    let out = import(&doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: p}
spec:
  rules:
  - name: r
    match:
      resources:
        kinds: [Pod, apps/v1/Deployment]
    mutate:
      patchStrategicMerge: {metadata: {labels: {mesh: istio}}}
"#))
    .unwrap();
    assert!(out.notes.is_empty(), "{:?}", out.notes);
    let spec = &out.policies[0].1;
    assert_eq!(spec.match_.kinds, ["Pod", "Deployment"]);
    assert_eq!(spec.target, MutationTarget::Object);
    // Mixed kinds disable Kyverno's autogen.
    assert!(!spec.pod_templates);
    let deployment = fixture("deployment.yaml");
    let mutated = run(&out.policies, &deployment, Operation::Create);
    assert_eq!(mutated["metadata"]["labels"]["mesh"], "istio");
    assert_eq!(mutated["spec"], deployment["spec"]);
    let pod = run(&out.policies, &fixture("pod.yaml"), Operation::Create);
    assert_eq!(pod["metadata"]["labels"]["mesh"], "istio");
}

/// Issue #30, cause 7: a rule for Deployments whose precondition reads the Deployment's pod
/// template and whose patch adds a volume and a mount. Its `request.object` is the Deployment,
/// so the precondition holds where Kyverno's does, and the patch lands where Kyverno's does.
#[test]
fn a_deployment_rule_with_preconditions_adds_its_volume() {
    let policy = doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: scratch-volume}
spec:
  rules:
  - name: add-scratch
    match:
      any:
      - resources: {kinds: [Deployment]}
    preconditions:
      all:
      - key: "{{ request.object.spec.template.metadata.annotations.\"example.com/scratch\" || '' }}"
        operator: Equals
        value: "on"
    mutate:
      patchesJson6902: |-
        - op: add
          path: /spec/template/spec/volumes/-
          value: {name: scratch, emptyDir: {medium: Memory}}
        - op: add
          path: /spec/template/spec/containers/0/volumeMounts/-
          value: {name: scratch, mountPath: /scratch}
  - name: job-ttl
    match:
      any:
      - resources: {kinds: [Job]}
    mutate:
      foreach:
      - list: "[request.object.spec]"
        patchStrategicMerge:
          spec:
            +(ttlSecondsAfterFinished): 300
"#);
    let out = import(&policy).unwrap();
    assert!(out.notes.is_empty(), "{:?}", out.notes);
    assert_eq!(out.policies.len(), 2);
    for (_, spec) in &out.policies {
        assert_eq!(spec.target, MutationTarget::Object);
        assert_eq!(validate(spec), Ok(()));
    }
    let mut deployment = fixture("deployment.yaml");
    deployment["spec"]["template"]["metadata"]["annotations"] =
        json!({"example.com/scratch": "on"});
    let mutated = run(&out.policies, &deployment, Operation::Create);
    let pod_spec = &mutated["spec"]["template"]["spec"];
    assert_eq!(
        pod_spec["volumes"],
        json!([{"name": "scratch", "emptyDir": {"medium": "Memory"}}])
    );
    assert_eq!(
        pod_spec["containers"][0]["volumeMounts"],
        json!([{"name": "scratch", "mountPath": "/scratch"}])
    );
    // Without the annotation the precondition fails: nothing changes.
    let plain = fixture("deployment.yaml");
    assert_eq!(run(&out.policies, &plain, Operation::Create), plain);

    let job = json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "shop"},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}});
    let mutated = run(&out.policies, &job, Operation::Create);
    assert_eq!(mutated["spec"]["ttlSecondsAfterFinished"], 300);
}

#[test]
fn namespaced_policy_applies_in_its_namespace() {
    let out = import(&doc(r#"
apiVersion: kyverno.io/v1
kind: Policy
metadata: {name: p, namespace: shop}
spec:
  rules:
  - name: r
    match:
      resources: {kinds: [Pod]}
    mutate:
      patchesJson6902: '[{"op": "add", "path": "/metadata/labels/x", "value": "y"}]'
"#))
    .unwrap();
    let spec = &out.policies[0].1;
    assert_eq!(spec.match_.namespaces, ["shop"]);
    assert!(spec.mutations[0].labels.is_some());
    assert!(out.notes.is_empty(), "{:?}", out.notes);
}

#[test]
fn not_a_policy_and_malformed() {
    let err = import(&json!({"apiVersion": "v1", "kind": "Pod"})).unwrap_err();
    assert!(matches!(err, KyvernoError::NotAPolicy { .. }));
    let err = import(&json!({"apiVersion": "kyverno.io/v1", "kind": "ClusterPolicy", "metadata": {"name": "x"}, "spec": {}}))
        .unwrap_err();
    assert_eq!(
        err,
        KyvernoError::Malformed {
            path: "spec.rules".into(),
            message: "must be a list".into()
        }
    );
}

#[test]
fn long_and_duplicate_names_are_dns1123() {
    let rule = |name: &str| {
        json!({"name": name, "match": {"resources": {"kinds": ["Pod"]}},
               "mutate": {"patchStrategicMerge": {"metadata": {"labels": {"a": "b"}}}}})
    };
    let long = "x".repeat(80);
    let out = import(&json!({
        "apiVersion": "kyverno.io/v1", "kind": "ClusterPolicy",
        "metadata": {"name": "My.Policy"},
        "spec": {"rules": [rule("Rule_1"), rule("rule 1"), rule(&long)]}
    }))
    .unwrap();
    let names: Vec<&str> = out.policies.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["my-policy-rule-1", "my-policy-rule-1-2"]);
    assert_eq!(names[2].len(), 63);
    assert!(names[2].starts_with("my-policy-xxx"));
    for n in names {
        assert!(
            n.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        assert!(!n.starts_with('-') && !n.ends_with('-'));
    }
}

/// Rules for other kinds than Pods and workloads convert as they are: the objects themselves.
#[test]
fn rules_for_other_kinds_convert() {
    let out = import(&doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: others}
spec:
  rules:
  - name: services
    match:
      any:
      - resources: {kinds: [Service, v1/ConfigMap, networking.k8s.io/v1/NetworkPolicy]}
    mutate:
      patchStrategicMerge: {metadata: {labels: {team: mesh}}}
  - name: everything
    match:
      any:
      - resources: {kinds: ["*"], selector: {matchLabels: {mesh: "true"}}}
    mutate:
      patchesJson6902: |-
        - {op: add, path: /metadata/annotations/seen, value: "yes"}
"#))
    .unwrap();
    assert!(out.notes.is_empty(), "{:#?}", out.notes);
    let services = &out.policies[0].1;
    assert_eq!(
        services.match_.kinds,
        [
            "Service",
            "v1/ConfigMap",
            "networking.k8s.io/v1/NetworkPolicy"
        ]
    );
    assert!(!services.pod_templates);
    let svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "shop"}});
    let out_svc = run(&out.policies[..1], &svc, Operation::Create);
    assert_eq!(out_svc["metadata"]["labels"]["team"], "mesh");
    let every = &out.policies[1].1;
    assert_eq!(every.match_.kinds, ["*"]);
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x", "namespace": "shop", "labels": {"mesh": "true"}}});
    let out_secret = run(&out.policies[1..], &secret, Operation::Create);
    assert_eq!(out_secret["metadata"]["annotations"]["seen"], "yes");
}

/// Issue #30, causes 1, 2, 3, 5: variable context entries (rule and foreach), nested variables,
/// `images`, and a variable that resolves to null, as a Kyverno author writes them.
#[test]
fn context_nested_variables_images_and_nulls_convert_and_apply() {
    let policy = doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: mirror}
spec:
  rules:
  - name: rewrite
    match:
      any:
      - resources: {kinds: [Pod]}
    context:
    - name: mirror
      variable: {value: mirror.example.com}
    - name: team
      variable:
        jmesPath: request.object.metadata.labels.team
        default: none
    mutate:
      foreach:
      - list: request.object.spec.containers
        context:
        - name: registry
          variable:
            jmesPath: images.containers."{{element.name}}".registry
        preconditions:
          all:
          - {key: "{{ registry }}", operator: Equals, value: docker.io}
        patchStrategicMerge:
          metadata:
            labels:
              team: "{{ team }}"
          spec:
            containers:
            - name: "{{ element.name }}"
              image: "{{ mirror }}/{{ images.containers.\"{{element.name}}\".path }}:{{ images.containers.\"{{element.name}}\".tag }}"
      - list: request.object.spec.containers
        patchStrategicMerge:
          spec:
            containers:
            - name: "{{ element.name }}"
              resources:
                limits:
                  memory: "{{ element.resources.limits.memory || element.resources.requests.memory }}"
"#);
    let out = import(&policy).expect("converts");
    assert!(out.notes.is_empty(), "{:#?}", out.notes);
    let (_, spec) = &out.policies[0];
    assert_eq!(validate(spec), Ok(()));
    // The rule's context once, for both foreach entries (Kyverno loads it once per rule).
    assert_eq!(spec.mutations.len(), 1);
    assert_eq!(spec.mutations[0].context.len(), 2);
    assert_eq!(spec.mutations[0].mutations.len(), 2);
    let pod = doc("
apiVersion: v1
kind: Pod
metadata: {name: web}
spec:
  containers:
  - {name: app, image: nginx:1.27, resources: {requests: {memory: 64Mi}}}
  - {name: side, image: ghcr.io/x/side:2}
  - {name: bare, image: busybox}
");
    let got = run(&out.policies, &pod, Operation::Create);
    let c = &got["spec"]["containers"];
    assert_eq!(got["metadata"]["labels"]["team"], "none");
    // Kyverno's order: a strategic-merge foreach runs last element first, and each patch puts
    // the container it names first (kustomize's merge). The first entry names bare, then app
    // (side fails the precondition): app, bare, side. The second entry lists the containers
    // as the first left them and names all three: the order stays.
    let names: Vec<&str> = c
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["app", "bare", "side"]);
    assert_eq!(c[0]["image"], "mirror.example.com/nginx:1.27");
    assert_eq!(c[1]["image"], "mirror.example.com/busybox:latest");
    assert_eq!(
        c[2]["image"], "ghcr.io/x/side:2",
        "not on docker.io: unchanged"
    );
    // The memory limit: from the request where there is one; a null (no limit, no request)
    // is no change, not an error.
    assert_eq!(c[0]["resources"]["limits"]["memory"], "64Mi");
    assert_eq!(c[1].get("resources"), None, "{c:#}");
    assert_eq!(c[2].get("resources"), None, "{c:#}");
}

/// Issue #30, cause 6: `order`, the default order of a strategic-merge foreach, and match by
/// `names` and `annotations`.
#[test]
fn foreach_order_names_and_annotations_convert() {
    let policy = doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: order}
spec:
  rules:
  - name: mark
    match:
      any:
      - resources:
          kinds: [Pod]
          names: ["web-*"]
          annotations: {"team.example.com/*": "pay?"}
    mutate:
      foreach:
      - list: request.object.spec.containers
        order: Ascending
        patchStrategicMerge:
          spec:
            containers:
            - {name: "{{ element.name }}", env: [{name: INDEX, value: "i{{ elementIndex }}"}]}
      - list: request.object.spec.containers
        order: Descending
        patchesJson6902: |-
          - op: add
            path: /metadata/labels/visit-{{ elementIndex }}
            value: "{{ element.name }}"
"#);
    let out = import(&policy).expect("converts");
    assert!(out.notes.is_empty(), "{:#?}", out.notes);
    let (_, spec) = &out.policies[0];
    assert_eq!(spec.match_.names, ["web-*"]);
    assert_eq!(spec.match_.annotations["team.example.com/*"], "pay?");
    assert!(
        !spec.pod_templates,
        "names and annotations turn Kyverno's autogen off"
    );
    let pod = |name: &str, team: &str| {
        doc(&format!(
            "
apiVersion: v1
kind: Pod
metadata: {{name: {name}, labels: {{}}, annotations: {{team.example.com/owner: {team}}}}}
spec:
  containers: [{{name: a}}, {{name: b}}]
"
        ))
    };
    let got = run(&out.policies, &pod("web-1", "pays"), Operation::Create);
    let names: Vec<&str> = got["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    // Ascending: each element's patch puts its container first (kustomize's merge), so the
    // last one visited ends first.
    assert_eq!(names, ["b", "a"]);
    assert_eq!(got["spec"]["containers"][0]["env"][0]["value"], "i1");
    // The second entry lists the containers as the first entry left them (b, a), and each
    // element keeps its index when visited in descending order.
    assert_eq!(got["metadata"]["labels"]["visit-0"], "b");
    assert_eq!(got["metadata"]["labels"]["visit-1"], "a");
    for (name, team) in [("api-1", "pays"), ("web-1", "other")] {
        let untouched = pod(name, team);
        assert_eq!(
            run(&out.policies, &untouched, Operation::Create),
            untouched,
            "{name} {team}"
        );
    }
}

/// An `apiCall` entry converts as a GET; a POST, `data` or a `service` call is refused, naming
/// the field.
#[test]
fn api_call_context_converts_a_get_and_refuses_the_rest_by_name() {
    let policy = |call: &str| {
        doc(&format!(
            r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {{name: calls}}
spec:
  rules:
  - name: r
    match: {{any: [{{resources: {{kinds: [Pod]}}}}]}}
    mutate:
      foreach:
      - list: request.object.spec.containers
        context:
        - name: svc
          apiCall: {call}
        patchStrategicMerge: {{metadata: {{labels: {{x: "{{{{ svc }}}}"}}}}}}
"#
        ))
    };
    let out = import(&policy(
        "{urlPath: /api/v1/services, method: GET, jmesPath: 'items | length(@)'}",
    ))
    .expect("a GET converts");
    assert!(out.notes.is_empty(), "{:#?}", out.notes);
    for (call, field) in [
        (
            "{urlPath: /api/v1/services, method: POST}",
            "apiCall.method",
        ),
        (
            "{service: {url: 'https://quota.example'}}",
            "apiCall.service",
        ),
        (
            "{urlPath: /apis/authorization.k8s.io/v1/subjectaccessreviews, data: [{key: a, value: b}]}",
            "apiCall.data",
        ),
    ] {
        let text = import(&policy(call)).expect_err("refused").to_string();
        assert!(
            text.contains(&format!(
                "spec.rules[0].mutate.foreach[0].context[0] (svc).{field}: not converted"
            )),
            "{text}"
        );
    }
}

/// Issue #30, cause 6: rule preconditions over several foreach entries are evaluated once, on
/// the object as the rule finds it, before the first entry (Kyverno's `pkg/engine/engine.go`);
/// a later entry runs although an earlier one changed what they test, and sees the object as
/// the earlier entry left it; when they fail no entry applies.
#[test]
fn rule_preconditions_hold_once_for_every_foreach_entry() {
    let policy = doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: stamp}
spec:
  rules:
  - name: stamp-once
    match: {any: [{resources: {kinds: [Pod]}}]}
    preconditions:
      all:
      - {key: "{{ request.object.metadata.labels.stamped || '' }}", operator: Equals, value: ""}
    mutate:
      foreach:
      - list: request.object.spec.containers
        patchesJson6902: |-
          - op: add
            path: /metadata/labels/stamped
            value: "by-{{ element.name }}"
      - list: request.object.spec.containers
        preconditions:
          any:
          - {key: "{{ element.name }}", operator: NotEquals, value: skip-me}
        patchStrategicMerge:
          spec:
            containers:
            - name: "{{ element.name }}"
              env:
              - {name: STAMP, value: "{{ request.object.metadata.labels.stamped }}"}
"#);
    let out = import(&policy).expect("converts");
    assert!(out.notes.is_empty(), "{:#?}", out.notes);
    let (_, spec) = &out.policies[0];
    assert_eq!(validate(spec), Ok(()));
    assert_eq!(spec.mutations.len(), 1, "{spec:#?}");
    assert!(spec.mutations[0].preconditions.is_some());
    assert_eq!(spec.mutations[0].mutations.len(), 2);
    let pod = doc("
apiVersion: v1
kind: Pod
metadata: {name: web, labels: {app: web}}
spec:
  containers:
  - {name: app}
  - {name: skip-me}
");
    let got = run(&out.policies, &pod, Operation::Create);
    assert_eq!(got["metadata"]["labels"]["stamped"], "by-skip-me");
    let env = |name: &str| {
        got["spec"]["containers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == name))
            .map(|c| c["env"].clone())
    };
    assert_eq!(
        env("app"),
        Some(json!([{"name": "STAMP", "value": "by-skip-me"}])),
        "{got:#}"
    );
    assert_eq!(
        env("skip-me"),
        Some(Value::Null),
        "the entry's own precondition, per element"
    );
    let mut stamped = pod.clone();
    stamped["metadata"]["labels"]["stamped"] = json!("earlier");
    assert_eq!(run(&out.policies, &stamped, Operation::Create), stamped);
}

/// Issue #30: a foreach of foreach (Kyverno's nested `foreach`): the inner entries per outer
/// element, `element`/`elementIndex` the inner element's, `element0`/`elementIndex0` the outer
/// one's, the inner entries' preconditions per inner element.
#[test]
fn nested_foreach_converts_and_applies_per_level() {
    let policy = doc(r#"
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: env-case}
spec:
  rules:
  - name: upper-app-env
    match: {any: [{resources: {kinds: [Pod]}}]}
    mutate:
      foreach:
      - list: request.object.spec.containers
        foreach:
        - list: "element.env || `[]`"
          preconditions:
            all:
            - {key: "{{ element.name }}", operator: NotEquals, value: KEEP}
          patchesJson6902: |-
            - op: replace
              path: /spec/containers/{{ elementIndex0 }}/env/{{ elementIndex1 }}/value
              value: "{{ to_upper(element.value) }}"
        - list: "element.env || `[]`"
          patchStrategicMerge:
            metadata:
              annotations:
                "env-{{ elementIndex0 }}-{{ elementIndex }}": "{{ element0.name }}/{{ element.name }}"
"#);
    let out = import(&policy).expect("converts");
    assert!(out.notes.is_empty(), "{:#?}", out.notes);
    let (_, spec) = &out.policies[0];
    assert_eq!(validate(spec), Ok(()));
    let outer = &spec.mutations[0];
    assert_eq!(
        outer.foreach.as_ref().map(|f| f.list.as_str()),
        Some("request.object.spec.containers")
    );
    assert_eq!(outer.mutations.len(), 2);
    let pod = doc("
apiVersion: v1
kind: Pod
metadata: {name: web}
spec:
  containers:
  - {name: app, env: [{name: MODE, value: fast}, {name: KEEP, value: low}]}
  - {name: bare}
  - {name: side, env: [{name: LEVEL, value: debug}]}
");
    let got = run(&out.policies, &pod, Operation::Create);
    let c = &got["spec"]["containers"];
    assert_eq!(c[0]["env"][0]["value"], "FAST");
    assert_eq!(
        c[0]["env"][1]["value"], "low",
        "the inner precondition, per element"
    );
    assert_eq!(c[2]["env"][0]["value"], "DEBUG");
    let a = &got["metadata"]["annotations"];
    assert_eq!(a["env-0-0"], "app/MODE");
    assert_eq!(a["env-0-1"], "app/KEEP");
    assert_eq!(a["env-2-0"], "side/LEVEL");
    assert_eq!(a.as_object().map(|a| a.len()), Some(3));
    assert_eq!(run(&out.policies, &got, Operation::Create), got);

    // Kyverno refuses an entry with a nested foreach and anything else; so does the import,
    // naming the field.
    let mut with_patch = policy.clone();
    with_patch["spec"]["rules"][0]["mutate"]["foreach"][0]["patchStrategicMerge"] =
        json!({"metadata": {"labels": {"x": "y"}}});
    let text = import(&with_patch).expect_err("refused").to_string();
    assert!(
        text.contains(
            "spec.rules[0].mutate.foreach[0].patchStrategicMerge: an entry with a nested foreach"
        ),
        "{text}"
    );
}

/// `import kyverno` over policies written in the style of Kyverno's sample library
/// (`tests/fixtures/policy/kyverno-library/`, their README): each mutate rule either converts,
/// and then applies without error, or is refused with a note naming the exact field.
#[test]
fn library_style_policies_convert_or_name_the_field_they_cannot() {
    let dir = format!("{}/tests/fixtures/policy/kyverno-library", crate_dir());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("corpus")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "the corpus: {files:?}");
    let pod = doc("
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop}
spec:
  initContainers: [{name: init, image: registry.example.com/tools/init:1.0}]
  containers:
  - {name: app, image: registry.example.com/shop/web:3.0, resources: {limits: {memory: 256Mi}}}
  - {name: log, image: fluent/bit}
  volumes: [{name: scratch, emptyDir: {}}]
");
    let job = doc("
apiVersion: batch/v1
kind: Job
metadata: {name: once, namespace: shop}
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: run, image: busybox}]
");
    for file in files {
        let name = file
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(&file).expect("read");
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("YAML");
        let (expect, policy, config_maps) = (&docs[0], &docs[1], &docs[2..]);
        let converted = expect["converted"].as_array().map_or(0, Vec::len);
        let refused: BTreeMap<String, String> = expect["refused"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let (policies, notes) = match import(policy) {
            Ok(out) => (out.policies, out.notes),
            Err(KyvernoError::NothingConvertible { notes, .. }) => (Vec::new(), notes),
            Err(e) => panic!("{name}: {e}"),
        };
        assert_eq!(
            policies.len(),
            converted,
            "{name}: converted rules; notes {notes:#?}"
        );
        assert_eq!(notes.len(), refused.len(), "{name}: notes {notes:#?}");
        for (rule, field) in &refused {
            assert!(
                notes
                    .iter()
                    .any(|n| n.contains(&format!("({rule})")) && n.contains(field.as_str())),
                "{name}: rule {rule} must be refused naming {field}: {notes:#?}"
            );
        }
        let mut maps = meshgate_core::policy::context::GivenObjects::read();
        for cm in config_maps {
            maps.add(cm);
        }
        let labels = BTreeMap::from([("istio-injection".to_owned(), "enabled".to_owned())]);
        for (policy_name, spec) in &policies {
            assert_eq!(validate(spec), Ok(()), "{name}: {policy_name}");
            for object in [&pod, &job] {
                let ctx = MatchContext {
                    operation: Operation::Create,
                    namespace: "shop",
                    namespace_labels: &labels,
                    cluster: &maps,
                };
                let applied = apply([(policy_name.as_str(), spec)], object, &ctx);
                assert!(
                    applied.failed.is_empty(),
                    "{name}: {policy_name} fails on {}: {:?}",
                    object["kind"],
                    applied.failed
                );
            }
        }
    }
}

/// Kyverno's CEL `MutatingPolicy`: a mutation whose expression reads nothing of the request
/// converts (and gives what `render` gives applying the MutatingPolicy itself); one that reads
/// the object is refused, naming the expression's field.
#[test]
fn a_mutating_policy_converts_where_its_expressions_are_constant() {
    let policy = doc(r#"
apiVersion: policies.kyverno.io/v1
kind: MutatingPolicy
metadata: {name: mesh-dns}
spec:
  matchConstraints:
    resourceRules:
    - apiGroups: [""]
      apiVersions: [v1]
      operations: [CREATE]
      resources: [pods]
    namespaceSelector:
      matchLabels: {mesh: "on"}
  mutations:
  - patchType: ApplyConfiguration
    applyConfiguration:
      expression: >
        Object{
          metadata: Object.metadata{annotations: {"traffic.sidecar.istio.io/excludeOutboundIPRanges": "169.254.169.254/32"}},
          spec: Object.spec{dnsConfig: Object.spec.dnsConfig{options: [Object.spec.dnsConfig.options{name: "ndots", value: "2"}]}}
        }
  - patchType: JSONPatch
    jsonPatch:
      expression: >
        [JSONPatch{op: "add", path: "/metadata/labels/mesh-dns", value: "set"}]
"#);
    let out = import(&policy).expect("converts");
    assert!(out.notes.is_empty(), "{:?}", out.notes);
    let [(name, spec)] = <[_; 1]>::try_from(out.policies).expect("one policy");
    assert_eq!(name, "mesh-dns");
    assert_eq!(spec.target, MutationTarget::Object);
    assert_eq!(spec.match_.kinds, ["Pod"]);
    assert_eq!(spec.match_.operations, [Operation::Create]);
    let pod = doc("
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec:
  containers: [{name: app, image: registry.example.com/shop/web:3.0}]
");
    let labels = BTreeMap::from([("mesh".to_owned(), "on".to_owned())]);
    let converted = apply(
        [(name.as_str(), &spec)],
        &pod,
        &MatchContext {
            operation: Operation::Create,
            namespace: "shop",
            namespace_labels: &labels,
            cluster: &meshgate_core::policy::context::NoCluster,
        },
    );
    assert!(converted.failed.is_empty(), "{:?}", converted.failed);
    let original = meshgate_core::policy::admission::apply(
        &[("mesh-dns".to_owned(), policy.clone())],
        &pod,
        &meshgate_core::policy::admission::AdmissionRequest {
            operation: "CREATE",
            namespace: "shop",
            namespace_labels: &labels,
        },
    )
    .expect("applies");
    assert_eq!(
        converted.object, original.object,
        "the same as the MutatingPolicy itself"
    );
    assert_eq!(
        converted.object["spec"]["dnsConfig"]["options"][0]["value"],
        "2"
    );
    assert_eq!(converted.object["metadata"]["labels"]["mesh-dns"], "set");

    // An expression that reads the object is refused, naming its field.
    let mut reads = policy.clone();
    reads["spec"]["mutations"][1]["jsonPatch"]["expression"] = json!(
        "[JSONPatch{op: \"add\", path: \"/metadata/labels/owner\", value: object.metadata.name}]"
    );
    reads["spec"]["matchConditions"] = json!([{"name": "x", "expression": "true"}]);
    match import(&reads) {
        Err(KyvernoError::NothingConvertible { notes, .. }) => {
            assert!(
                notes.iter().any(|n| n.starts_with("spec.mutations[1].jsonPatch.expression: not converted")),
                "{notes:#?}"
            );
            assert!(
                notes.iter().any(|n| n.starts_with("spec.matchConditions")),
                "{notes:#?}"
            );
        }
        other => panic!("refused expected: {other:?}"),
    }
}

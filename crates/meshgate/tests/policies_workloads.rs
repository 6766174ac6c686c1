//! Policies that name workloads, on the real API server (issue #30, causes 4 and 7): a
//! MutationPolicy with `target: Object` mutates the workload object itself (a Kyverno rule that
//! names Deployment does), one with the default target keeps mutating pod templates, and
//! `meshgate import kyverno` of rules naming Deployment and Job gives the object target with
//! the rules' preconditions and variables read on the workload. Every object is created through
//! meshgate's webhook and rendered offline by `meshgate render` (given the Kyverno policy
//! itself), and the two agree on everything the policies can change. The native path of an
//! object-target policy is in `policies_native` (cases `workload-object-*`).
//!
//! Run: `cargo test -p meshgate --test policies_workloads`.

mod common;

use std::time::Duration;

use common::*;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use meshgate_api::MutationPolicy;
use serde_json::{Value, json};

/// The Kyverno policy, written for this test: a Deployment rule whose precondition reads the
/// Deployment's pod template and whose patch adds a volume and its mount (cause 7), a
/// Deployment rule that annotates the Deployment itself with a variable, and a Job rule that
/// sets the Job's own `ttlSecondsAfterFinished` (cause 4). Each rule is kept to `ns`.
fn kyverno_policy(ns: &str) -> String {
    format!(
        r#"apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: workload-objects
spec:
  rules:
  - name: scratch-volume
    match:
      any:
      - resources:
          kinds: [Deployment]
          namespaces: ["{ns}"]
    preconditions:
      all:
      - key: "{{{{ request.object.spec.template.metadata.annotations.\"example.com/scratch\" || '' }}}}"
        operator: Equals
        value: "on"
    mutate:
      patchStrategicMerge:
        spec:
          template:
            spec:
              volumes:
              - name: scratch
                emptyDir: {{medium: Memory}}
              containers:
              - (name): "*"
                volumeMounts:
                - name: scratch
                  mountPath: /scratch
  - name: owner
    match:
      any:
      - resources:
          kinds: [apps/v1/Deployment]
          namespaces: ["{ns}"]
    mutate:
      patchStrategicMerge:
        metadata:
          annotations:
            example.com/owner: "team-{{{{ request.object.metadata.name }}}}"
  - name: job-ttl
    match:
      any:
      - resources:
          kinds: [batch/v1/Job]
          namespaces: ["{ns}"]
    mutate:
      patchStrategicMerge:
        spec:
          +(ttlSecondsAfterFinished): 300
"#
    )
}

/// A MutationPolicy of the default target naming Deployment: its annotation goes to the pod
/// template, as it always has.
fn template_policy(ns: &str) -> Value {
    json!({
        "apiVersion": "meshgate.dev/v1alpha1", "kind": "MutationPolicy",
        "metadata": {"name": "workloads-template-annotation"},
        "spec": {
            "match": {"kinds": ["Deployment"], "namespaces": [ns]},
            "mutations": [{"annotations": {"values": {"example.com/pod-annotation": "yes"}}}],
        },
    })
}

fn deployment(ns: &str, name: &str, template_annotations: Value) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}, "annotations": template_annotations},
                "spec": {"containers": [
                    {"name": "app", "image": "registry.invalid/app:1"},
                    {"name": "side", "image": "registry.invalid/side:1"},
                ]},
            },
        },
    })
}

fn job(ns: &str, name: &str, ttl: Option<u64>) -> Value {
    let mut j = json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {"template": {"spec": {"restartPolicy": "Never",
            "containers": [{"name": "job", "image": "registry.invalid/job:1"}]}}},
    });
    if let Some(t) = ttl {
        j["spec"]["ttlSecondsAfterFinished"] = json!(t);
    }
    j
}

/// What the policies of this test can change (the API server defaults none of these).
fn observed(o: &Value) -> Value {
    let at = |p: &str| o.pointer(p).cloned().unwrap_or(Value::Null);
    let mounts: Vec<Value> = o
        .pointer("/spec/template/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|c| json!([c["name"], c.get("volumeMounts")]))
        .collect();
    json!({
        "annotations": at("/metadata/annotations"),
        "replicas": at("/spec/replicas"),
        "ttl": at("/spec/ttlSecondsAfterFinished"),
        "template-annotations": at("/spec/template/metadata/annotations"),
        "volumes": at("/spec/template/spec/volumes"),
        "mounts": mounts,
    })
}

fn api(client: &kube::Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let (group, plural) = match kind {
        "Deployment" => ("apps", "deployments"),
        "Job" => ("batch", "jobs"),
        other => panic!("no resource for {other} in this test"),
    };
    let ar = ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(group, "v1", kind),
        plural,
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

async fn create(client: &kube::Client, object: &Value, dry_run: bool) -> Value {
    let ns = object["metadata"]["namespace"].as_str().expect("namespace");
    let kind = object["kind"].as_str().expect("kind");
    let obj: DynamicObject = serde_json::from_value(object.clone()).expect("object");
    let pp = PostParams {
        dry_run,
        ..Default::default()
    };
    let created = api(client, ns, kind)
        .create(&pp, &obj)
        .await
        .unwrap_or_else(|e| panic!("creating {kind} {}: {e}", object["metadata"]["name"]));
    serde_json::to_value(created).expect("json")
}

fn run_meshgate(args: &[&std::ffi::OsStr]) -> String {
    let out = std::process::Command::new(meshgate_bin())
        .args(args)
        .output()
        .expect("meshgate runs");
    assert!(
        out.status.success(),
        "meshgate {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn workload_objects_through_the_webhook_and_render_agree() {
    let cp = control_plane(false).await;
    serve_policies(&cp).await;
    let client = cp.client().await.expect("client");
    let ns = cp.namespace("workloads", &[]).await.expect("namespace");
    let dir = tempfile::tempdir().expect("tempdir");
    let kyverno_file = dir.path().join("kyverno.yaml");
    std::fs::write(&kyverno_file, kyverno_policy(&ns)).expect("write");

    // `meshgate import kyverno`: every rule converts, each with the object target.
    let imported = run_meshgate(&[
        "import".as_ref(),
        "kyverno".as_ref(),
        kyverno_file.as_os_str(),
    ]);
    let imported = meshgate_api::yaml::documents(&imported).expect("import prints YAML");
    assert_eq!(imported.len(), 3, "{imported:#?}");
    for p in &imported {
        assert_eq!(p["spec"]["target"], "Object", "{p:#}");
    }
    let policies: Api<MutationPolicy> = Api::all(client.clone());
    let mut policy_docs = imported.clone();
    policy_docs.push(template_policy(&ns));
    for p in &policy_docs {
        let p: MutationPolicy = serde_json::from_value(p.clone()).expect("policy");
        policies
            .create(&PostParams::default(), &p)
            .await
            .expect("policy created");
    }

    let objects = [
        deployment(&ns, "scratch", json!({"example.com/scratch": "on"})),
        deployment(&ns, "plain", json!({"example.com/other": "x"})),
        job(&ns, "batch", None),
        job(&ns, "batch-kept", Some(60)),
    ];
    // Wait until the webhook serves every policy (registration and caches are asynchronous).
    let probe = |name: &str, o: &Value| {
        let mut p = o.clone();
        p["metadata"]["name"] = json!(name);
        p
    };
    let mut n = 0;
    wait_for(
        "the webhook to apply the policies",
        Duration::from_secs(60),
        || {
            n += 1;
            let (d, j) = (
                probe(&format!("probe-d-{n}"), &objects[0]),
                probe(&format!("probe-j-{n}"), &objects[2]),
            );
            let client = client.clone();
            async move {
                let d = create(&client, &d, true).await;
                let j = create(&client, &j, true).await;
                d.pointer("/spec/template/spec/volumes").is_some()
                    && d.pointer("/spec/template/metadata/annotations/example.com~1pod-annotation")
                        .is_some()
                    && d.pointer("/metadata/annotations/example.com~1owner")
                        .is_some()
                    && j.pointer("/spec/ttlSecondsAfterFinished").is_some()
            }
        },
    )
    .await;

    let mut stored = Vec::new();
    for o in &objects {
        stored.push(create(&client, o, false).await);
    }

    // What the API server stored through the webhook, named.
    let scratch = observed(&stored[0]);
    assert_eq!(
        scratch["volumes"],
        json!([{"name": "scratch", "emptyDir": {"medium": "Memory"}}])
    );
    let mount = json!([{"name": "scratch", "mountPath": "/scratch"}]);
    assert_eq!(
        scratch["mounts"],
        json!([["app", mount], ["side", mount]]),
        "every container gets the mount"
    );
    assert_eq!(scratch["annotations"]["example.com/owner"], "team-scratch");
    assert_eq!(
        scratch["template-annotations"],
        json!({"example.com/scratch": "on", "example.com/pod-annotation": "yes"}),
        "the default target writes the template; the object target does not"
    );
    let plain = observed(&stored[1]);
    assert_eq!(
        plain["volumes"],
        Value::Null,
        "the precondition does not hold"
    );
    assert_eq!(plain["annotations"]["example.com/owner"], "team-plain");
    assert_eq!(observed(&stored[2])["ttl"], 300);
    assert_eq!(
        observed(&stored[3])["ttl"],
        60,
        "+(key) keeps the Job's own"
    );
    assert_eq!(observed(&stored[2])["annotations"], Value::Null);

    // `meshgate render` of the Kyverno policy itself (converted as `import` does) and the
    // template policy, on the same objects, prints what the API server stored.
    let policy_file = dir.path().join("template.yaml");
    std::fs::write(
        &policy_file,
        meshgate_api::yaml::to_string(&template_policy(&ns)).expect("yaml"),
    )
    .expect("write");
    let objects_file = dir.path().join("objects.yaml");
    let text: Vec<String> = objects
        .iter()
        .map(|o| meshgate_api::yaml::to_string(o).expect("yaml"))
        .collect();
    std::fs::write(&objects_file, text.join("---\n")).expect("write");
    let rendered = run_meshgate(&[
        "render".as_ref(),
        "-f".as_ref(),
        objects_file.as_os_str(),
        "--policy".as_ref(),
        kyverno_file.as_os_str(),
        "--policy".as_ref(),
        policy_file.as_os_str(),
    ]);
    let rendered = meshgate_api::yaml::documents(&rendered).expect("render prints YAML");
    assert_eq!(rendered.len(), objects.len());
    for (o, s) in rendered.iter().zip(&stored) {
        assert_eq!(
            observed(o),
            observed(s),
            "{}: render and the webhook agree",
            o["metadata"]["name"]
        );
    }
}

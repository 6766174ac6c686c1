//! `meshgate render`, offline: multi-document YAML in and out, errors that name the place.
//!
//! Run: `cargo test --workspace --test render`.

use std::collections::BTreeMap;
use std::path::PathBuf;

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, text).expect("write fixture");
    p
}

const MANIFESTS: &str = "\
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: kf}
spec:
  containers: [{name: app, image: app:1}]
---
apiVersion: v1
kind: Service
metadata: {name: svc, namespace: kf}
spec:
  ports: [{port: 80}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: other}
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers: [{name: web, image: web:1}]
";

const POLICY: &str = "\
apiVersion: meshgate.dev/v1alpha1
kind: MutationPolicy
metadata: {name: outbound}
spec:
  match:
    kinds: [Pod]
    namespaces: [kf]
  podTemplates: true
  mutations:
  - annotations:
      values: {traffic.sidecar.istio.io/excludeOutboundIPRanges: 0.0.0.0/0}
";

#[test]
fn multi_document_yaml_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(&dir, "m.yaml", MANIFESTS);
    let p = write(&dir, "p.yaml", POLICY);
    let (out, notes) = meshgate::render::render(
        &[m],
        &[p],
        &BTreeMap::new(),
        None,
        Default::default(),
        false,
    )
    .unwrap();
    assert!(
        notes.partial.is_empty() && notes.notes.is_empty(),
        "{notes:?}"
    );
    let input = meshgate::render::parse_documents("m.yaml", MANIFESTS).unwrap();
    let output = meshgate::render::parse_documents("out", &out).unwrap();
    assert_eq!(output.len(), 3, "one document out per document in");
    // The selected pod is mutated, the Service and the other namespace's Deployment are not.
    assert_eq!(
        output[0]["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeOutboundIPRanges"],
        "0.0.0.0/0"
    );
    assert_eq!(output[1], input[1]);
    assert_eq!(output[2], input[2]);
    // Rendering the output again changes nothing.
    let again = write(&dir, "again.yaml", &out);
    let p = dir.path().join("p.yaml");
    let (out2, _) = meshgate::render::render(
        &[again],
        &[p],
        &BTreeMap::new(),
        None,
        Default::default(),
        false,
    )
    .unwrap();
    assert_eq!(out2, out);
}

#[test]
fn bad_input_names_the_file_document_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(
        &dir,
        "m.yaml",
        "apiVersion: v1\nkind: Pod\n---\n- [unclosed\n",
    );
    let err = meshgate::render::read_documents(&m)
        .unwrap_err()
        .to_string();
    assert!(err.contains("m.yaml: document 1:"), "{err}");

    let bad = POLICY.replace("kinds: [Pod]", "kinds: Pod");
    let p = write(&dir, "bad.yaml", &bad);
    let err = meshgate::render::read_policies(&p).unwrap_err().to_string();
    assert!(
        err.contains("bad.yaml: document 0:") && err.contains("spec.match.kinds"),
        "{err}"
    );

    let p = write(&dir, "kind.yaml", "apiVersion: v1\nkind: ConfigMap\n");
    let err = meshgate::render::read_policies(&p).unwrap_err().to_string();
    assert!(
        err.contains("kind.yaml: document 0:") && err.contains("ConfigMap"),
        "{err}"
    );
}

/// A Kyverno policy with one rule meshgate converts and one it cannot (a variable).
const HALF_CONVERTIBLE: &str = "\
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {name: half}
spec:
  rules:
  - name: label
    match: {any: [{resources: {kinds: [Pod]}}]}
    mutate:
      patchStrategicMerge:
        metadata: {labels: {team: mesh}}
  - name: copy-name
    match: {any: [{resources: {kinds: [Pod]}}]}
    context:
    - name: settings
      apiCall: {service: {url: \"https://settings.platform.svc/name\"}, jmesPath: data}
    mutate:
      patchStrategicMerge:
        metadata: {labels: {copied: \"{{ settings.data.name }}\"}}
  - name: check
    match: {any: [{resources: {kinds: [Pod]}}]}
    validate: {message: x, pattern: {metadata: {name: \"?*\"}}}
";

fn meshgate(args: &[&std::ffi::OsStr]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_meshgate"))
        .args(args)
        .output()
        .expect("meshgate runs")
}

/// A half-applied policy is an error: `render` and `import` exit non-zero, print nothing on
/// stdout and name what cannot be applied; `--allow-partial` prints the rest, with what was left
/// out as warnings. A non-mutate rule is a note, not a failure.
#[test]
fn half_applied_policies_are_errors_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(&dir, "m.yaml", MANIFESTS);
    let k = write(&dir, "half.yaml", HALF_CONVERTIBLE);
    let render_args = |extra: &[&str]| {
        let mut a: Vec<std::ffi::OsString> = vec![
            "render".into(),
            "-f".into(),
            m.clone().into_os_string(),
            "--policy".into(),
            k.clone().into_os_string(),
        ];
        a.extend(extra.iter().map(|s| (*s).into()));
        a
    };
    for (what, args) in [
        ("render", render_args(&[])),
        (
            "import",
            vec![
                "import".into(),
                "kyverno".into(),
                k.clone().into_os_string(),
            ],
        ),
    ] {
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let out = meshgate(&refs);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: exit {}", out.status);
        assert!(
            out.stdout.is_empty(),
            "{what}: printed {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            stderr.contains("error: not applied: ")
                && stderr.contains("half.yaml: document 0: spec.rules[1]")
                && stderr.contains("--allow-partial"),
            "{what}: {stderr}"
        );
        assert!(
            stderr.contains("note: ") && stderr.contains("validate rule ignored"),
            "{what}: {stderr}"
        );

        let mut allowed = refs.clone();
        allowed.push(std::ffi::OsStr::new("--allow-partial"));
        let out = meshgate(&allowed);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{what} --allow-partial: {stderr}");
        assert!(
            stderr.contains("warning: not applied: "),
            "{what}: {stderr}"
        );
        let docs = meshgate::render::parse_documents("out", &String::from_utf8_lossy(&out.stdout))
            .unwrap();
        assert!(!docs.is_empty(), "{what}: printed the rest");
    }
    let out = meshgate(
        &render_args(&["--allow-partial"])
            .iter()
            .map(|a| a.as_os_str())
            .collect::<Vec<_>>(),
    );
    let docs =
        meshgate::render::parse_documents("out", &String::from_utf8_lossy(&out.stdout)).unwrap();
    assert_eq!(
        docs[0]["metadata"]["labels"]["team"], "mesh",
        "the convertible rule applied"
    );
    assert!(docs[0]["metadata"]["labels"].get("copied").is_none());
}

/// A policy that fails on a document (a JSON patch replacing a path the object lacks) is named
/// with the document; the other policies' result is printed only with `--allow-partial`.
#[test]
fn a_policy_failing_on_a_document_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(&dir, "m.yaml", MANIFESTS);
    let p = write(&dir, "p.yaml", POLICY);
    let bad = write(
        &dir,
        "bad.yaml",
        "apiVersion: meshgate.dev/v1alpha1\nkind: MutationPolicy\nmetadata: {name: bad}\nspec:\n  match: {kinds: [Pod]}\n  mutations:\n  - jsonPatch: [{op: replace, path: /spec/hostname, value: x}]\n",
    );
    let args = |extra: Option<&'static str>| {
        let mut a: Vec<&std::ffi::OsStr> = vec![
            "render".as_ref(),
            "-f".as_ref(),
            m.as_os_str(),
            "--policy".as_ref(),
            p.as_os_str(),
            "--policy".as_ref(),
            bad.as_os_str(),
        ];
        a.extend(extra.map(std::ffi::OsStr::new));
        a
    };
    let out = meshgate(&args(None));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("m.yaml: document 0: policy bad: spec.mutations[0].jsonPatch[0]")
            && stderr.contains("(policy from ")
            && stderr.contains("bad.yaml: document 0)"),
        "{stderr}"
    );
    let out = meshgate(&args(Some("--allow-partial")));
    assert!(out.status.success());
    let docs =
        meshgate::render::parse_documents("out", &String::from_utf8_lossy(&out.stdout)).unwrap();
    assert_eq!(
        docs[0]["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeOutboundIPRanges"],
        "0.0.0.0/0",
        "the other policy applied"
    );
}

/// `render --policy` takes NamespacedMutationPolicies confined to their namespace, and refuses
/// one that reaches out of it, naming the field.
#[test]
fn namespaced_policies_render_in_their_namespace_only() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(&dir, "m.yaml", MANIFESTS);
    let p = write(
        &dir,
        "ns.yaml",
        "apiVersion: meshgate.dev/v1alpha1\nkind: NamespacedMutationPolicy\nmetadata: {name: t, namespace: other}\nspec:\n  match: {kinds: [Pod, Service]}\n  podTemplates: true\n  mutations: [{labels: {values: {tenant: other}}}]\n",
    );
    let (out, report) = meshgate::render::render(
        std::slice::from_ref(&m),
        &[p],
        &BTreeMap::new(),
        None,
        Default::default(),
        false,
    )
    .unwrap();
    assert!(report.partial.is_empty(), "{report:?}");
    let docs = meshgate::render::parse_documents("out", &out).unwrap();
    assert!(
        docs[0]["metadata"]["labels"].get("tenant").is_none(),
        "the Pod is in kf"
    );
    assert!(
        docs[1]["metadata"].get("labels").is_none(),
        "the Service is in kf"
    );
    assert_eq!(
        docs[2]["spec"]["template"]["metadata"]["labels"]["tenant"], "other",
        "the Deployment in `other` is the tenant's"
    );
    let bad = write(
        &dir,
        "bad.yaml",
        "apiVersion: meshgate.dev/v1alpha1\nkind: NamespacedMutationPolicy\nmetadata: {name: t, namespace: other}\nspec:\n  match: {kinds: [Pod], namespaces: [kf]}\n  mutations: [{labels: {values: {x: \"z\"}}}]\n",
    );
    let err = meshgate::render::read_policies(&bad)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bad.yaml: document 0: ") && err.contains("spec.match.namespaces"),
        "{err}"
    );
}

/// `render --policy` applies MutatingAdmissionPolicy and Kyverno MutatingPolicy documents offline
/// (CEL), before MutationPolicies, as the API server runs admission policies before webhooks.
#[test]
fn admission_policies_and_kyverno_mutating_policies_render_offline() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(&dir, "m.yaml", MANIFESTS);
    let p = write(
        &dir,
        "cel.yaml",
        r#"
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingAdmissionPolicy
metadata: {name: team-label}
spec:
  matchConstraints:
    resourceRules:
    - {apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}
  matchConditions:
  - {name: in-kf, expression: "request.namespace == 'kf'"}
  failurePolicy: Fail
  reinvocationPolicy: Never
  mutations:
  - patchType: ApplyConfiguration
    applyConfiguration:
      expression: "Object{metadata: Object.metadata{labels: {'team': 'mesh'}}}"
---
apiVersion: policies.kyverno.io/v1
kind: MutatingPolicy
metadata: {name: pull-always}
spec:
  matchConstraints:
    resourceRules:
    - {apiGroups: [apps], apiVersions: [v1], operations: [CREATE], resources: [deployments]}
  mutations:
  - patchType: JSONPatch
    jsonPatch:
      expression: "[JSONPatch{op: 'add', path: '/spec/template/spec/containers/0/imagePullPolicy', value: 'Always'}]"
"#,
    );
    let (out, report) = meshgate::render::render(
        &[m],
        &[p],
        &BTreeMap::new(),
        None,
        Default::default(),
        false,
    )
    .expect("renders");
    assert!(report.partial.is_empty(), "{:?}", report.partial);
    let docs = meshgate_api::yaml::documents(&out).expect("yaml");
    assert_eq!(docs[0]["metadata"]["labels"]["team"], "mesh");
    assert!(
        docs[1]["metadata"].get("labels").is_none(),
        "a Service: not matched"
    );
    assert_eq!(
        docs[2]["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"],
        "Always"
    );
}

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
    assert!(notes.is_empty(), "{notes:?}");
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

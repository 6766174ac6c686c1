//! `meshgate check` on the real API server, after `install --apply`: the certificate the
//! controller would create, checked against the caBundle the API server uses; a missing agent
//! DaemonSet, a wrong caBundle and an expired certificate each fail with their hint and make the
//! command exit non-zero; once the agents exist and the certificate is good, those checks pass.
//! (Every check passing, components included, is asserted on a real node: `real_node`.)
//!
//! Run: `cargo test -p meshgate --test check`.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

const NS: &str = "meshgate-system";

/// Runs `meshgate check -o json`; returns success and the checks by name (failures first).
fn check(cp: &meshgate_testenv::ControlPlane) -> (bool, Vec<Value>) {
    let out = meshgate_on(cp, &["check", "--namespace", NS, "-o", "json"]);
    let checks: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "check output: {e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), checks)
}

fn named<'a>(checks: &'a [Value], name: &str) -> Vec<&'a Value> {
    checks.iter().filter(|c| c["name"] == name).collect()
}

fn all_ok(checks: &[Value], name: &str) -> bool {
    let of = named(checks, name);
    !of.is_empty() && of.iter().all(|c| c["ok"] == true)
}

/// Writes the serving certificate and the caBundle as the controller does.
async fn certificates(client: &kube::Client, serving: &meshgate_pki::CertifiedKey, ca_pem: &str) {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "meshgate-webhook-tls", "namespace": NS},
        "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": serving.cert_pem, "tls.key": serving.key_pem},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(client.clone(), NS)
        .patch(
            "meshgate-webhook-tls",
            &PatchParams::apply("check-test").force(),
            &Patch::Apply(&secret),
        )
        .await
        .expect("secret applied");
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let mwc = mwcs.get("meshgate").await.expect("configuration");
    let ops: Vec<Value> = (0..mwc.webhooks.unwrap_or_default().len())
        .map(|i| {
            json!({"op": "add", "path": format!("/webhooks/{i}/clientConfig/caBundle"),
                   "value": k8s_openapi::ByteString(ca_pem.as_bytes().to_vec())})
        })
        .collect();
    let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops)).expect("patch");
    mwcs.patch(
        "meshgate",
        &PatchParams::default(),
        &Patch::<()>::Json(patch),
    )
    .await
    .expect("caBundle");
}

#[tokio::test]
async fn check_names_each_failure_with_its_hint() {
    let cp = control_plane(false).await;
    let client = cp.client().await.expect("client");
    install_applied(&cp, "istio-ambient", NS);

    // Right after install: no certificate yet (the controller makes it), no agents.
    let (ok, checks) = check(&cp);
    assert!(!ok, "{checks:#?}");
    assert!(all_ok(&checks, "crds"), "{checks:#?}");
    assert!(all_ok(&checks, "rbac"), "{checks:#?}");
    let cert = named(&checks, "webhook-certificate");
    assert_eq!(cert[0]["ok"], false, "{checks:#?}");
    let agents = named(&checks, "agents");
    assert!(
        agents.iter().any(|c| c["ok"] == false
            && c["message"]
                .as_str()
                .is_some_and(|m| m.contains("DaemonSet istio-system/ztunnel missing"))
            && c["hint"]
                .as_str()
                .is_some_and(|h| h.contains("install the mesh's agent"))),
        "{agents:#?}"
    );

    // The controller's certificates: good.
    let ca = meshgate_pki::Ca::new("meshgate-ca", Duration::from_secs(3600)).expect("ca");
    let dns = format!("meshgate-webhook.{NS}.svc");
    let serving = ca
        .issue_server(&[dns.as_str()], Duration::from_secs(3600))
        .expect("serving");
    certificates(&client, &serving, &ca.certificate().cert_pem).await;
    // The agents' DaemonSets.
    let istio: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": "istio-system"}})).expect("ns");
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .patch(
            "istio-system",
            &PatchParams::apply("check-test"),
            &Patch::Apply(&istio),
        )
        .await
        .expect("namespace");
    for name in ["istio-cni-node", "ztunnel"] {
        let ds: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "istio-system"},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "a", "image": "registry.invalid/a:1"}]}}},
        }))
        .expect("ds");
        Api::<DaemonSet>::namespaced(client.clone(), "istio-system")
            .patch(name, &PatchParams::apply("check-test"), &Patch::Apply(&ds))
            .await
            .expect("daemonset");
    }
    let (_, checks) = check(&cp);
    for name in [
        "crds",
        "webhook-configuration",
        "webhook-certificate",
        "agents",
        "rbac",
        "gates",
    ] {
        assert!(all_ok(&checks, name), "{name}: {checks:#?}");
    }
    // Without a running cluster node, the components have no available replica.
    assert!(!all_ok(&checks, "components"), "{checks:#?}");

    // The ambient gate waits for the node proxy, which needs istiod: istiod as Istio's chart
    // has it (tolerating only Istio's taint) would deadlock a node only the gate taints.
    let istiod = |tolerations: Value| -> Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": "istiod", "namespace": "istio-system"},
            "spec": {"selector": {"matchLabels": {"app": "istiod"}},
                     "template": {"metadata": {"labels": {"app": "istiod"}},
                                  "spec": {"tolerations": tolerations,
                                           "containers": [{"name": "discovery", "image": "registry.invalid/d:1"}]}}},
        }))
        .expect("deployment")
    };
    let deployments = Api::<Deployment>::namespaced(client.clone(), "istio-system");
    let apply = |d: Deployment| {
        let deployments = deployments.clone();
        async move {
            deployments
                .patch(
                    "istiod",
                    &PatchParams::apply("check-test").force(),
                    &Patch::Apply(&d),
                )
                .await
                .expect("istiod");
        }
    };
    apply(istiod(
        json!([{"key": "cni.istio.io/not-ready", "operator": "Exists"}]),
    ))
    .await;
    let (ok, checks) = check(&cp);
    assert!(!ok);
    let cp_check = named(&checks, "control-plane");
    assert!(
        cp_check.len() == 1
            && cp_check[0]["ok"] == false
            && cp_check[0]["message"].as_str().is_some_and(|m| {
                m.contains("istio-system/istiod")
                    && m.contains(meshgate_api::names::STARTUP_TAINT_KEY)
            })
            && cp_check[0]["hint"]
                .as_str()
                .is_some_and(|h| h.contains("pilot.tolerations")),
        "{cp_check:#?}"
    );
    apply(istiod(json!([
        {"key": "cni.istio.io/not-ready", "operator": "Exists"},
        {"key": meshgate_api::names::STARTUP_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
    ])))
    .await;
    let (_, checks) = check(&cp);
    assert!(all_ok(&checks, "control-plane"), "{checks:#?}");

    // A caBundle of another CA.
    let other = meshgate_pki::Ca::new("other", Duration::from_secs(3600)).expect("ca");
    certificates(&client, &serving, &other.certificate().cert_pem).await;
    let (ok, checks) = check(&cp);
    assert!(!ok);
    let cert = named(&checks, "webhook-certificate");
    assert_eq!(cert[0]["ok"], false, "{cert:#?}");
    assert!(
        cert[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not signed by any CA in the caBundle"))
            && cert[0]["hint"]
                .as_str()
                .is_some_and(|h| h.contains("caBundle")),
        "{cert:#?}"
    );

    // An expired certificate.
    let short = ca
        .issue_server(&[dns.as_str()], Duration::from_secs(1))
        .expect("serving");
    certificates(&client, &short, &ca.certificate().cert_pem).await;
    wait_for(
        "the certificate to expire",
        Duration::from_secs(10),
        || async {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64 > short.not_after_unix)
                .unwrap_or(false)
        },
    )
    .await;
    let (ok, checks) = check(&cp);
    assert!(!ok);
    let cert = named(&checks, "webhook-certificate");
    assert!(
        cert[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("expired"))
            && cert[0]["hint"]
                .as_str()
                .is_some_and(|h| h.contains("renews")),
        "{cert:#?}"
    );
}

//! Certificate management on the real API server: the controller creates the webhook's CA and
//! serving certificate, rotates them before expiry, and keeps the webhook configuration's
//! caBundle current.
//!
//! Run: `cargo test --workspace --test certs`.

mod common;

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use meshgate_controller::certs::{CertOutcome, CertSettings, reconcile_once};
use serde_json::json;

fn text(s: &Secret, key: &str) -> String {
    String::from_utf8(s.data.as_ref().expect("data")[key].0.clone()).expect("utf-8")
}

#[tokio::test]
async fn creates_rotates_and_keeps_the_bundle_current() {
    let cp = common::control_plane(false).await;
    let client = cp.client().await.unwrap();
    let ns = cp.namespace("certs", &[]).await.unwrap();
    let name = format!("meshgate-{ns}");
    let mwc = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "gate.meshgate.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Ignore",
            "clientConfig": {"service": {"namespace": ns, "name": "meshgate-webhook", "path": "/mutate/pod-gate"},
                             "caBundle": k8s_openapi::ByteString(b"stale".to_vec())},
            "namespaceSelector": {"matchLabels": {"never": "selected"}},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
        }],
    });
    common::register(&client, &mwc).await;
    let mut s = CertSettings::new(&ns);
    s.webhook_configuration = name.clone();

    // First pass: everything is created and the bundle is the new CA.
    let out = reconcile_once(&client, &s).await.unwrap();
    assert_eq!(
        out,
        CertOutcome {
            ca_rotated: true,
            cert_rotated: true,
            bundle_updated: true
        }
    );
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let ca = text(&secrets.get("meshgate-ca").await.unwrap(), "ca.crt");
    let tls = secrets.get("meshgate-webhook-tls").await.unwrap();
    assert_eq!(text(&tls, "ca.crt"), ca);
    let not_after = meshgate_pki::not_after_unix(&text(&tls, "tls.crt")).unwrap();
    assert!(
        not_after > meshgate_controller::now() + 80 * 86_400,
        "90-day serving certificate"
    );
    let bundle = |m: &MutatingWebhookConfiguration| {
        String::from_utf8(
            m.webhooks.as_ref().unwrap()[0]
                .client_config
                .ca_bundle
                .clone()
                .unwrap()
                .0,
        )
        .unwrap()
    };
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    assert_eq!(bundle(&mwcs.get(&name).await.unwrap()), ca);

    // Nothing to do on the next pass.
    assert_eq!(
        reconcile_once(&client, &s).await.unwrap(),
        CertOutcome::default()
    );

    // Serving certificate inside the renewal window: renewed, same CA, bundle unchanged.
    let mut short = s.clone();
    short.renew_before = Duration::from_secs(100 * 86_400);
    let out = reconcile_once(&client, &short).await.unwrap();
    assert_eq!(
        out,
        CertOutcome {
            ca_rotated: false,
            cert_rotated: true,
            bundle_updated: false
        }
    );
    assert_ne!(
        text(
            &secrets.get("meshgate-webhook-tls").await.unwrap(),
            "tls.crt"
        ),
        text(&tls, "tls.crt")
    );

    // CA inside its renewal window: a new CA, a new certificate from it, and a bundle that still
    // trusts the old CA while it is valid.
    let mut ca_short = s.clone();
    ca_short.renew_before = Duration::from_secs(4 * 365 * 86_400);
    ca_short.cert_validity = Duration::from_secs(5 * 365 * 86_400);
    let out = reconcile_once(&client, &ca_short).await.unwrap();
    assert!(
        out.ca_rotated && out.cert_rotated && out.bundle_updated,
        "{out:?}"
    );
    let new_ca = text(&secrets.get("meshgate-ca").await.unwrap(), "ca.crt");
    assert_ne!(new_ca, ca);
    assert_eq!(
        text(
            &secrets.get("meshgate-webhook-tls").await.unwrap(),
            "ca.crt"
        ),
        new_ca
    );
    let b = bundle(&mwcs.get(&name).await.unwrap());
    assert!(
        b.starts_with(&new_ca) && b.contains(&ca),
        "bundle has the new and the old CA"
    );
    mwcs.delete(&name, &Default::default()).await.unwrap();
}

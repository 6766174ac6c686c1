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
            bundle_updated: true,
            cert_deferred: false,
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
            bundle_updated: false,
            cert_deferred: false,
        }
    );
    assert_ne!(
        text(
            &secrets.get("meshgate-webhook-tls").await.unwrap(),
            "tls.crt"
        ),
        text(&tls, "tls.crt")
    );

    // CA inside its renewal window (the new one, valid 10 years, is not): first the new CA
    // joins the bundle next to the old one while the webhook keeps serving its certificate from
    // the old CA; only the next pass, which finds the new CA trusted, issues a certificate from
    // it; the old CA stays in the bundle after that.
    let served_before = text(
        &secrets.get("meshgate-webhook-tls").await.unwrap(),
        "tls.crt",
    );
    let mut ca_short = s.clone();
    ca_short.renew_before = Duration::from_secs(4 * 365 * 86_400);
    ca_short.ca_validity = Duration::from_secs(10 * 365 * 86_400);
    ca_short.cert_validity = Duration::from_secs(5 * 365 * 86_400);
    let out = reconcile_once(&client, &ca_short).await.unwrap();
    assert_eq!(
        out,
        CertOutcome {
            ca_rotated: true,
            cert_rotated: false,
            bundle_updated: true,
            cert_deferred: true,
        },
        "a new CA: the bundle first, the serving certificate later"
    );
    let new_ca = text(&secrets.get("meshgate-ca").await.unwrap(), "ca.crt");
    assert_ne!(new_ca, ca);
    let tls_now = secrets.get("meshgate-webhook-tls").await.unwrap();
    assert_eq!(
        text(&tls_now, "tls.crt"),
        served_before,
        "still the old certificate"
    );
    assert_eq!(text(&tls_now, "ca.crt"), ca);
    let both = |b: &str| b.starts_with(&new_ca) && b.contains(&ca);
    let b = bundle(&mwcs.get(&name).await.unwrap());
    assert!(both(&b), "bundle has the new and the old CA");

    let out = reconcile_once(&client, &ca_short).await.unwrap();
    assert_eq!(
        out,
        CertOutcome {
            ca_rotated: false,
            cert_rotated: true,
            bundle_updated: false,
            cert_deferred: false,
        },
        "the new CA trusted: its serving certificate"
    );
    assert_eq!(
        text(
            &secrets.get("meshgate-webhook-tls").await.unwrap(),
            "ca.crt"
        ),
        new_ca
    );
    // The next passes change nothing, and the old CA stays trusted (its validity is the overlap).
    assert_eq!(
        reconcile_once(&client, &ca_short).await.unwrap(),
        CertOutcome::default()
    );
    assert!(both(&bundle(&mwcs.get(&name).await.unwrap())));
    mwcs.delete(&name, &Default::default()).await.unwrap();
}

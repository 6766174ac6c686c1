//! The webhook's certificates: a CA and a serving certificate kept in Secrets, rotated before
//! they expire, and the CA bundle of meshgate's webhook configuration kept current.
//!
//! * Secret `meshgate-ca` (`ca.crt`, `ca.key`, and `previous.crt`, the CA before the last
//!   rotation): read by the controller only.
//! * Secret `meshgate-webhook-tls` (`tls.crt`, `tls.key`, `ca.crt`): mounted by the webhook,
//!   which re-reads it when the kubelet updates the volume.
//! * `caBundle` of every webhook in the `MutatingWebhookConfiguration`: the current CA, plus the
//!   previous one while it is still valid, so API servers trust the webhook across a CA rotation.
//!
//! A certificate is renewed when less than `renew_before` of its validity is left. A CA rotation
//! goes in this order, so that API servers always trust the certificate the webhook serves: the
//! new CA joins the bundle next to the old one; a serving certificate from the new CA is issued
//! only on a later pass (10 s later), once the bundle read back already trusted it; the old CA
//! stays in the bundle while it is valid (the CA is renewed 30 days before it expires, so
//! for 30 days by default), long after the kubelet has given the webhook its new certificate.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::leader::Leader;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use meshgate_pki::Ca;
use serde_json::json;

/// The field manager of the caBundle writes.
pub const CA_BUNDLE_MANAGER: &str = "meshgate-controller-certs";

/// Settings of the certificate loop.
#[derive(Clone, Debug)]
pub struct CertSettings {
    pub namespace: String,
    pub ca_secret: String,
    pub tls_secret: String,
    /// The webhook Service (the certificate's DNS names).
    pub service: String,
    pub webhook_configuration: String,
    pub ca_validity: Duration,
    pub cert_validity: Duration,
    pub renew_before: Duration,
    pub interval: Duration,
}

impl CertSettings {
    pub fn new(namespace: &str) -> Self {
        Self {
            namespace: namespace.into(),
            ca_secret: "meshgate-ca".into(),
            tls_secret: "meshgate-webhook-tls".into(),
            service: "meshgate-webhook".into(),
            webhook_configuration: "meshgate".into(),
            ca_validity: Duration::from_secs(3 * 365 * 24 * 3600),
            cert_validity: Duration::from_secs(90 * 24 * 3600),
            renew_before: Duration::from_secs(30 * 24 * 3600),
            interval: Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    #[error("certificates: {0}")]
    Pki(#[from] meshgate_pki::PkiError),
}

/// What one pass changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CertOutcome {
    pub ca_rotated: bool,
    pub cert_rotated: bool,
    pub bundle_updated: bool,
    /// A serving certificate from a new CA waits for a later pass: the webhook configuration's
    /// bundle did not trust that CA when this pass began.
    pub cert_deferred: bool,
}

/// How long after a pass that deferred the serving certificate the next pass runs.
pub const TRUST_DELAY: Duration = Duration::from_secs(10);

/// Whether a certificate valid until `not_after` must be renewed at `now`.
fn needs_renewal(not_after: i64, now: i64, renew_before: Duration) -> bool {
    not_after - now < i64::try_from(renew_before.as_secs()).unwrap_or(i64::MAX)
}

fn text(secret: Option<&Secret>, key: &str) -> Option<String> {
    let data = secret?.data.as_ref()?;
    String::from_utf8(data.get(key)?.0.clone()).ok()
}

fn secret(name: &str, namespace: &str, type_: &str, data: BTreeMap<String, String>) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(
                meshgate_api::names::MANAGED_BY.into(),
                "meshgate".into(),
            )])),
            ..Default::default()
        },
        type_: Some(type_.into()),
        data: Some(
            data.into_iter()
                .map(|(k, v)| (k, ByteString(v.into_bytes())))
                .collect(),
        ),
        ..Default::default()
    }
}

/// One pass: create or renew what needs it, and bring the CA bundle up to date.
pub async fn reconcile_once(
    client: &kube::Client,
    s: &CertSettings,
) -> Result<CertOutcome, CertError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &s.namespace);
    let pp = PatchParams::apply(meshgate_api::names::FIELD_MANAGER).force();
    let now = crate::now();
    let mut out = CertOutcome::default();

    // The CA.
    let ca_secret = secrets.get_opt(&s.ca_secret).await?;
    let old_ca_pem = text(ca_secret.as_ref(), "ca.crt");
    let mut previous_pem = text(ca_secret.as_ref(), "previous.crt");
    let current = match (old_ca_pem.clone(), text(ca_secret.as_ref(), "ca.key")) {
        (Some(cert), Some(key)) => match meshgate_pki::not_after_unix(&cert) {
            Ok(not_after) if !needs_renewal(not_after, now, s.renew_before) => {
                Ca::from_pem(&cert, &key, not_after).ok()
            }
            _ => None,
        },
        _ => None,
    };
    let ca = match current {
        Some(ca) => ca,
        None => {
            let ca = Ca::new("meshgate-ca", s.ca_validity)?;
            let mut data = BTreeMap::from([
                ("ca.crt".to_owned(), ca.certificate().cert_pem.clone()),
                ("ca.key".to_owned(), ca.certificate().key_pem.clone()),
            ]);
            // The CA being replaced stays trusted while it is valid.
            previous_pem = old_ca_pem
                .clone()
                .filter(|old| meshgate_pki::not_after_unix(old).is_ok_and(|t| t > now));
            if let Some(previous) = &previous_pem {
                data.insert("previous.crt".to_owned(), previous.clone());
            }
            secrets
                .patch(
                    &s.ca_secret,
                    &pp,
                    &Patch::Apply(secret(&s.ca_secret, &s.namespace, "Opaque", data)),
                )
                .await?;
            tracing::info!(secret = %s.ca_secret, "webhook CA created");
            out.ca_rotated = true;
            ca
        }
    };
    let ca_pem = ca.certificate().cert_pem.clone();

    // The bundle: the current CA, and the previous one while it is valid.
    let mut bundle = ca_pem.clone();
    if let Some(old) = previous_pem.filter(|o| *o != ca_pem)
        && meshgate_pki::not_after_unix(&old).is_ok_and(|t| t > now)
    {
        bundle.push_str(&old);
    }
    // Whether every API server already trusts the current CA.
    let trusted;
    (trusted, out.bundle_updated) = update_bundle(client, s, &ca_pem, &bundle).await?;

    // The serving certificate: renewed when close to expiry or issued by another CA.
    let tls = secrets.get_opt(&s.tls_secret).await?;
    let served_ca = text(tls.as_ref(), "ca.crt");
    let cert_ok = text(tls.as_ref(), "tls.crt")
        .and_then(|c| meshgate_pki::not_after_unix(&c).ok())
        .is_some_and(|not_after| !needs_renewal(not_after, now, s.renew_before))
        && served_ca.as_deref() == Some(ca_pem.as_str());
    // A serving certificate still valid from a CA the bundle trusts keeps being served until
    // the API servers trust the new CA.
    let cert_in_use = text(tls.as_ref(), "tls.crt")
        .and_then(|c| meshgate_pki::not_after_unix(&c).ok())
        .is_some_and(|not_after| not_after > now)
        && served_ca.is_some_and(|c| bundle.contains(c.as_str()));
    if !cert_ok && !trusted && cert_in_use {
        tracing::info!(secret = %s.tls_secret, "a new webhook CA is in the caBundle; its serving certificate follows once the API servers trust it");
        out.cert_deferred = true;
    } else if !cert_ok {
        let names = [
            format!("{}.{}.svc", s.service, s.namespace),
            format!("{}.{}", s.service, s.namespace),
            s.service.clone(),
        ];
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let serving = ca.issue_server(&names, s.cert_validity)?;
        let data = BTreeMap::from([
            ("tls.crt".to_owned(), serving.cert_pem),
            ("tls.key".to_owned(), serving.key_pem),
            ("ca.crt".to_owned(), ca_pem.clone()),
        ]);
        secrets
            .patch(
                &s.tls_secret,
                &pp,
                &Patch::Apply(secret(
                    &s.tls_secret,
                    &s.namespace,
                    "kubernetes.io/tls",
                    data,
                )),
            )
            .await?;
        tracing::info!(secret = %s.tls_secret, "webhook serving certificate issued");
        out.cert_rotated = true;
    }

    Ok(out)
}

/// Writes `bundle` into every webhook of the configuration whose caBundle differs. Returns
/// whether every webhook already trusted `ca_pem` before, and whether anything was written.
async fn update_bundle(
    client: &kube::Client,
    s: &CertSettings,
    ca_pem: &str,
    bundle: &str,
) -> Result<(bool, bool), CertError> {
    // No configuration: nobody to wait for.
    let mut trusted = true;
    let mut updated = false;
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    if let Some(mwc) = mwcs.get_opt(&s.webhook_configuration).await? {
        let hooks = mwc.webhooks.unwrap_or_default();
        trusted = hooks.iter().all(|h| {
            h.client_config
                .ca_bundle
                .as_ref()
                .and_then(|b| std::str::from_utf8(&b.0).ok())
                .is_some_and(|b| b.contains(ca_pem))
        });
        let stale: Vec<usize> = hooks
            .iter()
            .enumerate()
            .filter(|(_, h)| {
                h.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice())
                    != Some(bundle.as_bytes())
            })
            .map(|(i, _)| i)
            .collect();
        if !stale.is_empty() {
            // A JSON patch per stale entry, guarded by the entry's name (the list may change).
            let mut ops = Vec::new();
            for i in stale {
                ops.push(json!({"op": "test", "path": format!("/webhooks/{i}/name"), "value": hooks[i].name}));
                ops.push(
                    json!({"op": "replace", "path": format!("/webhooks/{i}/clientConfig/caBundle"),
                                "value": ByteString(bundle.as_bytes().to_vec())}),
                );
            }
            let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops))
                .map_err(|e| CertError::Pki(meshgate_pki::PkiError::Parse(e.to_string())))?;
            // Under the controller's own field manager: `install`'s server-side apply (manager
            // `meshgate`, no caBundle in its manifests) never takes the bundle away.
            let pp = PatchParams {
                field_manager: Some(CA_BUNDLE_MANAGER.to_owned()),
                ..PatchParams::default()
            };
            mwcs.patch(&s.webhook_configuration, &pp, &Patch::<()>::Json(patch))
                .await?;
            tracing::info!(configuration = %s.webhook_configuration, "caBundle updated");
            updated = true;
        }
    }
    Ok((trusted, updated))
}

/// Runs [`reconcile_once`] while this replica leads: on becoming leader, every `interval`, 5 s
/// after a failed pass, and [`TRUST_DELAY`] after a pass that deferred the serving certificate.
pub async fn run(client: kube::Client, mut leader: Leader, s: CertSettings) {
    let mut tick = tokio::time::interval(s.interval);
    let mut failed = false;
    let mut deferred = false;
    loop {
        // A pass every interval, as soon as this replica becomes the leader (on a first install
        // the webhook waits for the certificates the leader creates), and 5 s after a failure.
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::time::sleep(Duration::from_secs(5)), if failed => {}
            _ = tokio::time::sleep(TRUST_DELAY), if deferred => {}
            changed = leader.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
        if !leader.is_leader() {
            continue;
        }
        (failed, deferred) = match reconcile_once(&client, &s).await {
            Ok(out) => (false, out.cert_deferred),
            Err(e) => {
                tracing::warn!(error = %e, "certificate pass failed; retrying in 5 s");
                (true, false)
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_window() {
        let day = Duration::from_secs(86_400);
        assert!(needs_renewal(1000 + 29 * 86_400, 1000, 30 * day));
        assert!(!needs_renewal(1000 + 31 * 86_400, 1000, 30 * day));
        assert!(needs_renewal(500, 1000, day), "expired");
    }
}

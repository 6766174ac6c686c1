//! A small certificate authority.
//!
//! meshgate issues its webhook's serving certificate from a CA it generates itself (the CA's
//! certificate becomes the webhook configurations' `caBundle`); the test control plane uses the
//! same code for the API server's serving certificate and the admin client certificate.
//! Keys are ECDSA P-256.

use std::net::IpAddr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("invalid subject alternative name {0:?}")]
    San(String),
    #[error("not a PEM certificate: {0}")]
    Parse(String),
}

/// A certificate and its private key, PEM encoded.
#[derive(Clone, Debug)]
pub struct CertifiedKey {
    pub cert_pem: String,
    pub key_pem: String,
    /// Seconds since the Unix epoch after which the certificate is no longer valid.
    pub not_after_unix: i64,
}

/// A certificate authority that can issue server and client certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert: CertifiedKey,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

fn validity(params: &mut CertificateParams, valid_for: Duration) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    // Backdate a little so peers with a slightly slow clock accept the certificate.
    let not_before = now.saturating_sub(Duration::from_secs(300));
    let not_after = now + valid_for;
    params.not_before = rcgen::date_time_ymd(1970, 1, 1) + not_before;
    params.not_after = rcgen::date_time_ymd(1970, 1, 1) + not_after;
    i64::try_from(not_after.as_secs()).unwrap_or(i64::MAX)
}

impl Ca {
    /// A new self-signed CA named `common_name`.
    pub fn new(common_name: &str, valid_for: Duration) -> Result<Self, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let not_after_unix = validity(&mut params, valid_for);
        let cert = params.self_signed(&key)?;
        let cert = CertifiedKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            not_after_unix,
        };
        Ok(Self {
            issuer: Issuer::new(params, key),
            cert,
        })
    }

    /// Loads a CA from its PEM certificate and key (e.g. from a Secret).
    pub fn from_pem(cert_pem: &str, key_pem: &str, not_after_unix: i64) -> Result<Self, PkiError> {
        let key = KeyPair::from_pem(key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(Self {
            issuer,
            cert: CertifiedKey {
                cert_pem: cert_pem.to_owned(),
                key_pem: key_pem.to_owned(),
                not_after_unix,
            },
        })
    }

    /// The CA's own certificate and key.
    pub fn certificate(&self) -> &CertifiedKey {
        &self.cert
    }

    /// A TLS server certificate for these DNS names and IP addresses.
    pub fn issue_server(
        &self,
        names: &[&str],
        valid_for: Duration,
    ) -> Result<CertifiedKey, PkiError> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("meshgate"),
        );
        params.distinguished_name = dn;
        for name in names {
            let san = match name.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) if !is_dns_name(name) => return Err(PkiError::San((*name).to_owned())),
                Err(_) => SanType::DnsName(
                    (*name)
                        .try_into()
                        .map_err(|_| PkiError::San((*name).to_owned()))?,
                ),
            };
            params.subject_alt_names.push(san);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params, valid_for)
    }

    /// A TLS client certificate: Kubernetes reads the user from the common name and the groups
    /// from the organizations.
    pub fn issue_client(
        &self,
        user: &str,
        groups: &[&str],
        valid_for: Duration,
    ) -> Result<CertifiedKey, PkiError> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, user);
        for g in groups {
            dn.push(DnType::OrganizationName, *g);
        }
        params.distinguished_name = dn;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params, valid_for)
    }

    fn sign(
        &self,
        mut params: CertificateParams,
        valid_for: Duration,
    ) -> Result<CertifiedKey, PkiError> {
        let key = KeyPair::generate()?;
        let not_after_unix = validity(&mut params, valid_for);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(CertifiedKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            not_after_unix,
        })
    }
}

/// The end of validity (Unix seconds) of the first certificate in a PEM text.
pub fn not_after_unix(cert_pem: &str) -> Result<i64, PkiError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| PkiError::Parse(e.to_string()))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| PkiError::Parse(e.to_string()))?;
    Ok(cert.validity().not_after.timestamp())
}

/// Checks a serving certificate as an API server would before calling a webhook with
/// `ca_bundle_pem`: valid at `now_unix`, signed by a CA of the bundle, and naming `dns_name`.
/// Returns its end of validity; the error says which of these fails.
pub fn verify_serving(
    cert_pem: &str,
    ca_bundle_pem: &str,
    dns_name: &str,
    now_unix: i64,
) -> Result<i64, String> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| format!("the serving certificate is not PEM: {e}"))?;
    let leaf = pem
        .parse_x509()
        .map_err(|e| format!("the serving certificate is not X.509: {e}"))?;
    let validity = leaf.validity();
    let not_after = validity.not_after.timestamp();
    if not_after <= now_unix {
        return Err(format!(
            "the serving certificate expired at {} (unix {not_after})",
            validity.not_after
        ));
    }
    if validity.not_before.timestamp() > now_unix {
        return Err(format!(
            "the serving certificate is not valid before {}",
            validity.not_before
        ));
    }
    let mut signed = false;
    for pem in x509_parser::pem::Pem::iter_from_buffer(ca_bundle_pem.as_bytes()) {
        let Ok(pem) = pem else { continue };
        let Ok(ca) = pem.parse_x509() else { continue };
        if ca.subject() == leaf.issuer() && leaf.verify_signature(Some(ca.public_key())).is_ok() {
            signed = true;
            break;
        }
    }
    if !signed {
        return Err(format!(
            "the serving certificate (issuer {}) is not signed by any CA in the caBundle",
            leaf.issuer()
        ));
    }
    let names: Vec<String> = leaf
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some((*d).to_owned()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    if !names.iter().any(|n| n == dns_name) {
        return Err(format!(
            "the serving certificate names {names:?}, not {dns_name}"
        ));
    }
    Ok(not_after)
}

/// RFC 1123 host names, with an optional leading `*.` wildcard label.
fn is_dns_name(name: &str) -> bool {
    let name = name.strip_prefix("*.").unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// A fresh P-256 key in PKCS#8 PEM (e.g. a service-account signing key).
pub fn generate_key_pem() -> Result<String, PkiError> {
    Ok(KeyPair::generate()?.serialize_pem())
}

/// The public half of a PEM private key, as a PEM `PUBLIC KEY`.
pub fn public_key_pem(key_pem: &str) -> Result<String, PkiError> {
    Ok(KeyPair::from_pem(key_pem)?.public_key_pem())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_certificates_are_checked_as_the_api_server_would() {
        let ca = Ca::new("ca", Duration::from_secs(3600)).unwrap();
        let other = Ca::new("other", Duration::from_secs(3600)).unwrap();
        let cert = ca
            .issue_server(&["svc.ns.svc"], Duration::from_secs(60))
            .unwrap();
        let now = cert.not_after_unix - 30;
        let bundle = &ca.certificate().cert_pem;
        assert_eq!(
            verify_serving(&cert.cert_pem, bundle, "svc.ns.svc", now),
            Ok(cert.not_after_unix)
        );
        let both = format!("{}{}", other.certificate().cert_pem, bundle);
        assert!(verify_serving(&cert.cert_pem, &both, "svc.ns.svc", now).is_ok());
        let e = verify_serving(
            &cert.cert_pem,
            &other.certificate().cert_pem,
            "svc.ns.svc",
            now,
        )
        .unwrap_err();
        assert!(e.contains("not signed by any CA in the caBundle"), "{e}");
        let e = verify_serving(
            &cert.cert_pem,
            bundle,
            "svc.ns.svc",
            cert.not_after_unix + 1,
        )
        .unwrap_err();
        assert!(e.contains("expired"), "{e}");
        let e = verify_serving(&cert.cert_pem, bundle, "other.ns.svc", now).unwrap_err();
        assert!(e.contains("not other.ns.svc"), "{e}");
    }

    #[test]
    fn issues_pem_certificates() {
        let ca = Ca::new("test-ca", Duration::from_secs(3600)).unwrap();
        let server = ca
            .issue_server(
                &["127.0.0.1", "meshgate.meshgate-system.svc"],
                Duration::from_secs(600),
            )
            .unwrap();
        assert!(server.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(server.key_pem.contains("PRIVATE KEY"));
        assert!(server.not_after_unix > ca.certificate().not_after_unix - 3600);
        let again = Ca::from_pem(
            &ca.certificate().cert_pem,
            &ca.certificate().key_pem,
            ca.certificate().not_after_unix,
        )
        .unwrap();
        again
            .issue_client("admin", &["system:masters"], Duration::from_secs(60))
            .unwrap();
        assert!(
            ca.issue_server(&["bad name!"], Duration::from_secs(1))
                .is_err()
        );
        // The validity read back from the PEM is what was issued.
        assert_eq!(
            not_after_unix(&server.cert_pem).unwrap(),
            server.not_after_unix
        );
        assert!(not_after_unix("garbage").is_err());
    }
}

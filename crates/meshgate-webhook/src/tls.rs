//! The serving certificate: loaded from PEM files, re-read when they change.
//!
//! Kubernetes updates a mounted Secret by swapping a symlink, so the files are polled (content,
//! not modification time) rather than watched by inode. A bad new pair is reported and the old
//! certificate keeps serving; connections in progress are never dropped, new handshakes use the
//! new certificate.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no PEM certificate found")]
    NoCertificate { path: String },
    #[error("{path}: {message}")]
    Pem { path: String, message: String },
    #[error("certificate and key do not form a TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// The certificate and key files.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// A rustls server configuration (TLS 1.2 and 1.3, ring, ALPN h2 and http/1.1) from PEM.
pub fn server_config(
    cert_pem: &[u8],
    key_pem: &[u8],
    files: &CertFiles,
) -> Result<Arc<ServerConfig>, TlsError> {
    let cert_path = files.cert.display().to_string();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem {
            path: cert_path.clone(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate { path: cert_path });
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Pem {
        path: files.key.display().to_string(),
        message: e.to_string(),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Loads the files into a reloadable configuration.
pub fn load(files: &CertFiles) -> Result<(RustlsConfig, u64), TlsError> {
    let (cert, key) = (read(&files.cert)?, read(&files.key)?);
    let config = server_config(&cert, &key, files)?;
    Ok((RustlsConfig::from_config(config), fingerprint(&cert, &key)))
}

fn fingerprint(cert: &[u8], key: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    cert.hash(&mut h);
    key.hash(&mut h);
    h.finish()
}

/// Polls the files every `interval` and reloads `config` when their content changes.
pub async fn reload_loop(
    config: RustlsConfig,
    files: CertFiles,
    mut current: u64,
    interval: Duration,
    metrics: Metrics,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (cert, key) = match (read(&files.cert), read(&files.key)) {
            (Ok(c), Ok(k)) => (c, k),
            // Mid-swap or removed: try again next tick.
            _ => continue,
        };
        let fp = fingerprint(&cert, &key);
        if fp == current {
            continue;
        }
        match server_config(&cert, &key, &files) {
            Ok(c) => {
                config.reload_from_config(c);
                current = fp;
                metrics.cert_reloads.inc();
                tracing::info!(cert = %files.cert.display(), "serving certificate reloaded");
            }
            Err(e) => {
                // Count each distinct bad pair once.
                current = fp;
                metrics.cert_reload_errors.inc();
                tracing::error!(error = %e, "new serving certificate rejected; the previous one stays");
            }
        }
    }
}

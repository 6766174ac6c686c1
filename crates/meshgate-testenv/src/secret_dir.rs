//! Certificate files laid out like a mounted Secret, for tests of certificate reloads.

use std::path::{Path, PathBuf};

/// `tls.crt -> ..data/tls.crt`, `tls.key -> ..data/tls.key`, `..data -> ..gen-N`: an update
/// writes a new generation and renames a new `..data` link over the old one, so that both files
/// change at once, as the kubelet updates a mounted Secret.
#[derive(Debug)]
pub struct SecretDir {
    dir: tempfile::TempDir,
    generation: u32,
}

impl SecretDir {
    /// A new directory holding this certificate and key.
    pub fn new(cert_pem: &[u8], key_pem: &[u8]) -> std::io::Result<Self> {
        let mut secret = SecretDir {
            dir: tempfile::tempdir()?,
            generation: 0,
        };
        secret.swap(cert_pem, key_pem)?;
        for name in ["tls.crt", "tls.key"] {
            std::os::unix::fs::symlink(
                Path::new("..data").join(name),
                secret.dir.path().join(name),
            )?;
        }
        Ok(secret)
    }

    /// `tls.crt`.
    pub fn cert(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }

    /// `tls.key`.
    pub fn key(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }

    /// Atomically replaces both files.
    pub fn swap(&mut self, cert_pem: &[u8], key_pem: &[u8]) -> std::io::Result<()> {
        self.generation += 1;
        let generation = format!("..gen-{}", self.generation);
        let root = self.dir.path();
        std::fs::create_dir(root.join(&generation))?;
        std::fs::write(root.join(&generation).join("tls.crt"), cert_pem)?;
        std::fs::write(root.join(&generation).join("tls.key"), key_pem)?;
        let tmp = root.join("..data_tmp");
        std::os::unix::fs::symlink(&generation, &tmp)?;
        std::fs::rename(&tmp, root.join("..data"))
    }
}

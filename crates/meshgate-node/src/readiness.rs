//! One check of the node: read the CNI configuration directory, probe the readiness URLs, and
//! judge with `meshgate_core::dra::node`.

use std::path::PathBuf;

use meshgate_core::dra::node::{self, CniVerdict, NodeReadiness};

use crate::http_probe::{self, HttpUrl};
use crate::{PROBE_TIMEOUT, Settings};

/// The runtimes skip larger CNI files (go-cni's `MaxFileSize`).
const MAX_CNI_FILE: u64 = 2 * 1024 * 1024;

/// Checks the node as the settings say.
#[derive(Debug)]
pub struct Checker {
    cni_dir: PathBuf,
    cni_plugin: Option<String>,
    urls: Vec<HttpUrl>,
}

impl Checker {
    pub fn new(settings: &Settings, urls: Vec<HttpUrl>) -> Self {
        Checker {
            cni_dir: settings.cni_conf_dir.clone(),
            cni_plugin: settings.cni_plugin.clone(),
            urls,
        }
    }

    /// What is checked, for the log.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(plugin) = &self.cni_plugin {
            parts.push(format!(
                "the CNI configuration in {} chains \"{plugin}\"",
                self.cni_dir.display()
            ));
        }
        for url in &self.urls {
            parts.push(format!("{url} answers 2xx"));
        }
        if parts.is_empty() {
            "nothing (every node is ready)".to_string()
        } else {
            parts.join(", ")
        }
    }

    /// One look at the node. Bounded: the URLs are probed at once, each for at most
    /// [`PROBE_TIMEOUT`]; dropping the future stops the probes.
    pub async fn check(&self) -> NodeReadiness {
        let probes = futures::future::join_all(self.urls.iter().map(|url| async move {
            (
                url.to_string(),
                http_probe::get_status(url, PROBE_TIMEOUT).await,
            )
        }));
        let (cni, probes) = futures::join!(self.cni(), probes);
        node::node_readiness(&cni, &probes)
    }

    async fn cni(&self) -> CniVerdict {
        let dir = self.cni_dir.display().to_string();
        let Some(plugin) = self.cni_plugin.as_deref() else {
            return CniVerdict::NotChecked;
        };
        match read_cni_files(&self.cni_dir).await {
            Ok(files) => node::cni_verdict(&dir, Some(plugin), &files),
            Err(error) => CniVerdict::Unreadable { dir, error },
        }
    }
}

/// The candidate files of the CNI directory (name, content). A missing directory has none
/// (libcni's `ConfFiles`); a file that vanishes or cannot be read meanwhile is skipped.
async fn read_cni_files(dir: &std::path::Path) -> Result<Vec<(String, String)>, String> {
    let mut entries = match tokio::fs::read_dir(dir).await {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.to_string()),
    };
    let mut files = Vec::new();
    loop {
        let entry = match entries.next_entry().await {
            Ok(Some(entry)) => entry,
            Ok(None) => break,
            Err(e) => return Err(e.to_string()),
        };
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if !node::is_cni_config_name(&name) {
            continue;
        }
        let path = entry.path();
        // Follows symlinks, as the runtimes' reads do.
        match tokio::fs::metadata(&path).await {
            Ok(m) if m.is_file() && m.len() <= MAX_CNI_FILE => {}
            _ => continue,
        }
        if let Ok(bytes) = tokio::fs::read(&path).await {
            files.push((name, String::from_utf8_lossy(&bytes).into_owned()));
        }
    }
    Ok(files)
}

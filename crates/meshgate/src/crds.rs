//! The CRD manifests, generated from the Rust types (`meshgate crds`), checked in under
//! `deploy/crds/` and compared in CI (`meshgate crds --check deploy/crds`).

use std::path::Path;

use kube::CustomResourceExt;
use meshgate_api::{MutationPolicy, NamespacedMutationPolicy, NodeGate};

/// `(file name, YAML)` of every CRD.
pub fn manifests() -> anyhow::Result<Vec<(&'static str, String)>> {
    Ok(vec![
        (
            "nodegates.meshgate.dev.yaml",
            meshgate_api::yaml::to_string(&NodeGate::crd())?,
        ),
        (
            "mutationpolicies.meshgate.dev.yaml",
            meshgate_api::yaml::to_string(&MutationPolicy::crd())?,
        ),
        (
            "namespacedmutationpolicies.meshgate.dev.yaml",
            meshgate_api::yaml::to_string(&NamespacedMutationPolicy::crd())?,
        ),
    ])
}

/// Every CRD as one multi-document YAML stream.
pub fn all_yaml() -> anyhow::Result<String> {
    Ok(manifests()?
        .into_iter()
        .map(|(_, y)| format!("---\n{y}"))
        .collect())
}

/// Writes the manifests into `dir`.
pub fn write(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, yaml) in manifests()? {
        std::fs::write(dir.join(name), yaml)?;
    }
    Ok(())
}

/// Fails, naming the files, when `dir` differs from what the types generate.
pub fn check(dir: &Path) -> anyhow::Result<()> {
    let mut stale = Vec::new();
    for (name, yaml) in manifests()? {
        let path = dir.join(name);
        if std::fs::read_to_string(&path).ok().as_deref() != Some(yaml.as_str()) {
            stale.push(path.display().to_string());
        }
    }
    if stale.is_empty() {
        Ok(())
    } else {
        anyhow::bail!(
            "generated CRDs differ from the checked-in files: {}; run `meshgate crds --write {}`",
            stale.join(", "),
            dir.display()
        )
    }
}

//! Keeps meshgate's CRDs at this controller's schema, so that `helm upgrade` (which installs a
//! chart's `crds/` once and never again) and a new image upgrade them: on start, each CRD that
//! exists is written by server-side apply (field manager `meshgate-controller`), unless a newer
//! meshgate wrote it (`meshgate_core::object::crd::may_write`). A CRD that does not exist is
//! left to `install` and Helm (the controller may only `get` and `patch` meshgate's three CRDs,
//! by name).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use kube::api::{Api, Patch, PatchParams};
use meshgate_core::object::crd::{VERSION_ANNOTATION, may_write};

/// This controller's version, written on the CRDs it applies.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// meshgate's CRDs, as this version defines them.
pub fn definitions() -> Vec<CustomResourceDefinition> {
    vec![
        meshgate_api::NodeGate::crd(),
        meshgate_api::MutationPolicy::crd(),
        meshgate_api::NamespacedMutationPolicy::crd(),
    ]
}

/// What happened to one CRD.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// Not in the cluster: nothing to upgrade.
    Absent,
    /// A newer meshgate wrote it (the version it names).
    Newer(String),
}

/// Applies every CRD that exists and no newer meshgate wrote.
pub async fn upgrade(client: &kube::Client) -> Result<Vec<(String, Outcome)>, kube::Error> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply("meshgate-controller").force();
    let mut out = Vec::new();
    for mut crd in definitions() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let Some(current) = api.get_opt(&name).await? else {
            out.push((name, Outcome::Absent));
            continue;
        };
        let installed = current
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(VERSION_ANNOTATION))
            .cloned();
        if !may_write(installed.as_deref(), VERSION) {
            out.push((name, Outcome::Newer(installed.unwrap_or_default())));
            continue;
        }
        crd.metadata
            .annotations
            .get_or_insert_default()
            .insert(VERSION_ANNOTATION.into(), VERSION.into());
        api.patch(&name, &params, &Patch::Apply(&crd)).await?;
        out.push((name, Outcome::Applied));
    }
    Ok(out)
}

/// [`upgrade`], logged: one line per CRD; a failure is a warning (the CRDs stay as they are).
pub async fn upgrade_logged(client: &kube::Client) {
    match upgrade(client).await {
        Ok(outcomes) => {
            for (name, outcome) in outcomes {
                match outcome {
                    Outcome::Applied => {
                        tracing::info!(crd = %name, version = VERSION, "CRD at this version's schema")
                    }
                    Outcome::Absent => {
                        tracing::info!(crd = %name, "CRD not installed: left to install or Helm")
                    }
                    Outcome::Newer(v) => {
                        tracing::info!(crd = %name, written_by = %v, "CRD written by a newer meshgate: left alone")
                    }
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not upgrade meshgate's CRDs; they stay as they are")
        }
    }
}

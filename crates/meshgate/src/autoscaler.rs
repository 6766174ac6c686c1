//! Finds the node autoscalers of a cluster, for `install` and `check`
//! (`meshgate_core::autoscaler` holds what they do beside a gate).
//!
//! * **Karpenter**: the API server serves `karpenter.sh/v1` NodePools. Its NodePools'
//!   `startupTaints` and its NodeOverlays' capacity (`karpenter.sh/v1alpha1`, where served) are
//!   read.
//! * **The Cluster Autoscaler**: a Deployment whose container image or command names
//!   `cluster-autoscaler`; its `--startup-taint`, `--ignore-taint` and `--startup-taint-prefix`
//!   flags are read. A managed one (no Deployment to see) is found by its status ConfigMap
//!   `kube-system/cluster-autoscaler-status`, with no flags known.
//!
//! A list the caller may not make (403) counts as nothing found there, and says so.

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, DynamicObject, ListParams};
use kube::discovery::ApiResource;
use meshgate_core::autoscaler::{Autoscaler, Found};

/// The autoscalers found, with notes on what could not be read.
pub async fn detect(client: &kube::Client) -> (Vec<Found>, Vec<String>) {
    let mut found = Vec::new();
    let mut notes = Vec::new();
    match karpenter(client).await {
        Ok(Some(k)) => found.push(k),
        Ok(None) => {}
        Err(e) => notes.push(format!("Karpenter's NodePools: {e}")),
    }
    match cluster_autoscaler(client).await {
        Ok(Some(ca)) => found.push(ca),
        Ok(None) => {}
        Err(e) => notes.push(format!("Deployments (the Cluster Autoscaler's): {e}")),
    }
    (found, notes)
}

async fn serves(client: &kube::Client, group_version: &str, resource: &str) -> bool {
    client
        .list_api_group_resources(group_version)
        .await
        .is_ok_and(|list| list.resources.iter().any(|r| r.name == resource))
}

async fn list(
    client: &kube::Client,
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
) -> Result<Vec<DynamicObject>, kube::Error> {
    let ar = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    };
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    Ok(api.list(&ListParams::default()).await?.items)
}

async fn karpenter(client: &kube::Client) -> Result<Option<Found>, kube::Error> {
    if !serves(client, "karpenter.sh/v1", "nodepools").await {
        return Ok(None);
    }
    let mut found = Found {
        autoscaler: Some(Autoscaler::Karpenter),
        ..Found::default()
    };
    for pool in list(client, "karpenter.sh", "v1", "NodePool", "nodepools").await? {
        let taints = &pool.data["spec"]["template"]["spec"]["startupTaints"];
        for t in taints.as_array().into_iter().flatten() {
            if let Some(key) = t["key"].as_str()
                && !found.startup_keys.iter().any(|k| k == key)
            {
                found.startup_keys.push(key.to_owned());
            }
        }
    }
    if serves(client, "karpenter.sh/v1alpha1", "nodeoverlays").await {
        for overlay in list(
            client,
            "karpenter.sh",
            "v1alpha1",
            "NodeOverlay",
            "nodeoverlays",
        )
        .await?
        {
            for name in overlay.data["spec"]["capacity"]
                .as_object()
                .into_iter()
                .flat_map(|c| c.keys())
            {
                if !found.template_resources.contains(name) {
                    found.template_resources.push(name.clone());
                }
            }
        }
    }
    Ok(Some(found))
}

async fn cluster_autoscaler(client: &kube::Client) -> Result<Option<Found>, kube::Error> {
    let deployments: Api<Deployment> = Api::all(client.clone());
    let mut found: Option<Found> = None;
    for d in deployments.list(&ListParams::default()).await?.items {
        let containers = d
            .spec
            .and_then(|s| s.template.spec)
            .map(|s| s.containers)
            .unwrap_or_default();
        for c in containers {
            let words: Vec<String> = c
                .command
                .unwrap_or_default()
                .into_iter()
                .chain(c.args.unwrap_or_default())
                .collect();
            let named = c
                .image
                .as_deref()
                .is_some_and(|i| i.contains("cluster-autoscaler"))
                || words.iter().any(|w| w.ends_with("cluster-autoscaler"));
            if !named {
                continue;
            }
            let f = found.get_or_insert_with(|| Found {
                autoscaler: Some(Autoscaler::ClusterAutoscaler),
                ..Found::default()
            });
            f.startup_keys
                .extend(flag_values(&words, "--startup-taint"));
            f.startup_keys.extend(flag_values(&words, "--ignore-taint"));
            f.startup_prefixes
                .extend(flag_values(&words, "--startup-taint-prefix"));
        }
    }
    if found.is_none() {
        let status: Api<k8s_openapi::api::core::v1::ConfigMap> =
            Api::namespaced(client.clone(), "kube-system");
        if status.get_opt("cluster-autoscaler-status").await?.is_some() {
            found = Some(Found {
                autoscaler: Some(Autoscaler::ClusterAutoscaler),
                ..Found::default()
            });
        }
    }
    Ok(found)
}

/// The values of a flag given as `--flag=VALUE` or `--flag VALUE` (repeatable), each cut at
/// its first `=` or `:` (`KEY[=VALUE][:EFFECT]`).
fn flag_values(words: &[String], flag: &str) -> Vec<String> {
    let key = |v: &str| v.split(['=', ':']).next().unwrap_or_default().to_owned();
    let mut out = Vec::new();
    let mut it = words.iter();
    while let Some(w) = it.next() {
        if let Some(v) = w.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            out.push(key(v));
        } else if w == flag
            && let Some(v) = it.next()
        {
            out.push(key(v));
        }
    }
    out.retain(|k| !k.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn startup_taint_flags_in_both_forms() {
        let words: Vec<String> = [
            "./cluster-autoscaler",
            "--startup-taint=node.meshgate.dev/agent-not-ready:NoSchedule",
            "--startup-taint",
            "x.io/y=v",
            "--startup-taint-prefix=readiness.k8s.io/",
            "--v=4",
        ]
        .map(String::from)
        .into();
        assert_eq!(
            flag_values(&words, "--startup-taint"),
            ["node.meshgate.dev/agent-not-ready", "x.io/y"]
        );
        assert_eq!(
            flag_values(&words, "--startup-taint-prefix"),
            ["readiness.k8s.io/"]
        );
    }
}

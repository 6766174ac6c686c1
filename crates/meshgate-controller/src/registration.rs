//! The policies webhook's rules follow the MutationPolicies: the API server calls meshgate for
//! exactly the kinds the policies name (`meshgate_core::registration::policy_rules`: Pods and
//! the workloads always, plus every other kind a policy's `match.kinds` names, resolved by
//! discovery to its resources; a wildcard kind becomes a wildcard rule).
//!
//! The leader recomputes the rules whenever a MutationPolicy changes, and every `resync` (CRDs
//! installed later change what discovery resolves), and replaces the `policies.meshgate.dev`
//! webhook's rules in the `MutatingWebhookConfiguration` when they differ (a JSON patch that
//! first tests the webhook's name at that index). A kind that discovery does not know yet is
//! logged and left out until it is served.

use std::time::Duration;

use crate::leader::Leader;
use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::api::{Api, Patch, PatchParams};
use kube::discovery::Discovery;
use kube::runtime::{reflector, watcher};
use meshgate_api::{MutationPolicy, MutationPolicySpec, NamespacedMutationPolicy};
use meshgate_core::policy::{parse_kind, wildcard_match};
use meshgate_core::registration::{
    PolicyResource, policies_webhook_name, policy_kind_entries, policy_rules,
};
use serde_json::json;

/// Resolves `kinds` entries to resources with discovery; returns them and the entries it could
/// not resolve.
pub async fn resolve(
    client: &kube::Client,
    entries: &[String],
) -> Result<(Vec<PolicyResource>, Vec<String>), kube::Error> {
    let mut out = Vec::new();
    let mut unresolved = Vec::new();
    let needs_discovery = entries
        .iter()
        .any(|e| parse_kind(e).is_ok_and(|(_, _, kind)| !kind.contains(['*', '?'])));
    let discovery = if needs_discovery {
        Some(Discovery::new(client.clone()).run().await?)
    } else {
        None
    };
    for entry in entries {
        let Ok((group, version, kind)) = parse_kind(entry) else {
            continue;
        };
        if kind.contains(['*', '?']) {
            out.push(PolicyResource {
                group: group.unwrap_or("*").to_owned(),
                version: version.unwrap_or("*").to_owned(),
                resource: "*".to_owned(),
            });
            continue;
        }
        let mut found = false;
        for g in discovery.iter().flat_map(|d| d.groups()) {
            if !group.is_none_or(|p| wildcard_match(p, g.name())) {
                continue;
            }
            for v in g.versions() {
                if !version.is_none_or(|p| wildcard_match(p, v)) {
                    continue;
                }
                for (ar, _) in g.versioned_resources(v) {
                    if ar.kind == kind && !ar.plural.contains('/') {
                        found = true;
                        out.push(PolicyResource {
                            group: ar.group.clone(),
                            version: ar.version.clone(),
                            resource: ar.plural.clone(),
                        });
                    }
                }
            }
        }
        if !found {
            unresolved.push(entry.clone());
        }
    }
    out.sort();
    out.dedup();
    Ok((out, unresolved))
}

/// One pass: the rules the policies need, written into `configuration` when they differ.
/// Returns whether it wrote.
pub async fn sync_once(
    client: &kube::Client,
    configuration: &str,
    policies: &[&MutationPolicySpec],
) -> Result<bool, kube::Error> {
    let entries = policy_kind_entries(policies.iter().copied());
    let (resources, unresolved) = resolve(client, &entries).await?;
    if !unresolved.is_empty() {
        tracing::warn!(kinds = ?unresolved, "policy kinds not served by the API server (yet); left out of the webhook's rules");
    }
    let desired = policy_rules(&resources);
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let Some(mwc) = mwcs.get_opt(configuration).await? else {
        return Ok(false);
    };
    let name = policies_webhook_name();
    let Some((index, hook)) = mwc
        .webhooks
        .iter()
        .flatten()
        .enumerate()
        .find(|(_, h)| h.name == name)
    else {
        return Ok(false);
    };
    if serde_json::to_value(&hook.rules).unwrap_or_default() == desired {
        return Ok(false);
    }
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": format!("/webhooks/{index}/name"), "value": name},
        {"op": "replace", "path": format!("/webhooks/{index}/rules"), "value": desired},
    ]))
    .map_err(kube::Error::SerdeError)?;
    mwcs.patch(
        configuration,
        &PatchParams::default(),
        &Patch::<()>::Json(patch),
    )
    .await?;
    tracing::info!(
        configuration,
        resources = resources.len(),
        "policies webhook rules updated"
    );
    Ok(true)
}

/// What a watch event means here.
enum Seen {
    /// The first full list is in.
    Listed,
    /// A policy was added, changed or deleted.
    Changed,
    Other,
}

impl Seen {
    fn of<K>(e: &watcher::Event<K>) -> Self {
        match e {
            watcher::Event::InitDone => Seen::Listed,
            watcher::Event::Apply(_) | watcher::Event::Delete(_) => Seen::Changed,
            _ => Seen::Other,
        }
    }
}

/// Runs until `shutdown`: a watch of MutationPolicies, a pass on each change and every
/// `resync`, writes only while leader.
pub async fn run(
    client: kube::Client,
    leader: Leader,
    configuration: String,
    resync: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let (store, writer) = reflector::store::<MutationPolicy>();
    let (nstore, nwriter) = reflector::store::<NamespacedMutationPolicy>();
    let cluster = reflector(
        writer,
        watcher(
            Api::<MutationPolicy>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .map(|e| e.map(|e| Seen::of(&e)));
    let namespaced = reflector(
        nwriter,
        watcher(
            Api::<NamespacedMutationPolicy>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .map(|e| e.map(|e| Seen::of(&e)));
    let mut stream = std::pin::pin!(futures::stream::select(cluster, namespaced));
    let mut tick = tokio::time::interval(resync);
    let mut shutdown = std::pin::pin!(shutdown);
    // Both watches listed once.
    let mut lists_done = 0;
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            ev = stream.next() => match ev {
                Some(Ok(Seen::Listed)) => lists_done += 1,
                Some(Ok(Seen::Changed)) => {}
                Some(Ok(Seen::Other)) => continue,
                Some(Err(e)) => {
                    meshgate_kube::watch::log("MutationPolicies (webhook rules)", &e);
                    continue;
                }
                None => return,
            },
            _ = tick.tick() => {}
        }
        if lists_done < 2 || !leader.is_leader() {
            continue;
        }
        let (cluster, namespaced) = (store.state(), nstore.state());
        let specs: Vec<&MutationPolicySpec> = cluster
            .iter()
            .map(|p| &p.spec)
            .chain(namespaced.iter().map(|p| &p.spec.policy))
            .collect();
        if let Err(e) = sync_once(&client, &configuration, &specs).await {
            tracing::warn!(error = %e, "policies webhook rules: pass failed; retrying");
        }
    }
}

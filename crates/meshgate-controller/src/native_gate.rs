//! The native gate's routing (`meshgate_core::native_gate`): the namespaces whose LimitRanges
//! constrain the gate's cpu or memory stay on the webhook, and this loop keeps that list in the
//! `MutatingAdmissionPolicy` (excluded) and in the native clauses' webhook entries (included).
//!
//! `install` writes both with every namespace routed to the webhook (`Routes::All`); the leader
//! writes the real list once its LimitRange watch has listed everything, and again on every
//! change, so that before the first full list nothing is decided without the LimitRanges. The
//! policy is written by server-side apply (field manager `meshgate-controller`), the webhook
//! entries by a JSON patch that tests each entry's name at its index first.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::leader::Leader;
use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::LimitRange;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::{reflector, watcher};
use meshgate_api::GateConfig;
use meshgate_core::native_gate::{Routes, policy, routed_namespace};
use meshgate_core::registration::{PolicyApi, native_gate_entries};
use meshgate_core::resources::ContainerLimits;
use serde_json::{Value, json};

/// What the loop needs.
#[derive(Clone, Debug)]
pub struct Settings {
    pub config: GateConfig,
    /// The `MutatingWebhookConfiguration` holding the gate's entries.
    pub configuration: String,
    pub api: PolicyApi,
}

/// The routed namespaces in `ranges`: those with a LimitRange that constrains the gate.
pub fn routes<'a>(ranges: impl IntoIterator<Item = &'a LimitRange>) -> Routes {
    let names: BTreeSet<String> = ranges
        .into_iter()
        .filter(|lr| routed_namespace(&ContainerLimits::of(lr)))
        .filter_map(|lr| lr.metadata.namespace.clone())
        .collect();
    Routes::Namespaces(names.into_iter().collect())
}

/// Writes the policy and the webhook entries for `routes`.
pub async fn write(client: &kube::Client, s: &Settings, routes: &Routes) -> Result<(), WriteError> {
    let params = PatchParams::apply("meshgate-controller").force();
    for doc in policy(&s.config, s.api, routes).map_err(|e| WriteError::NotNative(e.0))? {
        let obj: DynamicObject = serde_json::from_value(doc)?;
        let gvk = obj
            .types
            .as_ref()
            .and_then(|t| GroupVersionKind::try_from(t).ok())
            .ok_or(WriteError::NotNative("no type".into()))?;
        let name = obj.metadata.name.clone().unwrap_or_default();
        Api::<DynamicObject>::all_with(client.clone(), &ApiResource::from_gvk(&gvk))
            .patch(&name, &params, &Patch::Apply(&obj))
            .await?;
    }
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let Some(mwc) = mwcs.get_opt(&s.configuration).await? else {
        return Ok(());
    };
    let entries = native_gate_entries(&s.config, routes);
    let mut ops = Vec::new();
    for (i, hook) in mwc.webhooks.iter().flatten().enumerate() {
        let Some((_, selector)) = entries.iter().find(|(name, _)| *name == hook.name) else {
            continue;
        };
        let current = serde_json::to_value(&hook.namespace_selector).unwrap_or(Value::Null);
        // Routes were match conditions before they were selectors: an entry written then
        // loses them (meshgate puts no other condition on a gate entry).
        let stale_conditions = hook
            .match_conditions
            .as_ref()
            .is_some_and(|c| !c.is_empty());
        if current == *selector && !stale_conditions {
            continue;
        }
        ops.push(json!({"op": "test", "path": format!("/webhooks/{i}/name"), "value": hook.name}));
        ops.push(json!({"op": "add", "path": format!("/webhooks/{i}/namespaceSelector"), "value": selector}));
        if stale_conditions {
            ops.push(json!({"op": "remove", "path": format!("/webhooks/{i}/matchConditions")}));
        }
    }
    if !ops.is_empty() {
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops))?;
        mwcs.patch(
            &s.configuration,
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await?;
    }
    Ok(())
}

/// Why a write failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("the configuration has no native gate: {0}")]
    NotNative(String),
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// Runs until `shutdown`: a LimitRange watch; the leader writes the routes after the first full
/// list and whenever they change (retrying a failed write every `retry`).
pub async fn run(
    client: kube::Client,
    leader: Leader,
    s: Settings,
    retry: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let (store, writer) = reflector::store::<LimitRange>();
    let mut events = std::pin::pin!(reflector(
        writer,
        watcher(
            Api::<LimitRange>::all(client.clone()),
            watcher::Config::default()
        ),
    ));
    let mut shutdown = std::pin::pin!(shutdown);
    let mut leader_changes = leader.clone();
    let mut listed = false;
    let mut written: Option<Routes> = None;
    let mut tick = tokio::time::interval(retry);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            ev = events.next() => match ev {
                Some(Ok(watcher::Event::InitDone)) => listed = true,
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "LimitRange watch");
                    continue;
                }
                None => return,
            },
            changed = leader_changes.changed() => {
                if changed.is_err() {
                    return;
                }
                // A new leader writes again.
                written = None;
            }
            // Now and then again, whatever was written: a re-run `install` writes `Routes::All`.
            _ = tick.tick() => written = None,
        }
        if !listed || !leader.is_leader() {
            continue;
        }
        let state = store.state();
        let desired = routes(state.iter().map(|lr| lr.as_ref()));
        if written.as_ref() == Some(&desired) {
            continue;
        }
        match write(&client, &s, &desired).await {
            Ok(()) => {
                let Routes::Namespaces(names) = &desired else {
                    continue;
                };
                tracing::info!(
                    routed = ?names,
                    "native gate: pods in these namespaces (LimitRanges) go to the webhook, every other ambient pod is gated by the API server"
                );
                written = Some(desired);
            }
            Err(e) => {
                tracing::warn!(error = %e, "native gate: routes not written; the webhook keeps deciding")
            }
        }
    }
}

//! The native gate's routing (`meshgate_core::native_gate`): the namespaces whose LimitRanges
//! constrain the gate's cpu or memory stay on the webhook, and this loop keeps that list in the
//! `MutatingAdmissionPolicy` (excluded) and in the native clauses' webhook entries (included).
//!
//! `install` writes both with every namespace routed to the webhook (`Routes::All`); the leader
//! writes the real list once its LimitRange watch has listed everything, and again on every
//! change, so that before the first full list nothing is decided without the LimitRanges. The
//! policy is written by server-side apply (field manager `meshgate-controller`), the webhook
//! entries by a JSON patch that tests each entry's name at its index first.
//!
//! Served is not enforced: an API server may serve the policy API with its admission plugin off
//! (the `MutatingAdmissionPolicy` feature gate, after an upgrade or a flag change). The leader
//! proves that it runs ([`crate::discovery::prove_policy_api`]) before it routes any namespace
//! to the policy, and again every [`Proof::every`]; found not running, every namespace goes back
//! to the webhook (`Routes::All`, the webhook entries widened before the policy is narrowed),
//! with a warning and an Event, until a later proof finds it running again. A probe that cannot
//! be made (the controller may not create policies: native policies off) keeps the routes and
//! says so once.

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
    pub proof: Proof,
}

/// How the leader proves that the API server runs the policy.
#[derive(Clone, Debug)]
pub struct Proof {
    /// Where the probe's dry-run Lease is created (the controller's namespace).
    pub namespace: String,
    /// How often, while leading (and at each leadership gain).
    pub every: Duration,
    /// How long the probe waits for its policy to apply.
    pub wait: Duration,
}

/// [`Proof::every`] by default: a probe creates and deletes a policy and its binding, which
/// the API server compiles; ten minutes keeps that rare and still notices a changed API server
/// long before most rollouts finish.
pub const PROOF_EVERY: Duration = Duration::from_secs(600);

/// Whether the API server runs the policy, as the last proof found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Enforced {
    /// Not proven yet, or the probe could not be made: the served API is trusted.
    Trusted,
    Yes,
    No,
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

/// Writes the policy and the webhook entries for `routes`: for `Routes::All` (every namespace
/// back to the webhook) the webhook entries first, so that no namespace is left to a policy
/// that may not run; otherwise the policy first, so that a namespace leaves the webhook only
/// once the policy covers it.
pub async fn write(client: &kube::Client, s: &Settings, routes: &Routes) -> Result<(), WriteError> {
    if *routes == Routes::All {
        write_entries(client, s, routes).await?;
        match write_policy(client, s, routes).await {
            // The API is no longer served: no policy is left to narrow.
            Err(WriteError::Kube(kube::Error::Api(e))) if e.code == 404 => Ok(()),
            other => other,
        }
    } else {
        write_policy(client, s, routes).await?;
        write_entries(client, s, routes).await
    }
}

async fn write_policy(
    client: &kube::Client,
    s: &Settings,
    routes: &Routes,
) -> Result<(), WriteError> {
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
    Ok(())
}

async fn write_entries(
    client: &kube::Client,
    s: &Settings,
    routes: &Routes,
) -> Result<(), WriteError> {
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

/// Runs until `shutdown`: a LimitRange watch; the leader proves the policy runs, then writes
/// the routes after the first full list and whenever they change (retrying a failed write
/// every `retry`).
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
    let mut enforced = Enforced::Trusted;
    let mut proven: Option<tokio::time::Instant> = None;
    let recorder = crate::events::Events::new(client.clone());
    let mut tick = tokio::time::interval(retry.min(s.proof.every));
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
                // A new leader proves and writes again.
                written = None;
                proven = None;
            }
            // Now and then again, whatever was written: a re-run `install` writes `Routes::All`.
            _ = tick.tick() => written = None,
        }
        if !listed || !leader.is_leader() {
            continue;
        }
        if proven.is_none_or(|t| t.elapsed() >= s.proof.every) {
            let found = prove(&client, &s.proof, enforced).await;
            proven = Some(tokio::time::Instant::now());
            if found != enforced {
                report(&recorder, &s, enforced, found).await;
                enforced = found;
                written = None;
            }
        }
        let desired = if enforced == Enforced::No {
            Routes::All
        } else {
            let state = store.state();
            routes(state.iter().map(|lr| lr.as_ref()))
        };
        if written.as_ref() == Some(&desired) {
            continue;
        }
        match write(&client, &s, &desired).await {
            Ok(()) => {
                if let Routes::Namespaces(names) = &desired {
                    tracing::info!(
                        routed = ?names,
                        "native gate: pods in these namespaces (LimitRanges) go to the webhook, every other ambient pod is gated by the API server"
                    );
                }
                written = Some(desired);
            }
            Err(e) => {
                tracing::warn!(error = %e, "native gate: routes not written; the webhook keeps deciding")
            }
        }
    }
}

/// One proof; a probe that cannot be made keeps what was known.
async fn prove(client: &kube::Client, proof: &Proof, known: Enforced) -> Enforced {
    use crate::discovery::PolicyEnforcement;
    match crate::discovery::prove_policy_api(client, &proof.namespace, proof.wait).await {
        PolicyEnforcement::Enforced(_) => Enforced::Yes,
        PolicyEnforcement::StoredOnly(..) | PolicyEnforcement::NotServed => Enforced::No,
        PolicyEnforcement::Unproven(_, why) => {
            if known == Enforced::Trusted {
                tracing::debug!(%why, "native gate: the policy's enforcement could not be proven; the served API is trusted");
            } else {
                tracing::info!(%why, "native gate: the policy's enforcement could not be proven this time; keeping the last finding");
            }
            known
        }
    }
}

/// The warning and the Event (on the webhook configuration) for a changed finding.
async fn report(recorder: &crate::events::Events, s: &Settings, was: Enforced, now: Enforced) {
    let (type_, reason, note) = match now {
        Enforced::No => (
            crate::events::EventType::Warning,
            "NativeGateNotEnforced",
            "the API server does not run MutatingAdmissionPolicies (a probe policy changed nothing): every namespace's pods are gated by the webhook until it does".to_owned(),
        ),
        Enforced::Yes if was == Enforced::No => (
            crate::events::EventType::Normal,
            "NativeGateEnforced",
            "the API server runs MutatingAdmissionPolicies again: pods outside LimitRange namespaces are gated by the policy".to_owned(),
        ),
        _ => return,
    };
    if now == Enforced::No {
        tracing::warn!("native gate: {note}");
    } else {
        tracing::info!("native gate: {note}");
    }
    let regarding = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("admissionregistration.k8s.io/v1".into()),
        kind: Some("MutatingWebhookConfiguration".into()),
        name: Some(s.configuration.clone()),
        ..Default::default()
    };
    // The finding is reported once: a write refused by a passing fault (the API server just
    // restarted, as when its admission plugins change) is tried again, three times in all.
    for attempt in 1..=3u32 {
        match recorder
            .publish(type_, "Prove", reason, &note, &regarding)
            .await
        {
            Ok(()) => return,
            Err(e) if attempt < 3 => {
                tracing::debug!(error = %e, attempt, "event not recorded; trying again");
                tokio::time::sleep(std::time::Duration::from_millis(500 * u64::from(attempt)))
                    .await;
            }
            Err(e) => tracing::warn!(error = %e, reason, "event not recorded"),
        }
    }
}

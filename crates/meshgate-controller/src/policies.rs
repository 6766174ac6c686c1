//! The existing-workload backfill controller for MutationPolicies.
//!
//! Reconciles MutationPolicies. A policy whose `metadata.generation` differs from its
//! `status.observedGeneration` (created, or its spec changed) is handled once:
//!
//! * It is validated ([`meshgate_core::policy::validate`]). An invalid policy gets
//!   `Valid=False` (the messages in the condition) and `Ready=False`, and nothing else happens.
//! * With `spec.existing.enabled`, one pass goes over every Deployment, StatefulSet, DaemonSet,
//!   ReplicaSet, Job and CronJob in the cluster:
//!   - ReplicaSets controlled by a Deployment and Jobs controlled by a CronJob are skipped: their
//!     template comes from their owner, which is mutated instead.
//!   - Matching ([`meshgate_core::policy::policy_matches`], namespace labels read from the API):
//!     an existing workload is treated as if it were created now, so a policy that lists
//!     `CREATE` (or no operations, which means `CREATE`) matches it; a policy that lists only
//!     `UPDATE` matches too, since the backfill writes an update. Namespaces the webhook
//!     excludes ([`Settings::excluded_namespaces`]) and workloads (or pod templates) opted out
//!     with `meshgate.dev/inject: "false"` are never matched, as at admission.
//!   - The mutated pod template comes from the same engine as the webhook
//!     ([`meshgate_core::policy::apply`], with this one policy). A workload whose template does
//!     not change is `unchanged`. Otherwise the pod template alone is written (with
//!     `target: Object`, the workload's own changes: its metadata and spec as the policy
//!     mutated them): a JSON patch of the differences, preceded by a `test` of the
//!     `metadata.resourceVersion` that was read (optimistic lock). On a conflict (409, or a 422 after which the object has a
//!     new resourceVersion) the workload is read again, recomputed and written again, up to
//!     [`MAX_ATTEMPTS`] times. Writes use the field manager `meshgate` and are spaced to at most
//!     `spec.existing.ratePerSecond`. The write passes through the `/mutate/policies` webhook
//!     as an UPDATE, which is harmless: mutations are idempotent.
//!   - With `spec.existing.dryRun` nothing is written; `mutated` and `changed` report what
//!     would change.
//!   - Then every object of the other kinds the policy's `match.kinds` names (a Service, a
//!     ConfigMap, a Namespace, a custom resource: resolved by discovery, the group's preferred
//!     version unless the entry names one), written the same way as the object itself (the
//!     policy's changes to it). The controller may list and patch them only where `meshgate
//!     install --existing-kind` granted it: a kind it may not list counts as one failure that
//!     says what to grant. Wildcard kinds are not visited (the Ready message says so).
//!   - Pods that no controller owns (no ownerReference with `controller: true`) and that the
//!     policy matches are counted as `bare_pods`; they are never changed or deleted (their
//!     spec is mostly immutable, and recreating them is the owner's decision).
//!   - A write that fails for another reason (a Job's pod template is immutable, for example)
//!     counts as `failed`; the first messages go into the `Ready` condition. Failed workloads
//!     are not retried until the policy changes again.
//! * The report goes to `status.existing`, with `status.observedGeneration` and the `Valid` and
//!   `Ready` conditions, by a merge patch of the status subresource; an Event
//!   (`ExistingWorkloadsMutated`, or `ExistingWorkloadsDryRun`) on the policy names the counts.
//!
//! Only the leader writes: a replica that is not the leader, or loses leadership during a pass,
//! writes nothing (not even the status), and every policy is reconciled again when leadership is
//! gained.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::events::{EventType, Events};
use crate::leader::Leader;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, OwnerReference, Time};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use meshgate_api::mutation_policy::{
    ExistingReport, MutationPolicyStatus, MutationTarget, Operation,
};
use meshgate_api::{GateConfig, MutationPolicy, MutationPolicySpec, names};
use meshgate_core::patch::{JsonPatch, escape};
use meshgate_core::policy::context::{self, ClusterData, GivenObjects};
use meshgate_core::policy::{
    self, MatchContext, PolicyError, native, opted_out, pod_template_path, policy_matches,
};
use meshgate_core::registration::{PolicyApi, policy_kind_entries};
use serde_json::Value;

/// At most this many workloads are named in `status.existing.changed`.
pub const MAX_CHANGED: usize = 50;
/// Writes of one workload (first try and conflict retries).
pub const MAX_ATTEMPTS: usize = 5;
/// Failure messages quoted in the `Ready` condition.
const MAX_FAILURE_MESSAGES: usize = 3;
/// List page size.
const PAGE: u32 = 500;

/// Errors of one reconcile; the policy is retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("listing {what}: {source}")]
    List {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("keeping the MutatingAdmissionPolicy of policy {policy}: {source}")]
    Native {
        policy: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status of policy {policy}: {source}")]
    Status {
        policy: String,
        #[source]
        source: kube::Error,
    },
}

/// Controller settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Namespaces in which nothing is ever mutated (the webhook's `excludedNamespaces`).
    pub excluded_namespaces: Vec<String>,
    /// Native mode: compile policies to MutatingAdmissionPolicies of this API version (the
    /// API server serves it). `None`: every policy stays on the webhook.
    pub native: Option<PolicyApi>,
    /// The backfill of existing workloads (`spec.existing`). Off (`install
    /// --workload-backfill=false`, which then grants no workload `patch`): such policies apply
    /// at admission only and say so in their `Ready` condition.
    pub backfill: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            excluded_namespaces: GateConfig::default().excluded_namespaces,
            native: None,
            backfill: true,
        }
    }
}

struct Ctx {
    client: kube::Client,
    leader: Leader,
    events: Events,
    settings: Settings,
}

impl Ctx {
    fn is_leader(&self) -> bool {
        self.leader.is_leader()
    }
}

/// Runs the backfill controller with default [`Settings`] until `shutdown` resolves.
pub async fn run(
    client: kube::Client,
    leader: Leader,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    run_with(client, leader, Settings::default(), shutdown).await;
}

/// Runs the backfill controller until `shutdown` resolves.
pub async fn run_with(
    client: kube::Client,
    leader: Leader,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let shutdown = futures::FutureExt::shared(shutdown);
    let events = Events::new(client.clone());
    // Leadership gained: every policy is looked at again (those already observed are skipped).
    let gained = leader.gains();
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        leader,
        events,
        settings,
    });
    let work = Controller::new(
        Api::<MutationPolicy>::all(client),
        watcher::Config::default(),
    )
    .reconcile_all_on(gained)
    .graceful_shutdown_on(shutdown.clone())
    .run(reconcile, error_policy, ctx)
    .for_each(|r| {
        if let Err(e) = r {
            tracing::debug!(error = %e, "policy reconcile failed");
        }
        futures::future::ready(())
    });
    crate::drain::until_drained(work, shutdown).await;
}

fn error_policy(policy: Arc<MutationPolicy>, err: &Error, _ctx: Arc<Ctx>) -> Action {
    tracing::warn!(policy = %policy.name_any(), error = %err, "policy reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(policy: Arc<MutationPolicy>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if !ctx.is_leader() {
        return Ok(Action::await_change());
    }
    let generation = policy.metadata.generation.unwrap_or_default();
    let old = policy.status.clone().unwrap_or_default();
    let name = policy.name_any();
    let spec = &policy.spec;
    let valid = policy::validate(spec);
    // Native mode is kept on every reconcile (a deleted MutatingAdmissionPolicy comes back).
    let native = serve_natively(&ctx, &policy, valid.is_ok()).await?;
    let native = condition(
        &old,
        generation,
        NATIVE,
        native.native,
        native.reason,
        &native.message,
    );
    if old.observed_generation == generation && generation != 0 {
        let same = old.conditions.iter().any(|c| {
            c.type_ == NATIVE
                && c.status == native.status
                && c.reason == native.reason
                && c.message == native.message
        });
        if !same && ctx.is_leader() {
            let mut conditions: Vec<Condition> = old
                .conditions
                .iter()
                .filter(|c| c.type_ != NATIVE)
                .cloned()
                .collect();
            conditions.push(native);
            write_status(&ctx, &name, spec, generation, None, conditions).await?;
        }
        return Ok(Action::await_change());
    }

    if let Err(errors) = valid {
        tracing::warn!(policy = %name, ?errors, "invalid policy");
        let message = errors.join("; ");
        let conditions = vec![
            condition(&old, generation, "Valid", false, "Invalid", &message),
            condition(
                &old,
                generation,
                "Ready",
                false,
                "Invalid",
                "the policy is invalid (see the Valid condition); nothing is applied",
            ),
            native,
        ];
        write_status(&ctx, &name, spec, generation, None, conditions).await?;
        return Ok(Action::await_change());
    }
    let valid = condition(
        &old,
        generation,
        "Valid",
        true,
        "Valid",
        "the policy is valid",
    );

    if !spec.existing.enabled || !ctx.settings.backfill {
        let message = if spec.existing.enabled {
            "applied at admission only; existing workloads are left alone: this installation turns the backfill off (meshgate install --workload-backfill=false, chart value policies.workloadBackfill)"
        } else {
            "applied at admission only; existing workloads are left alone (spec.existing.enabled is false)"
        };
        let ready = condition(&old, generation, "Ready", true, "AdmissionOnly", message);
        write_status(
            &ctx,
            &name,
            spec,
            generation,
            None,
            vec![valid, ready, native],
        )
        .await?;
        return Ok(Action::await_change());
    }

    backfill_and_report(&ctx, &policy, &old, generation, [valid, native]).await
}

/// The backfill of existing workloads, then the policy's status (`Ready` with its counts) and
/// an Event; nothing once leadership is lost.
async fn backfill_and_report(
    ctx: &Ctx,
    policy: &MutationPolicy,
    old: &MutationPolicyStatus,
    generation: i64,
    [valid, native]: [Condition; 2],
) -> Result<Action, Error> {
    let name = policy.name_any();
    let spec = &policy.spec;
    let Some(pass) = backfill(ctx, &name, spec).await? else {
        tracing::info!(policy = %name, "leadership lost during the pass; the new leader repeats it");
        return Ok(Action::await_change());
    };
    let report = &pass.report;
    tracing::info!(policy = %name, ?report, failures = ?pass.failures, "existing workloads done");
    let counts = pass.counts();
    let ready = if report.failed == 0 {
        let reason = if report.dry_run { "DryRun" } else { "Applied" };
        condition(old, generation, "Ready", true, reason, &counts)
    } else {
        let quoted: Vec<&str> = pass
            .failures
            .iter()
            .take(MAX_FAILURE_MESSAGES)
            .map(String::as_str)
            .collect();
        let message = format!("{counts}; failures: {}", quoted.join("; "));
        condition(old, generation, "Ready", false, "SomeFailed", &message)
    };
    if !ctx.is_leader() {
        return Ok(Action::await_change());
    }
    write_status(
        ctx,
        &name,
        spec,
        generation,
        Some(&pass.report),
        vec![valid, ready, native],
    )
    .await?;
    let reason = if report.dry_run {
        "ExistingWorkloadsDryRun"
    } else {
        "ExistingWorkloadsMutated"
    };
    let type_ = if report.failed == 0 {
        EventType::Normal
    } else {
        EventType::Warning
    };
    event(
        ctx,
        policy,
        type_,
        reason,
        format!("policy {name}: {counts}"),
    )
    .await;
    Ok(Action::await_change())
}

/// The condition type that says which path applies a policy at admission.
pub const NATIVE: &str = "Native";

/// The `Native` condition's content.
struct NativeState {
    native: bool,
    reason: &'static str,
    message: String,
}

/// Native mode for one policy: its MutatingAdmissionPolicy and binding applied (server-side
/// apply, field manager `meshgate-controller`, owned by the policy) when it compiles, deleted
/// when it does not (or native mode is off); the state says which path serves the policy and why.
async fn serve_natively(
    ctx: &Ctx,
    policy: &MutationPolicy,
    valid: bool,
) -> Result<NativeState, Error> {
    let name = policy.name_any();
    let webhook = |reason: &'static str, message: String| NativeState {
        native: false,
        reason,
        message,
    };
    let Some(api) = ctx.settings.native else {
        return Ok(webhook(
            "Disabled",
            "the webhook applies the policy: native policies are off (the controller's --native-policies, or the API server serves no MutatingAdmissionPolicy API)".into(),
        ));
    };
    let (maps, bindings) = native_apis(&ctx.client, api);
    let native_name = native::native_name(&name);
    let state = if !valid {
        webhook(
            "Invalid",
            "the policy is invalid (see the Valid condition)".into(),
        )
    } else if let Err(why) = native::expressible(&policy.spec) {
        webhook(
            "NotExpressible",
            format!("the webhook applies the policy: {why}"),
        )
    } else {
        let entries = policy_kind_entries([&policy.spec]);
        let (resources, unresolved) = crate::registration::resolve(&ctx.client, &entries)
            .await
            .map_err(|source| Error::Native {
                policy: name.clone(),
                source,
            })?;
        if !unresolved.is_empty() {
            webhook(
                "KindsNotServed",
                format!(
                    "the webhook applies the policy: the API server does not serve {} (yet)",
                    unresolved.join(", ")
                ),
            )
        } else {
            let owner = policy.controller_owner_ref(&()).map(|mut o| {
                o.controller = None;
                o.block_owner_deletion = None;
                serde_json::to_value(o).unwrap_or(Value::Null)
            });
            let input = native::NativeInput {
                name: &name,
                spec: &policy.spec,
                resources: &resources,
                excluded_namespaces: &ctx.settings.excluded_namespaces,
                api,
                owner,
            };
            match native::compile(&input) {
                Err(why) => webhook(
                    "NotExpressible",
                    format!("the webhook applies the policy: {why}"),
                ),
                Ok(compiled) => {
                    if !ctx.is_leader() {
                        return Ok(webhook("NotLeader", String::new()));
                    }
                    let pp = PatchParams::apply(NATIVE_FIELD_MANAGER).force();
                    let apply = async {
                        maps.patch(&native_name, &pp, &Patch::Apply(&compiled.policy))
                            .await?;
                        bindings
                            .patch(&native_name, &pp, &Patch::Apply(&compiled.binding))
                            .await
                    };
                    apply.await.map_err(|source| Error::Native {
                        policy: name.clone(),
                        source,
                    })?;
                    return Ok(NativeState {
                        native: true,
                        reason: "MutatingAdmissionPolicy",
                        message: format!(
                            "the API server applies the policy itself (MutatingAdmissionPolicy and binding {native_name}); the webhook's pass after it changes nothing"
                        ),
                    });
                }
            }
        }
    };
    if ctx.is_leader() {
        remove_native(&name, &native_name, [&bindings, &maps], &state.message).await?;
    }
    Ok(state)
}

/// Deletes a policy's MutatingAdmissionPolicy binding and policy (`apis`) where they exist.
async fn remove_native(
    name: &str,
    native_name: &str,
    apis: [&Api<DynamicObject>; 2],
    why: &str,
) -> Result<(), Error> {
    for api in apis {
        match api.delete(native_name, &DeleteParams::default()).await {
            Ok(_) => tracing::info!(policy = %name, "native policy removed: {why}"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => {
                return Err(Error::Native {
                    policy: name.to_owned(),
                    source,
                });
            }
        }
    }
    Ok(())
}

/// The field manager of compiled MutatingAdmissionPolicies.
pub const NATIVE_FIELD_MANAGER: &str = "meshgate-controller";

/// The APIs of MutatingAdmissionPolicies and their bindings in `api`'s version.
fn native_apis(client: &kube::Client, api: PolicyApi) -> (Api<DynamicObject>, Api<DynamicObject>) {
    let (group, version) = api
        .api_version()
        .split_once('/')
        .unwrap_or(("admissionregistration.k8s.io", "v1"));
    let resource = |kind: &str, plural: &str| ApiResource {
        group: group.to_owned(),
        version: version.to_owned(),
        api_version: api.api_version().to_owned(),
        kind: kind.to_owned(),
        plural: plural.to_owned(),
    };
    (
        Api::all_with(
            client.clone(),
            &resource("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
        ),
        Api::all_with(
            client.clone(),
            &resource(
                "MutatingAdmissionPolicyBinding",
                "mutatingadmissionpolicybindings",
            ),
        ),
    )
}

/// A condition of the policy's status (see [`crate::conditions::condition`]).
fn condition(
    old: &MutationPolicyStatus,
    generation: i64,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
) -> Condition {
    crate::conditions::condition(
        &old.conditions,
        type_,
        status,
        reason,
        message,
        Some(generation),
    )
}

/// Merge patch of the status subresource; `existing: None` leaves the last report in place.
async fn write_status(
    ctx: &Ctx,
    name: &str,
    spec: &MutationPolicySpec,
    generation: i64,
    existing: Option<&ExistingReport>,
    conditions: Vec<Condition>,
) -> Result<(), Error> {
    // The ConfigMaps its context entries read: each must be granted to the webhook
    // (`meshgate install --context-config-map`). Empty clears an earlier list.
    let config_maps: Vec<String> = context::config_maps_named(spec)
        .into_iter()
        .map(|(ns, name)| format!("{ns}/{name}"))
        .collect();
    let mut status = serde_json::json!({
        "observedGeneration": generation,
        "conditions": conditions,
        "configMaps": if config_maps.is_empty() { Value::Null } else { config_maps.into() },
    });
    if let Some(report) = existing {
        status["existing"] = serde_json::to_value(report).unwrap_or(Value::Null);
    }
    let patch = serde_json::json!({"status": status});
    let pp = PatchParams {
        field_manager: Some(names::FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    Api::<MutationPolicy>::all(ctx.client.clone())
        .patch_status(name, &pp, &Patch::Merge(&patch))
        .await
        .map(|_| ())
        .map_err(|source| Error::Status {
            policy: name.to_owned(),
            source,
        })
}

async fn event(ctx: &Ctx, policy: &MutationPolicy, type_: EventType, reason: &str, note: String) {
    if let Err(e) = ctx
        .events
        .publish(
            type_,
            "MutateExisting",
            reason,
            &note,
            &policy.object_ref(&()),
        )
        .await
    {
        tracing::debug!(error = %e, "event not recorded");
    }
}

/// The result of one pass.
#[derive(Debug)]
struct Pass {
    report: ExistingReport,
    /// `Kind ns/name: message` of each failed workload.
    failures: Vec<String>,
    /// `kinds` entries the pass did not visit (wildcards).
    not_visited: Vec<String>,
}

impl Pass {
    fn counts(&self) -> String {
        let r = &self.report;
        let mut s = if r.dry_run {
            format!(
                "dry run: {} objects matched, {} would be mutated, {} already carry the mutation, {} failed",
                r.matched, r.mutated, r.unchanged, r.failed
            )
        } else {
            format!(
                "{} objects matched, {} mutated, {} already carried the mutation, {} failed",
                r.matched, r.mutated, r.unchanged, r.failed
            )
        };
        if r.bare_pods > 0 {
            s.push_str(&format!(
                "; {} bare pods match and are left alone (recreate them to get the mutation)",
                r.bare_pods
            ));
        }
        if !self.not_visited.is_empty() {
            s.push_str(&format!(
                "; kinds {} not visited (wildcard kinds are applied at admission only)",
                self.not_visited.join(", ")
            ));
        }
        s
    }
}

/// The resources of the policy's other kinds (not Pods and the workloads), with whether they
/// are namespaced, by discovery: the group's preferred version unless the entry names versions.
/// Also the entries not visited (wildcard kinds). An entry the API server does not serve has
/// nothing to visit.
async fn other_kinds(
    client: &kube::Client,
    spec: &MutationPolicySpec,
) -> Result<(Vec<(ApiResource, bool)>, Vec<String>), Error> {
    let entries = policy_kind_entries([spec]);
    let (wild, named): (Vec<String>, Vec<String>) = entries.into_iter().partition(|e| {
        meshgate_core::policy::parse_kind(e).is_ok_and(|(_, _, kind)| kind.contains(['*', '?']))
    });
    if named.is_empty() {
        return Ok((Vec::new(), wild));
    }
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .map_err(|source| Error::List {
            what: "API resources (discovery)",
            source,
        })?;
    let mut out: Vec<(ApiResource, bool)> = Vec::new();
    for entry in &named {
        let Ok((group, version, kind)) = meshgate_core::policy::parse_kind(entry) else {
            continue;
        };
        for g in discovery.groups() {
            if !group.is_none_or(|p| meshgate_core::policy::wildcard_match(p, g.name())) {
                continue;
            }
            let versions: Vec<String> = match version {
                Some(p) => g
                    .versions()
                    .filter(|v| meshgate_core::policy::wildcard_match(p, v))
                    .map(str::to_owned)
                    .collect(),
                None => g
                    .preferred_version()
                    .into_iter()
                    .map(str::to_owned)
                    .collect(),
            };
            for v in &versions {
                for (ar, caps) in g.versioned_resources(v) {
                    if ar.kind == kind
                        && !ar.plural.contains('/')
                        && !out.iter().any(|(o, _)| o == &ar)
                    {
                        let namespaced = caps.scope == kube::discovery::Scope::Namespaced;
                        out.push((ar, namespaced));
                    }
                }
            }
        }
    }
    Ok((out, wild))
}

/// A workload kind's name as a `'static` (for [`Error::List`]).
fn workload_name(kind: &str) -> &'static str {
    workload_resources()
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or("workloads", |(k, _)| *k)
}

/// The workload kinds, in the order they are visited.
fn workload_resources() -> [(&'static str, ApiResource); 6] {
    [
        ("Deployment", ApiResource::erase::<Deployment>(&())),
        ("StatefulSet", ApiResource::erase::<StatefulSet>(&())),
        ("DaemonSet", ApiResource::erase::<DaemonSet>(&())),
        ("ReplicaSet", ApiResource::erase::<ReplicaSet>(&())),
        ("Job", ApiResource::erase::<Job>(&())),
        ("CronJob", ApiResource::erase::<CronJob>(&())),
    ]
}

/// Spaces writes to at most `rate` per second.
struct Limiter {
    interval: Duration,
    next: Option<tokio::time::Instant>,
}

impl Limiter {
    fn new(rate: u32) -> Self {
        Self {
            interval: Duration::from_secs(1) / rate.max(1),
            next: None,
        }
    }

    async fn wait(&mut self) {
        let now = tokio::time::Instant::now();
        let at = self.next.filter(|n| *n > now).unwrap_or(now);
        tokio::time::sleep_until(at).await;
        self.next = Some(at + self.interval);
    }
}

/// The ConfigMaps the policy's `configMap` context entries name, read once per pass: one that
/// does not exist is absent, one that cannot be read (no RBAC grant: `meshgate install
/// --context-config-map`) fails the policy on every object, saying why.
async fn read_config_maps(client: &kube::Client, spec: &MutationPolicySpec) -> GivenObjects {
    let mut out = GivenObjects::read();
    for (namespace, name) in context::config_maps_named(spec) {
        let api = Api::<DynamicObject>::namespaced_with(
            client.clone(),
            &namespace,
            &ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
        );
        match api.get_opt(&name).await {
            Ok(Some(cm)) => match serde_json::to_value(&cm) {
                Ok(mut v) => {
                    v["apiVersion"] = "v1".into();
                    v["kind"] = "ConfigMap".into();
                    out.add(&v);
                }
                Err(e) => out.unreadable(&namespace, &name, e.to_string()),
            },
            Ok(None) => {}
            Err(e) => out.unreadable(&namespace, &name, format!("cannot be read: {e}")),
        }
    }
    out
}

/// One pass over existing workloads; `None` when leadership was lost.
async fn backfill(ctx: &Ctx, name: &str, spec: &MutationPolicySpec) -> Result<Option<Pass>, Error> {
    let namespaces = namespace_labels(&ctx.client).await?;
    let dry_run = spec.existing.dry_run;
    let mut pass = Pass {
        report: ExistingReport {
            dry_run,
            ..ExistingReport::default()
        },
        failures: Vec::new(),
        not_visited: Vec::new(),
    };
    let mut limiter = Limiter::new(spec.existing.rate_per_second);
    let config_maps = read_config_maps(&ctx.client, spec).await;
    // `apiCall` entries GET as the controller, once per path per pass.
    let reads = meshgate_kube::api_reader::ApiReads::new(&ctx.client, &config_maps);
    let input = PlanInput {
        policy: name,
        spec,
        namespaces: &namespaces,
        excluded: &ctx.settings.excluded_namespaces,
        cluster: &reads,
    };
    // The workloads (a list that fails fails the pass, which is retried), then the other kinds
    // the policy names (a list that fails, not granted, is one failure of the pass).
    let (others, not_visited) = other_kinds(&ctx.client, spec).await?;
    pass.not_visited = not_visited;
    let workloads = workload_resources()
        .into_iter()
        .map(|(_, resource)| (resource, true, true));
    let others = others
        .into_iter()
        .map(|(resource, namespaced)| (resource, namespaced, false));
    for (resource, namespaced, required) in workloads.chain(others) {
        let kind = resource.kind.clone();
        let api = Api::<DynamicObject>::all_with(ctx.client.clone(), &resource);
        let mut token: Option<String> = None;
        loop {
            let lp = ListParams {
                limit: Some(PAGE),
                continue_token: token.clone(),
                ..ListParams::default()
            };
            let list = match api.list(&lp).await {
                Ok(list) => list,
                Err(source) if required => {
                    return Err(Error::List {
                        what: workload_name(&kind),
                        source,
                    });
                }
                Err(e) => {
                    let grant = if resource.group.is_empty() {
                        resource.plural.clone()
                    } else {
                        format!("{}.{}", resource.plural, resource.group)
                    };
                    pass.report.failed += 1;
                    pass.failures.push(format!(
                        "{kind}: not listed: {e} (grant it with meshgate install --existing-kind {grant})"
                    ));
                    break;
                }
            };
            for obj in list.items {
                let outcome = mutate_object(
                    ctx,
                    &input,
                    &kind,
                    &resource,
                    namespaced,
                    obj,
                    dry_run,
                    &mut limiter,
                )
                .await;
                if !pass.record(&kind, outcome) {
                    return Ok(None);
                }
            }
            token = list.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                break;
            }
        }
    }
    pass.report.bare_pods = count_bare_pods(ctx, &input).await?;
    pass.report.last_applied = Some(Time(k8s_openapi::jiff::Timestamp::now()));
    Ok(Some(pass))
}

impl Pass {
    /// Counts one workload; `false` when leadership was lost.
    fn record(&mut self, kind: &str, outcome: Outcome) -> bool {
        let r = &mut self.report;
        match outcome {
            Outcome::Skipped => {}
            Outcome::Unchanged => {
                r.matched += 1;
                r.unchanged += 1;
            }
            Outcome::Mutated { namespace, name } => {
                r.matched += 1;
                r.mutated += 1;
                if r.changed.len() < MAX_CHANGED {
                    r.changed.push(object_ref(kind, &namespace, &name));
                }
            }
            Outcome::Failed {
                namespace,
                name,
                message,
            } => {
                r.matched += 1;
                r.failed += 1;
                tracing::warn!(kind, %namespace, %name, %message, "existing object not mutated");
                self.failures.push(format!(
                    "{}: {message}",
                    object_ref(kind, &namespace, &name)
                ));
            }
            Outcome::LostLeadership => return false,
        }
        true
    }
}

/// `Kind namespace/name`, or `Kind name` for a cluster-scoped object.
fn object_ref(kind: &str, namespace: &str, name: &str) -> String {
    if namespace.is_empty() {
        format!("{kind} {name}")
    } else {
        format!("{kind} {namespace}/{name}")
    }
}

/// What happened to one workload.
#[derive(Debug)]
enum Outcome {
    /// Not matched (or controlled by another workload).
    Skipped,
    Unchanged,
    Mutated {
        namespace: String,
        name: String,
    },
    Failed {
        namespace: String,
        name: String,
        message: String,
    },
    LostLeadership,
}

/// Reads, plans and writes one object, retrying on conflicts.
#[allow(clippy::too_many_arguments)]
async fn mutate_object(
    ctx: &Ctx,
    input: &PlanInput<'_>,
    kind: &str,
    resource: &ApiResource,
    namespaced: bool,
    obj: DynamicObject,
    dry_run: bool,
    limiter: &mut Limiter,
) -> Outcome {
    let namespace = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let failed = |message: String| Outcome::Failed {
        namespace: namespace.clone(),
        name: name.clone(),
        message,
    };
    let api = if namespaced {
        Api::<DynamicObject>::namespaced_with(ctx.client.clone(), &namespace, resource)
    } else {
        Api::<DynamicObject>::all_with(ctx.client.clone(), resource)
    };
    let mut object = workload_value(&obj, kind, resource);
    for attempt in 1..=MAX_ATTEMPTS {
        let (patch, tested) = match plan(input, &object) {
            Ok(Plan::Skip) => return Outcome::Skipped,
            // On a retry: someone else wrote the mutation meanwhile.
            Ok(Plan::Unchanged) => return Outcome::Unchanged,
            Ok(Plan::Change {
                patch,
                resource_version,
            }) => (patch, resource_version),
            Err(e) => return failed(e.to_string()),
        };
        if dry_run {
            return Outcome::Mutated {
                namespace: namespace.clone(),
                name: name.clone(),
            };
        }
        let patch: json_patch::Patch = match serde_json::from_value(Value::Array(patch.0)) {
            Ok(p) => p,
            Err(e) => return failed(format!("building the patch: {e}")),
        };
        limiter.wait().await;
        if !ctx.is_leader() {
            return Outcome::LostLeadership;
        }
        let pp = PatchParams {
            field_manager: Some(names::FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        let err = match api.patch(&name, &pp, &Patch::<()>::Json(patch)).await {
            Ok(_) => {
                tracing::info!(kind, %namespace, %name, policy = input.policy, "existing object mutated");
                return Outcome::Mutated {
                    namespace: namespace.clone(),
                    name: name.clone(),
                };
            }
            Err(e) => e,
        };
        let code = match &err {
            kube::Error::Api(status) => status.code,
            _ => 0,
        };
        if code != 409 && code != 422 {
            return failed(err.to_string());
        }
        // A failed `test` is a 422, like an invalid object: it is a conflict only when the
        // object has changed since it was read.
        let fresh = match api.get_opt(&name).await {
            Ok(Some(fresh)) => fresh,
            // Deleted meanwhile: nothing to mutate.
            Ok(None) => return Outcome::Skipped,
            Err(e) => return failed(format!("{err}; reading it again: {e}")),
        };
        if fresh.resource_version().as_deref() == Some(tested.as_str()) {
            return failed(err.to_string());
        }
        tracing::debug!(kind, %namespace, %name, attempt, "conflict; retrying with a fresh read");
        object = workload_value(&fresh, kind, resource);
    }
    failed(format!(
        "still conflicting after {MAX_ATTEMPTS} attempts (the object keeps changing)"
    ))
}

/// The object as JSON, with its `apiVersion` and `kind` (list items may come without them).
fn workload_value(obj: &DynamicObject, kind: &str, resource: &ApiResource) -> Value {
    let mut v = serde_json::to_value(obj).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert(
            "apiVersion".into(),
            Value::String(resource.api_version.clone()),
        );
        m.insert("kind".into(), Value::String(kind.to_owned()));
    }
    v
}

/// Labels of every namespace.
async fn namespace_labels(
    client: &kube::Client,
) -> Result<BTreeMap<String, BTreeMap<String, String>>, Error> {
    let api = Api::<Namespace>::all(client.clone());
    let mut out = BTreeMap::new();
    let mut token: Option<String> = None;
    loop {
        let lp = ListParams {
            limit: Some(PAGE),
            continue_token: token.clone(),
            ..ListParams::default()
        };
        let list = api.list_metadata(&lp).await.map_err(|source| Error::List {
            what: "namespaces",
            source,
        })?;
        for ns in list.items {
            out.insert(ns.name_any(), ns.metadata.labels.unwrap_or_default());
        }
        token = list.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(out);
        }
    }
}

/// Pods without a controlling owner that the policy matches.
async fn count_bare_pods(ctx: &Ctx, input: &PlanInput<'_>) -> Result<u32, Error> {
    let api = Api::<Pod>::all(ctx.client.clone());
    let mut count = 0u32;
    let mut token: Option<String> = None;
    loop {
        let lp = ListParams {
            limit: Some(PAGE),
            continue_token: token.clone(),
            ..ListParams::default()
        };
        let list = api.list_metadata(&lp).await.map_err(|source| Error::List {
            what: "pods",
            source,
        })?;
        for pod in &list.items {
            if is_bare_pod_match(input, pod) {
                count = count.saturating_add(1);
            }
        }
        token = list.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(count);
        }
    }
}

fn is_bare_pod_match(input: &PlanInput<'_>, pod: &PartialObjectMeta<Pod>) -> bool {
    if controller_of(pod.metadata.owner_references.as_deref()).is_some() {
        return false;
    }
    let object = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": serde_json::to_value(&pod.metadata).unwrap_or(Value::Null),
    });
    input.operation(&object).is_some()
}

fn controller_of(owners: Option<&[OwnerReference]>) -> Option<&OwnerReference> {
    owners?.iter().find(|o| o.controller == Some(true))
}

/// What a pass needs to decide about one object.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// The policy's name.
    pub policy: &'a str,
    pub spec: &'a MutationPolicySpec,
    /// Labels of every namespace, by name.
    pub namespaces: &'a BTreeMap<String, BTreeMap<String, String>>,
    /// Namespaces never mutated.
    pub excluded: &'a [String],
    /// Where `configMap` context entries are read.
    pub cluster: &'a dyn ClusterData,
}

impl<'a> PlanInput<'a> {
    /// The operation under which the policy matches `object` (an existing object is treated as
    /// created now, else as updated), or `None` when it does not match, is in an excluded
    /// namespace, or is opted out.
    fn operation(&self, object: &Value) -> Option<Operation> {
        let (namespace, namespace_labels) = self.namespace_of(object);
        if self.excluded.iter().any(|n| n == namespace) || opted_out(object) {
            return None;
        }
        if let Some(path) = object
            .get("kind")
            .and_then(Value::as_str)
            .and_then(pod_template_path)
            && !path.is_empty()
            && path
                .iter()
                .try_fold(object, |v, s| v.get(*s))
                .is_some_and(opted_out)
        {
            return None;
        }
        [Operation::Create, Operation::Update]
            .into_iter()
            .find(|&operation| {
                policy_matches(
                    self.spec,
                    object,
                    &MatchContext {
                        operation,
                        namespace,
                        namespace_labels: &namespace_labels,
                        cluster: self.cluster,
                    },
                )
            })
    }

    /// The object's namespace and its labels, as at admission: a Namespace is its own (its
    /// name, its labels), a cluster-scoped object has none.
    fn namespace_of<'o>(&self, object: &'o Value) -> (&'o str, Cow<'a, BTreeMap<String, String>>) {
        if object.get("kind").and_then(Value::as_str) == Some("Namespace")
            && object.get("apiVersion").and_then(Value::as_str) == Some("v1")
        {
            let name = object
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default();
            return (
                name,
                Cow::Owned(meshgate_core::policy::object_labels(object)),
            );
        }
        let namespace = object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let labels = self
            .namespaces
            .get(namespace)
            .map_or_else(|| Cow::Owned(BTreeMap::new()), Cow::Borrowed);
        (namespace, labels)
    }
}

/// What to do with one workload.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Not matched, or controlled by another workload whose template is mutated instead.
    Skip,
    /// Matched; its pod template carries the mutation already.
    Unchanged,
    /// Matched; write `patch` (a `test` of `resource_version`, then the pod template's changes).
    Change {
        patch: JsonPatch,
        resource_version: String,
    },
}

/// Decides about one workload object (with `apiVersion` and `kind`): pure.
pub fn plan(input: &PlanInput<'_>, object: &Value) -> Result<Plan, PolicyError> {
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let owners: Option<Vec<OwnerReference>> = object
        .pointer("/metadata/ownerReferences")
        .and_then(|o| serde_json::from_value(o.clone()).ok());
    let controlled_by = controller_of(owners.as_deref()).map(|o| o.kind.as_str());
    if matches!(
        (kind, controlled_by),
        ("ReplicaSet", Some("Deployment")) | ("Job", Some("CronJob"))
    ) {
        return Ok(Plan::Skip);
    }
    // What the policy writes: a workload's pod template, or with `target: Object` the workload
    // itself; an object of any other kind itself. Pods are never written (bare pods are
    // counted).
    let path: &[&str] = match pod_template_path(kind) {
        Some([]) => return Ok(Plan::Skip),
        Some(template) => match input.spec.target {
            MutationTarget::Pod => template,
            MutationTarget::Object => &[],
        },
        None => &[],
    };
    let Some(operation) = input.operation(object) else {
        return Ok(Plan::Skip);
    };
    let (namespace, namespace_labels) = input.namespace_of(object);
    let ctx = MatchContext {
        operation,
        namespace,
        namespace_labels: &namespace_labels,
        cluster: input.cluster,
    };
    let applied = policy::apply([(input.policy, input.spec)], object, &ctx);
    if let Some(e) = applied.failed.first() {
        return Err(e.clone());
    }
    let template_at = |v: &'_ Value| path.iter().try_fold(v, |v, s| v.get(*s)).cloned();
    let (Some(before), Some(after)) = (template_at(object), template_at(&applied.object)) else {
        return Ok(Plan::Skip);
    };
    if !applied.changed() || before == after {
        return Ok(Plan::Unchanged);
    }
    let resource_version = object
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let prefix: String = path.iter().map(|s| format!("/{}", escape(s))).collect();
    let mut patch = JsonPatch(vec![serde_json::json!({
        "op": "test", "path": "/metadata/resourceVersion", "value": resource_version,
    })]);
    for mut op in JsonPatch::diff(&before, &after).0 {
        for key in ["path", "from"] {
            if let Some(Value::String(p)) = op.get_mut(key) {
                *p = format!("{prefix}{p}");
            }
        }
        patch.0.push(op);
    }
    Ok(Plan::Change {
        patch,
        resource_version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_api::LabelSelector;
    use meshgate_api::mutation_policy::{MatchResources, MetadataMutation, Mutation};
    use serde_json::json;

    const KEY: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";

    fn spec(match_: MatchResources) -> MutationPolicySpec {
        MutationPolicySpec {
            match_,
            exclude: None,
            pod_templates: true,
            target: Default::default(),
            mutations: vec![Mutation {
                annotations: Some(MetadataMutation {
                    values: [(KEY.to_owned(), "0.0.0.0/0".to_owned())].into(),
                    on_conflict: Default::default(),
                }),
                ..Mutation::default()
            }],
            warning: None,
            existing: Default::default(),
        }
    }

    fn namespaces() -> BTreeMap<String, BTreeMap<String, String>> {
        [
            (
                "mesh".to_owned(),
                [("mesh".to_owned(), "on".to_owned())].into(),
            ),
            ("plain".to_owned(), BTreeMap::new()),
            (
                "kube-system".to_owned(),
                [("mesh".to_owned(), "on".to_owned())].into(),
            ),
        ]
        .into()
    }

    fn deployment(ns: &str) -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": ns, "resourceVersion": "42"},
            "spec": {"template": {"metadata": {"labels": {"app": "web"}},
                                  "spec": {"containers": [{"name": "app", "image": "x"}]}}},
        })
    }

    fn input<'a>(
        spec: &'a MutationPolicySpec,
        namespaces: &'a BTreeMap<String, BTreeMap<String, String>>,
        excluded: &'a [String],
    ) -> PlanInput<'a> {
        PlanInput {
            policy: "p",
            spec,
            namespaces,
            excluded,
            cluster: &meshgate_core::policy::context::NoCluster,
        }
    }

    fn mesh_selector() -> MatchResources {
        MatchResources {
            namespace_selector: Some(LabelSelector::labels([("mesh", "on")])),
            ..MatchResources::default()
        }
    }

    #[test]
    fn a_matching_workload_gets_a_locked_patch_of_its_template_only() {
        let s = spec(mesh_selector());
        let ns = namespaces();
        let plan = plan(&input(&s, &ns, &[]), &deployment("mesh")).unwrap();
        let Plan::Change {
            patch,
            resource_version,
        } = plan
        else {
            panic!("expected a change, got {plan:?}");
        };
        assert_eq!(resource_version, "42");
        assert_eq!(
            patch.0[0],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "42"})
        );
        assert!(patch.len() > 1);
        for op in &patch.0[1..] {
            let path = op["path"].as_str().unwrap();
            assert!(path.starts_with("/spec/template/"), "{path}");
        }
        let patched = patch.apply(&deployment("mesh")).unwrap();
        assert_eq!(
            patched["spec"]["template"]["metadata"]["annotations"][KEY],
            "0.0.0.0/0"
        );
        assert_eq!(patched["metadata"], deployment("mesh")["metadata"]);
        // Applying the policy again changes nothing.
        assert_eq!(plan_of(&s, &ns, &patched), Plan::Unchanged);
    }

    #[test]
    fn other_kinds_are_written_whole_and_a_namespace_matches_by_its_own_labels() {
        let s = spec(MatchResources {
            kinds: vec!["Service".to_owned(), "Namespace".to_owned()],
            ..mesh_selector()
        });
        let ns = namespaces();
        let service = |namespace: &str| {
            serde_json::json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "api", "namespace": namespace, "resourceVersion": "7"},
                "spec": {"ports": [{"port": 80}]}})
        };
        let Plan::Change { patch, .. } = plan_of(&s, &ns, &service("mesh")) else {
            panic!("expected a change");
        };
        let patched = patch.apply(&service("mesh")).unwrap();
        assert_eq!(patched["metadata"]["annotations"][KEY], "0.0.0.0/0");
        assert_eq!(plan_of(&s, &ns, &service("plain")), Plan::Skip);
        // A Namespace is matched by its own labels (as at admission), not by a namespace's.
        let namespace = |labels: Value| {
            serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "fresh", "labels": labels, "resourceVersion": "3"}})
        };
        assert!(matches!(
            plan_of(&s, &ns, &namespace(serde_json::json!({"mesh": "on"}))),
            Plan::Change { .. }
        ));
        assert_eq!(
            plan_of(&s, &ns, &namespace(serde_json::json!({}))),
            Plan::Skip
        );
        // Pods are never written: the backfill counts bare pods.
        let pod_policy = spec(MatchResources {
            kinds: vec!["Pod".to_owned()],
            ..mesh_selector()
        });
        let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "mesh"}, "spec": {"containers": []}});
        assert_eq!(plan_of(&pod_policy, &ns, &pod), Plan::Skip);
    }

    #[test]
    fn an_object_target_policy_writes_the_workload_itself() {
        let mut s = spec(MatchResources {
            kinds: vec!["Deployment".to_owned()],
            ..mesh_selector()
        });
        s.pod_templates = false;
        s.target = MutationTarget::Object;
        let ns = namespaces();
        let Plan::Change { patch, .. } = plan_of(&s, &ns, &deployment("mesh")) else {
            panic!("expected a change");
        };
        for op in &patch.0[1..] {
            let path = op["path"].as_str().unwrap();
            assert!(path.starts_with("/metadata/annotations"), "{path}");
        }
        let patched = patch.apply(&deployment("mesh")).unwrap();
        assert_eq!(patched["metadata"]["annotations"][KEY], "0.0.0.0/0");
        assert_eq!(patched["spec"], deployment("mesh")["spec"]);
        assert_eq!(plan_of(&s, &ns, &patched), Plan::Unchanged);
    }

    fn plan_of(
        s: &MutationPolicySpec,
        ns: &BTreeMap<String, BTreeMap<String, String>>,
        object: &Value,
    ) -> Plan {
        plan(&input(s, ns, &[]), object).unwrap()
    }

    #[test]
    fn cronjob_templates_are_patched_below_the_job_template() {
        let s = spec(mesh_selector());
        let ns = namespaces();
        let cj = json!({
            "apiVersion": "batch/v1", "kind": "CronJob",
            "metadata": {"name": "c", "namespace": "mesh", "resourceVersion": "7"},
            "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": {
                "spec": {"containers": [{"name": "app", "image": "x"}]}}}}},
        });
        let Plan::Change { patch, .. } = plan_of(&s, &ns, &cj) else {
            panic!("expected a change");
        };
        let patched = patch.apply(&cj).unwrap();
        assert_eq!(
            patched["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["annotations"][KEY],
            "0.0.0.0/0"
        );
    }

    #[test]
    fn unmatched_excluded_opted_out_and_owned_workloads_are_skipped() {
        let s = spec(mesh_selector());
        let ns = namespaces();
        assert_eq!(plan_of(&s, &ns, &deployment("plain")), Plan::Skip);
        let excluded = GateConfig::default().excluded_namespaces;
        assert_eq!(
            plan(&input(&s, &ns, &excluded), &deployment("kube-system")).unwrap(),
            Plan::Skip
        );
        let mut opted = deployment("mesh");
        opted["spec"]["template"]["metadata"]["labels"][names::OPT_OUT] = json!("false");
        assert_eq!(plan_of(&s, &ns, &opted), Plan::Skip);

        let owned_by = |kind: &str, owner: &str| {
            let mut o = deployment("mesh");
            o["kind"] = json!(kind);
            o["apiVersion"] = json!(if kind == "Job" { "batch/v1" } else { "apps/v1" });
            o["metadata"]["ownerReferences"] = json!([{
                "apiVersion": "apps/v1", "kind": owner, "name": "o", "uid": "u", "controller": true,
            }]);
            o
        };
        assert_eq!(
            plan_of(&s, &ns, &owned_by("ReplicaSet", "Deployment")),
            Plan::Skip
        );
        assert_eq!(plan_of(&s, &ns, &owned_by("Job", "CronJob")), Plan::Skip);
        // A ReplicaSet of another controller is its own workload.
        assert!(matches!(
            plan_of(&s, &ns, &owned_by("ReplicaSet", "Rollout")),
            Plan::Change { .. }
        ));
    }

    #[test]
    fn create_only_and_update_only_policies_both_match_existing_workloads() {
        let ns = namespaces();
        for ops in [vec![], vec![Operation::Create], vec![Operation::Update]] {
            let s = spec(MatchResources {
                operations: ops.clone(),
                ..mesh_selector()
            });
            assert!(
                matches!(plan_of(&s, &ns, &deployment("mesh")), Plan::Change { .. }),
                "{ops:?}"
            );
        }
        // A policy for Pods without podTemplates does not touch workloads.
        let mut pods_only = spec(mesh_selector());
        pods_only.pod_templates = false;
        assert_eq!(plan_of(&pods_only, &ns, &deployment("mesh")), Plan::Skip);
    }

    #[test]
    fn bare_pods_are_those_without_a_controller() {
        let s = spec(mesh_selector());
        let ns = namespaces();
        let i = input(&s, &ns, &[]);
        let pod = |owners: Value| -> PartialObjectMeta<Pod> {
            serde_json::from_value(json!({
                "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                "metadata": {"name": "p", "namespace": "mesh", "ownerReferences": owners},
            }))
            .unwrap()
        };
        assert!(is_bare_pod_match(&i, &pod(json!([]))));
        assert!(is_bare_pod_match(
            &i,
            &pod(json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "u"}]))
        ));
        assert!(!is_bare_pod_match(
            &i,
            &pod(
                json!([{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r", "uid": "u",
                         "controller": true}])
            )
        ));
    }

    #[test]
    fn limiter_spaces_writes() {
        let l = Limiter::new(4);
        assert_eq!(l.interval, Duration::from_millis(250));
        assert_eq!(Limiter::new(0).interval, Duration::from_secs(1));
    }
}

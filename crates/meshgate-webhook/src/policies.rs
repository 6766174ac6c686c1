//! The `/mutate/policies` handler: MutationPolicies on pods and pod templates.
//!
//! Each policy applies or fails on its own (`meshgate_core::policy::apply`): a policy that fails
//! on an object (a JSON patch path that does not exist, say) does not block the object or the
//! other policies; the object is admitted with the others' mutations, a warning names the failed
//! policy and the error, and the failure is logged and counted per policy
//! (`meshgate_webhook_policy_failures_total{policy}`). Policies are conveniences; blocking
//! workloads because of one would be worse than the missing mutation.

use meshgate_api::mutation_policy::Operation;
use meshgate_core::patch::JsonPatch;
use meshgate_core::policy::{self, MatchContext};

use crate::admission::{Request, object_name};
use crate::app::{App, Handled};
use crate::metrics::MutationLabels;

pub(crate) async fn handle(app: &App, req: Request<'_>) -> Result<Handled, (u16, String)> {
    let operation = match req.operation {
        "CREATE" => Operation::Create,
        "UPDATE" => Operation::Update,
        _ => return Ok(Handled::unchanged("operation")),
    };
    if app
        .config
        .excluded_namespaces
        .iter()
        .any(|n| *n == req.namespace)
    {
        return Ok(Handled::unchanged("excluded-namespace"));
    }
    let policies = app.sources.policies();
    if policies.is_empty() {
        return Ok(Handled::unchanged("unchanged"));
    }
    let object = crate::admission::object_value(&req)?;
    // A cluster-scoped object has no namespace; a Namespace is its own (the API server sets the
    // request's namespace to its name), and may not exist yet.
    let namespace_meta;
    let mut namespace_warnings = Vec::new();
    let object_labels;
    let labels = if req.kind == "Namespace" {
        object_labels = policy::object_labels(&object);
        &object_labels
    } else if req.namespace.is_empty() {
        object_labels = Default::default();
        &object_labels
    } else {
        let unread;
        (namespace_meta, unread) = crate::handlers::namespace_or_empty(app, &req.namespace).await;
        namespace_warnings = unread;
        &namespace_meta.labels
    };
    // `apiCall` context entries GET through the webhook's client, once per path per review.
    let reads;
    let cluster: &dyn meshgate_core::policy::context::ClusterData = match app.sources.api_client() {
        Some(client) => {
            reads = meshgate_kube::api_reader::ApiReads::new(client, app.sources.cluster_data());
            &reads
        }
        None => app.sources.cluster_data(),
    };
    let ctx = MatchContext {
        operation,
        namespace: &req.namespace,
        namespace_labels: labels,
        cluster,
    };
    let applied = policy::apply(policies.iter().map(|(n, s)| (n.as_str(), s)), &object, &ctx);
    let mut warnings = namespace_warnings;
    warnings.extend(report_failures(app, &req, &object, &applied.failed));
    match applied {
        applied if applied.changed() => {
            if !req.dry_run {
                app.metrics
                    .mutations
                    .get_or_create(&MutationLabels { mutation: "policy" })
                    .inc_by(applied.policies.len() as u64);
            }
            tracing::info!(
                uid = %req.uid,
                kind = %req.kind,
                namespace = %req.namespace,
                name = object_name(&object),
                dry_run = req.dry_run,
                policies = ?applied.policies,
                "policies applied"
            );
            warnings.extend(applied.warnings);
            Ok(Handled {
                patch: policy::admission_patch(&object, &applied.object),
                warnings,
                outcome: if applied.failed.is_empty() {
                    "mutated"
                } else {
                    "mutated-policy-error"
                },
            })
        }
        applied if applied.failed.is_empty() => Ok(Handled::unchanged("unchanged")),
        _ => Ok(Handled {
            patch: JsonPatch::default(),
            warnings,
            outcome: "policy-error",
        }),
    }
}

/// Each policy that failed on the object: logged, counted (not for a dry run), and a warning.
fn report_failures(
    app: &App,
    req: &Request<'_>,
    object: &serde_json::Value,
    failed: &[policy::PolicyError],
) -> Vec<String> {
    let mut warnings = Vec::new();
    for e in failed {
        tracing::error!(
            uid = %req.uid,
            kind = %req.kind,
            namespace = %req.namespace,
            name = object_name(object),
            error = %e,
            "policy failed; object admitted without it"
        );
        if !req.dry_run {
            app.metrics
                .policy_failures
                .get_or_create(&crate::metrics::PolicyLabels {
                    policy: e.policy().to_owned(),
                })
                .inc();
        }
        warnings.push(format!("meshgate: {e}; admitted without this policy"));
    }
    warnings
}

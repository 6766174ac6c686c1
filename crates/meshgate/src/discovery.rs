//! What the API server serves, for choices made at install time (one rule, in the controller
//! crate, which makes the same choice at run time).

pub use meshgate_controller::discovery::{
    PROBE_WAIT, PolicyEnforcement, policy_api, prove_policy_api,
};

/// Whether the API server runs the MutatingAdmissionPolicy API it serves: proven by a probe
/// policy (created in, and removed from, the cluster), or, with `dry_run`, served only.
pub async fn policy_enforcement(client: &kube::Client, dry_run: bool) -> PolicyEnforcement {
    if dry_run {
        return match policy_api(client).await {
            Some(api) => PolicyEnforcement::Unproven(api, "--dry-run writes no probe".into()),
            None => PolicyEnforcement::NotServed,
        };
    }
    prove_policy_api(client, "default", PROBE_WAIT).await
}

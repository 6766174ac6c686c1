//! What the API server serves, for choices made at install time (one rule, in the controller
//! crate, which makes the same choice at run time).

pub use meshgate_controller::discovery::{PolicyEnforcement, policy_api, prove_policy_api};

/// How long `install` and `check` wait for a probe policy to apply before they conclude that
/// the API server does not run MutatingAdmissionPolicies (it picks one up within a second or
/// two; concluding wrongly only makes meshgate use its webhook).
pub const PROBE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

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

//! Import of Kyverno policies as MutationPolicies (`meshgate import kyverno`): [`import`] takes
//! one policy document and gives the MutationPolicies it converts to, with notes on what did not
//! convert faithfully.
//!
//! * [`cluster_policy`]: `kyverno.io` `ClusterPolicy` and `Policy` mutate rules (patches,
//!   anchors, variables, `foreach`, context entries, Kyverno's pod-controller autogen);
//! * [`mutating_policy`]: `policies.kyverno.io` `MutatingPolicy` (CEL), where a MutationPolicy
//!   can say it;
//! * [`outcome`]: what both give ([`KyvernoImport`], [`KyvernoError`]).

pub mod cluster_policy;
pub mod mutating_policy;
pub mod outcome;

use serde_json::Value;

pub use cluster_policy::AUTOGEN_ANNOTATION;
pub use outcome::{KyvernoError, KyvernoImport};

/// Converts one Kyverno policy: a `MutatingPolicy`, or a `ClusterPolicy` / `Policy`'s mutate
/// rules.
pub fn import(doc: &Value) -> Result<KyvernoImport, KyvernoError> {
    if mutating_policy::is_mutating_policy(doc) {
        mutating_policy::import(doc)
    } else {
        cluster_policy::import(doc)
    }
}

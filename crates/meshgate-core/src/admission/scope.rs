//! What the webhook registrations and the native gate's policy share: the namespaces a
//! registration leaves out, and how a failure policy is spelled.

use meshgate_api::config::FailurePolicy;
use meshgate_api::{LabelSelector, SelectorOperator};

/// `ns` with the namespaces in `excluded` left out (`kubernetes.io/metadata.name NotIn`).
pub(crate) fn with_exclusions(mut ns: LabelSelector, excluded: &[String]) -> LabelSelector {
    if !excluded.is_empty() {
        let values: Vec<&str> = excluded.iter().map(String::as_str).collect();
        ns = ns.with(
            "kubernetes.io/metadata.name",
            SelectorOperator::NotIn,
            &values,
        );
    }
    ns
}

/// The API server's spelling of a failure policy.
pub(crate) fn failure_policy(p: FailurePolicy) -> &'static str {
    match p {
        FailurePolicy::Ignore => "Ignore",
        FailurePolicy::Fail => "Fail",
    }
}

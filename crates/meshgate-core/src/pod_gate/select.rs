//! Which pods the init gate selects: one predicate, derived from the same [`GateConfig`] that
//! generates the webhook's registration.

use std::collections::BTreeMap;

pub use crate::object::Meta;
use meshgate_api::GateConfig;
use meshgate_api::config::SelectorClause;

fn all_equal(want: &BTreeMap<String, String>, have: &BTreeMap<String, String>) -> bool {
    want.iter().all(|(k, v)| have.get(k) == Some(v))
}

/// Whether one clause selects the pod.
pub fn clause_matches(clause: &SelectorClause, namespace: &Meta, pod: &Meta) -> bool {
    clause.namespace_selector.matches(&namespace.labels)
        && clause.object_selector.matches(&pod.labels)
        && all_equal(&clause.namespace_annotations, &namespace.annotations)
        && all_equal(&clause.pod_annotations, &pod.annotations)
        && !clause
            .pod_annotations_absent
            .iter()
            .any(|(k, v)| pod.annotations.get(k) == Some(v))
}

/// Whether the webhook needs a namespace's annotations (some clause reads them).
pub fn needs_namespace_annotations(config: &GateConfig) -> bool {
    config
        .clauses()
        .iter()
        .any(SelectorClause::needs_namespace_annotations)
}

//! What the API server's own admission policies are written in: CEL string and list literals,
//! label selectors and the opt-out as CEL conditions, and the `admissionregistration.k8s.io`
//! version that serves `MutatingAdmissionPolicy` ([`PolicyApi`]). Every native path writes with
//! them: the pod gate as an admission policy ([`crate::admission::native_gate`]), the node-taint
//! policy ([`crate::admission::registration::node_taint_policy`]) and compiled `MutationPolicy`s
//! ([`crate::policy::native`]).

use meshgate_api::{LabelSelector, SelectorOperator, names};

/// The admission-policy API versions an API server may serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyApi {
    /// `admissionregistration.k8s.io/v1` (Kubernetes 1.36+).
    V1,
    /// `admissionregistration.k8s.io/v1beta1` (behind its feature gate before 1.36).
    V1beta1,
}

impl PolicyApi {
    /// What a Kubernetes 1.`minor` API server serves *and runs* with its defaults: v1 from 1.36
    /// (GA, its feature gate on); before, the beta API and its feature gate are both off by
    /// default, so nothing.
    pub fn enforced_by_default(minor: u32) -> Option<Self> {
        (minor >= 36).then_some(Self::V1)
    }

    /// The minor of a Kubernetes version as users write it: `1.35`, `v1.35.4`.
    pub fn minor_of(version: &str) -> Option<u32> {
        let mut parts = version.trim().trim_start_matches('v').split('.');
        (parts.next()? == "1").then_some(())?;
        parts.next()?.parse().ok()
    }

    pub fn api_version(self) -> &'static str {
        match self {
            PolicyApi::V1 => "admissionregistration.k8s.io/v1",
            PolicyApi::V1beta1 => "admissionregistration.k8s.io/v1beta1",
        }
    }
}

/// `meta.labels[key] == value`, false when absent.
pub fn has_value(meta: &str, field: &str, key: &str) -> String {
    format!(
        "(has({meta}.{field}) && {k} in {meta}.{field})",
        k = cel_string(key)
    )
}

/// A label selector over `meta.labels`, with the API server's semantics.
pub fn selector_cel(meta: &str, selector: &LabelSelector) -> String {
    let mut terms = Vec::new();
    let value = |key: &str| format!("{meta}.labels[{}]", cel_string(key));
    for (k, v) in &selector.match_labels {
        terms.push(format!(
            "({} && {} == {})",
            has_value(meta, "labels", k),
            value(k),
            cel_string(v)
        ));
    }
    for r in &selector.match_expressions {
        let present = has_value(meta, "labels", &r.key);
        terms.push(match r.operator {
            SelectorOperator::In => format!(
                "({present} && {} in {})",
                value(&r.key),
                cel_list(&r.values)
            ),
            SelectorOperator::NotIn => format!(
                "!({present} && {} in {})",
                value(&r.key),
                cel_list(&r.values)
            ),
            SelectorOperator::Exists => present,
            SelectorOperator::DoesNotExist => format!("!{present}"),
        });
    }
    if terms.is_empty() {
        "true".into()
    } else {
        format!("({})", terms.join(" && "))
    }
}

/// The opt-out (`meshgate.dev/inject: "false"` as a label or an annotation) on `meta`.
pub fn opted_out(meta: &str) -> String {
    let key = cel_string(names::OPT_OUT);
    format!(
        "(({l} && {meta}.labels[{key}] == \"false\") || ({a} && {meta}.annotations[{key}] == \"false\"))",
        l = has_value(meta, "labels", names::OPT_OUT),
        a = has_value(meta, "annotations", names::OPT_OUT),
    )
}

/// A CEL list of string literals.
pub fn cel_list<S: AsRef<str>>(items: &[S]) -> String {
    let items: Vec<String> = items.iter().map(|s| cel_string(s.as_ref())).collect();
    format!("[{}]", items.join(", "))
}

/// A CEL string literal.
pub fn cel_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offline_renders_follow_each_minors_defaults() {
        assert_eq!(PolicyApi::minor_of("1.35"), Some(35));
        assert_eq!(PolicyApi::minor_of("v1.37.2"), Some(37));
        assert_eq!(PolicyApi::minor_of("2.1"), None);
        assert_eq!(PolicyApi::minor_of("v1"), None);
        assert_eq!(PolicyApi::enforced_by_default(34), None);
        assert_eq!(PolicyApi::enforced_by_default(35), None);
        assert_eq!(PolicyApi::enforced_by_default(36), Some(PolicyApi::V1));
        assert_eq!(PolicyApi::enforced_by_default(37), Some(PolicyApi::V1));
    }
}

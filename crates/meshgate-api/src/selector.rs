//! A Kubernetes label selector with its matching rules.
//!
//! k8s-openapi's `LabelSelector` carries the wire shape but no semantics; this type has the same
//! JSON form and implements the API server's matching, so the webhook, the controller and the
//! offline `render` agree with the API server on which objects a selector picks.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `metav1.LabelSelector`. An empty selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

/// One `matchExpressions` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelectorRequirement {
    pub key: String,
    pub operator: SelectorOperator,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// `matchExpressions` operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SelectorOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl LabelSelector {
    /// A selector with `matchLabels` only.
    pub fn labels<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self {
            match_labels: pairs
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            match_expressions: Vec::new(),
        }
    }

    /// Adds one expression.
    pub fn with(mut self, key: &str, operator: SelectorOperator, values: &[&str]) -> Self {
        self.match_expressions.push(LabelSelectorRequirement {
            key: key.to_owned(),
            operator,
            values: values.iter().map(|v| (*v).to_owned()).collect(),
        });
        self
    }

    pub fn is_empty(&self) -> bool {
        self.match_labels.is_empty() && self.match_expressions.is_empty()
    }

    /// The API server's semantics: every `matchLabels` pair and every expression must hold.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }

    /// Structural checks the API server would make (operator/value agreement).
    pub fn validate(&self) -> Result<(), String> {
        for r in &self.match_expressions {
            match r.operator {
                SelectorOperator::In | SelectorOperator::NotIn if r.values.is_empty() => {
                    return Err(format!(
                        "matchExpressions key {:?}: operator {:?} needs at least one value",
                        r.key, r.operator
                    ));
                }
                SelectorOperator::Exists | SelectorOperator::DoesNotExist
                    if !r.values.is_empty() =>
                {
                    return Err(format!(
                        "matchExpressions key {:?}: operator {:?} takes no values",
                        r.key, r.operator
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The k8s-openapi form, for objects sent to the API server.
    pub fn to_k8s(&self) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
        meta::LabelSelector {
            match_labels: (!self.match_labels.is_empty()).then(|| self.match_labels.clone()),
            match_expressions: (!self.match_expressions.is_empty()).then(|| {
                self.match_expressions
                    .iter()
                    .map(|r| meta::LabelSelectorRequirement {
                        key: r.key.clone(),
                        operator: format!("{:?}", r.operator),
                        values: (!r.values.is_empty()).then(|| r.values.clone()),
                    })
                    .collect()
            }),
        }
    }
}

impl LabelSelectorRequirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            SelectorOperator::In => value.is_some_and(|v| self.values.contains(v)),
            SelectorOperator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            SelectorOperator::Exists => value.is_some(),
            SelectorOperator::DoesNotExist => value.is_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn empty_matches_everything() {
        assert!(LabelSelector::default().matches(&l(&[])));
        assert!(LabelSelector::default().matches(&l(&[("a", "b")])));
    }

    #[test]
    fn operators_follow_the_api_server() {
        let s = LabelSelector::labels([("app", "web")])
            .with("tier", SelectorOperator::In, &["a", "b"])
            .with("mode", SelectorOperator::NotIn, &["none"])
            .with("x", SelectorOperator::Exists, &[])
            .with("y", SelectorOperator::DoesNotExist, &[]);
        assert!(s.matches(&l(&[("app", "web"), ("tier", "a"), ("x", "")])));
        assert!(s.matches(&l(&[
            ("app", "web"),
            ("tier", "b"),
            ("x", "1"),
            ("mode", "m")
        ])));
        assert!(!s.matches(&l(&[("app", "web"), ("tier", "c"), ("x", "")])));
        assert!(!s.matches(&l(&[
            ("app", "web"),
            ("tier", "a"),
            ("x", ""),
            ("mode", "none")
        ])));
        assert!(!s.matches(&l(&[("app", "web"), ("tier", "a")])));
        assert!(!s.matches(&l(&[("app", "web"), ("tier", "a"), ("x", ""), ("y", "")])));
        assert!(!s.matches(&l(&[("app", "api"), ("tier", "a"), ("x", "")])));
    }

    #[test]
    fn validation_names_the_key() {
        let bad = LabelSelector::default().with("k", SelectorOperator::In, &[]);
        assert!(bad.validate().unwrap_err().contains("\"k\""));
        let bad = LabelSelector::default().with("k", SelectorOperator::Exists, &["v"]);
        assert!(bad.validate().is_err());
    }
}

//! Offline application of policies to documents (`meshgate render`).

use std::collections::BTreeMap;

use meshgate_api::mutation_policy::{MutationPolicySpec, Operation};
use serde_json::Value;

use super::context::GivenObjects;
use super::{MatchContext, PolicyError, admission_patch, apply, validate};
use crate::object::patch::JsonPatch;

/// One rendered document.
#[derive(Clone, Debug, PartialEq)]
pub struct RenderedDoc {
    /// Position of the document in the input.
    pub index: usize,
    /// The document after the policies.
    pub object: Value,
    /// The JSON patch the webhook would return for it (empty: unchanged).
    pub patch: JsonPatch,
    /// Policies that changed it, in application order.
    pub policies: Vec<String>,
    /// Their warnings, `"<policy>: <warning>"`.
    pub warnings: Vec<String>,
    /// Policies that matched but could not be applied to it (the others still were).
    pub failed: Vec<PolicyError>,
}

/// Why rendering failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// A policy does not pass [`validate`].
    #[error("policy {name} is invalid: {}", errors.join("; "))]
    InvalidPolicy { name: String, errors: Vec<String> },
    /// A document is not an object.
    #[error("document {index}: {message}")]
    Document { index: usize, message: String },
}

/// The namespace a document is created in offline, and its labels: `metadata.namespace`
/// (`"default"` when unset) with labels from `namespace_labels`; none for the cluster-scoped
/// kinds of [`super::matching::CLUSTER_SCOPED_KINDS`]; a Namespace is its own, with its own
/// labels.
pub fn document_namespace(
    doc: &Value,
    namespace_labels: &dyn Fn(&str) -> BTreeMap<String, String>,
) -> (String, BTreeMap<String, String>) {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
    if kind == "Namespace" {
        let name = doc
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        (name, super::object_labels(doc))
    } else if super::matching::CLUSTER_SCOPED_KINDS.contains(&kind) {
        (String::new(), BTreeMap::new())
    } else {
        let namespace = doc
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .unwrap_or("default")
            .to_owned();
        let labels = namespace_labels(&namespace);
        (namespace, labels)
    }
}

/// Applies `policies` to each document as the webhook would to a CREATE of it: the namespace is
/// `metadata.namespace` (`"default"` when unset; none for the cluster-scoped kinds of
/// [`super::matching::CLUSTER_SCOPED_KINDS`], a Namespace being its own), its labels come from
/// `namespace_labels` (a Namespace's from its own labels).
/// `configMap` context entries read the ConfigMaps of `docs` (one not given fails the policy on
/// that object, saying so). Every policy is validated first. `null` documents (empty YAML documents) pass through
/// unchanged; any other non-object is an error naming the document's index.
pub fn render(
    docs: Vec<Value>,
    policies: &[(String, MutationPolicySpec)],
    namespace_labels: &dyn Fn(&str) -> BTreeMap<String, String>,
) -> Result<Vec<RenderedDoc>, RenderError> {
    for (name, spec) in policies {
        validate(spec).map_err(|errors| RenderError::InvalidPolicy {
            name: name.clone(),
            errors,
        })?;
    }
    // `configMap` context entries read the ConfigMaps of the input, `apiCall` entries its
    // objects (as given, before any policy).
    let mut given = GivenObjects::default();
    for doc in &docs {
        given.add(doc);
    }
    let mut out = Vec::with_capacity(docs.len());
    for (index, doc) in docs.into_iter().enumerate() {
        if doc.is_null() {
            out.push(RenderedDoc {
                index,
                object: doc,
                patch: JsonPatch::default(),
                policies: Vec::new(),
                warnings: Vec::new(),
                failed: Vec::new(),
            });
            continue;
        }
        if !doc.is_object() {
            return Err(RenderError::Document {
                index,
                message: "not a Kubernetes object (expected a mapping)".to_owned(),
            });
        }
        let (namespace, labels) = document_namespace(&doc, namespace_labels);
        let ctx = MatchContext {
            operation: Operation::Create,
            namespace: &namespace,
            namespace_labels: &labels,
            cluster: &given,
        };
        let applied = apply(policies.iter().map(|(n, s)| (n.as_str(), s)), &doc, &ctx);
        out.push(RenderedDoc {
            index,
            patch: admission_patch(&doc, &applied.object),
            object: applied.object,
            policies: applied.policies,
            warnings: applied.warnings,
            failed: applied.failed,
        });
    }
    Ok(out)
}

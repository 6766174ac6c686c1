//! What an import gives: the policies and the notes ([`KyvernoImport`]), or why nothing was
//! imported ([`KyvernoError`]). Both kinds of Kyverno policy share them.

use meshgate_api::mutation_policy::MutationPolicySpec;

/// The result of [`import`](super::import).
#[derive(Clone, Debug, PartialEq)]
pub struct KyvernoImport {
    /// One `(name, spec)` per converted mutate rule, in rule order.
    pub policies: Vec<(String, MutationPolicySpec)>,
    /// What of the mutate rules was not converted, or converted with a difference, and why:
    /// with any, the imported policies do less than, or other than, the Kyverno policy.
    pub notes: Vec<String>,
    /// Validate, generate and verifyImages rules, which are not mutations: not imported.
    pub ignored: Vec<String>,
}

/// Why a Kyverno policy cannot be imported at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KyvernoError {
    /// Not a `kyverno.io/v1` or `kyverno.io/v2beta1` `ClusterPolicy` / `Policy`, nor a
    /// `policies.kyverno.io` `MutatingPolicy`.
    #[error(
        "not a Kyverno policy: apiVersion {api_version:?}, kind {kind:?} (expected kyverno.io/v1 or kyverno.io/v2beta1 ClusterPolicy or Policy, or a policies.kyverno.io MutatingPolicy)"
    )]
    NotAPolicy { api_version: String, kind: String },
    /// A field every Kyverno policy has is missing or of the wrong type.
    #[error("{path}: {message}")]
    Malformed { path: String, message: String },
    /// No rule could be converted; `notes` say why.
    #[error("nothing in Kyverno policy {policy} can be converted: {}", notes.join("; "))]
    NothingConvertible { policy: String, notes: Vec<String> },
}

pub(super) fn malformed(path: &str, message: &str) -> KyvernoError {
    KyvernoError::Malformed {
        path: path.to_owned(),
        message: message.to_owned(),
    }
}

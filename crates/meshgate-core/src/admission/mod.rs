//! How meshgate plugs into the API server's admission, for every domain: the webhook and
//! admission-policy registrations generated from the configuration ([`registration`]: the pod
//! gate's, the policies' and the node taint's), and the pod gate written as a
//! `MutatingAdmissionPolicy` the API server evaluates itself ([`native_gate`]).
//!
//! The top layer: it may use [`crate::pod_gate`], [`crate::node_gate`], [`crate::policy`] and
//! [`crate::object`]; none of them uses it (`tests/layers.rs`).

pub mod native_gate;
pub mod registration;
pub mod scope;

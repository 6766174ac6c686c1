//! The node gate: when a node is tainted and when the taint is lifted, from its agents' states
//! ([`nodegate`]); what to do about a pod that started before its node was ready ([`repair`]);
//! the readiness device a DRA driver publishes for a gated node ([`dra`]); and what node
//! autoscalers do beside a gate ([`autoscaler`]).
//!
//! Uses only [`crate::object`] (`tests/layers.rs`).

pub mod autoscaler;
pub mod dra;
pub mod nodegate;
pub mod repair;
pub mod retry;

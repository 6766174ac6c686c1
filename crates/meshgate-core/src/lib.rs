//! meshgate's pure core: every decision meshgate makes, as functions of plain data.
//!
//! No Kubernetes client, no I/O, no clock: the webhook and the controller feed these functions
//! what they observed and carry out what comes back. That is what makes every rule here testable
//! on fixtures.
//!
//! # The house
//! One folder per domain; dependencies go one way, down this list (`tests/layers.rs` fails on
//! any `crate::` path that goes up or sideways):
//!
//! | module        | what it decides                                          | may use            |
//! |---------------|----------------------------------------------------------|--------------------|
//! | [`admission`] | webhook and admission-policy registrations; native gate  | all four below     |
//! | [`pod_gate`]  | which pods the init gate holds, per mesh; gate resources | `object`           |
//! | [`node_gate`] | node taints, agent states, repair, the DRA device        | `object`           |
//! | [`policy`]    | the `MutationPolicy` engine, native compilation, Kyverno | `object`           |
//! | [`leader`]    | until when a Lease's holder may act as the leader        | nothing            |
//! | [`object`]    | views, patches, labels, quantities, pod templates, CEL   | nothing (the leaf) |
//!
//! The three domains do not use each other; what two of them share lives in [`object`].

pub mod admission;
pub mod leader;
pub mod node_gate;
pub mod object;
pub mod pod_gate;
pub mod policy;

// Paths kept for the shells (the webhook, the controller, the CLI and their tests and benches
// name these modules at the crate root); code inside this crate uses the domain paths.
pub use admission::{native_gate, registration};
pub use node_gate::{autoscaler, dra, nodegate, repair};
pub use object::{patch, quantity, view};
pub use pod_gate::{capture, gate, mesh, resources, select};
pub use policy::kyverno;

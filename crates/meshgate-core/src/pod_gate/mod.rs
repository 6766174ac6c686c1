//! The pod gate: which pods the init gate selects ([`select`]), what each mesh does to a pod
//! ([`mesh`]) and where its traffic is redirected ([`capture`]), the gate container's resources
//! for the pod's QoS class and the namespace's LimitRanges ([`resources`]), and the plan for a
//! pod ([`gate`]).
//!
//! Uses only [`crate::object`] (`tests/layers.rs`).

pub mod capture;
pub mod gate;
pub mod mesh;
pub mod resources;
pub mod select;

//! The leaf: what every domain reads and writes of a Kubernetes object, and nothing of any
//! domain's rules. Lenient views of the request bytes ([`view`]), the JSON patch an admission
//! response carries ([`patch`]), labels and annotations ([`Meta`]), resource quantities
//! ([`quantity`]), where a workload keeps its pod template ([`pod_template_path`]), and CEL for
//! the API server's admission policies ([`cel`]).
//!
//! It uses no other module of the crate (`tests/layers.rs`).

pub mod cel;
pub mod crd;
mod meta;
pub mod patch;
pub mod quantity;
pub mod view;
mod workload;

pub use meta::Meta;
pub use workload::pod_template_path;

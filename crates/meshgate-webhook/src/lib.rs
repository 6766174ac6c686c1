//! meshgate's admission webhook.
//!
//! One HTTPS server (rustls, TLS 1.2 and 1.3) answers `admission.k8s.io/v1` `AdmissionReview`s
//! with JSON patches, one path per purpose:
//!
//! | path | purpose | registered failure policy |
//! |---|---|---|
//! | `/mutate/pod-gate` | init gate and resource gate for mesh pods | from the configuration |
//! | `/mutate/policies` | `MutationPolicy` on pods and pod templates | `Ignore` |
//! | `/mutate/node-taint` | startup taint on Node CREATE | `Ignore` |
//!
//! A second, plain-HTTP port serves `/healthz`, `/readyz` and `/metrics`. The serving certificate
//! is re-read when its files change (Secret volumes swap a symlink), without dropping
//! connections. SIGTERM stops accepting and finishes in-flight reviews.
//!
//! Every request that reaches a handler gets a well-formed answer: a review it can read gets an
//! `AdmissionReview` response (a malformed one: `allowed: false` with code 400 and the reason);
//! a body that is not a review at all gets HTTP 400, a wrong content type 415, a body over 3.5 MiB
//! 413, a request over the in-flight limit 429. Nothing on the request path panics or unwraps.

// A shell's functions stay short (clippy.toml: too-many-lines-threshold).
#![deny(clippy::too_many_lines)]

pub mod admission;
pub mod app;
mod context_maps;
pub mod handlers;
pub mod metrics;
mod policies;
pub mod server;
pub mod sources;
pub mod tls;

pub use app::App;
pub use server::{Server, ServerOptions};
pub use sources::Sources;

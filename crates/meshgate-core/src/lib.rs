//! meshgate's pure core: every decision meshgate makes, as functions of plain data.
//!
//! No Kubernetes client, no I/O, no clock: the webhook and the controller feed these functions
//! what they observed and carry out what comes back. That is what makes every rule here testable
//! on fixtures.

pub mod capture;
pub mod dra;
pub mod gate;
pub mod kyverno;
pub mod mesh;
pub mod native_gate;
pub mod nodegate;
pub mod patch;
pub mod policy;
pub mod quantity;
pub mod registration;
pub mod repair;
pub mod resources;
pub mod select;
pub mod view;

//! The `meshgate` command: components, offline tools, install and demo.

// A shell's functions stay short (clippy.toml: too-many-lines-threshold).
#![deny(clippy::too_many_lines)]

pub mod autoscaler;
pub mod chart;
pub mod check;
pub mod crds;
#[cfg(feature = "demo")]
pub mod demo;
pub mod discovery;
pub mod install;
pub mod logging;
pub mod render;
pub mod run;
pub mod status;
pub mod uninstall;

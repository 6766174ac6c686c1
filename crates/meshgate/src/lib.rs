//! The `meshgate` command: components, offline tools, install and demo.

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

//! What the API server serves, for choices made at install time (one rule, in the controller
//! crate, which makes the same choice at run time).

pub use meshgate_controller::discovery::policy_api;

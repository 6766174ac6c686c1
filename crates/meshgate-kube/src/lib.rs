//! What meshgate's webhook and controller both do against the API server, so that neither shell
//! depends on the other:
//!
//! * [`watch`]: how a watch's error is logged (one rule for every component's watches);
//! * [`api_reader`]: the GETs of the policy engine's `apiCall` context entries, as the
//!   component's ServiceAccount (the webhook's at admission, the controller's in a backfill).

// A shell's functions stay short (clippy.toml: too-many-lines-threshold).
#![deny(clippy::too_many_lines)]

pub mod api_reader;
pub mod watch;

//! Logging: JSON lines (the default in a cluster) or human-readable text.

use tracing_subscriber::EnvFilter;

/// `RUST_LOG` filters (else `default`); `json` selects JSON lines on stderr.
pub fn init(json: bool, default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init()
    } else {
        builder.compact().try_init()
    };
}

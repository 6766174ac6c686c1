//! Logging: JSON lines (the default in a cluster) or human-readable text.

use tracing_subscriber::EnvFilter;

/// The kube client's own request log: its tracing layer logs every failed request (a refused
/// connection while the API server or the Service route is not there yet, a 5xx) at ERROR, before
/// the caller sees the error. meshgate's callers report each failure once, at the level its
/// meaning calls for (a watch that reconnects is info, a refused list a warning saying what to
/// grant), so the layer's lines are off unless `RUST_LOG` asks for them.
const KUBE_REQUEST_LOG_OFF: &str = "kube_client::client::builder=off";

/// `RUST_LOG` filters (else `default`, without the kube client's request log); `json` selects
/// JSON lines on stderr.
pub fn init(json: bool, default: &str) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},{KUBE_REQUEST_LOG_OFF}")));
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

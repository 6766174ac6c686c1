//! `/healthz` and `/readyz`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State as Extract;
use axum::http::StatusCode;
use axum::routing::get;

use crate::grpc::{Registration, State};

pub fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// A socket of the plugin that is no longer in place.
fn missing_socket(state: &State) -> Option<String> {
    use std::os::unix::fs::FileTypeExt;
    state
        .sockets
        .iter()
        .find(|p| !std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket()))
        .map(|p| {
            format!(
                "the plugin's socket {} was removed: the kubelet cannot reach the plugin\n",
                p.display()
            )
        })
}

/// 200 while both sockets are in place.
async fn healthz(Extract(state): Extract<Arc<State>>) -> (StatusCode, String) {
    match missing_socket(&state) {
        None => (StatusCode::OK, "ok\n".into()),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

/// 200 while the kubelet has registered the plugin and both sockets are in place; 503 with the
/// reason before, after it refused, or once a socket is gone.
async fn readyz(Extract(state): Extract<Arc<State>>) -> (StatusCode, String) {
    if let Some(why) = missing_socket(&state) {
        return (StatusCode::SERVICE_UNAVAILABLE, why);
    }
    match state.registration() {
        Registration::Registered => (StatusCode::OK, "registered with the kubelet\n".into()),
        Registration::Pending => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the kubelet has not registered the DRA plugin yet\n".into(),
        ),
        Registration::Rejected(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the kubelet did not register the DRA plugin: {error}\n"),
        ),
    }
}

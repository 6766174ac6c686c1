//! `/healthz` and `/readyz`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State as Extract;
use axum::http::StatusCode;
use axum::routing::get;

use crate::grpc::{Registration, State};

pub fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// 200 once the kubelet registered the plugin; 503 with the reason before, or after it refused.
async fn readyz(Extract(state): Extract<Arc<State>>) -> (StatusCode, String) {
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

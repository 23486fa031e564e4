//! The routes that describe the service: `GET /v1/models`, `GET /health`, `GET /metrics`
//! (Prometheus text) and `GET /` (the demo page).

use super::error::ApiError;
use super::metrics;
use super::reply::unix_seconds;
use super::Service;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

pub(super) async fn models(State(service): State<Arc<Service>>) -> Response {
    let created = unix_seconds();
    let data: Vec<serde_json::Value> = service
        .models
        .iter()
        .map(|id| {
            serde_json::json!({
                "id": id,
                "object": "model",
                "created": created,
                "owned_by": "wasi-nn-host",
                "max_model_len": service.host.graph_context(id),
                "chat_template": service.config.chat_templates.contains_key(id),
            })
        })
        .collect();
    Json(serde_json::json!({ "object": "list", "data": data })).into_response()
}

/// 200 while serving; 503 once a shutdown signal came (readiness probes and load
/// balancers' checks then take the replica out while it still accepts).
pub(super) async fn health(State(service): State<Arc<Service>>) -> Response {
    let (code, status) = match service.draining() {
        false => (StatusCode::OK, "ok"),
        true => (StatusCode::SERVICE_UNAVAILABLE, "draining"),
    };
    let body = Json(serde_json::json!({
        "status": status,
        "device": service.host.device_spec().to_string(),
        "graphs": service.models,
        "active": service.active(),
        "queued": service.queued(),
        "served": service.served(),
    }));
    (code, body).into_response()
}

pub(super) async fn metrics_text(State(service): State<Arc<Service>>) -> Response {
    // read when scraped: the pools change with every context opened or dropped
    metrics::kv_usage(service.host.kv_pool());
    metrics::run_ahead(service.host.batch_counts().map(|c| c.speculation));
    match metrics::render() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            )],
            text,
        )
            .into_response(),
        Err(message) => ApiError::new(StatusCode::NOT_FOUND, "not_found", message).into_response(),
    }
}

/// The demo page: plain HTML and JS, no build step.
pub(super) async fn demo_page() -> Html<&'static str> {
    Html(include_str!("page.html"))
}

//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes): the guest's tokenizer, run in
//! a fresh instance.

use super::error::ApiError;
use super::instance::with_fresh_instance;
use super::request::{json_body, DetokenizeRequest, TokenizeRequest};
use super::Service;
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

/// The model a tokenizer request names (or the default one), if this service serves it;
/// else a 404.
fn tokenizer_model(service: &Service, model: Option<String>) -> Result<String, ApiError> {
    let model = model.unwrap_or_else(|| service.config.default_model.clone());
    if service.models.contains(&model) {
        Ok(model)
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("model `{model}` does not exist"),
        ))
    }
}

pub(super) async fn tokenize(
    State(service): State<Arc<Service>>,
    request: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Response {
    let answer = async {
        let request = json_body(request)?;
        let model = tokenizer_model(&service, request.model)?;
        let text = request.prompt;
        let tokens = with_fresh_instance(&service, move |s, options| {
            s.host.tokenize_with_component(&s.component, &text, options)
        })
        .await?;
        Ok::<_, ApiError>(serde_json::json!({
            "count": tokens.len(),
            "max_model_len": service.host.graph_context(&model),
            "tokens": tokens,
        }))
    };
    match answer.await {
        Ok(value) => Json(value).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn detokenize(
    State(service): State<Arc<Service>>,
    request: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Response {
    let answer = async {
        let request = json_body(request)?;
        tokenizer_model(&service, request.model)?;
        let ids = request.tokens;
        let text = with_fresh_instance(&service, move |s, options| {
            s.host
                .detokenize_with_component(&s.component, &ids, options)
        })
        .await?;
        Ok::<_, ApiError>(serde_json::json!({ "prompt": text }))
    };
    match answer.await {
        Ok(value) => Json(value).into_response(),
        Err(e) => e.into_response(),
    }
}

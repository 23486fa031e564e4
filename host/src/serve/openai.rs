//! The service's wire format: OpenAI-style completion requests and responses, their
//! validation, and the JSON error body every 4xx and 5xx answer carries.

use crate::runtime::Sampling;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

/// `stop` may be one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The body of `POST /v1/completions`. Unknown fields are an error (clients learn that
/// `best_of` or `n` are not offered instead of having them ignored).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompletionRequest {
    model: Option<String>,
    /// Any JSON value, so that a non-string is a clear 400 rather than a parse error.
    prompt: serde_json::Value,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    stream: Option<bool>,
    /// Accepted and ignored, as OpenAI clients send it.
    #[serde(default, rename = "user")]
    _user: Option<String>,
}

/// What the service accepts of a request, with its defaults.
pub(crate) struct Limits<'a> {
    /// The model a request without `model` gets.
    pub default_model: &'a str,
    /// Every model served (the host's graphs).
    pub models: &'a [String],
    /// Largest `max_tokens`.
    pub max_tokens: u32,
}

/// A validated request: which graph, what prompt, how to sample, how to answer.
pub(crate) struct Job {
    pub model: String,
    pub prompt: String,
    pub sampling: Sampling,
    pub stream: bool,
}

impl CompletionRequest {
    /// Check every field and fill in the defaults (`max_tokens` 16, `temperature` 1,
    /// `top_p` 1, `seed` 0, no stop strings, not streamed).
    pub(crate) fn validate(self, limits: &Limits<'_>) -> Result<Job, ApiError> {
        let model = self
            .model
            .unwrap_or_else(|| limits.default_model.to_owned());
        if !limits.models.contains(&model) {
            let served: Vec<String> = limits.models.iter().map(|m| format!("`{m}`")).collect();
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!(
                    "model `{model}` does not exist; this service serves {}",
                    served.join(", ")
                ),
            ));
        }
        let serde_json::Value::String(prompt) = self.prompt else {
            return Err(ApiError::bad_request("`prompt` must be a string"));
        };
        let max_tokens = self.max_tokens.unwrap_or(16);
        if max_tokens == 0 || max_tokens > limits.max_tokens {
            return Err(ApiError::bad_request(format!(
                "`max_tokens` must be between 1 and {}",
                limits.max_tokens
            )));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
            return Err(ApiError::bad_request(
                "`temperature` must be between 0 and 2",
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad_request("`top_p` must be in (0, 1]"));
        }
        let stop = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > 4 || stop.iter().any(String::is_empty) {
            return Err(ApiError::bad_request(
                "`stop` takes up to 4 non-empty strings",
            ));
        }
        Ok(Job {
            model,
            prompt,
            sampling: Sampling {
                max_tokens,
                temperature,
                top_k: 0,
                top_p,
                seed: self.seed.unwrap_or(0),
                stop,
            },
            stream: self.stream.unwrap_or(false),
        })
    }
}

/// A completion (`stream: false`) or one chunk of a streamed completion: OpenAI's
/// `text_completion` object.
#[derive(Serialize)]
pub(crate) struct TextCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: [Choice<'a>; 1],
    /// On a completion and on the last chunk of a stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// On a completion (not part of OpenAI's format).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

#[derive(Serialize)]
pub(crate) struct Choice<'a> {
    pub text: &'a str,
    pub index: u32,
    /// Always null: log probabilities are not offered.
    pub logprobs: Option<()>,
    /// `length`, `eos` or `stop` once finished; null on the chunks before.
    pub finish_reason: Option<&'a str>,
}

/// Token counts, from the ids of the guest's completion.
#[derive(Serialize)]
pub(crate) struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub(crate) fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// How long a completion took, measured by the service (the component's completion carries
/// no timings): from when the request was accepted, so instantiating the guest is included.
#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub struct Timings {
    /// Until the first token was generated (prompt processing included).
    pub ttft_ms: f64,
    /// Until the completion was finished.
    pub total_ms: f64,
    /// Tokens after the first per second of the time after the first: the decode rate
    /// (0 with fewer than two tokens).
    pub tokens_per_s: f64,
}

impl Timings {
    /// Timings of `tokens` tokens, the first after `ttft_ms`, all after `total_ms`.
    pub fn new(ttft_ms: f64, total_ms: f64, tokens: usize) -> Self {
        let decode_s = (total_ms - ttft_ms) / 1e3;
        let tokens_per_s = if tokens > 1 && decode_s > 0.0 {
            (tokens - 1) as f64 / decode_s
        } else {
            0.0
        };
        Self {
            ttft_ms,
            total_ms,
            tokens_per_s,
        }
    }
}

/// `GET /v1/models`.
#[derive(Serialize)]
pub(crate) struct ModelList<'a> {
    pub object: &'static str,
    pub data: Vec<Model<'a>>,
}

#[derive(Serialize)]
pub(crate) struct Model<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub owned_by: &'static str,
}

/// An OpenAI-style error answer: `{"error": {"message": ..., "type": ...}}` with a status.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

#[derive(Serialize)]
pub(crate) struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
}

impl<'a> ErrorBody<'a> {
    pub(crate) fn new(kind: &'a str, message: &'a str) -> Self {
        Self {
            error: ErrorDetail { message, kind },
        }
    }
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub(crate) fn server_error(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 503: every instance slot is taken; the client may retry.
    pub(crate) fn busy(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_busy", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody::new(self.kind, &self.message);
        (self.status, Json(body)).into_response()
    }
}

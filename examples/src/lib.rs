//! An OpenAI-style completions service over `gpt2.wasm`: every request runs in a fresh
//! sandboxed guest instance of one shared [`Host`] (weights loaded once, each instance with its
//! own wasi-nn context and KV cache), so concurrent requests run side by side with no lock
//! around the forward pass.
//!
//! - `POST /v1/completions`: `prompt`, `max_tokens`, `temperature`, `top_p`, `seed`, `stop`,
//!   `stream` (Server-Sent Events of text pieces, then `[DONE]`).
//! - `GET /v1/models`, `GET /health`.
//!
//! The guest runs with `--stream-json`: each piece of text arrives as a JSON line on its stdout,
//! which [`RunOptions::on_stdout`] hands over as it is written. A client that goes away sets
//! the run's cancel flag and the instance stops at its next epoch check.

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use wasi_nn_host::runtime::{Host, HostError, RunOptions};

/// What the service serves and how each request is limited.
pub struct ServiceConfig {
    /// The model name clients see (and may pass as `model`).
    pub model: String,
    /// The wasi-nn graph the guest loads.
    pub graph: String,
    /// Largest `max_tokens` accepted.
    pub max_tokens_limit: u32,
    /// Wall-clock limit of one request's guest instance.
    pub timeout: Duration,
    /// Linear-memory cap of one guest instance.
    pub max_memory_bytes: usize,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            model: "gpt2".into(),
            graph: "gpt2".into(),
            max_tokens_limit: 1024,
            timeout: Duration::from_secs(120),
            max_memory_bytes: 1 << 30,
        }
    }
}

/// Shared state of the service.
pub struct Service {
    host: Arc<Host>,
    module: wasmtime::Module,
    config: ServiceConfig,
    active: AtomicUsize,
    served: AtomicUsize,
}

impl Service {
    pub fn new(host: Arc<Host>, module: wasmtime::Module, config: ServiceConfig) -> Arc<Self> {
        Arc::new(Self {
            host,
            module,
            config,
            active: AtomicUsize::new(0),
            served: AtomicUsize::new(0),
        })
    }

    /// Guest instances running now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }
}

/// The service's routes.
pub fn router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .with_state(service)
}

/// `stop` may be one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Value,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    stream: Option<bool>,
    // accepted and ignored, as OpenAI clients send them
    #[serde(default)]
    user: Option<String>,
}

/// An OpenAI-style error response.
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({ "error": { "message": self.message, "type": self.kind } });
        (self.status, Json(body)).into_response()
    }
}

fn error(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        status,
        kind,
        message: message.into(),
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// A validated request: the guest's arguments.
struct Job {
    args: Vec<String>,
    stream: bool,
}

fn validate(service: &Service, request: CompletionRequest) -> Result<Job, ApiError> {
    if let Some(model) = &request.model {
        if model != &service.config.model {
            return Err(error(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!(
                    "model `{model}` does not exist; this service serves `{}`",
                    service.config.model
                ),
            ));
        }
    }
    let prompt = match request.prompt {
        Value::String(s) => s,
        _ => return Err(bad_request("`prompt` must be a string")),
    };
    let max_tokens = request.max_tokens.unwrap_or(16);
    if max_tokens == 0 || max_tokens > service.config.max_tokens_limit {
        return Err(bad_request(format!(
            "`max_tokens` must be between 1 and {}",
            service.config.max_tokens_limit
        )));
    }
    let temperature = request.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
        return Err(bad_request("`temperature` must be between 0 and 2"));
    }
    let top_p = request.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad_request("`top_p` must be in (0, 1]"));
    }
    let stops = match request.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stops.len() > 4 || stops.iter().any(|s| s.is_empty()) {
        return Err(bad_request("`stop` takes up to 4 non-empty strings"));
    }
    let _ = request.user;
    let mut args = vec![
        "--stream-json".to_owned(),
        "--graph".into(),
        service.config.graph.clone(),
        "--max-tokens".into(),
        max_tokens.to_string(),
        "--temperature".into(),
        temperature.to_string(),
        "--top-p".into(),
        top_p.to_string(),
        "--seed".into(),
        request.seed.unwrap_or(0).to_string(),
    ];
    for stop in stops {
        args.push("--stop".into());
        args.push(stop);
    }
    // `--` ends the options: a prompt that starts with `-` stays a prompt.
    args.push("--".into());
    args.push(prompt);
    Ok(Job {
        args,
        stream: request.stream.unwrap_or(false),
    })
}

/// What the guest's stdout carries, line by line.
enum GuestLine {
    Piece(String),
    Done(Value),
}

fn parse_line(line: &[u8]) -> Option<GuestLine> {
    let value: Value = serde_json::from_slice(line).ok()?;
    if value.get("finish_reason").is_some() {
        Some(GuestLine::Done(value))
    } else {
        value
            .get("text")
            .and_then(Value::as_str)
            .map(|t| GuestLine::Piece(t.to_owned()))
    }
}

/// Run one guest instance on a blocking thread, sending each stdout line as it is complete.
/// Dropping the receiver cancels the instance.
fn spawn_guest(
    service: Arc<Service>,
    args: Vec<String>,
) -> mpsc::UnboundedReceiver<Result<GuestLine, String>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let pending = Arc::new(Mutex::new(Vec::<u8>::new()));
    let on_stdout = {
        let (tx, cancel, pending) = (tx.clone(), cancel.clone(), pending.clone());
        Arc::new(move |bytes: &[u8]| {
            let Ok(mut buf) = pending.lock() else { return };
            buf.extend_from_slice(bytes);
            while let Some(end) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=end).collect();
                if let Some(parsed) = parse_line(&line[..line.len() - 1]) {
                    if tx.send(Ok(parsed)).is_err() {
                        // the client is gone: stop the instance
                        cancel.store(true, Ordering::Relaxed);
                    }
                }
            }
        })
    };
    let options = RunOptions {
        args,
        capture: Some(64 << 10), // stderr, for error messages
        on_stdout: Some(on_stdout),
        max_memory_bytes: Some(service.config.max_memory_bytes),
        timeout: Some(service.config.timeout),
        cancel: Some(cancel),
        ..Default::default()
    };
    service.active.fetch_add(1, Ordering::Relaxed);
    tokio::task::spawn_blocking(move || {
        let outcome = service.host.run(&service.module, "gpt2.wasm", &options);
        service.active.fetch_sub(1, Ordering::Relaxed);
        service.served.fetch_add(1, Ordering::Relaxed);
        let failure = match outcome {
            Ok(out) if out.exit_code == 0 => None,
            Ok(out) => Some(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
            Err(HostError::Cancelled) => None,
            Err(e) => Some(e.to_string()),
        };
        if let Some(message) = failure {
            let _ = tx.send(Err(message));
        }
    });
    rx
}

/// OpenAI's `usage` from the guest's summary line.
fn usage(summary: &Value) -> Value {
    let prompt_tokens = summary["prompt_ids"].as_array().map_or(0, Vec::len);
    let completion_tokens = summary["ids"].as_array().map_or(0, Vec::len);
    json!({ "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens })
}

fn completion_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("cmpl-{nanos:x}")
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn completions(
    State(service): State<Arc<Service>>,
    request: Result<Json<CompletionRequest>, JsonRejection>,
) -> Response {
    let request = match request {
        Ok(Json(r)) => r,
        Err(rejection) => return bad_request(rejection.body_text()).into_response(),
    };
    let job = match validate(&service, request) {
        Ok(job) => job,
        Err(e) => return e.into_response(),
    };
    let model = service.config.model.clone();
    let id = completion_id();
    let created = unix_seconds();
    let mut rx = spawn_guest(service, job.args);
    if job.stream {
        let stream = futures_util::stream::unfold(Some(rx), move |state| {
            let (id, model) = (id.clone(), model.clone());
            async move {
                let mut rx = state?;
                let chunk = |text: &str, finish: Value| {
                    json!({ "id": id, "object": "text_completion", "created": created, "model": model,
                            "choices": [{ "text": text, "index": 0, "finish_reason": finish }] })
                };
                let event = match rx.recv().await {
                    Some(Ok(GuestLine::Piece(text))) => {
                        Event::default().data(chunk(&text, Value::Null).to_string())
                    }
                    Some(Ok(GuestLine::Done(summary))) => {
                        let mut last = chunk("", summary["finish_reason"].clone());
                        last["usage"] = usage(&summary);
                        Event::default().data(last.to_string())
                    }
                    Some(Err(message)) => Event::default().event("error").data(
                        json!({ "error": { "message": message, "type": "server_error" } })
                            .to_string(),
                    ),
                    None => return None,
                };
                Some((Ok::<_, std::convert::Infallible>(event), Some(rx)))
            }
        });
        let done = futures_util::stream::once(async { Ok(Event::default().data("[DONE]")) });
        use futures_util::StreamExt;
        return Sse::new(stream.chain(done))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    let mut summary = None;
    while let Some(line) = rx.recv().await {
        match line {
            Ok(GuestLine::Piece(_)) => {}
            Ok(GuestLine::Done(value)) => summary = Some(value),
            Err(message) => {
                return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
                    .into_response()
            }
        }
    }
    let Some(summary) = summary else {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the guest ended without a result",
        )
        .into_response();
    };
    Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{ "text": summary["text"], "index": 0, "logprobs": null, "finish_reason": summary["finish_reason"] }],
        "usage": usage(&summary),
        "timings": summary["timings"],
    }))
    .into_response()
}

async fn models(State(service): State<Arc<Service>>) -> Json<Value> {
    Json(
        json!({ "object": "list", "data": [{ "id": service.config.model, "object": "model", "owned_by": "wasi-nn-host" }] }),
    )
}

async fn health(State(service): State<Arc<Service>>) -> Json<Value> {
    Json(json!({
        "status": "ok",
        "device": format!("{:?}", service.host.device()).to_lowercase(),
        "graphs": service.host.graph_names(),
        "active": service.active(),
        "served": service.served.load(Ordering::Relaxed),
    }))
}

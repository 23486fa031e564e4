//! The OpenAI-style completions service (cargo feature `serve`, the CLI's `wasi-nn-host serve`):
//! an HTTP front end over the guest component (`gpt2:text`, see [`crate::component`]).
//!
//! Every request runs in a fresh sandboxed instance of one compiled component over one shared
//! [`Host`] (weights loaded once; each instance has its own wasi-nn contexts and KV caches), on
//! a blocking thread, so concurrent requests run side by side with no lock around the forward
//! pass. The instance streams typed pieces of text through [`Host::generate_with_component`];
//! they reach the handler through a channel, and a client that goes away (the channel's
//! receiver is dropped) sets the run's cancel flag, which stops the instance at its next epoch
//! check.
//!
//! - `POST /v1/completions`: `model`, `prompt`, `max_tokens`, `temperature`, `top_p`, `seed`,
//!   `stop`, `stream` (Server-Sent Events of text pieces, the last chunk with `finish_reason`
//!   and `usage`, then `[DONE]`). Unknown fields and bad values are 400s, unknown models 404s.
//!   A non-streamed answer also carries `timings` ([`Timings`]), measured by the service.
//! - `GET /v1/models`: every graph of the host is a model of the same name.
//! - `GET /health`: the device, the graphs, instances running and requests served.

mod cli;
mod openai;

pub use cli::{run, ServeArgs};
pub use openai::Timings;

use crate::runtime::{Completion, Sampling};
use crate::runtime::{GuestComponent, Host, HostError, RunOptions};
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use openai::{ApiError, Choice, CompletionRequest, ErrorBody, Limits, Model, ModelList};
use openai::{TextCompletion, Usage};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Errors of setting up or running the service.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("the default model `{model}` is not a graph of the host (its graphs: {graphs:?})")]
    UnknownDefaultModel { model: String, graphs: Vec<String> },
    #[error("--graph {0}: expected NAME=PATH")]
    GraphSpec(String),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("serving HTTP: {0}")]
    Http(#[source] std::io::Error),
}

/// What the service serves and how each request is limited.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// The model (graph name) a request without `model` gets.
    pub default_model: String,
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
            default_model: "gpt2".into(),
            max_tokens_limit: 1024,
            timeout: Duration::from_secs(120),
            max_memory_bytes: 1 << 30,
        }
    }
}

/// Shared state of the service: the host, the compiled component, the limits, counters.
pub struct Service {
    host: Arc<Host>,
    component: GuestComponent,
    config: ServiceConfig,
    /// The host's graph names: the models served.
    models: Vec<String>,
    active: AtomicUsize,
    served: AtomicUsize,
}

impl Service {
    /// A service over `host`'s graphs, running `component` (from [`Host::load_component`])
    /// for each request. The default model must be one of the host's graphs.
    pub fn new(
        host: Arc<Host>,
        component: GuestComponent,
        config: ServiceConfig,
    ) -> Result<Arc<Self>, ServeError> {
        let models = host.graph_names();
        if !models.contains(&config.default_model) {
            return Err(ServeError::UnknownDefaultModel {
                model: config.default_model,
                graphs: models,
            });
        }
        Ok(Arc::new(Self {
            host,
            component,
            config,
            models,
            active: AtomicUsize::new(0),
            served: AtomicUsize::new(0),
        }))
    }

    /// Guest instances running now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Guest instances that have finished (completed, failed or cancelled).
    pub fn served(&self) -> usize {
        self.served.load(Ordering::Relaxed)
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

/// Serve `service` on `listener` until `shutdown` completes (then finish the requests under
/// way).
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Arc<Service>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    axum::serve(listener, router(service))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(ServeError::Http)
}

/// What a running instance sends to its request's handler.
enum Message {
    /// A non-empty piece of text.
    Piece(String),
    /// The completion, once finished.
    Done(Completion, openai::Timings),
    /// The guest's error value, or why the instance stopped.
    Failed(String),
    /// No instance could be started: the host's instance pool is full.
    Busy(String),
}

/// Counts an instance as active while it lives, and as served once it is gone (even if the
/// run panicked).
struct Running(Arc<Service>);

impl Running {
    fn start(service: Arc<Service>) -> Self {
        service.active.fetch_add(1, Ordering::Relaxed);
        Self(service)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
        self.0.served.fetch_add(1, Ordering::Relaxed);
    }
}

/// Run a fresh instance of the component on a blocking thread, sending its pieces as they
/// are made and then its completion or failure. Dropping the receiver cancels the instance.
/// `accepted` is when the request came in: the timings count from there.
fn spawn_instance(
    service: Arc<Service>,
    graph: String,
    prompt: String,
    sampling: Sampling,
    accepted: Instant,
) -> mpsc::UnboundedReceiver<Message> {
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let options = RunOptions {
        max_memory_bytes: Some(service.config.max_memory_bytes),
        timeout: Some(service.config.timeout),
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let running = Running::start(service);
    tokio::task::spawn_blocking(move || {
        let service = &running.0;
        let mut first_token = None;
        let outcome = service.host.generate_with_component(
            &service.component,
            &graph,
            &prompt,
            &sampling,
            &options,
            |piece| {
                first_token.get_or_insert_with(|| accepted.elapsed());
                // Pieces may be empty while a character or a stop string is incomplete: the
                // client only gets text, but every token checks that someone still listens.
                let gone = if piece.is_empty() {
                    tx.is_closed()
                } else {
                    tx.send(Message::Piece(piece.to_owned())).is_err()
                };
                if gone {
                    cancel.store(true, Ordering::Relaxed);
                }
            },
        );
        let message = match outcome {
            Ok(Ok(completion)) => {
                let total = accepted.elapsed();
                let ttft = first_token.unwrap_or(total);
                let timings = openai::Timings::new(
                    ttft.as_secs_f64() * 1e3,
                    total.as_secs_f64() * 1e3,
                    completion.ids.len(),
                );
                Message::Done(completion, timings)
            }
            Ok(Err(message)) => Message::Failed(message),
            Err(HostError::Cancelled) => return,
            Err(e @ HostError::Busy { .. }) => Message::Busy(e.to_string()),
            Err(e) => Message::Failed(e.to_string()),
        };
        // Counted as finished before the client can see the answer.
        drop(running);
        // The receiver may be gone by now; then nobody needs the answer.
        let _ = tx.send(message);
    });
    rx
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

/// The fields every completion object and chunk of one request shares.
struct Reply {
    id: String,
    created: u64,
    model: String,
}

impl Reply {
    fn object<'a>(&'a self, text: &'a str, finish_reason: Option<&'a str>) -> TextCompletion<'a> {
        TextCompletion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model,
            choices: [Choice {
                text,
                index: 0,
                logprobs: None,
                finish_reason,
            }],
            usage: None,
            timings: None,
        }
    }
}

fn usage(completion: &Completion) -> Usage {
    Usage::new(completion.prompt_ids.len(), completion.ids.len())
}

/// One Server-Sent Event with a JSON body.
fn json_event(value: &impl serde::Serialize) -> Event {
    match serde_json::to_string(value) {
        Ok(data) => Event::default().data(data),
        Err(e) => error_event(&format!("cannot encode the chunk: {e}")),
    }
}

fn error_event(message: &str) -> Event {
    let body = ErrorBody::new("server_error", message);
    let data = serde_json::to_string(&body).unwrap_or_else(|_| "{}".into());
    Event::default().event("error").data(data)
}

async fn completions(
    State(service): State<Arc<Service>>,
    request: Result<Json<CompletionRequest>, JsonRejection>,
) -> Response {
    let accepted = Instant::now();
    let request = match request {
        Ok(Json(r)) => r,
        Err(rejection) => return ApiError::bad_request(rejection.body_text()).into_response(),
    };
    let limits = Limits {
        default_model: &service.config.default_model,
        models: &service.models,
        max_tokens: service.config.max_tokens_limit,
    };
    let job = match request.validate(&limits) {
        Ok(job) => job,
        Err(e) => return e.into_response(),
    };
    let reply = Reply {
        id: completion_id(),
        created: unix_seconds(),
        model: job.model.clone(),
    };
    // A full pool is answered before a stream starts (a race with another request can still
    // fill it; the stream then carries the error).
    if let Some(pool) = service.host.instance_pool() {
        if service.host.live_instances() >= pool.max_instances as usize {
            let busy = HostError::Busy {
                max_instances: pool.max_instances,
            };
            return ApiError::busy(busy.to_string()).into_response();
        }
    }
    let mut rx = spawn_instance(service, job.model, job.prompt, job.sampling, accepted);
    if job.stream {
        let events = futures_util::stream::unfold((rx, reply), |(mut rx, reply)| async move {
            let event = match rx.recv().await? {
                Message::Piece(text) => json_event(&reply.object(&text, None)),
                Message::Done(completion, _) => {
                    let mut last = reply.object("", Some(&completion.finish_reason));
                    last.usage = Some(usage(&completion));
                    json_event(&last)
                }
                Message::Failed(message) | Message::Busy(message) => error_event(&message),
            };
            Some((Ok::<_, std::convert::Infallible>(event), (rx, reply)))
        });
        let done = futures_util::stream::once(async { Ok(Event::default().data("[DONE]")) });
        use futures_util::StreamExt;
        return Sse::new(events.chain(done))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    while let Some(message) = rx.recv().await {
        match message {
            Message::Piece(_) => {}
            Message::Done(completion, timings) => {
                let mut object = reply.object(&completion.text, Some(&completion.finish_reason));
                object.usage = Some(usage(&completion));
                object.timings = Some(timings);
                return Json(object).into_response();
            }
            Message::Failed(message) => return ApiError::server_error(message).into_response(),
            Message::Busy(message) => return ApiError::busy(message).into_response(),
        }
    }
    ApiError::server_error("the guest ended without a result").into_response()
}

async fn models(State(service): State<Arc<Service>>) -> Response {
    let data = service
        .models
        .iter()
        .map(|id| Model {
            id,
            object: "model",
            owned_by: "wasi-nn-host",
        })
        .collect();
    Json(ModelList {
        object: "list",
        data,
    })
    .into_response()
}

#[derive(serde::Serialize)]
struct Health<'a> {
    status: &'static str,
    device: String,
    graphs: &'a [String],
    active: usize,
    served: usize,
}

async fn health(State(service): State<Arc<Service>>) -> Response {
    Json(Health {
        status: "ok",
        device: format!("{:?}", service.host.device()).to_lowercase(),
        graphs: &service.models,
        active: service.active(),
        served: service.served(),
    })
    .into_response()
}

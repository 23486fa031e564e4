//! The OpenAI-compatible service (cargo feature `serve`, the CLI's `wasi-nn-host serve`): an
//! HTTP front end over the guest component (`gpt2:text`, see [`crate::runtime`]).
//!
//! Every completion runs in a fresh sandboxed instance of one compiled component over one
//! shared [`Host`] (weights loaded once; each instance has its own wasi-nn contexts and KV
//! caches, and instances that step together share the backend's batched steps), on a
//! blocking thread. The guest tokenizes, applies penalties and biases, samples and computes
//! log probabilities; the service validates, admits, and speaks the API. A request with
//! several prompts or `n` > 1 runs one instance per choice. Each instance reports its
//! prompt's size first, so a prompt too long for the model is a 400 before any forward pass;
//! then its pieces reach the handler through a channel, and a client that goes away (the
//! receiver is dropped) sets the instance's cancel flag.
//!
//! Routes (see the README for every field):
//! - `POST /v1/completions`, `POST /v1/chat/completions` (with the model's chat template),
//!   streamed as Server-Sent Events or not.
//! - `POST /tokenize`, `POST /detokenize` (vLLM's shapes), `GET /v1/models`.
//! - `GET /health`, `GET /metrics` (Prometheus text), `GET /` (the demo page).
//!
//! Operating: an optional API key (bearer token) on the `/v1` routes and the tokenizer's; a
//! cap on guests running at once with a bounded queue (429 with `Retry-After` beyond it); a
//! request body limit; a request id (`x-request-id`, taken from the request or made) on
//! every answer and on the `tracing` span of the request; graceful shutdown with a deadline.

mod chat;
mod cli;
mod error;
mod metrics;
mod reply;
mod request;

pub use chat::{ChatTemplate, ChatTemplateError};
pub use cli::{run, ServeArgs};
pub use error::ServeError;
pub use reply::Timings;

use crate::runtime::{Completion, Piece, Prompt, Sampling};
use crate::runtime::{GuestComponent, Host, HostError, RunOptions};
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use error::{ApiError, ErrorBody};
use futures_util::StreamExt;
use reply::{Kind, Reply, Usage};
use request::{ChatRequest, CompletionRequest, DetokenizeRequest, Limits, Plan, TokenizeRequest};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

/// What the service serves and how each request is limited.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// The model (graph name) a request without `model` gets.
    pub default_model: String,
    /// Largest `max_tokens` accepted.
    pub max_tokens_limit: u32,
    /// Wall-clock limit of one request's guest instance.
    pub timeout: Duration,
    /// Fuel of one request's guest instance (the host must meter it,
    /// [`crate::HostBuilder::fuel_metering`]).
    pub fuel: Option<u64>,
    /// Linear-memory cap of one guest instance.
    pub max_memory_bytes: usize,
    /// Guests that may generate at once (every choice of a request is one); `None`: the
    /// host's instance pool, else 64.
    pub max_concurrent: Option<usize>,
    /// Requests that may wait for guests; beyond them a request gets 429.
    pub max_queue: usize,
    /// The longest a request waits in the queue before a 429.
    pub queue_timeout: Duration,
    /// Most choices (`n` times prompts) one request may ask for.
    pub max_choices: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Requests to the `/v1` routes and the tokenizer's must carry `Authorization: Bearer
    /// KEY`.
    pub api_key: Option<String>,
    /// Chat templates by model; a model without one answers chat requests with a 400.
    pub chat_templates: HashMap<String, ChatTemplate>,
    /// After a shutdown signal, streams in flight get this long to finish; then they are
    /// cancelled.
    pub shutdown_grace: Duration,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            default_model: "gpt2".into(),
            max_tokens_limit: 1024,
            timeout: Duration::from_secs(120),
            fuel: None,
            max_memory_bytes: 1 << 30,
            max_concurrent: None,
            max_queue: 256,
            queue_timeout: Duration::from_secs(60),
            max_choices: 16,
            max_body_bytes: 1 << 20,
            api_key: None,
            chat_templates: HashMap::new(),
            shutdown_grace: Duration::from_secs(30),
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
    /// Guests that may generate at once.
    guests: Arc<Semaphore>,
    max_concurrent: usize,
    queued: AtomicUsize,
    active: AtomicUsize,
    served: AtomicUsize,
    /// Set when the shutdown deadline has passed: instances stop at their next token.
    stopping: AtomicBool,
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
        if let Some(model) = config.chat_templates.keys().find(|m| !models.contains(m)) {
            return Err(ServeError::UnknownTemplateModel(model.clone()));
        }
        let max_concurrent = config
            .max_concurrent
            .or_else(|| host.instance_pool().map(|p| p.max_instances as usize))
            .unwrap_or(64)
            .max(1);
        // the recorder exists before the first request counts anything, and the gauges
        // from the start
        metrics::handle();
        metrics::guests_running(0);
        metrics::queued(0);
        Ok(Arc::new(Self {
            host,
            component,
            config,
            models,
            guests: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            queued: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            served: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
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

    /// Requests waiting for guests now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    fn limits(&self) -> Limits<'_> {
        Limits {
            default_model: &self.config.default_model,
            models: &self.models,
            max_tokens: self.config.max_tokens_limit,
            max_choices: self.config.max_choices.min(self.max_concurrent),
        }
    }

    fn run_options(&self, cancel: Option<Arc<AtomicBool>>) -> RunOptions {
        RunOptions {
            max_memory_bytes: Some(self.config.max_memory_bytes),
            timeout: Some(self.config.timeout),
            fuel: self.config.fuel,
            cancel,
            ..Default::default()
        }
    }
}

/// The service's routes.
pub fn router(service: Arc<Service>) -> Router {
    let guarded = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(service.clone(), api_key));
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .merge(guarded)
        .layer(DefaultBodyLimit::max(service.config.max_body_bytes))
        .layer(middleware::from_fn(request_context))
        .with_state(service)
}

/// Serve `service` on `listener` until `shutdown` completes; then stop accepting, let the
/// requests in flight finish for up to [`ServiceConfig::shutdown_grace`], and cancel the
/// rest.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Arc<Service>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let signalled = Arc::new(tokio::sync::Notify::new());
    let notify = signalled.clone();
    let server =
        axum::serve(listener, router(service.clone())).with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("shutting down: no new connections; finishing the requests in flight");
            notify.notify_one();
        });
    let grace = service.config.shutdown_grace;
    tokio::select! {
        served = std::future::IntoFuture::into_future(server) => served.map_err(ServeError::Http),
        () = async { signalled.notified().await; tokio::time::sleep(grace).await } => {
            tracing::warn!(
                "shutdown deadline of {grace:?} passed: cancelling {} guests",
                service.active()
            );
            service.stopping.store(true, Ordering::Relaxed);
            Ok(())
        }
    }
}

/// The request id of a request (`x-request-id`, the client's or made here).
#[derive(Clone)]
struct RequestId(String);

fn new_request_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{nanos:x}-{:x}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Every request: its id (echoed in `x-request-id`), a `tracing` span, a log line and the
/// request counter.
async fn request_context(mut request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(new_request_id, str::to_owned);
    let route = request.uri().path().to_owned();
    let span = tracing::info_span!("request", id = %id, method = %request.method(), route = %route);
    request.extensions_mut().insert(RequestId(id.clone()));
    let started = Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    let status = response.status().as_u16();
    span.in_scope(|| {
        tracing::info!(
            status,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "answered"
        )
    });
    metrics::request(&route, status);
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// The API key check of the guarded routes.
async fn api_key(State(service): State<Arc<Service>>, request: Request, next: Next) -> Response {
    if let Some(key) = &service.config.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// Equal, in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// The JSON body, or the rejection as an OpenAI-style error (413 for a body over the limit).
fn body<T>(request: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    request.map(|Json(r)| r).map_err(|rejection| {
        // a body over the limit stays a 413 and a wrong content type a 415; a body that is
        // not JSON or does not fit the request (axum says 422 for that) is a 400, as OpenAI
        // and vLLM answer it
        let status = rejection.status();
        let (status, kind) = match status {
            StatusCode::PAYLOAD_TOO_LARGE => (status, "request_too_large"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => (status, "invalid_request_error"),
            _ => (StatusCode::BAD_REQUEST, "invalid_request_error"),
        };
        ApiError::new(status, kind, rejection.body_text())
    })
}

/// Places for `n` guests: at once, or after a wait in the bounded queue.
async fn admit(service: &Arc<Service>, n: usize) -> Result<OwnedSemaphorePermit, ApiError> {
    let n = n as u32;
    if let Ok(permit) = service.guests.clone().try_acquire_many_owned(n) {
        return Ok(permit);
    }
    /// Counts a request as queued while it waits (also when its client goes away).
    struct Waiting<'a>(&'a Service);
    impl Drop for Waiting<'_> {
        fn drop(&mut self) {
            let left = self.0.queued.fetch_sub(1, Ordering::Relaxed) - 1;
            metrics::queued(left);
        }
    }
    let before = service.queued.fetch_add(1, Ordering::Relaxed);
    let waiting = Waiting(service);
    if before >= service.config.max_queue {
        drop(waiting);
        return Err(ApiError::too_many(format!(
            "the service is at capacity: {} guests running and {before} requests queued; \
             retry later",
            service.max_concurrent
        )));
    }
    metrics::queued(before + 1);
    let wait = service.config.queue_timeout;
    let permit = tokio::time::timeout(wait, service.guests.clone().acquire_many_owned(n)).await;
    drop(waiting);
    match permit {
        Ok(Ok(permit)) => Ok(permit),
        Ok(Err(_closed)) => Err(ApiError::busy("the service is shutting down")),
        Err(_) => Err(ApiError::too_many(format!(
            "no guest became free within {wait:?}; retry later"
        ))),
    }
}

/// What a running instance sends to its request's handler.
enum Message {
    /// The prompt fits: its token count. Always the first message of a started instance.
    Ready(u32),
    /// The request cannot run (a bad token id, a prompt too long): a 400, before any
    /// forward pass.
    Rejected(ApiError),
    /// A piece of text (maybe empty) and its tokens' log probabilities.
    Piece(Piece),
    /// The completion, once finished.
    Done(Completion, Timings),
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
        let n = service.active.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::guests_running(n);
        Self(service)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let n = self.0.active.fetch_sub(1, Ordering::Relaxed) - 1;
        metrics::guests_running(n);
        self.0.served.fetch_add(1, Ordering::Relaxed);
    }
}

/// One choice of a request: which prompt, how to sample.
struct Task {
    prompt: Prompt,
    sampling: Sampling,
}

/// Why a prompt cannot run on a model of `context` positions, if it cannot.
fn context_error(prompt: u32, max_tokens: u32, explicit: bool, context: u32) -> Option<ApiError> {
    let message = if prompt > context {
        format!("this model's maximum context length is {context} tokens; the prompt has {prompt}")
    } else if explicit && prompt + max_tokens > context {
        format!(
            "this model's maximum context length is {context} tokens; the request needs {}: \
             {prompt} in the prompt, {max_tokens} to generate",
            prompt + max_tokens
        )
    } else {
        return None;
    };
    Some(ApiError::bad_request(message))
}

/// Run one choice in a fresh instance on a blocking thread. Dropping the receiver cancels
/// the instance. `accepted` is when the request came in: the timings count from there.
fn spawn_task(
    service: Arc<Service>,
    model: String,
    task: Task,
    explicit_max_tokens: bool,
    accepted: Instant,
    permit: Arc<OwnedSemaphorePermit>,
) -> mpsc::UnboundedReceiver<Message> {
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let options = service.run_options(Some(cancel.clone()));
    let running = Running::start(service);
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || {
        let _span = span.enter();
        let service = &running.0;
        let send = |message| {
            // the receiver may be gone; then nobody needs the answer
            let _ = tx.send(message);
        };
        let outcome = (|| {
            let mut generation = service.host.start_generation(
                &service.component,
                &model,
                &task.prompt,
                &task.sampling,
                &options,
            )?;
            let prompt_tokens = match generation.prompt_tokens()? {
                Ok(n) => n,
                Err(message) => return Ok(Some(Message::Rejected(ApiError::bad_request(message)))),
            };
            let sampling = &task.sampling;
            if let Some(e) = context_error(
                prompt_tokens,
                sampling.max_tokens,
                explicit_max_tokens,
                sampling.context_length,
            ) {
                return Ok(Some(Message::Rejected(e)));
            }
            send(Message::Ready(prompt_tokens));
            let (mut first, mut last) = (None, Instant::now());
            loop {
                let piece = match generation.next_piece()? {
                    Ok(Some(piece)) => piece,
                    Ok(None) => break,
                    Err(message) => return Ok(Some(Message::Failed(message))),
                };
                let now = Instant::now();
                match first {
                    None => {
                        first = Some(accepted.elapsed());
                        metrics::ttft(now - accepted);
                    }
                    Some(_) => metrics::inter_token(now - last),
                }
                last = now;
                if tx.send(Message::Piece(piece)).is_err()
                    || service.stopping.load(Ordering::Relaxed)
                {
                    cancel.store(true, Ordering::Relaxed);
                }
            }
            let completion = generation.finish()?;
            let total = accepted.elapsed();
            let ttft = first.unwrap_or(total);
            metrics::tokens(prompt_tokens, completion.ids.len());
            let timings = Timings::new(
                ttft.as_secs_f64() * 1e3,
                total.as_secs_f64() * 1e3,
                completion.ids.len(),
            );
            Ok::<_, HostError>(Some(Message::Done(completion, timings)))
        })();
        let message = match outcome {
            Ok(message) => message,
            Err(HostError::Cancelled) => None,
            Err(e @ HostError::Busy { .. }) => Some(Message::Busy(e.to_string())),
            Err(e) => Some(Message::Failed(e.to_string())),
        };
        // Counted as finished, and its place given back, before the client can see the
        // answer (a client's next request must find the place free).
        drop(running);
        drop(permit);
        if let Some(message) = message {
            send(message);
        }
    });
    rx
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One Server-Sent Event with a JSON body.
fn json_event(value: &serde_json::Value) -> Event {
    Event::default().data(value.to_string())
}

fn error_event(message: &str) -> Event {
    let body = ErrorBody::new("server_error", message, StatusCode::INTERNAL_SERVER_ERROR);
    let data = serde_json::to_string(&body).unwrap_or_else(|_| "{}".into());
    Event::default().event("error").data(data)
}

/// The answer to a failed first message of an instance.
fn first_error(message: Option<Message>) -> ApiError {
    match message {
        Some(Message::Rejected(e)) => e,
        Some(Message::Busy(m)) => ApiError::busy(m),
        Some(Message::Failed(m)) => ApiError::server_error(m),
        _ => ApiError::server_error("the guest ended without a result"),
    }
}

async fn completions(
    State(service): State<Arc<Service>>,
    Extension(id): Extension<RequestId>,
    request: Result<Json<CompletionRequest>, JsonRejection>,
) -> Response {
    let accepted = Instant::now();
    let plan = body(request).and_then(|r| r.validate(&service.limits()));
    match plan {
        Ok(plan) => run_plan(service, plan, Kind::Text, &id, accepted).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(service): State<Arc<Service>>,
    Extension(id): Extension<RequestId>,
    request: Result<Json<ChatRequest>, JsonRejection>,
) -> Response {
    let accepted = Instant::now();
    let plan = body(request).and_then(|r| {
        let limits = service.limits();
        let model = r.model(&limits).to_owned();
        if !service.models.contains(&model) {
            // the same 404 as completions
            return r.validate(String::new(), &limits);
        }
        let template = service.config.chat_templates.get(&model).ok_or_else(|| {
            ApiError::bad_request(format!(
                "model `{model}` has no chat template (none in its tokenizer_config.json); \
                 use /v1/completions, or start the service with --chat-template FILE"
            ))
        })?;
        let prompt = template.render(&r.messages)?;
        r.validate(prompt, &limits)
    });
    match plan {
        Ok(plan) => run_plan(service, plan, Kind::Chat, &id, accepted).await,
        Err(e) => e.into_response(),
    }
}

/// Admit a plan, start one instance per choice, wait until every prompt is known to fit,
/// then answer: streamed or whole.
async fn run_plan(
    service: Arc<Service>,
    mut plan: Plan,
    kind: Kind,
    id: &RequestId,
    accepted: Instant,
) -> Response {
    let choices = plan.prompts.len() * plan.n as usize;
    let permit = match admit(&service, choices).await {
        Ok(permit) => Arc::new(permit),
        Err(e) => return e.into_response(),
    };
    plan.sampling.context_length = service
        .host
        .graph_context(&plan.model)
        .map_or(0, |c| c as u32);
    let want_logprobs = plan.sampling.logprobs.is_some();
    let mut receivers = Vec::with_capacity(choices);
    let mut prompt_of = Vec::with_capacity(choices);
    for (p, prompt) in plan.prompts.iter().enumerate() {
        for j in 0..plan.n {
            let mut sampling = plan.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(j as u64);
            let task = Task {
                prompt: prompt.clone(),
                sampling,
            };
            receivers.push(spawn_task(
                service.clone(),
                plan.model.clone(),
                task,
                plan.max_tokens_explicit,
                accepted,
                permit.clone(),
            ));
            prompt_of.push(p);
        }
    }
    drop(permit);
    let mut usage = Usage::default();
    for (i, rx) in receivers.iter_mut().enumerate() {
        match rx.recv().await {
            Some(Message::Ready(n)) => {
                // each prompt counts once, however many choices it has
                if i % plan.n as usize == 0 {
                    usage.prompt_tokens += n as usize;
                }
            }
            other => return first_error(other).into_response(),
        }
    }
    let prefix = match kind {
        Kind::Text => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let reply = Reply::new(
        kind,
        format!("{prefix}-{}", id.0),
        unix_seconds(),
        plan.model.clone(),
        choices,
    );
    if plan.stream {
        return stream(receivers, reply, usage, want_logprobs, plan.include_usage);
    }
    let mut finished = Vec::with_capacity(choices);
    for mut rx in receivers {
        let done = loop {
            match rx.recv().await {
                Some(Message::Piece(_)) => {}
                Some(Message::Done(completion, timings)) => break (completion, timings),
                other => return first_error(other).into_response(),
            }
        };
        usage.completion_tokens += done.0.ids.len();
        finished.push(done);
    }
    let mut reply = reply;
    Json(reply.complete(&finished, usage, want_logprobs)).into_response()
}

/// The streamed answer: every choice's chunks as they come (each tagged with its index),
/// its finish chunk, the usage chunk if asked, then `[DONE]`.
fn stream(
    receivers: Vec<mpsc::UnboundedReceiver<Message>>,
    reply: Reply,
    usage: Usage,
    want_logprobs: bool,
    include_usage: bool,
) -> Response {
    let merged =
        futures_util::stream::select_all(receivers.into_iter().enumerate().map(|(index, rx)| {
            futures_util::stream::unfold(rx, move |mut rx| async move {
                rx.recv().await.map(|m| ((index, m), rx))
            })
            .boxed()
        }));
    struct State<S> {
        merged: S,
        reply: Reply,
        usage: Usage,
        queue: VecDeque<Event>,
        ended: bool,
    }
    let mut queue = VecDeque::new();
    if reply.kind == Kind::Chat {
        for index in 0..reply.choices() {
            queue.push_back(json_event(&reply.role_chunk(index)));
        }
    }
    let state = State {
        merged,
        reply,
        usage,
        queue,
        ended: false,
    };
    let events = futures_util::stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(event) = st.queue.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(event), st));
            }
            if st.ended {
                return None;
            }
            match st.merged.next().await {
                Some((index, Message::Piece(piece))) => {
                    if !piece.text.is_empty() || !piece.logprobs.is_empty() {
                        let chunk = st.reply.piece_chunk(
                            index,
                            &piece.text,
                            &piece.logprobs,
                            want_logprobs,
                        );
                        st.queue.push_back(Event::default().data(chunk));
                    }
                }
                Some((index, Message::Done(completion, _))) => {
                    st.usage.completion_tokens += completion.ids.len();
                    let chunk = st.reply.finish_chunk(index, &completion.finish_reason);
                    st.queue.push_back(json_event(&chunk));
                }
                Some((_, Message::Failed(m) | Message::Busy(m))) => {
                    st.queue.push_back(error_event(&m));
                }
                Some((_, Message::Rejected(e))) => st.queue.push_back(error_event(&e.message)),
                Some((_, Message::Ready(_))) => {}
                None => {
                    if include_usage {
                        st.queue
                            .push_back(json_event(&st.reply.usage_chunk(st.usage)));
                    }
                    st.queue.push_back(Event::default().data("[DONE]"));
                    st.ended = true;
                }
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Run `f` with a fresh instance on a blocking thread (the tokenizer routes).
async fn with_instance<T: Send + 'static>(
    service: &Arc<Service>,
    f: impl FnOnce(&Service, &RunOptions) -> Result<Result<T, String>, HostError> + Send + 'static,
) -> Result<T, ApiError> {
    let service = service.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let options = service.run_options(None);
        f(&service, &options)
    })
    .await;
    match joined {
        Ok(Ok(Ok(value))) => Ok(value),
        Ok(Ok(Err(message))) => Err(ApiError::bad_request(message)),
        Ok(Err(e @ HostError::Busy { .. })) => Err(ApiError::busy(e.to_string())),
        Ok(Err(e)) => Err(ApiError::server_error(e.to_string())),
        Err(e) => Err(ApiError::server_error(format!("the guest's thread: {e}"))),
    }
}

/// The model a tokenizer request names, checked.
fn known_model(service: &Service, model: Option<String>) -> Result<String, ApiError> {
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

async fn tokenize(
    State(service): State<Arc<Service>>,
    request: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Response {
    let answer = async {
        let request = body(request)?;
        let model = known_model(&service, request.model)?;
        let text = request.prompt;
        let tokens = with_instance(&service, move |s, options| {
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

async fn detokenize(
    State(service): State<Arc<Service>>,
    request: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Response {
    let answer = async {
        let request = body(request)?;
        known_model(&service, request.model)?;
        let ids = request.tokens;
        let text = with_instance(&service, move |s, options| {
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

async fn models(State(service): State<Arc<Service>>) -> Response {
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

async fn health(State(service): State<Arc<Service>>) -> Response {
    Json(serde_json::json!({
        "status": "ok",
        "device": format!("{:?}", service.host.device()).to_lowercase(),
        "graphs": service.models,
        "active": service.active(),
        "queued": service.queued(),
        "served": service.served(),
    }))
    .into_response()
}

async fn metrics_text() -> Response {
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
async fn page() -> Html<&'static str> {
    Html(include_str!("page.html"))
}

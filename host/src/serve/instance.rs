//! Guest instances on blocking threads: one choice of a completion, whose prompt's size,
//! pieces and result reach the request's handler as [`ChoiceMessage`]s through a channel (a
//! dropped receiver cancels the instance), and the tokenizer routes' one-shot calls.

use super::error::ApiError;
use super::metrics;
use super::reply::Timings;
use super::Service;
use crate::runtime::{Completion, HostError, Piece, Prompt, RunOptions, Sampling};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// What a choice's instance sends to its request's handler.
pub(super) enum ChoiceMessage {
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
struct ActiveInstance(Arc<Service>);

impl ActiveInstance {
    fn start(service: Arc<Service>) -> Self {
        let active = service.active.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::guests_running(active);
        Self(service)
    }
}

impl Drop for ActiveInstance {
    fn drop(&mut self) {
        let active = self.0.active.fetch_sub(1, Ordering::Relaxed) - 1;
        metrics::guests_running(active);
        self.0.served.fetch_add(1, Ordering::Relaxed);
    }
}

/// One choice of a request: which model and prompt, how to sample.
pub(super) struct Choice {
    pub(super) model: String,
    pub(super) prompt: Prompt,
    pub(super) sampling: Sampling,
    /// Whether the client set `max_tokens`: then prompt and completion must both fit.
    pub(super) max_tokens_explicit: bool,
}

/// Why a prompt cannot run on a model of `context` positions, if it cannot.
fn context_length_error(
    prompt: u32,
    max_tokens: u32,
    explicit: bool,
    context: u32,
) -> Option<ApiError> {
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
pub(super) fn spawn_choice(
    service: Arc<Service>,
    choice: Choice,
    accepted: Instant,
    permit: Arc<OwnedSemaphorePermit>,
) -> mpsc::UnboundedReceiver<ChoiceMessage> {
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let options = service.run_options(Some(cancel.clone()));
    let active = ActiveInstance::start(service);
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || {
        let _span = span.enter();
        let outcome = run_choice(&active.0, &choice, &options, accepted, &cancel, &tx);
        let message = match outcome {
            Ok(message) => message,
            Err(HostError::Cancelled) => None,
            Err(e @ HostError::Busy { .. }) => Some(ChoiceMessage::Busy(e.to_string())),
            Err(e) => Some(ChoiceMessage::Failed(e.to_string())),
        };
        // Counted as finished, and its place given back, before the client can see the
        // answer (a client's next request must find the place free).
        drop(active);
        drop(permit);
        if let Some(message) = message {
            // the receiver may be gone; then nobody needs the answer
            let _ = tx.send(message);
        }
    });
    rx
}

/// Generate one choice: check that its prompt fits and say so (`Ready`), send its pieces
/// as they come (setting `cancel` once the receiver is gone or the service is stopping),
/// and return its last message (`None`: nothing more to say).
fn run_choice(
    service: &Service,
    choice: &Choice,
    options: &RunOptions,
    accepted: Instant,
    cancel: &AtomicBool,
    tx: &mpsc::UnboundedSender<ChoiceMessage>,
) -> Result<Option<ChoiceMessage>, HostError> {
    let sampling = &choice.sampling;
    let mut generation = service.host.start_generation(
        &service.component,
        &choice.model,
        &choice.prompt,
        sampling,
        options,
    )?;
    let prompt_tokens = match generation.prompt_tokens()? {
        Ok(n) => n,
        Err(message) => {
            return Ok(Some(ChoiceMessage::Rejected(ApiError::bad_request(
                message,
            ))))
        }
    };
    if let Some(e) = context_length_error(
        prompt_tokens,
        sampling.max_tokens,
        choice.max_tokens_explicit,
        sampling.context_length,
    ) {
        return Ok(Some(ChoiceMessage::Rejected(e)));
    }
    // the receiver may be gone; then nobody needs the answer
    let _ = tx.send(ChoiceMessage::Ready(prompt_tokens));
    let (mut first, mut last) = (None, Instant::now());
    loop {
        let piece = match generation.next_piece()? {
            Ok(Some(piece)) => piece,
            Ok(None) => break,
            Err(message) => return Ok(Some(ChoiceMessage::Failed(message))),
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
        if tx.send(ChoiceMessage::Piece(piece)).is_err() || service.stopping.load(Ordering::Relaxed)
        {
            cancel.store(true, Ordering::Relaxed);
        }
    }
    let completion = generation.finish()?;
    let total = accepted.elapsed();
    let ttft = first.unwrap_or(total);
    metrics::tokens(prompt_tokens, completion.ids.len());
    metrics::request_latency(total);
    let timings = Timings::new(
        ttft.as_secs_f64() * 1e3,
        total.as_secs_f64() * 1e3,
        completion.ids.len(),
    );
    Ok(Some(ChoiceMessage::Done(completion, timings)))
}

/// Run `f` with a fresh instance on a blocking thread (the tokenizer routes).
pub(super) async fn with_fresh_instance<T: Send + 'static>(
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

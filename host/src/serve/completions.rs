//! `POST /v1/completions` and `POST /v1/chat/completions`: validate the request into a
//! [`Plan`] (a chat's messages rendered with its model's template first), admit it, start
//! one instance per choice, wait until every prompt is known to fit, then answer, streamed
//! or whole.

use super::admission::admit;
use super::error::ApiError;
use super::http::RequestId;
use super::instance::{spawn_task, Message, Task};
use super::reply::{unix_seconds, Kind, Reply, Usage};
use super::request::{body, ChatRequest, CompletionRequest, Plan};
use super::stream::stream;
use super::Service;
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use std::sync::Arc;
use std::time::Instant;

/// The answer to a failed first message of an instance.
fn first_error(message: Option<Message>) -> ApiError {
    match message {
        Some(Message::Rejected(e)) => e,
        Some(Message::Busy(m)) => ApiError::busy(m),
        Some(Message::Failed(m)) => ApiError::server_error(m),
        _ => ApiError::server_error("the guest ended without a result"),
    }
}

pub(super) async fn completions(
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

pub(super) async fn chat_completions(
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

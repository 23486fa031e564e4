//! `POST /v1/completions` and `POST /v1/chat/completions`: validate the request into a
//! [`Plan`] (a chat's messages rendered with its model's template first), admit it, start
//! one instance per choice, wait until every prompt is known to fit, then answer, streamed
//! or whole.

use super::admission::admit;
use super::error::ApiError;
use super::instance::{spawn_choice, Choice, ChoiceMessage};
use super::reply::{unix_seconds, Reply, ReplyKind, Timings, Usage};
use super::request::RequestId;
use super::request::{json_body, ChatRequest, CompletionRequest, Plan};
use super::stream::stream_reply;
use super::Service;
use crate::runtime::Completion;
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// The error answer of a choice whose instance sent something other than what its handler
/// waited for: a rejection, a failure, or nothing at all.
fn choice_error(message: Option<ChoiceMessage>) -> ApiError {
    match message {
        Some(ChoiceMessage::Rejected(e)) => e,
        Some(ChoiceMessage::Busy(m)) => ApiError::busy(m),
        Some(ChoiceMessage::Failed(m)) => ApiError::server_error(m),
        _ => ApiError::server_error("the guest ended without a result"),
    }
}

pub(super) async fn completions(
    State(service): State<Arc<Service>>,
    Extension(id): Extension<RequestId>,
    request: Result<Json<CompletionRequest>, JsonRejection>,
) -> Response {
    let accepted = Instant::now();
    let plan = json_body(request).and_then(|r| r.validate(&service.limits()));
    match plan {
        Ok(plan) => run_plan(service, plan, ReplyKind::Text, &id, accepted).await,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn chat_completions(
    State(service): State<Arc<Service>>,
    Extension(id): Extension<RequestId>,
    request: Result<Json<ChatRequest>, JsonRejection>,
) -> Response {
    let accepted = Instant::now();
    let plan = json_body(request).and_then(|r| {
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
        Ok(plan) => run_plan(service, plan, ReplyKind::Chat, &id, accepted).await,
        Err(e) => e.into_response(),
    }
}

/// Admit a plan, start one instance per choice, wait until every prompt is known to fit,
/// then answer: streamed or whole.
async fn run_plan(
    service: Arc<Service>,
    mut plan: Plan,
    kind: ReplyKind,
    id: &RequestId,
    accepted: Instant,
) -> Response {
    let choices = plan.prompts.len() * plan.n as usize;
    let permit = match admit(&service, choices).await {
        Ok(permit) => Arc::new(permit),
        Err(e) => return e.into_response(),
    };
    super::metrics::queue_time(accepted.elapsed());
    plan.sampling.context_length = service
        .host
        .graph_context(&plan.model)
        .map_or(0, |c| c as u32);
    let mut receivers = start_choices(&service, &plan, accepted, permit);
    let mut usage = match prompt_usage(&mut receivers, plan.n).await {
        Ok(usage) => usage,
        Err(e) => return e.into_response(),
    };
    let prefix = match kind {
        ReplyKind::Text => "cmpl",
        ReplyKind::Chat => "chatcmpl",
    };
    let mut reply = Reply::new(
        kind,
        format!("{prefix}-{}", id.0),
        unix_seconds(),
        plan.model.clone(),
        choices,
    );
    let want_logprobs = plan.sampling.logprobs.is_some();
    if plan.stream {
        return stream_reply(receivers, reply, usage, want_logprobs, plan.include_usage);
    }
    match whole_choices(receivers).await {
        Ok(finished) => {
            usage.completion_tokens = finished.iter().map(|(c, _)| c.ids.len()).sum();
            Json(reply.complete(&finished, usage, want_logprobs)).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// One instance per choice, in index order (choice `j` of prompt `i` is `i * n + j`, with
/// seed `seed + j`), each holding the request's places (`permit`) until it ends.
fn start_choices(
    service: &Arc<Service>,
    plan: &Plan,
    accepted: Instant,
    permit: Arc<OwnedSemaphorePermit>,
) -> Vec<mpsc::UnboundedReceiver<ChoiceMessage>> {
    let mut receivers = Vec::with_capacity(plan.prompts.len() * plan.n as usize);
    for prompt in &plan.prompts {
        for choice_of_prompt in 0..plan.n {
            let mut sampling = plan.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(choice_of_prompt as u64);
            let choice = Choice {
                model: plan.model.clone(),
                prompt: prompt.clone(),
                sampling,
                max_tokens_explicit: plan.max_tokens_explicit,
            };
            receivers.push(spawn_choice(
                service.clone(),
                choice,
                accepted,
                permit.clone(),
            ));
        }
    }
    receivers
}

/// Wait for every choice's first message, that its prompt fits: the prompt tokens of the
/// usage (each prompt counted once, however many choices it has), or the first error.
async fn prompt_usage(
    receivers: &mut [mpsc::UnboundedReceiver<ChoiceMessage>],
    choices_per_prompt: u32,
) -> Result<Usage, ApiError> {
    let mut usage = Usage::default();
    for (index, rx) in receivers.iter_mut().enumerate() {
        match rx.recv().await {
            Some(ChoiceMessage::Ready(prompt_tokens)) => {
                if index % choices_per_prompt as usize == 0 {
                    usage.prompt_tokens += prompt_tokens as usize;
                }
            }
            other => return Err(choice_error(other)),
        }
    }
    Ok(usage)
}

/// Every choice's completion and timings, in index order (the pieces on the way are not
/// needed), or the first error.
async fn whole_choices(
    receivers: Vec<mpsc::UnboundedReceiver<ChoiceMessage>>,
) -> Result<Vec<(Completion, Timings)>, ApiError> {
    let mut finished = Vec::with_capacity(receivers.len());
    for mut rx in receivers {
        loop {
            match rx.recv().await {
                Some(ChoiceMessage::Piece(_)) => {}
                Some(ChoiceMessage::Done(completion, timings)) => {
                    finished.push((completion, timings));
                    break;
                }
                other => return Err(choice_error(other)),
            }
        }
    }
    Ok(finished)
}

//! The streamed answer of a completion or chat request: Server-Sent Events with every
//! choice's chunks as its instance sends them, each choice's finish chunk, the usage chunk
//! if asked, then `[DONE]`.

use super::error::ErrorBody;
use super::instance::ChoiceMessage;
use super::reply::{Reply, ReplyKind, Usage};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use std::collections::VecDeque;
use tokio::sync::mpsc;

/// One Server-Sent Event with a JSON body.
fn json_event(value: &serde_json::Value) -> Event {
    Event::default().data(value.to_string())
}

/// An `error` event: a choice failed after the answer had begun.
fn error_event(message: &str) -> Event {
    let body = ErrorBody::new("server_error", message, StatusCode::INTERNAL_SERVER_ERROR);
    let data = serde_json::to_string(&body).unwrap_or_else(|_| "{}".into());
    Event::default().event("error").data(data)
}

/// The streamed answer: every choice's chunks as they come (each tagged with its index),
/// its finish chunk, the usage chunk if asked, then `[DONE]`.
pub(super) fn stream_reply(
    receivers: Vec<mpsc::UnboundedReceiver<ChoiceMessage>>,
    reply: Reply,
    usage: Usage,
    want_logprobs: bool,
    include_usage: bool,
) -> Response {
    let messages =
        futures_util::stream::select_all(receivers.into_iter().enumerate().map(|(index, rx)| {
            futures_util::stream::unfold(rx, move |mut rx| async move {
                rx.recv().await.map(|m| ((index, m), rx))
            })
            .boxed()
        }));
    let mut pending = VecDeque::new();
    if reply.kind == ReplyKind::Chat {
        for index in 0..reply.choices() {
            pending.push_back(json_event(&reply.role_chunk(index)));
        }
    }
    let state = ReplyStream {
        messages,
        reply,
        usage,
        want_logprobs,
        include_usage,
        pending,
        ended: false,
    };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(event) = st.pending.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(event), st));
            }
            if st.ended {
                return None;
            }
            let message = st.messages.next().await;
            st.push_events(message);
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A streamed answer between two events: the choices' messages merged (each with its
/// choice's index), the reply they make, and the events made but not yet sent.
struct ReplyStream<S> {
    messages: S,
    reply: Reply,
    usage: Usage,
    want_logprobs: bool,
    include_usage: bool,
    pending: VecDeque<Event>,
    /// `[DONE]` is pending: nothing follows it.
    ended: bool,
}

impl<S> ReplyStream<S> {
    /// The events of choice `index`'s message; `None`, every choice having ended: the
    /// usage chunk if asked, and `[DONE]`.
    fn push_events(&mut self, message: Option<(usize, ChoiceMessage)>) {
        match message {
            Some((index, ChoiceMessage::Piece(piece))) => {
                if !piece.text.is_empty() || !piece.logprobs.is_empty() {
                    let chunk = self.reply.piece_chunk(
                        index,
                        &piece.text,
                        &piece.logprobs,
                        self.want_logprobs,
                    );
                    self.pending.push_back(Event::default().data(chunk));
                }
            }
            Some((index, ChoiceMessage::Done(completion, _))) => {
                self.usage.completion_tokens += completion.ids.len();
                let chunk = self.reply.finish_chunk(index, &completion.finish_reason);
                self.pending.push_back(json_event(&chunk));
            }
            Some((_, ChoiceMessage::Failed(m) | ChoiceMessage::Busy(m))) => {
                self.pending.push_back(error_event(&m));
            }
            Some((_, ChoiceMessage::Rejected(e))) => {
                self.pending.push_back(error_event(&e.message));
            }
            Some((_, ChoiceMessage::Ready(_))) => {}
            None => {
                if self.include_usage {
                    let chunk = self.reply.usage_chunk(self.usage);
                    self.pending.push_back(json_event(&chunk));
                }
                self.pending.push_back(Event::default().data("[DONE]"));
                self.ended = true;
            }
        }
    }
}

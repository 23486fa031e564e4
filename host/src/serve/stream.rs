//! The streamed answer of a completion or chat request: Server-Sent Events with every
//! choice's chunks as its instance sends them, each choice's finish chunk, the usage chunk
//! if asked, then `[DONE]`.

use super::error::ErrorBody;
use super::instance::Message;
use super::reply::{Kind, Reply, Usage};
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

fn error_event(message: &str) -> Event {
    let body = ErrorBody::new("server_error", message, StatusCode::INTERNAL_SERVER_ERROR);
    let data = serde_json::to_string(&body).unwrap_or_else(|_| "{}".into());
    Event::default().event("error").data(data)
}

/// The streamed answer: every choice's chunks as they come (each tagged with its index),
/// its finish chunk, the usage chunk if asked, then `[DONE]`.
pub(super) fn stream(
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

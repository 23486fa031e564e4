//! The answers: OpenAI's `text_completion` and `chat.completion` objects, their streamed
//! chunks, and the two shapes of `logprobs` (completions: `tokens`, `token_logprobs`,
//! `top_logprobs`, `text_offset`; chat: `content` entries with `bytes`), and the service's
//! [`Timings`] of a completion.

use crate::runtime::{Completion, TokenLogprob};
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// Which API a reply speaks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ReplyKind {
    Text,
    Chat,
}

/// One request's reply: what every object and chunk shares, and per choice what has been
/// sent (for `text_offset`).
pub(crate) struct Reply {
    pub kind: ReplyKind,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Characters of text before each choice's next token (`text_offset`).
    offsets: Vec<usize>,
}

/// Token counts over every choice (prompts counted once each).
#[derive(Clone, Copy, Default)]
pub(crate) struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

impl Usage {
    pub fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

/// Seconds since the Unix epoch: the `created` of every object.
pub(super) fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// OpenAI says `stop` where the model ended the text itself.
pub(crate) fn finish_reason(reason: &str) -> &str {
    match reason {
        "eos" => "stop",
        other => other,
    }
}

impl Reply {
    pub fn new(kind: ReplyKind, id: String, created: u64, model: String, choices: usize) -> Self {
        Self {
            kind,
            id,
            created,
            model,
            offsets: vec![0; choices],
        }
    }

    /// How many choices the reply has.
    pub fn choices(&self) -> usize {
        self.offsets.len()
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (ReplyKind::Text, _) => "text_completion",
            (ReplyKind::Chat, false) => "chat.completion",
            (ReplyKind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Map<String, Value> {
        let mut object = Map::new();
        object.insert("id".into(), json!(self.id));
        object.insert("object".into(), json!(self.object(chunk)));
        object.insert("created".into(), json!(self.created));
        object.insert("model".into(), json!(self.model));
        object.insert("choices".into(), Value::Array(choices));
        object
    }

    /// `logprobs` of a choice for `entries`, the next in its text (the completions shape
    /// tracks `text_offset`).
    fn logprobs(&mut self, index: usize, entries: &[TokenLogprob], want: bool) -> Value {
        if !want {
            return Value::Null;
        }
        match self.kind {
            ReplyKind::Text => {
                let offset = &mut self.offsets[index];
                let mut text_offset = Vec::with_capacity(entries.len());
                for e in entries {
                    text_offset.push(*offset);
                    *offset += e.token.chars().count();
                }
                json!({
                    "tokens": entries.iter().map(|e| &e.token).collect::<Vec<_>>(),
                    "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
                    "top_logprobs": entries.iter().map(top_map).collect::<Vec<_>>(),
                    "text_offset": text_offset,
                })
            }
            ReplyKind::Chat => json!({
                "content": entries.iter().map(|e| json!({
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": e.token.as_bytes(),
                    "top_logprobs": e.top.iter().map(|t| json!({
                        "token": t.token,
                        "logprob": t.logprob,
                        "bytes": t.token.as_bytes(),
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            }),
        }
    }

    /// The first chunk of a chat choice: the assistant's role.
    pub fn role_chunk(&self, index: usize) -> Value {
        let choice = json!({
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        });
        Value::Object(self.envelope(true, vec![choice]))
    }

    /// A chunk with a piece of a choice's text and the log probabilities of its tokens, as
    /// JSON text (the hot path of a stream: serialised straight from borrowed fields).
    pub fn piece_chunk(
        &mut self,
        index: usize,
        text: &str,
        entries: &[TokenLogprob],
        want_logprobs: bool,
    ) -> String {
        let logprobs = self.logprobs(index, entries, want_logprobs);
        let chunk = |choice| PieceChunk {
            id: &self.id,
            object: self.object(true),
            created: self.created,
            model: &self.model,
            choices: [choice],
        };
        let choice = match self.kind {
            ReplyKind::Text => PieceChoice {
                index,
                text: Some(text),
                delta: None,
                logprobs,
                finish_reason: None,
            },
            ReplyKind::Chat => PieceChoice {
                index,
                text: None,
                delta: Some(Delta { content: text }),
                logprobs,
                finish_reason: None,
            },
        };
        serde_json::to_string(&chunk(choice)).unwrap_or_else(|e| {
            json!({ "error": { "message": format!("cannot encode a chunk: {e}") } }).to_string()
        })
    }

    /// The last chunk of a choice: its finish reason.
    pub fn finish_chunk(&self, index: usize, reason: &str) -> Value {
        let choice = match self.kind {
            ReplyKind::Text => json!({
                "index": index, "text": "", "logprobs": null,
                "finish_reason": finish_reason(reason),
            }),
            ReplyKind::Chat => json!({
                "index": index, "delta": {}, "logprobs": null,
                "finish_reason": finish_reason(reason),
            }),
        };
        Value::Object(self.envelope(true, vec![choice]))
    }

    /// The chunk after every choice's last (`stream_options.include_usage`).
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut object = self.envelope(true, Vec::new());
        object.insert("usage".into(), usage.json());
        Value::Object(object)
    }

    /// The whole answer: every choice in index order, usage, and the service's timings.
    pub fn complete(
        &mut self,
        choices: &[(Completion, Timings)],
        usage: Usage,
        want_logprobs: bool,
    ) -> Value {
        let mut out = Vec::with_capacity(choices.len());
        for (index, (completion, _)) in choices.iter().enumerate() {
            let entries: Vec<TokenLogprob> = completion
                .prompt_logprobs
                .iter()
                .chain(&completion.logprobs)
                .cloned()
                .collect();
            let logprobs = self.logprobs(index, &entries, want_logprobs);
            let reason = finish_reason(&completion.finish_reason);
            out.push(match self.kind {
                ReplyKind::Text => json!({
                    "index": index, "text": completion.text, "logprobs": logprobs,
                    "finish_reason": reason,
                }),
                ReplyKind::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": completion.text},
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }),
            });
        }
        let mut object = self.envelope(false, out);
        object.insert("usage".into(), usage.json());
        if let [(_, timings)] = choices {
            object.insert("timings".into(), json!(timings));
        }
        Value::Object(object)
    }
}

#[derive(Serialize)]
struct PieceChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [PieceChoice<'a>; 1],
}

#[derive(Serialize)]
struct PieceChoice<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    logprobs: Value,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct Delta<'a> {
    content: &'a str,
}

/// The completions shape's `top_logprobs` entry: token -> logprob for the alternatives and
/// the chosen token (OpenAI: up to `logprobs + 1` entries); null for a prompt's first token.
fn top_map(e: &TokenLogprob) -> Value {
    let Some(logprob) = e.logprob else {
        return Value::Null;
    };
    let mut map = Map::new();
    for t in &e.top {
        map.insert(t.token.clone(), json!(t.logprob));
    }
    map.entry(e.token.clone()).or_insert(json!(logprob));
    Value::Object(map)
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

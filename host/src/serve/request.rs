//! The requests: OpenAI-style completion and chat requests as vLLM and the llama.cpp server
//! accept them, the tokenizer routes' requests (vLLM's shapes), and the validation of a
//! completion or chat request into a [`Plan`].

use super::error::ApiError;
use crate::runtime::{Prompt, Sampling};
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The request id of a request (`x-request-id`, the client's or made here).
#[derive(Clone)]
pub(super) struct RequestId(pub(super) String);

/// A new request id: the time and a counter.
pub(super) fn new_request_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{nanos:x}-{:x}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// `stop` may be one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    /// vLLM's: usage on every chunk (accepted; only the final chunk carries it here).
    #[serde(default, rename = "continuous_usage_stats")]
    _continuous_usage_stats: Option<bool>,
}

/// The body of `POST /v1/completions`. Unknown fields are a 400 that names them; fields we
/// don't implement (`suffix`, `best_of` above `n`) are accepted only with their neutral
/// values.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompletionRequest {
    model: Option<String>,
    /// Any JSON value, so that a wrong shape is a clear 400 rather than a parse error.
    prompt: Option<serde_json::Value>,
    suffix: Option<String>,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    logprobs: Option<u32>,
    echo: Option<bool>,
    stop: Option<Stop>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    best_of: Option<u32>,
    logit_bias: Option<BTreeMap<String, f32>>,
    #[serde(rename = "user")]
    _user: Option<String>,
    seed: Option<i64>,
    // vLLM's extras
    top_k: Option<i32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    stop_token_ids: Option<Vec<u32>>,
}

/// A chat message; `content` is a string or a list of text parts.
#[derive(Deserialize)]
pub(crate) struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<serde_json::Value>,
    #[serde(default)]
    pub name: Option<String>,
}

/// The body of `POST /v1/chat/completions`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatRequest {
    model: Option<String>,
    pub messages: Vec<ChatMessage>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    stop: Option<Stop>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logit_bias: Option<BTreeMap<String, f32>>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    #[serde(rename = "user")]
    _user: Option<String>,
    seed: Option<i64>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    stop_token_ids: Option<Vec<u32>>,
}

/// What the service accepts of a request, with its defaults.
pub(crate) struct Limits<'a> {
    /// The model a request without `model` gets.
    pub default_model: &'a str,
    /// Every model served (the host's graphs).
    pub models: &'a [String],
    /// Largest `max_tokens`.
    pub max_tokens: u32,
    /// Most guests one request may run (`n` times the prompts).
    pub max_choices: usize,
}

/// The most alternatives `logprobs` may ask for.
pub(crate) const MAX_LOGPROBS: u32 = 20;

/// A validated request: which graph, what prompts, how to sample, how to answer.
pub(crate) struct Plan {
    pub model: String,
    pub prompts: Vec<Prompt>,
    /// Choices per prompt; choice `j` of prompt `i` has index `i * n + j` and seed `seed + j`.
    pub n: u32,
    pub sampling: Sampling,
    /// Whether the client set `max_tokens` (else it is 16, or less where the context ends
    /// first).
    pub max_tokens_explicit: bool,
    pub stream: bool,
    pub include_usage: bool,
}

/// The fields completions and chat share (they name them alike), gathered for one
/// validation.
struct SharedFields {
    model: Option<String>,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    stop: Option<Stop>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logit_bias: Option<BTreeMap<String, f32>>,
    seed: Option<i64>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    stop_token_ids: Option<Vec<u32>>,
    logprobs: Option<u32>,
    echo: bool,
}

/// `value`, or `default` where it is absent; a 400 that names the field and its `range`
/// where it is not finite or not `within` it.
fn float_in_range(
    name: &str,
    value: Option<f32>,
    default: f32,
    range: &str,
    within: impl Fn(f32) -> bool,
) -> Result<f32, ApiError> {
    match value {
        None => Ok(default),
        Some(v) if v.is_finite() && within(v) => Ok(v),
        Some(v) => Err(ApiError::bad_request(format!(
            "`{name}` must be {range}, got {v}"
        ))),
    }
}

/// The model a request names (or the default one), if this service serves it; else a 404.
fn served_model(model: Option<String>, limits: &Limits<'_>) -> Result<String, ApiError> {
    let model = model.unwrap_or_else(|| limits.default_model.to_owned());
    if limits.models.contains(&model) {
        return Ok(model);
    }
    let served: Vec<String> = limits.models.iter().map(|m| format!("`{m}`")).collect();
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        "model_not_found",
        format!(
            "model `{model}` does not exist; this service serves {}",
            served.join(", ")
        ),
    ))
}

/// `top_k` for the guest: -1 and 0 both mean off (0 to the guest).
fn top_k(top_k: Option<i32>) -> Result<u32, ApiError> {
    match top_k {
        None | Some(-1) => Ok(0),
        Some(k) if k >= 0 => Ok(k as u32),
        Some(k) => Err(ApiError::bad_request(format!(
            "`top_k` must be -1 (off), 0 (off) or positive, got {k}"
        ))),
    }
}

/// `stop` as a list: up to 4 non-empty strings.
fn stop_strings(stop: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let stop = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(ApiError::bad_request(
            "`stop` takes up to 4 non-empty strings",
        ));
    }
    Ok(stop)
}

/// `logit_bias` as (token id, bias) pairs: each key a token id, each bias in [-100, 100].
fn logit_biases(logit_bias: Option<BTreeMap<String, f32>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut biases = Vec::new();
    for (key, bias) in logit_bias.unwrap_or_default() {
        let id = key.parse::<u32>().map_err(|_| {
            ApiError::bad_request(format!("`logit_bias`: `{key}` is not a token id"))
        })?;
        if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
            return Err(ApiError::bad_request(format!(
                "`logit_bias`: the bias of token {id} must be between -100 and 100, got {bias}"
            )));
        }
        biases.push((id, bias));
    }
    Ok(biases)
}

impl SharedFields {
    /// Check every field, in this order (the first one wrong is the 400): the model, the
    /// length, the sampling settings, the number of choices.
    fn plan(mut self, prompts: Vec<Prompt>, limits: &Limits<'_>) -> Result<Plan, ApiError> {
        let model = served_model(self.model.take(), limits)?;
        let max_tokens = self.max_tokens.unwrap_or(16);
        if max_tokens > limits.max_tokens || (max_tokens == 0 && !self.echo) {
            return Err(ApiError::bad_request(format!(
                "`max_tokens` must be between 1 and {} (0 only with `echo`)",
                limits.max_tokens
            )));
        }
        let sampling = self.sampling(max_tokens)?;
        let n = self.n.unwrap_or(1);
        if n == 0 {
            return Err(ApiError::bad_request("`n` must be at least 1"));
        }
        if prompts.is_empty() {
            return Err(ApiError::bad_request("`prompt` is an empty list"));
        }
        let choices = prompts.len() * n as usize;
        if choices > limits.max_choices {
            return Err(ApiError::bad_request(format!(
                "the request asks for {choices} completions (`n` {n} x {} prompts); this \
                 service runs at most {} for one request",
                prompts.len(),
                limits.max_choices
            )));
        }
        let stream = self.stream.unwrap_or(false);
        let include_usage = self
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        Ok(Plan {
            model,
            prompts,
            n,
            sampling,
            max_tokens_explicit: self.max_tokens.is_some(),
            stream,
            include_usage,
        })
    }

    /// The guest's sampling settings, each field checked (`context_length` is the
    /// handler's to fill in).
    fn sampling(&mut self, max_tokens: u32) -> Result<Sampling, ApiError> {
        let temperature = float_in_range(
            "temperature",
            self.temperature,
            1.0,
            "between 0 and 2",
            |t| (0.0..=2.0).contains(&t),
        )?;
        let top_p = float_in_range("top_p", self.top_p, 1.0, "in (0, 1]", |p| {
            p > 0.0 && p <= 1.0
        })?;
        let min_p = float_in_range("min_p", self.min_p, 0.0, "in [0, 1]", |m| {
            (0.0..=1.0).contains(&m)
        })?;
        let penalty = |name, value| {
            float_in_range(name, value, 0.0, "between -2 and 2", |v| {
                (-2.0..=2.0).contains(&v)
            })
        };
        let presence_penalty = penalty("presence_penalty", self.presence_penalty)?;
        let frequency_penalty = penalty("frequency_penalty", self.frequency_penalty)?;
        let repetition_penalty = float_in_range(
            "repetition_penalty",
            self.repetition_penalty,
            1.0,
            "in (0, 10]",
            |r| r > 0.0 && r <= 10.0,
        )?;
        let top_k = top_k(self.top_k)?;
        let stop = stop_strings(self.stop.take())?;
        let logit_bias = logit_biases(self.logit_bias.take())?;
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return Err(ApiError::bad_request(format!(
                "`logprobs` must be at most {MAX_LOGPROBS}, got {n}"
            )));
        }
        Ok(Sampling {
            max_tokens,
            temperature,
            top_k,
            top_p,
            // a negative seed keeps its bits
            seed: self.seed.unwrap_or(0) as u64,
            stop,
            stop_token_ids: self.stop_token_ids.take().unwrap_or_default(),
            logit_bias,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            min_p,
            logprobs: self.logprobs,
            echo: self.echo,
            context_length: 0,
        })
    }
}

/// The [`SharedFields`] of a request (completions and chat name them alike), with the three
/// that differ given.
macro_rules! shared_fields {
    ($r:ident, $max_tokens:expr, $logprobs:expr, $echo:expr) => {
        SharedFields {
            model: $r.model,
            max_tokens: $max_tokens,
            temperature: $r.temperature,
            top_p: $r.top_p,
            n: $r.n,
            stream: $r.stream,
            stream_options: $r.stream_options,
            stop: $r.stop,
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
            logit_bias: $r.logit_bias,
            seed: $r.seed,
            top_k: $r.top_k,
            min_p: $r.min_p,
            repetition_penalty: $r.repetition_penalty,
            stop_token_ids: $r.stop_token_ids,
            logprobs: $logprobs,
            echo: $echo,
        }
    };
}

/// The prompts of a completion request: a string, a list of strings, a list of token ids,
/// or a list of such lists.
fn prompts(prompt: Option<serde_json::Value>) -> Result<Vec<Prompt>, ApiError> {
    use serde_json::Value;
    let shape = "`prompt` must be a string, a list of strings, a list of token ids or a list \
                 of lists of token ids";
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect()
    };
    match prompt {
        None => Err(ApiError::bad_request("`prompt` is required")),
        Some(Value::String(text)) => Ok(vec![Prompt::Text(text)]),
        Some(Value::Array(items)) if items.is_empty() => {
            Err(ApiError::bad_request("`prompt` is an empty list"))
        }
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(text) => Ok(Prompt::Text(text)),
                    _ => Err(ApiError::bad_request(shape)),
                })
                .collect(),
            Value::Number(_) => ids(&items)
                .map(|ids| vec![Prompt::Ids(ids)])
                .ok_or_else(|| ApiError::bad_request(shape)),
            Value::Array(_) => items
                .iter()
                .map(|v| {
                    v.as_array()
                        .and_then(|a| ids(a))
                        .map(Prompt::Ids)
                        .ok_or_else(|| ApiError::bad_request(shape))
                })
                .collect(),
            _ => Err(ApiError::bad_request(shape)),
        },
        Some(_) => Err(ApiError::bad_request(shape)),
    }
}

impl CompletionRequest {
    /// Check every field and fill in the defaults (OpenAI's: `max_tokens` 16, `temperature`
    /// 1, `top_p` 1, `n` 1; `seed` 0; not streamed).
    pub(crate) fn validate(self, limits: &Limits<'_>) -> Result<Plan, ApiError> {
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::bad_request(
                "`suffix` is not supported: GPT-2 only continues text",
            ));
        }
        let n = self.n.unwrap_or(1);
        if self.best_of.is_some_and(|b| b != n) {
            return Err(ApiError::bad_request(
                "`best_of` is not supported (only `best_of` equal to `n`)",
            ));
        }
        let prompts = prompts(self.prompt)?;
        let echo = self.echo.unwrap_or(false);
        shared_fields!(self, self.max_tokens, self.logprobs, echo).plan(prompts, limits)
    }
}

impl ChatRequest {
    /// The model the request names (its template renders the prompt).
    pub(crate) fn model<'a>(&'a self, limits: &'a Limits<'_>) -> &'a str {
        self.model.as_deref().unwrap_or(limits.default_model)
    }

    /// Validate with `prompt`, the rendered conversation.
    pub(crate) fn validate(self, prompt: String, limits: &Limits<'_>) -> Result<Plan, ApiError> {
        if self.max_tokens.is_some() && self.max_completion_tokens.is_some() {
            return Err(ApiError::bad_request(
                "set `max_completion_tokens` or `max_tokens`, not both",
            ));
        }
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (true, n) => Some(n.unwrap_or(0)),
            (false, None | Some(0)) => None,
            (false, Some(_)) => {
                return Err(ApiError::bad_request(
                    "`top_logprobs` needs `logprobs: true`",
                ))
            }
        };
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        shared_fields!(self, max_tokens, logprobs, false).plan(vec![Prompt::Text(prompt)], limits)
    }
}

/// `POST /tokenize` (vLLM's shape).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: String,
    /// Accepted: GPT-2 adds no special tokens.
    #[serde(rename = "add_special_tokens")]
    pub _add_special_tokens: Option<bool>,
}

/// `POST /detokenize` (vLLM's shape).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// The JSON body, or the rejection as an OpenAI-style error (413 for a body over the limit).
pub(super) fn json_body<T>(request: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
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

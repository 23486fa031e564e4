//! The OpenAI-compatible service (cargo feature `serve`, the CLI's `wasi-nn-host serve`): an
//! HTTP front end over the guest component (`gpt2:text`, see [`crate::runtime`]).
//!
//! Every completion runs in a fresh sandboxed instance of one compiled component over one
//! shared [`Host`](crate::runtime::Host) (weights loaded once; each instance has its own wasi-nn contexts and KV
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
//!
//! The files, in the order a request meets them:
//! - `http`: the route table, the request id and API key every request passes, serving
//!   with graceful shutdown.
//! - `request`: the request bodies and their validation into a plan; `chat`: the chat
//!   templates that turn a conversation into a prompt.
//! - `completions`: the completion and chat routes, from a plan to an answer; `admission`:
//!   the cap on guests running at once and its bounded queue; `instance`: a guest instance
//!   on a blocking thread, reporting to its request's handler.
//! - `reply`: the answers' JSON, whole or as chunks; `stream`: the streamed answer as
//!   Server-Sent Events.
//! - `tokenizer`, `info`: the other routes; `metrics`: the Prometheus metrics.
//! - `service`: the shared state and its configuration; `error`: a request's error answer;
//!   `setup_error`: the errors of setting up and running; `cli`: `wasi-nn-host serve`.

mod admission;
mod chat;
mod cli;
mod completions;
mod error;
mod http;
mod info;
mod instance;
mod metrics;
mod reply;
mod request;
mod service;
mod setup_error;
mod stream;
mod tokenizer;

pub use chat::{ChatTemplate, ChatTemplateError};
pub use cli::{run, ServeArgs};
pub use http::{router, serve};
pub use reply::Timings;
pub use service::{Service, ServiceConfig};
pub use setup_error::ServeError;

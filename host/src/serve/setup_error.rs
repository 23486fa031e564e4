//! [`ServeError`]: what can go wrong in setting the service up or running it (a request's
//! own errors are [`super::error::ApiError`]s).

use super::chat::ChatTemplateError;
use crate::runtime::HostError;

/// Errors of setting up or running the service.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("the default model `{model}` is not a graph of the host (its graphs: {graphs:?})")]
    UnknownDefaultModel { model: String, graphs: Vec<String> },
    #[error("a chat template for `{0}`, which is not a graph of the host")]
    UnknownTemplateModel(String),
    #[error("--graph {0}: expected NAME=PATH")]
    GraphSpec(String),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
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

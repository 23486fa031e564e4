//! The graph contract's errors ([`Gpt2Error`]), the wasi-nn code each reaches a guest with
//! ([`ErrorKind`]), and reading both back from an error that came through wasmtime-wasi-nn.

use crate::engine::draw::RuleError;
use crate::engine::processing::ProcessingError;
use crate::engine::EngineError;
use crate::model::LoadError;
use wasmtime_wasi_nn::backend::BackendError;
use wasmtime_wasi_nn::wit::TensorType;

/// Errors of the graph contract; each reaches the guest as a wasi-nn error code and is logged
/// on the host with this message.
#[derive(Debug, thiserror::Error)]
pub enum Gpt2Error {
    #[error("input {index} must be an {expected} tensor, got {found:?}")]
    WrongTensorType {
        index: u32,
        found: TensorType,
        expected: &'static str,
    },
    #[error("input {index}: dimensions {dims:?} do not fit {bytes} bytes of data ({expected})")]
    WrongShape {
        index: u32,
        dims: Vec<u32>,
        bytes: usize,
        expected: &'static str,
    },
    #[error("the token sequence is empty")]
    EmptySequence,
    #[error("sequence of {len} tokens is longer than the model's context of {n_ctx}")]
    TooLong { len: usize, n_ctx: usize },
    #[error("token id {id} at position {position} is outside the vocabulary (0..{vocab})")]
    TokenOutOfRange {
        position: usize,
        id: i64,
        vocab: usize,
    },
    #[error("logits_from {from} is outside the sequence of {len} tokens")]
    LogitsFromOutOfRange { from: i64, len: usize },
    #[error("no input {0}: this graph takes inputs 0 (token ids), 1 (logits_from), 2 (sampling: temperature, top_p and min_p), 3 (seed), 4 (penalties), 5 (generated_from), 6 (bias_ids) and 7 (bias_values)")]
    NoSuchInput(String),
    #[error("no output {0}: this graph has outputs 0 (last logits), 1 (logits from logits_from), 2 (argmax), 3 (context length) and 4 (sampled token)")]
    NoSuchOutput(String),
    #[error("sampling: {0}")]
    BadRule(#[from] RuleError),
    #[error("logit processing: {0}")]
    BadProcessing(#[from] ProcessingError),
    #[error("output 4 (the sampled token) needs input 2 (sampling: temperature and top_p) to be set before compute")]
    NoDrawRule,
    #[error("compute called before input 0 (token ids) was set")]
    NoInput,
    #[error("output {0} requested before compute")]
    NotComputed(u32),
    #[error("output 1 needs input 1 (logits_from) to be set before compute")]
    NoAllLogits,
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The device the guest's execution target chose could not take the graph.
    #[error("execution target gpu: {0}")]
    TargetDevice(#[source] EngineError),
    #[error(
        "execution target {0} is not supported: this backend runs on the CPU (target cpu) or a \
         CUDA GPU (target gpu)"
    )]
    UnsupportedTarget(&'static str),
}

/// What kind of failure an error is: the wasi-nn error code it reaches a guest with, in either
/// ABI (witx's `$nn_errno` or WIT's `error-code`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A malformed tensor, model or argument (wrong type, shape, id, name or handle).
    InvalidArgument,
    /// An encoding this backend does not load.
    InvalidEncoding,
    /// Past a limit: the model's context, the KV pool, the load size, an instance's handles.
    TooLarge,
    /// No graph of that name.
    NotFound,
    /// An execution target this backend does not run on.
    UnsupportedOperation,
    /// Anything else (a device failure); the host's log says what.
    RuntimeError,
}

impl Gpt2Error {
    /// The code this error reaches the guest with.
    pub fn kind(&self) -> ErrorKind {
        use Gpt2Error as G;
        match self {
            G::TooLong { .. } => ErrorKind::TooLarge,
            G::Engine(EngineError::KvPoolFull { .. } | EngineError::OverCapacity { .. }) => {
                ErrorKind::TooLarge
            }
            G::Engine(EngineError::Load(LoadError::TooLarge { .. })) => ErrorKind::TooLarge,
            G::Engine(EngineError::Load(_)) => ErrorKind::InvalidArgument,
            G::Engine(EngineError::EmptySequence | EngineError::TokenOutOfRange { .. }) => {
                ErrorKind::InvalidArgument
            }
            G::Engine(_) | G::TargetDevice(_) => ErrorKind::RuntimeError,
            G::UnsupportedTarget(_) => ErrorKind::UnsupportedOperation,
            G::WrongTensorType { .. }
            | G::WrongShape { .. }
            | G::EmptySequence
            | G::TokenOutOfRange { .. }
            | G::LogitsFromOutOfRange { .. }
            | G::NoSuchInput(_)
            | G::NoSuchOutput(_)
            | G::NoInput
            | G::NotComputed(_)
            | G::NoAllLogits
            | G::BadRule(_)
            | G::BadProcessing(_)
            | G::NoDrawRule => ErrorKind::InvalidArgument,
        }
    }
}

/// What went wrong, in the words of the error that came back through wasmtime-wasi-nn's
/// backend traits (its own Display says only "Failed while accessing backend").
pub fn backend_error_message(e: &BackendError) -> String {
    match e {
        BackendError::BackendAccess(inner) => format!("{inner:#}"),
        other => other.to_string(),
    }
}

/// The code of an error that came back through wasmtime-wasi-nn's backend traits.
pub fn backend_error_kind(e: &BackendError) -> ErrorKind {
    match e {
        BackendError::BackendAccess(inner) => match inner.downcast_ref::<Gpt2Error>() {
            Some(e) => e.kind(),
            None => ErrorKind::RuntimeError,
        },
        BackendError::NotEnoughMemory(_) => ErrorKind::TooLarge,
        BackendError::UnsupportedTensorType(_) => ErrorKind::InvalidArgument,
        _ => ErrorKind::RuntimeError,
    }
}

impl From<LoadError> for Gpt2Error {
    fn from(e: LoadError) -> Self {
        Gpt2Error::Engine(EngineError::Load(e))
    }
}

impl From<Gpt2Error> for BackendError {
    fn from(e: Gpt2Error) -> Self {
        // The guest only sees an error code; the host's log keeps the reason.
        tracing::warn!("wasi-nn: {e}");
        BackendError::BackendAccess(wasmtime::Error::new(e))
    }
}

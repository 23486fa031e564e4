//! A graph loaded on the GPU: what every session and batched step of it shares.

use super::device::Gpu;
use super::ops::Kernels;
use super::weights::DevWeights;
use crate::engine::GpuDtype;
use crate::model::Gpt2Config;
use std::sync::Arc;

/// One graph on the GPU: its weights (uploaded once), the kernels for their dtype, and the
/// cap on each context's KV cache.
pub(crate) struct LoadedModel {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) config: Gpt2Config,
    pub(crate) dtype: GpuDtype,
    pub(crate) kernels: Arc<Kernels>,
    pub(crate) weights: DevWeights,
    pub(crate) max_kv_bytes: usize,
    /// Sessions decode through the persistent kernel where the GPU has it.
    pub(crate) persistent_decode: bool,
}

//! The CUDA executor: a graph's weights on the GPU once, and the batchers ("lanes") its
//! contexts' steps go through.

use super::batch::CudaBatch;
use super::device::Gpu;
use super::error::{self, CudaError};
use super::loaded::LoadedModel;
use super::ops::Kernels;
use super::session::CudaSession;
use super::weights::DevWeights;
use crate::engine::batch::{BatchCounts, Batcher, KvPool};
use crate::engine::{EngineError, EngineOptions, Executor, Session};
use crate::model::{Gpt2Config, Gpt2Weights};
use std::sync::Arc;

/// GPT-2 on the GPU: weights uploaded once, shared by every context; the contexts' decode
/// steps taken together as batched steps ([`CudaBatch`] behind a [`Batcher`]); idle
/// sessions kept for reuse (a request then skips the allocation of its KV cache and buffers,
/// the cuBLAS set-up and the decode-graph capture; a reused session starts empty).
pub struct CudaExecutor {
    inner: Arc<LoadedModel>,
    /// Independent batchers ("lanes", `WASI_NN_HOST_BATCH_LANES`), each with its own batched-step
    /// stream, buffers and steps; a new context joins the first lane with fewer than
    /// `WASI_NN_HOST_LANE_FILL` open, else the one with the fewest. Many streams in one lane wait
    /// for each other at every step (the slowest guest of hundreds sets its pace); two
    /// lanes halve that and run their passes side by side on the GPU. Fewer streams share
    /// one lane, whose single pass a period reads the weights once. They share the KV pool.
    lanes: Vec<Arc<Batcher<CudaBatch>>>,
}

impl CudaExecutor {
    /// Upload `weights` (converted to `options.dtype`) to the GPU. `options.max_kv_bytes`
    /// caps each context's KV cache, `options.kv_pool_bytes` all of them together (by
    /// default three quarters of the memory free once the weights are up).
    pub fn new(weights: &Gpt2Weights, options: &EngineOptions) -> Result<Self, EngineError> {
        let (dtype, max_kv_bytes) = (options.dtype, options.max_kv_bytes);
        let config = weights.config;
        if !config.n_embd.is_multiple_of(8)
            || config.n_embd > 2048
            || !config.head_dim().is_multiple_of(16)
            || config.head_dim() > 128
        {
            return Err(CudaError::unavailable(format!(
                "the CUDA kernels need n_embd % 8 == 0, n_embd <= 2048 and head_dim % 16 == 0, <= 128 (got {config:?})"
            ))
            .into());
        }
        let gpu = Gpu::get(options.gpu)?;
        // A session's own prompt pass runs without cuBLAS, but the batched pass (every
        // decode in company, every short prompt) needs it: say so at load, not at the first
        // request that shares a step.
        if !super::blas::Blas::loadable() {
            return Err(CudaError::unavailable(
                "cuBLAS (libcublas.so.12) was not found: the batched pass needs it; install \
                 CUDA's cuBLAS (in a container image: deploy/build-image.sh --with-cublas) or \
                 add its folder to LD_LIBRARY_PATH",
            )
            .into());
        }
        let kernels = Arc::new(Kernels::load(&gpu, dtype)?);
        let weights = DevWeights::upload(&gpu.ctx.default_stream(), weights, dtype)?;
        // Keep up to 8 GiB of idle sessions (their KV caches and buffers) for reuse.
        let session_bytes = CudaSession::device_bytes(&config, dtype, config.n_ctx);
        let lanes = gpu.settings().batch_lanes;
        let warm = options.warm_contexts.div_ceil(lanes);
        let max_idle = ((8usize << 30) / session_bytes.max(1) / lanes)
            .clamp(1, 64)
            .max(warm);
        let pool_bytes = match options.kv_pool_bytes {
            Some(bytes) => bytes,
            None => error::DriverContext::ctx(gpu.ctx.mem_get_info(), "memory info")?.0 / 4 * 3,
        };
        let persistent_decode = (options.persistent_decode)
            .or(gpu.measurement().persistent_decode)
            .unwrap_or(false);
        let inner = Arc::new(LoadedModel {
            gpu,
            config,
            dtype,
            kernels,
            weights,
            max_kv_bytes,
            persistent_decode,
        });
        let pool = KvPool::new(pool_bytes);
        let mut batchers = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let model = CudaBatch::new(inner.clone(), pool.clone(), max_idle);
            model.warm(warm)?;
            let budget = (inner.gpu.settings()).step_tokens_for(inner.config.n_embd);
            batchers.push(Batcher::new(model, budget));
        }
        Ok(Self {
            inner,
            lanes: batchers,
        })
    }

    /// The batchers' counts (steps, items over all steps, the largest step).
    pub fn batch_stats(&self) -> (usize, usize, usize) {
        let c = self.counts();
        (c.steps, c.items, c.largest)
    }

    /// Every lane's counts together.
    fn counts(&self) -> BatchCounts {
        self.lanes
            .iter()
            .map(|lane| lane.counts())
            .fold(BatchCounts::default(), BatchCounts::with)
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.inner.gpu
    }

    /// A new session with its concrete type, outside the pool (checks and benchmarks).
    #[cfg(feature = "dev")]
    pub fn open(&self) -> Result<CudaSession, EngineError> {
        Ok(CudaSession::new(self.inner.clone())?)
    }

    /// The weights on the GPU (the kernel workbench feeds them to single kernels).
    #[cfg(feature = "dev")]
    pub fn weights(&self) -> &DevWeights {
        &self.inner.weights
    }

    /// A launcher on a new stream for this executor's kernels (the kernel workbench).
    #[cfg(feature = "dev")]
    pub fn launcher(&self) -> Result<super::ops::Launcher, EngineError> {
        use error::DriverContext;
        let stream = self.inner.gpu.ctx.new_stream().ctx("creating a stream")?;
        let inner = &self.inner;
        Ok(super::ops::Launcher::new(
            inner.gpu.clone(),
            stream,
            inner.kernels.clone(),
            inner.config,
            inner.dtype,
        ))
    }
}

impl Executor for CudaExecutor {
    fn config(&self) -> Gpt2Config {
        self.inner.config
    }
    fn new_session(&self) -> Result<Box<dyn Session>, EngineError> {
        let live: Vec<usize> = self.lanes.iter().map(|l| l.model().live()).collect();
        let lane = pick_lane(&live, self.inner.gpu.settings().lane_fill);
        self.lanes
            .get(lane)
            .ok_or_else(|| EngineError::device("no batcher"))?
            .session()
    }
    fn batch_counts(&self) -> Option<BatchCounts> {
        Some(self.counts())
    }
    /// The lanes share one pool.
    fn kv_pool(&self) -> Option<(usize, usize)> {
        let pool = self.lanes.first()?.model().kv_pool();
        Some((pool.used(), pool.cap()))
    }
}

/// The lane a new context joins, given each lane's open contexts: the first with fewer than
/// `fill`, else the one with the fewest (the first of those).
fn pick_lane(live: &[usize], fill: usize) -> usize {
    live.iter().position(|&n| n < fill).unwrap_or_else(|| {
        live.iter()
            .enumerate()
            .min_by_key(|&(_, &n)| n)
            .map_or(0, |(i, _)| i)
    })
}

#[cfg(test)]
mod tests {
    use super::pick_lane;

    #[test]
    fn contexts_fill_the_first_lane_then_spread_to_the_least_loaded() {
        // one stream, and up to `fill`, share the first lane
        assert_eq!(pick_lane(&[0, 0], 128), 0);
        assert_eq!(pick_lane(&[127, 0], 128), 0);
        // then the next lane with room
        assert_eq!(pick_lane(&[128, 0], 128), 1);
        assert_eq!(pick_lane(&[128, 127], 128), 1);
        // a context gone from the first lane frees its room first
        assert_eq!(pick_lane(&[127, 100], 128), 0);
        // every lane full: the least loaded, the first of equals
        assert_eq!(pick_lane(&[130, 128, 129], 128), 1);
        assert_eq!(pick_lane(&[128, 128], 128), 0);
        // one lane
        assert_eq!(pick_lane(&[500], 128), 0);
    }
}

//! The decode step as one persistent kernel (see `kernels/persistent.cu`), where it is
//! chosen: the session's table of layer pointers (weights and its own KV cache) and the
//! kernel's scratch, made once with the session.

use super::CudaSession;
use crate::cuda::buffer::{DevBuf, DevPtr};
use crate::cuda::error::{CudaError, DriverContext};
use crate::cuda::loaded::LoadedModel;
use crate::cuda::ops::persistent::{
    phases, PersistentDecode, PersistentShape, LAYER_POINTERS, TRACE_SLOTS,
};
use crate::cuda::ops::KvLayer;
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// What the persistent decode kernel needs of a session besides its activations.
pub(super) struct Persistent {
    shape: PersistentShape,
    /// `[n_layer * LAYER_POINTERS]`, in `PdLayer`'s order.
    layers: DevBuf<u64>,
    partials: DevBuf<f32>,
    /// The phase counter.
    counter: DevBuf<u32>,
    /// When each phase started and ended (`WASI_NN_HOST_PERSISTENT_TRACE`).
    trace: Option<DevBuf<u64>>,
}

impl Persistent {
    /// The kernel's state for a session of `capacity` positions whose layer `l` keeps its
    /// keys and values at `kv(l)`; None where it is not chosen or cannot take the model.
    pub(super) fn new(
        model: &LoadedModel,
        stream: &Arc<CudaStream>,
        capacity: usize,
        kv: impl Fn(usize) -> KvLayer,
    ) -> Result<Option<Self>, CudaError> {
        let Some((_, shared_limit)) = model.kernels.persistent.as_ref() else {
            return Ok(None);
        };
        if !model.persistent_decode {
            return Ok(None);
        }
        let cfg = model.config;
        let slot = model.gpu.measurement().persistent_slot;
        let sms = model.gpu.sms();
        let Some(shape) =
            PersistentShape::new(&cfg, model.dtype, capacity, sms, *shared_limit, slot)
        else {
            tracing::warn!(
                "the persistent decode kernel does not take this model here: the graph runs"
            );
            return Ok(None);
        };
        // a cooperative grid must fit the GPU at once (an MPS client may get fewer SMs)
        let (func, _) =
            model.kernels.persistent.as_ref().ok_or_else(|| {
                CudaError::unavailable("the persistent decode kernel was not loaded")
            })?;
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(
                shape.threads(),
                shape.shared_bytes(),
                None,
            )
            .ctx("persistent decode occupancy")?;
        if (per_sm as usize) * sms < shape.blocks() as usize {
            tracing::warn!(
                "the persistent decode kernel's grid does not fit this GPU at once: the graph runs"
            );
            return Ok(None);
        }
        let mut table = Vec::with_capacity(cfg.n_layer * LAYER_POINTERS);
        for (l, w) in model.weights.layers.iter().enumerate() {
            let cache = kv(l);
            table.extend([
                w.ln1_w.ptr().addr(),
                w.ln1_b.ptr().addr(),
                w.qkv_w.ptr().addr(),
                w.qkv_b.ptr().addr(),
                w.proj_w.ptr().addr(),
                w.proj_b.ptr().addr(),
                w.ln2_w.ptr().addr(),
                w.ln2_b.ptr().addr(),
                w.fc_w.ptr().addr(),
                w.fc_b.ptr().addr(),
                w.fc_proj_w.ptr().addr(),
                w.fc_proj_b.ptr().addr(),
                cache.k.addr(),
                cache.v.addr(),
            ]);
        }
        Ok(Some(Self {
            shape,
            layers: DevBuf::from_host(stream, &table, "persistent decode table")?,
            partials: DevBuf::zeros(stream, shape.partial_floats(&cfg), "attention scratch")?,
            counter: DevBuf::zeros(stream, 1, "persistent decode counter")?,
            trace: match model.gpu.measurement().persistent_trace {
                true => Some(DevBuf::zeros(
                    stream,
                    TRACE_SLOTS * phases(&cfg),
                    "persistent trace",
                )?),
                false => None,
            },
        }))
    }
}

impl CudaSession {
    /// The layers and the LM head of a decode step (its embedding done) as the persistent
    /// kernel, logits into `logits`; false where the session decodes through the graph of
    /// per-layer kernels (and nothing was launched).
    pub(super) fn persistent_layers(&self, logits: DevPtr<f32>) -> Result<bool, CudaError> {
        let Some(p) = &self.persistent else {
            return Ok(false);
        };
        let w = &self.model.weights;
        self.launcher.persistent_decode(PersistentDecode {
            shape: p.shape,
            layers: p.layers.ptr(),
            wte: w.wte.ptr(),
            lnf_w: w.lnf_w.ptr(),
            lnf_b: w.lnf_b.ptr(),
            x: self.x.ptr(),
            q: self.qkv.ptr(),
            fc: self.fc.ptr(),
            partials: p.partials.ptr(),
            logits,
            argmax_key: self.argmax_key.ptr(),
            position: self.position(),
            counter: p.counter.ptr(),
            trace: p.trace.as_ref().map(DevBuf::ptr),
            capacity: self.capacity,
        })?;
        Ok(true)
    }

    /// Whether this session's decode steps run as the persistent kernel.
    pub fn uses_persistent_decode(&self) -> bool {
        self.persistent.is_some()
    }

    /// The last persistent step's phase times (`WASI_NN_HOST_PERSISTENT_TRACE`; see
    /// [`crate::cuda::ops::persistent::phase_times`]); None without a trace.
    #[cfg(feature = "dev")]
    pub fn persistent_trace(&self) -> Result<Option<Vec<u64>>, CudaError> {
        let Some(trace) = self.persistent.as_ref().and_then(|p| p.trace.as_ref()) else {
            return Ok(None);
        };
        Ok(Some(trace.read(self.launcher.stream(), trace.len())?))
    }
}

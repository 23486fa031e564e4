//! The decode step: one new token through the whole model, as one captured CUDA graph.
//!
//! The graph is captured on the session's first step (or when the context is made, see
//! [`CudaSession::capture_decode`]) and serves every step after it: its kernels read the
//! token and the position from device memory (`ids`), so a step is one small upload and one
//! graph launch. Its kernels: the embedding, then per layer either the fused LayerNorm +
//! QKV + attention kernel (sm_90 clusters) or a QKV product and the attention, then the
//! attention projection and the MLP, and last the LM head with its argmax key. Where the
//! session has the persistent kernel (`persistent.rs`), the graph is the embedding and that
//! one kernel.

use super::CudaSession;
use crate::cuda::buffer::{DevPtr, Stored};
use crate::cuda::error::{CudaError, DriverContext};
use crate::cuda::ops::attention::{decode_cluster_shape, DecodeAttention, FusedDecode};
use crate::cuda::ops::matvec::Matvec;
use crate::cuda::ops::{Epilogue, KvLayer};
use crate::cuda::weights::DevLayer;
#[cfg(feature = "dev")]
use crate::engine::EngineError;
use crate::engine::GpuDtype;

impl CudaSession {
    /// The kernels of one decode step (token in `ids[1]`, position in `ids[0]`).
    fn decode_kernels(&self) -> Result<(), CudaError> {
        self.decode_kernels_into(false, self.logits[0].ptr())
    }

    /// The kernels of one decode step, its logits into `logits`; with `feed`, a step run
    /// ahead: its token is the argmax of the step before and its position the one after
    /// `ids[0]`'s (both fed on the GPU by the embedding kernel). Each of the step's products
    /// (and the fused attention) asks L2 for the next one's weights while it runs: they depend
    /// on nothing the step computes, and the chain of short kernels leaves DRAM idle most of
    /// the time.
    pub(super) fn decode_kernels_into(
        &self,
        feed: bool,
        logits: DevPtr<f32>,
    ) -> Result<(), CudaError> {
        let cfg = self.model.config;
        let w = &self.model.weights;
        let c = cfg.n_embd;
        let skip = self.skip();
        let l = &self.launcher;
        // the first bytes of the next weights (more would hold up this kernel's own loads:
        // 1558M's 20 MB MLP weights made its step slower)
        let most = self.model.gpu.measurement().l2_prefetch / self.model.dtype.bytes();
        let prefetch = |next: DevPtr<Stored>| {
            (most > 0).then(|| DevPtr::new(next.addr(), next.len().min(most)))
        };
        // after the last layer: the LM head's first rows (its first blocks')
        let head_start = w.wte.ptr();
        self.embed(1, None, feed)?;
        if !skip.decode_any() && self.persistent_layers(logits)? {
            return Ok(());
        }
        for (i, lw) in w.layers.iter().enumerate() {
            let kv = self.kv_layer(i);
            let after_mlp = w
                .layers
                .get(i + 1)
                .map_or(head_start, |next| next.qkv_w.ptr());
            if self.model.gpu.clusters.is_some() {
                if !skip.attn {
                    self.fused_decode(lw, kv, prefetch(lw.proj_w.ptr()))?;
                }
            } else {
                if !skip.qkv {
                    l.matvec(Matvec {
                        out: self.qkv.ptr(),
                        x: self.x.ptr(),
                        w: lw.qkv_w.ptr(),
                        bias: Some(lw.qkv_b.ptr()),
                        n: 3 * c,
                        k: c,
                        norm: Some(lw.ln1()),
                        epilogue: Epilogue::Qkv,
                        kv: Some((kv, self.position())),
                        argmax_key: None,
                        prefetch: None,
                    })?;
                }
                if !skip.attn {
                    l.decode_attention(DecodeAttention {
                        out: self.h.ptr(),
                        qkv: self.qkv.ptr(),
                        kv,
                        position: self.position(),
                        partial: self.attention_partials.ptr(),
                        max_chunks: self.max_chunks,
                    })?;
                }
            }
            let residual = |x: DevPtr<f32>, w: DevPtr<_>, b: DevPtr<_>, k, next| {
                l.matvec(Matvec {
                    out: self.x.ptr(),
                    x,
                    w,
                    bias: Some(b),
                    n: c,
                    k,
                    norm: None,
                    epilogue: Epilogue::Residual,
                    kv: None,
                    argmax_key: None,
                    prefetch: prefetch(next),
                })
            };
            if !skip.proj {
                let (pw, pb) = (lw.proj_w.ptr(), lw.proj_b.ptr());
                residual(self.h.ptr(), pw, pb, c, lw.fc_w.ptr())?;
            }
            if !skip.mlp {
                l.matvec(Matvec {
                    out: self.fc.ptr(),
                    x: self.x.ptr(),
                    w: lw.fc_w.ptr(),
                    bias: Some(lw.fc_b.ptr()),
                    n: 4 * c,
                    k: c,
                    norm: Some(lw.ln2()),
                    epilogue: Epilogue::Gelu,
                    kv: None,
                    argmax_key: None,
                    prefetch: prefetch(lw.fc_proj_w.ptr()),
                })?;
                let (fp_w, fp_b) = (lw.fc_proj_w.ptr(), lw.fc_proj_b.ptr());
                residual(self.fc.ptr(), fp_w, fp_b, 4 * c, after_mlp)?;
            }
        }
        if !skip.head {
            self.lm_head_into(self.x.ptr(), logits)?;
        }
        Ok(())
    }

    /// LayerNorm, QKV product and attention of one decode step in one kernel: a cluster of
    /// blocks per head (sm_90+); the new key and value are appended to the cache at `ids[0]`
    /// and the attention output goes to h.
    fn fused_decode(
        &self,
        lw: &DevLayer,
        kv: KvLayer,
        prefetch: Option<DevPtr<Stored>>,
    ) -> Result<(), CudaError> {
        let chosen = self.model.gpu.clusters.ok_or_else(|| {
            CudaError::unavailable("the fused decode attention needs sm_90 clusters")
        })?;
        let wide_f32 = self.model.dtype == GpuDtype::F32 && self.model.config.n_embd > 768;
        let (cluster, threads) = decode_cluster_shape(chosen, wide_f32);
        self.launcher.fused_decode(FusedDecode {
            out: self.h.ptr(),
            x: self.x.ptr(),
            qkv_w: lw.qkv_w.ptr(),
            qkv_b: lw.qkv_b.ptr(),
            norm: lw.ln1(),
            kv,
            position: self.position(),
            capacity: self.capacity,
            cluster,
            threads,
            prefetch,
        })
    }

    /// One decode step through the captured graph (captured on first use).
    pub(super) fn decode(&mut self, token: u32) -> Result<(), CudaError> {
        // (ids[0] unknown until the upload is done)
        self.read_out.own_step_begins();
        self.upload_ids(Some(self.read_out.len()), &[token as i32])?;
        self.read_out.decode_position_uploaded();
        self.capture_decode();
        match &self.decode_graph {
            Some(graph) => graph.launch().ctx("decode step"),
            None => self.decode_kernels(),
        }
    }

    /// Capture the decode step as a graph if it is not yet (it reads the token and the
    /// position from device memory, so it serves every step).
    pub(crate) fn capture_decode(&mut self) {
        if self.decode_graph.is_none()
            && !self.capture_failed
            && self.model.gpu.measurement().graphs
        {
            match self.capture(Self::decode_kernels) {
                Ok(graph) => self.decode_graph = graph,
                Err(e) => {
                    // Run this session's steps kernel by kernel instead of failing the request.
                    tracing::warn!("decode graph capture failed, running without a graph: {e}");
                    self.capture_failed = true;
                }
            }
        }
    }
}

/// Hooks for the benchmarks (the `dev` feature): not part of the embedding API.
#[cfg(feature = "dev")]
impl CudaSession {
    /// Run one decode step without copying logits back (the GPU part alone).
    pub fn decode_only(&mut self, token: u32) -> Result<(), EngineError> {
        self.check_room(1)?;
        self.read_out.bare_decode_started();
        self.decode(token)?;
        self.read_out.bare_decode_done();
        Ok(())
    }
}

//! Prefill: several new tokens through the model in one batched pass.
//!
//! The [`PrefillPlan`] is chosen once per session, from the GPU, the dtype, the model and the
//! switches: the products through cuBLAS (+ cuBLASLt in bf16, with the fused bf16 flow) or
//! our tiled kernel, and the attention kernel. A prefill embeds the tokens, runs the layers
//! ([`super::prefill_layers`]), writes every position's logits when asked, and ends with the
//! LM head on the last row. On the bf16 path whose every kernel takes the first position from
//! device memory, a prompt length seen before is captured as a graph the second time and
//! replayed after that.

use super::CudaSession;
use crate::cuda::blas::lt::bucket_rows;
use crate::cuda::blas::Blas;
use crate::cuda::buffer::{Act, DevBuf};
use crate::cuda::error::{CudaError, DriverContext};
use crate::cuda::loaded::LoadedModel;
use crate::cuda::ops::attention::Start;
use crate::cuda::ops::matmul::Matmul;
use crate::cuda::ops::Epilogue;
use crate::engine::EngineError;
use crate::engine::GpuDtype;
use cudarc::driver::CudaGraph;

/// The longest prompt [`CudaSession::warm_prefill`] runs at start: GPT-2's context.
const WARM_PREFILL_MOST: usize = 1024;

/// Captured prefills kept per session (by prompt length), and so twice that many lengths
/// remembered: a length is captured the second time it is seen.
const PREFILL_GRAPHS: usize = 4;

/// How this session's prefills run, chosen once from the GPU, the dtype, the model and the
/// switches.
#[derive(Clone, Copy, Debug)]
pub struct PrefillPlan {
    /// Products through cuBLAS (and cuBLASLt in bf16), else our tiled kernel.
    pub blas: bool,
    /// Attention on tensor cores (bf16 mode, head size 64, sm_80+), reading the QKV
    /// product's bf16 rows when `fresh_kv` (and cuBLASLt has a plan for it).
    pub tensor_cores: bool,
    pub fresh_kv: bool,
    /// Else the tiled CUDA-core attention (head size <= 64), else one block per row.
    pub tiled_attention: bool,
    /// Repeated prompt lengths are captured as graphs (the bf16 path whose every kernel takes
    /// the first position from device memory).
    pub graphs: bool,
}

impl PrefillPlan {
    /// The plan for a session of `model`, with cuBLAS (and cuBLASLt) as `blas` has
    /// them.
    pub(super) fn choose(model: &LoadedModel, blas: Option<&Blas>) -> Self {
        let (cfg, gpu) = (model.config, &model.gpu);
        let switches = gpu.measurement();
        let tensor_cores = model.dtype == GpuDtype::Bf16
            && cfg.head_dim() == 64
            && gpu.tensor_cores
            && switches.tc_attention;
        let has_lt = blas.is_some_and(Blas::has_lt);
        Self {
            blas: blas.is_some(),
            tensor_cores,
            fresh_kv: tensor_cores && switches.fresh_kv && has_lt,
            tiled_attention: cfg.head_dim() <= 64 && switches.tiled_attention,
            graphs: tensor_cores && has_lt && switches.graphs && switches.fresh_kv,
        }
    }
}

impl CudaSession {
    /// A batched prefill of `tokens` at positions len..len+n.
    pub(super) fn prefill(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), CudaError> {
        self.read_out.own_step_begins();
        let cfg = self.model.config;
        let (n, start) = (tokens.len(), self.read_out.len());
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        if all_positions && self.all_logits.is_none() {
            self.all_logits = Some(DevBuf::zeros(
                self.launcher.stream(),
                self.capacity * cfg.vocab_size,
                "logits of every position",
            )?);
        }
        let key = (n, all_positions);
        // a later chunk's all-position logits go after the earlier chunks': not captured
        if self.prefill_graphable() && self.read_out.all_offset() == 0 {
            let cached = self.prefill_graphs.iter().position(|(k, _)| *k == key);
            // a capture stalls everything else on the GPU's set-up lock: only when alone
            let graphed =
                cached.is_some() || (self.may_capture && self.prefill_seen.contains(&key));
            // a captured prefill reads its first position from ids[0]
            self.upload_ids(graphed.then_some(start), &ids)?;
            if let Some(i) = cached {
                // most recently used last
                let entry = self.prefill_graphs.remove(i);
                let launched = entry.1.launch().ctx("prefill graph");
                self.prefill_graphs.push(entry);
                return launched;
            }
            if graphed {
                if let Some(graph) = self.capture_prefill(n, all_positions) {
                    graph.launch().ctx("prefill graph")?;
                    if self.prefill_graphs.len() >= PREFILL_GRAPHS {
                        self.prefill_graphs.remove(0);
                    }
                    self.prefill_graphs.push((key, graph));
                    return Ok(());
                }
            } else {
                if self.prefill_seen.len() >= 2 * PREFILL_GRAPHS {
                    self.prefill_seen.remove(0);
                }
                self.prefill_seen.push(key);
            }
        } else {
            self.upload_ids(None, &ids)?;
        }
        self.prefill_kernels(n, Start::Host(start), all_positions)
    }

    /// Run a prefill of each length that tops a bucket of cuBLASLt's row counts
    /// ([`bucket_rows`]: 2, 4, ... 64, 128, 192, ...) up to [`WARM_PREFILL_MOST`] tokens on this
    /// session, eagerly, and forget it, the lengths seen included (so no later prompt is
    /// captured for them). A process's first prefill loads the prefill path's kernels and
    /// cuBLASLt's (about 0.1 s on an H200), and the first prompt of each bucket of lengths
    /// runs cuBLASLt's heuristic for its products (12-17 ms); this pays both at start, for
    /// every session of the GPU, instead of in the first requests' time to their first token.
    pub(crate) fn warm_prefill(&mut self) -> Result<(), EngineError> {
        let most = self.capacity.min(WARM_PREFILL_MOST);
        let vocab = self.model.config.vocab_size.max(1) as u32;
        let lengths: Vec<usize> = std::iter::successors(Some(2), |&n| Some(bucket_rows(n + 1)))
            .take_while(|&n| n <= most)
            .collect();
        let mut warmed = Ok(());
        for n in lengths {
            let tokens: Vec<u32> = (0..n as u32).map(|t| t % vocab).collect();
            warmed = self.extend_chunk(&tokens, false, false);
            warmed = warmed.and_then(|()| self.synchronize());
            self.reset();
            if warmed.is_err() {
                break;
            }
        }
        self.prefill_seen.clear();
        warmed
    }

    /// Whether this prefill may be captured as a graph (the plan allows it and no capture
    /// failed in this session).
    fn prefill_graphable(&self) -> bool {
        self.plan.graphs && !self.capture_failed
    }

    /// Capture the prefill of `n` tokens (ids in `ids[1..]`, the first position in `ids[0]`) as a
    /// graph; None (and no more prefill graphs for this session) when capture fails.
    fn capture_prefill(&mut self, n: usize, all_positions: bool) -> Option<CudaGraph> {
        let position = self.position();
        let launches = |s: &Self| s.prefill_kernels(n, Start::Device(position), all_positions);
        match self.capture(launches) {
            Ok(graph) => graph,
            Err(e) => {
                tracing::warn!("prefill graph capture failed, running prefills eagerly: {e}");
                self.plan.graphs = false;
                None
            }
        }
    }

    /// The launches of a prefill of the `n` ids in `ids[1..]` at positions `start..` (a device
    /// start: a graph, whose kernels read the first position from `ids[0]`).
    fn prefill_kernels(
        &self,
        n: usize,
        start: Start,
        all_positions: bool,
    ) -> Result<(), CudaError> {
        let (cfg, c) = (self.model.config, self.model.config.n_embd);
        let l = &self.launcher;
        let host_start = match start {
            Start::Host(s) => Some(s),
            Start::Device(_) => None,
        };
        self.embed(n, host_start, false)?;
        let w = &self.model.weights;
        if let Some(blas) = &self.blas {
            // The last layer's MLP bias is still to be added to the rows that are read next.
            if let Some(pending) = self.prefill_layers_blas(blas, n, start)? {
                let first = if all_positions { 0 } else { n - 1 };
                l.add_bias(self.x.ptr().skip(first * c), pending, n - first)?;
            }
        } else {
            self.prefill_layers_tiled(n, host_start.unwrap_or(0))?;
        }
        if let Some(all) = self.all_logits.as_ref().filter(|_| all_positions) {
            let v = cfg.vocab_size;
            let all = all.ptr().skip(self.read_out.all_offset() * v);
            if let Some(blas) = &self.blas {
                // the final LayerNorm writes the head product's input in the weights' type
                let a = self.product_input(blas);
                self.layernorm(a, self.x.ptr(), w.lnf(), None, n)?;
                blas.gemm(l, w.wte.ptr(), a, (n, v, c), (all, v), false)?;
            } else {
                self.layernorm(Act::F32(self.h.ptr()), self.x.ptr(), w.lnf(), None, n)?;
                l.matmul(Matmul {
                    out: all,
                    x: self.h.ptr(),
                    w: w.wte.ptr(),
                    bias: None,
                    rows: n,
                    n: v,
                    k: c,
                    epilogue: Epilogue::Store,
                    start: host_start.unwrap_or(0),
                    kv: None,
                    out_stride: v,
                })?;
            }
        }
        self.lm_head(self.x.ptr().skip((n - 1) * c))
    }
}

/// Hooks for the benchmarks (the `dev` feature): not part of the embedding API.
#[cfg(feature = "dev")]
impl CudaSession {
    /// Turn the capture of repeated prefill shapes on or off (benchmarks of the eager path).
    pub fn set_prefill_graphs(&mut self, on: bool) {
        let switches = self.model.gpu.measurement();
        self.plan.graphs = on && self.plan.tensor_cores && self.plan.fresh_kv && switches.graphs;
        if !on {
            self.prefill_graphs.clear();
            self.prefill_seen.clear();
        }
    }

    /// GPU time of a prefill of `tokens` from position 0, without the host's launch costs: the
    /// prefill's launches captured once as a CUDA graph, replayed `iters` times.
    pub fn prefill_gpu_ms(&mut self, tokens: &[u32], iters: usize) -> Result<f64, EngineError> {
        self.read_out.set_len_only(0);
        self.check_room(tokens.len())?;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        self.upload_ids(None, &ids)?;
        let stream = self.launcher.stream().clone();
        stream.synchronize().ctx("prefill graph")?;
        let graph = self
            .capture(|s| s.prefill_kernels(tokens.len(), Start::Host(0), false))?
            .ok_or_else(|| CudaError::unavailable("empty prefill graph"))?;
        graph.launch().ctx("prefill graph")?;
        stream.synchronize().ctx("prefill graph")?;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            graph.launch().ctx("prefill graph")?;
        }
        stream.synchronize().ctx("prefill graph")?;
        self.read_out.set_len_only(tokens.len());
        Ok(t.elapsed().as_secs_f64() * 1e3 / iters.max(1) as f64)
    }
}

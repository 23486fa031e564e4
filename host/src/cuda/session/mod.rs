//! One sequence on the GPU ([`CudaSession`]): its stream, KV cache and activation buffers,
//! the captured decode graph, the prefill plan chosen once, and the captured prefills.
//!
//! - A decode step (one new token) is one CUDA graph, captured on the session's first step,
//!   of `1 + k * n_layer + 1` kernels that read the token and position from device memory;
//!   only what the guest asks for comes back (4 bytes of argmax, or the logits).
//! - Several new tokens go through as one batched prefill, on the path the [`PrefillPlan`]
//!   names: cuBLAS (+ cuBLASLt in bf16) with the fused bf16 flow, or our tiled kernels. A
//!   bf16 prompt length seen before replays a prefill captured the second time.

use super::blas::{Blas, LtBias, LtEpilogue, Shape};
use super::buffer::{Act, DevBuf, DevPtr, HostCopy, Stored};
use super::error::{CudaError, DriverContext};
use super::loaded::LoadedModel;
use super::ops::attention::{
    decode_cluster_shape, DecodeAttention, FusedDecode, PrefillAttention, Start, ATT_CHUNK,
};
use super::ops::embed_norm::{Embed, LayerNorm};
use super::ops::matmul::{GemmEpilogue, Matmul};
use super::ops::matvec::{argmax_row, Matvec};
use super::ops::{Epilogue, KvLayer, Launcher};
use super::weights::DevLayer;
use crate::engine::{EngineError, GpuDtype, Session};
use crate::model::Gpt2Config;
use crate::switches::Skip;
use cudarc::driver::CudaGraph;
use std::sync::Arc;

/// Captured prefills kept per session (by prompt length), and so twice that many lengths
/// remembered: a length is captured the second time it is seen.
const PREFILL_GRAPHS: usize = 4;

/// Logits buffers of a session: the one the guest reads and one for each of the (at most
/// two) steps run ahead of it (see [`super::batch`]).
pub(crate) const LOGITS_BUFFERS: usize = 3;

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

/// A decode step run ahead on a session's own stream: its position and its token.
struct LoneAhead {
    position: usize,
    token: u32,
    /// The logits buffer it writes (see [`CudaSession::logits_at`]).
    buffer: usize,
}

/// One sequence on the GPU: KV cache, activations, and the captured graphs.
pub struct CudaSession {
    exec: Arc<LoadedModel>,
    launcher: Launcher,
    /// Positions the KV cache can hold (n_ctx unless the per-session cap is lower).
    capacity: usize,
    len: usize,
    k_cache: DevBuf<u8>, // [L, capacity, C] elements of the dtype's `kv_bytes`
    v_cache: DevBuf<u8>,
    x: DevBuf<f32>,   // residual stream [capacity, C]
    h: DevBuf<f32>,   // LayerNorm / attention output [capacity, C]
    qkv: DevBuf<f32>, // [capacity, 3C]
    fc: DevBuf<f32>,  // [capacity, 4C]
    partial: DevBuf<f32>,
    logits: DevBuf<f32>, // [V]
    /// Two more `[V]` for steps run ahead (see [`super::batch`]): each writes a buffer the
    /// guest is not reading and no other step run ahead for it is writing; when the guest's
    /// token is the one guessed, the buffer of that step becomes the one read (`readable`).
    spares: [DevBuf<f32>; 2],
    /// Which buffer holds the last logits: 0 `logits`, 1 and 2 `spares`.
    readable: usize,
    all_logits: Option<DevBuf<f32>>,
    /// [position, ids...]: the decode step's position (or a captured prefill's first one),
    /// then the token ids (one for a decode step), so a step uploads both in one copy.
    ids: DevBuf<i32>,
    /// [1] the argmax key of the last logits (see [`argmax_row`]).
    next: DevBuf<u64>,
    /// Rows of all-position logits from the last extend (0 when not asked for).
    all_rows: usize,
    /// Where the current prefill's all-position logits go (rows already written by the
    /// earlier chunks of the same extend).
    all_offset: usize,
    /// The argmax of the last logits when a batched step brought it back already.
    cached_argmax: Option<u32>,
    /// Whether a repeated prompt shape may be captured now (not while other contexts share
    /// the step: a capture holds them up).
    may_capture: bool,
    max_chunks: usize,
    graph: Option<CudaGraph>,
    graph_failed: bool,
    /// The position ids[0] holds after the last decode through this session's own graph
    /// (None after prompts and batched steps, which leave something else there): a decode
    /// run ahead takes the position after it.
    fed_from: Option<usize>,
    /// The decode step run ahead on this session's stream, if any (see
    /// [`Self::launch_ahead_decode`]).
    lone: Option<LoneAhead>,
    /// Work run ahead may still be under way on this session's stream: a batched pass waits
    /// for it ([`Self::settle_own`]) before it touches the session's cache.
    own_in_flight: bool,
    /// Page-locked landing of the argmax key a decode run ahead is fed from.
    key_copy: Option<HostCopy<u64>>,
    /// Captured decode steps run ahead: logits into `logits` (0) or the first spare (1).
    ahead_graphs: [Option<CudaGraph>; 2],
    plan: PrefillPlan,
    /// Captured prefills by (prompt length, all positions), most recently used last.
    prefill_graphs: Vec<((usize, bool), CudaGraph)>,
    /// Prompt shapes seen (a shape is captured when it comes again).
    prefill_seen: Vec<(usize, bool)>,
    /// cuBLAS for prefill products (None: our tiled kernel), with its scratch buffers.
    blas: Option<Blas>,
}

// SAFETY: the session's device state is only touched through `&mut self` (the `Session`
// methods that launch work take `&mut self`); `&self` methods read plain integers. The raw
// handles inside `CudaGraph` and `Blas` are used from one thread at a time as a result.
unsafe impl Send for CudaSession {}
unsafe impl Sync for CudaSession {}

impl CudaSession {
    /// Device bytes a session of `capacity` positions allocates in [`Self::new`] (its KV
    /// cache, activations, logits, and cuBLAS's scratch with cuBLASLt's workspace; not the
    /// all-position logits, made only when asked for): what the KV pool reserves for it.
    pub(crate) fn device_bytes(cfg: &Gpt2Config, dtype: GpuDtype, capacity: usize) -> usize {
        let (c, l, v) = (cfg.n_embd, cfg.n_layer, cfg.vocab_size);
        let chunks = capacity.div_ceil(ATT_CHUNK as usize);
        let kv = 2 * l * capacity * c * dtype.kv_bytes(); // keys and values
        let f32s = capacity * c * (1 + 1 + 3 + 4) // x, h, qkv, fc
            + cfg.n_head * chunks * (cfg.head_dim() + 2) // attention partials
            + LOGITS_BUFFERS * v // logits, spares
            + capacity * 4 * c; // cuBLAS's f32 scratch
        let bf16s = capacity * c * (4 + 4 + 3); // cuBLAS's bf16 scratch
        kv + 4 * f32s + 2 * bf16s + 4 * (capacity + 1) + 8 + (4 << 20)
    }

    pub(crate) fn new(exec: Arc<LoadedModel>) -> Result<Self, CudaError> {
        let gpu = exec.gpu.clone();
        let _setup = gpu.setup_lock();
        let cfg = exec.config;
        let c = cfg.n_embd;
        let per_position = 2 * cfg.n_layer * c * exec.dtype.kv_bytes();
        let capacity = cfg.n_ctx.min(exec.max_kv_bytes / per_position);
        if capacity == 0 {
            return Err(CudaError::unavailable(format!(
                "the per-context KV cap of {} bytes is below one position ({per_position} bytes)",
                exec.max_kv_bytes
            )));
        }
        let stream = gpu.ctx.new_stream().ctx("creating a stream")?;
        let max_chunks = capacity.div_ceil(ATT_CHUNK as usize);
        let kv = cfg.n_layer * capacity * c * exec.dtype.kv_bytes();
        let switches = gpu.measurement();
        let blas = switches
            .cublas
            .then(|| Blas::new(&stream, capacity, c, switches.cublaslt))
            .flatten();
        let tensor_cores = exec.dtype == GpuDtype::Bf16
            && cfg.head_dim() == 64
            && gpu.tensor_cores
            && switches.tc_attention;
        let has_lt = blas.as_ref().is_some_and(Blas::has_lt);
        let plan = PrefillPlan {
            blas: blas.is_some(),
            tensor_cores,
            fresh_kv: tensor_cores && switches.fresh_kv && has_lt,
            tiled_attention: cfg.head_dim() <= 64 && switches.tiled_attention,
            graphs: tensor_cores && has_lt && switches.graphs && switches.fresh_kv,
        };
        let launcher = Launcher::new(
            gpu.clone(),
            stream.clone(),
            exec.kernels.clone(),
            cfg,
            exec.dtype,
        );
        Ok(Self {
            k_cache: DevBuf::zeros(&stream, kv, "KV cache")?,
            v_cache: DevBuf::zeros(&stream, kv, "KV cache")?,
            x: DevBuf::zeros(&stream, capacity * c, "activations")?,
            h: DevBuf::zeros(&stream, capacity * c, "activations")?,
            qkv: DevBuf::zeros(&stream, capacity * 3 * c, "activations")?,
            fc: DevBuf::zeros(&stream, capacity * 4 * c, "activations")?,
            partial: DevBuf::zeros(
                &stream,
                cfg.n_head * max_chunks * (cfg.head_dim() + 2),
                "attention scratch",
            )?,
            logits: DevBuf::zeros(&stream, cfg.vocab_size, "logits")?,
            spares: [
                DevBuf::zeros(&stream, cfg.vocab_size, "logits")?,
                DevBuf::zeros(&stream, cfg.vocab_size, "logits")?,
            ],
            readable: 0,
            all_logits: None,
            ids: DevBuf::zeros(&stream, capacity + 1, "token buffer")?,
            next: DevBuf::zeros(&stream, 1, "argmax buffer")?,
            all_rows: 0,
            all_offset: 0,
            cached_argmax: None,
            may_capture: true,
            max_chunks,
            capacity,
            len: 0,
            graph: None,
            graph_failed: false,
            fed_from: None,
            lone: None,
            own_in_flight: false,
            key_copy: None,
            ahead_graphs: [None, None],
            plan,
            prefill_graphs: Vec::new(),
            prefill_seen: Vec::new(),
            blas,
            launcher,
            exec,
        })
    }

    /// The prefill plan this session chose.
    pub fn plan(&self) -> PrefillPlan {
        self.plan
    }

    fn skip(&self) -> &Skip {
        &self.exec.gpu.measurement().skip
    }

    /// The position slot (`ids[0]`) and the token ids (`ids[1..]`).
    fn position(&self) -> DevPtr<i32> {
        DevPtr::new(self.ids.ptr().addr(), 1)
    }
    fn tokens(&self) -> DevPtr<i32> {
        self.ids.ptr().skip(1)
    }

    fn kv_layer(&self, l: usize) -> KvLayer {
        let per_layer = self.capacity * self.exec.config.n_embd;
        let bytes = self.exec.dtype.kv_bytes();
        let layer = |buf: &DevBuf<u8>| {
            let p = buf.ptr().skip(l * per_layer * bytes);
            DevPtr::new(p.addr(), per_layer)
        };
        KvLayer {
            k: layer(&self.k_cache),
            v: layer(&self.v_cache),
        }
    }

    /// The embedding of `rows` tokens from `ids[1..]` into x, at positions `start..` (None:
    /// from `ids[0]`).
    fn embed(&self, rows: usize, start: Option<usize>, feed: bool) -> Result<(), CudaError> {
        let w = &self.exec.weights;
        self.launcher.embed(Embed {
            out: self.x.ptr(),
            tokens: self.tokens(),
            wte: w.wte.ptr(),
            wpe: w.wpe.ptr(),
            rows,
            start,
            position: self.position(),
            argmax_key: self.next.ptr(),
            feed,
        })
    }

    /// The LM head for the row at `x`: logits (final LayerNorm fused) into `logits`, and
    /// their argmax key into `next` (cleared by the step's embedding kernel).
    fn lm_head(&self, x: DevPtr<f32>) -> Result<(), CudaError> {
        self.lm_head_into(x, self.logits.ptr())
    }

    /// The LM head into `logits` (see [`Self::lm_head`]).
    fn lm_head_into(&self, x: DevPtr<f32>, logits: DevPtr<f32>) -> Result<(), CudaError> {
        let (cfg, w) = (self.exec.config, &self.exec.weights);
        let head = w.lm_head(cfg, logits, x, self.next.ptr());
        self.launcher.matvec(head)
    }

    /// The kernels of one decode step (token in ids[1], position in ids[0]).
    fn decode_kernels(&self) -> Result<(), CudaError> {
        self.decode_kernels_into(false, self.logits.ptr())
    }

    /// The kernels of one decode step, its logits into `logits`; with `feed`, a step run
    /// ahead: its token is the argmax of the step before and its position the one after
    /// ids[0]'s (both fed on the GPU by the embedding kernel). Each of the step's products
    /// (and the fused attention) asks L2 for the next one's weights while it runs: they depend
    /// on nothing the step computes, and the chain of short kernels leaves DRAM idle most of
    /// the time.
    fn decode_kernels_into(&self, feed: bool, logits: DevPtr<f32>) -> Result<(), CudaError> {
        let cfg = self.exec.config;
        let w = &self.exec.weights;
        let c = cfg.n_embd;
        let skip = self.skip();
        let l = &self.launcher;
        // the first bytes of the next weights (more would hold up this kernel's own loads:
        // 1558M's 20 MB MLP weights made its step slower)
        let most = self.exec.gpu.measurement().l2_prefetch / self.exec.dtype.bytes();
        let prefetch = |next: DevPtr<Stored>| {
            (most > 0).then(|| DevPtr::new(next.addr(), next.len().min(most)))
        };
        // after the last layer: the LM head's first rows (its first blocks')
        let head_start = w.wte.ptr();
        self.embed(1, None, feed)?;
        for (i, lw) in w.layers.iter().enumerate() {
            let kv = self.kv_layer(i);
            let after_mlp = w
                .layers
                .get(i + 1)
                .map_or(head_start, |next| next.qkv_w.ptr());
            if self.exec.gpu.clusters.is_some() {
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
                        partial: self.partial.ptr(),
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
    /// blocks per head (sm_90+); the new key and value are appended to the cache at ids[0]
    /// and the attention output goes to h.
    fn fused_decode(
        &self,
        lw: &DevLayer,
        kv: KvLayer,
        prefetch: Option<DevPtr<Stored>>,
    ) -> Result<(), CudaError> {
        let chosen = self.exec.gpu.clusters.ok_or_else(|| {
            CudaError::unavailable("the fused decode attention needs sm_90 clusters")
        })?;
        let wide_f32 = self.exec.dtype == GpuDtype::F32 && self.exec.config.n_embd > 768;
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
    fn decode(&mut self, token: u32) -> Result<(), CudaError> {
        self.lone = None;
        // (unknown until the upload is done)
        self.fed_from = None;
        self.upload_ids(Some(self.len), &[token as i32])?;
        self.fed_from = Some(self.len);
        self.capture_decode();
        match &self.graph {
            Some(graph) => graph.launch().ctx("decode step"),
            None => self.decode_kernels(),
        }
    }

    /// Capture the decode step as a graph if it is not yet (it reads the token and the
    /// position from device memory, so it serves every step).
    pub(crate) fn capture_decode(&mut self) {
        if self.graph.is_none() && !self.graph_failed && self.exec.gpu.measurement().graphs {
            match self.capture(Self::decode_kernels) {
                Ok(graph) => self.graph = graph,
                Err(e) => {
                    // Run this session's steps kernel by kernel instead of failing the request.
                    tracing::warn!("decode graph capture failed, running without a graph: {e}");
                    self.graph_failed = true;
                }
            }
        }
    }

    /// The launches of `launches` captured on the session's stream as a graph (None: nothing
    /// was launched). Holds the GPU's set-up lock.
    fn capture(
        &self,
        launches: impl FnOnce(&Self) -> Result<(), CudaError>,
    ) -> Result<Option<CudaGraph>, CudaError> {
        self.exec
            .gpu
            .capture(self.launcher.stream(), || launches(self))
    }

    /// A batched prefill of `tokens` at positions len..len+n.
    fn prefill(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), CudaError> {
        self.lone = None;
        self.fed_from = None;
        let cfg = self.exec.config;
        let (n, start) = (tokens.len(), self.len);
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
        if self.prefill_graphable() && self.all_offset == 0 {
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

    /// Upload token ids to ids[1..], and with `first` the position to ids[0], in one copy.
    fn upload_ids(&mut self, first: Option<usize>, tokens: &[i32]) -> Result<(), CudaError> {
        let stream = self.launcher.stream().clone();
        match first {
            Some(pos) => {
                let mut all = Vec::with_capacity(tokens.len() + 1);
                all.push(pos as i32);
                all.extend_from_slice(tokens);
                self.ids.write(&stream, 0, &all)
            }
            None => self.ids.write(&stream, 1, tokens),
        }
    }

    /// Whether this prefill may be captured as a graph (the plan allows it and no capture
    /// failed in this session).
    fn prefill_graphable(&self) -> bool {
        self.plan.graphs && !self.graph_failed
    }

    /// Capture the prefill of `n` tokens (ids in ids[1..], the first position in ids[0]) as a
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

    /// The launches of a prefill of the `n` ids in ids[1..] at positions `start..` (a device
    /// start: a graph, whose kernels read the first position from ids[0]).
    fn prefill_kernels(
        &self,
        n: usize,
        start: Start,
        all_positions: bool,
    ) -> Result<(), CudaError> {
        let (cfg, c) = (self.exec.config, self.exec.config.n_embd);
        let l = &self.launcher;
        let host_start = match start {
            Start::Host(s) => Some(s),
            Start::Device(_) => None,
        };
        self.embed(n, host_start, false)?;
        let w = &self.exec.weights;
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
            let all = all.ptr().skip(self.all_offset * v);
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

    /// A LayerNorm (left out under `WASI_NN_HOST_SKIP=ln`).
    fn layernorm(
        &self,
        out: Act,
        x: DevPtr<f32>,
        norm: super::ops::Norm,
        pre_bias: Option<DevPtr<super::buffer::Stored>>,
        rows: usize,
    ) -> Result<(), CudaError> {
        if self.skip().ln {
            return Ok(());
        }
        self.launcher.layernorm(LayerNorm {
            out,
            x,
            norm,
            pre_bias,
            rows,
        })
    }

    /// The activations a product of width C reads in the weights' type: bf16 rows in bf16
    /// mode, h in f32.
    fn product_input(&self, blas: &Blas) -> Act {
        match self.exec.dtype {
            GpuDtype::Bf16 => Act::Bf16(blas.x_bf16.ptr()),
            GpuDtype::F32 => Act::F32(self.h.ptr()),
        }
    }

    /// The layers of a prefill through cuBLAS: LayerNorm and the attention and GELU epilogues
    /// write the next GEMM's input directly (bf16 in bf16 mode); the projections accumulate
    /// into the residual stream (beta = 1), with their bias fused (cuBLASLt) or added by the
    /// next LayerNorm. Returns the bias still pending on `x` (the last layer's MLP projection
    /// bias), if any.
    fn prefill_layers_blas(
        &self,
        blas: &Blas,
        n: usize,
        start: Start,
    ) -> Result<Option<DevPtr<super::buffer::Stored>>, CudaError> {
        let c = self.exec.config.n_embd;
        let l = &self.launcher;
        let skip = self.skip();
        let a_c = self.product_input(blas);
        let a_4c = match self.exec.dtype {
            GpuDtype::Bf16 => Act::Bf16(blas.fc_bf16.ptr()),
            GpuDtype::F32 => Act::F32(self.fc.ptr()),
        };
        let bf16_in = |a: Act| match a {
            Act::Bf16(p) => p,
            Act::F32(p) => p.cast(),
        };
        let (x, tmp) = (self.x.ptr(), blas.tmp.ptr());
        let host_start = match start {
            Start::Host(s) => s,
            Start::Device(_) => 0,
        };
        let mut pending = None;
        for (i, lw) in self.exec.weights.layers.iter().enumerate() {
            let kv = self.kv_layer(i);
            self.layernorm(a_c, x, lw.ln1(), pending, n)?;
            // QKV with its bias through cuBLASLt into bf16 rows, the tensor-core attention
            // reading queries, keys and values from them and appending the keys and values to
            // the cache; else a product, then a pass adding the bias and scattering keys and
            // values into the cache
            let qkv_rows = Act::Bf16(blas.qkv_bf16.ptr());
            let qkv_shape = Shape::new((n, 3 * c, c), LtEpilogue::Bias);
            let (qkv_w, qkv_b) = (lw.qkv_w.ptr(), LtBias::Stored(lw.qkv_b.ptr()));
            let fresh = self.plan.fresh_kv
                && blas.lt_matmul(l, qkv_shape, qkv_w, bf16_in(a_c), qkv_b, qkv_rows)?;
            if !fresh && matches!(start, Start::Device(_)) {
                return Err(CudaError::unavailable(
                    "no cuBLASLt plan for the QKV product: the prefill cannot be captured",
                ));
            }
            if !fresh {
                blas.gemm(l, qkv_w, a_c, (n, 3 * c, c), (tmp, 3 * c), false)?;
                self.epilogue(GemmEpilogue {
                    out: Act::F32(self.qkv.ptr()),
                    tmp,
                    bias: lw.qkv_b.ptr(),
                    rows: n,
                    n: 3 * c,
                    epilogue: Epilogue::Qkv,
                    start: host_start,
                    kv: Some(kv),
                    out_stride: 3 * c,
                })?;
            }
            if !skip.pattn {
                let attention = PrefillAttention {
                    out: a_c,
                    kv,
                    start,
                    rows: n,
                };
                self.prefill_attention(attention, fresh.then(|| blas.qkv_bf16.ptr()))?;
            }
            // projection into the residual stream: with its bias (cuBLASLt), or the bias is
            // left to the next LayerNorm
            let residual = |k| Shape {
                accumulate: true,
                ..Shape::new((n, c, k), LtEpilogue::Bias)
            };
            let mut pre_bias = Some(lw.proj_b.ptr());
            let proj_b32 = LtBias::F32(lw.proj_b32());
            if blas.lt_matmul(
                l,
                residual(c),
                lw.proj_w.ptr(),
                bf16_in(a_c),
                proj_b32,
                Act::F32(x),
            )? {
                pre_bias = None;
            } else {
                blas.gemm(l, lw.proj_w.ptr(), a_c, (n, c, c), (x, c), true)?;
            }
            self.layernorm(a_c, x, lw.ln2(), pre_bias, n)?;
            let gelu = Shape::new((n, 4 * c, c), LtEpilogue::GeluBias);
            let fc_b = LtBias::Stored(lw.fc_b.ptr());
            if !blas.lt_matmul(l, gelu, lw.fc_w.ptr(), bf16_in(a_c), fc_b, a_4c)? {
                blas.gemm(l, lw.fc_w.ptr(), a_c, (n, 4 * c, c), (tmp, 4 * c), false)?;
                self.epilogue(GemmEpilogue {
                    out: a_4c,
                    tmp,
                    bias: lw.fc_b.ptr(),
                    rows: n,
                    n: 4 * c,
                    epilogue: Epilogue::Gelu,
                    start: host_start,
                    kv: None,
                    out_stride: 4 * c,
                })?;
            }
            let fc_proj_b32 = LtBias::F32(lw.fc_proj_b32());
            let fp_w = lw.fc_proj_w.ptr();
            if blas.lt_matmul(
                l,
                residual(4 * c),
                fp_w,
                bf16_in(a_4c),
                fc_proj_b32,
                Act::F32(x),
            )? {
                pending = None;
            } else {
                blas.gemm(l, fp_w, a_4c, (n, c, 4 * c), (x, c), true)?;
                pending = Some(lw.fc_proj_b.ptr());
            }
        }
        Ok(pending)
    }

    /// A GEMM epilogue pass (left out under `WASI_NN_HOST_SKIP=epi`).
    fn epilogue(&self, a: GemmEpilogue) -> Result<(), CudaError> {
        if self.skip().epi {
            return Ok(());
        }
        self.launcher.gemm_epilogue(a)
    }

    /// The layers of a prefill on our tiled matrix kernel (no cuBLAS), f32 activations.
    fn prefill_layers_tiled(&self, n: usize, start: usize) -> Result<(), CudaError> {
        let c = self.exec.config.n_embd;
        let l = &self.launcher;
        let (x, h, fc) = (self.x.ptr(), self.h.ptr(), self.fc.ptr());
        let product = |out, x, w, b, n_out, k, epilogue, kv, stride| {
            if self.skip().gemm {
                return Ok(());
            }
            l.matmul(Matmul {
                out,
                x,
                w,
                bias: Some(b),
                rows: n,
                n: n_out,
                k,
                epilogue,
                start,
                kv,
                out_stride: stride,
            })
        };
        for (i, lw) in self.exec.weights.layers.iter().enumerate() {
            let kv = self.kv_layer(i);
            self.layernorm(Act::F32(h), x, lw.ln1(), None, n)?;
            let (qkv_w, qkv_b) = (lw.qkv_w.ptr(), lw.qkv_b.ptr());
            product(
                self.qkv.ptr(),
                h,
                qkv_w,
                qkv_b,
                3 * c,
                c,
                Epilogue::Qkv,
                Some(kv),
                3 * c,
            )?;
            if !self.skip().pattn {
                let attention = PrefillAttention {
                    out: Act::F32(h),
                    kv,
                    start: Start::Host(start),
                    rows: n,
                };
                self.prefill_attention(attention, None)?;
            }
            let (proj_w, proj_b) = (lw.proj_w.ptr(), lw.proj_b.ptr());
            product(x, h, proj_w, proj_b, c, c, Epilogue::Residual, None, c)?;
            self.layernorm(Act::F32(h), x, lw.ln2(), None, n)?;
            let (fc_w, fc_b) = (lw.fc_w.ptr(), lw.fc_b.ptr());
            product(fc, h, fc_w, fc_b, 4 * c, c, Epilogue::Gelu, None, 4 * c)?;
            let (fp_w, fp_b) = (lw.fc_proj_w.ptr(), lw.fc_proj_b.ptr());
            product(x, fc, fp_w, fp_b, c, 4 * c, Epilogue::Residual, None, c)?;
        }
        Ok(())
    }

    /// Causal attention of new rows on the plan's kernel: tensor cores (from the bf16 QKV
    /// rows `fresh`, or from the cache), else tiled, else one block per row; a bf16 output
    /// without tensor cores goes through h and a conversion.
    fn prefill_attention(
        &self,
        a: PrefillAttention,
        fresh: Option<DevPtr<super::buffer::Bf16>>,
    ) -> Result<(), CudaError> {
        let l = &self.launcher;
        if self.plan.tensor_cores {
            return match fresh {
                Some(rows) => l.prefill_attention_fresh(a, rows),
                None => l.prefill_attention_mma(a, self.qkv.ptr()),
            };
        }
        if fresh.is_some() || matches!(a.start, Start::Device(_)) {
            return Err(CudaError::unavailable(
                "keys and values from the QKV rows, or the first position from device memory, need the tensor-core attention",
            ));
        }
        if let Act::Bf16(out) = a.out {
            let h = self.h.ptr();
            self.prefill_attention(
                PrefillAttention {
                    out: Act::F32(h),
                    ..a
                },
                None,
            )?;
            return l.to_bf16(out, h, a.rows * self.exec.config.n_embd);
        }
        if self.plan.tiled_attention {
            l.prefill_attention_tiled(a, self.qkv.ptr())
        } else {
            l.prefill_attention_plain(a, self.qkv.ptr())
        }
    }

    fn check(&self, n: usize) -> Result<(), EngineError> {
        if self.len + n > self.capacity {
            return Err(EngineError::OverCapacity {
                len: self.len + n,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Copy `count` logits back (from the all-position buffer when `all`) and wait for them.
    fn read(&self, count: usize, all: bool) -> Result<Vec<f32>, CudaError> {
        let stream = self.launcher.stream();
        match (&self.all_logits, all) {
            (Some(buf), true) => buf.read(stream, count),
            (None, true) => Ok(Vec::new()),
            _ => self.logits_buffer(self.readable).read(stream, count),
        }
    }

    /// Wait for the session's stream.
    pub fn synchronize(&self) -> Result<(), EngineError> {
        Ok(self.launcher.stream().synchronize().ctx("synchronize")?)
    }
}

/// Hooks for the benchmarks (the `dev` feature): not part of the embedding API.
#[cfg(feature = "dev")]
impl CudaSession {
    /// Turn the capture of repeated prefill shapes on or off (benchmarks of the eager path).
    pub fn set_prefill_graphs(&mut self, on: bool) {
        let switches = self.exec.gpu.measurement();
        self.plan.graphs = on && self.plan.tensor_cores && self.plan.fresh_kv && switches.graphs;
        if !on {
            self.prefill_graphs.clear();
            self.prefill_seen.clear();
        }
    }

    /// GPU time of a prefill of `tokens` from position 0, without the host's launch costs: the
    /// prefill's launches captured once as a CUDA graph, replayed `iters` times.
    pub fn prefill_gpu_ms(&mut self, tokens: &[u32], iters: usize) -> Result<f64, EngineError> {
        self.len = 0;
        self.check(tokens.len())?;
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
        self.len = tokens.len();
        Ok(t.elapsed().as_secs_f64() * 1e3 / iters.max(1) as f64)
    }

    /// Run one decode step without copying logits back (the GPU part alone).
    pub fn decode_only(&mut self, token: u32) -> Result<(), EngineError> {
        self.check(1)?;
        self.cached_argmax = None;
        self.readable = 0;
        self.decode(token)?;
        self.len += 1;
        Ok(())
    }
}

/// What the batched step ([`super::batch`]) needs of a session.
impl CudaSession {
    /// Whether `tokens` may run next: not empty, ids in the vocabulary, room in the cache.
    pub(crate) fn admit(&self, tokens: &[u32]) -> Result<(), EngineError> {
        let vocab = self.exec.config.vocab_size;
        if tokens.is_empty() {
            return Err(EngineError::EmptySequence);
        }
        self.check(tokens.len())?;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { id, vocab });
        }
        Ok(())
    }

    /// Run `tokens` on this session's own stream (its decode graph or its prefill); with
    /// `continued`, they are a later chunk of one extend whose all-position logits follow
    /// the earlier chunks'.
    pub(crate) fn extend_chunk(
        &mut self,
        tokens: &[u32],
        all_positions: bool,
        continued: bool,
    ) -> Result<(), EngineError> {
        self.admit(tokens)?;
        self.cached_argmax = None;
        self.readable = 0;
        self.all_offset = if all_positions && continued {
            self.all_rows
        } else {
            0
        };
        if tokens.len() == 1 && !all_positions {
            self.decode(tokens[0])?;
        } else {
            self.prefill(tokens, all_positions)?;
        }
        self.all_rows = if all_positions {
            self.all_offset + tokens.len()
        } else {
            0
        };
        self.len += tokens.len();
        Ok(())
    }

    /// Allow or hold off capturing repeated prompt shapes (already captured ones replay).
    pub(crate) fn allow_capture(&mut self, allowed: bool) {
        self.may_capture = allowed;
    }

    /// The device addresses a batched step's row takes: (layer-0 keys, layer-0 values, the
    /// last logits).
    pub(crate) fn row_addresses(&self) -> (u64, u64, u64) {
        (
            self.k_cache.ptr().addr(),
            self.v_cache.ptr().addr(),
            self.logits.ptr().addr(),
        )
    }

    /// Floats between two layers of the KV cache.
    pub(crate) fn layer_floats(&self) -> usize {
        self.capacity * self.exec.config.n_embd
    }

    /// A batched step appended `added` positions and left the last one's logits (and their
    /// argmax).
    pub(crate) fn advanced_in_batch(&mut self, added: usize, argmax: u32) {
        self.fed_from = None;
        self.len += added;
        self.all_rows = 0;
        self.readable = 0;
        self.cached_argmax = Some(argmax);
    }

    /// A batched pass that this step does not wait for appends `added` positions (their
    /// logits go to the buffer read next, their argmax comes with [`Self::set_argmax`]).
    pub(crate) fn advanced_late(&mut self, added: usize) {
        self.fed_from = None;
        self.len += added;
        self.all_rows = 0;
        self.readable = 0;
        self.cached_argmax = None;
    }

    /// The argmax of the last position's logits, known on the host.
    pub(crate) fn set_argmax(&mut self, argmax: u32) {
        self.cached_argmax = Some(argmax);
    }

    fn logits_buffer(&self, buffer: usize) -> &DevBuf<f32> {
        match buffer {
            1 | 2 => &self.spares[buffer - 1],
            _ => &self.logits,
        }
    }

    /// The device address of logits buffer `buffer` (0 to [`LOGITS_BUFFERS`] - 1).
    pub(crate) fn logits_at(&self, buffer: usize) -> u64 {
        self.logits_buffer(buffer).ptr().addr()
    }

    /// The buffer holding the last logits, the one the guest reads.
    pub(crate) fn readable(&self) -> usize {
        self.readable
    }

    /// The step run ahead (one position, its logits in `buffer`) is this session's next step:
    /// take its results.
    pub(crate) fn advanced_ahead(&mut self, argmax: u32, buffer: usize) {
        self.advanced_ahead_pending(buffer);
        self.cached_argmax = Some(argmax);
    }

    /// The step run ahead is this session's next step, and its pass is still under way: take
    /// its position and logits (in `buffer`) now; its argmax comes with [`Self::set_argmax`].
    pub(crate) fn advanced_ahead_pending(&mut self, buffer: usize) {
        self.fed_from = None;
        self.len += 1;
        self.all_rows = 0;
        self.readable = buffer;
        self.cached_argmax = None;
    }

    /// Launch this session's next decode step now, on its own stream, ahead of its guest:
    /// its token is the argmax of the step just run (fed on the GPU), its logits go to the
    /// buffer the guest is not reading, so nothing the guest can still read changes. When
    /// the guest comes back with exactly that token at that position, its step is done or
    /// under way ([`Self::take_ahead_decode`]); any other call runs after it and overwrites
    /// what it wrote. Returns the argmax of the step just run (read back through page-locked
    /// memory), or None when no step can run ahead: no room, no captured graphs, or the last
    /// step was not a decode through this session's graph (ids[0] holds another position).
    pub(crate) fn launch_ahead_decode(&mut self) -> Result<Option<u32>, EngineError> {
        let last_decode = self
            .len
            .checked_sub(1)
            .is_some_and(|p| self.fed_from == Some(p));
        let graphs =
            self.exec.gpu.measurement().graphs && !self.graph_failed && self.graph.is_some();
        if !last_decode || !graphs || self.len >= self.capacity {
            return Ok(None);
        }
        // the step run ahead writes a buffer not being read (`logits` or the first spare)
        let which = usize::from(self.readable == 0);
        if self.ahead_graphs[which].is_none() {
            let logits = self.logits_buffer(which).ptr();
            match self.capture(|s| s.decode_kernels_into(true, logits)) {
                Ok(Some(graph)) => self.ahead_graphs[which] = Some(graph),
                Ok(None) => return Ok(None),
                Err(e) => {
                    tracing::warn!("capturing a decode run ahead failed, not running ahead: {e}");
                    self.graph_failed = true;
                    return Ok(None);
                }
            }
        }
        let stream = self.launcher.stream().clone();
        if self.key_copy.is_none() {
            self.key_copy = Some(HostCopy::new(&stream, 1)?);
        }
        let (Some(copy), Some(graph)) = (self.key_copy.as_mut(), self.ahead_graphs[which].as_ref())
        else {
            return Ok(None);
        };
        // this step's argmax key goes out before the step run ahead clears it
        copy.start(&stream, &self.next, 1)?;
        graph.launch().ctx("decode run ahead")?;
        self.own_in_flight = true;
        let key = copy.wait()?.first().copied().unwrap_or(0);
        let argmax = argmax_row(key);
        // the kernel feeds row 0 for a row past the vocabulary (never an argmax): no guess then
        if (argmax as usize) < self.exec.config.vocab_size {
            self.lone = Some(LoneAhead {
                position: self.len,
                token: argmax,
                buffer: which,
            });
        }
        self.cached_argmax = Some(argmax);
        Ok(Some(argmax))
    }

    /// Take the decode run ahead as this session's next step when it is `token` at the
    /// current position: the position advances and its logits buffer becomes the one read
    /// (the step may still be under way; reads are ordered after it on the stream). False, and
    /// the step run ahead forgotten, otherwise.
    pub(crate) fn take_ahead_decode(&mut self, token: u32) -> bool {
        let Some(ahead) = self
            .lone
            .take()
            .filter(|a| a.position == self.len && a.token == token)
        else {
            return false;
        };
        self.fed_from = Some(self.len);
        self.len += 1;
        self.all_rows = 0;
        self.readable = ahead.buffer;
        self.cached_argmax = None;
        true
    }

    /// Forget any decode run ahead and wait for this session's own stream if work run ahead
    /// may still be under way on it: before a batched pass (on another stream) reads or writes
    /// the session's cache and logits.
    pub(crate) fn settle_own(&mut self) -> Result<(), EngineError> {
        self.lone = None;
        if self.own_in_flight {
            self.synchronize()?;
            self.own_in_flight = false;
        }
        Ok(())
    }

    /// Nothing run ahead on the session's own stream (see [`Self::settle_own`]).
    pub(crate) fn idle_own(&self) -> bool {
        self.lone.is_none() && !self.own_in_flight
    }

    /// Positions the KV cache holds.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn logits_now(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self.read(self.exec.config.vocab_size, false)?)
    }

    pub(crate) fn all_logits_now(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self.read(self.all_rows * self.exec.config.vocab_size, true)?)
    }

    pub(crate) fn argmax_now(&self) -> Result<u32, EngineError> {
        if let Some(id) = self.cached_argmax {
            return Ok(id);
        }
        let key = self.next.read(self.launcher.stream(), 1)?;
        Ok(argmax_row(key.first().copied().unwrap_or(0)))
    }
}

impl Session for CudaSession {
    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) {
        // Positions past `len` are simply overwritten by the next step; a step run ahead
        // was for the old sequence (the wasi-nn backend truncates to the length it keeps
        // before every step: a no-op then, and the step run ahead stays).
        if len < self.len {
            self.lone = None;
        }
        self.len = self.len.min(len);
    }

    fn extend(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), EngineError> {
        self.extend_chunk(tokens, all_positions, false)
    }

    fn last_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        self.logits_now()
    }

    fn all_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        self.all_logits_now()
    }

    fn argmax(&mut self) -> Result<u32, EngineError> {
        self.argmax_now()
    }
}

impl CudaSession {
    /// Forget the sequence (length 0) and its outputs, for the next context to reuse it.
    pub(crate) fn reset(&mut self) {
        self.lone = None;
        self.fed_from = None;
        self.own_in_flight = false;
        self.len = 0;
        self.readable = 0;
        self.all_rows = 0;
        self.all_offset = 0;
        self.cached_argmax = None;
    }
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        // Free the graphs and cuBLAS under the set-up lock; the buffers follow (stream-ordered).
        let gpu = self.exec.gpu.clone();
        let _setup = gpu.setup_lock();
        let _ = self.launcher.stream().synchronize();
        self.graph = None;
        self.ahead_graphs = [None, None];
        self.prefill_graphs.clear();
        self.blas = None;
    }
}

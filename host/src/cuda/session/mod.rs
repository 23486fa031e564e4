//! One sequence on the GPU ([`CudaSession`]): its stream, KV cache and activation buffers,
//! the captured decode graph, the prefill plan chosen once, and the captured prefills.
//!
//! - A decode step (one new token) is one CUDA graph, captured on the session's first step,
//!   of `1 + k * n_layer + 1` kernels that read the token and position from device memory;
//!   only what the guest asks for comes back (4 bytes of argmax, or the logits).
//! - Several new tokens go through as one batched prefill, on the path the [`PrefillPlan`]
//!   names: cuBLAS (+ cuBLASLt in bf16) with the fused bf16 flow, or our tiled kernels. A
//!   bf16 prompt length seen before replays a prefill captured the second time.
//!
//! The files, one concern each:
//! - this one: the session, its buffers and their device addresses, and the kernels both
//!   paths share (the embedding, the LM head);
//! - `sequence.rs`: the sequence as the guest and the batched step see it (the `Session`
//!   trait, a chunk of tokens run on the session's stream, the steps a batched pass ran for
//!   it, reading the outputs back);
//! - `read_out.rs`: where the sequence stands and what reading it gives (its length, the
//!   logits buffer read, the argmax when known, the decode run ahead), one type whose named
//!   transitions every step goes through;
//! - `decode.rs`: the decode step and its captured graph;
//! - `persistent.rs`: the decode step's layers as one persistent kernel, where chosen;
//! - `ahead.rs`: the decode step run ahead on the session's own stream;
//! - `prefill.rs`: the prefill plan, the prefill and its captured graphs;
//!   `prefill_layers.rs`: the layers of a prefill on the plan's path.

mod ahead;
mod decode;
mod persistent;
mod prefill;
mod prefill_layers;
mod read_out;
mod resident_edits;
mod sequence;

pub use prefill::PrefillPlan;
pub(crate) use resident_edits::{Change, ResidentEdits};

use super::blas::Blas;
use super::buffer::{DevBuf, DevPtr, HostCopy};
use super::error::{CudaError, DriverContext};
use super::loaded::LoadedModel;
use super::ops::attention::ATT_CHUNK;
use super::ops::draw::EDIT_WORDS;
use super::ops::embed_norm::Embed;
use super::ops::persistent::{phases, LAYER_POINTERS, MAX_SPLITS, TRACE_SLOTS};
use super::ops::{KvLayer, Launcher};
use crate::engine::{EngineError, GpuDtype};
use crate::model::Gpt2Config;
use crate::switches::{Skip, MAX_AHEAD_DEPTH};
use cudarc::driver::CudaGraph;
use read_out::ReadOut;
use std::sync::{Arc, Mutex};

/// Logits buffers of a session: the one the guest reads and one for each of the (at most
/// [`MAX_AHEAD_DEPTH`]) steps run ahead of it (see [`super::batch`]).
pub(crate) const LOGITS_BUFFERS: usize = MAX_AHEAD_DEPTH + 1;

/// Most edits of one processed draw in a session of `capacity` positions: every token of the
/// bias list and of the sequence distinct.
pub(crate) fn max_edits(capacity: usize) -> usize {
    crate::engine::processing::MAX_BIAS + capacity
}

/// One sequence on the GPU: KV cache, activations, and the captured graphs.
pub struct CudaSession {
    /// The weights, the kernels and the GPU, shared by the executor's sessions.
    model: Arc<LoadedModel>,
    launcher: Launcher,
    /// Positions the KV cache can hold (n_ctx unless the per-session cap is lower).
    capacity: usize,
    /// The sequence's length and what reading it gives (the logits buffer the guest reads,
    /// the argmax when known, the decode run ahead on this stream, ...).
    read_out: ReadOut,
    k_cache: DevBuf<u8>, // [L, capacity, C] elements of the dtype's `kv_bytes`
    v_cache: DevBuf<u8>,
    x: DevBuf<f32>,   // residual stream [capacity, C]
    h: DevBuf<f32>,   // LayerNorm / attention output [capacity, C]
    qkv: DevBuf<f32>, // [capacity, 3C]
    fc: DevBuf<f32>,  // [capacity, 4C]
    /// The decode attention's partial results, per head and chunk of positions.
    attention_partials: DevBuf<f32>,
    /// [`LOGITS_BUFFERS`] of `[V]` each: the last logits in the one the guest reads (see
    /// [`ReadOut`]); the others for steps run ahead (see [`super::batch`]): each writes a
    /// buffer the guest is not reading and no other step run ahead for it is writing; when the
    /// guest's token is the one guessed, the buffer of that step becomes the one read.
    logits: Vec<DevBuf<f32>>,
    /// Page-locked landing of the last logits the guest reads: a copy to pageable memory
    /// goes through the driver's one staging buffer, so many guests reading at once queue
    /// behind each other there (9 ms a read at 64 sampling streams, 0.17 ms alone).
    logits_host: Mutex<HostCopy<f32>>,
    all_logits: Option<DevBuf<f32>>,
    /// `[position, ids...]`: the decode step's position (or a captured prefill's first one),
    /// then the token ids (one for a decode step), so a step uploads both in one copy.
    ids: DevBuf<i32>,
    /// `[1]`: the argmax key of the last logits (see [`super::ops::matvec::argmax_row`]).
    argmax_key: DevBuf<u64>,
    /// A sampled draw's rule (`[4]`, see [`super::ops::draw::rule_words`]), its token on
    /// the device and its page-locked landing.
    draw_rule: DevBuf<u64>,
    drawn: DevBuf<i32>,
    drawn_host: Mutex<HostCopy<i32>>,
    /// A processed draw's buffers, made at the session's first.
    edited_draws: Option<sequence::EditedDraws>,
    /// Its processing's edits on the GPU for the batched pass's draws.
    resident_edits: Arc<ResidentEdits>,
    /// How the batched pass drew the last position's next token (its key is the draw's, not
    /// the argmax's): by a rule, or by a rule after a processing's edits; None when the key
    /// is the argmax, or there is none.
    keys_drawn: Option<crate::engine::processing::DrawnBy>,
    /// Whether a repeated prompt shape may be captured now (not while other contexts share
    /// the step: a capture holds them up).
    may_capture: bool,
    /// Chunks of positions the decode attention splits the cache into, at most.
    max_chunks: usize,
    /// The decode step captured as a graph (see [`decode`]).
    decode_graph: Option<CudaGraph>,
    /// The decode step's layers as one persistent kernel (sm_90, where chosen).
    persistent: Option<persistent::Persistent>,
    /// A capture failed in this session: its steps run kernel by kernel from then on.
    capture_failed: bool,
    /// Page-locked landing of the argmax key a decode run ahead is fed from.
    argmax_key_host: Option<HostCopy<u64>>,
    /// Captured decode steps run ahead: logits into buffer 0 or 1.
    ahead_decode_graphs: [Option<CudaGraph>; 2],
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
            + LOGITS_BUFFERS * v // logits
            + capacity * 4 * c // cuBLAS's f32 scratch
            + cfg.n_head * MAX_SPLITS * (cfg.head_dim() + 2); // the persistent decode's partials
        let bf16s = capacity * c * (4 + 4 + 3); // cuBLAS's bf16 scratch
                                                // a processed draw's logits, edits, rule and token
        let edits = 4 * v + 4 * EDIT_WORDS * max_edits(capacity);
        let persistent = 8 * LAYER_POINTERS * l + 4 + 8 * TRACE_SLOTS * phases(cfg); // table, counter, trace
        kv + 4 * f32s + 2 * bf16s + 4 * (capacity + 1) + 8 + 36 + persistent + edits + (4 << 20)
    }

    pub(crate) fn new(model: Arc<LoadedModel>) -> Result<Self, CudaError> {
        let gpu = model.gpu.clone();
        let _setup = gpu.setup_lock();
        let cfg = model.config;
        let c = cfg.n_embd;
        let per_position = 2 * cfg.n_layer * c * model.dtype.kv_bytes();
        let capacity = cfg.n_ctx.min(model.max_kv_bytes / per_position);
        if capacity == 0 {
            return Err(CudaError::unavailable(format!(
                "the per-context KV cap of {} bytes is below one position ({per_position} bytes)",
                model.max_kv_bytes
            )));
        }
        let stream = gpu.ctx.new_stream().ctx("creating a stream")?;
        let max_chunks = capacity.div_ceil(ATT_CHUNK as usize);
        let kv = cfg.n_layer * capacity * c * model.dtype.kv_bytes();
        let switches = gpu.measurement();
        let blas = switches
            .cublas
            .then(|| {
                let lt = switches.cublaslt.then_some(&gpu.lt_plans);
                Blas::new(&stream, capacity, c, lt)
            })
            .flatten();
        let plan = PrefillPlan::choose(&model, blas.as_ref());
        let launcher = Launcher::new(
            gpu.clone(),
            stream.clone(),
            model.kernels.clone(),
            cfg,
            model.dtype,
        );
        let mut session = Self {
            k_cache: DevBuf::zeros(&stream, kv, "KV cache")?,
            v_cache: DevBuf::zeros(&stream, kv, "KV cache")?,
            x: DevBuf::zeros(&stream, capacity * c, "activations")?,
            h: DevBuf::zeros(&stream, capacity * c, "activations")?,
            qkv: DevBuf::zeros(&stream, capacity * 3 * c, "activations")?,
            fc: DevBuf::zeros(&stream, capacity * 4 * c, "activations")?,
            attention_partials: DevBuf::zeros(
                &stream,
                cfg.n_head * max_chunks * (cfg.head_dim() + 2),
                "attention scratch",
            )?,
            logits: (0..LOGITS_BUFFERS)
                .map(|_| DevBuf::zeros(&stream, cfg.vocab_size, "logits"))
                .collect::<Result<_, _>>()?,
            logits_host: Mutex::new(HostCopy::new(&stream, cfg.vocab_size)?),
            all_logits: None,
            ids: DevBuf::zeros(&stream, capacity + 1, "token buffer")?,
            argmax_key: DevBuf::zeros(&stream, 1, "argmax buffer")?,
            draw_rule: DevBuf::zeros(&stream, 4, "draw buffer")?,
            drawn: DevBuf::zeros(&stream, 1, "draw buffer")?,
            drawn_host: Mutex::new(HostCopy::new(&stream, 1)?),
            edited_draws: None,
            resident_edits: Arc::new(ResidentEdits::new(&stream, max_edits(capacity))?),
            keys_drawn: None,
            may_capture: true,
            max_chunks,
            capacity,
            read_out: ReadOut::default(),
            decode_graph: None,
            capture_failed: false,
            argmax_key_host: None,
            ahead_decode_graphs: [None, None],
            plan,
            prefill_graphs: Vec::new(),
            prefill_seen: Vec::new(),
            blas,
            launcher,
            model,
            persistent: None,
        };
        session.persistent = persistent::Persistent::new(&session.model, &stream, capacity, |l| {
            session.kv_layer(l)
        })?;
        Ok(session)
    }

    /// The prefill plan this session chose.
    pub fn plan(&self) -> PrefillPlan {
        self.plan
    }

    fn skip(&self) -> &Skip {
        &self.model.gpu.measurement().skip
    }

    /// The position slot (`ids[0]`) and the token ids (`ids[1..]`).
    fn position(&self) -> DevPtr<i32> {
        DevPtr::new(self.ids.ptr().addr(), 1)
    }

    fn tokens(&self) -> DevPtr<i32> {
        self.ids.ptr().skip(1)
    }

    fn kv_layer(&self, l: usize) -> KvLayer {
        let per_layer = self.capacity * self.model.config.n_embd;
        let bytes = self.model.dtype.kv_bytes();
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
        let w = &self.model.weights;
        self.launcher.embed(Embed {
            out: self.x.ptr(),
            tokens: self.tokens(),
            wte: w.wte.ptr(),
            wpe: w.wpe.ptr(),
            rows,
            start,
            position: self.position(),
            argmax_key: self.argmax_key.ptr(),
            feed,
        })
    }

    /// The LM head for the row at `x`: logits (final LayerNorm fused) into `logits`, and
    /// their argmax key into `argmax_key` (cleared by the step's embedding kernel).
    fn lm_head(&self, x: DevPtr<f32>) -> Result<(), CudaError> {
        self.lm_head_into(x, self.logits[0].ptr())
    }

    /// The LM head into `logits` (see [`Self::lm_head`]).
    fn lm_head_into(&self, x: DevPtr<f32>, logits: DevPtr<f32>) -> Result<(), CudaError> {
        let (cfg, w) = (self.model.config, &self.model.weights);
        let head = w.lm_head(cfg, logits, x, self.argmax_key.ptr());
        self.launcher.matvec(head)
    }

    /// The launches of `launches` captured on the session's stream as a graph (None: nothing
    /// was launched). Holds the GPU's set-up lock.
    fn capture(
        &self,
        launches: impl FnOnce(&Self) -> Result<(), CudaError>,
    ) -> Result<Option<CudaGraph>, CudaError> {
        self.model
            .gpu
            .capture(self.launcher.stream(), || launches(self))
    }

    /// Upload token ids to `ids[1..]`, and with `first` the position to `ids[0]`, in one copy.
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

    fn check_room(&self, n: usize) -> Result<(), EngineError> {
        let len = self.read_out.len();
        if len + n > self.capacity {
            return Err(EngineError::OverCapacity {
                len: len + n,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Wait for the session's stream.
    pub fn synchronize(&self) -> Result<(), EngineError> {
        Ok(self.launcher.stream().synchronize().ctx("synchronize")?)
    }

    /// The device addresses a batched step's row takes: (layer-0 keys, layer-0 values, the
    /// last logits).
    pub(crate) fn row_addresses(&self) -> (u64, u64, u64) {
        (
            self.k_cache.ptr().addr(),
            self.v_cache.ptr().addr(),
            self.logits[0].ptr().addr(),
        )
    }

    /// Its processing's edits on the GPU, for the batched pass's draws.
    pub(crate) fn resident_edits(&self) -> &Arc<ResidentEdits> {
        &self.resident_edits
    }

    /// Floats between two layers of the KV cache.
    pub(crate) fn layer_floats(&self) -> usize {
        self.capacity * self.model.config.n_embd
    }

    /// Logits buffer `buffer` (the first past the last).
    fn logits_buffer(&self, buffer: usize) -> &DevBuf<f32> {
        self.logits.get(buffer).unwrap_or(&self.logits[0])
    }

    /// The device address of logits buffer `buffer` (0 to [`LOGITS_BUFFERS`] - 1).
    pub(crate) fn logits_at(&self, buffer: usize) -> u64 {
        self.logits_buffer(buffer).ptr().addr()
    }

    /// Positions the KV cache holds.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        // Free the graphs and cuBLAS under the set-up lock; the buffers follow (stream-ordered).
        let gpu = self.model.gpu.clone();
        let _setup = gpu.setup_lock();
        let _ = self.launcher.stream().synchronize();
        self.decode_graph = None;
        self.ahead_decode_graphs = [None, None];
        self.prefill_graphs.clear();
        self.blas = None;
    }
}

//! The batched pass: one row a token over many contexts, on the batcher's own stream. Each
//! row's token and position and its context's cache and logits addresses go into a table on
//! the GPU; the pass ([`super::forward`]) reads the table, so one CUDA graph per size bucket
//! serves every step of that size (rows rounded up; padding rows touch no cache and no
//! output). Contexts never see each other's caches: a row's addresses come from its own
//! session.

mod forward;
mod order;
mod tiles;

use crate::cuda::blas::{saved_file_name, Blas, Tuned};
use crate::cuda::buffer::{DevBuf, DevPtr, HostCopy};
use crate::cuda::error::{CudaError, DriverContext};
use crate::cuda::loaded::LoadedModel;
use crate::cuda::ops::batch::{
    tiles_fit, AttentionTiles, RowTable, BATCH_ATT_SPAN, BATCH_ATT_SPLITS,
};
use crate::cuda::ops::draw::{batch_rule_words, RowEdits, BATCH_RULE_WORDS, EDIT_WORDS};
use crate::cuda::ops::Launcher;
use crate::cuda::session::CudaSession;
use crate::cuda::session::{max_edits, Change, ResidentEdits};
use crate::cuda::weights::head_rows;
use crate::engine::draw::DrawRule;
use crate::engine::processing::EditedRule;
use crate::engine::{EngineError, GpuDtype, Session};
use cudarc::driver::{CudaGraph, CudaStream};
use rustc_hash::FxHashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Prompts (and chunks) of at most this many tokens go through the batched step, one row a
/// token. A longer prompt among other contexts is cut into chunks of this size that ride the
/// passes beside their decodes; alone it runs on its session's own stream (the prefill path's
/// tensor-core attention).
pub const BATCHED_PROMPT: usize = 64;

/// Positions one block of the batched attention takes before a row is split in more spans
/// (up to [`BATCH_ATT_SPLITS`]) and combined.
const SPAN: usize = BATCH_ATT_SPAN;

/// [`SPAN`] when batch-invariant, where the wave's limit is off: rows of up to this many
/// positions (every stream of a 128-token request) still take one span and no combine.
const INVARIANT_SPAN: usize = 4 * SPAN;

/// Products a round when a product shape's algorithms are timed ([`Blas::tune_products`]).
const TUNING_RUNS: usize = 10;

/// The spans of the batched attention's grid: one per `span` positions of the longest row
/// (short rows: one, and no combine pass), at most [`BATCH_ATT_SPLITS`], and no more than keep
/// the blocks (`row_heads` x spans) within one `wave` of the GPU (0: no limit). Past a wave,
/// more spans only add blocks that wait for a free SM, and the combine. Each row takes one
/// span per `span` of its own positions, at most the grid's (`ba_row_spans` in
/// `kernels/batch.cu`): without the wave's limit, a row's spans depend on the row alone.
fn attention_splits(longest: usize, row_heads: usize, wave: usize, span: usize) -> usize {
    let splits = longest.div_ceil(span).clamp(1, BATCH_ATT_SPLITS);
    match wave {
        0 => splits,
        _ => splits.min(wave / row_heads.max(1)).max(1),
    }
}

/// The rows a step of `rows` runs as (its graph's size): powers of two to 8, then multiples
/// of 8 to 64, then of 32 (a pass's rows, [`crate::switches::Settings::pass_rows_for`], are a
/// multiple of 32, so a step that fits a pass fits its bucket).
pub fn bucket(rows: usize) -> usize {
    match rows {
        0..=8 => rows.next_power_of_two(),
        9..=64 => rows.div_ceil(8) * 8,
        _ => rows.div_ceil(32) * 32,
    }
}

/// The rows the LM head of a step of `padded` rows runs over when `wanted` of them want
/// logits (a table puts those first): the smallest of a quarter, a half and all of the rows
/// (as buckets) that holds them. Prompt rows before a prompt's last want none, and they are
/// most of a step's rows when prompts of hundreds of tokens ride beside the decodes: a few
/// sizes keep the head's product to about the rows that are read, with few graphs.
fn logit_rows(padded: usize, wanted: usize) -> usize {
    logit_row_sizes(padded)
        .into_iter()
        .find(|&rows| rows >= wanted)
        .unwrap_or(padded)
}

/// The sizes [`logit_rows`] picks from for a step of `padded` rows, smallest first.
fn logit_row_sizes(padded: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = [padded.div_ceil(4), padded.div_ceil(2)]
        .into_iter()
        .map(|rows| bucket(rows).min(padded))
        .chain([padded])
        .collect();
    sizes.dedup();
    sizes
}

/// A captured step: (rows as its bucket, attention spans, whether prompt rows are in it, the
/// rows its LM head runs over). Every session of a batch has the same cache layout
/// (`layer_floats`), which the graph bakes in.
type GraphKey = (usize, usize, bool, usize);

/// Floats between two rows of the LM head's product, and the product's N: V rounded up to
/// [`head_rows`] (wte's zero rows past V give zero columns, which no one reads).
fn head_ld(vocab: usize) -> usize {
    head_rows(vocab)
}

/// The batched step's buffers on its own stream, made at the first batched step.
pub(crate) struct StepBuffers {
    launcher: Launcher,
    blas: Blas,
    /// Most rows of a pass: `R` below ([`Pass::max_rows`]).
    rows: usize,
    /// Residual stream `[R, C]`.
    x: DevBuf<f32>,
    /// Product inputs: f32 `[R, 4C]`, or the same bytes as split bf16 rows `[2 * R, 4C]`.
    act: DevBuf<f32>,
    /// The LM head's product rows `[2 * R, head_ld(V)]`.
    head: DevBuf<f32>,
    partial: DevBuf<f32>,
    /// [`INT_SECTIONS`] of `[R]`: tokens, positions, the rows of the pass before whose
    /// argmax is a row's token (-1: none; see [`NextStep::fed`]), then the attention's tiles
    /// ([`AttentionTiles`]: work, tiles, tile rows, tiled).
    ints: DevBuf<i32>,
    /// Key caches, value caches, logits buffers: `[R]` addresses each.
    addrs: DevBuf<u64>,
    pub(crate) keys: DevBuf<u64>,
    /// The rows' draw rules (`[BATCH_RULE_WORDS * R]`, see `batch_draw`): a row whose
    /// context draws its tokens gets the drawn token's key instead of the argmax's.
    rules: DevBuf<u64>,
    /// The changes the pass's draws make to their contexts' edits on the GPU (2 x
    /// [`EDIT_WORDS`] words each, room for the most edits of every row).
    changes: DevBuf<u32>,
    /// Page-locked landing of `keys` for a pass waited for (a pageable copy would queue
    /// behind the guests' in the driver's staging buffer).
    keys_host: HostCopy<u64>,
    /// Captured steps.
    graphs: FxHashMap<GraphKey, CudaGraph>,
    graphs_failed: bool,
}

// SAFETY: the buffers are only touched by the step that holds the mutex around them; the raw
// handles in `Blas` and `CudaGraph` are used from that one thread at a time.
unsafe impl Send for StepBuffers {}

impl StepBuffers {
    fn new(exec: &Arc<LoadedModel>, rows: usize) -> Result<Self, CudaError> {
        let gpu = exec.gpu.clone();
        let cfg = exec.config;
        let c = cfg.n_embd;
        let stream = gpu.ctx.new_stream().ctx("creating a stream")?;
        let m = gpu.measurement();
        let blas = match m.tuned_gemm && m.cublaslt && exec.dtype == GpuDtype::Bf16 {
            true => {
                Blas::new(&stream, 2 * rows, c, Some(&gpu.lt_plans)).map(Blas::with_tuned_products)
            }
            false => Blas::new(&stream, 2 * rows, c, None),
        }
        .ok_or_else(|| CudaError::unavailable("cuBLAS is not loadable"))?;
        let launcher = Launcher::new(gpu, stream.clone(), exec.kernels.clone(), cfg, exec.dtype);
        let zeros = |len, what| DevBuf::<f32>::zeros(&stream, len, what);
        Ok(Self {
            rows,
            x: zeros(rows * c, "batched activations")?,
            act: zeros(rows * 4 * c, "batched activations")?,
            head: zeros(2 * rows * head_ld(cfg.vocab_size), "batched logits")?,
            partial: zeros(
                rows * cfg.n_head * BATCH_ATT_SPLITS * (cfg.head_dim() + 2),
                "batched attention scratch",
            )?,
            ints: DevBuf::zeros(&stream, INT_SECTIONS * rows, "batched step table")?,
            addrs: DevBuf::zeros(&stream, 3 * rows, "batched step table")?,
            keys: DevBuf::zeros(&stream, rows, "batched step table")?,
            rules: DevBuf::zeros(&stream, BATCH_RULE_WORDS * rows, "batched step table")?,
            changes: DevBuf::zeros(
                &stream,
                2 * EDIT_WORDS * rows * max_edits(cfg.n_ctx),
                "batched step table",
            )?,
            keys_host: HostCopy::new(&stream, rows)?,
            launcher,
            blas,
            graphs: FxHashMap::default(),
            graphs_failed: false,
        })
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        self.launcher.stream()
    }

    /// The table of the first `rows` rows (fixed addresses: every graph reads it), its prompt
    /// rows in tiles when `tiles`.
    fn table(
        &self,
        rows: usize,
        (logit_rows, lo_rows): (usize, usize),
        layer_floats: usize,
        tiles: bool,
    ) -> RowTable {
        let (ints, addrs, stride) = (self.ints.ptr(), self.addrs.ptr(), self.rows);
        let part = |p: DevPtr<u64>, i: usize| p.skip(i * stride);
        let section = |i: usize| ints.skip(i * stride);
        let tiles = tiles.then(|| AttentionTiles {
            work: section(3),
            tiles: section(4),
            tile_rows: section(5),
            tiled: section(6),
        });
        RowTable {
            rows,
            logit_rows,
            lo_rows,
            tokens: ints,
            positions: ints.skip(stride),
            k_caches: part(addrs, 0),
            v_caches: part(addrs, 1),
            logits: part(addrs, 2),
            keys: self.keys.ptr(),
            layer_floats,
            tiles,
        }
    }
}

/// Sections of a pass's rows in [`StepBuffers::ints`].
const INT_SECTIONS: usize = 7;

/// One context's rows in a batched pass: its cache, where its last row's logits go, its
/// first position and its tokens.
pub(crate) struct Rows<'t> {
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) logits: u64,
    pub(crate) start: usize,
    pub(crate) tokens: &'t [u32],
    /// A lone token fed on the GPU from this row of the pass before (see [`NextStep::fed`]).
    pub(crate) fed: Option<usize>,
    pub(crate) layer_floats: usize,
    /// The context draws its next token by this rule: its last row's key is the draw's.
    pub(crate) rule: Option<DrawRule>,
    /// Or by this rule after a processing's edits (made for the sequence these rows end),
    /// which goes before `rule`.
    pub(crate) edited: Option<Arc<EditedRule>>,
    /// `edited`'s edits are those of the sequence before the lone token fed on the GPU
    /// (`fed`): the draw makes that token's edit follow ([`Edits::after`]).
    ///
    /// [`Edits::after`]: crate::engine::processing::Edits::after
    pub(crate) follow: bool,
    /// The context's edits on the GPU, where `edited` is set: the draw takes them there, and
    /// the pass uploads only what changed.
    pub(crate) resident: Option<Arc<ResidentEdits>>,
    /// The tokens are (a chunk of) a prompt longer than a pass takes whole
    /// ([`Pass::batched_prompt`]), which alone runs through the prefill path: the rows before
    /// the last are multiplied as bf16, as a prefill's are (see [`RowTable::lo_rows`]). A
    /// short prompt cut by a step's budget is not one.
    pub(crate) chunk: bool,
}

impl<'t> Rows<'t> {
    /// `tokens` at the session's next positions, its last row's logits into the buffer its
    /// guest reads, its next token drawn by `rule` (else the argmax).
    pub(crate) fn of(session: &CudaSession, tokens: &'t [u32], rule: Option<DrawRule>) -> Self {
        let (k, v, logits) = session.row_addresses();
        Self {
            k,
            v,
            logits,
            start: session.len(),
            tokens,
            fed: None,
            layer_floats: session.layer_floats(),
            rule,
            edited: None,
            follow: false,
            resident: None,
            chunk: false,
        }
    }

    /// The same rows, drawn by `edited` where set (see [`Rows::edited`]), with `session`'s
    /// edits on the GPU.
    pub(crate) fn edited(self, edited: Option<Arc<EditedRule>>, session: &CudaSession) -> Self {
        let resident = edited.as_ref().map(|_| session.resident_edits().clone());
        Self {
            edited,
            resident,
            ..self
        }
    }

    /// The same rows, marked as a chunk of a longer prompt or not (see [`Rows::chunk`]).
    pub(crate) fn chunked(self, chunk: bool) -> Self {
        Self { chunk, ..self }
    }
}

/// The batched pass of one batcher: its stream and buffers (made at the first pass) and its
/// captured graphs.
pub(crate) struct Pass {
    pub(crate) exec: Arc<LoadedModel>,
    /// Most rows of one pass (a step with more runs several, in order).
    max_rows: usize,
    /// The pass's stream, once made.
    stream: OnceLock<Arc<CudaStream>>,
    /// The pass's buffers, made at the first pass.
    buffers: Mutex<Option<StepBuffers>>,
}

impl Pass {
    pub(crate) fn new(exec: Arc<LoadedModel>) -> Self {
        Self {
            max_rows: exec.gpu.settings().pass_rows_for(exec.config.n_embd),
            exec,
            stream: OnceLock::new(),
            buffers: Mutex::new(None),
        }
    }

    /// Most rows of one pass ([`crate::switches::Settings::pass_rows_for`]).
    pub(crate) fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// The pass's stream, once its buffers are made.
    pub(crate) fn stream(&self) -> Option<&Arc<CudaStream>> {
        self.stream.get()
    }

    /// Capture the pass's graphs of every size ahead of the first requests (a capture holds
    /// up every context on the GPU), for sessions whose caches are `layer_floats` apart.
    pub(crate) fn capture_all(&self, layer_floats: usize) -> Result<(), EngineError> {
        let gpu = &self.exec.gpu;
        let saved = (gpu.settings().cache_dir.as_ref())
            .map(|dir| dir.join(saved_file_name(gpu.name(), gpu.sms())));
        self.with_buffers(|b| {
            if let Some(path) = &saved {
                let restored = b.blas.restore_tuned(path, gpu.name(), gpu.sms());
                if restored > 0 {
                    tracing::info!(restored, "batched products' algorithms restored");
                }
            }
            self.capture_every_size(b, layer_floats);
            // the graphs hold cuBLASLt's heuristic algorithms for the shapes not restored:
            // time them, and capture the graphs again with the fastest
            if self.tune_products(b) {
                if let Some(path) = &saved {
                    if let Err(e) = b.blas.save_tuned(path, gpu.name(), gpu.sms()) {
                        tracing::warn!("saving the products' algorithms to {path:?}: {e}");
                    }
                }
                b.graphs.clear();
                self.capture_every_size(b, layer_floats);
            }
            Ok(())
        })
    }

    fn capture_every_size(&self, b: &mut StepBuffers, layer_floats: usize) {
        // every size: prompt rows make a step bigger than its contexts
        let mut sizes: Vec<usize> = (1..=self.max_rows).map(bucket).collect();
        sizes.dedup();
        for padded in sizes {
            // the spans a step of this size can ask for
            let most = attention_splits(
                usize::MAX,
                padded * self.exec.config.n_head,
                self.wave(),
                self.span(),
            );
            for splits in 1..=most {
                self.capture(b, (padded, splits, false, padded), layer_floats);
                for logit_rows in self.logit_row_sizes(padded) {
                    self.capture(b, (padded, splits, true, logit_rows), layer_floats);
                }
            }
        }
    }

    /// Time the candidates of the products the pass has met untimed and keep each shape's
    /// fastest ([`Blas::tune_products`]); whether any was timed.
    fn tune_products(&self, b: &StepBuffers) -> bool {
        let started = Instant::now();
        // the timing captures graphs: no session is made or dropped meanwhile (see
        // `Gpu::capture`)
        let setup = self.exec.gpu.setup_lock();
        // SAFETY: the shapes were met by this pass's captures, on its own buffers and the
        // model's weights, which `b` and the pass hold; between passes its outputs are
        // scratch.
        let timed = unsafe { b.blas.tune_products(&b.launcher, TUNING_RUNS) };
        drop(setup);
        let tuned = match timed {
            Ok(tuned) if !tuned.is_empty() => tuned,
            Ok(_) => return false,
            Err(e) => {
                // only a speed-up: the shapes not timed keep cuBLAS's default
                tracing::warn!("timing the batched products' algorithms: {e}");
                return false;
            }
        };
        let sum = |us: fn(&Tuned) -> f64| tuned.iter().map(us).sum::<f64>();
        tracing::info!(
            shapes = tuned.len(),
            changed = tuned
                .iter()
                .filter(|t| t.kept.is_some_and(|k| k != 0))
                .count(),
            default = tuned.iter().filter(|t| t.kept.is_none()).count(),
            heuristic_us = sum(|t| t.heuristic_us),
            kept_us = sum(|t| t.kept_us),
            ms = started.elapsed().as_millis() as u64,
            "batched products' algorithms timed"
        );
        for t in &tuned {
            let kept = match t.kept {
                Some(kept) => format!("candidate {kept} of {}", t.candidates),
                None => "cuBLAS's default".to_owned(),
            };
            tracing::debug!(
                "{}x{}x{}: {:.1} us ({kept}) against the heuristic's {:.1} and the default's {:.1}",
                t.shape.rows,
                t.shape.n,
                t.shape.k,
                t.kept_us,
                t.heuristic_us,
                t.default_us
            );
        }
        true
    }

    /// The rows the LM head of a step of `padded` rows with prompt rows runs over when
    /// `wanted` want logits ([`logit_rows`]; all of them with `NO_LOGIT_ROWS`).
    fn logit_rows(&self, padded: usize, wanted: usize) -> usize {
        match self.exec.gpu.measurement().logit_rows {
            true => logit_rows(padded, wanted),
            false => padded,
        }
    }

    /// The rows of a step of `padded` rows whose split products include their lo rows: the
    /// LM head's (the rows of chunks of longer prompts, before each chunk's last, come after
    /// them and are multiplied as bf16, as a prefill's are), or every row with
    /// `WASI_NN_HOST_SPLIT_PROMPTS`.
    fn lo_rows(&self, padded: usize, logit_rows: usize) -> usize {
        match self.exec.gpu.measurement().split_prompts {
            true => padded,
            false => logit_rows,
        }
    }

    /// The sizes [`Pass::logit_rows`] can give a step of `padded` rows: its graphs.
    fn logit_row_sizes(&self, padded: usize) -> Vec<usize> {
        match self.exec.gpu.measurement().logit_rows {
            true => logit_row_sizes(padded),
            false => vec![padded],
        }
    }

    /// Blocks of the batched attention the GPU runs at once (see [`attention_splits`]; 0, no
    /// limit, when batch-invariant).
    pub(crate) fn wave(&self) -> usize {
        let gpu = &self.exec.gpu;
        match gpu.batch_invariant() {
            true => 0,
            false => gpu.measurement().batch_wave.unwrap_or(8 * gpu.sms()),
        }
    }

    /// Positions a span of the batched attention takes (see [`attention_splits`]).
    pub(crate) fn span(&self) -> usize {
        match self.exec.gpu.batch_invariant() {
            true => INVARIANT_SPAN,
            false => SPAN,
        }
    }

    /// The most tokens of a prompt (or chunk) that run in a batched pass: [`BATCHED_PROMPT`],
    /// or when batch-invariant every chunk a pass holds (the prefill path's products and
    /// attention are not the pass's).
    pub(crate) fn batched_prompt(&self) -> usize {
        match self.exec.gpu.batch_invariant() {
            true => self.max_rows,
            false => BATCHED_PROMPT,
        }
    }

    /// Whether a pass's prompt rows attend in tiles: where the model fits them
    /// ([`tiles_fit`]) on sm_80+ (cp.async); not batch-invariant, where a prompt's chunks (and
    /// so which rows share a tile, or whether a last row of one token takes the decode block)
    /// depend on the company.
    pub(crate) fn tiles(&self) -> bool {
        let gpu = &self.exec.gpu;
        tiles_fit(self.exec.dtype, self.exec.config.head_dim())
            && gpu.tensor_cores()
            && !gpu.batch_invariant()
            && gpu.measurement().prompt_tiles
    }

    /// `f` with the step's buffers (made at first use) locked.
    pub(crate) fn with_buffers<R>(
        &self,
        f: impl FnOnce(&mut StepBuffers) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut guard = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            let made = StepBuffers::new(&self.exec, self.max_rows)?;
            let _ = self.stream.set(made.stream().clone());
            *guard = Some(made);
        }
        match guard.as_mut() {
            Some(b) => f(b),
            None => Err(EngineError::device("batched step buffers missing")),
        }
    }

    /// The graph of `key` captured into `b.graphs` unless it is there, graphs are off, or a
    /// capture failed before (then steps run kernel by kernel from here on).
    pub(crate) fn capture(&self, b: &mut StepBuffers, key: GraphKey, layer_floats: usize) {
        if !self.exec.gpu.measurement().graphs || b.graphs_failed || b.graphs.contains_key(&key) {
            return;
        }
        let (padded, splits, prompts, logit_rows) = key;
        let rows = (logit_rows, self.lo_rows(padded, logit_rows));
        let table = b.table(padded, rows, layer_floats, prompts && self.tiles());
        let stream = b.stream().clone();
        let launches = || self.forward(b, &table, splits, prompts);
        match self.exec.gpu.capture(&stream, launches) {
            Ok(Some(graph)) => {
                b.graphs.insert(key, graph);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("batched step capture failed, running steps eagerly: {e}");
                b.graphs_failed = true;
            }
        }
    }

    /// Upload the table of `inputs` (at most [`Pass::max_rows`] together) and launch their
    /// batched pass, one row per token at its position, without waiting for it; returns the
    /// row of each input's last token.
    pub(crate) fn launch_rows(
        &self,
        b: &mut StepBuffers,
        inputs: &[Rows<'_>],
    ) -> Result<(usize, Vec<usize>), EngineError> {
        let mut touched = Vec::new();
        let launched = self.launch_rows_changing(b, inputs, &mut touched);
        // the changes to the contexts' edits reach the GPU with the pass's draw: without it,
        // what the host holds they are would be wrong
        if launched.is_err() || self.exec.gpu.measurement().skip.draw {
            touched.iter().for_each(|r| r.forget());
        }
        launched
    }

    /// [`Self::launch_rows`], noting in `touched` the contexts whose edits on the GPU the
    /// pass's draw changes.
    fn launch_rows_changing<'i>(
        &self,
        b: &mut StepBuffers,
        inputs: &'i [Rows<'_>],
        touched: &mut Vec<&'i ResidentEdits>,
    ) -> Result<(usize, Vec<usize>), EngineError> {
        let n: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        // a pass of no rows would capture its bucket's graph with no context's cache layout
        if n == 0 {
            return Err(EngineError::device("a batched pass of no rows"));
        }
        // every input has a last row, which the table puts among the first inputs.len()
        if inputs.iter().any(|i| i.tokens.is_empty()) {
            return Err(EngineError::device("a batched input of no tokens"));
        }
        // a draw that makes its edits follow the row's token reads it where the GPU fed it
        if (inputs.iter()).any(|i| i.follow && (i.fed.is_none() || i.tokens.len() != 1)) {
            return Err(EngineError::device(
                "edits that follow a token not fed on the GPU",
            ));
        }
        // the table and the captured graphs hold the buffers' rows (callers cut steps to fit)
        let stride = b.rows;
        if n > stride {
            return Err(EngineError::device(format!(
                "a batched pass of {n} rows, more than {stride}"
            )));
        }
        let padded = bucket(n);
        let prompts = inputs.iter().any(|i| i.tokens.len() > 1);
        let tiles = prompts && self.tiles();
        let sections = if tiles { INT_SECTIONS } else { 3 };
        let mut ints = vec![0i32; sections * stride];
        let mut addrs = vec![0u64; 3 * stride];
        ints[stride + n..stride + padded].fill(-1);
        ints[2 * stride..3 * stride].fill(-1);
        let mut fed = false;
        let drawn = (inputs.iter()).any(|i| i.rule.is_some() || i.edited.is_some());
        let mut rules = match drawn {
            true => vec![0u64; BATCH_RULE_WORDS * padded],
            false => Vec::new(),
        };
        // the changes to the rows' edits on the GPU, and the contexts whose edits they change
        let mut changes = Vec::new();
        let vocab = self.exec.config.vocab_size;
        // each input's last row first, then the rows before it of whole prompts, then of
        // chunks of longer prompts (`order`)
        let shapes: Vec<(usize, bool)> =
            (inputs.iter()).map(|i| (i.tokens.len(), i.chunk)).collect();
        let order = order::order_rows(&shapes);
        let (mut layer_floats, mut longest) = (0, 0);
        let mut last_rows = Vec::with_capacity(inputs.len());
        for (input, rows) in inputs.iter().zip(&order.inputs) {
            for (i, &token) in input.tokens.iter().enumerate() {
                let r = rows.row(i);
                // a token the host learned from a key is below V, except an undecided draw's
                // (V): never an embedding row past the table
                ints[r] = (token as usize).min(vocab - 1) as i32;
                ints[stride + r] = (input.start + i) as i32;
                if let (Some(source), 1) = (input.fed, input.tokens.len()) {
                    ints[2 * stride + r] = source as i32;
                    fed = true;
                }
                addrs[r] = input.k;
                addrs[stride + r] = input.v;
            }
            // logits for the input's last row only
            let (r, last) = (rows.last, input.tokens.len() - 1);
            addrs[2 * stride + r] = input.logits;
            last_rows.push(r);
            let position = input.start + last + 1;
            let words = match (&input.edited, &input.rule) {
                (Some(edited), _) => {
                    let resident = (input.resident.as_deref())
                        .ok_or_else(|| EngineError::device("a processed draw without its edits"))?;
                    let first = changes.len();
                    touched.push(resident);
                    let Some(count) = resident.update(&edited.edits.edits, &mut changes) else {
                        return Err(EngineError::device(format!(
                            "a processed draw of {} edits, more than {}",
                            edited.edits.edits.len(),
                            resident.region().1
                        )));
                    };
                    let at = RowEdits {
                        region: resident.region().0,
                        count,
                        changes: (first as u32, (changes.len() - first) as u32),
                        edits: &edited.edits,
                        follow: input.follow,
                    };
                    Some(batch_rule_words(&edited.rule, position, Some(at)))
                }
                (None, Some(rule)) => Some(batch_rule_words(rule, position, None)),
                (None, None) => None,
            };
            if let Some(words) = words {
                rules[BATCH_RULE_WORDS * r..][..BATCH_RULE_WORDS].copy_from_slice(&words);
            }
            layer_floats = input.layer_floats;
            longest = longest.max(input.start + input.tokens.len());
        }
        if tiles {
            let plan = tiles::plan(&order.inputs, padded);
            let mut put = |section: usize, values: &[i32]| {
                ints[section * stride..][..values.len()].copy_from_slice(values);
            };
            put(3, &plan.work);
            put(4, &plan.tiles);
            put(5, &plan.tile_rows);
            put(6, &plan.tiled);
        }
        let splits = attention_splits(
            longest,
            padded * self.exec.config.n_head,
            self.wave(),
            self.span(),
        );
        // the LM head's rows hold the whole prompts' rows too, and are the split products'
        // lo rows (one size for both keeps the graphs few)
        let logit_rows = match prompts {
            true => self.logit_rows(padded, order.lo_rows),
            false => padded,
        };
        let key = (padded, splits, prompts, logit_rows);
        let stream = b.stream().clone();
        let t0 = Instant::now();
        b.ints.write(&stream, 0, &ints)?;
        b.addrs.write(&stream, 0, &addrs)?;
        if drawn {
            b.rules.write(&stream, 0, &rules)?;
        }
        if !changes.is_empty() {
            let words: Vec<u32> = changes.iter().flat_map(Change::words).collect();
            if words.len() > b.changes.len() {
                return Err(EngineError::device(format!(
                    "a batched pass's draws with {} changes to their edits, room for {}",
                    changes.len(),
                    b.changes.len() / (2 * EDIT_WORDS)
                )));
            }
            b.changes.write(&stream, 0, &words)?;
        }
        self.capture(b, key, layer_floats);
        let rows = (logit_rows, self.lo_rows(padded, logit_rows));
        let table = b.table(padded, rows, layer_floats, tiles);
        if fed {
            // the pass before has left its keys; this pass's embedding clears them
            b.launcher
                .batch_feed(&table, b.ints.ptr().skip(2 * b.rows))?;
        }
        let t1 = Instant::now();
        let graphed = match b.graphs.get(&key).filter(|_| !b.graphs_failed) {
            Some(graph) => {
                graph.launch().ctx("batched step")?;
                true
            }
            None => {
                self.forward(b, &table, splits, prompts)?;
                false
            }
        };
        // `WASI_NN_HOST_SKIP=draw` leaves the draw out: its rows take their argmax (wrong
        // results, only the time counts)
        if drawn && !self.exec.gpu.measurement().skip.draw {
            let scratch = (b.head.ptr(), head_ld(self.exec.config.vocab_size));
            (b.launcher).batch_draw(&table, b.rules.ptr(), scratch, b.changes.ptr())?;
        }
        tracing::trace!(
            rows = n,
            graphed,
            upload_us = (t1 - t0).as_micros() as u64,
            launch_us = t1.elapsed().as_micros() as u64,
            "batched rows launched"
        );
        Ok((n, last_rows))
    }

    /// Launch the pass of `inputs` (at most [`Pass::max_rows`] together) and wait for it:
    /// returns its rows, the row of each input's last token, and the argmax keys of the rows.
    pub(crate) fn run(
        &self,
        inputs: &[Rows<'_>],
    ) -> Result<(usize, Vec<usize>, Vec<u64>), EngineError> {
        let started = Instant::now();
        let ran = self.with_buffers(|b| {
            let (n, last_rows) = self.launch_rows(b, inputs)?;
            let stream = b.stream().clone();
            b.keys_host.start(&stream, &b.keys, n)?;
            Ok((n, last_rows, b.keys_host.wait()?))
        })?;
        tracing::trace!(
            rows = ran.0,
            wait_us = started.elapsed().as_micros() as u64,
            "batched rows"
        );
        Ok(ran)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lm_head_runs_over_a_few_sizes_that_hold_the_rows_wanted() {
        assert_eq!(logit_row_sizes(224), vec![56, 128, 224]);
        assert_eq!(logit_row_sizes(8), vec![2, 4, 8]);
        assert_eq!(logit_row_sizes(1), vec![1]);
        assert_eq!(logit_rows(224, 90), 128);
        assert_eq!(logit_rows(224, 56), 56);
        assert_eq!(logit_rows(224, 129), 224);
        // every size of the largest pass the settings allow (a budget of 1024 tokens)
        let mut sizes: Vec<usize> = (1..=1088).map(bucket).collect();
        sizes.dedup();
        for padded in sizes {
            let options = logit_row_sizes(padded);
            assert!(options.len() <= 3 && options.windows(2).all(|w| w[0] < w[1]));
            for wanted in 1..=padded {
                let rows = logit_rows(padded, wanted);
                assert!(
                    wanted <= rows && rows <= padded,
                    "{padded} {wanted} -> {rows}"
                );
                assert!(options.contains(&rows));
            }
        }
    }

    #[test]
    fn attention_spans_grow_with_the_longest_row_until_the_wave_is_full() {
        // few rows: a span per SPAN positions, at most BATCH_ATT_SPLITS
        assert_eq!(attention_splits(1, 12, 1056, SPAN), 1);
        assert_eq!(attention_splits(SPAN, 12, 1056, SPAN), 1);
        assert_eq!(attention_splits(SPAN + 1, 12, 1056, SPAN), 2);
        assert_eq!(
            attention_splits(100 * SPAN, 12, 1056, SPAN),
            BATCH_ATT_SPLITS
        );
        // 64 rows of 12 heads fill 768 of a 1056-block wave: a second span would not fit
        assert_eq!(attention_splits(3 * SPAN, 64 * 12, 1056, SPAN), 1);
        assert_eq!(attention_splits(3 * SPAN, 32 * 12, 1056, SPAN), 2);
        // no limit: as many spans as the positions ask for
        assert_eq!(attention_splits(3 * SPAN, 256 * 12, 0, SPAN), 3);
        // batch-invariant: no wave, longer spans
        assert_eq!(attention_splits(3 * SPAN, 64 * 12, 0, INVARIANT_SPAN), 1);
        assert_eq!(
            attention_splits(1000, 64 * 12, 0, INVARIANT_SPAN),
            BATCH_ATT_SPLITS
        );
    }

    #[test]
    fn steps_round_up_to_their_bucket() {
        assert_eq!(bucket(3), 4);
        assert_eq!(bucket(9), 16);
        assert_eq!(bucket(65), 96);
        assert_eq!(bucket(320), 320);
        assert_eq!(bucket(1088), 1088);
    }
}

//! `kernels/batch.cu`: one decode step of many contexts, one row each, every row with its
//! own token, position and KV cache read from a [`RowTable`]. Product inputs are an
//! [`Act`]: f32 rows, or in bf16 mode bf16 rows split in hi and lo halves (`[2 * rows, k]`)
//! whose product rows the next kernel sums.

use super::{kernel_args, Epilogue, Launcher, Norm};
use crate::cuda::buffer::{Act, DevPtr, Stored};
use crate::cuda::error::{ensure, CudaError};
use crate::engine::GpuDtype;
use cudarc::driver::{CudaFunction, LaunchConfig};

use super::batch_gemm::MAX_PARTS;

/// Most spans each row's positions are split into by the batched attention (blocks per
/// head and row); steps whose rows are all short take one.
pub const BATCH_ATT_SPLITS: usize = 4;

/// Positions of a row one block of the batched attention takes before the row is cut into
/// more spans, by default ([`BatchAttention::span`]).
pub const BATCH_ATT_SPAN: usize = 64;

/// Rows of a prompt one block of the batched attention takes together (a tile): few, so that
/// a tile's block ends about when the decode rows' blocks beside it do.
pub const BT_Q: u32 = 8;

/// Dynamic shared memory of the bf16 batched attention with tiles: a tile's queries (f32,
/// rows of 68), two stages of 32 keys (fp16, rows of 72) and values (rows of 64), the tile's
/// weights (rows of 33) (`static_assert`ed in kernels/batch.cu); a decode block stages its
/// values there ([`BA_VALUES_SMEM`]).
pub const BT_SMEM: u32 = BT_Q * 68 * 4 + 2 * (32 * 72 * 2 + 32 * 64 * 2) + BT_Q * 33 * 4;

/// Dynamic shared memory of a bf16 decode block of the batched attention: each of its four
/// warps' piece of 32 positions' values of a 64-dimension head, fp16 (`static_assert`ed in
/// kernels/batch.cu); half of it for a block of half the warps.
pub const BA_VALUES_SMEM: u32 = 4 * 32 * 64 * 2;

/// The head size the bf16 batched attention's decode blocks take in warps of their own
/// (`batch_attention_h64`), which may then run as blocks of half the warps.
const BA_HD: usize = 64;

/// Blocks of the bf16 batched attention (`func`) that `sms` SMs run at once as decode blocks
/// of four warps and of two, from the driver's occupancy (None where it does not say).
pub(crate) fn attention_waves(func: &CudaFunction, sms: usize) -> Option<(usize, usize)> {
    let threads = super::attention::ATT_THREADS;
    let per_sm = |threads: u32, smem: u32| {
        func.occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
            .inspect_err(|e| {
                tracing::warn!("batched attention occupancy unknown ({e}): whole blocks")
            })
            .ok()
    };
    let whole = per_sm(threads, BA_VALUES_SMEM)?;
    let half = per_sm(threads / 2, BA_VALUES_SMEM / 2)?;
    Some((whole as usize * sms, half as usize * sms))
}

/// Whether `blocks` of the batched attention run faster as blocks of half the warps, where
/// the GPU holds `whole_wave` whole blocks at once and `half_wave` half ones: where they would
/// take more than one wave of whole blocks and fit one of half blocks. A block's warps share
/// its row's positions, so half the warps take twice the pieces each, in turn; past one wave
/// of half blocks, both sizes take two rounds and the whole blocks' rounds are shorter. A
/// decode pass of 128 rows of 124M is 1,536 blocks: about two waves of whole blocks, one of
/// half blocks (H200).
fn halves_fit(blocks: usize, whole_wave: usize, half_wave: usize) -> bool {
    blocks > whole_wave && blocks <= half_wave
}

/// Whether a model of this weight type and head width can take its prompt rows in tiles:
/// the tiles read the fp16 cache (bf16 weights), a pair or more of a head's dimensions a
/// thread and at most 64.
pub fn tiles_fit(dtype: GpuDtype, head_dim: usize) -> bool {
    dtype == GpuDtype::Bf16 && head_dim <= 64 && head_dim.is_multiple_of(32)
}

/// A pass's prompt rows grouped into tiles for the batched attention (bf16; `bt_attend` in
/// `kernels/batch.cu`): each tile is up to [`BT_Q`] rows of one context at consecutive
/// positions, whose keys and values one block reads once for all of them.
#[derive(Clone, Copy, Debug)]
pub struct AttentionTiles {
    /// Per block index of the grid (`rows` of them): a row, the tile `-2 - work`, or none (-1).
    pub work: DevPtr<i32>,
    /// Per tile: its first entry of `tile_rows`, its rows.
    pub tiles: DevPtr<i32>,
    /// The tiles' rows, each tile's in position order.
    pub tile_rows: DevPtr<i32>,
    /// Per row: 1 in a tile (no block and no combine of its own), else 0.
    pub tiled: DevPtr<i32>,
}

/// The rows of a batched step: per row its token, position (-1: a padding row that touches
/// no cache and no output), the addresses of its layer-0 key and value caches
/// (`[capacity, C]` per layer, `layer_floats` apart), its logits buffer (V floats) and its
/// argmax key.
#[derive(Clone, Copy, Debug)]
pub struct RowTable {
    pub rows: usize,
    /// The first rows, which hold every row whose logits are wanted: the LM head runs over
    /// these alone (at most `rows`).
    pub logit_rows: usize,
    /// The first rows, whose split products (cuBLAS over hi and lo rows) include their lo
    /// rows' (at most `rows`): every row whose logits are read and every row of a whole short
    /// prompt is among them. The rows past them are rows of chunks of prompts longer than a
    /// pass takes whole (which alone run through the prefill path) and padding; their
    /// products take their bf16 hi halves alone, as a prefill's products do. (`lo_rows` is a
    /// bucketed size, so a chunk's first rows may fall below it and keep both halves.)
    pub lo_rows: usize,
    pub tokens: DevPtr<i32>,
    pub positions: DevPtr<i32>,
    pub k_caches: DevPtr<u64>,
    pub v_caches: DevPtr<u64>,
    pub logits: DevPtr<u64>,
    pub keys: DevPtr<u64>,
    /// Floats between two layers of one cache (capacity * C).
    pub layer_floats: usize,
    /// Prompt rows attend in tiles (a step with prompt rows, bf16).
    pub tiles: Option<AttentionTiles>,
}

impl RowTable {
    pub(crate) fn check(&self, what: &'static str) -> Result<(), CudaError> {
        let n = self.rows;
        ensure(
            self.logit_rows <= n
                && self.lo_rows <= n
                && self.tokens.len() >= n
                && self.positions.len() >= n
                && self.k_caches.len() >= n
                && self.v_caches.len() >= n
                && self.logits.len() >= n
                && self.keys.len() >= n
                && self.tiles.is_none_or(|a| {
                    a.work.len() >= n
                        && a.tiles.len() >= n
                        && a.tile_rows.len() >= n
                        && a.tiled.len() >= n
                }),
            what,
        )
    }
}

/// How a product's consumer reads its result (`product_value` in `kernels/batch.cu`): bit 0
/// the split input (hi and lo rows), the bits above the planes of K slices, or for a split
/// input the rows with lo rows ([`RowTable::lo_rows`]).
fn split_in(t: &RowTable, split: bool, parts: usize) -> i32 {
    match split {
        true => 1 | ((t.lo_rows as i32) << 1),
        false => (parts as i32) << 1,
    }
}

/// Columns a thread of `batch_logits` takes (its loads all in flight at once).
pub const BL_PER: u32 = 8;

/// Floats of a product's result: `parts` planes of `rows` rows (twice that, split) of `n`.
fn product_len(rows: usize, n: usize, split: bool, parts: usize) -> usize {
    parts * if split { 2 * rows } else { rows } * n
}

/// The rows a product input holds: `rows` f32 rows, or twice that many split bf16 rows.
fn act_len(a: Act, rows: usize, width: usize) -> usize {
    if a.is_bf16() {
        2 * rows * width
    } else {
        rows * width
    }
}

fn act_fits(a: Act, len: usize) -> bool {
    match a {
        Act::F32(p) => p.len() >= len,
        Act::Bf16(p) => p.len() >= len,
    }
}

/// What updates the residual stream before a LayerNorm: the embedding of the rows' tokens,
/// or a product's result (f32 rows; from a split input, the hi rows' and then, `rows` rows
/// on, the lo rows' of the table's first `lo_rows`) and its bias.
#[derive(Clone, Copy, Debug)]
pub enum Update {
    Embed {
        wte: DevPtr<Stored>,
        wpe: DevPtr<Stored>,
    },
    /// `parts` planes of partial sums (a product over K slices, [`Launcher::batch_gemm`]).
    Product {
        tmp: DevPtr<f32>,
        bias: DevPtr<Stored>,
        split: bool,
        parts: usize,
    },
}

/// `x = update(x)`, then `out = LayerNorm(x)` as a product input.
#[derive(Clone, Copy, Debug)]
pub struct ResidualNorm {
    pub x: DevPtr<f32>,
    pub update: Update,
    pub norm: Norm,
    pub out: Act,
}

/// After a product of width `n` over the table's rows: bias, then GELU or not, into the
/// product input `out`.
#[derive(Clone, Copy, Debug)]
pub struct BatchEpilogue {
    pub out: Act,
    pub tmp: DevPtr<f32>,
    pub bias: DevPtr<Stored>,
    pub n: usize,
    /// [`Epilogue::Gelu`] or [`Epilogue::Store`].
    pub epilogue: Epilogue,
    /// The product's input was split (its result: the hi rows, then `rows` rows on the lo
    /// rows of the table's first `lo_rows`).
    pub split: bool,
    /// Planes of K slices the product left ([`Launcher::batch_gemm`]; 1 from cuBLAS).
    pub parts: usize,
}

/// The QKV product's bias and each row's attention over its own cache of `layer` (its key
/// and value appended first), into the product input `out`, the positions in `splits` spans
/// (1: no combine pass; else `partial` holds `[rows, n_head, splits, hd + 2]`).
#[derive(Clone, Copy, Debug)]
pub struct BatchAttention {
    pub out: Act,
    pub tmp: DevPtr<f32>,
    pub bias: DevPtr<Stored>,
    pub split: bool,
    /// Planes of K slices the QKV product left.
    pub parts: usize,
    pub partial: DevPtr<f32>,
    pub layer: usize,
    /// Spans of the grid: a row takes one per `span` of its positions, at most this many
    /// (`ba_row_spans` in `kernels/batch.cu`).
    pub splits: usize,
    /// Positions a span of a row takes ([`BATCH_ATT_SPAN`] by default).
    pub span: usize,
    /// Each row appends its own key and value first (else [`Launcher::batch_append_kv`] did).
    pub append: bool,
}

impl Launcher {
    /// The residual stream's update (an embedding, or a projection's result with its bias)
    /// and the LayerNorm after it, into the product input `out`.
    pub fn batch_residual_norm(&self, t: &RowTable, a: ResidualNorm) -> Result<(), CudaError> {
        let c = self.config.n_embd;
        t.check("batched residual + layernorm")?;
        let (tmp, bias, split, parts, wte, wpe) = match a.update {
            Update::Embed { wte, wpe } => (0, 0, false, 1, wte.addr(), wpe.addr()),
            Update::Product {
                tmp,
                bias,
                split,
                parts,
            } => {
                ensure(
                    (1..=MAX_PARTS).contains(&parts)
                        && tmp.len() >= product_len(t.rows, c, split, parts),
                    "batched residual + layernorm",
                )?;
                (tmp.addr(), bias.addr(), split, parts, 0, 0)
            }
        };
        ensure(
            a.x.len() >= t.rows * c && act_fits(a.out, act_len(a.out, t.rows, c)),
            "batched residual + layernorm",
        )?;
        let cfg = LaunchConfig {
            grid_dim: (t.rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (split_in, split_out) = (split_in(t, split, parts), i32::from(a.out.is_bf16()));
        let (rows, c) = (t.rows as i32, c as i32);
        let (x, out, ln_w, ln_b) = (a.x.addr(), a.out.addr(), a.norm.w.addr(), a.norm.b.addr());
        let (tokens, pos, keys) = (t.tokens.addr(), t.positions.addr(), t.keys.addr());
        // SAFETY: x holds rows*C floats, out rows (or 2*rows) rows of C, tmp (if any) the
        // product's rows of C; tokens (checked < vocab by the step) and positions (< capacity
        // <= n_ctx, or -1) index the embeddings; keys holds rows u64.
        let mut args = kernel_args![
            &x, &tmp, &bias, &split_in, &tokens, &pos, &wte, &wpe, &ln_w, &ln_b, &out, &split_out,
            &rows, &c, &keys
        ];
        unsafe {
            self.launch(
                &self.kernels.batch_residual_norm,
                cfg,
                1,
                &mut args,
                "batched residual + layernorm",
            )
        }
    }

    pub fn batch_epilogue(&self, t: &RowTable, a: BatchEpilogue) -> Result<(), CudaError> {
        ensure(
            matches!(a.epilogue, Epilogue::Gelu | Epilogue::Store)
                && (1..=MAX_PARTS).contains(&a.parts)
                && a.tmp.len() >= product_len(t.rows, a.n, a.split, a.parts)
                && act_fits(a.out, act_len(a.out, t.rows, a.n)),
            "batched epilogue",
        )?;
        let cfg = LaunchConfig {
            grid_dim: (a.n.div_ceil(256).min(16) as u32, t.rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, n, mode) = (t.rows as i32, a.n as i32, a.epilogue as i32);
        let (split_in, split_out) = (split_in(t, a.split, a.parts), i32::from(a.out.is_bf16()));
        let (out, tmp, bias) = (a.out.addr(), a.tmp.addr(), a.bias.addr());
        // SAFETY: tmp holds the product's rows of n floats and out the rows' n values (or
        // split rows), checked above; bias holds n weights.
        let mut args = kernel_args![&out, &tmp, &bias, &rows, &n, &mode, &split_in, &split_out];
        unsafe {
            self.launch(
                &self.kernels.batch_epilogue,
                cfg,
                1,
                &mut args,
                "batched epilogue",
            )
        }
    }

    pub fn batch_attention(&self, t: &RowTable, a: BatchAttention) -> Result<(), CudaError> {
        let cfg = self.config;
        let (c, hd, heads) = (cfg.n_embd, cfg.head_dim(), cfg.n_head);
        t.check("batched attention")?;
        ensure(
            (1..=MAX_PARTS).contains(&a.parts)
                && a.tmp.len() >= product_len(t.rows, 3 * c, a.split, a.parts)
                && (1..=BATCH_ATT_SPLITS).contains(&a.splits)
                && (1..=1 << 20).contains(&a.span)
                && (a.splits == 1 || a.partial.len() >= t.rows * heads * a.splits * (hd + 2))
                && act_fits(a.out, act_len(a.out, t.rows, c))
                && a.layer < cfg.n_layer
                && hd <= 128,
            "batched attention",
        )?;
        // the bf16 kernel stages values in dynamic shared memory: the output must be its kind
        let bf16 = self.dtype == GpuDtype::Bf16;
        ensure(a.out.is_bf16() == bf16, "batched attention")?;
        ensure(
            t.tiles.is_none() || (tiles_fit(self.dtype, hd) && !a.append),
            "batched attention in tiles",
        )?;
        // passes of decodes alone, each row in one span (the rows are short)
        let halves = bf16
            && hd == BA_HD
            && t.tiles.is_none()
            && a.append
            && a.splits == 1
            && self.half_blocks_fit(heads * t.rows);
        let threads = super::attention::ATT_THREADS;
        let grid = LaunchConfig {
            grid_dim: (heads as u32, a.splits as u32, t.rows as u32),
            block_dim: (if halves { threads / 2 } else { threads }, 1, 1),
            shared_mem_bytes: match (bf16, t.tiles) {
                (false, _) => 0,
                (true, None) if halves => BA_VALUES_SMEM / 2,
                (true, None) => BA_VALUES_SMEM,
                (true, Some(_)) => BT_SMEM.max(BA_VALUES_SMEM),
            },
        };
        let layer_off = (a.layer * t.layer_floats) as i64;
        let (c32, hd32, rows) = (c as i32, hd as i32, t.rows as i32);
        let (split_in, split_out) = (split_in(t, a.split, a.parts), i32::from(a.out.is_bf16()));
        let (append, span) = (i32::from(a.append), a.span as i32);
        let (out, part, tmp, bias) = (a.out.addr(), a.partial.addr(), a.tmp.addr(), a.bias.addr());
        let (pos, kc, vc) = (t.positions.addr(), t.k_caches.addr(), t.v_caches.addr());
        let (work, tiles, tile_rows, tiled) = t.tiles.map_or((0, 0, 0, 0), |a| {
            (
                a.work.addr(),
                a.tiles.addr(),
                a.tile_rows.addr(),
                a.tiled.addr(),
            )
        });
        // SAFETY: each row reads and appends to its own cache of `layer` at positions
        // 0..=position < capacity (checked by the step; padding rows touch none), a tile's
        // rows are one context's (the step builds the tiles); tmp, bias, out and partial are
        // covered (checked above).
        let mut args = kernel_args![
            &out, &part, &tmp, &bias, &split_in, &pos, &kc, &vc, &layer_off, &c32, &hd32, &rows,
            &split_out, &append, &span, &work, &tiles, &tile_rows
        ];
        unsafe {
            self.launch(
                &self.kernels.batch_attention,
                grid,
                1,
                &mut args,
                "batched attention",
            )
        }?;
        if a.splits == 1 {
            return Ok(());
        }
        let grid = LaunchConfig {
            grid_dim: (heads as u32, t.rows as u32, 1),
            block_dim: (super::attention::ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let splits = a.splits as i32;
        // SAFETY: as above; out holds the rows' C values (or split rows).
        let mut args =
            kernel_args![&out, &part, &pos, &hd32, &c32, &rows, &splits, &split_out, &span, &tiled];
        unsafe {
            self.launch(
                &self.kernels.batch_att_combine,
                grid,
                1,
                &mut args,
                "batched attention",
            )
        }
    }

    /// Whether the bf16 batched attention's `blocks` (one span a row) of 64-dimension heads
    /// run as blocks of half the warps ([`halves_fit`], with the kernel's occupancy at either
    /// size). Never batch-invariant: how many warps share a row's positions changes its sums'
    /// order.
    fn half_blocks_fit(&self, blocks: usize) -> bool {
        if self.gpu.batch_invariant() || !self.gpu.measurement().attention_halves {
            return false;
        }
        (self.kernels.batch_attention_waves)
            .is_some_and(|(whole, half)| halves_fit(blocks, whole, half))
    }

    /// The keys and values of every row (the QKV product's rows and bias) into the rows'
    /// caches of `layer` at their positions.
    pub fn batch_append_kv(
        &self,
        t: &RowTable,
        tmp: DevPtr<f32>,
        bias: DevPtr<Stored>,
        (split, parts): (bool, usize),
        layer: usize,
    ) -> Result<(), CudaError> {
        let c = self.config.n_embd;
        t.check("batched key and value append")?;
        ensure(
            (1..=MAX_PARTS).contains(&parts)
                && tmp.len() >= product_len(t.rows, 3 * c, split, parts)
                && layer < self.config.n_layer,
            "batched key and value append",
        )?;
        let cfg = LaunchConfig {
            grid_dim: ((2 * c).div_ceil(256) as u32, t.rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (split, layer_off, c32, rows) = (
            split_in(t, split, parts),
            (layer * t.layer_floats) as i64,
            c as i32,
            t.rows as i32,
        );
        let (tmp, bias, pos, kc, vc) = (
            tmp.addr(),
            bias.addr(),
            t.positions.addr(),
            t.k_caches.addr(),
            t.v_caches.addr(),
        );
        // SAFETY: each row writes its own cache of `layer` at its position < capacity (checked
        // by the step; padding rows write nothing); tmp holds the product's rows of 3C.
        let mut args = kernel_args![&tmp, &bias, &split, &pos, &kc, &vc, &layer_off, &c32, &rows];
        unsafe {
            self.launch(
                &self.kernels.batch_append_kv,
                cfg,
                1,
                &mut args,
                "batched key and value append",
            )
        }
    }

    /// The LM head's product rows (`tmp`, `ld` >= V floats apart) into each row's logits
    /// buffer, with their argmax into the row's key.
    pub fn batch_logits(
        &self,
        t: &RowTable,
        tmp: DevPtr<f32>,
        ld: usize,
        split: bool,
    ) -> Result<(), CudaError> {
        let v = self.config.vocab_size;
        t.check("batched logits")?;
        let tmp_rows = if split { 2 * t.rows } else { t.rows };
        ensure(ld >= v && tmp.len() >= tmp_rows * ld, "batched logits")?;
        let cfg = LaunchConfig {
            grid_dim: (
                v.div_ceil(256 * BL_PER as usize) as u32,
                t.logit_rows as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, split, v, ld) = (t.rows as i32, i32::from(split), v as i32, ld as i32);
        let (tmp, pos, dst, keys) = (
            tmp.addr(),
            t.positions.addr(),
            t.logits.addr(),
            t.keys.addr(),
        );
        // SAFETY: tmp holds the product's rows of ld >= V floats; each real row's logits
        // address is a V-float buffer of its context (set by the step); keys holds rows u64.
        let mut args = kernel_args![&tmp, &rows, &split, &v, &ld, &pos, &dst, &keys];
        unsafe {
            self.launch(
                &self.kernels.batch_logits,
                cfg,
                1,
                &mut args,
                "batched logits",
            )
        }
    }

    /// The tokens of the table's rows whose `feeds[r]` names a row of the pass before: the
    /// argmax that pass left in `t.keys` (see `batch_feed` in `kernels/batch.cu`). Launched
    /// after that pass and before this one's embedding clears the keys.
    pub fn batch_feed(&self, t: &RowTable, feeds: DevPtr<i32>) -> Result<(), CudaError> {
        t.check("batched token feed")?;
        ensure(feeds.len() >= t.rows, "batched token feed")?;
        let cfg = LaunchConfig {
            grid_dim: (t.rows.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, max_rows) = (t.rows as i32, t.keys.len() as i32);
        let v = self.config.vocab_size as i32;
        let (tokens, feeds, keys) = (t.tokens.addr(), feeds.addr(), t.keys.addr());
        // SAFETY: tokens and feeds hold rows i32, keys max_rows u64 (each feed is checked
        // against it); the ids written are below V.
        let mut args = kernel_args![&tokens, &feeds, &keys, &rows, &max_rows, &v];
        unsafe {
            self.launch(
                &self.kernels.batch_feed,
                cfg,
                1,
                &mut args,
                "batched token feed",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::halves_fit;

    #[test]
    fn half_blocks_only_where_whole_ones_take_a_second_wave_and_half_ones_do_not() {
        // an H200: six whole blocks an SM, twelve half ones
        let (whole, half) = (6 * 132, 12 * 132);
        // 124M: 64 rows fit one wave of whole blocks, 128 rows need halves, 160 rows overflow both
        assert!(!halves_fit(64 * 12, whole, half));
        assert!(halves_fit(128 * 12, whole, half));
        assert!(!halves_fit(160 * 12, whole, half));
        // 1558M's 64-row pass: 1,600 blocks, 16 past a wave of half blocks
        assert!(!halves_fit(64 * 25, whole, half));
        assert!(halves_fit(whole + 1, whole, half) && !halves_fit(half + 1, whole, half));
    }
}

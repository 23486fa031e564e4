//! `kernels/batch.cu`: one decode step of many contexts, one row each, every row with its
//! own token, position and KV cache read from a [`RowTable`]. Product inputs are an
//! [`Act`]: f32 rows, or in bf16 mode bf16 rows split in hi and lo halves (`[2 * rows, k]`)
//! whose product rows the next kernel sums.

use super::{kernel_args, Epilogue, Launcher, Norm};
use crate::cuda::buffer::{Act, Bf16, DevPtr, Stored};
use crate::cuda::error::{ensure, CudaError};
use cudarc::driver::LaunchConfig;

/// Most spans each row's positions are split into by the batched attention (blocks per
/// head and row); steps whose rows are all short take one.
pub const BATCH_ATT_SPLITS: usize = 4;

/// Positions of a row one block of the batched attention takes before the row is cut into
/// more spans, by default ([`BatchAttention::span`]).
pub const BATCH_ATT_SPAN: usize = 64;

/// The rows of a batched step: per row its token, position (-1: a padding row that touches
/// no cache and no output), the addresses of its layer-0 key and value caches
/// (`[capacity, C]` per layer, `layer_floats` apart), its logits buffer (V floats) and its
/// argmax key.
#[derive(Clone, Copy, Debug)]
pub struct RowTable {
    pub rows: usize,
    pub tokens: DevPtr<i32>,
    pub positions: DevPtr<i32>,
    pub k_caches: DevPtr<u64>,
    pub v_caches: DevPtr<u64>,
    pub logits: DevPtr<u64>,
    pub keys: DevPtr<u64>,
    /// Floats between two layers of one cache (capacity * C).
    pub layer_floats: usize,
}

impl RowTable {
    fn check(&self, what: &'static str) -> Result<(), CudaError> {
        let n = self.rows;
        ensure(
            self.tokens.len() >= n
                && self.positions.len() >= n
                && self.k_caches.len() >= n
                && self.v_caches.len() >= n
                && self.logits.len() >= n
                && self.keys.len() >= n,
            what,
        )
    }
}

/// How a product's consumer reads its result (`product_value` in `kernels/batch.cu`): bit 0
/// the split input (hi and lo rows), the bits above the planes of K slices.
fn split_in(split: bool, parts: usize) -> i32 {
    i32::from(split) | ((parts as i32) << 1)
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
/// or a product's result (f32 rows, or twice as many from a split input) and its bias.
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
    /// The product's input was split (its result has 2 * rows rows).
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
        let (split_in, split_out) = (split_in(split, parts), i32::from(a.out.is_bf16()));
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
        let (split_in, split_out) = (split_in(a.split, a.parts), i32::from(a.out.is_bf16()));
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
        let grid = LaunchConfig {
            grid_dim: (heads as u32, a.splits as u32, t.rows as u32),
            block_dim: (super::attention::ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let layer_off = (a.layer * t.layer_floats) as i64;
        let (c32, hd32, rows) = (c as i32, hd as i32, t.rows as i32);
        let (split_in, split_out) = (split_in(a.split, a.parts), i32::from(a.out.is_bf16()));
        let (append, span) = (i32::from(a.append), a.span as i32);
        let (out, part, tmp, bias) = (a.out.addr(), a.partial.addr(), a.tmp.addr(), a.bias.addr());
        let (pos, kc, vc) = (t.positions.addr(), t.k_caches.addr(), t.v_caches.addr());
        // SAFETY: each row reads and appends to its own cache of `layer` at positions
        // 0..=position < capacity (checked by the step; padding rows touch none); tmp, bias,
        // out and partial are covered (checked above).
        let mut args = kernel_args![
            &out, &part, &tmp, &bias, &split_in, &pos, &kc, &vc, &layer_off, &c32, &hd32, &rows,
            &split_out, &append, &span
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
            kernel_args![&out, &part, &pos, &hd32, &c32, &rows, &splits, &split_out, &span];
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
            split_in(split, parts),
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
            grid_dim: (v.div_ceil(256 * BL_PER as usize) as u32, t.rows as u32, 1),
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

    /// `out[z][r, :] = (a[r] + a[rows + r]) w^T` over plane z's share of K, for the `rows` rows
    /// of a split bf16 input (`[2 * rows, k]`, hi rows then lo rows): K cut into `plan.slices`
    /// slices summed in order, `plan.planes` f32 planes of `[rows, n]` one after the other
    /// (each slice its own plane, or all folded into one), for a consumer that sums them in
    /// order (`product_value`). The batched step's products on our tensor-core kernel; a row's
    /// result does not depend on the other rows. `None` when the GPU or the shape does not suit
    /// the kernel (the caller then uses cuBLAS).
    pub fn batch_gemm(
        &self,
        w: DevPtr<Stored>,
        a: DevPtr<Bf16>,
        (rows, n, k): (usize, usize, usize),
        out: DevPtr<f32>,
        plan: GemmPlan,
    ) -> Option<Result<(), CudaError>> {
        let (slices, planes, cols) = (plan.slices, plan.planes, plan.cols());
        let funcs = self.kernels.batch_gemm.as_ref()?;
        let usable = self.dtype == crate::engine::GpuDtype::Bf16
            && (1..=MAX_PARTS).contains(&slices)
            && (planes == 1 || planes == slices)
            && rows >= 1
            && n.is_multiple_of(cols)
            && k.is_multiple_of(slices * BG_BK);
        if !usable {
            return None;
        }
        let checked = ensure(
            w.len() >= n * k && a.len() >= 2 * rows * k && out.len() >= planes * rows * n,
            "batched product",
        );
        if let Err(e) = checked {
            return Some(Err(e));
        }
        let cfg = LaunchConfig {
            grid_dim: (
                (planes * rows.div_ceil(BG_STREAMS)) as u32,
                (n / cols) as u32,
                1,
            ),
            block_dim: (BG_THREADS, 1, 1),
            shared_mem_bytes: gemm_shared_bytes(cols) as u32,
        };
        let (c, a, w) = (out.addr(), a.addr(), w.addr());
        let (rows, n, k, slices) = (rows as i32, n as i32, k as i32, slices as i32);
        let func = &funcs[usize::from(!plan.wide) + 2 * usize::from(plan.planes < plan.slices)];
        // SAFETY: w holds n rows of k, a 2 * rows rows of k, out `planes` planes of rows rows
        // of n (checked); the grid covers the rows in tiles of 64 (rows past `rows` neither
        // read nor written), n in whole column tiles and K in `planes` spans of whole slices,
        // each of whole 64-wide stages.
        let mut args = kernel_args![&c, &a, &w, &rows, &n, &k, &slices];
        Some(unsafe { self.launch(func, cfg, 1, &mut args, "batched product") })
    }
}

/// Rows (each as its hi and lo row) and K-stage width of one block of
/// [`Launcher::batch_gemm`], and its two column widths (`BG_STREAMS`, `BG_BK`, `batch_gemm_bf16_n64`
/// / `_n32` in `kernels/batch.cu`).
const BG_STREAMS: usize = 64;
const BG_BK: usize = 64;
const BG_WIDE: usize = 64;
const BG_NARROW: usize = 32;

/// Output columns of one block of [`Launcher::batch_gemm`]: 64 (`wide`) or 32.
fn tile_cols(wide: bool) -> usize {
    if wide {
        BG_WIDE
    } else {
        BG_NARROW
    }
}
const BG_STAGES: usize = 4;
const BG_THREADS: u32 = 256;

/// Dynamic shared memory of [`Launcher::batch_gemm`]'s blocks of `cols` columns: `BG_STAGES`
/// stages of 128 input rows and the tile's weight rows, each row 64 bf16 + 8 of padding.
fn gemm_shared_bytes(cols: usize) -> usize {
    BG_STAGES * (2 * BG_STREAMS + cols) * (BG_BK + 8) * 2
}

/// Let a product kernel use its dynamic shared memory (above the default 48 KiB).
pub(crate) fn allow_gemm_shared_memory(
    func: &cudarc::driver::CudaFunction,
    wide: bool,
) -> Result<(), CudaError> {
    use super::super::error::DriverContext;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    let cols = tile_cols(wide);
    func.set_attribute(
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        gemm_shared_bytes(cols) as i32,
    )
    .ctx("product shared memory")
}

/// Most K slices (planes for the consumer to sum, `MAX_PLANES` in `kernels/batch.cu`) a
/// product is cut into.
pub const MAX_PARTS: usize = 8;

/// How [`Launcher::batch_gemm`] runs one product: K in `slices` slices (summed in order, which
/// fixes a row's bits), written as `planes` planes (1: the slices folded in the kernel, or one
/// plane each), 64-column tiles (`wide`) or 32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmPlan {
    pub slices: usize,
    pub planes: usize,
    pub wide: bool,
}

impl GemmPlan {
    /// Output columns of one block.
    pub fn cols(&self) -> usize {
        tile_cols(self.wide)
    }

    /// Blocks of a product of `rows` rows and `n` columns.
    fn blocks(&self, rows: usize, n: usize) -> usize {
        (n / self.cols()) * rows.div_ceil(BG_STREAMS) * self.planes
    }
}

/// The slices of a product of `n` columns and depth `k` on a GPU of `sms` multiprocessors, and
/// whether a step of up to 64 rows takes it in 64-column tiles: those tiles unless even 8 slices
/// of them leave SMs idle, then K cut into as many slices as keep the blocks within two an SM
/// (at most [`MAX_PARTS`], whole stages each). Not a function of the rows: every step cuts a
/// product's K the same way, so a row's sums are the same whatever rows it runs with.
fn batch_gemm_slices(n: usize, k: usize, sms: usize) -> (usize, bool) {
    let wide = n.is_multiple_of(BG_WIDE) && (n / BG_WIDE) * MAX_PARTS >= sms;
    let tiles = (n / tile_cols(wide)).max(1);
    (
        gemm_most_parts(k, (2 * sms / tiles).clamp(1, MAX_PARTS)),
        wide,
    )
}

/// The plan for a product of `rows` rows, `n` columns and depth `k` on a GPU of `sms`
/// multiprocessors, its planes within `room` floats. The slices are the product's own
/// ([`batch_gemm_slices`]); up to 64 rows each slice is a plane, as the 64-column choice says.
/// More rows fold the slices into one plane in the kernel, in the widest tiles that still give
/// every SM a block, and keep a plane per slice only where a single plane would not.
pub fn batch_gemm_plan(rows: usize, n: usize, k: usize, sms: usize, room: usize) -> GemmPlan {
    let (slices, wide) = batch_gemm_slices(n, k, sms);
    let fits = |planes: usize| planes * rows * n <= room;
    let own = GemmPlan {
        slices,
        planes: if fits(slices) { slices } else { 1 },
        wide,
    };
    if rows <= BG_STREAMS {
        return own;
    }
    let wides: &[bool] = if n.is_multiple_of(BG_WIDE) {
        &[true, false]
    } else {
        &[false]
    };
    [1, slices]
        .into_iter()
        .filter(|&planes| fits(planes))
        .flat_map(|planes| {
            wides.iter().map(move |&wide| GemmPlan {
                slices,
                planes,
                wide,
            })
        })
        .find(|plan| plan.blocks(rows, n) >= sms)
        .unwrap_or(GemmPlan { wide: false, ..own })
}

/// Whether our kernel suits a product of `n` columns and depth `k` on a GPU of `sms`
/// multiprocessors, at any number of rows: weights of at most [`BG_MOST_WEIGHT_BYTES`] (bf16),
/// and a 64-row step's plan that gives every multiprocessor a block. Elsewhere cuBLAS was
/// faster (H200, 64 rows: 774M's pass 2.60 ms with ours against 2.19 with cuBLAS; 1558M's QKV
/// and MLP products, 25 stages deep without a fitting cut, take one slice of 75 or 100 tiles).
pub fn batch_gemm_suits((n, k): (usize, usize), sms: usize) -> bool {
    let plan = batch_gemm_plan(BG_STREAMS, n, k, sms, usize::MAX);
    n * k * 2 <= BG_MOST_WEIGHT_BYTES && plan.blocks(BG_STREAMS, n) >= sms
}

/// The largest weights (bytes) of a product our kernel takes: 124M's MLP products (768 x 3072).
pub const BG_MOST_WEIGHT_BYTES: usize = 768 * 3072 * 2;

/// The most K slices, at most `most`, that cut `k` into whole stages of [`Launcher::batch_gemm`].
pub fn gemm_most_parts(k: usize, most: usize) -> usize {
    (1..=most.max(1))
        .rev()
        .find(|p| k.is_multiple_of(p * BG_BK))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (QKV, attention projection, FC, MLP projection) of a model of width `c`: (n, k).
    fn products(c: usize) -> [(usize, usize); 4] {
        [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)]
    }

    #[test]
    fn slices_cut_k_into_whole_stages() {
        assert_eq!(gemm_most_parts(768, MAX_PARTS), 6);
        assert_eq!(gemm_most_parts(3072, MAX_PARTS), 8);
        assert_eq!(gemm_most_parts(1600, MAX_PARTS), 5);
        assert_eq!(gemm_most_parts(1600, 3), 1);
        assert_eq!(gemm_most_parts(64, MAX_PARTS), 1);
        assert_eq!(gemm_most_parts(768, 0), 1);
        for k in (64..=6400).step_by(64) {
            for most in 1..=MAX_PARTS {
                let p = gemm_most_parts(k, most);
                assert!(
                    (1..=most).contains(&p) && k % (p * BG_BK) == 0,
                    "k {k} most {most}"
                );
            }
        }
    }

    #[test]
    fn a_64_row_step_of_124m_fills_an_h200_with_our_products() {
        let (sms, room) = (132, 2 * 256 * 4 * 768);
        let plans: Vec<GemmPlan> = products(768)
            .iter()
            .map(|&(n, k)| batch_gemm_plan(64, n, k, sms, room))
            .collect();
        let want = [(6, true), (6, false), (4, true), (8, false)];
        for (plan, (slices, wide)) in plans.iter().zip(want) {
            assert_eq!(
                *plan,
                GemmPlan {
                    slices,
                    planes: slices,
                    wide
                }
            );
        }
        for (&(n, k), &plan) in products(768).iter().zip(&plans) {
            assert!(batch_gemm_suits((n, k), sms), "{n}x{k}");
            // the planes fit the scratch buffer
            assert!(plan.planes * 64 * n <= room);
        }
    }

    #[test]
    fn every_step_cuts_k_the_same_way() {
        let (sms, room) = (132, 2 * 320 * 4 * 768);
        for (n, k) in products(768) {
            let own = batch_gemm_plan(1, n, k, sms, room);
            for rows in [1, 8, 17, 64, 65, 128, 130, 192, 256, 320] {
                let plan = batch_gemm_plan(rows, n, k, sms, room);
                assert_eq!(plan.slices, own.slices, "{rows} rows, {n}x{k}");
                assert!(plan.planes == 1 || plan.planes == plan.slices);
                assert!(plan.planes * rows * n <= room, "{rows} rows, {n}x{k}");
                assert!(k.is_multiple_of(plan.slices * BG_BK) && n.is_multiple_of(plan.cols()));
                // up to 64 rows a plane per slice; beyond, every SM gets a block
                match rows <= BG_STREAMS {
                    true => assert_eq!(plan, own),
                    false => assert!(
                        plan.blocks(rows, n) >= sms,
                        "{rows} rows, {n}x{k}: {plan:?}"
                    ),
                }
            }
        }
        // 256 rows of QKV: enough 64-column tiles for one folded plane
        let qkv = batch_gemm_plan(256, 3 * 768, 768, sms, room);
        assert_eq!((qkv.slices, qkv.planes, qkv.wide), (6, 1, true));
        // 256 rows of the MLP projection: too few tiles, so a plane per slice
        let proj = batch_gemm_plan(256, 768, 4 * 768, sms, room);
        assert_eq!((proj.slices, proj.planes), (8, 8));
    }

    #[test]
    fn larger_models_and_thin_plans_keep_cublas() {
        let sms = 132;
        // 1558M: K = 1600 has no cut into 2-4 slices, so QKV (75 tiles) and FC (100) take one
        for (n, k) in products(1600) {
            assert!(!batch_gemm_suits((n, k), sms), "{n}x{k}");
        }
        // 355M: only the attention projection's 2 MiB of weights
        let suits: Vec<bool> = products(1024)
            .iter()
            .map(|&(n, k)| batch_gemm_suits((n, k), sms))
            .collect();
        assert_eq!(suits, [false, true, false, false]);
        // a product whose plan has fewer blocks than SMs
        assert!(!batch_gemm_suits((64, 64), sms));
    }

    #[test]
    fn planes_never_outgrow_the_scratch_buffer() {
        for rows in [1, 17, 64, 130, 256] {
            for (n, k) in products(768) {
                let room = 2 * 64 * 4 * 768;
                let plan = batch_gemm_plan(rows, n, k, 132, room);
                assert!(
                    plan.planes == 1 || plan.planes * rows * n <= room,
                    "{rows} rows, {n}x{k}"
                );
            }
        }
    }
}

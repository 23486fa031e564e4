//! The CPU forward pass over a batch of contexts ([`CpuBatch`], a [`BatchModel`]): the rows of
//! every context in the step (one per decoding context, a chunk of each prompt) go through
//! each layer's products together as one matrix-matrix product (the `gemm` crate, which picks
//! AVX2/FMA kernels at run time and threads over rayon), so the weights are read once per step
//! rather than once per context. Attention stays per context, over its own cache.
//!
//! A step of a few rows (up to [`PACKED_ROWS`]) takes its LM head, and its layers' products
//! when the model is small enough to hold a second copy of them ([`PACKED_LAYER_BYTES`]),
//! through [`super::skinny`] instead (packed once; `gemm` rearranges its operands on every
//! step: the whole `[vocab, C]` matrix for the head).
//!
//! The arithmetic is that of the specification ([`super::CpuModel::forward`]) with the sums of
//! the products in the kernels' order and GELU's `tanh` through an exponential of ours (within
//! 1e-6): logits agree with it within 1e-4 (tested). The whole step runs on a rayon thread.

use super::skinny::Packed;
use super::{attention_row, layer_norm, CpuKvCache};
use crate::engine::batch::{BatchModel, KvPool, SeqState, StepItem};
use crate::engine::draw::{self, DrawRule};
use crate::engine::{argmax, EngineError};
use crate::model::Gpt2Weights;
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// GPT-2 on the CPU for batched steps, over shared weights and one KV pool.
pub struct CpuBatch {
    weights: Arc<Gpt2Weights>,
    pool: Arc<KvPool>,
    /// The LM head packed for steps of up to [`PACKED_ROWS`] rows (None: no AVX2/FMA).
    head: Option<Packed>,
    /// Each layer's products packed likewise (empty: none, see [`PACKED_LAYER_BYTES`]).
    layers: Vec<PackedLayer>,
}

/// A layer's four products, packed.
struct PackedLayer {
    qkv: Packed,
    proj: Packed,
    fc: Packed,
    fc_proj: Packed,
}

/// The most rows whose products go through the packed kernel (more, a prompt's rows, go
/// through `gemm`, whose rearranging of the weights is then a small share).
const PACKED_ROWS: usize = 64;

/// The layers are packed too when their copy takes at most this many bytes (the embedded
/// model's 14 MB, 124M's 340 MB; not the larger models', whose copy would cost gigabytes).
const PACKED_LAYER_BYTES: usize = 512 << 20;

/// One context on the CPU: its KV cache, the last step's logits, its share of the pool.
pub struct CpuSeq {
    cache: CpuKvCache,
    /// The last position's logits, or every position's of an all-positions extend.
    logits: Vec<f32>,
    vocab: usize,
    n_embd: usize,
    /// Bytes of one cached position (keys and values of every layer).
    position_bytes: usize,
    /// Positions reserved in the pool.
    reserved: usize,
    pool: Arc<KvPool>,
    /// The rule its guest drew its last token by (None: it read the argmax or the logits):
    /// the step draws its next token by it, beside the others' (see [`CpuBatch::draws`]).
    rule: Mutex<Option<DrawRule>>,
    /// The token the last step drew by that rule, and the position drawn for.
    drawn: Option<(DrawRule, usize, u32)>,
}

impl CpuSeq {
    fn set_rule(&self, rule: Option<DrawRule>) {
        *self.rule.lock().unwrap_or_else(|p| p.into_inner()) = rule;
    }

    fn rule(&self) -> Option<DrawRule> {
        *self.rule.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for CpuSeq {
    fn drop(&mut self) {
        self.pool.release(self.reserved * self.position_bytes);
    }
}

impl SeqState for CpuSeq {
    fn len(&self) -> usize {
        self.cache.len()
    }
    fn truncate(&mut self, len: usize) {
        self.cache.truncate(len, self.n_embd);
        let keep = self.cache.len();
        if keep < self.reserved {
            self.pool
                .release((self.reserved - keep) * self.position_bytes);
            self.reserved = keep;
        }
    }
    fn last_logits(&self) -> Result<Vec<f32>, EngineError> {
        self.set_rule(None);
        Ok(self.logits[self.logits.len().saturating_sub(self.vocab)..].to_vec())
    }
    fn all_logits(&self) -> Result<Vec<f32>, EngineError> {
        self.set_rule(None);
        Ok(self.logits.clone())
    }
    fn argmax(&self) -> Result<u32, EngineError> {
        self.set_rule(None);
        Ok(argmax(
            &self.logits[self.logits.len().saturating_sub(self.vocab)..],
        ))
    }
    fn draw(&mut self, rule: &DrawRule) -> Result<u32, EngineError> {
        self.set_rule(Some(*rule));
        if let Some((by, position, token)) = self.drawn {
            if by == *rule && position == self.len() {
                return Ok(token);
            }
        }
        let last = &self.logits[self.logits.len().saturating_sub(self.vocab)..];
        Ok(draw::draw(last, rule, self.len()))
    }
}

impl CpuBatch {
    pub fn new(weights: Arc<Gpt2Weights>, pool: Arc<KvPool>) -> Self {
        let cfg = weights.config;
        // `WASI_NN_HOST_NO_PACKED` keeps `gemm` for every step (for measurements)
        let packing = crate::switches::get().measurement.packed;
        let c = cfg.n_embd;
        let head = packing
            .then(|| Packed::new(&weights.wte, cfg.vocab_size, c))
            .flatten();
        let layer_bytes = 4 * weights.layers.len() * 12 * c * c;
        let layers = match packing && head.is_some() && layer_bytes <= PACKED_LAYER_BYTES {
            true => weights
                .layers
                .iter()
                .filter_map(|lw| {
                    Some(PackedLayer {
                        qkv: Packed::new(&lw.qkv_w, 3 * c, c)?,
                        proj: Packed::new(&lw.proj_w, c, c)?,
                        fc: Packed::new(&lw.fc_w, 4 * c, c)?,
                        fc_proj: Packed::new(&lw.fc_proj_w, c, 4 * c)?,
                    })
                })
                .collect(),
            false => Vec::new(),
        };
        let layer_copies: usize = layers
            .iter()
            .map(|l: &PackedLayer| {
                l.qkv.bytes() + l.proj.bytes() + l.fc.bytes() + l.fc_proj.bytes()
            })
            .sum();
        tracing::debug!(
            head_bytes = head.as_ref().map_or(0, Packed::bytes),
            layer_bytes = layer_copies,
            "packed copies for small batched steps"
        );
        Self {
            weights,
            pool,
            head,
            layers,
        }
    }

    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }
}

/// `out[rows, n_out] (+)= x[rows, n_in] W[n_out, n_in]^T` (row-major), added to what `out`
/// holds when `accumulate`.
fn matmul(out: &mut [f32], x: &[f32], w: &[f32], n_in: usize, n_out: usize, accumulate: bool) {
    let rows = x.len() / n_in;
    assert!(
        out.len() == rows * n_out && w.len() == n_out * n_in,
        "matmul shapes"
    );
    // SAFETY: the slices hold exactly the strided elements gemm reads and writes (checked
    // above): lhs [rows, n_in] row-major, rhs = W^T read as [n_in, n_out] with column stride
    // n_in, dst [rows, n_out] row-major; dst does not alias the inputs (&mut vs &).
    unsafe {
        gemm::gemm(
            rows,
            n_out,
            n_in,
            out.as_mut_ptr(),
            1,
            n_out as isize,
            accumulate,
            x.as_ptr(),
            1,
            n_in as isize,
            w.as_ptr(),
            n_in as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        )
    }
}

/// `out (+)= x W^T` through the packed copy of W when there is one and the step is small,
/// else through `gemm`.
fn product(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    packed: Option<&Packed>,
    n_in: usize,
    n_out: usize,
) {
    match packed {
        Some(p) if x.len() / n_in <= PACKED_ROWS => p.matmul(out, x, true),
        _ => matmul(out, x, w, n_in, n_out, true),
    }
}

/// Every row of `out` (`[rows, n]`) set to `bias`.
fn fill_rows(out: &mut [f32], bias: &[f32]) {
    out.par_chunks_mut(bias.len())
        .for_each(|row| row.copy_from_slice(bias));
}

/// Every row of `x` plus `bias`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    x.par_chunks_mut(bias.len()).for_each(|row| {
        for (a, b) in row.iter_mut().zip(bias) {
            *a += b;
        }
    });
}

/// GELU (the tanh form) of every value: [`super::gelu`] to within 1e-6 (tested), but through
/// [`exp_approx`], which the compiler vectorises; `tanhf` took 5% of the CPU of a 16-stream
/// service.
fn gelu_rows(values: &mut [f32]) {
    values
        .par_chunks_mut(4096)
        .for_each(|chunk| chunk.iter_mut().for_each(|v| *v = gelu_approx(*v)));
}

/// `0.5 x (1 + tanh(u))`, u = sqrt(2 / pi) (x + 0.044715 x^3), with tanh(u) = 1 - 2 / (e^2u + 1).
#[inline(always)]
fn gelu_approx(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    0.5 * x * (2.0 - 2.0 / (exp_approx(2.0 * u) + 1.0))
}

/// e^x without branches: x clamped to [-87, 88] (e^x stays a normal float), x = n ln2 + r
/// with |r| <= ln2 / 2 (n rounded by the 1.5 * 2^23 trick, ln2 in two parts), e^r by its
/// Taylor polynomial of degree 6 (within 5e-7 of `expf`, relative, from 0 down to -87 in a
/// check made when it was written), 2^n through the exponent bits.
#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// LayerNorm of each row, rows in parallel.
fn layer_norm_rows(out: &mut [f32], x: &[f32], weight: &[f32], bias: &[f32]) {
    let c = weight.len();
    out.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .for_each(|(o, row)| layer_norm(o, row, weight, bias));
}

impl BatchModel for CpuBatch {
    type Seq = CpuSeq;

    fn new_seq(&self) -> Result<CpuSeq, EngineError> {
        let cfg = self.weights.config;
        Ok(CpuSeq {
            cache: CpuKvCache::default(),
            logits: Vec::new(),
            vocab: cfg.vocab_size,
            n_embd: cfg.n_embd,
            position_bytes: 2 * cfg.n_layer * cfg.n_embd * 4,
            reserved: 0,
            pool: self.pool.clone(),
            rule: Mutex::new(None),
            drawn: None,
        })
    }

    fn step(&self, items: &mut [StepItem<'_, CpuSeq>]) {
        // The step runs on one of rayon's threads: its many parallel loops then fork and join
        // inside the pool, where a loop called from the leader's own thread (outside the
        // pool) would hand itself over to a worker and wait to be woken, every time.
        rayon::scope(|_| self.run_step(items))
    }
}

impl CpuBatch {
    /// One batched step (see [`BatchModel::step`]), on the calling thread.
    fn run_step(&self, items: &mut [StepItem<'_, CpuSeq>]) {
        self.reserve(items);
        let mut active: Vec<&mut StepItem<'_, CpuSeq>> =
            items.iter_mut().filter(|i| i.error.is_none()).collect();
        if active.is_empty() {
            return;
        }
        let n_layer = self.weights.config.n_layer;
        for item in active.iter_mut() {
            let cache = &mut item.seq.cache;
            if cache.k.len() != n_layer {
                cache.k = vec![Vec::new(); n_layer];
                cache.v = vec![Vec::new(); n_layer];
            }
        }
        let (x, first_row) = self.layers(&mut active);
        self.logits(&mut active, &x, &first_row);
        let drawing = std::time::Instant::now();
        Self::draws(&mut active);
        tracing::trace!(
            rows = active.len(),
            draws_us = drawing.elapsed().as_micros() as u64,
            "cpu step's draws"
        );
    }

    /// The next token of each context that draws its tokens, drawn in the step (the contexts
    /// in parallel) so that its guest finds it there instead of drawing on its own thread
    /// after the step: on 2 cores with 16 streams that took 0.5 ms a token under load, and
    /// the step that gathers the contexts back waited for it.
    fn draws(active: &mut [&mut StepItem<'_, CpuSeq>]) {
        active.par_iter_mut().for_each(|item| {
            let seq = &mut *item.seq;
            seq.drawn = None;
            let Some(rule) = seq.rule() else {
                return;
            };
            if item.all_positions || !item.last_chunk {
                return;
            }
            let last = &seq.logits[seq.logits.len().saturating_sub(seq.vocab)..];
            let position = seq.cache.len();
            seq.drawn = Some((rule, position, draw::draw(last, &rule, position)));
        });
    }

    /// Reserve each context's new positions; a context over the pool's cap (or past the
    /// model's context, or with a token out of the vocabulary) fails alone.
    fn reserve(&self, items: &mut [StepItem<'_, CpuSeq>]) {
        let cfg = self.weights.config;
        for item in items.iter_mut() {
            let seq = &mut *item.seq;
            let end = seq.cache.len() + item.tokens.len();
            if end > cfg.n_ctx {
                item.error = Some(EngineError::OverCapacity {
                    len: end,
                    capacity: cfg.n_ctx,
                });
                continue;
            }
            if let Some(&id) = item.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                item.error = Some(EngineError::TokenOutOfRange {
                    id,
                    vocab: cfg.vocab_size,
                });
                continue;
            }
            if end > seq.reserved {
                match self.pool.reserve((end - seq.reserved) * seq.position_bytes) {
                    Ok(()) => seq.reserved = end,
                    Err(e) => item.error = Some(e),
                }
            }
        }
    }

    /// Every row of the step through the embedding and the layers, each context's keys and
    /// values appended to its own cache. Returns the residual stream `[rows, C]` and each
    /// context's first row.
    fn layers(&self, active: &mut [&mut StepItem<'_, CpuSeq>]) -> (Vec<f32>, Vec<usize>) {
        let w = &*self.weights;
        let cfg = w.config;
        let c = cfg.n_embd;
        // Row r of the step belongs to context `owner[r]` at position `start + t`.
        let mut owner = Vec::new();
        let mut first_row = Vec::with_capacity(active.len());
        for (i, item) in active.iter().enumerate() {
            first_row.push(owner.len());
            owner.extend(item.tokens.iter().enumerate().map(|(t, _)| (i, t)));
        }
        let rows = owner.len();
        let starts: Vec<usize> = active.iter().map(|i| i.seq.cache.len()).collect();

        // x = wte[token] + wpe[position]
        let mut x = vec![0.0f32; rows * c];
        x.par_chunks_mut(c).enumerate().for_each(|(r, row)| {
            let (i, t) = owner[r];
            let tok = active[i].tokens[t] as usize;
            let te = &w.wte[tok * c..][..c];
            let pe = &w.wpe[(starts[i] + t) * c..][..c];
            for ((o, a), b) in row.iter_mut().zip(te).zip(pe) {
                *o = a + b;
            }
        });

        let mut h = vec![0.0f32; rows * c];
        let mut qkv = vec![0.0f32; rows * 3 * c];
        let mut attn = vec![0.0f32; rows * c];
        let mut fc = vec![0.0f32; rows * 4 * c];
        for (l, lw) in w.layers.iter().enumerate() {
            let packed = self.layers.get(l);
            layer_norm_rows(&mut h, &x, &lw.ln1_w, &lw.ln1_b);
            fill_rows(&mut qkv, &lw.qkv_b);
            product(&mut qkv, &h, &lw.qkv_w, packed.map(|p| &p.qkv), c, 3 * c);
            for (i, item) in active.iter_mut().enumerate() {
                let cache = &mut item.seq.cache;
                let own = &qkv[first_row[i] * 3 * c..][..item.tokens.len() * 3 * c];
                for row in own.chunks_exact(3 * c) {
                    cache.k[l].extend_from_slice(&row[c..2 * c]);
                    cache.v[l].extend_from_slice(&row[2 * c..]);
                }
            }
            let caches: Vec<(&[f32], &[f32])> = active
                .iter()
                .map(|item| (&item.seq.cache.k[l][..], &item.seq.cache.v[l][..]))
                .collect();
            attn.par_chunks_mut(c).enumerate().for_each(|(r, out_row)| {
                let (i, t) = owner[r];
                let q = &qkv[r * 3 * c..][..c];
                attention_row(out_row, q, caches[i], starts[i] + t + 1, cfg.n_head);
            });
            add_rows(&mut x, &lw.proj_b);
            product(&mut x, &attn, &lw.proj_w, packed.map(|p| &p.proj), c, c);

            layer_norm_rows(&mut h, &x, &lw.ln2_w, &lw.ln2_b);
            fill_rows(&mut fc, &lw.fc_b);
            product(&mut fc, &h, &lw.fc_w, packed.map(|p| &p.fc), c, 4 * c);
            gelu_rows(&mut fc);
            add_rows(&mut x, &lw.fc_proj_b);
            product(
                &mut x,
                &fc,
                &lw.fc_proj_w,
                packed.map(|p| &p.fc_proj),
                4 * c,
                c,
            );
        }
        for (i, item) in active.iter_mut().enumerate() {
            item.seq.cache.len = starts[i] + item.tokens.len();
        }

        (x, first_row)
    }

    /// The logits of the rows each context needs, into each context's logits buffer.
    fn logits(&self, active: &mut [&mut StepItem<'_, CpuSeq>], x: &[f32], first_row: &[usize]) {
        let w = &*self.weights;
        let cfg = w.config;
        let c = cfg.n_embd;
        // Logits of the rows each context needs: all of an all-positions request's rows, the
        // last row of a request's last chunk, none of a prompt's earlier chunks.
        let mut wanted = Vec::new();
        for (i, item) in active.iter().enumerate() {
            let n = item.tokens.len();
            if item.all_positions {
                wanted.extend((0..n).map(|t| first_row[i] + t));
            } else if item.last_chunk {
                wanted.push(first_row[i] + n - 1);
            }
        }
        let mut picked = vec![0.0f32; wanted.len() * c];
        for (dst, &r) in picked.chunks_exact_mut(c).zip(&wanted) {
            dst.copy_from_slice(&x[r * c..][..c]);
        }
        let mut normed = vec![0.0f32; picked.len()];
        layer_norm_rows(&mut normed, &picked, &w.lnf_w, &w.lnf_b);
        let v = cfg.vocab_size;
        // Each context's logits buffer sized for its rows (a decode's stays [V] from step to
        // step, so nothing is allocated or cleared), its rows in the order of `wanted`.
        let mut dests: Vec<&mut [f32]> = Vec::with_capacity(wanted.len());
        for item in active.iter_mut() {
            let seq = &mut *item.seq;
            let rows = match (item.all_positions, item.last_chunk) {
                (true, _) => item.tokens.len(),
                (false, true) => 1,
                (false, false) => 0,
            };
            // an all-positions extend keeps its earlier chunks' rows
            let keep = match item.all_positions && !item.first_chunk {
                true => seq.logits.len(),
                false => 0,
            };
            if rows == 0 {
                if item.first_chunk {
                    seq.logits.clear();
                }
                continue;
            }
            seq.logits.resize(keep + rows * v, 0.0);
            dests.extend(seq.logits[keep..].chunks_exact_mut(v));
        }
        match &self.head {
            Some(head) if (1..=PACKED_ROWS).contains(&wanted.len()) => {
                head.matmul_rows(&mut dests, &normed)
            }
            _ if !wanted.is_empty() => {
                let mut logits = vec![0.0f32; wanted.len() * v];
                matmul(&mut logits, &normed, &w.wte, c, v, false);
                for (dst, row) in dests.iter_mut().zip(logits.chunks_exact(v)) {
                    dst.copy_from_slice(row);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised GELU against the specification's, over the range activations take
    /// and beyond (where tanh is +-1 and e^2u would overflow).
    #[test]
    fn fast_gelu_matches_the_specification() {
        let mut worst = 0.0f32;
        for i in -400_000..=400_000 {
            let x = i as f32 * 1e-4; // -40 .. 40
            let (got, want) = (gelu_approx(x), super::super::gelu(x));
            let err = (got - want).abs() / want.abs().max(1.0);
            worst = worst.max(err);
        }
        assert!(worst <= 1e-6, "worst error {worst}");
        assert_eq!(gelu_approx(1e30), 1e30);
        assert_eq!(gelu_approx(-1e30), 0.0);
        let mut rows = vec![-3.0f32, -0.5, 0.0, 0.5, 3.0];
        gelu_rows(&mut rows);
        for (got, x) in rows.iter().zip([-3.0f32, -0.5, 0.0, 0.5, 3.0]) {
            assert!((got - super::super::gelu(x)).abs() <= 1e-6);
        }
    }
}

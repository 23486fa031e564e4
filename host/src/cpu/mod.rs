//! The CPU reference forward pass: the specification the GPU backend is checked against.
//!
//! Plain f32 code in the order of the GPT-2 paper and HF's `GPT2Model`: token + position
//! embedding; per block LayerNorm (eps 1e-5), fused QKV projection, causal softmax attention
//! over the KV cache, output projection + residual, LayerNorm, FC + GELU (tanh form),
//! projection + residual; a final LayerNorm and the LM head tied to `wte`.
//! Matrix products are parallel over output features with rayon; a prompt goes through as one
//! matrix-matrix pass rather than token by token.
//!
//! [`CpuExecutor`] puts it behind the engine's [`Executor`] / [`Session`] traits, and
//! [`batched`] runs many contexts' tokens as one step with matrix-matrix products.

pub mod batched;
pub mod skinny;

use crate::engine::batch::{Batcher, KvPool};
use crate::engine::{argmax, EngineError, Executor, Session};
use crate::model::{Gpt2Config, Gpt2Weights};
use rayon::prelude::*;
use std::sync::Arc;

pub const LAYER_NORM_EPS: f32 = 1e-5;

/// The keys and values of every position seen so far, per layer `[position, C]`.
#[derive(Default)]
pub struct CpuKvCache {
    len: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl CpuKvCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget every position from `len` on.
    pub fn truncate(&mut self, len: usize, n_embd: usize) {
        self.len = self.len.min(len);
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(self.len * n_embd);
        }
    }

    /// Bytes held by this cache.
    pub fn nbytes(&self) -> usize {
        self.k
            .iter()
            .chain(self.v.iter())
            .map(|b| b.capacity() * 4)
            .sum()
    }
}

/// GPT-2 on the CPU over shared, immutable weights.
#[derive(Clone)]
pub struct CpuModel {
    weights: Arc<Gpt2Weights>,
}

impl CpuModel {
    pub fn new(weights: Arc<Gpt2Weights>) -> Self {
        Self { weights }
    }

    pub fn weights(&self) -> &Gpt2Weights {
        &self.weights
    }

    /// Run `tokens` at positions `cache.len()..`, appending their keys and values to `cache`.
    /// Returns the logits of the last new position (`[V]`), or of every new position
    /// (`[n, V]`) when `all_positions` is set. The caller checks ids and lengths.
    pub fn forward(&self, cache: &mut CpuKvCache, tokens: &[u32], all_positions: bool) -> Vec<f32> {
        let w = &*self.weights;
        let cfg = w.config;
        let (c, n) = (cfg.n_embd, tokens.len());
        let start = cache.len;
        debug_assert!(start + n <= cfg.n_ctx);
        if cache.k.len() != cfg.n_layer {
            cache.k = vec![Vec::new(); cfg.n_layer];
            cache.v = vec![Vec::new(); cfg.n_layer];
        }

        // x = wte[token] + wpe[position]
        let mut x = vec![0.0f32; n * c];
        for (t, (row, &tok)) in x.chunks_exact_mut(c).zip(tokens).enumerate() {
            let te = &w.wte[tok as usize * c..][..c];
            let pe = &w.wpe[(start + t) * c..][..c];
            for ((o, a), b) in row.iter_mut().zip(te).zip(pe) {
                *o = a + b;
            }
        }

        let mut h = vec![0.0f32; n * c];
        let mut qkv = vec![0.0f32; n * 3 * c];
        let mut attn = vec![0.0f32; n * c];
        let mut fc = vec![0.0f32; n * 4 * c];
        let mut delta = vec![0.0f32; n * c];
        for (l, lw) in w.layers.iter().enumerate() {
            layer_norm(&mut h, &x, &lw.ln1_w, &lw.ln1_b);
            linear(&mut qkv, &h, &lw.qkv_w, Some(&lw.qkv_b), c, 3 * c);
            for row in qkv.chunks_exact(3 * c) {
                cache.k[l].extend_from_slice(&row[c..2 * c]);
                cache.v[l].extend_from_slice(&row[2 * c..]);
            }
            attention(
                &mut attn,
                &qkv,
                (&cache.k[l], &cache.v[l]),
                start,
                cfg.n_head,
                c,
            );
            linear(&mut delta, &attn, &lw.proj_w, Some(&lw.proj_b), c, c);
            add_in_place(&mut x, &delta);

            layer_norm(&mut h, &x, &lw.ln2_w, &lw.ln2_b);
            linear(&mut fc, &h, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
            fc.par_iter_mut().for_each(|v| *v = gelu(*v));
            linear(
                &mut delta,
                &fc,
                &lw.fc_proj_w,
                Some(&lw.fc_proj_b),
                4 * c,
                c,
            );
            add_in_place(&mut x, &delta);
        }
        cache.len = start + n;

        let rows = if all_positions {
            &x[..]
        } else {
            &x[(n - 1) * c..]
        };
        let mut normed = vec![0.0f32; rows.len()];
        layer_norm(&mut normed, rows, &w.lnf_w, &w.lnf_b);
        let mut logits = vec![0.0f32; rows.len() / c * cfg.vocab_size];
        linear(&mut logits, &normed, &w.wte, None, c, cfg.vocab_size);
        logits
    }
}

fn add_in_place(x: &mut [f32], delta: &[f32]) {
    for (a, b) in x.iter_mut().zip(delta) {
        *a += b;
    }
}

/// GELU, tanh approximation (HF `gelu_new`, PyTorch `approximate="tanh"`).
pub fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// LayerNorm of each row of `input` (row length = `weight.len()`), biased variance.
pub fn layer_norm(out: &mut [f32], input: &[f32], weight: &[f32], bias: &[f32]) {
    let c = weight.len();
    for (o, x) in out.chunks_exact_mut(c).zip(input.chunks_exact(c)) {
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + LAYER_NORM_EPS as f64).sqrt();
        for i in 0..c {
            o[i] = ((x[i] as f64 - mean) * rstd) as f32 * weight[i] + bias[i];
        }
    }
}

/// Dot product with 16 independent lanes so the compiler vectorises it without reordering
/// a single serial sum.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..16 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out[t, o] = bias[o] + sum_i input[t, i] * weight[o, i]` for every row `t` of `input`;
/// `weight` is `[n_out, n_in]`. Parallel over blocks of output features, each block of
/// weight rows reused for every input row while it is in cache.
pub fn linear(
    out: &mut [f32],
    input: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n_in: usize,
    n_out: usize,
) {
    const BLOCK: usize = 16;
    let rows = input.len() / n_in;
    debug_assert_eq!(out.len(), rows * n_out);
    let feature = |f: usize, x: &[f32]| {
        dot(x, &weight[f * n_in..(f + 1) * n_in]) + bias.map_or(0.0, |b| b[f])
    };
    if rows == 1 {
        out.par_chunks_mut(BLOCK)
            .enumerate()
            .for_each(|(block, chunk)| {
                for (j, o) in chunk.iter_mut().enumerate() {
                    *o = feature(block * BLOCK + j, input);
                }
            });
        return;
    }
    // Tiles of the transposed output [n_out, rows], one block of features each.
    let mut out_t = vec![0.0f32; n_out * rows];
    out_t
        .par_chunks_mut(BLOCK * rows)
        .enumerate()
        .for_each(|(block, tile)| {
            let features = tile.len() / rows;
            for (t, x) in input.chunks_exact(n_in).enumerate() {
                for j in 0..features {
                    tile[j * rows + t] = feature(block * BLOCK + j, x);
                }
            }
        });
    out.par_chunks_mut(n_out).enumerate().for_each(|(t, row)| {
        for (f, o) in row.iter_mut().enumerate() {
            *o = out_t[f * rows + t];
        }
    });
}

/// Causal multi-head attention for `n` new positions starting at absolute position `start`.
/// `qkv` is `[n, 3C]`; the caches hold keys and values of positions `0..start + n`.
pub fn attention(
    out: &mut [f32],
    qkv: &[f32],
    (k_cache, v_cache): (&[f32], &[f32]),
    start: usize,
    n_head: usize,
    c: usize,
) {
    out.par_chunks_mut(c).enumerate().for_each(|(t, out_row)| {
        let q = &qkv[t * 3 * c..][..c];
        attention_row(out_row, q, (k_cache, v_cache), start + t + 1, n_head);
    });
}

/// Attention of one query row `q` (`[C]`) over the first `visible` cached positions, into
/// `out_row` (`[C]`), head by head.
pub fn attention_row(
    out_row: &mut [f32],
    q: &[f32],
    (k_cache, v_cache): (&[f32], &[f32]),
    visible: usize,
    n_head: usize,
) {
    let c = out_row.len();
    let hd = c / n_head;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = vec![0.0f32; visible];
    for h in 0..n_head {
        let q = &q[h * hd..][..hd];
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            *s = dot(q, &k_cache[j * c + h * hd..][..hd]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let o = &mut out_row[h * hd..(h + 1) * hd];
        o.fill(0.0);
        for (j, s) in scores.iter().enumerate() {
            let weight = s / sum;
            for (oi, vi) in o.iter_mut().zip(&v_cache[j * c + h * hd..][..hd]) {
                *oi += weight * vi;
            }
        }
    }
}

/// The CPU backend as an [`Executor`]: by default the contexts of one model share batched
/// steps ([`batched::CpuBatch`] behind a [`Batcher`]); [`CpuExecutor::reference`] runs the
/// specification, one context at a time.
pub struct CpuExecutor {
    config: Gpt2Config,
    engine: CpuEngine,
}

enum CpuEngine {
    Batched(Arc<Batcher<batched::CpuBatch>>),
    Reference(CpuModel),
}

impl CpuExecutor {
    /// Most tokens one batched step runs: a long prompt goes through in chunks of this many,
    /// so the streams decoding beside it wait at most one chunk.
    pub const MAX_STEP_TOKENS: usize = 128;

    /// Batched steps, the KV caches of all contexts together capped at `kv_pool_bytes`.
    pub fn new(weights: Arc<Gpt2Weights>, kv_pool_bytes: usize) -> Self {
        let config = weights.config;
        let model = batched::CpuBatch::new(weights, KvPool::new(kv_pool_bytes));
        Self {
            config,
            engine: CpuEngine::Batched(Batcher::new(model, Self::MAX_STEP_TOKENS)),
        }
    }

    /// The specification's forward pass, one context at a time, no pool.
    pub fn reference(weights: Arc<Gpt2Weights>) -> Self {
        Self {
            config: weights.config,
            engine: CpuEngine::Reference(CpuModel::new(weights)),
        }
    }

    /// The batcher's counts (steps, items over all steps, the largest step), when batched.
    pub fn batch_stats(&self) -> Option<(usize, usize, usize)> {
        match &self.engine {
            CpuEngine::Batched(b) => Some(b.stats().get()),
            CpuEngine::Reference(_) => None,
        }
    }
}

struct CpuSession {
    model: CpuModel,
    cache: CpuKvCache,
    /// Logits of the last extend: one row, or every new row.
    logits: Vec<f32>,
}

impl Executor for CpuExecutor {
    fn config(&self) -> Gpt2Config {
        self.config
    }
    fn batch_counts(&self) -> Option<crate::engine::batch::BatchCounts> {
        match &self.engine {
            CpuEngine::Batched(b) => Some(b.counts()),
            CpuEngine::Reference(_) => None,
        }
    }
    fn kv_pool(&self) -> Option<(usize, usize)> {
        match &self.engine {
            CpuEngine::Batched(b) => Some((b.model().pool().used(), b.model().pool().cap())),
            CpuEngine::Reference(_) => None,
        }
    }
    fn new_session(&self) -> Result<Box<dyn Session>, EngineError> {
        Ok(match &self.engine {
            CpuEngine::Batched(batcher) => batcher.session()?,
            CpuEngine::Reference(model) => Box::new(CpuSession {
                model: model.clone(),
                cache: Default::default(),
                logits: Vec::new(),
            }),
        })
    }
}

impl CpuSession {
    /// The last position's row of the last extend's logits.
    fn last_row(&self) -> &[f32] {
        let vocab = self.model.weights().config.vocab_size;
        &self.logits[self.logits.len().saturating_sub(vocab)..]
    }
}

impl Session for CpuSession {
    fn len(&self) -> usize {
        self.cache.len()
    }
    fn truncate(&mut self, len: usize) {
        self.cache.truncate(len, self.model.weights().config.n_embd);
    }
    fn extend(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), EngineError> {
        self.logits = self.model.forward(&mut self.cache, tokens, all_positions);
        Ok(())
    }
    fn last_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        Ok(self.last_row().to_vec())
    }
    fn all_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        Ok(self.logits.clone())
    }
    fn argmax(&mut self) -> Result<u32, EngineError> {
        Ok(argmax(self.last_row()))
    }
}

//! The CPU forward pass over a batch of contexts ([`CpuBatch`], a [`BatchModel`]): the rows of
//! every context in the step (one per decoding context, a chunk of each prompt) go through
//! each layer's products together as one matrix-matrix product (the `gemm` crate, which picks
//! AVX2/FMA kernels at run time and threads over rayon), so the weights are read once per step
//! rather than once per context. Attention stays per context, over its own cache.
//!
//! The LM head of a step of a few rows goes through [`super::skinny`] instead (packed once;
//! `gemm` would pack the whole `[vocab, C]` matrix on every step).
//!
//! The arithmetic is that of the specification ([`super::CpuModel::forward`]) with the sums of
//! the products in the GEMM's order: logits agree with it within 1e-4 (tested).

use super::skinny::PackedHead;
use super::{attention_row, gelu, layer_norm, CpuKvCache};
use crate::engine::batch::{BatchModel, KvPool, SeqState, StepItem};
use crate::engine::{argmax, EngineError};
use crate::model::Gpt2Weights;
use rayon::prelude::*;
use std::sync::Arc;

/// GPT-2 on the CPU for batched steps, over shared weights and one KV pool.
pub struct CpuBatch {
    weights: Arc<Gpt2Weights>,
    pool: Arc<KvPool>,
    /// The LM head packed for steps of up to [`PACKED_HEAD_ROWS`] rows (None: no AVX2/FMA).
    head: Option<PackedHead>,
}

/// The most rows whose LM head goes through the packed kernel (more, a prompt's rows, go
/// through `gemm`, whose rearranging of the weights is then a small share).
const PACKED_HEAD_ROWS: usize = 64;

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
        Ok(self.logits[self.logits.len().saturating_sub(self.vocab)..].to_vec())
    }
    fn all_logits(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self.logits.clone())
    }
    fn argmax(&self) -> Result<u32, EngineError> {
        Ok(argmax(
            &self.logits[self.logits.len().saturating_sub(self.vocab)..],
        ))
    }
}

impl CpuBatch {
    pub fn new(weights: Arc<Gpt2Weights>, pool: Arc<KvPool>) -> Self {
        let cfg = weights.config;
        // `WASI_NN_HOST_NO_PACKED_HEAD` keeps `gemm` for every step (for measurements)
        let head = match std::env::var_os("WASI_NN_HOST_NO_PACKED_HEAD") {
            Some(_) => None,
            None => PackedHead::new(&weights.wte, cfg.vocab_size, cfg.n_embd),
        };
        Self {
            weights,
            pool,
            head,
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
        })
    }

    fn step(&self, items: &mut [StepItem<'_, CpuSeq>]) {
        let w = &*self.weights;
        let cfg = w.config;
        let c = cfg.n_embd;
        // Reserve each context's new positions; a context over the pool's cap (or past the
        // model's context) fails alone.
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
        let mut active: Vec<&mut StepItem<'_, CpuSeq>> =
            items.iter_mut().filter(|i| i.error.is_none()).collect();
        if active.is_empty() {
            return;
        }
        for item in active.iter_mut() {
            let cache = &mut item.seq.cache;
            if cache.k.len() != cfg.n_layer {
                cache.k = vec![Vec::new(); cfg.n_layer];
                cache.v = vec![Vec::new(); cfg.n_layer];
            }
        }
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
            layer_norm_rows(&mut h, &x, &lw.ln1_w, &lw.ln1_b);
            fill_rows(&mut qkv, &lw.qkv_b);
            matmul(&mut qkv, &h, &lw.qkv_w, c, 3 * c, true);
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
            matmul(&mut x, &attn, &lw.proj_w, c, c, true);

            layer_norm_rows(&mut h, &x, &lw.ln2_w, &lw.ln2_b);
            fill_rows(&mut fc, &lw.fc_b);
            matmul(&mut fc, &h, &lw.fc_w, c, 4 * c, true);
            fc.par_iter_mut().for_each(|v| *v = gelu(*v));
            add_rows(&mut x, &lw.fc_proj_b);
            matmul(&mut x, &fc, &lw.fc_proj_w, 4 * c, c, true);
        }
        for (i, item) in active.iter_mut().enumerate() {
            item.seq.cache.len = starts[i] + item.tokens.len();
        }

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
        let mut logits = vec![0.0f32; wanted.len() * v];
        match &self.head {
            Some(head) if (1..=PACKED_HEAD_ROWS).contains(&wanted.len()) => {
                head.matmul(&mut logits, &normed)
            }
            _ if !wanted.is_empty() => matmul(&mut logits, &normed, &w.wte, c, v, false),
            _ => {}
        }
        let mut rows_out = logits.chunks_exact(v);
        for item in active.iter_mut() {
            let seq = &mut *item.seq;
            if item.first_chunk {
                seq.logits.clear();
            }
            if item.all_positions {
                for _ in 0..item.tokens.len() {
                    if let Some(row) = rows_out.next() {
                        seq.logits.extend_from_slice(row);
                    }
                }
            } else if item.last_chunk {
                if let Some(row) = rows_out.next() {
                    seq.logits.clear();
                    seq.logits.extend_from_slice(row);
                }
            }
        }
    }
}

//! Deterministic random weights of any GPT-2 shape, for tests and benchmarks (speed does not
//! depend on the values). The same `(config, seed)` gives the same bits on every machine:
//! each tensor is cut into fixed chunks, each chunk drawn from its own ChaCha8 stream.

use super::{Gpt2Config, Gpt2Weights, LayerWeights};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

const CHUNK: usize = 1 << 16;

/// Uniform values in `center ± spread`, drawn from the stream of `(seed, tensor_id)`.
fn fill(n: usize, seed: u64, tensor_id: u64, center: f32, spread: f32) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(chunk, values)| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(tensor_id << 32 | chunk as u64);
            for v in values {
                *v = center + spread * (2.0 * rng.random::<f32>() - 1.0);
            }
        });
    out
}

/// Random weights with GPT-2-like scales: matrices with std 0.02 (projections into the residual
/// scaled by 1/sqrt(2L)), small non-zero biases and LayerNorm parameters near (1, 0), so that
/// every parameter matters in a comparison.
pub fn random_weights(config: Gpt2Config, seed: u64) -> Gpt2Weights {
    let c = config.n_embd;
    // uniform(-a, a) has std a/sqrt(3)
    let std = |s: f32| s * 3f32.sqrt();
    let w = std(0.02);
    let w_resid = std(0.02 / (2.0 * config.n_layer as f32).sqrt());
    let mut id = 0u64;
    let mut next = |n: usize, center: f32, spread: f32| {
        id += 1;
        fill(n, seed, id, center, spread)
    };
    let wte = next(config.vocab_size * c, 0.0, w);
    let wpe = next(config.n_ctx * c, 0.0, std(0.01));
    let layers = (0..config.n_layer)
        .map(|_| LayerWeights {
            ln1_w: next(c, 1.0, 0.1),
            ln1_b: next(c, 0.0, 0.05),
            qkv_w: next(3 * c * c, 0.0, w),
            qkv_b: next(3 * c, 0.0, 0.02),
            proj_w: next(c * c, 0.0, w_resid),
            proj_b: next(c, 0.0, 0.02),
            ln2_w: next(c, 1.0, 0.1),
            ln2_b: next(c, 0.0, 0.05),
            fc_w: next(4 * c * c, 0.0, w),
            fc_b: next(4 * c, 0.0, 0.02),
            fc_proj_w: next(4 * c * c, 0.0, w_resid),
            fc_proj_b: next(c, 0.0, 0.02),
        })
        .collect();
    Gpt2Weights {
        config,
        wte,
        wpe,
        layers,
        lnf_w: next(c, 1.0, 0.1),
        lnf_b: next(c, 0.0, 0.05),
    }
}

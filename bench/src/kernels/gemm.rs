//! The batched pass's cuBLAS products timed alone: cuBLAS's default algorithm (`cublasGemmEx`)
//! against cuBLASLt's heuristic first candidate and the one timing keeps
//! ([`Blas::tune_products`]), each kept algorithm's results checked against the default's.

use rand::{Rng, SeedableRng};
use std::sync::Arc;
use wasi_nn_host::cuda::blas::{time_products, Blas, LtPlans};
use wasi_nn_host::cuda::buffer::{Act, Bf16, DevBuf};
use wasi_nn_host::cuda::error::CudaError;
use wasi_nn_host::cuda::ops::Launcher;
use wasi_nn_host::cuda::weights::DevTensor;
use wasi_nn_host::engine::{EngineError, GpuDtype};

/// One product shape: `rows` x `n` over `k`, microseconds a product.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmSpeed {
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    /// `cublasGemmEx` with its default algorithm (the pass's products without tuning).
    pub default_us: f64,
    /// cuBLASLt's heuristic's first candidate, as timed while tuning.
    pub heuristic_us: f64,
    /// The candidate tuning kept, timed as the default is.
    pub tuned_us: f64,
    /// Its place in the heuristic's order (0: the first; None: cuBLAS's default was kept) and
    /// how many were timed.
    pub kept: Option<usize>,
    pub candidates: usize,
    /// The worst `|tuned - default| / max(1, |default|)` over the product's results.
    pub max_difference: f32,
}

/// Each `(n, k)` of `shapes` at each of `row_counts` rows on random bf16 weights and
/// activations: through the default algorithm and through a tuned cuBLASLt plan, each as a
/// graph of `runs` products ([`time_products`]).
pub fn gemm_speed(
    l: &Launcher,
    shapes: &[(usize, usize)],
    row_counts: &[usize],
    runs: usize,
) -> Result<Vec<GemmSpeed>, EngineError> {
    let bad = |e: &dyn std::fmt::Display| EngineError::device(e.to_string());
    if l.dtype() != GpuDtype::Bf16 {
        return Err(bad(&"the pass's cuBLAS products are timed in bf16"));
    }
    let stream = l.stream().clone();
    let most_rows = row_counts.iter().copied().max().unwrap_or(1);
    let most_n = shapes.iter().map(|s| s.0).max().unwrap_or(1);
    let most_k = shapes.iter().map(|s| s.1).max().unwrap_or(1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut random = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * 0.05)
            .collect()
    };
    let w = DevTensor::upload(&stream, &random(most_n * most_k), GpuDtype::Bf16)?;
    let x_bits: Vec<Bf16> = (random(most_rows * most_k).iter())
        .map(|v| half::bf16::from_f32(*v * 20.0).to_bits())
        .collect();
    let x = DevBuf::from_host(&stream, &x_bits, "activations")?;
    let out_default = DevBuf::<f32>::zeros(&stream, most_rows * most_n, "products")?;
    let out_tuned = DevBuf::<f32>::zeros(&stream, most_rows * most_n, "products")?;
    let unavailable = || EngineError::device("cuBLAS is not loadable");
    let plain = Blas::new(&stream, 1, 1, None).ok_or_else(unavailable)?;
    let plans = Arc::new(LtPlans::default());
    let tuned =
        (Blas::new(&stream, 1, 1, Some(&plans)).ok_or_else(unavailable)?).with_tuned_products();
    if !tuned.has_lt() {
        return Err(bad(&"cuBLASLt is not loadable"));
    }
    // both paths captured into graphs and timed on the GPU, as the pass runs them
    let time = |blases: [(&Blas, &DevBuf<f32>); 2], shape| -> Result<[f64; 2], EngineError> {
        let (_, n, _) = shape;
        let (w, x) = (w.ptr(), Act::Bf16(x.ptr()));
        let mut enqueuers = blases.map(|(blas, out)| {
            let out = out.ptr();
            move || -> Result<bool, CudaError> {
                blas.gemm(l, w, x, shape, (out, n), false)?;
                Ok(true)
            }
        });
        let times = time_products(&stream, runs, &mut enqueuers)?;
        match times[..] {
            [Some(a), Some(b)] => Ok([a, b]),
            _ => Err(bad(&"a product could not be captured")),
        }
    };
    let mut results = Vec::new();
    for &(n, k) in shapes {
        for &rows in row_counts.iter().filter(|&&r| r > 0) {
            let shape = (rows, n, k);
            // met once (on the heuristic's plan), then timed and the fastest kept
            tuned.gemm(
                l,
                w.ptr(),
                Act::Bf16(x.ptr()),
                shape,
                (out_tuned.ptr(), n),
                false,
            )?;
            // SAFETY: the shape was met on this function's buffers and weights, alive to its
            // end; the outputs are scratch.
            let found = unsafe { tuned.tune_products(l, runs) }?;
            let Some(t) = found.first() else {
                return Err(bad(&format!("cuBLASLt has no plan for {rows}x{n}x{k}")));
            };
            let [default_us, tuned_us] =
                time([(&plain, &out_default), (&tuned, &out_tuned)], shape)?;
            let want = out_default.read(&stream, rows * n)?;
            let got = out_tuned.read(&stream, rows * n)?;
            let max_difference = (got.iter().zip(&want))
                .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
                .fold(0.0f32, f32::max);
            results.push(GemmSpeed {
                rows,
                n,
                k,
                default_us,
                heuristic_us: t.heuristic_us,
                tuned_us,
                kept: t.kept,
                candidates: t.candidates,
                max_difference,
            });
        }
    }
    Ok(results)
}

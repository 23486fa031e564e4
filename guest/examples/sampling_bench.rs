//! The sampler alone, in microseconds per token, on logits like a trained model's and on flat
//! ones like random weights' (synthetic, 50257 tokens), and on logit rows from files (the JSON
//! line that `gpt2.wasm --logits PROMPT` prints). `bench/sampling.sh` runs it both ways on
//! rows from the embedded model and from random weights.
//!
//! Natively: `cargo run --release -p gpt2-guest --example sampling_bench [-- FILE...]`.
//! In wasm, as the guest samples: build it with `cargo build -p gpt2-guest --example
//! sampling_bench --target wasm32-wasip1 --profile release-wasm`, then
//! `target/release/wasi-nn-host run --dir DIR::rows
//! target/wasm32-wasip1/release-wasm/examples/sampling_bench.wasm -- rows/FILE...`.
//!
//! Each row is sampled over and over, which trains the branch predictors on it: in a real
//! generation (a new row every token, caches cold from the forward pass) the same sampling
//! costs somewhat more; `gpt2.wasm --json` reports that (`sampling_ms_per_token`).

use gpt2_guest::sampling::{Sampler, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

const VOCAB: usize = 50_257;

/// Most tokens far below the top, a few thousand spread over the 16 below it, a handful near
/// it (the shape of the embedded Shakespeare model's logits).
fn peaked(seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..VOCAB)
        .map(|_| {
            let (r, s): (f32, f32) = (rng.random(), rng.random());
            if r < 0.001 {
                8.0 - 4.0 * s
            } else if r < 0.2 {
                8.0 - 16.0 * s
            } else {
                -12.0 - 4.0 * s
            }
        })
        .collect()
}

/// Every logit within about 5 of the others (the shape of random weights' logits).
fn flat(seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..VOCAB)
        .map(|_| (0..4).map(|_| rng.random::<f32>()).sum::<f32>() * 1.2)
        .collect()
}

fn read_row(path: &str) -> Result<Vec<f32>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let line = text.lines().last().unwrap_or_default();
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("{path}: {e}"))?;
    value["logits"]
        .as_array()
        .ok_or(format!("{path}: no \"logits\" array"))?
        .iter()
        .map(|v| {
            v.as_f64()
                .map(|x| x as f32)
                .ok_or(format!("{path}: a logit is not a number"))
        })
        .collect()
}

fn main() -> Result<(), String> {
    let files: Vec<String> = std::env::args().skip(1).collect();
    let mut rows: Vec<(String, Vec<f32>)> = vec![
        ("peaked (synthetic)".into(), peaked(1)),
        ("flat (synthetic)".into(), flat(1)),
    ];
    for f in files {
        let name = std::path::Path::new(&f)
            .file_name()
            .map_or(f.clone(), |n| n.to_string_lossy().into_owned());
        rows.push((name, read_row(&f)?));
    }
    let settings = [
        ("temperature 1", 0, 1.0),
        ("top-k 50", 50, 1.0),
        ("top-p 0.9", 0, 0.9),
        ("top-k 50, top-p 0.9", 50, 0.9),
    ];
    println!(
        "{:<28} {:<22} {:>10} {:>10}",
        "logits", "sampling", "mean us", "best us"
    );
    for (name, logits) in &rows {
        for &(setting, top_k, top_p) in &settings {
            let mut sampler = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_k,
                top_p,
                seed: 1,
            });
            let (rounds, per_round) = (20, 100);
            let mut sink = 0usize;
            for _ in 0..per_round {
                sink = sink.wrapping_add(sampler.sample(logits));
            }
            let (mut total, mut best) = (0.0f64, f64::INFINITY);
            for _ in 0..rounds {
                let start = Instant::now();
                for _ in 0..per_round {
                    sink = sink.wrapping_add(sampler.sample(logits));
                }
                let us = start.elapsed().as_secs_f64() * 1e6 / per_round as f64;
                total += us;
                best = best.min(us);
            }
            println!(
                "{:<28} {:<22} {:>10.1} {:>10.1}",
                name,
                setting,
                total / rounds as f64,
                best
            );
            std::hint::black_box(sink);
        }
    }
    Ok(())
}

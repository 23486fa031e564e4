//! The parts of `gpt2.wasm` that do not touch WASI-NN: the tokenizer, sampling, streaming text
//! and stop strings. They build and are unit-tested natively as well as for wasm32-wasip1.

pub mod generate;
pub mod processing;
pub mod sampling;
pub mod text;
pub mod tokenizer;

/// `log(sum(exp(row)))`, computed stably in f64.
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row
        .iter()
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

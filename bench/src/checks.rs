//! Whole models: the CUDA backend checked against the CPU reference. Used by the GPU tests
//! (`tests/tests/cuda.rs`, which skip without a GPU) and by `wasi-nn-bench check-cuda`, which
//! runs the same checks on the GPU machine from one binary.
//!
//! Each check runs a prompt as one prefill and then greedy decode steps (the decode graph) on
//! both backends and compares last-position logits after the prefill and after every step,
//! with the error scaled as `|gpu - cpu| / max(1, |cpu|)`.

use std::sync::Arc;
use wasi_nn_host::cpu::CpuExecutor;
use wasi_nn_host::engine::{argmax, Device, EngineError, EngineOptions, Executor, GpuDtype};
use wasi_nn_host::executor_for;
use wasi_nn_host::model::{random_weights, Gpt2Config, Gpt2Weights};

/// What one comparison saw.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckReport {
    pub model: String,
    pub dtype: String,
    pub prompt_tokens: usize,
    pub steps: usize,
    /// Worst scaled logit error after the prefill.
    pub prefill_error: f32,
    /// Worst scaled logit error over the decode steps (GPU graph vs CPU).
    pub decode_error: f32,
    /// Worst scaled logit error of a prompt length run three times: eager, captured as a
    /// graph, and replayed after a prefix (the bf16 path's prefill graphs).
    pub repeat_prefill_error: f32,
    /// Greedy ids that agree, from the start, between GPU and CPU (the GPU follows its own ids).
    pub greedy_agree: usize,
    /// Positions where the GPU's argmax differs from the CPU's on the same sequence.
    pub argmax_mismatches: usize,
    pub tolerance: f32,
    pub passed: bool,
    /// bf16 only, for information: the worst scaled error against the CPU over the original
    /// (unrounded) weights, and how many greedy ids agree with it from the start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub f32_model_error: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub f32_model_greedy_agree: Option<usize>,
}

/// The worst `|ours - reference| / max(1, |reference|)`; NaN and length mismatches count as infinite.
pub fn scaled_error(ours: &[f32], reference: &[f32]) -> f32 {
    if ours.len() != reference.len() {
        return f32::INFINITY;
    }
    ours.iter()
        .zip(reference)
        .map(|(a, b)| {
            let e = (a - b).abs() / b.abs().max(1.0);
            if e.is_nan() {
                f32::INFINITY
            } else {
                e
            }
        })
        .fold(0.0, f32::max)
}

/// Compare GPU (`dtype`) and CPU on `prompt` then `steps` greedy steps. The CPU is fed the
/// GPU's chosen tokens so both see the same sequence; `greedy_agree` counts how long the
/// CPU's own greedy choice matches. A prompt that would not leave room for the steps in the
/// model's context is cut to fit (the report gives the length used).
pub fn compare(
    name: &str,
    weights: Gpt2Weights,
    dtype: GpuDtype,
    prompt: &[u32],
    steps: usize,
    tolerance: f32,
) -> Result<CheckReport, EngineError> {
    let room = weights.config.n_ctx.saturating_sub(steps).max(1);
    let prompt = &prompt[..prompt.len().min(room)];
    let steps = steps.min(weights.config.n_ctx - prompt.len());
    // bf16: the reference holds the same rounded weights as the GPU, so what is compared is
    // the GPU's arithmetic (bf16 products, f32 accumulation), not the weight rounding.
    let reference = match dtype {
        GpuDtype::F32 => weights.clone(),
        GpuDtype::Bf16 => weights.bf16_rounded(),
    };
    let cpu = CpuExecutor::reference(Arc::new(reference));
    // the unrounded model as well, for the f32_model_* figures
    let f32_model =
        (dtype == GpuDtype::Bf16).then(|| CpuExecutor::reference(Arc::new(weights.clone())));
    let options = EngineOptions {
        dtype,
        max_kv_bytes: usize::MAX,
        ..Default::default()
    };
    let gpu = executor_for(weights, Device::Cuda, &options)?;
    let mut cpu_s = cpu.new_session()?;
    let mut gpu_s = gpu.new_session()?;
    let mut f32_s = f32_model.map(|e| e.new_session()).transpose()?;
    cpu_s.extend(prompt, false)?;
    gpu_s.extend(prompt, false)?;
    let mut cpu_logits = cpu_s.last_logits()?;
    let mut gpu_logits = gpu_s.last_logits()?;
    let (mut f32_error, mut f32_agree, mut f32_diverged) = (0.0f32, 0usize, false);
    let mut f32_logits = Vec::new();
    if let Some(s) = &mut f32_s {
        s.extend(prompt, false)?;
        f32_logits = s.last_logits()?;
        f32_error = scaled_error(&gpu_logits, &f32_logits);
    }
    let (mut argmax_disagree, mut all_error) = (0usize, 0.0f32);
    let prefill_error = scaled_error(&gpu_logits, &cpu_logits);
    let (mut decode_error, mut mismatches, mut agree, mut diverged) = (0.0f32, 0, 0, false);
    for _ in 0..steps {
        let next = argmax(&gpu_logits);
        if argmax(&cpu_logits) != next {
            mismatches += 1;
            diverged = true;
        }
        if !diverged {
            agree += 1;
        }
        if let Some(s) = &mut f32_s {
            f32_diverged |= argmax(&f32_logits) != next;
            f32_agree += usize::from(!f32_diverged);
            s.extend(&[next], false)?;
            f32_logits = s.last_logits()?;
        }
        cpu_s.extend(&[next], false)?;
        gpu_s.extend(&[next], false)?;
        // the GPU argmax kernel must agree with the logits it came from
        let gpu_next = gpu_s.argmax()?;
        cpu_logits = cpu_s.last_logits()?;
        gpu_logits = gpu_s.last_logits()?;
        argmax_disagree += usize::from(gpu_next != argmax(&gpu_logits));
        decode_error = decode_error.max(scaled_error(&gpu_logits, &cpu_logits));
        if f32_s.is_some() {
            f32_error = f32_error.max(scaled_error(&gpu_logits, &f32_logits));
        }
    }
    // The all-positions output (scoring) over the whole sequence: one prefill on each side.
    let mut sequence = prompt.to_vec();
    sequence.truncate(sequence.len().min(64));
    gpu_s.truncate(0);
    cpu_s.truncate(0);
    gpu_s.extend(&sequence, true)?;
    cpu_s.extend(&sequence, true)?;
    all_error = all_error.max(scaled_error(&gpu_s.all_logits()?, &cpu_s.all_logits()?));
    let decode_error = decode_error.max(all_error);
    // The same prompt length three times: from 0 (eager), from 0 again (captured), after a
    // prefix of the prompt (the captured prefill replayed at another first position).
    let chunk = prompt.len().div_ceil(2);
    let mut repeat_error = 0.0f32;
    for start in [0, 0, prompt.len() - chunk] {
        gpu_s.truncate(0);
        cpu_s.truncate(0);
        if start > 0 {
            gpu_s.extend(&prompt[..start], false)?;
            cpu_s.extend(&prompt[..start], false)?;
        }
        gpu_s.extend(&prompt[start..start + chunk], false)?;
        cpu_s.extend(&prompt[start..start + chunk], false)?;
        repeat_error = repeat_error.max(scaled_error(&gpu_s.last_logits()?, &cpu_s.last_logits()?));
    }
    Ok(CheckReport {
        model: name.to_owned(),
        dtype: format!("{dtype:?}").to_lowercase(),
        prompt_tokens: prompt.len(),
        steps,
        prefill_error,
        decode_error,
        repeat_prefill_error: repeat_error,
        greedy_agree: agree,
        argmax_mismatches: mismatches,
        tolerance,
        passed: prefill_error <= tolerance
            && decode_error <= tolerance
            && repeat_error <= tolerance
            && argmax_disagree == 0,
        f32_model_error: f32_s.as_ref().map(|_| f32_error),
        f32_model_greedy_agree: f32_s.as_ref().map(|_| f32_agree),
    })
}

/// A prompt of `n` ids spread over the vocabulary.
pub fn prompt(n: usize, vocab: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 97)) % vocab as u32)
        .collect()
}

/// Small random models that exercise every kernel at awkward sizes: several head counts and
/// widths, vocabularies that are no multiple of the block sizes, contexts up to n_ctx.
pub fn kernel_sweep(seed: u64) -> Result<Vec<CheckReport>, EngineError> {
    let configs = [
        (1, 1, 64, 64, 517),
        (2, 3, 96, 130, 1000),
        (1, 4, 256, 300, 2111),
        (2, 2, 128, 96, 50257),
    ];
    let mut reports = Vec::new();
    for (i, &(n_layer, n_head, n_embd, n_ctx, vocab_size)) in configs.iter().enumerate() {
        let config = Gpt2Config {
            n_layer,
            n_head,
            n_embd,
            n_ctx,
            vocab_size,
        };
        let weights = random_weights(config, seed + i as u64);
        let name = format!("random L{n_layer} H{n_head} C{n_embd} T{n_ctx} V{vocab_size}");
        // prompt fills most of the context, then decode to the very end
        let p = prompt(n_ctx - 20, vocab_size, i as u32);
        reports.push(compare(
            &name,
            weights.clone(),
            GpuDtype::F32,
            &p,
            20,
            1e-3,
        )?);
        reports.push(compare(
            &name,
            weights,
            GpuDtype::Bf16,
            &p[..n_ctx / 2],
            10,
            5e-2,
        )?);
    }
    Ok(reports)
}

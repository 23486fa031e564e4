//! Whole models: the CUDA backend checked against the CPU reference. Used by the GPU tests
//! (`tests/tests/cuda.rs`, which skip without a GPU) and by `wasi-nn-bench check-cuda`, which
//! runs the same checks on the GPU machine from one binary.
//!
//! Each check runs a prompt as one prefill and then greedy decode steps (the decode graph) on
//! both backends and compares last-position logits after the prefill and after every step,
//! with the error scaled as `|gpu - cpu| / max(1, |cpu|)`.

mod draws;

pub use draws::{compare_batched_draws, DrawCheckReport};
use std::sync::Arc;
use wasi_nn_host::cpu::CpuExecutor;
use wasi_nn_host::cuda::batch::BATCHED_PROMPT;
use wasi_nn_host::engine::draw::{self, DrawRule};
use wasi_nn_host::engine::{argmax, Device, EngineError, EngineOptions, Executor, GpuDtype};
use wasi_nn_host::executor_for;
use wasi_nn_host::model::{random_weights, Gpt2Config, Gpt2Weights};

/// The CUDA executor the checks and benchmarks use: weights as `dtype`, no cap on a
/// context's KV cache (the whole context).
pub fn gpu_executor(
    weights: &Gpt2Weights,
    dtype: GpuDtype,
) -> Result<wasi_nn_host::cuda::CudaExecutor, EngineError> {
    warm_gpu_executor(weights, dtype, 0)
}

/// [`gpu_executor`] with `warm` contexts made ready at start (`--warm-contexts`).
fn warm_gpu_executor(
    weights: &Gpt2Weights,
    dtype: GpuDtype,
    warm: usize,
) -> Result<wasi_nn_host::cuda::CudaExecutor, EngineError> {
    let options = EngineOptions {
        dtype,
        max_kv_bytes: usize::MAX,
        warm_contexts: warm,
        ..Default::default()
    };
    wasi_nn_host::cuda::CudaExecutor::new(weights, &options)
}

/// A random model of the shape `(n_layer, n_head, n_embd, n_ctx, vocab_size)`, and its name.
fn random_model(
    (n_layer, n_head, n_embd, n_ctx, vocab_size): (usize, usize, usize, usize, usize),
    seed: u64,
) -> (String, Gpt2Weights) {
    let config = Gpt2Config {
        n_layer,
        n_head,
        n_embd,
        n_ctx,
        vocab_size,
    };
    let name = format!("random L{n_layer} H{n_head} C{n_embd} T{n_ctx} V{vocab_size}");
    (name, random_weights(config, seed))
}

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
    /// Steps whose sampled draw on the GPU (output 4) is not the rule's draw from the same
    /// logits read back (must be 0).
    pub draw_mismatches: usize,
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
    compare_on(name, weights, dtype, prompt, steps, tolerance, None)
}

/// [`compare`] with the decode path chosen (`EngineOptions::persistent_decode`).
fn compare_on(
    name: &str,
    weights: Gpt2Weights,
    dtype: GpuDtype,
    prompt: &[u32],
    steps: usize,
    tolerance: f32,
    persistent_decode: Option<bool>,
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
        persistent_decode,
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
    let (mut argmax_disagree, mut draw_mismatches, mut all_error) = (0usize, 0usize, 0.0f32);
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
        // the GPU argmax and draw kernels must agree with the logits they came from
        let gpu_next = gpu_s.argmax()?;
        let rule = sampling_rule(gpu_s.len());
        let gpu_drawn = gpu_s.draw(&rule)?;
        cpu_logits = cpu_s.last_logits()?;
        gpu_logits = gpu_s.last_logits()?;
        argmax_disagree += usize::from(gpu_next != argmax(&gpu_logits));
        draw_mismatches += usize::from(gpu_drawn != draw::draw(&gpu_logits, &rule, gpu_s.len()));
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
        draw_mismatches,
        tolerance,
        passed: prefill_error <= tolerance
            && decode_error <= tolerance
            && repeat_error <= tolerance
            && argmax_disagree == 0
            && draw_mismatches == 0,
        f32_model_error: f32_s.as_ref().map(|_| f32_error),
        f32_model_greedy_agree: f32_s.as_ref().map(|_| f32_agree),
    })
}

/// The sampled draws the checks ask of the GPU: settings that take turns (temperature alone,
/// top-p 0.9 and 0.5, a low temperature), a seed from the length.
fn sampling_rule(len: usize) -> DrawRule {
    let (temperature, top_p) = [(1.0, 1.0), (0.8, 0.9), (1.2, 0.5), (0.3, 0.95)][len % 4];
    DrawRule {
        temperature,
        top_p,
        seed: len as u64 * 7919,
        min_p: 0.0,
    }
}

/// A prompt of `n` ids spread over the vocabulary.
pub fn prompt(n: usize, vocab: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 97)) % vocab as u32)
        .collect()
}

/// `(n_layer, n_head, n_embd, n_ctx, vocab_size)` of the sweeps' small random models.
const SWEEP_SHAPES: [(usize, usize, usize, usize, usize); 4] = [
    (1, 1, 64, 64, 517),
    (2, 3, 96, 130, 1000),
    (1, 4, 256, 300, 2111),
    (2, 2, 128, 96, 50257),
];

/// The persistent decode kernel (sm_90) against the CPU: the sweep's small shapes and three
/// more (head sizes 96 and 128, a width of 2048) to the end of their contexts, and each of
/// `models` from contexts of 1, 100 and n_ctx - `steps`
/// positions on, bf16 (and f32 from 100), greedy steps fed the GPU's ids.
pub fn persistent_sweep(
    seed: u64,
    models: &[(String, Gpt2Weights)],
    steps: usize,
) -> Result<Vec<CheckReport>, EngineError> {
    let on = Some(true);
    // a model the kernel does not take runs the graph: that must fail here, not pass as it
    let runs_persistent = |name: &str, weights: &Gpt2Weights| {
        for dtype in [GpuDtype::F32, GpuDtype::Bf16] {
            let options = EngineOptions {
                dtype,
                max_kv_bytes: usize::MAX,
                persistent_decode: on,
                ..Default::default()
            };
            let executor = wasi_nn_host::cuda::CudaExecutor::new(weights, &options)?;
            if !executor.open()?.uses_persistent_decode() {
                return Err(EngineError::device(format!(
                    "{name} ({dtype:?}): the persistent decode kernel was asked for and not used"
                )));
            }
        }
        Ok(())
    };
    let mut reports = Vec::new();
    // and head sizes 96 and 128, and the widest model the kernel takes
    let shapes = SWEEP_SHAPES.iter().chain(&[
        (1, 2, 192, 80, 700),
        (1, 2, 256, 80, 700),
        (1, 16, 2048, 40, 300),
    ]);
    for (i, &shape) in shapes.enumerate() {
        let (name, weights) = random_model(shape, seed + 100 + i as u64);
        runs_persistent(&name, &weights)?;
        let (n_ctx, vocab_size) = (shape.3, shape.4);
        let p = prompt(n_ctx - 20, vocab_size, i as u32);
        let name = format!("{name} persistent");
        reports.push(compare_on(
            &name,
            weights.clone(),
            GpuDtype::F32,
            &p,
            20,
            1e-3,
            on,
        )?);
        reports.push(compare_on(
            &name,
            weights,
            GpuDtype::Bf16,
            &p,
            20,
            5e-2,
            on,
        )?);
    }
    for (spec, weights) in models {
        runs_persistent(spec, weights)?;
        let (n_ctx, vocab) = (weights.config.n_ctx, weights.config.vocab_size);
        let name = format!("{spec} persistent");
        for len in [1, 100, n_ctx.saturating_sub(steps)] {
            let p = prompt(len.max(1), vocab, 3);
            let bf16 = compare_on(&name, weights.clone(), GpuDtype::Bf16, &p, steps, 5e-2, on)?;
            reports.push(bf16);
            if len == 100 {
                let f32 = compare_on(&name, weights.clone(), GpuDtype::F32, &p, steps, 1e-3, on)?;
                reports.push(f32);
            }
        }
    }
    Ok(reports)
}

/// Small random models that exercise every kernel at awkward sizes: several head counts and
/// widths, vocabularies that are no multiple of the block sizes, contexts up to n_ctx.
pub fn kernel_sweep(seed: u64) -> Result<Vec<CheckReport>, EngineError> {
    let mut reports = Vec::new();
    for (i, &shape) in SWEEP_SHAPES.iter().enumerate() {
        let (name, weights) = random_model(shape, seed + i as u64);
        let (n_ctx, vocab_size) = (shape.3, shape.4);
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

/// What one batched comparison saw.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchCheckReport {
    pub model: String,
    pub dtype: String,
    pub streams: usize,
    pub steps: usize,
    /// Worst scaled logit error of any context after any shared step, against the CPU
    /// reference fed the same ids.
    pub decode_error: f32,
    /// Worst scaled logit error between a context's shared steps and the same context run
    /// alone on the GPU (the one-row decode kernels; batch-invariant: batched passes).
    pub alone_error: f32,
    /// Batch-invariant steps (`WASI_NN_HOST_BATCH_INVARIANT`, bf16): every logit read must be
    /// the same bits shared and alone (`alone_error` 0).
    pub invariant: bool,
    /// Contexts whose greedy ids differ from their ids alone.
    pub ids_differ: usize,
    /// Outside batch invariance, the contexts whose long prompts ran in chunks beside the
    /// others (and whole alone) that parted from their ids alone at a near tie (not a failure:
    /// their logits are compared up to there, and against the CPU reference throughout).
    pub chunked_ids_parted: usize,
    /// Steps where the batch's argmax, or its sampled draw, disagrees with the logits it came
    /// with.
    pub argmax_disagree: usize,
    /// The largest step, in contexts (the steps were shared when it is > 1).
    pub largest_step: usize,
    /// The context sent an id outside the vocabulary mid-run: it got an error, and the
    /// others' results did not change.
    pub bad_id_refused: bool,
    /// Steps of the shared run that were run ahead and taken (the guessed token came), and
    /// those whose guess was wrong.
    pub ahead_hits: u64,
    pub ahead_misses: u64,
    /// Rows that ran late (in a pass run ahead, their step not waiting for them).
    pub ahead_late: u64,
    /// Passes run ahead launched before the pass in flight had ended.
    pub ahead_early: u64,
    /// Results run ahead still kept once every context is gone (must be none).
    pub ahead_kept: usize,
    pub tolerance: f32,
    pub passed: bool,
}

/// The steps a context of [`compare_batched`] is away for: five from the first step past a
/// third of the way whose step before read no logits (so steps are run ahead from there), so
/// that it comes back at a step that reads none and the first it reads is its third back
/// (none when the run is too short).
fn away_steps(steps: usize) -> std::ops::Range<usize> {
    let first = (steps / 3..).find(|s| s % 3 == 1).unwrap_or(steps);
    // back, it reads the logits of its third step: within the run
    match first + 5 + 2 < steps {
        true => first..first + 5,
        false => 0..0,
    }
}

/// Greedy steps of `streams` contexts (distinct prompts of different lengths) stepping
/// together, each step one shared batched step (a barrier per step), against the CPU
/// reference and against each context run alone. Context 0 also sends an id outside the
/// vocabulary halfway: it must get an error for that call alone. The contexts read their
/// logits every third step and at their last, only the argmax otherwise (so most shared
/// steps are run ahead); context 1 sends another token than its argmax about a third of the way
/// (the step run ahead for it is wrong), and context 2 stops halfway (dropped while a step
/// run ahead for it may be under way); context 3 sends its prompt (150 tokens where the model
/// allows: chunks beside the others' decodes) a quarter of the way in, to a step whose other
/// contexts were run ahead (its rows usually run late, in their pass, and every later step of
/// it too); context 4 is away for five steps a third of the way in (no call while the others
/// step, so steps are run ahead for it up to the depth), then takes the results one by one
/// and reads the logits of the third; once all are gone, no result run ahead is kept.
pub fn compare_batched(
    name: &str,
    weights: Gpt2Weights,
    dtype: GpuDtype,
    streams: usize,
    steps: usize,
    tolerance: f32,
) -> Result<BatchCheckReport, EngineError> {
    let cfg = weights.config;
    let prompts: Vec<Vec<u32>> = (0..streams)
        .map(|i| {
            // context 3 starts late, among contexts decoding: its prompt, longer than a
            // pass takes at once, rides the passes in chunks beside their decodes
            let len = if i == 3 { 150 } else { 5 + 11 * i };
            let len = len.min(cfg.n_ctx.saturating_sub(steps + 1)).max(1);
            prompt(len, cfg.vocab_size, 1000 + i as u32)
        })
        .collect();
    let steps = steps.min(cfg.n_ctx - prompts.iter().map(Vec::len).max().unwrap_or(1));
    let reference = match dtype {
        GpuDtype::F32 => weights.clone(),
        GpuDtype::Bf16 => weights.bf16_rounded(),
    };
    let cpu = CpuExecutor::reference(Arc::new(reference));
    // warmed as the service is with `--warm-contexts`: the pass's graphs captured at start
    let gpu = warm_gpu_executor(&weights, dtype, streams)?;
    type Run = (Vec<u32>, Vec<Option<Vec<f32>>>, usize, bool);
    // one context: its prompt, then greedy steps (with `barrier`, in step with the others;
    // after an error it keeps meeting the barrier, so the others never wait for it in vain)
    let run = |i: usize, barrier: Option<&std::sync::Barrier>| -> Result<Run, EngineError> {
        let mut session = Some(gpu.new_session()?);
        let (mut ids, mut logits, mut disagree, mut refused) = (Vec::new(), Vec::new(), 0, false);
        let mut failure = None;
        let stop = if i == 2 { steps / 2 } else { steps };
        let away = match i {
            4 => away_steps(steps),
            _ => 0..0,
        };
        // after a step whose logits were read (step % 3 == 2) nothing is run ahead
        let begin = match i {
            3 if (steps / 4).is_multiple_of(3) => steps / 4 + 1,
            3 => steps / 4,
            _ => 0,
        };
        for step in 0..=steps {
            if let Some(b) = barrier {
                b.wait();
            }
            if step == stop || failure.is_some() {
                session = None;
            }
            let Some(s) = session.as_mut() else {
                continue;
            };
            if step < begin || away.contains(&step) {
                continue;
            }
            let mut one_step = || -> Result<(), EngineError> {
                if step == begin {
                    return s.extend(&prompts[i], false);
                }
                let mut next = s.argmax()?;
                // a step run ahead (the logits of two steps before were not read), with the
                // wrong guess
                if i == 1 && step == steps / 9 * 3 + 2 {
                    next = (next + 1) % cfg.vocab_size as u32;
                }
                if i == 0 && step == steps / 2 && barrier.is_some() {
                    refused = s.extend(&[cfg.vocab_size as u32], false).is_err();
                }
                s.extend(&[next], false)?;
                // context 2 reads no logits before it stops: its last step is run ahead
                let read = step % 3 == 2 || (step + 1 == stop && i != 2);
                let l = match read {
                    true => Some(s.last_logits()?),
                    false => None,
                };
                if let Some(l) = &l {
                    disagree += usize::from(s.argmax()? != argmax(l));
                    let rule = sampling_rule(s.len());
                    disagree += usize::from(s.draw(&rule)? != draw::draw(l, &rule, s.len()));
                }
                ids.push(next);
                logits.push(l);
                Ok(())
            };
            if let Err(e) = one_step() {
                failure = Some(EngineError::device(format!(
                    "context {i}, step {step}: {e}"
                )));
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok((ids, logits, disagree, refused)),
        }
    };
    let alone: Vec<Run> = (0..streams)
        .map(|i| run(i, None))
        .collect::<Result<_, _>>()?;
    let (steps_before, _, _) = gpu.batch_stats();
    let counts_before = gpu.batch_counts().unwrap_or_default();
    let barrier = std::sync::Barrier::new(streams);
    let together: Vec<Result<Run, EngineError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                let (run, barrier) = (&run, &barrier);
                scope.spawn(move || run(i, Some(barrier)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(EngineError::device("a stream panicked")))
            })
            .collect()
    });
    let (steps_after, _, largest) = gpu.batch_stats();
    let counts = gpu.batch_counts().unwrap_or_default();
    let ahead_hits = counts.speculation.hits - counts_before.speculation.hits;
    let ahead_misses = counts.speculation.misses - counts_before.speculation.misses;
    let ahead_late = counts.speculation.deferred - counts_before.speculation.deferred;
    let ahead_early = counts.speculation.overlapped - counts_before.speculation.overlapped;
    let switches = wasi_nn_host::switches::get();
    let run_ahead = switches.measurement.run_ahead;
    let early = run_ahead && switches.measurement.early_launch;
    let invariant = dtype == GpuDtype::Bf16 && switches.settings.batch_invariant;
    let (mut decode_error, mut alone_error, mut ids_differ, mut disagree) = (0.0f32, 0.0f32, 0, 0);
    let mut chunked_ids_parted = 0;
    let mut bad_id_refused = false;
    for (i, result) in together.into_iter().enumerate() {
        let (ids, logits, d, refused) = result?;
        bad_id_refused |= refused;
        disagree += d;
        // A prompt longer than a pass's chunk runs whole through the prefill path alone and
        // in chunks in the passes beside the others: other kernels, so outside batch
        // invariance its ids may part at a near tie. Its logits are compared up to there (and
        // against the CPU reference all along); where they part is counted, not failed.
        let differs = ids != alone[i].0;
        let may_part = prompts[i].len() > BATCHED_PROMPT && !invariant;
        let same_ids = (ids.iter().zip(&alone[i].0))
            .take_while(|(a, b)| a == b)
            .count();
        match (differs, may_part) {
            (true, true) => chunked_ids_parted += 1,
            (true, false) => ids_differ += 1,
            _ => {}
        }
        let compared = if may_part { same_ids } else { usize::MAX };
        for (a, b) in logits.iter().zip(&alone[i].1).take(compared) {
            if let (Some(a), Some(b)) = (a, b) {
                alone_error = alone_error.max(scaled_error(a, b));
            }
        }
        let mut c = cpu.new_session()?;
        c.extend(&prompts[i], false)?;
        for (id, l) in ids.iter().zip(&logits) {
            c.extend(&[*id], false)?;
            if let Some(l) = l {
                decode_error = decode_error.max(scaled_error(l, &c.last_logits()?));
            }
        }
    }
    Ok(BatchCheckReport {
        model: name.to_owned(),
        dtype: format!("{dtype:?}").to_lowercase(),
        streams,
        steps,
        decode_error,
        alone_error,
        invariant,
        ids_differ,
        chunked_ids_parted,
        argmax_disagree: disagree,
        largest_step: largest,
        bad_id_refused,
        ahead_hits,
        ahead_misses,
        ahead_late,
        ahead_early,
        ahead_kept: counts.speculation.kept,
        tolerance,
        passed: decode_error <= tolerance
            && counts.speculation.kept == 0
            && (streams < 3 || !run_ahead || ahead_hits > 0)
            && (streams < 3 || !early || ahead_early > 0)
            && alone_error <= tolerance
            && (!invariant || alone_error == 0.0)
            && ids_differ == 0
            && disagree == 0
            && bad_id_refused
            && (streams < 2 || (largest > 1 && steps_after > steps_before)),
    })
}

/// Batched steps on small random models of awkward sizes (head counts, widths, a vocabulary
/// no multiple of the block sizes), 5 and 11 contexts (padded to 8 and 16 rows), f32 and
/// bf16.
pub fn batched_sweep(seed: u64) -> Result<Vec<BatchCheckReport>, EngineError> {
    let configs = [(2, 3, 96, 130, 1000, 5), (1, 4, 256, 300, 2111, 11)];
    let mut reports = Vec::new();
    for (i, &(n_layer, n_head, n_embd, n_ctx, vocab_size, streams)) in configs.iter().enumerate() {
        let shape = (n_layer, n_head, n_embd, n_ctx, vocab_size);
        let (name, weights) = random_model(shape, seed + 100 + i as u64);
        reports.push(compare_batched(
            &name,
            weights.clone(),
            GpuDtype::F32,
            streams,
            24,
            1e-3,
        )?);
        reports.push(compare_batched(
            &name,
            weights,
            GpuDtype::Bf16,
            streams,
            24,
            5e-2,
        )?);
    }
    Ok(reports)
}

/// What [`kv_out_of_memory`] saw, with the pool capped as `pool` says.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OomReport {
    /// "default" (the KV pool's cap: 3/4 of the memory free after the weights) or
    /// "uncapped" (the driver's out-of-memory).
    pub pool: String,
    /// Contexts open when the next one was refused.
    pub opened: usize,
    /// The refused context's error.
    pub error: String,
    /// Every open context then took a step (greedy id = argmax of its logits).
    pub others_stepped: bool,
    /// After they were dropped, a new context opened and stepped.
    pub reopened: bool,
    pub passed: bool,
}

/// Out of memory on the GPU: contexts of a model with a long context (~3.7 GB each, 2.4 GB
/// of it KV cache) are opened until one is refused: with the default KV pool its cap refuses
/// it, with the pool uncapped the driver's allocation does. That context alone gets an error; every
/// context open steps on, and once they are dropped a new one opens again.
pub fn kv_out_of_memory(seed: u64) -> Result<Vec<OomReport>, EngineError> {
    let config = Gpt2Config {
        n_layer: 12,
        n_head: 12,
        n_embd: 768,
        n_ctx: 32768,
        vocab_size: 1000,
    };
    let weights = random_weights(config, seed);
    let mut reports = Vec::new();
    for (pool, cap) in [("default", None), ("uncapped", Some(usize::MAX))] {
        let options = EngineOptions {
            dtype: GpuDtype::Bf16,
            max_kv_bytes: usize::MAX,
            kv_pool_bytes: cap,
            ..Default::default()
        };
        let gpu = wasi_nn_host::cuda::CudaExecutor::new(&weights, &options)?;
        let mut open = Vec::new();
        let error = loop {
            match gpu.new_session() {
                Ok(mut s) => {
                    s.extend(&prompt(8, config.vocab_size, open.len() as u32), false)?;
                    open.push(s);
                }
                Err(e) => break e.to_string(),
            }
            if open.len() > 1000 {
                break "no context was refused".to_owned();
            }
        };
        let opened = open.len();
        let mut others_stepped = opened > 0;
        for s in open.iter_mut() {
            let next = s.argmax()?;
            let stepped = s.extend(&[next], false).and_then(|()| {
                let logits = s.last_logits()?;
                Ok(s.argmax()? == argmax(&logits))
            });
            others_stepped &= stepped.unwrap_or(false);
        }
        drop(open);
        let reopened = gpu
            .new_session()
            .and_then(|mut s| {
                s.extend(&prompt(8, config.vocab_size, 7), false)?;
                let next = s.argmax()?;
                s.extend(&[next], false)
            })
            .is_ok();
        reports.push(OomReport {
            pool: pool.to_owned(),
            opened,
            // the default pool (each context counted with its session's buffers) refuses
            // before the driver runs out
            passed: opened > 0
                && others_stepped
                && reopened
                && error != "no context was refused"
                && (cap.is_some() || error.contains("pool is full")),
            error,
            others_stepped,
            reopened,
        });
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::away_steps;

    #[test]
    fn a_context_is_away_from_a_step_run_ahead_and_reads_the_third_result_back() {
        for steps in [24, 32, 100] {
            let away = away_steps(steps);
            assert_eq!(away.len(), 5, "{steps}");
            assert!(away.start >= steps / 3 && away.end + 2 < steps, "{steps}");
            // the step before read no logits (a read stops the run-ahead), nor does the
            // first back; the third back does
            assert_ne!((away.start - 1) % 3, 2, "{steps}");
            assert_ne!(away.end % 3, 2, "{steps}");
            assert_eq!((away.end + 2) % 3, 2, "{steps}");
        }
        assert_eq!(away_steps(24), 10..15);
        assert_eq!(away_steps(12), 4..9);
        assert!(away_steps(10).is_empty());
    }
}

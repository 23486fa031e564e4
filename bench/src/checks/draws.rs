//! Contexts that draw their tokens (output 4) sharing batched steps: the token each step
//! draws, in the pass or in a step run ahead for the context, is the rule's draw from the
//! logits of that position.

use super::gpu_executor;
use super::prompt;
use std::sync::Arc;
use wasi_nn_host::engine::draw::{self, DrawRule};
use wasi_nn_host::engine::processing::{EditedRule, Processing};
use wasi_nn_host::engine::{EngineError, Executor, GpuDtype};
use wasi_nn_host::model::Gpt2Weights;

/// What [`compare_batched_draws`] saw.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DrawCheckReport {
    pub model: String,
    pub dtype: String,
    pub streams: usize,
    pub steps: usize,
    /// Every context drew after a processing (penalties, a bias, min-p), announced with
    /// each step.
    pub processed: bool,
    /// Draws checked against the rule on the logits read after them.
    pub checked: usize,
    /// Of those, draws that are not the rule's (must be 0).
    pub mismatches: usize,
    /// Steps run ahead that the contexts took (with their drawn tokens).
    pub ahead_hits: u64,
    pub passed: bool,
}

/// The rules (temperature, top-p, min-p) of the draw check's contexts, one after the other.
const RULES: [(f32, f32, f32); 5] = [
    (1.0, 0.9, 0.0),
    (0.8, 0.5, 0.0),
    (1.1, 1.0, 0.0),
    (1.0, 0.95, 0.05),
    (0.9, 0.95, 0.0),
];

/// The processing of context `i` of the draw check: with `processed`, each context's own
/// (penalties and a bias with the repetition penalty, presence alone, frequency with the
/// repetition penalty, a bias alone, none but its rule's min-p); else the last rule's
/// alone.
fn processing_of(i: usize, processed: bool, vocab: usize) -> Result<Processing, EngineError> {
    let (penalties, ids, values): ((f32, f32, f32), &[i32], &[f32]) =
        match (processed, i % RULES.len()) {
            (false, 4) | (true, 0) => ((0.5, 0.25, 1.2), &[7, 11], &[2.0, -100.0]),
            (true, 1) => ((0.8, 0.0, 1.0), &[], &[]),
            (true, 2) => ((0.0, 0.6, 0.9), &[], &[]),
            (true, 4) => ((0.0, 0.0, 1.0), &[3, 5, 9], &[1.5, -2.0, 4.0]),
            _ => return Ok(Processing::default()),
        };
    Processing::new(penalties, ids, values, 0, vocab)
        .map_err(|e| EngineError::device(e.to_string()))
}

/// `streams` contexts, each with its own rule (top-p 0.9 or 0.5, temperature alone, min-p
/// with top-p, or top-p after a bias and penalties; with `processed`, every one after a
/// processing or with min-p) and seed, draw `steps` tokens in lockstep (a barrier per step).
/// Every other step only draws, so that the next step is run ahead with the drawn token (its
/// edits following the token where the context has penalties); the step after it draws and
/// then reads its logits, and its draw must be the rule's draw from them.
pub fn compare_batched_draws(
    name: &str,
    weights: &Gpt2Weights,
    dtype: GpuDtype,
    (streams, steps): (usize, usize),
    processed: bool,
) -> Result<DrawCheckReport, EngineError> {
    let cfg = weights.config;
    let gpu = gpu_executor(weights, dtype)?;
    let before = gpu.batch_counts().unwrap_or_default();
    let barrier = std::sync::Barrier::new(streams);
    let run = |i: usize| -> Result<(usize, usize), EngineError> {
        // min-p (drawn after the pass) and a request's processing (drawn inside the pass
        // where announced, else after it) draw from a processed copy of the logits
        let processing = processing_of(i, processed, cfg.vocab_size)?;
        let (temperature, top_p, min_p) = RULES[i % RULES.len()];
        let rule = DrawRule {
            temperature,
            top_p,
            seed: 77 + i as u64,
            min_p,
        };
        let mut s = gpu.new_session()?;
        let len = (4 + 3 * i).min(cfg.n_ctx.saturating_sub(steps + 1)).max(1);
        let mut next = prompt(len, cfg.vocab_size, 300 + i as u32);
        let mut sequence = Vec::new();
        let (mut checked, mut mismatches) = (0, 0);
        for step in 0..steps {
            barrier.wait();
            sequence.extend_from_slice(&next);
            let edits = (processing.edits(&sequence))
                .map_err(|e| EngineError::device(e.to_string()))?
                .ok_or_else(|| EngineError::device("distinct bias ids have edits"))?;
            // a processed draw announced with its step is made inside the pass; every fourth
            // is not (but with `processed`), and is made after it
            let drawn_after = !(processing.is_neutral() && rule.is_plain());
            let announced = (drawn_after && (processed || step % 4 != 3)).then(|| {
                let edits = edits.clone();
                Arc::new(EditedRule { rule, edits })
            });
            s.announce_draw(announced);
            s.extend(&next, false)?;
            let token = match drawn_after {
                false => s.draw(&rule)?,
                true => s.draw_edited(&rule, &edits)?,
            };
            if step % 2 == 1 {
                let mut logits = s.last_logits()?;
                edits.apply(&mut logits);
                checked += 1;
                mismatches += usize::from(token != draw::draw(&logits, &rule, s.len()));
            }
            next = vec![token];
        }
        Ok((checked, mismatches))
    };
    let results: Vec<Result<(usize, usize), EngineError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                let run = &run;
                scope.spawn(move || run(i))
            })
            .collect();
        (handles.into_iter())
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(EngineError::device("a stream panicked")))
            })
            .collect()
    });
    let (mut checked, mut mismatches) = (0, 0);
    for result in results {
        let (c, m) = result?;
        checked += c;
        mismatches += m;
    }
    let after = gpu.batch_counts().unwrap_or_default();
    let ahead_hits = after.speculation.hits - before.speculation.hits;
    let run_ahead = wasi_nn_host::switches::get().measurement.run_ahead;
    Ok(DrawCheckReport {
        model: name.to_owned(),
        dtype: format!("{dtype:?}").to_lowercase(),
        streams,
        steps,
        processed,
        checked,
        mismatches,
        ahead_hits,
        passed: mismatches == 0 && checked > 0 && (ahead_hits > 0 || !run_ahead),
    })
}

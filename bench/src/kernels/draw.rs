//! The sampled draw (`draw_token`) against its specification (`engine::draw`): rows of fresh
//! random logits (peaked, flat, with NaN, -inf and +inf, ties), each with its own rule, seed
//! and position, in one launch. The kernel's token must be the reference's (or both leave the
//! row undecided, -1): both sum the same f64 weights in another order, so they could only part
//! where a draw's target falls within about 1e-13 of a token's edge. Rows where the nucleus
//! check's f32 estimate cannot decide, and a vocabulary whose threads' chunks are too long
//! for the walk through shared memory, take the kernel's other paths.

use rand::{Rng, SeedableRng};
use wasi_nn_host::cuda::buffer::DevBuf;
use wasi_nn_host::cuda::ops::draw::{rule_words, Draw};
use wasi_nn_host::cuda::ops::Launcher;
use wasi_nn_host::engine::draw::{draw_by_rejection, DrawRule, Drawn};
use wasi_nn_host::engine::EngineError;

/// One row: its logits and rule, and the position drawn for.
struct Row {
    logits: Vec<f32>,
    rule: DrawRule,
    position: usize,
}

fn rows(vocab: usize, seed: u64) -> Result<Vec<Row>, EngineError> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let rules = [
        (1.0, 1.0),
        (0.8, 0.95),
        (1.0, 0.5),
        (0.7, 0.9),
        (1.5, 0.05),
        (0.05, 1.0),
    ];
    let mut rows = Vec::new();
    for (i, &(t, p)) in rules.iter().cycle().take(24).enumerate() {
        let spread = [0.1f32, 2.0, 8.0][i % 3];
        let mut logits: Vec<f32> = (0..vocab)
            .map(|_| rng.random_range(-1.0f32..1.0) * spread)
            .collect();
        match i {
            3 => logits.iter_mut().step_by(7).for_each(|l| *l = f32::NAN),
            4 => logits
                .iter_mut()
                .step_by(3)
                .for_each(|l| *l = f32::NEG_INFINITY),
            5 => logits
                .iter_mut()
                .for_each(|l| *l = (*l * 4.0).round() / 4.0), // ties
            6 => logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY),
            7 => {
                logits[vocab / 2] = f32::INFINITY;
                logits[vocab - 1] = f32::INFINITY;
            }
            8 => logits.iter_mut().for_each(|l| *l = 0.0), // every token alike
            _ => {}
        }
        let rule =
            DrawRule::new(t, p, rng.random()).map_err(|e| EngineError::device(e.to_string()))?;
        rows.push(Row {
            logits,
            rule,
            position: rng.random_range(0..100_000),
        });
    }
    // Two tokens alike and nothing else: a draw of the higher id has exactly half the total
    // before it, where the kernel's f32 estimate cannot decide and the f64 sum must: with
    // top-p 0.5 it is rejected, with the next f32 above 0.5 kept. Each row's first draw takes
    // the higher id with odds 1/2, so over the rows and vocabularies both outcomes come up.
    let mut logits = vec![f32::NEG_INFINITY; vocab];
    logits[vocab / 3] = 0.25;
    logits[vocab - 2] = 0.25;
    let just_above_half = f32::from_bits(0.5f32.to_bits() + 1);
    for (k, top_p) in [0.5, just_above_half]
        .into_iter()
        .cycle()
        .take(8)
        .enumerate()
    {
        rows.push(Row {
            logits: logits.clone(),
            rule: DrawRule::new(1.0, top_p, rng.random())
                .map_err(|e| EngineError::device(e.to_string()))?,
            position: k,
        });
    }
    Ok(rows)
}

/// `draw_token` on the rows of [`rows`] for the vocabulary sizes `vocabs`.
pub(super) fn check_draw(
    l: &Launcher,
    vocabs: &[usize],
    seed: u64,
    report: &mut impl FnMut(&str, &[f32], &[f32], f32),
) -> Result<(), EngineError> {
    let stream = l.stream().clone();
    for &vocab in vocabs {
        let rows = rows(vocab, seed ^ vocab as u64)?;
        let logits: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
        let words: Vec<u64> = (rows.iter())
            .flat_map(|r| rule_words(&r.rule, r.position))
            .collect();
        let logits = DevBuf::from_host(&stream, &logits, "logits")?;
        let rules = DevBuf::from_host(&stream, &words, "rules")?;
        let out = DevBuf::<i32>::zeros(&stream, rows.len(), "tokens")?;
        l.draw_token(Draw {
            logits: logits.ptr(),
            stride: vocab,
            rows: rows.len(),
            vocab,
            rules: rules.ptr(),
            out: out.ptr(),
        })?;
        let got: Vec<f32> = (out.read(&stream, rows.len())?.iter())
            .map(|&t| t as f32)
            .collect();
        let want: Vec<f32> = (rows.iter())
            .map(
                |r| match draw_by_rejection(&r.logits, &r.rule, r.position) {
                    Drawn::Token(id) => id as f32,
                    Drawn::Undecided { .. } => -1.0,
                },
            )
            .collect();
        report(
            &format!("draw rows={} V={vocab}", rows.len()),
            &got,
            &want,
            0.0,
        );
    }
    Ok(())
}

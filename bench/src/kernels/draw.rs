//! The sampled draw (`draw_token`) against its specification (`engine::draw`): rows of fresh
//! random logits (peaked, flat, with NaN, -inf and +inf, ties), each with its own rule, seed
//! and position, in one launch. The kernel's token must be the reference's (or both leave the
//! row undecided, -1): both sum the same f64 weights in another order, so they could only part
//! where a draw's target falls within about 1e-13 of a token's edge. Rows where the nucleus
//! check's f32 estimate cannot decide, and a vocabulary whose threads' chunks are too long
//! for the walk through shared memory, take the kernel's other paths.

use rand::{Rng, SeedableRng};
use wasi_nn_host::cuda::buffer::DevBuf;
use wasi_nn_host::cuda::ops::draw::{
    edit_words, rule_words, Draw, EditedDraw, EDIT_WORDS, MAX_DRAW_BLOCKS,
};
use wasi_nn_host::cuda::ops::Launcher;
use wasi_nn_host::engine::draw::{draw_by_rejection, DrawRule, Drawn};
use wasi_nn_host::engine::processing::Processing;
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

/// The blocks a row's draw is checked over: one, and on sm_90+ clusters of 2 and of the most.
fn block_counts(l: &Launcher) -> Vec<u32> {
    match l.gpu().cluster_launch() {
        true => vec![1, 2, MAX_DRAW_BLOCKS],
        false => vec![1],
    }
}

/// `draw_token` on the rows of [`rows`] for the vocabulary sizes `vocabs`, over each of
/// [`block_counts`].
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
        let mut out = DevBuf::<i32>::zeros(&stream, rows.len(), "tokens")?;
        let want: Vec<f32> = (rows.iter())
            .map(
                |r| match draw_by_rejection(&r.logits, &r.rule, r.position) {
                    Drawn::Token(id) => id as f32,
                    Drawn::Undecided { .. } => -1.0,
                },
            )
            .collect();
        for blocks in block_counts(l) {
            out.write(&stream, 0, &vec![-2; rows.len()])?;
            let draw = Draw {
                logits: logits.ptr(),
                stride: vocab,
                rows: rows.len(),
                vocab,
                rules: rules.ptr(),
                out: out.ptr(),
            };
            l.draw_token_over(draw, blocks)?;
            let got: Vec<f32> = (out.read(&stream, rows.len())?.iter())
                .map(|&t| t as f32)
                .collect();
            report(
                &format!("draw rows={} V={vocab} blocks={blocks}", rows.len()),
                &got,
                &want,
                0.0,
            );
        }
    }
    Ok(())
}

/// `draw_processed` on the rows of [`rows`] (GPT-2's vocabulary and the model's), each with
/// a fresh random processing of its logits (a bias list, a sequence with a prompt and a
/// generated part, presence, frequency and repetition penalties, each set or not) and min-p on
/// every other row, the rows taking [`block_counts`] in turn: the kernel's token must be the
/// reference's draw from the logits that [`Processing::apply`] gives, and the logits it was
/// given must be left as they were.
pub(super) fn check_draw_edited(
    l: &Launcher,
    vocabs: &[usize],
    seed: u64,
    report: &mut impl FnMut(&str, &[f32], &[f32], f32),
) -> Result<(), EngineError> {
    let stream = l.stream().clone();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let bad = |e: &dyn std::fmt::Display| EngineError::device(e.to_string());
    let counts = block_counts(l);
    for &vocab in vocabs {
        let rows = rows(vocab, seed ^ vocab as u64)?;
        let (mut got, mut want, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        let scratch = DevBuf::<f32>::zeros(&stream, vocab, "scratch")?;
        let mut rule_buf = DevBuf::<u64>::zeros(&stream, 4, "rule")?;
        let out = DevBuf::<i32>::zeros(&stream, 1, "token")?;
        for (i, row) in rows.iter().enumerate() {
            let len = rng.random_range(1..300);
            let sequence: Vec<u32> = (0..len)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect();
            // distinct bias ids, some of them pushing a token far up or down
            let mut ids: Vec<i32> = (0..rng.random_range(0..40))
                .map(|_| rng.random_range(0..vocab as i32))
                .collect();
            ids.sort_unstable();
            ids.dedup();
            let values: Vec<f32> = (ids.iter())
                .map(|_| match rng.random_range(0..4) {
                    0 => 100.0,
                    1 => -100.0,
                    _ => rng.random_range(-3.0..3.0),
                })
                .collect();
            let penalties = (
                [0.0, 0.5, -0.3][i % 3],
                [0.0, 0.25][i % 2],
                [1.0, 1.3, 0.8][(i / 2) % 3],
            );
            let from = rng.random_range(0..=len);
            let processing =
                Processing::new(penalties, &ids, &values, from, vocab).map_err(|e| bad(&e))?;
            let edits = (processing.edits(&sequence).map_err(|e| bad(&e))?)
                .ok_or_else(|| EngineError::device("distinct bias ids have edits"))?;
            let rule = match i % 2 {
                0 => row.rule,
                _ => row.rule.with_min_p(0.05).map_err(|e| bad(&e))?,
            };
            let logits = DevBuf::from_host(&stream, &row.logits, "logits")?;
            let words = edit_words(&edits);
            let edit_buf = DevBuf::from_host(&stream, &words, "edits")?;
            rule_buf.write(&stream, 0, &rule_words(&rule, row.position))?;
            let blocks = counts[i % counts.len()];
            let draw = EditedDraw {
                logits: logits.ptr(),
                scratch: scratch.ptr(),
                vocab,
                rule: rule_buf.ptr(),
                edits: edit_buf.ptr(),
                count: words.len() / EDIT_WORDS,
                repetition: edits.repetition,
                floor_offset: rule.min_p_offset(),
                out: out.ptr(),
            };
            l.draw_edited_over(draw, blocks)?;
            got.push(out.read(&stream, 1)?[0] as f32);
            let mut processed = Vec::new();
            (processing.apply(&row.logits, &sequence, &mut processed)).map_err(|e| bad(&e))?;
            want.push(match draw_by_rejection(&processed, &rule, row.position) {
                Drawn::Token(id) => id as f32,
                Drawn::Undecided { .. } => -1.0,
            });
            let after = logits.read(&stream, vocab)?;
            let same = (after.iter().zip(&row.logits)).all(|(a, b)| a.to_bits() == b.to_bits());
            kept.push(f32::from(u8::from(same)));
        }
        let n = rows.len();
        report(
            &format!("processed draw rows={n} V={vocab}"),
            &got,
            &want,
            0.0,
        );
        report(
            &format!("processed draw leaves the logits rows={n} V={vocab}"),
            &kept,
            &vec![1.0; n],
            0.0,
        );
    }
    Ok(())
}

/// The draw alone, timed: for each row count and each of `blocks` (those the GPU can launch),
/// the median over `runs` of 20 launches back to back on rows of flat random logits (top-p
/// 0.95, temperature 1, as random weights give and users ask), in microseconds a launch.
pub fn draw_speed(
    l: &Launcher,
    vocab: usize,
    row_counts: &[usize],
    blocks: &[u32],
    runs: usize,
) -> Result<Vec<(usize, u32, f64)>, EngineError> {
    let stream = l.stream().clone();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let most = row_counts.iter().copied().max().unwrap_or(1);
    let logits: Vec<f32> = (0..most * vocab)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    let bad = |e: &dyn std::fmt::Display| EngineError::device(e.to_string());
    let rule = DrawRule::new(1.0, 0.95, 1).map_err(|e| bad(&e))?;
    let words: Vec<u64> = (0..most).flat_map(|r| rule_words(&rule, r)).collect();
    let logits = DevBuf::from_host(&stream, &logits, "logits")?;
    let rules = DevBuf::from_host(&stream, &words, "rules")?;
    let out = DevBuf::<i32>::zeros(&stream, most, "tokens")?;
    let mut results = Vec::new();
    let runs = runs.max(1);
    let launchable = |b: u32| b == 1 || (b <= MAX_DRAW_BLOCKS && l.gpu().cluster_launch());
    for &rows in row_counts.iter().filter(|&&rows| rows > 0) {
        for &b in blocks.iter().filter(|&&b| launchable(b)) {
            let draw = Draw {
                logits: logits.ptr(),
                stride: vocab,
                rows,
                vocab,
                rules: rules.ptr(),
                out: out.ptr(),
            };
            let mut times = Vec::with_capacity(runs);
            for run in 0..runs + 3 {
                stream.synchronize().map_err(|e| bad(&e))?;
                let t = std::time::Instant::now();
                for _ in 0..20 {
                    l.draw_token_over(draw, b)?;
                }
                stream.synchronize().map_err(|e| bad(&e))?;
                if run >= 3 {
                    times.push(t.elapsed().as_secs_f64() * 1e6 / 20.0);
                }
            }
            times.sort_by(f64::total_cmp);
            results.push((rows, b, times[times.len() / 2]));
        }
    }
    Ok(results)
}

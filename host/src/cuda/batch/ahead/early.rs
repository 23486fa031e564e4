//! Two passes in flight: a step whose contexts came back with the tokens the pass in flight
//! runs for them launches the next pass before that one ends. Each hit's next row takes as its
//! token the argmax of its row in the pass in flight, read from that pass's keys on the GPU
//! (`batch_feed`, before the next pass's embedding clears them); everything else of the step
//! runs late in the same pass. Only then does the step wait for the pass in flight and hand out
//! its argmax, so the GPU goes from one pass to the next without waiting for the host.

use super::plan::{
    host_next_token, may_run_ahead, note_guests, plan_ahead, take_late_results,
    take_next_after_late, take_result,
};
use super::state::{Ahead, InFlight, InFlightHit, NextStep};
use crate::cuda::batch::contexts::CudaSeq;
use crate::cuda::batch::CudaBatch;
use crate::engine::batch::StepItem;
use crate::engine::EngineError;
use std::sync::MutexGuard;
use std::time::Instant;

impl CudaBatch {
    /// A step whose pass run ahead is launched before the pass in flight ends (`early[i]`:
    /// the row of that pass whose results item i takes; see [`super::plan::early_hits`]).
    /// The contexts that hit advance at once; the next pass feeds their tokens from the keys
    /// of the pass in flight on the GPU; then the step waits for the pass in flight and hands
    /// out its argmax.
    pub(crate) fn step_early(
        &self,
        mut ahead: MutexGuard<'_, Ahead>,
        items: &mut [StepItem<'_, CudaSeq>],
        early: &[Option<InFlightHit>],
        started: Instant,
    ) {
        let hit = take_hits(&mut ahead, items, early);
        let hits = hit.iter().filter(|&&h| h).count();
        // every other item's rows run late in the next pass
        let mut late = Vec::new();
        for (i, item) in items.iter_mut().enumerate() {
            if hit[i] || item.error.is_some() {
                continue;
            }
            match item.seq.session().and_then(|s| s.admit(item.tokens)) {
                Ok(()) => late.push(i),
                Err(e) => item.error = Some(e),
            }
        }
        let greedy = may_run_ahead(items);
        let picks = self.plan_early(&mut ahead, items, &hit, early, &late, &greedy);
        // nothing to run ahead (every context sampled): only the wait below
        let next = match picks.is_empty() && late.is_empty() {
            true => None,
            false => match self.launch_ahead(&mut ahead, items, picks, &late, &greedy) {
                Ok(flight) => {
                    ahead.counts.early += 1;
                    Some(flight)
                }
                Err(e) => {
                    tracing::warn!("running a step ahead failed: {e}");
                    for &i in &late {
                        let message = format!("batched step: {e}");
                        items[i].error.get_or_insert(EngineError::device(message));
                    }
                    None
                }
            },
        };
        let launched = started.elapsed();
        ahead.clock.launched(launched);
        // now the pass in flight: its argmax for the contexts that took its rows, and the
        // tokens the next pass was fed
        ahead.resolve();
        let resolved = started.elapsed();
        let run_ahead_rows = next.as_ref().map_or(0, |n| n.n);
        hand_out_in_flight(&mut ahead, items, &hit, early, next);
        tracing::debug!(
            items = items.len(),
            hit = hits,
            late = late.len(),
            run_ahead = run_ahead_rows,
            hits = ahead.counts.hits,
            misses = ahead.counts.misses,
            taken = ahead.counts.taken,
            early = true,
            resolve_us = resolved.as_micros() as u64,
            pass_gpu_us = ahead.clock.gpu_time.as_micros() as u64,
            gap_gpu_us = ahead.clock.gpu_gap.as_micros() as u64,
            own_launch_us = launched.as_micros() as u64,
            step_us = started.elapsed().as_micros() as u64,
            "batched step"
        );
    }

    /// The steps the early pass runs ahead: the hits' next steps, the next steps of contexts
    /// whose late rows are in the pass in flight, and those kept for contexts whose late rows
    /// were resolved, within the pass's rows left by the `late` items.
    fn plan_early(
        &self,
        ahead: &mut Ahead,
        items: &[StepItem<'_, CudaSeq>],
        hit: &[bool],
        early: &[Option<InFlightHit>],
        late: &[usize],
        greedy: &[bool],
    ) -> Vec<(u64, NextStep)> {
        // a late row's next step goes with its late row (`LateRow::next`)
        let eligible: Vec<bool> = (0..items.len()).map(|i| greedy[i] && hit[i]).collect();
        // the argmax of the contexts that took a result resolved before (the others' comes
        // with the pass in flight)
        let argmax: Vec<Option<u32>> = (0..items.len())
            .map(|i| {
                (hit[i] && early[i].is_none())
                    .then(|| host_next_token(&items[i]))
                    .flatten()
            })
            .collect();
        let serials = note_guests(ahead, items, hit, &eligible, &argmax);
        let late_tokens: usize = late.iter().map(|&i| items[i].tokens.len()).sum();
        let mut room = self.pass.max_rows().saturating_sub(late_tokens);
        let mut picks = plan_ahead(ahead, &serials, self.depth());
        picks.truncate(room);
        room -= picks.len();
        // The contexts whose late rows are in the pass in flight (their guests wait for it,
        // so none is in this step): their next step too, its token fed on the GPU from that
        // row, so that they hit the next pass when they come back. Without it each would
        // come back to a step whose pass is already launched, run late again, and again.
        for l in ahead.in_flight.iter_mut().flat_map(|f| f.late.iter_mut()) {
            if room == 0 {
                break;
            }
            if let Some(next) = l.next.take() {
                let fed = Some(l.row);
                picks.push((l.serial, NextStep { fed, ..next }));
                room -= 1;
            }
        }
        picks.extend(take_next_after_late(ahead, room));
        picks
    }
}

/// The items that hit: those whose row is in the pass in flight advance now (their argmax
/// comes when it is resolved), those with a result resolved before take it.
fn take_hits(
    ahead: &mut Ahead,
    items: &mut [StepItem<'_, CudaSeq>],
    early: &[Option<InFlightHit>],
) -> Vec<bool> {
    take_late_results(ahead, items);
    let mut hit = vec![false; items.len()];
    for (i, item) in items.iter_mut().enumerate() {
        if let (Some(taken), None) = (&early[i], &item.error) {
            if let Ok(session) = item.seq.session_mut() {
                // its argmax comes when the pass in flight is resolved
                session.advanced_ahead_pending(taken.buffer, taken.rule.clone());
                hit[i] = true;
                ahead.counts.hits += 1;
            }
            continue;
        }
        // a result resolved in an earlier step (the context was not in the last one)
        hit[i] = take_result(ahead, item);
    }
    hit
}

/// With the pass in flight resolved: the rows of the pass just launched that were fed from
/// it learn their tokens, the items that took its rows their argmax, and the new pass becomes
/// the one in flight.
fn hand_out_in_flight(
    ahead: &mut Ahead,
    items: &mut [StepItem<'_, CudaSeq>],
    hit: &[bool],
    early: &[Option<InFlightHit>],
    mut next: Option<InFlight>,
) {
    for row in next.iter_mut().flat_map(|n| n.rows.iter_mut()) {
        if !row.fed {
            continue;
        }
        let before = row.position.checked_sub(1).map(|p| (row.serial, p));
        let token = match before.and_then(|at| ahead.results.get(&at)) {
            Some(result) => Some(result.argmax),
            None => ahead.late_argmax.get(&row.serial).copied().flatten(),
        };
        if let Some(token) = token {
            // the pass drew its key after the token's edit too
            (row.token, row.fed) = (token, false);
            row.rule = row.rule.take().map(|rule| rule.after(token));
        }
    }
    for (i, item) in items.iter_mut().enumerate() {
        let Some(taken) = early[i].as_ref().filter(|_| hit[i]) else {
            continue;
        };
        let result = ahead.results.remove(&(item.seq.serial, taken.position));
        match (result, item.seq.session_mut()) {
            (Some(result), Ok(session)) => session.set_argmax(result.argmax),
            _ => item.error = Some(EngineError::device("the batched step failed")),
        }
    }
    if let Some(mut n) = next {
        // rows whose token stayed unknown are no guess for anyone
        n.rows.retain(|r| !r.fed);
        ahead.in_flight = Some(n);
    }
}

//! The run-ahead layer's decisions, as functions of its state and the step's items: which
//! items take a result run ahead for them, which contexts get which step run ahead (at which
//! position, with which token, into which logits buffer), and whether a step may launch its
//! pass before the pass in flight ends.

use super::state::{Ahead, AheadResult, AheadRow, GuestState, InFlightHit, NextStep, RowTargets};
use crate::cuda::batch::contexts::CudaSeq;
use crate::cuda::batch::pass::Pass;
use crate::cuda::session::LOGITS_BUFFERS;
use crate::engine::batch::{SeqState, StepItem};
use crate::engine::processing::DrawnBy;
use crate::engine::{EngineError, Session};
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::atomic::Ordering;

/// The first `room` follows (see [`Ahead::next_after_late`]), taken out; the rest stay for a later pass.
pub(crate) fn take_next_after_late(ahead: &mut Ahead, room: usize) -> Vec<(u64, NextStep)> {
    let serials: Vec<u64> = ahead.next_after_late.keys().take(room).copied().collect();
    (serials.into_iter())
        .filter_map(|serial| Some((serial, ahead.next_after_late.remove(&serial)?)))
        .collect()
}

/// Whether this step may launch its pass run ahead before the pass in flight has ended
/// (see [`super::early`]): there is one, some contexts came back with the
/// token run ahead for them (in that pass, or resolved before), every other item is rows
/// of the batched step (nothing on a session's own stream, which the pass in flight may
/// still be writing), no context's late rows are in it (their guests read them first),
/// and everything fits one pass. Then, for each item, the row of the pass in flight whose
/// results it takes.
pub(crate) fn early_hits(
    ahead: &Ahead,
    items: &[StepItem<'_, CudaSeq>],
    pass: &Pass,
) -> Result<Vec<Option<InFlightHit>>, &'static str> {
    let batched_prompt = pass.batched_prompt();
    let flight = ahead.in_flight.as_ref().ok_or("nothing in flight")?;
    // one context alone keeps its own decode step (the pass in flight is its alone)
    if let [item] = items {
        if flight.rows.iter().all(|r| r.serial == item.seq.serial) {
            return Err("one context");
        }
    }
    let rows: FxHashMap<(u64, usize), &AheadRow> = (flight.rows.iter())
        .map(|r| ((r.serial, r.position), r))
        .collect();
    let late: FxHashSet<u64> = flight.late.iter().map(|l| l.serial).collect();
    let mut total = ahead.next_after_late.len();
    let mut hits = Vec::with_capacity(items.len());
    let mut any = false;
    for item in items {
        let serial = item.seq.serial;
        if late.contains(&serial) {
            return Err("late rows in flight");
        }
        if item.tokens.len() > batched_prompt || item.all_positions {
            return Err("a prompt of its own");
        }
        total += item.tokens.len();
        let at = (serial, item.seq.len());
        let same = |token: u32| item.error.is_none() && item.first_chunk && item.tokens == [token];
        let hit = (rows.get(&at))
            .filter(|r| !r.fed && same(r.token))
            .map(|r| InFlightHit {
                position: r.position,
                buffer: r.buffer,
                rule: r.rule.clone(),
            });
        any |= hit.is_some() || ahead.results.get(&at).is_some_and(|g| same(g.token));
        hits.push(hit);
    }
    match (total <= pass.max_rows(), any) {
        (false, _) => Err("too many rows"),
        (true, false) => Err("no hits"),
        (true, true) => Ok(hits),
    }
}

/// Keep each item as this step leaves it ([`GuestState`], with `argmax[i]` its argmax when
/// known on the host); a context that did not take what was run ahead for it loses all of
/// it. Returns the contexts that may get steps run ahead: the step's, then those whose
/// guests are away with results run ahead for them (in flight or resolved) or with the
/// argmax of a result taken without a step.
pub(crate) fn note_guests(
    ahead: &mut Ahead,
    items: &[StepItem<'_, CudaSeq>],
    hit: &[bool],
    eligible: &[bool],
    argmax: &[Option<u32>],
) -> Vec<u64> {
    let mut serials = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let serial = item.seq.serial;
        if !hit[i] {
            forget_ahead(ahead, serial);
        }
        let Ok(session) = item.seq.session() else {
            ahead.guests.remove(&serial);
            continue;
        };
        let at = GuestState {
            len: session.len(),
            readable: session.readable(),
            greedy: eligible[i],
            targets: RowTargets::of(session),
            argmax: argmax[i],
            rule: item.seq.drawn_by(item.last_chunk),
        };
        ahead.guests.insert(serial, at);
        serials.push(serial);
    }
    let mine: FxHashSet<u64> = serials.iter().copied().collect();
    let mut away: Vec<u64> = (ahead.in_flight.iter())
        .flat_map(|f| f.rows.iter().map(|r| r.serial))
        .chain(ahead.results.keys().map(|&(serial, _)| serial))
        .chain((ahead.guests.iter()).filter_map(|(&serial, g)| g.argmax.map(|_| serial)))
        .filter(|serial| !mine.contains(serial))
        .collect();
    away.sort_unstable();
    away.dedup();
    serials.extend(away);
    serials
}

/// The next steps to run ahead (see "Several steps ahead" in `docs/design/batching.md`): for
/// each greedy context of `serials`, the position after the last step run ahead for it (or
/// after its guest's position), while fewer than `depth` steps are ahead of its guest and its
/// cache has room. The token is the argmax of the position before: fed on the GPU from the
/// pass in flight, or known on the host (a result resolved, or [`GuestState::argmax`]). Its
/// logits go to a buffer that neither the guest reads nor another step run ahead writes.
pub(crate) fn plan_ahead(ahead: &Ahead, serials: &[u64], depth: usize) -> Vec<(u64, NextStep)> {
    let in_flight = ahead.in_flight.as_ref().map_or(&[][..], |f| &f.rows[..]);
    plan_rows(in_flight, &ahead.results, &ahead.guests, serials, depth)
}

/// [`plan_ahead`] over the rows of the pass in flight, the results resolved and the contexts.
pub(crate) fn plan_rows(
    in_flight: &[AheadRow],
    ready: &FxHashMap<(u64, usize), AheadResult>,
    guests: &FxHashMap<u64, GuestState>,
    serials: &[u64],
    depth: usize,
) -> Vec<(u64, NextStep)> {
    let flight: FxHashMap<(u64, usize), &AheadRow> = (in_flight.iter())
        .map(|r| ((r.serial, r.position), r))
        .collect();
    let mut picks = Vec::new();
    for &serial in serials {
        let Some(guest) = guests.get(&serial).filter(|g| g.greedy) else {
            continue;
        };
        let mut busy = [false; LOGITS_BUFFERS];
        busy[guest.readable.min(LOGITS_BUFFERS - 1)] = true;
        let mut ahead_of_guest = 0;
        while ahead_of_guest < depth {
            let at = (serial, guest.len + ahead_of_guest);
            let buffer = match (flight.get(&at), ready.get(&at)) {
                (Some(row), _) => row.buffer,
                (None, Some(guess)) => guess.buffer,
                (None, None) => break,
            };
            busy[buffer.min(LOGITS_BUFFERS - 1)] = true;
            ahead_of_guest += 1;
        }
        let position = guest.len + ahead_of_guest;
        if ahead_of_guest >= depth || position >= guest.targets.capacity {
            continue;
        }
        let Some(buffer) = (0..LOGITS_BUFFERS).find(|&b| !busy[b]) else {
            continue;
        };
        // the token, and how it was drawn: by the row before (its edits after its own token)
        // or by the guest
        let before = position.checked_sub(1).map(|p| (serial, p));
        let (token, fed, rule) = match before.map(|at| (flight.get(&at), ready.get(&at))) {
            // (a row whose own token is still unknown holds the edits before it: no base; the
            // pass in flight has none today, its fed rows learn their tokens or go when it
            // is handed out, but a base must never be one)
            Some((Some(row), _)) if row.fed && matches!(row.rule, Some(DrawnBy::Edited(_))) => {
                continue
            }
            Some((Some(row), _)) => (0, Some(row.row), &row.rule),
            Some((None, Some(guess))) => (guess.argmax, None, &guess.rule),
            _ => match (ahead_of_guest, guest.argmax) {
                (0, Some(token)) => (token, None, &guest.rule),
                _ => continue,
            },
        };
        let next = NextStep {
            token,
            fed,
            position,
            targets: guest.targets.clone(),
            buffer,
            rule: rule.clone(),
        };
        picks.push((serial, next));
    }
    picks
}

/// An item's next token when known on the host: its argmax (read back if its step ran on
/// its own stream), or the token its rows drew.
pub(crate) fn host_next_token(item: &StepItem<'_, CudaSeq>) -> Option<u32> {
    let session = item.seq.session().ok()?;
    // its rows' keys are its draws; a step on its own stream took the argmax: no guess
    let Some(drawn) = item.seq.drawn_by(item.last_chunk) else {
        return session.argmax_now().ok();
    };
    (session.keys_drawn() == Some(&drawn))
        .then(|| session.drawn_known())
        .flatten()
}

/// Forget everything run ahead for a context (its guest came back with something else): its
/// results resolved, and its rows in the pass in flight (which still run, and are
/// overwritten by its next rows).
pub(crate) fn forget_ahead(ahead: &mut Ahead, serial: u64) {
    let before = ahead.results.len();
    ahead.results.retain(|&(s, _), _| s != serial);
    let mut forgot = ahead.results.len() < before;
    if let Some(flight) = ahead.in_flight.as_mut() {
        let rows = flight.rows.len();
        flight.rows.retain(|r| r.serial != serial);
        forgot |= flight.rows.len() < rows;
    }
    if forgot {
        ahead.counts.misses += 1;
    }
}

/// Whether `item` came back with the token run ahead for it at its position, resolved: then
/// it takes that result (a hit).
pub(crate) fn take_result(ahead: &mut Ahead, item: &mut StepItem<'_, CudaSeq>) -> bool {
    let at = (item.seq.serial, item.seq.len());
    let Some(guess) = ahead.results.get(&at) else {
        return false;
    };
    let same = item.tokens == [guess.token] && item.first_chunk && !item.all_positions;
    if let (true, None, Ok(session)) = (same, &item.error, item.seq.session_mut()) {
        session.advanced_ahead(guess.argmax, guess.buffer, guess.rule.clone());
        ahead.results.remove(&at);
        ahead.counts.hits += 1;
        true
    } else {
        false
    }
}

/// For each item, whether its next step may be run ahead: its guest read only the argmax
/// since its last step (a sampling guest reads logits), and this step ends its request.
pub(crate) fn may_run_ahead(items: &[StepItem<'_, CudaSeq>]) -> Vec<bool> {
    items
        .iter()
        .map(|item| {
            let sampled = item.seq.read_logits.swap(false, Ordering::Relaxed);
            item.error.is_none() && item.last_chunk && !item.all_positions && !sampled
        })
        .collect()
}

/// Contexts whose last rows ran late take their result (their guests may not have read it),
/// and need no step run ahead from outside.
pub(crate) fn take_late_results(ahead: &mut Ahead, items: &mut [StepItem<'_, CudaSeq>]) {
    for item in items.iter_mut() {
        let serial = item.seq.serial;
        ahead.next_after_late.remove(&serial);
        if !item.seq.late.swap(false, Ordering::AcqRel) {
            continue;
        }
        match (ahead.late_argmax.remove(&serial), item.seq.session_mut()) {
            (Some(Some(argmax)), Ok(session)) => session.set_argmax(argmax),
            _ => item.error = Some(EngineError::device("the batched step failed")),
        }
    }
}

/// A result run ahead and resolved for `seq`, whose guest is back with `token` at its
/// position (see "Several steps ahead" in `docs/design/batching.md`): taken at once, without a
/// step. False when there is none for that token.
pub(crate) fn take_precomputed(ahead: &mut Ahead, seq: &mut CudaSeq, token: u32) -> bool {
    let serial = seq.serial;
    let Some(session) = seq.session.as_mut().filter(|s| s.idle_own()) else {
        return false;
    };
    let at = (serial, session.len());
    let Some(result) = ahead.results.remove(&at) else {
        return false;
    };
    if result.token != token {
        ahead.results.insert(at, result);
        return false;
    }
    session.advanced_ahead(result.argmax, result.buffer, result.rule.clone());
    ahead.counts.hits += 1;
    ahead.counts.taken += 1;
    // a guest that read logits samples: no more steps run ahead for it
    let sampled = seq.read_logits.swap(false, Ordering::Relaxed);
    if let Some(guest) = ahead.guests.get_mut(&serial) {
        (guest.len, guest.readable) = (session.len(), session.readable());
        guest.greedy &= !sampled;
        // its next step may run ahead before it is back, drawn as this one was
        guest.argmax = Some(result.argmax);
        guest.rule = result.rule;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets(capacity: usize) -> RowTargets {
        RowTargets {
            k: 1,
            v: 2,
            layer_floats: 3,
            capacity,
            logits: [10, 11, 12, 13, 14],
            edits: None,
        }
    }

    fn guest(len: usize, readable: usize) -> GuestState {
        GuestState {
            len,
            readable,
            greedy: true,
            targets: targets(64),
            argmax: None,
            rule: None,
        }
    }

    fn row(serial: u64, position: usize, row: usize, buffer: usize) -> AheadRow {
        AheadRow {
            serial,
            position,
            token: 5,
            fed: false,
            row,
            buffer,
            rule: None,
        }
    }

    fn guess(argmax: u32, buffer: usize) -> AheadResult {
        AheadResult {
            token: 5,
            argmax,
            buffer,
            rule: None,
        }
    }

    /// The step planned for context 7 (at most one), with `known` its argmax after its step.
    fn plan_7(
        in_flight: &[AheadRow],
        ready: &[((u64, usize), AheadResult)],
        mut guest: GuestState,
        known: Option<u32>,
        depth: usize,
    ) -> Option<NextStep> {
        let ready: FxHashMap<(u64, usize), AheadResult> = ready.iter().cloned().collect();
        guest.argmax = guest.argmax.or(known);
        let guests: FxHashMap<u64, GuestState> = [(7, guest)].into_iter().collect();
        let mut plan = plan_rows(in_flight, &ready, &guests, &[7], depth);
        assert!(plan.len() <= 1, "one step a context");
        plan.pop().map(|(serial, next)| {
            assert_eq!(serial, 7);
            next
        })
    }

    #[test]
    fn a_guest_not_back_gets_its_second_step_ahead_fed_from_its_row_in_flight() {
        // context 7's guest is at 10, its step at 10 is in flight (row 3, buffer 1)
        let in_flight = [row(7, 10, 3, 1)];
        let next = plan_7(&in_flight, &[], guest(10, 0), None, 2).expect("a step");
        assert_eq!((next.position, next.fed), (11, Some(3)));
        // neither the buffer the guest reads nor the one the step in flight writes
        assert_eq!(next.buffer, 2);
        assert_eq!(next.rows(next.drawn()).logits, 12);
        // one step ahead at most: nothing
        assert!(plan_7(&in_flight, &[], guest(10, 0), None, 1).is_none());
    }

    #[test]
    fn no_third_step_runs_ahead_of_a_guest() {
        // its step at 10 resolved, at 11 in flight: two ahead already
        let in_flight = [row(7, 11, 0, 1)];
        let ready = [((7, 10), guess(40, 0))];
        assert!(plan_7(&in_flight, &ready, guest(10, 2), None, 2).is_none());
        // both resolved: still two ahead
        let ready = [((7, 10), guess(40, 0)), ((7, 11), guess(41, 1))];
        assert!(plan_7(&[], &ready, guest(10, 2), None, 2).is_none());
    }

    #[test]
    fn at_depth_three_a_guest_two_behind_gets_a_third_step_in_the_last_free_buffer() {
        // the guest reads buffer 2; 10 resolved (buffer 0), 11 in flight (row 4, buffer 1)
        let in_flight = [row(7, 11, 4, 1)];
        let ready = [((7, 10), guess(40, 0))];
        let next = plan_7(&in_flight, &ready, guest(10, 2), None, 3).expect("a step");
        assert_eq!((next.position, next.fed, next.buffer), (12, Some(4), 3));
        // three ahead: no fourth, however many buffers are free
        let in_flight = [row(7, 12, 4, 3)];
        let ready = [((7, 10), guess(40, 0)), ((7, 11), guess(41, 1))];
        assert!(plan_7(&in_flight, &ready, guest(10, 2), None, 3).is_none());
    }

    #[test]
    fn a_step_ahead_takes_the_argmax_of_the_step_before_it() {
        // resolved at 10 (argmax 40, buffer 1): the next is at 11 with token 40, buffer 0
        let ready = [((7, 10), guess(40, 1))];
        let next = plan_7(&[], &ready, guest(10, 2), None, 2).expect("a step");
        assert_eq!(
            (next.position, next.token, next.fed, next.buffer),
            (11, 40, None, 0)
        );
        // nothing ahead: the item's own argmax, at its position
        let next = plan_7(&[], &[], guest(10, 2), Some(33), 2).expect("a step");
        assert_eq!((next.position, next.token, next.buffer), (10, 33, 0));
        // and without it (a guest away with nothing run ahead), no step
        assert!(plan_7(&[], &[], guest(10, 2), None, 2).is_none());
        // unless it took a result without a step: that result's argmax
        let mut took = guest(10, 2);
        took.argmax = Some(34);
        let next = plan_7(&[], &[], took, None, 2).expect("a step");
        assert_eq!((next.position, next.token), (10, 34));
    }

    #[test]
    fn no_step_ahead_past_the_cache_or_for_a_sampling_guest() {
        let mut full = guest(63, 0);
        full.targets = targets(64);
        assert!(plan_7(&[row(7, 63, 0, 1)], &[], full, None, 2).is_none());
        let mut sampling = guest(10, 0);
        sampling.greedy = false;
        assert!(plan_7(&[], &[], sampling, Some(33), 2).is_none());
    }

    /// A guest that draws its tokens gets steps run ahead with the token its rows drew, and
    /// the step carries its rule, so that the pass draws that step's next token too.
    #[test]
    fn a_drawing_guest_runs_ahead_with_its_draw_and_rule() {
        let rule = crate::engine::draw::DrawRule {
            temperature: 0.8,
            top_p: 0.95,
            seed: 9,
            min_p: 0.0,
        };
        let mut drawing = guest(10, 2);
        drawing.rule = Some(DrawnBy::Rule(rule));
        let next = plan_7(&[], &[], drawing, Some(33), 2).expect("a step");
        assert_eq!((next.token, &next.rule), (33, &Some(DrawnBy::Rule(rule))));
        assert_eq!(next.rows(next.drawn()).rule, Some(rule));
        assert!(next.rows(next.drawn()).edited.is_none());
    }

    /// A guest that draws after a processing with penalties gets steps run ahead whose edits
    /// follow their tokens: made on the host where the token is known, and left to the pass
    /// (the edits before the token, `follow`) where it is fed on the GPU.
    #[test]
    fn a_processed_draw_runs_ahead_with_its_edits_following_the_tokens() {
        use crate::engine::processing::{EditedRule, Processing};
        use std::sync::Arc;
        let rule = crate::engine::draw::DrawRule {
            temperature: 1.0,
            top_p: 0.9,
            seed: 3,
            min_p: 0.0,
        };
        let processing = Processing::new((0.5, 0.25, 1.0), &[7], &[2.0], 2, 64).expect("valid");
        let sequence = [1, 2, 33, 4];
        let edits_of = |s: &[u32]| processing.edits(s).expect("edits").expect("distinct");
        let at_guest = Arc::new(EditedRule {
            rule,
            edits: edits_of(&sequence),
        });
        let mut drawing = guest(4, 2);
        drawing.rule = Some(DrawnBy::Edited(at_guest.clone()));
        // the guest's own draw (33) known: the step's edits are the longer sequence's
        let next = plan_7(&[], &[], drawing, Some(33), 2).expect("a step");
        let rows = next.rows(next.drawn());
        let longer = edits_of(&[1, 2, 33, 4, 33]);
        assert_eq!(rows.edited.as_ref().map(|e| &e.edits), Some(&longer));
        assert_eq!((rows.rule, rows.follow), (Some(rule), false));
        // its step at 4 in flight, drawn after 33: the next step is fed from that row, its
        // edits those of the row before its token, which the pass makes follow it
        let mut in_flight = row(7, 4, 3, 0);
        in_flight.rule = next.drawn();
        let mut waiting = guest(4, 2);
        waiting.rule = Some(DrawnBy::Edited(at_guest));
        let fed = plan_7(&[in_flight], &[], waiting, None, 2).expect("a step");
        let rows = fed.rows(fed.drawn());
        assert_eq!((fed.position, fed.fed, rows.follow), (5, Some(3), true));
        assert_eq!(rows.edited.as_ref().map(|e| &e.edits), Some(&longer));
        // once the fed token is known (12), the row was drawn after it too
        let known = fed.drawn().map(|d| d.after(12));
        let twelve = edits_of(&[1, 2, 33, 4, 33, 12]);
        assert_eq!(
            known,
            Some(DrawnBy::Edited(Arc::new(EditedRule {
                rule,
                edits: twelve
            })))
        );
    }
}

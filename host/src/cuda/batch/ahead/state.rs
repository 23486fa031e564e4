//! The run-ahead layer's state: the rows of the pass in flight, the results kept until their
//! guests come back, and each context as its last step left it.

use super::clock::PassClock;
use crate::cuda::batch::pass::Rows;
use crate::cuda::buffer::HostCopy;
use crate::cuda::ops::matvec::argmax_row;
use crate::cuda::session::{CudaSession, ResidentEdits, LOGITS_BUFFERS};
use crate::engine::processing::DrawnBy;
use cudarc::driver::CudaEvent;
use rustc_hash::FxHashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A row of a step run ahead: which context, at which position, with which token.
pub(crate) struct AheadRow {
    pub(crate) serial: u64,
    pub(crate) position: usize,
    pub(crate) token: u32,
    /// The token is fed on the GPU and not known yet (see [`NextStep::fed`]).
    pub(crate) fed: bool,
    /// The row of the batched pass.
    pub(crate) row: usize,
    /// The session's logits buffer it writes.
    pub(crate) buffer: usize,
    /// How its key was drawn (None: the argmax). While `fed`, a rule's edits are those before
    /// the token, which the pass made follow it ([`NextStep::drawn`]).
    pub(crate) rule: Option<DrawnBy>,
}

/// Where a context's rows go: what a row run ahead for it needs without its session.
#[derive(Clone)]
pub(crate) struct RowTargets {
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) layer_floats: usize,
    pub(crate) capacity: usize,
    pub(crate) logits: [u64; LOGITS_BUFFERS],
    /// The context's edits on the GPU, for a processed draw (None only in tests without one).
    pub(crate) edits: Option<Arc<ResidentEdits>>,
}

impl RowTargets {
    pub(crate) fn of(session: &CudaSession) -> Self {
        let (k, v, _) = session.row_addresses();
        Self {
            k,
            v,
            layer_floats: session.layer_floats(),
            capacity: session.capacity(),
            logits: std::array::from_fn(|b| session.logits_at(b)),
            edits: Some(session.resident_edits().clone()),
        }
    }
}

/// A context as its last step left it, for steps run ahead while its guest is away.
pub(crate) struct GuestState {
    /// Its guest's position (the rows run ahead start there).
    pub(crate) len: usize,
    /// The logits buffer its guest reads.
    pub(crate) readable: usize,
    /// Steps may be run ahead for it (its guest reads only the argmax).
    pub(crate) greedy: bool,
    pub(crate) targets: RowTargets,
    /// The argmax of its guest's last position when known on the host (after its step, or a
    /// result its guest took without one): the token of the step after it.
    pub(crate) argmax: Option<u32>,
    /// How its guest draws its tokens, at its position: the keys of its rows are the draws,
    /// and `argmax` is the token drawn (None: the argmax).
    pub(crate) rule: Option<DrawnBy>,
}

/// A context's rows in a pass run ahead whose step did not wait for them (see the module
/// docs): its guest reads their result once the pass is resolved.
pub(crate) struct LateRow {
    pub(crate) serial: u64,
    /// The row of its last token.
    pub(crate) row: usize,
    /// Its next step, to run ahead with the argmax (a greedy context with room left).
    pub(crate) next: Option<NextStep>,
}

/// A context's next step to run ahead: one token at its next position, its logits into the
/// buffer its guest is not reading. InFlightHit from its session by the step launching it, or kept
/// for a context whose rows ran late and that is not in that step.
pub(crate) struct NextStep {
    pub(crate) token: u32,
    /// The token is the argmax of this row of the pass launched before, fed on the GPU (that
    /// pass was not resolved when this one was launched; `token` is set once it is).
    pub(crate) fed: Option<usize>,
    pub(crate) position: usize,
    pub(crate) targets: RowTargets,
    /// The logits buffer it writes: neither the one its guest reads nor one another step run
    /// ahead for it writes.
    pub(crate) buffer: usize,
    /// How this step's token was drawn (None: the argmax): this step's draw is the same, its
    /// edits following this step's token.
    pub(crate) rule: Option<DrawnBy>,
}

impl NextStep {
    /// How its row's key is drawn: the rule, its edits after the step's token; or, the token
    /// fed on the GPU and not known yet, the edits before it, which the pass makes follow it.
    pub(crate) fn drawn(&self) -> Option<DrawnBy> {
        match (&self.rule, self.fed) {
            (Some(rule), None) => Some(rule.after(self.token)),
            (rule, _) => rule.clone(),
        }
    }

    /// Its rows, drawn as `drawn` says ([`Self::drawn`], which the caller keeps for the row's
    /// record too: edits after a token are a copy).
    pub(crate) fn rows(&self, drawn: Option<DrawnBy>) -> Rows<'_> {
        let (rule, edited) = match drawn {
            Some(DrawnBy::Rule(rule)) => (Some(rule), None),
            Some(DrawnBy::Edited(edited)) => (Some(edited.rule), Some(edited)),
            None => (None, None),
        };
        Rows {
            k: self.targets.k,
            v: self.targets.v,
            logits: self.targets.logits[self.buffer],
            start: self.position,
            tokens: std::slice::from_ref(&self.token),
            fed: self.fed,
            layer_floats: self.targets.layer_floats,
            rule,
            follow: self.fed.is_some() && edited.is_some(),
            resident: edited.as_ref().and(self.targets.edits.clone()),
            edited,
            chunk: false,
        }
    }
}

/// A step run ahead that is launched and not yet waited for.
pub(crate) struct InFlight {
    /// Which pass (counted from 1), to tell it from a later one.
    pub(crate) id: u64,
    pub(crate) rows: Vec<AheadRow>,
    pub(crate) late: Vec<LateRow>,
    /// Rows of the pass (its argmax keys to read).
    pub(crate) n: usize,
    pub(crate) launched: Instant,
    /// The copy of its argmax keys to the host, queued right behind it.
    pub(crate) keys: HostCopy<u64>,
    /// Events around it on the GPU (for its time in the trace), when they could be made.
    pub(crate) timing: Option<(CudaEvent, CudaEvent)>,
}

/// The result of a step run ahead for one context (at the position it is kept under), kept
/// until its guest comes back to that position.
#[derive(Clone)]
pub(crate) struct AheadResult {
    pub(crate) token: u32,
    /// The next token: the argmax, or the draw as `rule` says.
    pub(crate) argmax: u32,
    pub(crate) buffer: usize,
    pub(crate) rule: Option<DrawnBy>,
}

/// An item's row in the pass in flight, which it takes (see [`CudaBatch::early_hits`]).
#[derive(Clone)]
pub(crate) struct InFlightHit {
    pub(crate) position: usize,
    pub(crate) buffer: usize,
    pub(crate) rule: Option<DrawnBy>,
}

/// What the run-ahead layer keeps between steps (under [`RunAhead`]'s lock).
#[derive(Default)]
pub(crate) struct Ahead {
    pub(crate) in_flight: Option<InFlight>,
    /// Results run ahead, by context and position.
    pub(crate) results: FxHashMap<(u64, usize), AheadResult>,
    /// Each context as its last step left it.
    pub(crate) guests: FxHashMap<u64, GuestState>,
    /// The argmax of late rows resolved, until their context's next step (None: the pass
    /// failed).
    pub(crate) late_argmax: FxHashMap<u64, Option<u32>>,
    /// Steps to run ahead, with the next pass, for contexts whose late rows were resolved.
    pub(crate) next_after_late: FxHashMap<u64, NextStep>,
    /// When passes ran on the GPU, and how long a step takes to launch one.
    pub(crate) clock: PassClock,
    /// Host buffers for passes' argmax keys, kept for the next passes.
    pub(crate) reusable_keys: Vec<HostCopy<u64>>,
    pub(crate) counts: AheadCounters,
}

/// What running ahead achieved, for the trace and the metrics.
#[derive(Default)]
pub(crate) struct AheadCounters {
    /// Contexts that came back with the guessed token, and those that did not.
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    /// Rows that ran late.
    pub(crate) late: u64,
    /// Passes launched before the pass in flight had ended.
    pub(crate) early: u64,
    /// Results taken without a step ([`crate::engine::batch::BatchModel::take_precomputed`]).
    pub(crate) taken: u64,
    /// Passes run ahead so far (the last one's [`InFlight::id`]).
    pub(crate) flights: u64,
}

/// The run-ahead state of one batcher, shared by its steps and its contexts (a context reads
/// the results of its late rows, and takes its rows out of the pass in flight when dropped).
/// Lock order: this, then the pass's buffers.
#[derive(Default)]
pub(crate) struct RunAhead {
    state: Mutex<Ahead>,
}

impl RunAhead {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Ahead> {
        // plain bookkeeping, consistent even if a holder panicked
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lock, once the pass in flight has ended if `holds` it (a pass with this caller's
    /// rows), and with that pass resolved. The wait itself is outside the lock: the next
    /// step may launch its pass before the one in flight ends (see [`super::early`]) only while
    /// that pass is still in flight for it to resolve.
    pub(crate) fn wait_for_pass(&self, holds: impl Fn(&InFlight) -> bool) -> MutexGuard<'_, Ahead> {
        let ahead = self.lock();
        let Some((id, done)) = (ahead.in_flight.as_ref())
            .filter(|f| holds(f))
            .map(|f| (f.id, f.keys.done()))
        else {
            return ahead;
        };
        drop(ahead);
        // an error shows when the pass is resolved
        let _ = wait_idle(&done);
        let mut ahead = self.lock();
        if ahead.in_flight.as_ref().is_some_and(|f| f.id == id) {
            // it has ended: resolving it does not wait
            ahead.resolve();
        }
        ahead
    }
}

impl Ahead {
    /// Wait for the pass run ahead, if one is under way, and keep its results: the results
    /// for the contexts' next steps, the late rows' argmax for their contexts to read (and
    /// their next step, to run ahead with the next pass).
    pub(crate) fn resolve(&mut self) {
        let Some(flight) = self.in_flight.take() else {
            return;
        };
        let waited = Instant::now();
        // the copy of the pass's keys (queued behind it; a pass launched after it may be
        // running already)
        let keys = flight.keys.wait();
        (self.clock).resolved(flight.launched, waited.elapsed(), flight.timing);
        self.reusable_keys.push(flight.keys);
        let keys = match keys {
            Ok(keys) => keys,
            Err(e) => {
                tracing::warn!("a step run ahead failed: {e}");
                for late in flight.late {
                    self.late_argmax.insert(late.serial, None);
                }
                return;
            }
        };
        let key = |row: usize| argmax_row(keys.get(row).copied().unwrap_or(0));
        for r in flight.rows {
            let result = AheadResult {
                token: r.token,
                argmax: key(r.row),
                buffer: r.buffer,
                rule: r.rule,
            };
            self.results.insert((r.serial, r.position), result);
        }
        for late in flight.late {
            let argmax = key(late.row);
            self.late_argmax.insert(late.serial, Some(argmax));
            if let Some(mut next) = late.next {
                next.token = argmax;
                self.next_after_late.insert(late.serial, next);
            }
        }
    }
}

/// Wait for `done` without keeping a core busy (the event spins in `synchronize`): the waiter
/// is a guest's thread or a closing context, beside the guests and the steps on the same
/// cores, and ~0.1 ms more for it is nothing beside a pass.
pub(crate) fn wait_idle(done: &CudaEvent) -> Result<(), cudarc::driver::DriverError> {
    done.context().bind_to_thread()?;
    while !done.try_is_complete()? {
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(())
}

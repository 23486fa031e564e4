//! Running ahead: the steps a batched step launches for its greedy contexts before their
//! guests come back (`docs/design/batching.md` tells the whole story, with a state diagram).
//!
//! A layer over the batched pass: [`state`] is what it keeps between steps, [`plan`] decides
//! (pure functions over that state: which contexts get which step, which items take which
//! result), [`launch`] and [`early`] put the plan on the GPU, [`clock`] times the passes so
//! that the next step knows how long to wait for its contexts. [`RunAhead`] holds the state
//! under one lock; [`Ahead::resolve`] turns a finished pass into results.

pub(crate) mod clock;
pub(crate) mod early;
pub(crate) mod launch;
pub(crate) mod plan;
pub(crate) mod state;

use crate::cuda::ops::matvec::argmax_row;
use cudarc::driver::CudaEvent;
use state::{Ahead, AheadResult, InFlight};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
    /// step may launch its pass before the one in flight ends (see [`early`]) only while
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

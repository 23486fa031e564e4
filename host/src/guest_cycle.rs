//! Where a guest's token cycle goes, summed over every execution context of the process: the
//! forward pass it waited for (batching included), bringing its logits back from the device,
//! encoding them as a wasi-nn tensor, and the guest's own time between its calls on the context
//! (sampling, tokenizing, streaming out, copying outputs into its memory).
//!
//! Plain atomic totals, cheap enough for every call and free of any metrics library: the
//! service exports them on `/metrics` (`wasi_nn_cycle_*`), and a benchmark reads the
//! difference over its run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A part of the cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// `compute`'s forward pass: queued, batched with other contexts, run, waited for.
    Step,
    /// The last logits brought from the device to the host.
    ReadLogits,
    /// Logits turned into a wasi-nn tensor's bytes.
    Encode,
    /// A sampled token drawn where the logits are (output 4), brought back.
    Draw,
    /// The guest's own time between two of its calls on one context.
    Guest,
}

impl Part {
    pub const ALL: [Part; 5] = [
        Part::Step,
        Part::ReadLogits,
        Part::Encode,
        Part::Draw,
        Part::Guest,
    ];

    /// The name of the part on `/metrics` and in benchmark reports.
    pub fn name(self) -> &'static str {
        match self {
            Part::Step => "step",
            Part::ReadLogits => "read_logits",
            Part::Encode => "encode",
            Part::Draw => "draw",
            Part::Guest => "guest",
        }
    }
}

struct Total {
    count: AtomicU64,
    nanos: AtomicU64,
}

static TOTALS: [Total; Part::ALL.len()] = [const {
    Total {
        count: AtomicU64::new(0),
        nanos: AtomicU64::new(0),
    }
}; Part::ALL.len()];

/// Add one `part` of `took`.
pub fn record(part: Part, took: Duration) {
    let total = &TOTALS[part as usize];
    total.count.fetch_add(1, Ordering::Relaxed);
    let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
    total.nanos.fetch_add(nanos, Ordering::Relaxed);
}

/// `f`, timed as one `part`.
pub fn timed<R>(part: Part, f: impl FnOnce() -> R) -> R {
    let started = Instant::now();
    let out = f();
    record(part, started.elapsed());
    out
}

/// How often `part` was recorded, and its total time in seconds, so far.
pub fn total(part: Part) -> (u64, f64) {
    let total = &TOTALS[part as usize];
    let nanos = total.nanos.load(Ordering::Relaxed);
    (total.count.load(Ordering::Relaxed), nanos as f64 * 1e-9)
}

/// One context's clock of its guest's own time: the time from the return of one call on the
/// context to the start of the next counts as [`Part::Guest`].
#[derive(Debug, Default)]
pub struct GuestClock {
    returned: Option<Instant>,
}

impl GuestClock {
    /// A call on the context starts.
    pub fn called(&mut self) {
        if let Some(at) = self.returned.take() {
            record(Part::Guest, at.elapsed());
        }
    }

    /// The call returns to the guest.
    pub fn returned(&mut self) {
        self.returned = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_add_up_and_the_guest_clock_counts_between_calls() {
        let (count, seconds) = total(Part::Encode);
        record(Part::Encode, Duration::from_millis(3));
        record(Part::Encode, Duration::from_millis(2));
        let (after, after_seconds) = total(Part::Encode);
        // other tests may record too: at least ours are there
        assert!(after >= count + 2);
        assert!(after_seconds - seconds >= 0.005 - 1e-9);

        let (guest, _) = total(Part::Guest);
        let mut clock = GuestClock::default();
        clock.called(); // no call returned before: nothing to count
        clock.returned();
        std::thread::sleep(Duration::from_millis(2));
        clock.called();
        let (guest_after, _) = total(Part::Guest);
        assert!(guest_after > guest);
    }
}

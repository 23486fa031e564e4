//! The run-ahead layer's clock: when the passes run ahead ran on the GPU (events around each,
//! read once the pass is resolved), how long a step takes to launch one, and from these how
//! long the next step may wait for the last step's contexts.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Events around one pass on the GPU: its begin and its end.
pub(crate) type PassEvents = (CudaEvent, CudaEvent);

#[derive(Default)]
pub(crate) struct PassClock {
    /// How long the last pass run ahead took from its launch, as the step that waited for it
    /// saw it.
    pub(crate) took: Duration,
    /// When the last pass run ahead was resolved (it had ended by then).
    pub(crate) resolved: Option<Instant>,
    /// The GPU time of the last pass resolved, between its events: what the batched pass
    /// itself costs, for the trace.
    pub(crate) gpu_time: Duration,
    /// The GPU's time from the end of the pass resolved before it to the begin of the last
    /// one (other work, or the GPU waiting for the host), for the trace.
    pub(crate) gpu_gap: Duration,
    /// The last resolved pass's events (its end is where the next one's gap begins).
    last_events: Option<PassEvents>,
    /// Event pairs of passes resolved, kept for the next passes.
    reusable_events: Vec<PassEvents>,
    /// How long a step takes to launch its pass run ahead, averaged.
    pub(crate) launch: Duration,
}

impl PassClock {
    /// A pair of events to time a pass on `stream` with: a kept one, or new ones (None when
    /// there is no stream yet or no event could be made; the pass then goes untimed).
    pub(crate) fn events(&mut self, stream: Option<&Arc<CudaStream>>) -> Option<PassEvents> {
        if let Some(pair) = self.reusable_events.pop() {
            return Some(pair);
        }
        let stream = stream?;
        let make = || {
            stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        };
        make().and_then(|a| Ok((a, make()?))).ok()
    }

    /// A pass launched at `launched` was resolved just now, after waiting `waited` for its
    /// results; `events` were recorded around it. Both events are behind the results just
    /// read: reading them does not wait.
    pub(crate) fn resolved(
        &mut self,
        launched: Instant,
        waited: Duration,
        events: Option<PassEvents>,
    ) {
        // the pass ended while we waited: its time is known
        if waited > Duration::from_micros(20) {
            self.took = launched.elapsed();
        }
        // (or earlier: the pass after it began no later than now)
        self.resolved = Some(Instant::now());
        let span = |from: &CudaEvent, to: &CudaEvent| {
            from.elapsed_ms(to).map_or(Duration::ZERO, |ms| {
                Duration::from_secs_f32(ms.max(0.0) / 1e3)
            })
        };
        let last = self.last_events.take();
        self.gpu_gap = Duration::ZERO;
        if let Some((begin, end)) = &events {
            self.gpu_time = span(begin, end);
            if let Some((_, last_end)) = &last {
                self.gpu_gap = span(last_end, begin);
            }
        }
        self.reusable_events.extend(last);
        self.last_events = events;
    }

    /// A step launched its pass run ahead `took` after it began.
    pub(crate) fn launched(&mut self, took: Duration) {
        self.launch = (self.launch * 7 + took.min(Duration::from_millis(1))) / 8;
    }

    /// How long from now the next step may wait for the last step's contexts, with a pass
    /// launched at `launched` in flight: until shortly before that pass is expected to end,
    /// by the time a step takes to launch its pass and `margin` more (waking the step's
    /// thread). The pass began at its launch, or when the pass before it ended, whichever came
    /// later, and takes about as long on the GPU as the last pass resolved. Without a margin
    /// (or before any pass was timed), up to the pass's time from launch to end.
    pub(crate) fn gather_window(&self, launched: Instant, margin: Option<Duration>) -> Duration {
        let Some(margin) = margin else {
            return self.took;
        };
        if self.gpu_time.is_zero() {
            return self.took;
        }
        let began = self.resolved.map_or(launched, |r| r.max(launched));
        let end = began + self.gpu_time;
        end.saturating_duration_since(Instant::now() + margin + self.launch)
    }
}

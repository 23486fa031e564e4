//! Choosing a product's algorithm by timing it. cuBLASLt's heuristic guesses from the shape
//! alone; for the batched pass's products (a few hundred rows against weights of thousands)
//! its guess can leave much of the GPU idle, and the pass runs each shape hundreds of times a
//! second. So the pass, once it has captured its graphs and so met every shape, times the
//! heuristic's first candidates on its own buffers, keeps the fastest, and captures the
//! graphs again.

use super::{Lt, Plan, Shape};
use crate::cuda::error::CudaError;
use cudarc::driver::{sys::CUevent_flags, CudaStream};
use std::sync::Arc;

/// The heuristic's candidates timed for a shape.
const CANDIDATES: usize = 12;
/// Rounds over the candidates; a candidate's time is its median round.
const ROUNDS: usize = 3;
/// Another candidate replaces the heuristic's first only when it is at least this much
/// faster: a near tie is kept as the heuristic has it, so that timing noise does not decide
/// which algorithm (and so which rounding) a shape gets.
const MARGIN: f64 = 0.97;

/// What timing one shape's candidates found (microseconds a product).
#[derive(Clone, Copy, Debug)]
pub struct Tuned {
    pub shape: Shape,
    /// Candidates the heuristic gave and were timed.
    pub candidates: usize,
    /// The heuristic's first candidate.
    pub heuristic_us: f64,
    /// The one kept, and its place in the heuristic's order (0: its first).
    pub kept_us: f64,
    pub kept: usize,
}

impl Lt {
    /// Time the heuristic's first candidates for `shape` on `stream` with the product's own
    /// operands, `runs` products a round, and keep the fastest as the shape's plan. None when
    /// cuBLASLt has no algorithm for it, or the shape accumulates (timing would add to its
    /// output). The stream is synchronised.
    ///
    /// # Safety
    /// As [`Lt::matmul`]; the output is scratch that nothing reads until it is written again.
    pub(crate) unsafe fn tune(
        &self,
        stream: &Arc<CudaStream>,
        shape: Shape,
        operands: (u64, u64, u64, u64),
        runs: usize,
    ) -> Result<Option<Tuned>, CudaError> {
        if shape.accumulate {
            return Ok(None);
        }
        let Some(mut plan) = Plan::describe(shape) else {
            return Ok(None);
        };
        let algos = plan.candidates(self.handle, self.workspace.1, CANDIDATES);
        if algos.is_empty() {
            return Ok(None);
        }
        let cu = stream.cu_stream() as _;
        let mut enqueuers: Vec<_> = (algos.iter())
            .map(|algo| {
                let plan = &plan;
                move || {
                    // SAFETY: the caller vouches for the operands; `plan` is ours alone.
                    unsafe { self.enqueue(cu, plan, algo, shape, operands) }
                }
            })
            .collect();
        let times = time_products(stream, runs, &mut enqueuers)?;
        drop(enqueuers);
        // a candidate that could not be timed counts as never finishing
        let medians: Vec<f64> = (times.iter()).map(|t| t.unwrap_or(f64::INFINITY)).collect();
        if !medians.iter().any(|m| m.is_finite()) {
            return Ok(None);
        }
        let (kept, kept_us) = choose(&medians);
        plan.algo = algos[kept];
        let mut cache = self.plans.lock()?;
        cache.tuned.insert(shape, plan.algo);
        cache.plans.insert(shape, Some(plan));
        Ok(Some(Tuned {
            shape,
            candidates: algos.len(),
            heuristic_us: medians[0],
            kept_us,
            kept,
        }))
    }
}

/// Each of `enqueuers` called `runs` times into a captured graph; the graphs launched in
/// turn for [`ROUNDS`] rounds after one that warms them up, each launch between two events:
/// each one's median round in microseconds a product. The products run back to back on the
/// GPU as a pass's do in its graph, so the host's cost of enqueuing them is not timed. None for
/// one whose capture failed or that declined (returned false). Each launch is waited for.
pub fn time_products(
    stream: &Arc<CudaStream>,
    runs: usize,
    enqueuers: &mut [impl FnMut() -> Result<bool, CudaError>],
) -> Result<Vec<Option<f64>>, CudaError> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let timing =
        |e: &dyn std::fmt::Display| CudaError::unavailable(format!("timing a product: {e}"));
    let runs = runs.max(1);
    let mut graphs = Vec::with_capacity(enqueuers.len());
    for enqueue in enqueuers.iter_mut() {
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| timing(&e))?;
        let mut ran = Ok(true);
        for _ in 0..runs {
            ran = enqueue();
            if !matches!(ran, Ok(true)) {
                break;
            }
        }
        // the capture is ended whatever the enqueues did
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        graphs.push(match (ran, graph) {
            (Ok(true), Ok(graph)) => graph,
            _ => None,
        });
    }
    let event = || {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| timing(&e))
    };
    let mut rounds = vec![Vec::with_capacity(ROUNDS); graphs.len()];
    for round in 0..=ROUNDS {
        for (times, graph) in rounds.iter_mut().zip(&graphs) {
            let Some(graph) = graph else { continue };
            let start = event()?;
            graph.launch().map_err(|e| timing(&e))?;
            let end = event()?;
            let ms = start.elapsed_ms(&end).map_err(|e| timing(&e))?;
            if round > 0 {
                times.push(f64::from(ms) * 1e3 / runs as f64);
            }
        }
    }
    Ok((rounds.iter_mut().zip(&graphs))
        .map(|(times, graph)| graph.as_ref().map(|_| median(times)))
        .collect())
}

fn median(times: &mut [f64]) -> f64 {
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(f64::INFINITY)
}

/// The candidate to keep from each one's time, the heuristic's first at index 0: the
/// fastest, unless it is within [`MARGIN`] of the first.
fn choose(times: &[f64]) -> (usize, f64) {
    let Some(&first) = times.first() else {
        return (0, f64::INFINITY);
    };
    let (best, best_us) = (times.iter().copied().enumerate())
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, first));
    match best_us < first * MARGIN {
        true => (best, best_us),
        false => (0, first),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heuristics_first_is_kept_unless_another_is_clearly_faster() {
        assert_eq!(choose(&[10.0, 9.8, 11.0]), (0, 10.0));
        assert_eq!(choose(&[10.0, 9.0, 9.5]), (1, 9.0));
        assert_eq!(choose(&[10.0, 12.0, 8.0]), (2, 8.0));
        assert_eq!(choose(&[10.0]), (0, 10.0));
        assert_eq!(choose(&[]).0, 0);
    }

    #[test]
    fn a_median_of_an_odd_or_even_count() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0]), 4.0);
        assert!(median(&mut []).is_infinite());
    }
}

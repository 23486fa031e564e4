//! Choosing a product's algorithm by timing it. cuBLASLt's heuristic guesses from the shape
//! alone; for the batched pass's products (a few hundred rows against weights of thousands)
//! its guess can leave much of the GPU idle, and the pass runs each shape hundreds of times a
//! second. So the pass, once it has captured its graphs and so met every shape, times the
//! heuristic's first candidates on its own buffers beside cuBLAS's default (what the shape ran
//! before), keeps the fastest, and captures the graphs again.

use super::{Lt, Plan, Shape};
use crate::cuda::error::CudaError;
use cudarc::driver::{sys::CUevent_flags, CudaStream};
use std::sync::Arc;

/// Rounds over the candidates; a candidate's time is its median round.
const ROUNDS: usize = 3;
/// Another candidate replaces the heuristic's first, and a cuBLASLt candidate replaces cuBLAS's
/// default, only when it is at least this much faster: a near tie is kept as it was, so that
/// timing noise does not decide which algorithm (and so which rounding) a shape gets.
const MARGIN: f64 = 0.97;

/// What timing one shape's candidates found (microseconds a product).
#[derive(Clone, Copy, Debug)]
pub struct Tuned {
    pub shape: Shape,
    /// Candidates the heuristic gave and were timed.
    pub candidates: usize,
    /// cuBLAS's default algorithm (`cublasGemmEx`), and the heuristic's first candidate.
    pub default_us: f64,
    pub heuristic_us: f64,
    /// The one kept, and its place in the heuristic's order (0: its first; None: cuBLAS's
    /// default, which the shape then keeps running).
    pub kept_us: f64,
    pub kept: Option<usize>,
}

impl Lt {
    /// Time the heuristic's first candidates for `shape` on `stream` with the product's own
    /// operands, `runs` products a round, beside `default` (the same product on cuBLAS's
    /// default algorithm), and keep the fastest as the shape's plan, or mark the shape as
    /// the default's. None when cuBLASLt has no algorithm for it, or the shape accumulates
    /// (timing would add to its output). The stream is synchronised.
    ///
    /// # Safety
    /// As [`Lt::matmul`]; the output is scratch that nothing reads until it is written again.
    pub(crate) unsafe fn tune(
        &self,
        stream: &Arc<CudaStream>,
        shape: Shape,
        operands: (u64, u64, u64, u64),
        runs: usize,
        default: &mut dyn FnMut() -> Result<bool, CudaError>,
    ) -> Result<Option<Tuned>, CudaError> {
        if shape.accumulate {
            return Ok(None);
        }
        let Some(mut plan) = Plan::describe(shape) else {
            return Ok(None);
        };
        let most = crate::switches::get().measurement.lt_candidates;
        let algos = plan.candidates(self.handle, self.workspace.1, most);
        if algos.is_empty() {
            return Ok(None);
        }
        let cu = stream.cu_stream() as _;
        type Enqueue<'a> = Box<dyn FnMut() -> Result<bool, CudaError> + 'a>;
        let mut enqueuers: Vec<Enqueue> = (algos.iter())
            .map(|algo| {
                let plan = &plan;
                Box::new(move || {
                    // SAFETY: the caller vouches for the operands; `plan` is ours alone.
                    unsafe { self.enqueue(cu, plan, algo, shape, operands) }
                }) as Enqueue
            })
            .collect();
        enqueuers.push(Box::new(default));
        let times = time_products(stream, runs, &mut enqueuers)?;
        drop(enqueuers);
        // one that could not be timed counts as never finishing
        let mut medians: Vec<f64> = (times.iter()).map(|t| t.unwrap_or(f64::INFINITY)).collect();
        let default_us = medians.pop().unwrap_or(f64::INFINITY);
        if !medians.iter().any(|m| m.is_finite()) {
            return Ok(None);
        }
        let (kept, kept_us) = choose(&medians, default_us);
        let mut cache = self.plans.lock()?;
        match kept {
            Some(kept) => {
                plan.algo = algos[kept];
                cache.tuned.insert(shape, Some(plan.algo));
                cache.plans.insert(shape, Some(plan));
            }
            None => {
                cache.tuned.insert(shape, None);
            }
        }
        Ok(Some(Tuned {
            shape,
            candidates: algos.len(),
            default_us,
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
/// fastest, unless it is within [`MARGIN`] of the first; and that one only if it is at least
/// [`MARGIN`] faster than cuBLAS's default (None: the default is kept).
fn choose(times: &[f64], default_us: f64) -> (Option<usize>, f64) {
    let Some(&first) = times.first() else {
        return (None, default_us);
    };
    let (best, best_us) = (times.iter().copied().enumerate())
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, first));
    let (kept, kept_us) = match best_us < first * MARGIN {
        true => (best, best_us),
        false => (0, first),
    };
    match kept_us < default_us * MARGIN || !default_us.is_finite() {
        true => (Some(kept), kept_us),
        false => (None, default_us),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heuristics_first_is_kept_unless_another_is_clearly_faster() {
        let slow = f64::INFINITY;
        assert_eq!(choose(&[10.0, 9.8, 11.0], slow), (Some(0), 10.0));
        assert_eq!(choose(&[10.0, 9.0, 9.5], slow), (Some(1), 9.0));
        assert_eq!(choose(&[10.0, 12.0, 8.0], 20.0), (Some(2), 8.0));
        assert_eq!(choose(&[10.0], slow), (Some(0), 10.0));
        assert_eq!(choose(&[], 5.0), (None, 5.0));
    }

    #[test]
    fn cublas_default_is_kept_unless_a_candidate_is_clearly_faster() {
        // the best candidate within the margin of the default: the default stays
        assert_eq!(choose(&[10.0, 9.0], 9.2), (None, 9.2));
        assert_eq!(choose(&[10.0, 9.0], 8.0), (None, 8.0));
        // clearly faster: the candidate replaces it
        assert_eq!(choose(&[10.0, 9.0], 9.5), (Some(1), 9.0));
        assert_eq!(choose(&[10.0, 12.0], 11.0), (Some(0), 10.0));
    }

    #[test]
    fn a_median_of_an_odd_or_even_count() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0]), 4.0);
        assert!(median(&mut []).is_infinite());
    }
}

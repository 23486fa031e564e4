//! Many contexts, one GPU step: [`CudaBatch`] is the CUDA model behind the engine's
//! [`crate::engine::batch::Batcher`]. `docs/design/batching.md` explains the mechanisms; a
//! decode step passes these rooms in order:
//!
//! 1. [`contexts`]: each context's [`CudaSeq`] (its own session: stream, KV cache, logits,
//!    captured graphs), from the idle sessions, with its KV bytes reserved in the pool.
//! 2. [`route`]: where each item of the step runs, decided before anything is launched: on
//!    its session's own stream (long prompts, a lone decode through its captured decode
//!    graph) or as rows of the batched pass.
//! 3. [`pass`]: the batched pass, one row a token over many contexts, captured as a CUDA graph
//!    per size; [`pass::forward`] holds its kernels (embed -> layers -> head).
//! 4. [`ahead`]: running ahead, a layer on top: the next steps of greedy contexts launched
//!    before their guests come back, results kept until they do, and rows run late.
//!
//! **Batch invariance** (`WASI_NN_HOST_BATCH_INVARIANT`, [`crate::cuda::Gpu::batch_invariant`]).
//! By default a row's logits may differ in their last bits with its company: cuBLAS's
//! products (past 64 rows, and the LM head) depend on the rows, the attention's grid of spans
//! on the step, and a lone decode runs its own kernels. With the switch every product and the
//! LM head run on our kernel at every size, each product's K always cut into the same slices
//! (folded in the kernel past 64 rows); each row's attention takes spans of its own length;
//! lone decodes and prompts up to a pass's rows run in batched passes. A context's logits are
//! then the same bits whatever shares its steps, and alone.

pub(crate) mod ahead;
pub(crate) mod contexts;
pub(crate) mod pass;
pub(crate) mod route;

pub use contexts::CudaSeq;
pub use pass::{bucket, BATCHED_PROMPT};

use super::loaded::LoadedModel;
use super::session::CudaSession;
use crate::cuda::ops::matvec::argmax_row;
use crate::engine::batch::{BatchModel, KvPool, SpeculationCounts, StepItem};
use crate::engine::EngineError;
use ahead::plan::{
    early_hits, host_next_token, may_run_ahead, note_guests, plan_ahead, take_late_results,
    take_next_after_late, take_precomputed, take_result,
};
use ahead::state::Ahead;
use ahead::state::RunAhead;
use contexts::Contexts;
use pass::{Pass, Rows};
use route::{route, ItemShape, RouteLimits, StepRoute};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

/// GPT-2 on the GPU for the engine's batcher (see the module docs).
pub struct CudaBatch {
    exec: Arc<LoadedModel>,
    pass: Pass,
    contexts: Arc<Contexts>,
    ahead: Arc<RunAhead>,
}

impl CudaBatch {
    pub(crate) fn new(exec: Arc<LoadedModel>, pool: Arc<KvPool>, max_idle: usize) -> Self {
        Self {
            pass: Pass::new(exec.clone()),
            contexts: Arc::new(Contexts::new(&exec, pool, max_idle)),
            ahead: Arc::default(),
            exec,
        }
    }

    /// Make `n` idle sessions ready (allocated, set up) for the first contexts. With them,
    /// the batched pass's graphs of every size are captured too, and each session's decode
    /// step: a capture holds up every context on the GPU, so none is left for the first
    /// requests. One of them runs the prefill path at each bucket of cuBLASLt's row counts
    /// ([`CudaSession::warm_prefill`]), whose first use in the process is slow; a failure
    /// there only costs the first prompts that time.
    pub(crate) fn warm(&self, n: usize) -> Result<(), EngineError> {
        let mut made = (0..n)
            .map(|_| CudaSession::new(self.exec.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        made.iter_mut().for_each(CudaSession::capture_decode);
        if let Some(Err(e)) = made.first_mut().map(CudaSession::warm_prefill) {
            tracing::warn!("warming the prefill path failed: {e}");
        }
        let layer_floats = made.first().map(CudaSession::layer_floats);
        self.contexts.keep_idle(made);
        match (layer_floats, self.exec.gpu.measurement().graphs) {
            (Some(layer_floats), true) => self.pass.capture_all(layer_floats),
            _ => Ok(()),
        }
    }

    /// The pool the contexts' KV caches are reserved from.
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        self.contexts.pool()
    }

    /// Contexts open now.
    pub fn live(&self) -> usize {
        self.contexts.live()
    }

    /// A step that waits for the pass in flight (if any) before it launches anything: the
    /// contexts that came back with the token run ahead for them take its results; the rest
    /// run as routed ([`route`]); then the next steps of the greedy contexts are run ahead.
    fn step_waiting(
        &self,
        mut ahead: MutexGuard<'_, Ahead>,
        items: &mut [StepItem<'_, CudaSeq>],
        started: Instant,
        waited: &'static str,
    ) {
        // Whatever was run ahead is finished before anything else is launched; the contexts
        // that came back with the token run ahead take its results.
        ahead.resolve();
        let resolved = started.elapsed();
        let (pass_gpu, gap_gpu) = (ahead.clock.gpu_time, ahead.clock.gpu_gap);
        take_late_results(&mut ahead, items);
        let hit: Vec<bool> = (items.iter_mut())
            .map(|item| take_result(&mut ahead, item))
            .collect();
        let hits = hit.iter().filter(|&&h| h).count();
        for (i, item) in items.iter_mut().enumerate() {
            if hit[i] || item.error.is_some() {
                continue;
            }
            if let Err(e) = item.seq.session().and_then(|s| s.admit(item.tokens)) {
                item.error = Some(e);
            }
        }
        let shapes: Vec<ItemShape> = (items.iter().zip(&hit))
            .map(|(item, &hit)| ItemShape {
                tokens: item.tokens.len(),
                all_positions: item.all_positions,
                runs: !hit && item.error.is_none(),
            })
            .collect();
        let limits = RouteLimits {
            batched_prompt: self.pass.batched_prompt(),
            max_rows: self.pass.max_rows(),
            invariant: self.exec.gpu.batch_invariant(),
            run_ahead: self.exec.gpu.measurement().run_ahead,
            hits,
            kept_next: ahead.next_after_late.len(),
        };
        let plan = route(&shapes, limits);
        self.run_routed(items, &plan);
        let launched = started.elapsed();
        self.finish_own(items, &plan);
        let (run_ahead_rows, late) = self.run_ahead_after(&mut ahead, items, &hit, &plan);
        let (total_hits, misses) = (ahead.counts.hits, ahead.counts.misses);
        drop(ahead);
        tracing::debug!(
            items = items.len(),
            hit = hits,
            batched = plan.batched.len(),
            late,
            own = plan.own().len(),
            run_ahead = run_ahead_rows,
            hits = total_hits,
            misses,
            resolve_us = resolved.as_micros() as u64,
            pass_gpu_us = pass_gpu.as_micros() as u64,
            gap_gpu_us = gap_gpu.as_micros() as u64,
            own_launch_us = launched.as_micros() as u64,
            step_us = started.elapsed().as_micros() as u64,
            waited,
            "batched step"
        );
    }

    /// Launch what `plan` puts on the sessions' own streams (prompts start at once), and run
    /// the batched rows as passes, waited for, unless they run late.
    fn run_routed(&self, items: &mut [StepItem<'_, CudaSeq>], plan: &StepRoute) {
        let alone = items.len() == 1;
        for &i in &plan.own_prompts {
            let item = &mut items[i];
            let (tokens, all, continued) = (item.tokens, item.all_positions, !item.first_chunk);
            let ran = item.seq.session_mut().and_then(|s| {
                s.allow_capture(alone);
                s.extend_chunk(tokens, all, continued)
            });
            item.error = ran.err();
        }
        if plan.late {
            return;
        }
        if let Some(i) = plan.lone_decode {
            // a lone decode keeps its own captured decode step
            let item = &mut items[i];
            let token = item.tokens;
            item.error = (item.seq.session_mut())
                .and_then(|s| s.extend_chunk(token, false, false))
                .err();
        }
        if !plan.batched.is_empty() {
            self.run_batched(items, &plan.batched);
        }
    }

    /// An item's rows for a pass: its tokens at its session's next positions, marked as a
    /// chunk when its request is a prompt longer than a pass takes whole ([`Rows::chunk`]).
    fn rows_of<'t>(&self, item: &StepItem<'t, CudaSeq>) -> Result<Rows<'t>, EngineError> {
        let chunk = item.request_tokens > self.pass.batched_prompt();
        let session = item.seq.session()?;
        let rows = Rows::of(session, item.tokens, item.seq.rule());
        // the announced draw is for the end of the request: its last chunk
        let edited = item.seq.announced.clone().filter(|_| item.last_chunk);
        Ok(rows.chunked(chunk).edited(edited, session))
    }

    /// The tokens of `items` (each admitted, at most [`Pass::max_rows`] together) as one
    /// batched step; on success each session has its new positions, its last row's logits
    /// and their argmax.
    fn run_rows(&self, items: &mut [&mut StepItem<'_, CudaSeq>]) -> Result<(), EngineError> {
        let inputs = (items.iter())
            .map(|item| self.rows_of(item))
            .collect::<Result<Vec<_>, EngineError>>()?;
        let (_, last_rows, keys) = self.pass.run(&inputs)?;
        drop(inputs);
        for (item, row) in items.iter_mut().zip(last_rows) {
            let key = keys.get(row).copied().unwrap_or(0);
            let added = item.tokens.len();
            let drawn = item.seq.drawn_by(item.last_chunk);
            let session = item.seq.session_mut()?;
            session.advanced_in_batch(added, argmax_row(key));
            session.set_keys_drawn(drawn);
        }
        Ok(())
    }

    /// The items `batched` (indices into `items`, in order) as batched passes of at most
    /// [`Pass::max_rows`] each, waited for; an item of a pass that failed gets its error.
    fn run_batched(&self, items: &mut [StepItem<'_, CudaSeq>], batched: &[usize]) {
        let mut rows: Vec<&mut StepItem<'_, CudaSeq>> = items
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| batched.binary_search(i).is_ok())
            .map(|(_, item)| item)
            .collect();
        // groups of at most a pass's rows, in order (a context's rows never span two)
        let max_rows = self.pass.max_rows();
        let mut start = 0;
        while start < rows.len() {
            let (mut end, mut count) = (start, 0);
            while end < rows.len() && count + rows[end].tokens.len() <= max_rows {
                count += rows[end].tokens.len();
                end += 1;
            }
            let group = &mut rows[start..end];
            if let Err(e) = self.run_rows(group) {
                let message = e.to_string();
                for item in group.iter_mut() {
                    item.error = Some(EngineError::device(format!("batched step: {message}")));
                }
            }
            start = end;
        }
    }

    /// Everything of this step on the sessions' own streams is done before its contexts see
    /// their results.
    fn finish_own(&self, items: &mut [StepItem<'_, CudaSeq>], plan: &StepRoute) {
        for i in plan.own() {
            let item = &mut items[i];
            if let Err(e) = item.seq.session().and_then(CudaSession::synchronize) {
                item.error.get_or_insert(e);
            }
        }
    }

    /// The next step of the greedy contexts, run ahead: a lone decode's on its own stream
    /// through its session's graph (faster than a batched pass), the others' in a pass with
    /// the step's late rows. Returns the rows of that pass and the late items.
    fn run_ahead_after(
        &self,
        ahead: &mut Ahead,
        items: &mut [StepItem<'_, CudaSeq>],
        hit: &[bool],
        plan: &StepRoute,
    ) -> (usize, usize) {
        let run_ahead = self.exec.gpu.measurement().run_ahead;
        let greedy = may_run_ahead(items);
        let lone_ahead = run_ahead && self.lone_decode_ahead(items, &greedy, plan);
        let late: &[usize] = if plan.late { &plan.batched } else { &[] };
        // (a lone decode run ahead on its own stream is not run in a pass too)
        let eligible: Vec<bool> = (0..items.len())
            .map(|i| greedy[i] && late.binary_search(&i).is_err() && !lone_ahead)
            .collect();
        let argmax: Vec<Option<u32>> = (0..items.len())
            .map(|i| eligible[i].then(|| host_next_token(&items[i])).flatten())
            .collect();
        let serials = note_guests(ahead, items, hit, &eligible, &argmax);
        let mut picks = match run_ahead {
            true => plan_ahead(ahead, &serials, self.depth()),
            false => Vec::new(),
        };
        // one pass holds them all when late; otherwise the first that fit
        let late_rows: usize = late.iter().map(|&i| items[i].tokens.len()).sum();
        let max_rows = self.pass.max_rows();
        picks.truncate(max_rows - late_rows);
        let room = max_rows - late_rows - picks.len();
        let launch =
            run_ahead && (plan.late || picks.len() + ahead.next_after_late.len().min(room) >= 2);
        if !launch {
            return (0, late.len());
        }
        picks.extend(take_next_after_late(ahead, room));
        match self.launch_ahead(ahead, items, picks, late, &greedy) {
            Ok(flight) => {
                let n = flight.n;
                ahead.in_flight = Some(flight);
                (n, late.len())
            }
            Err(e) => {
                tracing::warn!("running a step ahead failed: {e}");
                for &i in late {
                    let message = format!("batched step: {e}");
                    items[i].error.get_or_insert(EngineError::device(message));
                }
                (0, late.len())
            }
        }
    }

    /// A lone greedy decode that ran on its session's own stream gets its next step launched
    /// there at once; true when it was.
    fn lone_decode_ahead(
        &self,
        items: &mut [StepItem<'_, CudaSeq>],
        greedy: &[bool],
        plan: &StepRoute,
    ) -> bool {
        let [item] = items else {
            return false;
        };
        // (its own decode feeds the argmax: not for a context that draws its tokens)
        let own = greedy[0] && !item.seq.draws();
        if !(own && plan.own() == [0] && item.tokens.len() == 1) {
            return false;
        }
        match item
            .seq
            .session_mut()
            .and_then(CudaSession::launch_ahead_decode)
        {
            Ok(launched) => launched.is_some(),
            Err(e) => {
                item.error.get_or_insert(e);
                false
            }
        }
    }
}

impl BatchModel for CudaBatch {
    type Seq = CudaSeq;

    /// Waiting contexts park at once unless `WASI_NN_HOST_SPIN_US` says otherwise: with 64
    /// guests and the service on the 16 cores of the H200 machine, waiters that spun
    /// (yielding) for 3 ms slowed the guests down more than they saved (33.9k against
    /// 43.7k tokens/s).
    fn spin(&self) -> Duration {
        self.exec.gpu.settings().spin
    }

    fn take_precomputed(&self, seq: &mut CudaSeq, tokens: &[u32], all_positions: bool) -> bool {
        let (&[token], false) = (tokens, all_positions) else {
            return false;
        };
        if seq.late.load(Ordering::Acquire) || !self.exec.gpu.measurement().run_ahead {
            return false;
        }
        take_precomputed(&mut self.ahead.lock(), seq, token)
    }

    /// A prompt among other contexts rides the batched pass in chunks of
    /// [`Pass::batched_prompt`] rows, so the others' decodes go on beside it (on its own
    /// stream, the step would wait for all of it); alone it runs whole through the prefill
    /// path, the quickest to its first token. A prompt wanting every position's logits
    /// always takes the prefill path (the pass keeps a row's logits for the last one only).
    fn max_chunk(&self, all_positions: bool, company: usize) -> usize {
        match all_positions || company == 0 {
            true => usize::MAX,
            false => self.pass.batched_prompt(),
        }
    }

    fn new_seq(&self) -> Result<CudaSeq, EngineError> {
        self.contexts.open(&self.exec, &self.ahead)
    }

    fn step(&self, items: &mut [StepItem<'_, CudaSeq>]) {
        let started = Instant::now();
        if let [item] = items {
            if self.take_lone_decode_ahead(item) {
                return;
            }
        }
        // work run ahead on a session's own stream ends before anything else uses the session
        for item in items.iter_mut() {
            if let Some(Err(e)) = item.seq.session.as_mut().map(CudaSession::settle_own) {
                item.error.get_or_insert(e);
            }
        }
        let ahead = self.ahead.lock();
        let switches = self.exec.gpu.measurement();
        let early = match switches.run_ahead && switches.early_launch {
            true => early_hits(&ahead, items, &self.pass),
            false => Err("off"),
        };
        match early {
            Ok(early) => self.step_early(ahead, items, &early, started),
            Err(waited) => self.step_waiting(ahead, items, started, waited),
        }
    }

    fn speculation(&self) -> SpeculationCounts {
        let ahead = self.ahead.lock();
        let in_flight = (ahead.in_flight.as_ref()).map_or(0, |f| f.rows.len() + f.late.len());
        SpeculationCounts {
            hits: ahead.counts.hits,
            misses: ahead.counts.misses,
            deferred: ahead.counts.late,
            overlapped: ahead.counts.early,
            kept: ahead.results.len()
                + ahead.late_argmax.len()
                + ahead.next_after_late.len()
                + in_flight,
        }
    }

    /// Until shortly before the pass in flight is expected to end (see
    /// [`ahead::clock::PassClock::gather_window`]; `WASI_NN_HOST_GATHER_MARGIN_US`).
    fn gather_window(&self) -> Option<Duration> {
        let ahead = self.ahead.lock();
        let flight = ahead.in_flight.as_ref()?;
        let margin = self.exec.gpu.settings().gather_margin;
        Some(ahead.clock.gather_window(flight.launched, margin))
    }
}

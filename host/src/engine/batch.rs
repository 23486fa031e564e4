//! Continuous batching across execution contexts: forward passes that contexts of one graph
//! ask for at about the same time run as one batched step ([`Batcher`]).
//!
//! Iteration-level scheduling by flat combining, with no scheduler thread: a context that
//! asks for a step queues its request; if no step is running, its own thread becomes the
//! leader, takes every queued request (up to a token budget), runs them as one step of the
//! [`BatchModel`], hands each result to its thread and wakes that thread alone (and the
//! thread of the first request still queued, to lead the next step); if a step is running, it
//! parks and joins the next one. A step never waits for a batch to fill: a lone stream runs
//! at once, on its own thread, as before. It only gives the contexts of the previous step,
//! whose guests are choosing their next token, a moment (at most that step's time, 2 ms at
//! most) to come back, so the streams stay in one step instead of splitting into two that
//! alternate (not those whose work the model deferred past the step, [`StepItem::deferred`]:
//! they come back only after that work). A long prompt is cut into chunks (at most the
//! model's [`BatchModel::max_chunk`], and what is left of `max_step_tokens` once every queued
//! decode has its token) so the streams decoding beside it wait at most one chunk per step.
//!
//! Each context's state (its KV cache and last logits, a [`BatchModel::Seq`]) moves into the
//! step and back, so no context can see another's; an error in one item (its cache pool is
//! full, say) fails that context alone, and a panic in a step fails that step's contexts with
//! an error while the batcher keeps serving.

use super::draw::DrawRule;
pub use super::kv_pool::KvPool;
use super::processing::{EditedRule, Edits};
use super::{EngineError, Session};
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// One context's state on a device: what a step reads and extends.
pub trait SeqState: Send + Sync + 'static {
    /// Positions cached.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forget every position from `len` on.
    fn truncate(&mut self, len: usize);
    /// Logits of the last position of the last extend, `[V]`.
    fn last_logits(&self) -> Result<Vec<f32>, EngineError>;
    /// Logits of every position of the last extend with all positions (every chunk of it),
    /// `[n, V]`.
    fn all_logits(&self) -> Result<Vec<f32>, EngineError>;
    /// Index of the largest last-position logit.
    fn argmax(&self) -> Result<u32, EngineError>;
    /// The token `rule` draws from the last position's logits (see [`Session::draw`]).
    fn draw(&mut self, rule: &DrawRule) -> Result<u32, EngineError> {
        Ok(super::draw::draw(&self.last_logits()?, rule, self.len()))
    }
    /// See [`Session::announce_draw`].
    fn announce_draw(&mut self, _next: Option<Arc<EditedRule>>) {}
    /// The token `rule` draws after `edits` changed the last position's logits (see
    /// [`Session::draw_edited`]).
    fn draw_edited(&mut self, rule: &DrawRule, edits: &Edits) -> Result<u32, EngineError> {
        Ok(edits.draw(self.last_logits()?, rule, self.len()))
    }
}

/// A model that runs several contexts' tokens as one step.
pub trait BatchModel: Send + Sync + 'static {
    type Seq: SeqState;

    /// How long a context waiting for a step spins (yielding its core) before it parks:
    /// worth it when the step runs elsewhere (a GPU) and waking a sleeping core costs a good
    /// part of a step; not when the step needs every core (the CPU).
    fn spin(&self) -> Duration {
        Duration::ZERO
    }

    /// The longest a step waits for the contexts of the previous one to come back (at most
    /// the previous step's time, and never for a lone context).
    const MAX_GATHER: Duration = Duration::from_millis(2);

    /// How long from now the next step may wait for the last step's contexts to come back,
    /// when the model still has work queued on its device for them (computed speculatively):
    /// until shortly before that work runs out, so that the next step's is queued behind it;
    /// the contexts not back by then join a later step. None: the device has nothing queued,
    /// and the step waits up to its own time.
    fn gather_window(&self) -> Option<Duration> {
        None
    }

    /// What the model's speculative work achieved (models that compute a context's next step
    /// before it asks, guessing its token).
    fn speculation(&self) -> SpeculationCounts {
        SpeculationCounts::default()
    }

    /// Take a result the model already holds for `seq`'s next call: computed speculatively
    /// with exactly `tokens` (one token, not every position's logits), and finished. True:
    /// `seq` advanced as if a step had run it, and the call needs no step.
    fn take_precomputed(
        &self,
        _seq: &mut Self::Seq,
        _tokens: &[u32],
        _all_positions: bool,
    ) -> bool {
        false
    }

    /// The most tokens of one request a step runs, given `company`: the other contexts queued
    /// for the step or expected back for their next token. A longer prompt runs in chunks of
    /// this size, one a step, beside the others' decodes; alone it may run whole, which is
    /// quicker to its first token where the model has a faster path for long prompts.
    fn max_chunk(&self, _all_positions: bool, _company: usize) -> usize {
        usize::MAX
    }

    /// A new, empty context (it may be refused: no memory for its cache, the pool is full).
    fn new_seq(&self) -> Result<Self::Seq, EngineError>;

    /// Run one step: each item's `tokens` at its next positions (a chunk of its request:
    /// `first_chunk` / `last_chunk` say which). Keep the last position's logits of a last
    /// chunk, and every position's when `all_positions`. An item that cannot run sets its
    /// `error` and leaves its state as it was; the others are unaffected.
    fn step(&self, items: &mut [StepItem<'_, Self::Seq>]);
}

/// One context's share of a step.
pub struct StepItem<'a, S> {
    pub seq: &'a mut S,
    pub tokens: &'a [u32],
    pub all_positions: bool,
    pub first_chunk: bool,
    pub last_chunk: bool,
    /// Tokens of the whole request this item's `tokens` are a chunk of.
    pub request_tokens: usize,
    pub error: Option<EngineError>,
    /// Set by the model: the step returns before this item's work ran (its results come when
    /// the context reads them), so its context will not be back within a step's time and the
    /// next step does not wait for it.
    pub deferred: bool,
}

/// Where a request's outcome goes, and the thread waiting for it.
struct Slot<S> {
    outcome: Mutex<Option<Outcome<S>>>,
    thread: Thread,
    /// Set with every wake-up (a result, or a turn to lead), for a thread that is spinning.
    woken: AtomicBool,
}

/// A request's result, and the threads of its step still to wake.
type Outcome<S> = (S, Result<(), EngineError>, Arc<WakeList<S>>);

impl<S> Slot<S> {
    /// The outcome, once a step put it there; the waking of the step's other threads is
    /// helped along on the way.
    fn take(&self) -> Option<(S, Result<(), EngineError>)> {
        let (seq, result, wake) = self
            .outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        wake.help(WAKE_FAN_OUT);
        Some((seq, result))
    }
    fn put(&self, outcome: Outcome<S>) {
        *self.outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
    }

    fn wake(&self) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }

    /// Wait for a wake-up (or `deadline`): spinning (yielding the core) for `spin`, then
    /// parked.
    fn wait(&self, spin: Duration, deadline: Option<Instant>) {
        // no clock read without a spin (the default: every token of every stream waits here)
        if !spin.is_zero() {
            let spin_until = Instant::now() + spin;
            while Instant::now() < spin_until {
                if self.woken.swap(false, Ordering::AcqRel) {
                    return;
                }
                std::thread::yield_now();
            }
        }
        match deadline {
            Some(at) => std::thread::park_timeout(at.saturating_duration_since(Instant::now())),
            None => std::thread::park(),
        }
        self.woken.store(false, Ordering::Release);
    }
}

/// Threads each woken thread wakes in turn: the step's threads wake as a tree, not one
/// after another from the leader.
const WAKE_FAN_OUT: usize = 2;

/// The threads a step wakes; whoever holds the list wakes the next ones.
struct WakeList<S> {
    slots: Vec<Arc<Slot<S>>>,
    next: AtomicUsize,
}

impl<S> WakeList<S> {
    /// Wake up to `n` more threads (all that are left for `usize::MAX`).
    fn help(&self, n: usize) {
        for _ in 0..n {
            let i = self.next.fetch_add(1, Ordering::AcqRel);
            match self.slots.get(i) {
                Some(slot) => slot.wake(),
                None => return,
            }
        }
    }
}

/// A queued request: a context's state and the tokens still to run.
struct Request<S> {
    /// The context's id (a context has at most one request at a time).
    ticket: u64,
    slot: Arc<Slot<S>>,
    seq: S,
    tokens: Vec<u32>,
    done: usize,
    all_positions: bool,
}

/// A request in a step: the tokens it runs this step and, afterwards, its error if any.
struct Scheduled<S> {
    request: Request<S>,
    take: usize,
    error: Option<EngineError>,
    deferred: bool,
}

struct State<S> {
    running: bool,
    queue: VecDeque<Request<S>>,
    /// Contexts whose request the last step completed: they are expected back for their next
    /// token (their guests are choosing it), so the next step gives them until
    /// `gather_until` to join rather than running without them.
    returning: HashSet<u64>,
    gather_until: Option<Instant>,
    /// A thread is timing the wait for them (the others queued just park).
    gatherer: bool,
    /// When the last step ended.
    last_end: Option<Instant>,
}

/// Steps shared by the contexts of one model (see the module docs).
pub struct Batcher<M: BatchModel> {
    model: M,
    /// Most tokens one step runs (every queued decode gets its token; prompts share the rest).
    max_step_tokens: usize,
    state: Mutex<State<M::Seq>>,
    stats: BatchStats,
    next_id: AtomicU64,
}

/// What the batcher has done, for benchmarks and tests.
#[derive(Default)]
pub struct BatchStats {
    steps: AtomicUsize,
    items: AtomicUsize,
    largest: AtomicUsize,
    step_ns: AtomicU64,
    gather_ns: AtomicU64,
}

/// A model's speculative work (see [`BatchModel::speculation`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpeculationCounts {
    /// Contexts that came back with the token their next step was computed with, and those
    /// that came back with another.
    pub hits: u64,
    pub misses: u64,
    /// Items whose work ran past their step ([`StepItem::deferred`]).
    pub deferred: u64,
    /// Steps whose device work was queued before the previous step's had ended.
    pub overlapped: u64,
    /// Results (launched or done) kept for contexts that have not come back yet: none once
    /// every context is gone.
    pub kept: usize,
}

impl SpeculationCounts {
    /// Two models' counts together.
    pub fn with(self, other: Self) -> Self {
        Self {
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            deferred: self.deferred + other.deferred,
            overlapped: self.overlapped + other.overlapped,
            kept: self.kept + other.kept,
        }
    }
}

/// What a [`Batcher`] has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchCounts {
    /// Steps run.
    pub steps: usize,
    /// Items over all steps.
    pub items: usize,
    /// The largest step, in items.
    pub largest: usize,
    /// Time spent in steps, and waiting for the previous step's contexts to come back.
    pub step_seconds: f64,
    pub gather_seconds: f64,
    /// The model's speculative work so far ([`BatchModel::speculation`]).
    pub speculation: SpeculationCounts,
}

impl BatchCounts {
    /// Two batchers' counts together (the largest step is the larger of the two).
    pub fn with(self, other: Self) -> Self {
        Self {
            steps: self.steps + other.steps,
            items: self.items + other.items,
            largest: self.largest.max(other.largest),
            step_seconds: self.step_seconds + other.step_seconds,
            gather_seconds: self.gather_seconds + other.gather_seconds,
            speculation: self.speculation.with(other.speculation),
        }
    }
}

impl BatchStats {
    /// (steps run, items over all steps, the largest step in items).
    pub fn get(&self) -> (usize, usize, usize) {
        let c = self.counts();
        (c.steps, c.items, c.largest)
    }

    pub fn counts(&self) -> BatchCounts {
        BatchCounts {
            steps: self.steps.load(Ordering::Relaxed),
            items: self.items.load(Ordering::Relaxed),
            largest: self.largest.load(Ordering::Relaxed),
            step_seconds: self.step_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            gather_seconds: self.gather_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            speculation: SpeculationCounts::default(),
        }
    }
}

impl<M: BatchModel> Batcher<M> {
    pub fn new(model: M, max_step_tokens: usize) -> Arc<Self> {
        Arc::new(Self {
            model,
            max_step_tokens: max_step_tokens.max(1),
            state: Mutex::new(State {
                running: false,
                queue: VecDeque::new(),
                returning: HashSet::new(),
                gather_until: None,
                gatherer: false,
                last_end: None,
            }),
            stats: BatchStats::default(),
            next_id: AtomicU64::new(0),
        })
    }

    pub fn model(&self) -> &M {
        &self.model
    }

    pub fn stats(&self) -> &BatchStats {
        &self.stats
    }

    /// What the batcher and its model have done so far.
    pub fn counts(&self) -> BatchCounts {
        BatchCounts {
            speculation: self.model.speculation(),
            ..self.stats.counts()
        }
    }

    /// A new context as a [`Session`] whose extends go through this batcher.
    pub fn session(self: &Arc<Self>) -> Result<Box<dyn Session>, EngineError> {
        Ok(Box::new(BatchedSession {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            batcher: self.clone(),
            seq: Some(self.model.new_seq()?),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State<M::Seq>> {
        // The lock only guards queue bookkeeping (no step runs under it), which stays
        // consistent even if a holder panicked.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A context is gone: no step waits for it any more.
    fn forget(&self, id: u64) {
        let mut state = self.lock();
        if state.returning.remove(&id) {
            // the next step may not need to wait any longer
            if let Some(front) = state.queue.front() {
                front.slot.wake();
            }
        }
    }

    /// Run `tokens` on context `ticket`'s `seq` in the next step(s); returns the state and
    /// the outcome.
    fn run(
        &self,
        ticket: u64,
        seq: M::Seq,
        tokens: Vec<u32>,
        all_positions: bool,
    ) -> (M::Seq, Result<(), EngineError>) {
        let slot = Arc::new(Slot {
            outcome: Mutex::new(None),
            thread: std::thread::current(),
            woken: AtomicBool::new(false),
        });
        let mut state = self.lock();
        state.returning.remove(&ticket);
        state.queue.push_back(Request {
            ticket,
            slot: slot.clone(),
            seq,
            tokens,
            done: 0,
            all_positions,
        });
        loop {
            if let Some(outcome) = slot.take() {
                return outcome;
            }
            if state.running || state.queue.is_empty() {
                // a step is running (with this request, or before it): its leader wakes us
                drop(state);
                slot.wait(self.model.spin(), None);
                if let Some(outcome) = slot.take() {
                    return outcome;
                }
                state = self.lock();
                continue;
            }
            let now = Instant::now();
            let gather = state
                .gather_until
                .filter(|&until| now < until && !state.returning.is_empty());
            if let Some(until) = gather {
                // the previous step's other contexts are on their way back: the last of them
                // leads the step; one thread keeps the time in case they don't all come
                if state.gatherer {
                    // The gatherer may be done (its own request taken by another step) before
                    // it gives up the role: wait no longer than the gather either.
                    drop(state);
                    slot.wait(self.model.spin(), Some(until));
                    if let Some(outcome) = slot.take() {
                        return outcome;
                    }
                } else {
                    state.gatherer = true;
                    drop(state);
                    std::thread::park_timeout(until - now);
                    let waited = now.elapsed().as_nanos() as u64;
                    self.stats.gather_ns.fetch_add(waited, Ordering::Relaxed);
                    state = self.lock();
                    state.gatherer = false;
                    // whoever waits behind may take the role over now
                    if let Some(front) = state.queue.front() {
                        front.slot.wake();
                    }
                    continue;
                }
                state = self.lock();
                continue;
            }
            state.running = true;
            self.lead(state);
            state = self.lock();
        }
    }

    /// Run the next step as its leader (`state` says a step is running): take the queued
    /// requests, run them, hand each result to its thread and wake the threads, with the first
    /// request still queued, which leads the step after.
    fn lead<'s>(&'s self, mut state: MutexGuard<'s, State<M::Seq>>) {
        // expected back but not here: the gather gave up on them
        let missing = state.returning.len();
        state.returning.clear();
        let mut batch = self.take_batch(&mut state, missing);
        let since_last = state.last_end.map(|end| end.elapsed());
        drop(state);
        let started = Instant::now();
        self.run_step(&mut batch);
        let took = started.elapsed();
        tracing::trace!(
            items = batch.len(),
            step_us = took.as_micros() as u64,
            between_us = since_last.map_or(0, |d| d.as_micros() as u64),
            missing,
            "step"
        );
        self.stats
            .step_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        let mut done = Vec::with_capacity(batch.len());
        let mut slots = Vec::with_capacity(batch.len() + 1);
        state = self.lock();
        let wait = self
            .model
            .gather_window()
            .unwrap_or(took)
            .min(M::MAX_GATHER);
        state.gather_until = Some(Instant::now() + wait);
        state.last_end = Some(Instant::now());
        // unfinished prompts go back to the front, in their order
        for Scheduled {
            request,
            take,
            error,
            deferred,
        } in batch.into_iter().rev()
        {
            let mut r = request;
            if let Some(e) = error {
                slots.push(r.slot.clone());
                done.push((r.slot, r.seq, Err(e)));
                continue;
            }
            r.done += take;
            if r.done >= r.tokens.len() {
                if !deferred {
                    state.returning.insert(r.ticket);
                }
                slots.push(r.slot.clone());
                done.push((r.slot, r.seq, Ok(())));
            } else {
                state.queue.push_front(r);
            }
        }
        state.running = false;
        // the first request still queued leads the next step
        if let Some(front) = state.queue.front() {
            slots.push(front.slot.clone());
        }
        let wake = Arc::new(WakeList {
            slots,
            next: AtomicUsize::new(0),
        });
        for (slot, seq, result) in done {
            slot.put((seq, result, wake.clone()));
        }
        drop(state);
        // the woken threads wake the rest with us
        wake.help(usize::MAX);
    }

    /// The requests of the next step with the tokens each runs: every queued decode, and
    /// prompts in arrival order while the budget lasts (the first request always runs), each
    /// at most the model's [`BatchModel::max_chunk`] given the others (queued, or `missing`:
    /// expected back from the last step and not here yet).
    fn take_batch(&self, state: &mut State<M::Seq>, missing: usize) -> Vec<Scheduled<M::Seq>> {
        let mut budget = self.max_step_tokens;
        let company = state.queue.len().saturating_sub(1) + missing;
        let mut batch = Vec::new();
        let mut kept = VecDeque::new();
        while let Some(request) = state.queue.pop_front() {
            let chunk = self.model.max_chunk(request.all_positions, company).max(1);
            let remaining = (request.tokens.len() - request.done).min(chunk);
            let take = if batch.is_empty() {
                remaining.min(budget.max(1))
            } else if remaining == 1 {
                1
            } else {
                remaining.min(budget)
            };
            if take == 0 {
                kept.push_back(request);
                continue;
            }
            budget = budget.saturating_sub(take);
            batch.push(Scheduled {
                request,
                take,
                error: None,
                deferred: false,
            });
        }
        state.queue = kept;
        batch
    }

    fn run_step(&self, batch: &mut [Scheduled<M::Seq>]) {
        let mut items: Vec<StepItem<'_, M::Seq>> = batch
            .iter_mut()
            .map(|s| {
                let (r, take) = (&mut s.request, s.take);
                StepItem {
                    first_chunk: r.done == 0,
                    last_chunk: r.done + take == r.tokens.len(),
                    request_tokens: r.tokens.len(),
                    tokens: &r.tokens[r.done..r.done + take],
                    all_positions: r.all_positions,
                    seq: &mut r.seq,
                    error: None,
                    deferred: false,
                }
            })
            .collect();
        let ran =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.model.step(&mut items)));
        let outcomes: Vec<(Option<EngineError>, bool)> = match ran {
            Ok(()) => items
                .into_iter()
                .map(|item| (item.error, item.deferred))
                .collect(),
            Err(_) => {
                drop(items);
                tracing::error!("a batched step panicked; its contexts get an error");
                batch
                    .iter()
                    .map(|_| (Some(EngineError::device("the batched step failed")), false))
                    .collect()
            }
        };
        let n = batch.len();
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats.items.fetch_add(n, Ordering::Relaxed);
        self.stats.largest.fetch_max(n, Ordering::Relaxed);
        for (scheduled, (error, deferred)) in batch.iter_mut().zip(outcomes) {
            scheduled.error = error;
            scheduled.deferred = deferred;
        }
    }
}

/// One execution context's view of a [`Batcher`]: its state lives here between steps.
struct BatchedSession<M: BatchModel> {
    id: u64,
    batcher: Arc<Batcher<M>>,
    /// `None` only if a step lost it (it never returns without it).
    seq: Option<M::Seq>,
}

impl<M: BatchModel> BatchedSession<M> {
    fn seq(&self) -> Result<&M::Seq, EngineError> {
        self.seq
            .as_ref()
            .ok_or_else(|| EngineError::device("context state lost"))
    }
}

impl<M: BatchModel> Drop for BatchedSession<M> {
    fn drop(&mut self) {
        self.batcher.forget(self.id);
    }
}

impl<M: BatchModel> Session for BatchedSession<M> {
    fn len(&self) -> usize {
        self.seq.as_ref().map_or(0, SeqState::len)
    }
    fn truncate(&mut self, len: usize) {
        if let Some(seq) = self.seq.as_mut() {
            seq.truncate(len);
        }
    }
    fn extend(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptySequence);
        }
        let ready = (self.seq.as_mut()).is_some_and(|seq| {
            self.batcher
                .model
                .take_precomputed(seq, tokens, all_positions)
        });
        if ready {
            // not expected back by the next step any more
            self.batcher.forget(self.id);
            return Ok(());
        }
        let seq = self
            .seq
            .take()
            .ok_or_else(|| EngineError::device("context state lost"))?;
        let (seq, result) = self
            .batcher
            .run(self.id, seq, tokens.to_vec(), all_positions);
        self.seq = Some(seq);
        result
    }
    fn last_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        self.seq()?.last_logits()
    }
    fn all_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        self.seq()?.all_logits()
    }
    fn argmax(&mut self) -> Result<u32, EngineError> {
        self.seq()?.argmax()
    }
    fn draw(&mut self, rule: &DrawRule) -> Result<u32, EngineError> {
        (self.seq.as_mut())
            .ok_or_else(|| EngineError::device("context state lost"))?
            .draw(rule)
    }
    fn announce_draw(&mut self, next: Option<Arc<EditedRule>>) {
        if let Some(seq) = self.seq.as_mut() {
            seq.announce_draw(next);
        }
    }
    fn draw_edited(&mut self, rule: &DrawRule, edits: &Edits) -> Result<u32, EngineError> {
        (self.seq.as_mut())
            .ok_or_else(|| EngineError::device("context state lost"))?
            .draw_edited(rule, edits)
    }
}

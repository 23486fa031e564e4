//! Many contexts, one GPU step: [`CudaBatch`] is the CUDA model behind the engine's
//! [`crate::engine::batch::Batcher`].
//!
//! Each context keeps its own [`CudaSession`] (stream, KV cache, logits, captured graphs).
//! In a step, a lone decode runs through its session's captured decode graph (one stream
//! keeps its latency); long prompts (over `BATCHED_PROMPT` tokens, and prompts that want
//! every position's logits) run on their sessions' own streams through the prefill path;
//! everything else, decodes and short prompts, is one batched pass on the batch's stream,
//! one row a token: every row's embedding, the products over all rows (bf16 inputs split in
//! hi and lo halves so the rows see their activations to ~16 bits, as the one-row kernels do;
//! our tensor-core kernel up to [`super::Gpu::batch_gemm_rows`] rows, cuBLAS above and for
//! the LM head), each row's key and value appended to its own context's cache,
//! attention of each row over its own context's cache in one launch (ragged lengths), and
//! the LM head writing each context's last row's logits into its session with their argmax.
//! The batched pass is captured as a CUDA graph per size bucket (rows rounded up; padding
//! rows touch no cache and no output). Contexts never see each other's caches: a row's
//! addresses come from its own session, set by the step.
//!
//! **Running ahead.** While the guests of a step's contexts turn its results into their next
//! call, the GPU would sit idle. So at the end of a step, the contexts whose guests only
//! read the argmax (greedy guests; a guest that read logits after its last step is left
//! out) get their next step launched at once, with that argmax as their token: each row
//! writes its own context's cache at the next position and its logits into a logits buffer
//! of the session that the guest is not reading, so nothing the guest can still read
//! changes. When a context comes back with exactly that token at that position, its step is
//! already done (or under way): it takes the results, and that buffer becomes the one read.
//! Any other call runs as usual and overwrites the guessed position; a step waits for the
//! work run ahead before it launches anything on a session's own stream (the next batched
//! pass may go first, see "Two passes"), and a context dropped while it is under way waits
//! for it too.
//!
//! **A lone decode runs ahead too**, on its session's own stream and through its captured
//! decode graph rather than a pass: a variant of the graph whose embedding kernel takes the
//! token from the last step's argmax key and the position after the last one (both fed on the
//! GPU), its logits into the buffer the guest is not reading. The step's own argmax comes back
//! through page-locked memory, copied before the step run ahead clears it. A guest that comes
//! back with that token at that position takes the step (done or under way) and the next one is
//! launched at once, so the GPU runs one stream's steps back to back; any other call runs after
//! it on the stream and overwrites what it wrote. Before a batched pass touches such a
//! session, its stream is waited for (`CudaSession::settle_own`).
//!
//! **Late rows.** A step whose contexts mostly hit may also carry rows no one guessed: a new
//! request's prompt, a token other than the argmax. Run in a pass of their own, they would
//! hold up every context of the step for a whole pass. Instead they join the pass run ahead
//! for the hits, and the step returns without waiting for them: their contexts' positions
//! advance at once, and the guest's first read of their logits or argmax waits for the pass
//! (outside the lock, polling its event, so that steps go on launching meanwhile; it resolves
//! the pass if no step has yet). A late context that is not back yet gets its own next step
//! run ahead with that argmax, with the next pass, so it is a hit again when it comes back:
//! a step launching early feeds its token on the GPU from the late row, like the hits'; a
//! step that waited takes it from the resolved argmax.
//!
//! **Two passes.** A step whose contexts came back with the tokens the pass in flight runs for
//! them need not wait for that pass before it launches the next: each hit's next row takes as
//! its token the argmax of its row in the pass in flight, read from that pass's keys on the
//! GPU (`batch_feed`, before the next pass's embedding clears them), and everything else of
//! the step runs late in the same pass. Only then does the step wait for the pass in flight
//! (its keys come back through page-locked memory, copied right behind it, so the wait does
//! not include the pass just launched) and hand out its argmax. The GPU goes from one pass to
//! the next without waiting for the host. A step that has work for a session's own stream (a
//! long prompt, a lone decode), or a context whose late rows are in the pass in flight, waits
//! first, as above.
//!
//! **Two steps ahead.** A greedy context whose guest is not back when the next pass is
//! launched (the step waits for the last step's contexts only until shortly before the pass
//! in flight ends, `WASI_NN_HOST_GATHER_MARGIN_US`) still gets its next row in it, fed from
//! its row in the pass in flight: up to two steps run ahead of a guest
//! (`WASI_NN_HOST_AHEAD_DEPTH`), each writing its own logits buffer of the session's three
//! (neither the one the guest reads nor the other step's). Results wait by context and
//! position until the guest comes back to that position with that token; a guest that comes
//! back with anything else loses all of them.
//!
//! **Batch invariance** (`WASI_NN_HOST_BATCH_INVARIANT`, [`super::Gpu::batch_invariant`]). By
//! default a row's logits may differ in their last bits with its company: cuBLAS's products
//! (past 64 rows, and the LM head) depend on the rows, the attention's grid of spans on the
//! step, and a lone decode runs its own kernels. With the switch every product and the LM head
//! run on our kernel at every size, each product's K always cut into the same slices (folded in
//! the kernel past 64 rows); each row's attention takes spans of its own length; lone decodes
//! and prompts up to a pass's rows run in batched passes. A context's logits are then the same
//! bits whatever shares its steps, and alone.
//!
//! Sessions come from an idle list (their caches and graphs reused, emptied on the way) and
//! hold a reservation of their KV bytes in a [`KvPool`]: a context over the cap is refused
//! alone. `CudaBatch::warm` makes sessions and graphs ahead of the first requests.

use super::blas::Blas;
use super::buffer::{Act, DevBuf, DevPtr, HostCopy};
use super::error::{CudaError, DriverContext};
use super::loaded::LoadedModel;
use super::ops::batch::{
    batch_gemm_plan, batch_gemm_suits, BatchAttention, BatchEpilogue, ResidualNorm, RowTable,
    Update, BATCH_ATT_SPAN, BATCH_ATT_SPLITS,
};
use super::ops::matvec::argmax_row;
use super::ops::{Epilogue, Launcher};
use super::session::{CudaSession, LOGITS_BUFFERS};
use super::weights::head_rows;
use crate::engine::batch::{AheadCounts, BatchModel, KvPool, SeqState, StepItem};
use crate::engine::{EngineError, GpuDtype, Session};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream};
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Most rows of one batched pass (a step with more runs several, in order): 256 streams'
/// decodes and a prompt's late rows beside them.
pub const MAX_ROWS: usize = 320;

/// Prompts (and chunks) of at most this many tokens go through the batched step, one row a
/// token; longer ones run on their session's own stream (the prefill path's tensor-core
/// attention).
const BATCHED_PROMPT: usize = 64;

/// Positions one block of the batched attention takes before a row is split in more spans
/// (up to [`BATCH_ATT_SPLITS`]) and combined.
const SPAN: usize = BATCH_ATT_SPAN;

/// [`SPAN`] when batch-invariant, where the wave's limit is off: rows of up to this many
/// positions (every stream of a 128-token request) still take one span and no combine.
const INVARIANT_SPAN: usize = 4 * SPAN;

/// The spans of the batched attention's grid: one per `span` positions of the longest row
/// (short rows: one, and no combine pass), at most [`BATCH_ATT_SPLITS`], and no more than keep
/// the blocks (`row_heads` x spans) within one `wave` of the GPU (0: no limit). Past a wave,
/// more spans only add blocks that wait for a free SM, and the combine. Each row takes one
/// span per `span` of its own positions, at most the grid's (`ba_row_spans` in
/// `kernels/batch.cu`): without the wave's limit, a row's spans depend on the row alone.
fn attention_splits(longest: usize, row_heads: usize, wave: usize, span: usize) -> usize {
    let splits = longest.div_ceil(span).clamp(1, BATCH_ATT_SPLITS);
    match wave {
        0 => splits,
        _ => splits.min(wave / row_heads.max(1)).max(1),
    }
}

/// The rows a step of `rows` runs as (its graph's size): powers of two to 8, then multiples
/// of 8 to 64, then of 32.
pub fn bucket(rows: usize) -> usize {
    match rows {
        0..=8 => rows.next_power_of_two(),
        9..=64 => rows.div_ceil(8) * 8,
        _ => (rows.div_ceil(32) * 32).min(MAX_ROWS),
    }
}

/// A captured step: (rows as its bucket, attention spans, whether prompt rows are in it).
/// Every session of a batch has the same cache layout (`layer_floats`), which the graph
/// bakes in.
type GraphKey = (usize, usize, bool);

/// Floats between two rows of the LM head's product, and the product's N: V rounded up to
/// [`head_rows`] (wte's zero rows past V give zero columns, which no one reads).
fn head_ld(vocab: usize) -> usize {
    head_rows(vocab)
}

/// Sessions not in use, and the pool their KV caches are reserved from; what contexts share
/// beyond a step (the work run ahead, the batched step's stream).
struct Idle {
    sessions: Mutex<Vec<CudaSession>>,
    max_idle: usize,
    pool: Arc<KvPool>,
    /// Device bytes of one session (its KV cache and buffers), reserved in the pool.
    session_bytes: usize,
    /// Steps run ahead (see the module docs). Lock order: `ahead`, then the step's buffers.
    ahead: Mutex<Ahead>,
    /// The batched step's stream, once made.
    stream: OnceLock<Arc<CudaStream>>,
    /// The batched step's buffers, made at the first batched step.
    buffers: Mutex<Option<StepBuffers>>,
    /// The next context's serial number.
    serials: AtomicU64,
    /// Contexts open (made and not yet dropped).
    live: AtomicUsize,
}

impl Idle {
    fn ahead(&self) -> MutexGuard<'_, Ahead> {
        // plain bookkeeping, consistent even if a holder panicked
        self.ahead.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lock, once the pass in flight has ended if `holds` it (a pass with this caller's
    /// rows), and with that pass resolved. The wait itself is outside the lock: the next
    /// step may launch its pass before the one in flight ends (see "Two passes") only while
    /// that pass is still in flight for it to resolve.
    fn wait_for_pass(&self, holds: impl Fn(&InFlight) -> bool) -> MutexGuard<'_, Ahead> {
        let ahead = self.ahead();
        let Some((id, done)) = (ahead.in_flight.as_ref())
            .filter(|f| holds(f))
            .map(|f| (f.id, f.keys.done()))
        else {
            return ahead;
        };
        drop(ahead);
        // an error shows when the pass is resolved
        let _ = wait_idle(&done);
        let mut ahead = self.ahead();
        if ahead.in_flight.as_ref().is_some_and(|f| f.id == id) {
            // it has ended: resolving it does not wait
            self.resolve(&mut ahead);
        }
        ahead
    }

    /// Wait for the pass run ahead, if one is under way, and keep its results: the guesses'
    /// for the contexts' next steps, the late rows' for their contexts to read (and a guess
    /// of their next step, for the next pass run ahead).
    fn resolve(&self, ahead: &mut Ahead) {
        let Some(flight) = ahead.in_flight.take() else {
            return;
        };
        let waited = Instant::now();
        // the copy of the pass's keys (queued behind it; a pass launched after it may be
        // running already)
        let keys = flight.keys.wait();
        // the pass ended while we waited: its time is known
        if waited.elapsed() > Duration::from_micros(20) {
            ahead.took = flight.launched.elapsed();
        }
        // (or earlier: the pass after it began no later than now)
        ahead.resolved = Some(Instant::now());
        let span = |from: &CudaEvent, to: &CudaEvent| {
            from.elapsed_ms(to).map_or(Duration::ZERO, |ms| {
                Duration::from_secs_f32(ms.max(0.0) / 1e3)
            })
        };
        // both events are behind the keys just read: no wait
        let last = ahead.last_timing.take();
        ahead.gpu_gap = Duration::ZERO;
        if let Some((begin, end)) = &flight.timing {
            ahead.gpu_time = span(begin, end);
            if let Some((_, last_end)) = &last {
                ahead.gpu_gap = span(last_end, begin);
            }
        }
        ahead.spare_keys.push(flight.keys);
        ahead.spare_timing.extend(last);
        ahead.last_timing = flight.timing;
        let keys = match keys {
            Ok(keys) => keys,
            Err(e) => {
                tracing::warn!("a step run ahead failed: {e}");
                for late in flight.late {
                    ahead.late_done.insert(late.serial, None);
                }
                return;
            }
        };
        let key = |row: usize| argmax_row(keys.get(row).copied().unwrap_or(0));
        for r in flight.rows {
            let guess = Guess {
                token: r.token,
                argmax: key(r.row),
                buffer: r.buffer,
            };
            ahead.ready.insert((r.serial, r.position), guess);
        }
        for late in flight.late {
            let argmax = key(late.row);
            ahead.late_done.insert(late.serial, Some(argmax));
            if let Some(mut next) = late.next {
                next.token = argmax;
                ahead.follow.insert(late.serial, next);
            }
        }
    }
}

/// Wait for `done` without keeping a core busy (the event spins in `synchronize`): the waiter
/// is a guest's thread or a closing context, beside the guests and the steps on the same
/// cores, and ~0.1 ms more for it is nothing beside a pass.
fn wait_idle(done: &CudaEvent) -> Result<(), cudarc::driver::DriverError> {
    done.context().bind_to_thread()?;
    while !done.try_is_complete()? {
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(())
}

/// The first `room` follows (see [`Ahead::follow`]), taken out; the rest stay for a later pass.
fn take_follows(ahead: &mut Ahead, room: usize) -> Vec<(u64, NextStep)> {
    let serials: Vec<u64> = ahead.follow.keys().take(room).copied().collect();
    (serials.into_iter())
        .filter_map(|serial| Some((serial, ahead.follow.remove(&serial)?)))
        .collect()
}

/// A row of a step run ahead: which context, at which position, with which token.
struct AheadRow {
    serial: u64,
    position: usize,
    token: u32,
    /// The token is fed on the GPU and not known yet (see [`NextStep::fed`]).
    fed: bool,
    /// The row of the batched pass.
    row: usize,
    /// The session's logits buffer it writes.
    buffer: usize,
}

/// Where a context's rows go: what a row run ahead for it needs without its session.
#[derive(Clone, Copy)]
struct Seat {
    k: u64,
    v: u64,
    layer_floats: usize,
    capacity: usize,
    logits: [u64; LOGITS_BUFFERS],
}

impl Seat {
    fn of(session: &CudaSession) -> Self {
        let (k, v, _) = session.row_addresses();
        Self {
            k,
            v,
            layer_floats: session.layer_floats(),
            capacity: session.capacity(),
            logits: std::array::from_fn(|b| session.logits_at(b)),
        }
    }
}

/// A context as its last step left it, for steps run ahead while its guest is away.
struct GuestAt {
    /// Its guest's position (the rows run ahead start there).
    len: usize,
    /// The logits buffer its guest reads.
    readable: usize,
    /// Steps may be run ahead for it (its guest reads only the argmax).
    greedy: bool,
    seat: Seat,
    /// The argmax of its guest's last position when known on the host (after its step, or a
    /// result its guest took without one): the token of the step after it.
    argmax: Option<u32>,
}

/// A context's rows in a pass run ahead whose step did not wait for them (see the module
/// docs): its guest reads their result once the pass is resolved.
struct LateRow {
    serial: u64,
    /// The row of its last token.
    row: usize,
    /// Its next step, to run ahead with the argmax (a greedy context with room left).
    next: Option<NextStep>,
}

/// A context's next step to run ahead: one token at its next position, its logits into the
/// buffer its guest is not reading. Taken from its session by the step launching it, or kept
/// for a context whose rows ran late and that is not in that step.
struct NextStep {
    token: u32,
    /// The token is the argmax of this row of the pass launched before, fed on the GPU (that
    /// pass was not resolved when this one was launched; `token` is set once it is).
    fed: Option<usize>,
    position: usize,
    seat: Seat,
    /// The logits buffer it writes: neither the one its guest reads nor one another step run
    /// ahead for it writes.
    buffer: usize,
}

impl NextStep {
    fn rows(&self) -> Rows<'_> {
        Rows {
            k: self.seat.k,
            v: self.seat.v,
            logits: self.seat.logits[self.buffer],
            start: self.position,
            tokens: std::slice::from_ref(&self.token),
            fed: self.fed,
            layer_floats: self.seat.layer_floats,
        }
    }
}

/// A step run ahead that is launched and not yet waited for.
struct InFlight {
    /// Which pass (counted from 1), to tell it from a later one.
    id: u64,
    rows: Vec<AheadRow>,
    late: Vec<LateRow>,
    /// Rows of the pass (its argmax keys to read).
    n: usize,
    launched: Instant,
    /// The copy of its argmax keys to the host, queued right behind it.
    keys: HostCopy<u64>,
    /// Events around it on the GPU (for its time in the trace), when they could be made.
    timing: Option<(CudaEvent, CudaEvent)>,
}

/// The result of a step run ahead for one context (at the position it is kept under), kept
/// until its guest comes back to that position.
#[derive(Clone, Copy)]
struct Guess {
    token: u32,
    argmax: u32,
    buffer: usize,
}

#[derive(Default)]
struct Ahead {
    in_flight: Option<InFlight>,
    /// Results run ahead, by context and position.
    ready: FxHashMap<(u64, usize), Guess>,
    /// Each context as its last step left it.
    guests: FxHashMap<u64, GuestAt>,
    /// The argmax of late rows resolved, until their context's next step (None: the pass
    /// failed).
    late_done: FxHashMap<u64, Option<u32>>,
    /// Steps to run ahead, with the next pass, for contexts whose late rows were resolved.
    follow: FxHashMap<u64, NextStep>,
    /// How long the last pass run ahead took from its launch, as the step that waited for it
    /// saw it.
    took: Duration,
    /// When the last pass run ahead was resolved (it had ended by then).
    resolved: Option<Instant>,
    /// The GPU time of the last pass resolved, between its events: what the batched pass
    /// itself costs, for the trace.
    gpu_time: Duration,
    /// The GPU's time from the end of the pass resolved before it to the begin of the last
    /// one (other work, or the GPU waiting for the host), for the trace.
    gpu_gap: Duration,
    /// The last resolved pass's events (its end is where the next one's gap begins).
    last_timing: Option<(CudaEvent, CudaEvent)>,
    /// Host buffers for passes' keys and event pairs, kept for the next passes.
    spare_keys: Vec<HostCopy<u64>>,
    spare_timing: Vec<(CudaEvent, CudaEvent)>,
    /// Contexts that came back with the guessed token, and those that did not.
    hits: u64,
    misses: u64,
    /// Rows that ran late.
    late: u64,
    /// Passes launched before the pass in flight had ended.
    early: u64,
    /// Results taken without a step ([`BatchModel::take_ready`]).
    taken: u64,
    /// How long a step takes to launch its pass run ahead, averaged (see
    /// [`BatchModel::gather`]).
    launch: Duration,
    /// Passes run ahead so far (the last one's [`InFlight::id`]).
    flights: u64,
}

/// One context's state: its session, and its reservation in the pool (given back with it).
pub struct CudaSeq {
    session: Option<CudaSession>,
    idle: Arc<Idle>,
    serial: u64,
    /// The guest read logits since the last step (it samples: no step is run ahead for it).
    read_logits: AtomicBool,
    /// Its last rows ran late (in a pass run ahead its step did not wait for): their argmax
    /// is in `Ahead::late_done` once the pass is resolved, and the logits are not read before.
    late: AtomicBool,
}

impl CudaSeq {
    fn session(&self) -> Result<&CudaSession, EngineError> {
        self.session
            .as_ref()
            .ok_or_else(|| EngineError::device("session already released"))
    }

    fn session_mut(&mut self) -> Result<&mut CudaSession, EngineError> {
        self.session
            .as_mut()
            .ok_or_else(|| EngineError::device("session already released"))
    }

    /// The argmax of this context's late rows (None when its last rows were not late),
    /// waiting for their pass if it is still under way.
    fn settle(&self) -> Result<Option<u32>, EngineError> {
        if !self.late.load(Ordering::Acquire) {
            return Ok(None);
        }
        let serial = self.serial;
        let ahead = self
            .idle
            .wait_for_pass(|f| f.late.iter().any(|l| l.serial == serial));
        match ahead.late_done.get(&self.serial) {
            Some(Some(argmax)) => Ok(Some(*argmax)),
            Some(None) => Err(EngineError::device("the batched step failed")),
            None => Err(EngineError::device("the batched step's result is lost")),
        }
    }
}

impl Drop for CudaSeq {
    fn drop(&mut self) {
        {
            // a step run ahead may still be writing this context's cache and logits
            let mut ahead = self.idle.ahead();
            let serial = self.serial;
            ahead.ready.retain(|&(s, _), _| s != serial);
            ahead.guests.remove(&serial);
            ahead.late_done.remove(&self.serial);
            ahead.follow.remove(&self.serial);
            // its rows are taken out of the pass in flight too, or resolving the pass would
            // keep a result for a context that never comes back
            let running = ahead.in_flight.as_mut().and_then(|f| {
                let before = f.rows.len() + f.late.len();
                f.rows.retain(|r| r.serial != self.serial);
                f.late.retain(|l| l.serial != self.serial);
                (f.rows.len() + f.late.len() < before).then(|| f.keys.done())
            });
            drop(ahead);
            // wait for that pass to end without holding the steps up (the pass after it may
            // be launched meanwhile; it has no rows of this context)
            if running.is_some_and(|done| wait_idle(&done).is_err()) {
                // not known to be done: the session is not reused
                self.session = None;
            }
        }
        self.idle.pool.release(self.idle.session_bytes);
        self.idle.live.fetch_sub(1, Ordering::Relaxed);
        if let Some(mut session) = self.session.take() {
            // nothing of this sequence stays readable, nor in flight, when it is reused
            if session.synchronize().is_err() {
                return;
            }
            session.reset();
            if let Ok(mut idle) = self.idle.sessions.lock() {
                if idle.len() < self.idle.max_idle {
                    idle.push(session);
                }
            }
        }
    }
}

impl SeqState for CudaSeq {
    fn len(&self) -> usize {
        self.session.as_ref().map_or(0, Session::len)
    }
    fn truncate(&mut self, len: usize) {
        if let Some(s) = self.session.as_mut() {
            s.truncate(len);
        }
    }
    fn last_logits(&self) -> Result<Vec<f32>, EngineError> {
        self.read_logits.store(true, Ordering::Relaxed);
        self.settle()?;
        self.session()?.logits_now()
    }
    fn all_logits(&self) -> Result<Vec<f32>, EngineError> {
        self.read_logits.store(true, Ordering::Relaxed);
        self.settle()?;
        self.session()?.all_logits_now()
    }
    fn argmax(&self) -> Result<u32, EngineError> {
        match self.settle()? {
            Some(argmax) => Ok(argmax),
            None => self.session()?.argmax_now(),
        }
    }
}

/// The batched step's buffers on its own stream, made at the first batched step.
struct StepBuffers {
    launcher: Launcher,
    blas: Blas,
    /// Residual stream `[MAX_ROWS, C]`.
    x: DevBuf<f32>,
    /// Product inputs: f32 `[MAX_ROWS, 4C]`, or the same bytes as split bf16 rows
    /// `[2 * MAX_ROWS, 4C]`.
    act: DevBuf<f32>,
    /// The LM head's product rows `[2 * MAX_ROWS, head_ld(V)]`.
    head: DevBuf<f32>,
    partial: DevBuf<f32>,
    /// Tokens `[MAX_ROWS]`, positions `[MAX_ROWS]`, then the rows of the pass before whose
    /// argmax is a row's token (`[MAX_ROWS]`, -1: none; see [`NextStep::fed`]).
    ints: DevBuf<i32>,
    /// Key caches, value caches, logits buffers: `[MAX_ROWS]` addresses each.
    addrs: DevBuf<u64>,
    keys: DevBuf<u64>,
    /// Captured steps.
    graphs: FxHashMap<GraphKey, CudaGraph>,
    graphs_failed: bool,
}

// SAFETY: the buffers are only touched by the step that holds the mutex around them; the raw
// handles in `Blas` and `CudaGraph` are used from that one thread at a time.
unsafe impl Send for StepBuffers {}

impl StepBuffers {
    fn new(exec: &Arc<LoadedModel>) -> Result<Self, CudaError> {
        let gpu = exec.gpu.clone();
        let cfg = exec.config;
        let c = cfg.n_embd;
        let stream = gpu.ctx.new_stream().ctx("creating a stream")?;
        let blas = Blas::new(&stream, 2 * MAX_ROWS, c, false)
            .ok_or_else(|| CudaError::unavailable("cuBLAS is not loadable"))?;
        let launcher = Launcher::new(gpu, stream.clone(), exec.kernels.clone(), cfg, exec.dtype);
        let zeros = |len, what| DevBuf::<f32>::zeros(&stream, len, what);
        Ok(Self {
            x: zeros(MAX_ROWS * c, "batched activations")?,
            act: zeros(MAX_ROWS * 4 * c, "batched activations")?,
            head: zeros(2 * MAX_ROWS * head_ld(cfg.vocab_size), "batched logits")?,
            partial: zeros(
                MAX_ROWS * cfg.n_head * BATCH_ATT_SPLITS * (cfg.head_dim() + 2),
                "batched attention scratch",
            )?,
            ints: DevBuf::zeros(&stream, 3 * MAX_ROWS, "batched step table")?,
            addrs: DevBuf::zeros(&stream, 3 * MAX_ROWS, "batched step table")?,
            keys: DevBuf::zeros(&stream, MAX_ROWS, "batched step table")?,
            launcher,
            blas,
            graphs: FxHashMap::default(),
            graphs_failed: false,
        })
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.launcher.stream()
    }

    /// The table of the first `rows` rows (fixed addresses: every graph reads it).
    fn table(&self, rows: usize, layer_floats: usize) -> RowTable {
        let (ints, addrs) = (self.ints.ptr(), self.addrs.ptr());
        let part = |p: DevPtr<u64>, i: usize| p.skip(i * MAX_ROWS);
        RowTable {
            rows,
            tokens: ints,
            positions: ints.skip(MAX_ROWS),
            k_caches: part(addrs, 0),
            v_caches: part(addrs, 1),
            logits: part(addrs, 2),
            keys: self.keys.ptr(),
            layer_floats,
        }
    }
}

/// GPT-2 on the GPU for the engine's batcher (see the module docs).
pub struct CudaBatch {
    exec: Arc<LoadedModel>,
    idle: Arc<Idle>,
}

impl CudaBatch {
    pub(crate) fn new(exec: Arc<LoadedModel>, pool: Arc<KvPool>, max_idle: usize) -> Self {
        let cfg = exec.config;
        let per_position = 2 * cfg.n_layer * cfg.n_embd * exec.dtype.kv_bytes();
        let capacity = cfg.n_ctx.min(exec.max_kv_bytes / per_position.max(1));
        Self {
            idle: Arc::new(Idle {
                sessions: Mutex::new(Vec::new()),
                max_idle,
                pool,
                session_bytes: CudaSession::device_bytes(&cfg, exec.dtype, capacity),
                ahead: Mutex::new(Ahead::default()),
                stream: OnceLock::new(),
                buffers: Mutex::new(None),
                serials: AtomicU64::new(0),
                live: AtomicUsize::new(0),
            }),
            exec,
        }
    }

    /// Make `n` idle sessions ready (allocated, set up) for the first contexts.
    /// With them, the batched step's graphs of every size are captured too,
    /// and each session's decode step: a capture holds up every context on the GPU, so none
    /// is left for the first requests.
    pub(crate) fn warm(&self, n: usize) -> Result<(), EngineError> {
        let mut made = (0..n)
            .map(|_| CudaSession::new(self.exec.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        made.iter_mut().for_each(CudaSession::capture_decode);
        let layer_floats = made.first().map(CudaSession::layer_floats);
        self.idle
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(made);
        let (Some(layer_floats), true) = (layer_floats, self.exec.gpu.measurement().graphs) else {
            return Ok(());
        };
        self.with_buffers(|b| {
            // every size: prompt rows make a step bigger than its contexts
            let mut sizes: Vec<usize> = (1..=MAX_ROWS).map(bucket).collect();
            sizes.dedup();
            for padded in sizes {
                // the spans a step of this size can ask for
                let most = attention_splits(
                    usize::MAX,
                    padded * self.exec.config.n_head,
                    self.wave(),
                    self.span(),
                );
                for splits in 1..=most {
                    for prompts in [false, true] {
                        self.capture(b, (padded, splits, prompts), layer_floats);
                    }
                }
            }
            Ok(())
        })
    }

    /// Blocks of the batched attention the GPU runs at once (see [`attention_splits`]; 0, no
    /// limit, when batch-invariant).
    fn wave(&self) -> usize {
        let gpu = &self.exec.gpu;
        match gpu.batch_invariant() {
            true => 0,
            false => gpu.measurement().batch_wave.unwrap_or(8 * gpu.sms()),
        }
    }

    /// Positions a span of the batched attention takes (see [`attention_splits`]).
    fn span(&self) -> usize {
        match self.exec.gpu.batch_invariant() {
            true => INVARIANT_SPAN,
            false => SPAN,
        }
    }

    /// The most tokens of a prompt (or chunk) that run in a batched pass: [`BATCHED_PROMPT`],
    /// or when batch-invariant every chunk a pass holds (the prefill path's products and
    /// attention are not the pass's).
    fn batched_prompt(&self) -> usize {
        match self.exec.gpu.batch_invariant() {
            true => MAX_ROWS,
            false => BATCHED_PROMPT,
        }
    }

    /// `f` with the step's buffers (made at first use) locked.
    fn with_buffers<R>(
        &self,
        f: impl FnOnce(&mut StepBuffers) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut guard = self.idle.buffers.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            let made = StepBuffers::new(&self.exec)?;
            let _ = self.idle.stream.set(made.stream().clone());
            *guard = Some(made);
        }
        match guard.as_mut() {
            Some(b) => f(b),
            None => Err(EngineError::device("batched step buffers missing")),
        }
    }

    /// The graph of `key` captured into `b.graphs` unless it is there, graphs are off, or a
    /// capture failed before (then steps run kernel by kernel from here on).
    fn capture(&self, b: &mut StepBuffers, key: GraphKey, layer_floats: usize) {
        if !self.exec.gpu.measurement().graphs || b.graphs_failed || b.graphs.contains_key(&key) {
            return;
        }
        let (padded, splits, prompts) = key;
        let table = b.table(padded, layer_floats);
        let stream = b.stream().clone();
        let launches = || self.step_kernels(b, &table, splits, prompts);
        match self.exec.gpu.capture(&stream, launches) {
            Ok(Some(graph)) => {
                b.graphs.insert(key, graph);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("batched step capture failed, running steps eagerly: {e}");
                b.graphs_failed = true;
            }
        }
    }

    /// The pool the contexts' KV caches are reserved from.
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.idle.pool
    }

    /// Contexts open now.
    pub fn live(&self) -> usize {
        self.idle.live.load(Ordering::Relaxed)
    }

    /// The kernels of one batched step over the table's rows.
    fn step_kernels(
        &self,
        b: &StepBuffers,
        t: &RowTable,
        splits: usize,
        prompts: bool,
    ) -> Result<(), CudaError> {
        let (cfg, w) = (self.exec.config, &self.exec.weights);
        let (c, v, n) = (cfg.n_embd, cfg.vocab_size, t.rows);
        let l = &b.launcher;
        let split = self.exec.dtype == GpuDtype::Bf16;
        let act = match split {
            true => Act::Bf16(b.act.ptr().cast()),
            false => Act::F32(b.act.ptr()),
        };
        let product_rows = if split { 2 * n } else { n };
        let tmp = b.blas.tmp.ptr();
        let x = b.x.ptr();
        // `WASI_NN_HOST_SKIP` leaves parts out, to measure what the rest costs (wrong results)
        let skip = &self.exec.gpu.measurement().skip;
        // Steps of up to `batch_gemm_rows` rows (64 on sm_90+; every step when batch-invariant)
        // use our tensor-core kernel where it fits (bf16) and suits the shape (small weights, a
        // plan that fills the GPU); batch-invariant, every product it can take (GPT-2's
        // widths), suited or not. Each product's K is cut the same way at every step size, so a
        // row's results do not depend on the rows beside it. The hi and lo rows are summed in
        // the kernel. Returns how the next kernel reads the product: (its input was split,
        // planes).
        let ours = n <= self.exec.gpu.batch_gemm_rows();
        let invariant = self.exec.gpu.batch_invariant();
        let sms = self.exec.gpu.sms();
        let product = |w: DevPtr<_>, n_out: usize, k: usize| -> Result<(bool, usize), CudaError> {
            if let (true, Act::Bf16(a)) = (ours, act) {
                if invariant || batch_gemm_suits((n_out, k), sms) {
                    let plan = batch_gemm_plan(n, n_out, k, sms, tmp.len());
                    if let Some(ran) = l.batch_gemm(w, a, (n, n_out, k), tmp, plan) {
                        return ran.map(|()| (false, plan.planes));
                    }
                }
            }
            b.blas
                .gemm(l, w, act, (product_rows, n_out, k), (tmp, n_out), false)
                .map(|()| (split, 1))
        };

        // x += the product (its `parts` planes) and its bias, then the LayerNorm `norm` into act
        let residual_norm = |bias, norm, (split, parts)| {
            if skip.ln {
                return Ok(());
            }
            let update = Update::Product {
                tmp,
                bias,
                split,
                parts,
            };
            l.batch_residual_norm(
                t,
                ResidualNorm {
                    x,
                    update,
                    norm,
                    out: act,
                },
            )
        };
        let embed = Update::Embed {
            wte: w.wte.ptr(),
            wpe: w.wpe.ptr(),
        };
        let first_norm = w.layers.first().map_or(w.lnf(), |lw| lw.ln1());
        l.batch_residual_norm(
            t,
            ResidualNorm {
                x,
                update: embed,
                norm: first_norm,
                out: act,
            },
        )?;
        for (i, lw) in w.layers.iter().enumerate() {
            let (qkv_split, qkv_parts) = product(lw.qkv_w.ptr(), 3 * c, c)?;
            if prompts {
                // rows of one prompt read each other's keys: all appended first
                l.batch_append_kv(t, tmp, lw.qkv_b.ptr(), (qkv_split, qkv_parts), i)?;
            }
            let attention = BatchAttention {
                out: act,
                tmp,
                bias: lw.qkv_b.ptr(),
                split: qkv_split,
                parts: qkv_parts,
                partial: b.partial.ptr(),
                layer: i,
                splits,
                span: self.span(),
                append: !prompts,
            };
            if !skip.attn {
                l.batch_attention(t, attention)?;
            }
            let parts = product(lw.proj_w.ptr(), c, c)?;
            residual_norm(lw.proj_b.ptr(), lw.ln2(), parts)?;
            let (fc_split, fc_parts) = product(lw.fc_w.ptr(), 4 * c, c)?;
            let gelu = BatchEpilogue {
                out: act,
                tmp,
                bias: lw.fc_b.ptr(),
                n: 4 * c,
                epilogue: Epilogue::Gelu,
                split: fc_split,
                parts: fc_parts,
            };
            if !skip.epi {
                l.batch_epilogue(t, gelu)?;
            }
            let parts = product(lw.fc_proj_w.ptr(), c, 4 * c)?;
            let next_norm = w.layers.get(i + 1).map_or(w.lnf(), |next| next.ln1());
            residual_norm(lw.fc_proj_b.ptr(), next_norm, parts)?;
        }
        let (head, ld) = (b.head.ptr(), head_ld(v));
        if skip.head {
            return Ok(());
        }
        // batch-invariant: the LM head on our kernel too (one slice: its many column tiles
        // fill the GPU), so a row's logits do not depend on the step either
        if let (true, Act::Bf16(a)) = (ours && invariant, act) {
            let plan = batch_gemm_plan(n, ld, c, sms, head.len());
            if plan.planes == 1 {
                if let Some(ran) = l.batch_gemm(w.wte.ptr(), a, (n, ld, c), head, plan) {
                    ran?;
                    return l.batch_logits(t, head, ld, false);
                }
            }
        }
        b.blas.gemm(
            l,
            w.wte.ptr(),
            act,
            (product_rows, ld, c),
            (head, ld),
            false,
        )?;
        l.batch_logits(t, head, ld, split)
    }

    /// Upload the table of `inputs` (at most [`MAX_ROWS`] rows together) and launch their
    /// batched pass, one row per token at its position, without waiting for it; returns the
    /// row of each input's last token.
    fn launch_rows(
        &self,
        b: &mut StepBuffers,
        inputs: &[Rows<'_>],
    ) -> Result<(usize, Vec<usize>), EngineError> {
        let n: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        // a pass of no rows would capture its bucket's graph with no context's cache layout
        if n == 0 {
            return Err(EngineError::device("a batched pass of no rows"));
        }
        let padded = bucket(n);
        let prompts = inputs.iter().any(|i| i.tokens.len() > 1);
        let mut ints = vec![0i32; 3 * MAX_ROWS];
        let mut addrs = vec![0u64; 3 * MAX_ROWS];
        ints[MAX_ROWS + n..MAX_ROWS + padded].fill(-1);
        ints[2 * MAX_ROWS..].fill(-1);
        let mut fed = false;
        let (mut layer_floats, mut longest, mut r) = (0, 0, 0);
        let mut last_rows = Vec::with_capacity(inputs.len());
        for input in inputs {
            for (i, &token) in input.tokens.iter().enumerate() {
                ints[r] = token as i32;
                ints[MAX_ROWS + r] = (input.start + i) as i32;
                if let (Some(source), 1) = (input.fed, input.tokens.len()) {
                    ints[2 * MAX_ROWS + r] = source as i32;
                    fed = true;
                }
                addrs[r] = input.k;
                addrs[MAX_ROWS + r] = input.v;
                // logits for the input's last row only
                if i + 1 == input.tokens.len() {
                    addrs[2 * MAX_ROWS + r] = input.logits;
                    last_rows.push(r);
                }
                r += 1;
            }
            layer_floats = input.layer_floats;
            longest = longest.max(input.start + input.tokens.len());
        }
        let splits = attention_splits(
            longest,
            padded * self.exec.config.n_head,
            self.wave(),
            self.span(),
        );
        let key = (padded, splits, prompts);
        let stream = b.stream().clone();
        let t0 = Instant::now();
        b.ints.write(&stream, 0, &ints)?;
        b.addrs.write(&stream, 0, &addrs)?;
        self.capture(b, key, layer_floats);
        let table = b.table(padded, layer_floats);
        if fed {
            // the pass before has left its keys; this pass's embedding clears them
            b.launcher
                .batch_feed(&table, b.ints.ptr().skip(2 * MAX_ROWS))?;
        }
        let t1 = Instant::now();
        let graphed = match b.graphs.get(&key).filter(|_| !b.graphs_failed) {
            Some(graph) => {
                graph.launch().ctx("batched step")?;
                true
            }
            None => {
                self.step_kernels(b, &table, splits, prompts)?;
                false
            }
        };
        tracing::trace!(
            rows = n,
            graphed,
            upload_us = (t1 - t0).as_micros() as u64,
            launch_us = t1.elapsed().as_micros() as u64,
            "batched rows launched"
        );
        Ok((n, last_rows))
    }

    /// The tokens of `items` (each admitted, at most [`MAX_ROWS`] rows together) as one
    /// batched step; on success each session has its new positions, its last row's logits
    /// and their argmax.
    fn run_rows(&self, items: &mut [&mut StepItem<'_, CudaSeq>]) -> Result<(), EngineError> {
        let mut inputs = Vec::with_capacity(items.len());
        for item in items.iter() {
            let session = item.seq.session()?;
            let (k, v, logits) = session.row_addresses();
            inputs.push(Rows {
                k,
                v,
                logits,
                start: session.len(),
                tokens: item.tokens,
                fed: None,
                layer_floats: session.layer_floats(),
            });
        }
        let started = Instant::now();
        let (n, last_rows, keys) = self.with_buffers(|b| {
            let (n, last_rows) = self.launch_rows(b, &inputs)?;
            Ok((n, last_rows, b.keys.read(b.stream(), n)?))
        })?;
        tracing::trace!(
            rows = n,
            wait_us = started.elapsed().as_micros() as u64,
            "batched rows"
        );
        for (item, row) in items.iter_mut().zip(last_rows) {
            let key = keys.get(row).copied().unwrap_or(0);
            let added = item.tokens.len();
            item.seq
                .session_mut()?
                .advanced_in_batch(added, argmax_row(key));
        }
        Ok(())
    }

    /// A pair of events to time a pass with: a spare one, or new ones (None when there is
    /// no stream yet or no event could be made; the pass then goes untimed).
    fn timing(&self, ahead: &mut Ahead) -> Option<(CudaEvent, CudaEvent)> {
        if let Some(pair) = ahead.spare_timing.pop() {
            return Some(pair);
        }
        let stream = self.idle.stream.get()?;
        let make = || {
            stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        };
        make().and_then(|a| Ok((a, make()?))).ok()
    }

    /// A lone decode whose step was run ahead on its session's own stream, with the token
    /// guessed: take that step, and run the next one ahead for a greedy guest (its argmax comes
    /// back once the step taken ends). False for any other step (a step run ahead for it is
    /// forgotten: the step waits for it before anything else uses the session).
    fn lone_hit(&self, item: &mut StepItem<'_, CudaSeq>) -> bool {
        let [token] = *item.tokens else {
            return false;
        };
        if item.all_positions || item.error.is_some() {
            return false;
        }
        if !item
            .seq
            .session_mut()
            .is_ok_and(|s| s.take_ahead_decode(token))
        {
            return false;
        }
        let sampled = item.seq.read_logits.swap(false, Ordering::Relaxed);
        let ran = item.seq.session_mut().and_then(|s| {
            match sampled || !self.exec.gpu.measurement().run_ahead {
                true => Ok(None),
                false => s.launch_ahead_decode(),
            }
        });
        if let Err(e) = ran {
            item.error = Some(e);
        }
        true
    }

    /// The step's batched items (`batched`, in order) as batched passes, waited for; a lone
    /// decode runs its session's captured decode step instead (and moves to `own`).
    fn run_batched(
        &self,
        items: &mut [StepItem<'_, CudaSeq>],
        batched: &mut Vec<usize>,
        own: &mut Vec<usize>,
    ) {
        if let [i] = batched[..] {
            if items[i].tokens.len() == 1 && !self.exec.gpu.batch_invariant() {
                // a lone decode keeps its own captured decode step
                let item = &mut items[i];
                let token = item.tokens;
                item.error = item
                    .seq
                    .session_mut()
                    .and_then(|s| s.extend_chunk(token, false, false))
                    .err();
                own.push(i);
                batched.clear();
            }
        }
        if batched.is_empty() {
            return;
        }
        let mut rows: Vec<&mut StepItem<'_, CudaSeq>> = items
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| batched.binary_search(i).is_ok())
            .map(|(_, item)| item)
            .collect();
        // groups of at most MAX_ROWS rows, in order (a context's rows never span two)
        let mut start = 0;
        while start < rows.len() {
            let (mut end, mut count) = (start, 0);
            while end < rows.len() && count + rows[end].tokens.len() <= MAX_ROWS {
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

    /// Launch the pass run ahead (see the module docs): the steps `picks` (contexts' next
    /// steps run ahead, see [`plan_ahead`], and those of contexts whose late rows were
    /// resolved) and the rows of `items[late]`, which this step does not wait for
    /// (`greedy[i]`: a step may be run ahead after them). Returns the pass for the caller to
    /// keep; on an error nothing was launched.
    fn launch_ahead(
        &self,
        ahead: &mut Ahead,
        items: &mut [StepItem<'_, CudaSeq>],
        picks: Vec<(u64, NextStep)>,
        late: &[usize],
        greedy: &[bool],
    ) -> Result<InFlight, EngineError> {
        let begun = Instant::now();
        let mut inputs: Vec<Rows<'_>> = picks.iter().map(|(_, next)| next.rows()).collect();
        for &i in late {
            let session = items[i].seq.session()?;
            let (k, v, logits) = session.row_addresses();
            inputs.push(Rows {
                k,
                v,
                logits,
                start: session.len(),
                tokens: items[i].tokens,
                fed: None,
                layer_floats: session.layer_floats(),
            });
        }
        let launched = Instant::now();
        let timing = self.timing(ahead);
        let spare = ahead.spare_keys.pop();
        let (n, last_rows, keys) = self.with_buffers(|b| {
            let stream = b.stream().clone();
            let mut keys = match spare {
                Some(keys) => keys,
                None => HostCopy::new(&stream, MAX_ROWS)?,
            };
            // timing is best-effort: an event that failed to record reads as no time
            if let Some((begin, _)) = &timing {
                let _ = begin.record(&stream);
            }
            let (n, last_rows) = self.launch_rows(b, &inputs)?;
            // the keys come back behind the pass, while the next pass may already run
            keys.start(&stream, &b.keys, n)?;
            if let Some((_, end)) = &timing {
                let _ = end.record(&stream);
            }
            Ok((n, last_rows, keys))
        })?;
        drop(inputs);
        tracing::trace!(
            picks_us = (launched - begun).as_micros() as u64,
            buffers_us = launched.elapsed().as_micros() as u64,
            "pass run ahead launched"
        );
        let mut last = last_rows.into_iter();
        let rows: Vec<AheadRow> = picks
            .iter()
            .zip(last.by_ref())
            .map(|((serial, next), row)| AheadRow {
                serial: *serial,
                position: next.position,
                token: next.token,
                fed: next.fed.is_some(),
                row,
                buffer: next.buffer,
            })
            .collect();
        let mut late_rows = Vec::with_capacity(late.len());
        for (&i, row) in late.iter().zip(last) {
            let item = &mut items[i];
            let added = item.tokens.len();
            let seq = &mut *item.seq;
            let serial = seq.serial;
            let Ok(session) = seq.session_mut() else {
                continue;
            };
            session.advanced_late(added);
            let room = session.len() < session.capacity();
            // the token is the argmax, known when the pass is resolved; the late row writes
            // the first buffer, which its guest reads next
            let next = (greedy[i] && room).then(|| NextStep {
                token: 0,
                fed: None,
                position: session.len(),
                seat: Seat::of(session),
                buffer: 1,
            });
            seq.late.store(true, Ordering::Release);
            item.late = true;
            late_rows.push(LateRow { serial, row, next });
        }
        ahead.late += late_rows.len() as u64;
        ahead.flights += 1;
        Ok(InFlight {
            id: ahead.flights,
            rows,
            late: late_rows,
            n,
            launched,
            keys,
            timing,
        })
    }
}

impl CudaBatch {
    /// Whether this step may launch its pass run ahead before the pass in flight has ended
    /// (see the module docs, "Two passes"): there is one, some contexts came back with the
    /// token run ahead for them (in that pass, or resolved before), every other item is rows
    /// of the batched step (nothing on a session's own stream, which the pass in flight may
    /// still be writing), no context's late rows are in it (their guests read them first),
    /// and everything fits one pass. Then, for each item, the row of the pass in flight whose
    /// results it takes.
    fn early_hits(
        &self,
        ahead: &Ahead,
        items: &[StepItem<'_, CudaSeq>],
    ) -> Result<Vec<Option<Taken>>, &'static str> {
        let tuning = self.exec.gpu.measurement();
        if !tuning.run_ahead || !tuning.early_launch {
            return Err("off");
        }
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
        let mut total = ahead.follow.len();
        let mut hits = Vec::with_capacity(items.len());
        let mut any = false;
        for item in items {
            let serial = item.seq.serial;
            if late.contains(&serial) {
                return Err("late rows in flight");
            }
            if item.tokens.len() > self.batched_prompt() || item.all_positions {
                return Err("a prompt of its own");
            }
            total += item.tokens.len();
            let at = (serial, item.seq.len());
            let same =
                |token: u32| item.error.is_none() && item.first_chunk && item.tokens == [token];
            let hit = (rows.get(&at))
                .filter(|r| !r.fed && same(r.token))
                .map(|r| Taken {
                    position: r.position,
                    buffer: r.buffer,
                });
            any |= hit.is_some() || ahead.ready.get(&at).is_some_and(|g| same(g.token));
            hits.push(hit);
        }
        match (total <= MAX_ROWS, any) {
            (false, _) => Err("too many rows"),
            (true, false) => Err("no hits"),
            (true, true) => Ok(hits),
        }
    }

    /// A step whose pass run ahead is launched before the pass in flight ends (`early[i]`:
    /// the row of that pass whose results item i takes; see [`Self::early_hits`]). The
    /// contexts that hit advance at once; the next pass feeds their tokens from the keys of
    /// the pass in flight on the GPU; then the step waits for the pass in flight and hands
    /// out its argmax.
    fn step_early(
        &self,
        mut ahead: MutexGuard<'_, Ahead>,
        items: &mut [StepItem<'_, CudaSeq>],
        early: &[Option<Taken>],
        started: Instant,
    ) {
        take_late(&mut ahead, items);
        let mut hit = vec![false; items.len()];
        for (i, item) in items.iter_mut().enumerate() {
            if let (Some(taken), None) = (early[i], &item.error) {
                if let Ok(session) = item.seq.session_mut() {
                    // its argmax comes when the pass in flight is resolved, below
                    session.advanced_ahead_pending(taken.buffer);
                    hit[i] = true;
                    ahead.hits += 1;
                }
                continue;
            }
            // a result resolved in an earlier step (the context was not in the last one)
            hit[i] = take_ready(&mut ahead, item);
        }
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
        let greedy = greedy(items);
        // a late row's next step goes with its late row (`LateRow::next`)
        let eligible: Vec<bool> = (0..items.len()).map(|i| greedy[i] && hit[i]).collect();
        // the argmax of the contexts that took a result resolved before (the others' comes
        // with the pass in flight)
        let argmax: Vec<Option<u32>> = (0..items.len())
            .map(|i| {
                (hit[i] && early[i].is_none())
                    .then(|| host_argmax(&items[i]))
                    .flatten()
            })
            .collect();
        let serials = self.note_guests(&mut ahead, items, &hit, &eligible, &argmax);
        let late_tokens: usize = late.iter().map(|&i| items[i].tokens.len()).sum();
        let mut room = MAX_ROWS.saturating_sub(late_tokens);
        let mut picks = plan_ahead(&ahead, &serials, self.depth());
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
        picks.extend(take_follows(&mut ahead, room));
        // nothing to run ahead (every context sampled): only the wait below
        let mut next = match picks.is_empty() && late.is_empty() {
            true => None,
            false => match self.launch_ahead(&mut ahead, items, picks, &late, &greedy) {
                Ok(flight) => {
                    ahead.early += 1;
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
        ahead.launch = (ahead.launch * 7 + launched.min(Duration::from_millis(1))) / 8;
        // now the pass in flight: its argmax for the contexts that took its rows, and the
        // tokens the next pass was fed
        self.idle.resolve(&mut ahead);
        let resolved = started.elapsed();
        // the rows fed from rows just resolved learn their tokens
        for row in next.iter_mut().flat_map(|n| n.rows.iter_mut()) {
            if !row.fed {
                continue;
            }
            let before = row.position.checked_sub(1).map(|p| (row.serial, p));
            if let Some(guess) = before.and_then(|at| ahead.ready.get(&at)) {
                (row.token, row.fed) = (guess.argmax, false);
            } else if let Some(Some(argmax)) = ahead.late_done.get(&row.serial) {
                (row.token, row.fed) = (*argmax, false);
            }
        }
        for (i, item) in items.iter_mut().enumerate() {
            let Some(taken) = early[i].filter(|_| hit[i]) else {
                continue;
            };
            let guess = ahead.ready.remove(&(item.seq.serial, taken.position));
            match (guess, item.seq.session_mut()) {
                (Some(guess), Ok(session)) => session.set_argmax(guess.argmax),
                _ => item.error = Some(EngineError::device("the batched step failed")),
            }
        }
        let run_ahead_rows = next.as_ref().map_or(0, |n| n.n);
        if let Some(mut n) = next {
            // rows whose token stayed unknown are no guess for anyone
            n.rows.retain(|r| !r.fed);
            ahead.in_flight = Some(n);
        }
        tracing::debug!(
            items = items.len(),
            hit = hits,
            late = late.len(),
            run_ahead = run_ahead_rows,
            hits = ahead.hits,
            misses = ahead.misses,
            taken = ahead.taken,
            early = true,
            resolve_us = resolved.as_micros() as u64,
            pass_gpu_us = ahead.gpu_time.as_micros() as u64,
            gap_gpu_us = ahead.gpu_gap.as_micros() as u64,
            own_launch_us = launched.as_micros() as u64,
            step_us = started.elapsed().as_micros() as u64,
            "batched step"
        );
    }

    /// How many steps may be run ahead of a guest (`WASI_NN_HOST_AHEAD_DEPTH`).
    fn depth(&self) -> usize {
        self.exec.gpu.settings().ahead_depth
    }

    /// Keep each item as this step leaves it ([`GuestAt`], with `argmax[i]` its argmax when
    /// known on the host); a context that did not take what was run ahead for it loses all of
    /// it. Returns the contexts that may get steps run ahead: the step's, then those whose
    /// guests are away with results run ahead for them (in flight or resolved) or with the
    /// argmax of a result taken without a step.
    fn note_guests(
        &self,
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
            let at = GuestAt {
                len: session.len(),
                readable: session.readable(),
                greedy: eligible[i],
                seat: Seat::of(session),
                argmax: argmax[i],
            };
            ahead.guests.insert(serial, at);
            serials.push(serial);
        }
        let mine: FxHashSet<u64> = serials.iter().copied().collect();
        let mut away: Vec<u64> = (ahead.in_flight.iter())
            .flat_map(|f| f.rows.iter().map(|r| r.serial))
            .chain(ahead.ready.keys().map(|&(serial, _)| serial))
            .chain((ahead.guests.iter()).filter_map(|(&serial, g)| g.argmax.map(|_| serial)))
            .filter(|serial| !mine.contains(serial))
            .collect();
        away.sort_unstable();
        away.dedup();
        serials.extend(away);
        serials
    }
}

/// An item's row in the pass in flight, which it takes (see [`CudaBatch::early_hits`]).
#[derive(Clone, Copy)]
struct Taken {
    position: usize,
    buffer: usize,
}

/// The next steps to run ahead (see "Two steps ahead" in the module docs): for each greedy
/// context of `serials`, the position after the last step run ahead for it (or after its
/// guest's position), while fewer than `depth` steps are ahead of its guest and its cache
/// has room. The token is the argmax of the position before: fed on the GPU from the pass in
/// flight, or known on the host (a result resolved, or [`GuestAt::argmax`]). Its logits go
/// to a buffer that neither the guest reads nor another step run ahead writes.
fn plan_ahead(ahead: &Ahead, serials: &[u64], depth: usize) -> Vec<(u64, NextStep)> {
    let in_flight = ahead.in_flight.as_ref().map_or(&[][..], |f| &f.rows[..]);
    plan_rows(in_flight, &ahead.ready, &ahead.guests, serials, depth)
}

/// [`plan_ahead`] over the rows of the pass in flight, the results resolved and the contexts.
fn plan_rows(
    in_flight: &[AheadRow],
    ready: &FxHashMap<(u64, usize), Guess>,
    guests: &FxHashMap<u64, GuestAt>,
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
        if ahead_of_guest >= depth || position >= guest.seat.capacity {
            continue;
        }
        let Some(buffer) = (0..LOGITS_BUFFERS).find(|&b| !busy[b]) else {
            continue;
        };
        let before = position.checked_sub(1).map(|p| (serial, p));
        let (token, fed) = match before.map(|at| (flight.get(&at), ready.get(&at))) {
            Some((Some(row), _)) => (0, Some(row.row)),
            Some((None, Some(guess))) => (guess.argmax, None),
            _ => match (ahead_of_guest, guest.argmax) {
                (0, Some(token)) => (token, None),
                _ => continue,
            },
        };
        let next = NextStep {
            token,
            fed,
            position,
            seat: guest.seat,
            buffer,
        };
        picks.push((serial, next));
    }
    picks
}

/// An item's argmax when known on the host (read back if its step ran on its own stream).
fn host_argmax(item: &StepItem<'_, CudaSeq>) -> Option<u32> {
    item.seq.session().ok()?.argmax_now().ok()
}

/// Forget everything run ahead for a context (its guest came back with something else): its
/// results resolved, and its rows in the pass in flight (which still run, and are
/// overwritten by its next rows).
fn forget_ahead(ahead: &mut Ahead, serial: u64) {
    let before = ahead.ready.len();
    ahead.ready.retain(|&(s, _), _| s != serial);
    let mut forgot = ahead.ready.len() < before;
    if let Some(flight) = ahead.in_flight.as_mut() {
        let rows = flight.rows.len();
        flight.rows.retain(|r| r.serial != serial);
        forgot |= flight.rows.len() < rows;
    }
    if forgot {
        ahead.misses += 1;
    }
}

/// Whether `item` came back with the token run ahead for it at its position, resolved: then
/// it takes that result (a hit).
fn take_ready(ahead: &mut Ahead, item: &mut StepItem<'_, CudaSeq>) -> bool {
    let at = (item.seq.serial, item.seq.len());
    let Some(&guess) = ahead.ready.get(&at) else {
        return false;
    };
    let same = item.tokens == [guess.token] && item.first_chunk && !item.all_positions;
    if let (true, None, Ok(session)) = (same, &item.error, item.seq.session_mut()) {
        session.advanced_ahead(guess.argmax, guess.buffer);
        ahead.ready.remove(&at);
        ahead.hits += 1;
        true
    } else {
        false
    }
}

/// For each item, whether its next step may be run ahead: its guest read only the argmax
/// since its last step (a sampling guest reads logits), and this step ends its request.
fn greedy(items: &[StepItem<'_, CudaSeq>]) -> Vec<bool> {
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
fn take_late(ahead: &mut Ahead, items: &mut [StepItem<'_, CudaSeq>]) {
    for item in items.iter_mut() {
        let serial = item.seq.serial;
        ahead.follow.remove(&serial);
        if !item.seq.late.swap(false, Ordering::AcqRel) {
            continue;
        }
        match (ahead.late_done.remove(&serial), item.seq.session_mut()) {
            (Some(Some(argmax)), Ok(session)) => session.set_argmax(argmax),
            _ => item.error = Some(EngineError::device("the batched step failed")),
        }
    }
}

/// One context's rows in a batched pass: its cache, where its last row's logits go, its
/// first position and its tokens.
struct Rows<'t> {
    k: u64,
    v: u64,
    logits: u64,
    start: usize,
    tokens: &'t [u32],
    /// A lone token fed on the GPU from this row of the pass before (see [`NextStep::fed`]).
    fed: Option<usize>,
    layer_floats: usize,
}

impl BatchModel for CudaBatch {
    type Seq = CudaSeq;
    /// Waiting contexts park at once unless `WASI_NN_HOST_SPIN_US` says otherwise: with 64
    /// guests and the service on the 16 cores of the H200 machine, waiters that spun
    /// (yielding) for 3 ms slowed the guests down more than they saved (33.9k against
    /// 43.7k tokens/s).
    fn spin(&self) -> std::time::Duration {
        self.exec.gpu.settings().spin
    }

    /// A result run ahead and resolved, for a guest back with its token at its position
    /// (see "Two steps ahead" in the module docs): taken at once, without a step.
    fn take_ready(&self, seq: &mut CudaSeq, tokens: &[u32], all_positions: bool) -> bool {
        let (&[token], false) = (tokens, all_positions) else {
            return false;
        };
        if seq.late.load(Ordering::Acquire) || !self.exec.gpu.measurement().run_ahead {
            return false;
        }
        let serial = seq.serial;
        let Some(session) = seq.session.as_mut().filter(|s| s.idle_own()) else {
            return false;
        };
        let mut ahead = self.idle.ahead();
        let at = (serial, session.len());
        let Some(guess) = ahead.ready.get(&at).copied().filter(|g| g.token == token) else {
            return false;
        };
        ahead.ready.remove(&at);
        session.advanced_ahead(guess.argmax, guess.buffer);
        ahead.hits += 1;
        ahead.taken += 1;
        // a guest that read logits samples: no more steps run ahead for it
        let sampled = seq.read_logits.swap(false, Ordering::Relaxed);
        if let Some(guest) = ahead.guests.get_mut(&serial) {
            (guest.len, guest.readable) = (session.len(), session.readable());
            guest.greedy &= !sampled;
            // its next step may run ahead before it is back
            guest.argmax = Some(guess.argmax);
        }
        true
    }

    fn new_seq(&self) -> Result<CudaSeq, EngineError> {
        let started = std::time::Instant::now();
        self.idle.pool.reserve(self.idle.session_bytes)?;
        let reused = self
            .idle
            .sessions
            .lock()
            .ok()
            .and_then(|mut idle| idle.pop());
        let session = match reused {
            Some(session) => session,
            None => match CudaSession::new(self.exec.clone()) {
                Ok(session) => {
                    tracing::debug!("new GPU session in {:?}", started.elapsed());
                    session
                }
                Err(e) => {
                    self.idle.pool.release(self.idle.session_bytes);
                    return Err(e.into());
                }
            },
        };
        self.idle.live.fetch_add(1, Ordering::Relaxed);
        Ok(CudaSeq {
            session: Some(session),
            idle: self.idle.clone(),
            serial: self.idle.serials.fetch_add(1, Ordering::Relaxed),
            read_logits: AtomicBool::new(false),
            late: AtomicBool::new(false),
        })
    }

    fn step(&self, items: &mut [StepItem<'_, CudaSeq>]) {
        let started = Instant::now();
        if let [item] = items {
            if self.lone_hit(item) {
                return;
            }
        }
        // work run ahead on a session's own stream ends before anything else uses the session
        for item in items.iter_mut() {
            if let Some(Err(e)) = item.seq.session.as_mut().map(CudaSession::settle_own) {
                item.error.get_or_insert(e);
            }
        }
        let mut ahead = self.idle.ahead();
        let waited = match self.early_hits(&ahead, items) {
            Ok(early) => return self.step_early(ahead, items, &early, started),
            Err(why) => why,
        };
        // Whatever was run ahead is finished before anything else is launched; the contexts
        // that came back with the guessed token take its results.
        self.idle.resolve(&mut ahead);
        let resolved = started.elapsed();
        let (pass_gpu, gap_gpu) = (ahead.gpu_time, ahead.gpu_gap);
        take_late(&mut ahead, items);
        let hit: Vec<bool> = (items.iter_mut())
            .map(|item| take_ready(&mut ahead, item))
            .collect();
        let hits = hit.iter().filter(|&&h| h).count();
        // Long prompts (and prompts asking for every position's logits) start on their own
        // streams at once; decodes and short prompts go through the batched step, one row a
        // token (a short prompt always does, alone or not, so its logits don't depend on its
        // company); a lone decode keeps its session's captured decode step.
        let mut own = Vec::new();
        let mut batched = Vec::new();
        let alone = items.len() == 1;
        for (i, item) in items.iter_mut().enumerate() {
            if hit[i] || item.error.is_some() {
                continue;
            }
            let admitted = item.seq.session().and_then(|s| s.admit(item.tokens));
            if let Err(e) = admitted {
                item.error = Some(e);
            } else if item.tokens.len() <= self.batched_prompt() && !item.all_positions {
                batched.push(i);
            } else {
                own.push(i);
                let (tokens, all, continued) = (item.tokens, item.all_positions, !item.first_chunk);
                let ran = item.seq.session_mut().and_then(|s| {
                    s.allow_capture(alone);
                    s.extend_chunk(tokens, all, continued)
                });
                item.error = ran.err();
            }
        }
        let launched = started.elapsed();
        // With hits, the batched rows join the pass run ahead for them, and the step does
        // not wait for them: they run late (see the module docs).
        let run_ahead = self.exec.gpu.measurement().run_ahead;
        let late_tokens: usize = batched.iter().map(|&i| items[i].tokens.len()).sum();
        let others = items.len() - batched.len();
        let merge = run_ahead
            && hits > 0
            && !batched.is_empty()
            && others + ahead.follow.len() + late_tokens <= MAX_ROWS;
        if !merge {
            self.run_batched(items, &mut batched, &mut own);
        }
        // everything of this step is done before its contexts see their results
        for &i in &own {
            let item = &mut items[i];
            if let Err(e) = item.seq.session().and_then(CudaSession::synchronize) {
                item.error.get_or_insert(e);
            }
        }
        // the next step of the greedy contexts, run ahead: a lone decode's on its own stream
        // through its session's graph (faster than a batched pass), the others' in a pass
        let greedy = greedy(items);
        let mut lone_ahead = false;
        if alone && run_ahead && greedy[0] && own == [0] && items[0].tokens.len() == 1 {
            match items[0]
                .seq
                .session_mut()
                .and_then(CudaSession::launch_ahead_decode)
            {
                Ok(launched) => lone_ahead = launched.is_some(),
                Err(e) => {
                    items[0].error.get_or_insert(e);
                }
            }
        }
        let late: &[usize] = if merge { &batched } else { &[] };
        // (a lone decode run ahead on its own stream is not run in a pass too)
        let eligible: Vec<bool> = (0..items.len())
            .map(|i| greedy[i] && late.binary_search(&i).is_err() && !lone_ahead)
            .collect();
        let argmax: Vec<Option<u32>> = (0..items.len())
            .map(|i| eligible[i].then(|| host_argmax(&items[i])).flatten())
            .collect();
        let serials = self.note_guests(&mut ahead, items, &hit, &eligible, &argmax);
        let mut picks = match run_ahead {
            true => plan_ahead(&ahead, &serials, self.depth()),
            false => Vec::new(),
        };
        // one pass holds them all when merged; otherwise the first that fit
        let late_rows = if merge { late_tokens } else { 0 };
        picks.truncate(MAX_ROWS - late_rows);
        let room = MAX_ROWS - late_rows - picks.len();
        let launch = run_ahead && (merge || picks.len() + ahead.follow.len().min(room) >= 2);
        if launch {
            picks.extend(take_follows(&mut ahead, room));
        }
        let run_ahead_rows = match launch {
            true => self
                .launch_ahead(&mut ahead, items, picks, late, &greedy)
                .map(|flight| {
                    let n = flight.n;
                    ahead.in_flight = Some(flight);
                    n
                }),
            false => Ok(0),
        };
        let (total_hits, misses) = (ahead.hits, ahead.misses);
        drop(ahead);
        let run_ahead_rows = run_ahead_rows.unwrap_or_else(|e| {
            tracing::warn!("running a step ahead failed: {e}");
            for &i in late {
                let message = format!("batched step: {e}");
                items[i].error.get_or_insert(EngineError::device(message));
            }
            0
        });
        tracing::debug!(
            items = items.len(),
            hit = hits,
            batched = batched.len(),
            late = late.len(),
            own = own.len(),
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

    fn ahead_counts(&self) -> AheadCounts {
        let ahead = self.idle.ahead();
        AheadCounts {
            hits: ahead.hits,
            misses: ahead.misses,
            late: ahead.late,
            early: ahead.early,
            kept: ahead.ready.len()
                + ahead.late_done.len()
                + ahead.follow.len()
                + ahead
                    .in_flight
                    .as_ref()
                    .map_or(0, |f| f.rows.len() + f.late.len()),
        }
    }

    /// Until shortly before the pass in flight is expected to end: by the time a step takes
    /// to launch its pass (averaged) and `WASI_NN_HOST_GATHER_MARGIN_US` more (waking the
    /// step's thread). The pass began at its launch, or when the pass before it ended,
    /// whichever came later, and takes about as long on the GPU as the last pass resolved.
    fn gather(&self) -> Option<Duration> {
        let ahead = self.idle.ahead();
        let flight = ahead.in_flight.as_ref()?;
        let Some(margin) = self.exec.gpu.settings().gather_margin else {
            // every context waited for: up to the pass's time from launch to end
            return Some(ahead.took);
        };
        if ahead.gpu_time.is_zero() {
            return Some(ahead.took);
        }
        let began = ahead
            .resolved
            .map_or(flight.launched, |r| r.max(flight.launched));
        let end = began + ahead.gpu_time;
        Some(end.saturating_duration_since(Instant::now() + margin + ahead.launch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_spans_grow_with_the_longest_row_until_the_wave_is_full() {
        // few rows: a span per SPAN positions, at most BATCH_ATT_SPLITS
        assert_eq!(attention_splits(1, 12, 1056, SPAN), 1);
        assert_eq!(attention_splits(SPAN, 12, 1056, SPAN), 1);
        assert_eq!(attention_splits(SPAN + 1, 12, 1056, SPAN), 2);
        assert_eq!(
            attention_splits(100 * SPAN, 12, 1056, SPAN),
            BATCH_ATT_SPLITS
        );
        // 64 rows of 12 heads fill 768 of a 1056-block wave: a second span would not fit
        assert_eq!(attention_splits(3 * SPAN, 64 * 12, 1056, SPAN), 1);
        assert_eq!(attention_splits(3 * SPAN, 32 * 12, 1056, SPAN), 2);
        // no limit: as many spans as the positions ask for
        assert_eq!(attention_splits(3 * SPAN, 256 * 12, 0, SPAN), 3);
        // batch-invariant: no wave, longer spans
        assert_eq!(attention_splits(3 * SPAN, 64 * 12, 0, INVARIANT_SPAN), 1);
        assert_eq!(
            attention_splits(1000, 64 * 12, 0, INVARIANT_SPAN),
            BATCH_ATT_SPLITS
        );
    }

    fn seat(capacity: usize) -> Seat {
        Seat {
            k: 1,
            v: 2,
            layer_floats: 3,
            capacity,
            logits: [10, 11, 12],
        }
    }

    fn guest(len: usize, readable: usize) -> GuestAt {
        GuestAt {
            len,
            readable,
            greedy: true,
            seat: seat(64),
            argmax: None,
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
        }
    }

    fn guess(argmax: u32, buffer: usize) -> Guess {
        Guess {
            token: 5,
            argmax,
            buffer,
        }
    }

    /// The step planned for context 7 (at most one), with `known` its argmax after its step.
    fn plan_7(
        in_flight: &[AheadRow],
        ready: &[((u64, usize), Guess)],
        mut guest: GuestAt,
        known: Option<u32>,
        depth: usize,
    ) -> Option<NextStep> {
        let ready: FxHashMap<(u64, usize), Guess> = ready.iter().copied().collect();
        guest.argmax = guest.argmax.or(known);
        let guests: FxHashMap<u64, GuestAt> = [(7, guest)].into_iter().collect();
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
        assert_eq!(next.rows().logits, 12);
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
        full.seat = seat(64);
        assert!(plan_7(&[row(7, 63, 0, 1)], &[], full, None, 2).is_none());
        let mut sampling = guest(10, 0);
        sampling.greedy = false;
        assert!(plan_7(&[], &[], sampling, Some(33), 2).is_none());
    }

    #[test]
    fn steps_round_up_to_their_bucket() {
        assert_eq!(bucket(3), 4);
        assert_eq!(bucket(9), 16);
        assert_eq!(bucket(65), 96);
        assert_eq!(bucket(MAX_ROWS), MAX_ROWS);
    }
}

//! The contexts of one batcher: each a [`CudaSeq`] holding its own [`CudaSession`] (stream,
//! KV cache, logits, captured graphs) between steps, and the idle sessions kept for reuse
//! (their caches and graphs kept, emptied on the way). A context holds a reservation of its KV
//! bytes in a [`KvPool`]: a context over the cap is refused alone.

use super::ahead::state::{wait_idle, RunAhead};
use crate::cuda::loaded::LoadedModel;
use crate::cuda::session::CudaSession;
use crate::engine::batch::{KvPool, SeqState};
use crate::engine::draw::DrawRule;
use crate::engine::processing::{DrawnBy, EditedRule, Edits};
use crate::engine::{EngineError, Session};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The sessions not in use, the pool their KV caches are reserved from, and the count of
/// contexts open.
pub(crate) struct Contexts {
    idle: Mutex<Vec<CudaSession>>,
    max_idle: usize,
    pool: Arc<KvPool>,
    /// Device bytes of one session (its KV cache and buffers), reserved in the pool.
    session_bytes: usize,
    /// The next context's serial number.
    serials: AtomicU64,
    /// Contexts open (made and not yet dropped).
    live: AtomicUsize,
}

impl Contexts {
    pub(crate) fn new(exec: &LoadedModel, pool: Arc<KvPool>, max_idle: usize) -> Self {
        let cfg = exec.config;
        let per_position = 2 * cfg.n_layer * cfg.n_embd * exec.dtype.kv_bytes();
        let capacity = cfg.n_ctx.min(exec.max_kv_bytes / per_position.max(1));
        Self {
            idle: Mutex::new(Vec::new()),
            max_idle,
            pool,
            session_bytes: CudaSession::device_bytes(&cfg, exec.dtype, capacity),
            serials: AtomicU64::new(0),
            live: AtomicUsize::new(0),
        }
    }

    /// Keep `sessions` (made ahead of the first requests) for the first contexts.
    pub(crate) fn keep_idle(&self, sessions: Vec<CudaSession>) {
        (self.idle.lock())
            .unwrap_or_else(|p| p.into_inner())
            .extend(sessions);
    }

    /// The pool the contexts' KV caches are reserved from.
    pub(crate) fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Contexts open now.
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// A new context: an idle session (emptied when it was given back), or a new one, with
    /// its KV bytes reserved in the pool.
    pub(crate) fn open(
        self: &Arc<Self>,
        exec: &Arc<LoadedModel>,
        ahead: &Arc<RunAhead>,
    ) -> Result<CudaSeq, EngineError> {
        let started = std::time::Instant::now();
        self.pool.reserve(self.session_bytes)?;
        let reused = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        let session = match reused {
            Some(session) => session,
            None => match CudaSession::new(exec.clone()) {
                Ok(session) => {
                    tracing::debug!("new GPU session in {:?}", started.elapsed());
                    session
                }
                Err(e) => {
                    self.pool.release(self.session_bytes);
                    return Err(e.into());
                }
            },
        };
        self.live.fetch_add(1, Ordering::Relaxed);
        Ok(CudaSeq {
            session: Some(session),
            contexts: self.clone(),
            ahead: ahead.clone(),
            serial: self.serials.fetch_add(1, Ordering::Relaxed),
            read_logits: AtomicBool::new(false),
            late: AtomicBool::new(false),
            rule: Mutex::new(None),
            announced: None,
        })
    }
}

/// One context's state: its session, and its reservation in the pool (given back with it).
pub struct CudaSeq {
    pub(crate) session: Option<CudaSession>,
    contexts: Arc<Contexts>,
    ahead: Arc<RunAhead>,
    pub(crate) serial: u64,
    /// The guest read logits since the last step (it samples: no step is run ahead for it).
    pub(crate) read_logits: AtomicBool,
    /// Its last rows ran late (in a pass run ahead its step did not wait for): their argmax
    /// is in `Ahead::late_done` once the pass is resolved, and the logits are not read before.
    pub(crate) late: AtomicBool,
    /// The rule its guest drew its last token by (None: it read the argmax or the logits):
    /// its next rows' keys are drawn by it, so that the token comes back with the pass.
    rule: Mutex<Option<DrawRule>>,
    /// The draw after a processing its guest announced for the end of its next rows
    /// ([`SeqState::announce_draw`]): their last key is drawn by it instead.
    pub(crate) announced: Option<Arc<EditedRule>>,
}

impl CudaSeq {
    pub(crate) fn session(&self) -> Result<&CudaSession, EngineError> {
        self.session
            .as_ref()
            .ok_or_else(|| EngineError::device("session already released"))
    }

    /// The rule its next rows are drawn by (see [`Self::rule`]).
    pub(crate) fn rule(&self) -> Option<DrawRule> {
        *self.rule.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How its rows' last key is drawn: by the draw its guest announced (for the end of its
    /// request: `last_chunk`), else by its rule (None: the argmax).
    pub(crate) fn drawn_by(&self, last_chunk: bool) -> Option<DrawnBy> {
        match self.announced.as_ref().filter(|_| last_chunk) {
            Some(edited) => Some(DrawnBy::Edited(edited.clone())),
            None => self.rule().map(DrawnBy::Rule),
        }
    }

    /// Whether its guest draws its tokens (by a rule, or announced after a processing).
    pub(crate) fn draws(&self) -> bool {
        self.rule().is_some() || self.announced.is_some()
    }

    fn set_rule(&self, rule: Option<DrawRule>) {
        *self.rule.lock().unwrap_or_else(|p| p.into_inner()) = rule;
    }

    pub(crate) fn session_mut(&mut self) -> Result<&mut CudaSession, EngineError> {
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
            .ahead
            .wait_for_pass(|f| f.late.iter().any(|l| l.serial == serial));
        match ahead.late_argmax.get(&self.serial) {
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
            let mut ahead = self.ahead.lock();
            let serial = self.serial;
            ahead.results.retain(|&(s, _), _| s != serial);
            ahead.guests.remove(&serial);
            ahead.late_argmax.remove(&self.serial);
            ahead.next_after_late.remove(&self.serial);
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
        self.contexts.pool.release(self.contexts.session_bytes);
        self.contexts.live.fetch_sub(1, Ordering::Relaxed);
        if let Some(mut session) = self.session.take() {
            // nothing of this sequence stays readable, nor in flight, when it is reused
            if session.synchronize().is_err() {
                return;
            }
            session.reset();
            if let Ok(mut idle) = self.contexts.idle.lock() {
                if idle.len() < self.contexts.max_idle {
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
        self.set_rule(None);
        self.settle()?;
        self.session()?.logits_now()
    }
    fn all_logits(&self) -> Result<Vec<f32>, EngineError> {
        self.read_logits.store(true, Ordering::Relaxed);
        self.set_rule(None);
        self.settle()?;
        self.session()?.all_logits_now()
    }
    fn draw(&mut self, rule: &DrawRule) -> Result<u32, EngineError> {
        // the pass's draw takes temperature, top-p and seed alone: min-p is drawn after the
        // pass, and nothing is run ahead for it
        if !rule.is_plain() {
            return self.draw_edited(rule, &Edits::none());
        }
        // its next rows draw their keys by the rule, and its steps are run ahead with them
        self.set_rule(Some(*rule));
        let settled = self.settle()?;
        let session = self.session_mut()?;
        if let Some(token) = settled {
            session.set_argmax(token);
        }
        session.draw_now(rule)
    }
    fn announce_draw(&mut self, next: Option<Arc<EditedRule>>) {
        self.announced = next;
    }
    /// Drawn on the GPU from a processed copy of the logits: inside the pass where the guest
    /// announced it ([`SeqState::announce_draw`]), else after it. Where it was announced, its
    /// steps are run ahead as a plain rule's are, each drawn after the edits of the sequence
    /// up to its token ([`Edits::after`]); otherwise not, as for a context that reads its
    /// logits.
    fn draw_edited(&mut self, rule: &DrawRule, edits: &Edits) -> Result<u32, EngineError> {
        let announced =
            (self.announced.as_ref()).is_some_and(|a| a.rule == *rule && a.edits == *edits);
        if !announced {
            self.read_logits.store(true, Ordering::Relaxed);
        }
        self.set_rule(None);
        let settled = self.settle()?;
        let session = self.session_mut()?;
        if let Some(token) = settled {
            session.set_argmax(token);
        }
        session.draw_edited_now(rule, edits)
    }
    fn argmax(&self) -> Result<u32, EngineError> {
        self.set_rule(None);
        let settled = self.settle()?;
        let session = self.session()?;
        match settled {
            // a late row's key is its argmax unless its rows were drawn
            Some(argmax) if !session.key_drawn() => Ok(argmax),
            _ => session.argmax_now(),
        }
    }
}

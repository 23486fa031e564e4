//! The sequence as its guest and the batched step see it: the [`Session`] trait, the
//! admission of new tokens, a chunk of them run on the session's own stream, the steps the
//! batched pass ([`crate::cuda::batch`]) ran for it, and reading the last logits and their
//! argmax back.

use super::{max_edits, CudaSession};
use crate::cuda::buffer::DevBuf;
use crate::cuda::error::CudaError;
use crate::cuda::ops::draw::{edit_words, rule_words, Draw, EditedDraw, EDIT_WORDS};
use crate::cuda::ops::matvec::argmax_row;
use crate::engine::draw::{self, DrawRule};
use crate::engine::processing::{DrawnBy, EditedRule, Edits};
use crate::engine::{EngineError, Session};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// What the batched step ([`crate::cuda::batch`]) needs of a session.
impl CudaSession {
    /// Whether `tokens` may run next: not empty, ids in the vocabulary, room in the cache.
    pub(crate) fn admit(&self, tokens: &[u32]) -> Result<(), EngineError> {
        let vocab = self.model.config.vocab_size;
        if tokens.is_empty() {
            return Err(EngineError::EmptySequence);
        }
        self.check_room(tokens.len())?;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { id, vocab });
        }
        Ok(())
    }

    /// Run `tokens` on this session's own stream (its decode graph or its prefill); with
    /// `continued`, they are a later chunk of one extend whose all-position logits follow
    /// the earlier chunks'.
    pub(crate) fn extend_chunk(
        &mut self,
        tokens: &[u32],
        all_positions: bool,
        continued: bool,
    ) -> Result<(), EngineError> {
        self.admit(tokens)?;
        self.set_keys_drawn(None);
        self.read_out.chunk_started(all_positions, continued);
        if tokens.len() == 1 && !all_positions {
            self.decode(tokens[0])?;
        } else {
            self.prefill(tokens, all_positions)?;
        }
        self.read_out.chunk_done(tokens.len(), all_positions);
        Ok(())
    }

    /// Allow or hold off capturing repeated prompt shapes (already captured ones replay).
    pub(crate) fn allow_capture(&mut self, allowed: bool) {
        self.may_capture = allowed;
    }

    /// A batched step appended `added` positions and left the last one's logits (and their
    /// argmax).
    pub(crate) fn advanced_in_batch(&mut self, added: usize, argmax: u32) {
        self.read_out.after_batched_step(added, Some(argmax));
    }

    /// A batched pass that this step does not wait for appends `added` positions (their
    /// logits go to the buffer read next, their argmax comes with [`Self::set_argmax`]).
    pub(crate) fn advanced_late(&mut self, added: usize) {
        self.read_out.after_batched_step(added, None);
    }

    /// The argmax of the last position's logits, known on the host.
    pub(crate) fn set_argmax(&mut self, argmax: u32) {
        self.read_out.argmax_arrived(argmax);
    }

    /// The buffer holding the last logits, the one the guest reads.
    pub(crate) fn readable(&self) -> usize {
        self.read_out.readable()
    }

    /// The step run ahead (one position, its logits in `buffer`) is this session's next step:
    /// take its results.
    /// (`argmax` is the token drawn as `drawn` says where the context draws its tokens.)
    pub(crate) fn advanced_ahead(&mut self, argmax: u32, buffer: usize, drawn: Option<DrawnBy>) {
        self.set_keys_drawn(drawn);
        self.read_out.took_batched_ahead(buffer, Some(argmax));
    }

    /// The step run ahead is this session's next step, and its pass is still under way: take
    /// its position and logits (in `buffer`) now; its argmax comes with [`Self::set_argmax`].
    pub(crate) fn advanced_ahead_pending(&mut self, buffer: usize, drawn: Option<DrawnBy>) {
        self.set_keys_drawn(drawn);
        self.read_out.took_batched_ahead(buffer, None);
    }

    /// The last logits, from the buffer the guest reads.
    pub(crate) fn logits_now(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self.read_logits(self.model.config.vocab_size, false)?)
    }

    /// Every position's logits from the last extend (empty when not asked for).
    pub(crate) fn all_logits_now(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self.read_logits(
            self.read_out.all_rows() * self.model.config.vocab_size,
            true,
        )?)
    }

    /// The batched pass drew the next token as `drawn` says (None: took the argmax).
    pub(crate) fn set_keys_drawn(&mut self, drawn: Option<DrawnBy>) {
        self.keys_drawn = drawn;
    }

    /// The rule and edits the key was drawn by (None: the argmax, or a plain rule).
    pub(crate) fn keys_edited(&self) -> Option<&Arc<EditedRule>> {
        match &self.keys_drawn {
            Some(DrawnBy::Edited(edited)) => Some(edited),
            _ => None,
        }
    }

    /// How the key was drawn (None: it is the argmax).
    pub(crate) fn keys_drawn(&self) -> Option<&DrawnBy> {
        self.keys_drawn.as_ref()
    }

    /// Whether the key is a draw (by a rule, after edits or not), not the argmax.
    pub(crate) fn key_drawn(&self) -> bool {
        self.keys_drawn.is_some()
    }

    /// The plain rule the key was drawn by (None: the argmax, or a draw after edits).
    pub(crate) fn keys_rule(&self) -> Option<DrawRule> {
        match self.keys_drawn {
            Some(DrawnBy::Rule(rule)) => Some(rule),
            _ => None,
        }
    }

    /// The token the batched pass drew for the next position, when it is known on the host
    /// and decided (an undecided row names V).
    pub(crate) fn drawn_known(&self) -> Option<u32> {
        (self.read_out.argmax()).filter(|&t| (t as usize) < self.model.config.vocab_size)
    }

    /// The argmax of the last logits: known on the host, or its key read from the GPU (or,
    /// where the batched pass drew the token instead, found in the logits).
    pub(crate) fn argmax_now(&self) -> Result<u32, EngineError> {
        if self.key_drawn() {
            return Ok(crate::engine::argmax(&self.logits_now()?));
        }
        if let Some(id) = self.read_out.argmax() {
            return Ok(id);
        }
        let key = self.argmax_key.read(self.launcher.stream(), 1)?;
        Ok(argmax_row(key.first().copied().unwrap_or(0)))
    }

    /// The token `rule` draws from the last logits, drawn on the GPU: 4 bytes come back
    /// instead of the logits (a row whose draws all fell outside the nucleus, odds below
    /// 2^-32 at top-p 0.5, is finished here from the logits).
    pub(crate) fn draw_now(&mut self, rule: &DrawRule) -> Result<u32, EngineError> {
        let position = self.read_out.len();
        // the plain kernel takes temperature, top-p and seed alone (`DrawRule::is_plain`)
        if !rule.is_plain() {
            return self.draw_edited_now(rule, &Edits::none());
        }
        let vocab = self.model.config.vocab_size;
        // the batched pass drew it already, by the same rule
        if let (Some(token), Some(drawn_by)) = (self.read_out.argmax(), &self.keys_rule()) {
            if drawn_by == rule && (token as usize) < vocab {
                return Ok(token);
            }
        }
        let stream = self.launcher.stream().clone();
        self.draw_rule
            .write(&stream, 0, &rule_words(rule, position))?;
        self.launcher.draw_token(Draw {
            logits: self.logits_buffer(self.read_out.readable()).ptr(),
            stride: vocab,
            rows: 1,
            vocab,
            rules: self.draw_rule.ptr(),
            out: self.drawn.ptr(),
        })?;
        let drawn = {
            let mut host = self.drawn_host.lock().unwrap_or_else(|p| p.into_inner());
            host.start(&stream, &self.drawn, 1)?;
            host.wait()?
        };
        match drawn.first() {
            Some(&id) if id >= 0 && (id as usize) < vocab => Ok(id as u32),
            _ => Ok(draw::draw(&self.logits_now()?, rule, position)),
        }
    }

    /// The token `rule` draws from the last logits after `edits` (a request's processing,
    /// and min-p), drawn on the GPU from a processed copy: the logits the guest reads stay as
    /// they are, and 4 bytes come back (a row whose draws all fell outside the nucleus is
    /// finished here from the logits, processed here).
    pub(crate) fn draw_edited_now(
        &mut self,
        rule: &DrawRule,
        edits: &Edits,
    ) -> Result<u32, EngineError> {
        let position = self.read_out.len();
        let vocab = self.model.config.vocab_size;
        let most = max_edits(self.capacity);
        if edits.edits.len() > most {
            return Err(EngineError::device(format!(
                "a processed draw of {} edits, more than {most}",
                edits.edits.len()
            )));
        }
        // the batched pass drew it already, by the same rule after the same edits
        if let (Some(token), Some(drawn_by)) = (self.read_out.argmax(), self.keys_edited()) {
            if drawn_by.rule == *rule && drawn_by.edits == *edits && (token as usize) < vocab {
                return Ok(token);
            }
        }
        let stream = self.launcher.stream().clone();
        let mut draws = match self.edited_draws.take() {
            Some(draws) => draws,
            None => EditedDraws::new(&stream, vocab, most)?,
        };
        let words = edit_words(edits);
        // (on the session's stream: the draw on a stream of its own, even of the highest
        // priority, waited twice as long behind the batched passes)
        let drawn = (|| {
            if !words.is_empty() {
                draws.edits.write(&stream, 0, &words)?;
            }
            self.draw_rule
                .write(&stream, 0, &rule_words(rule, position))?;
            self.launcher.draw_edited(EditedDraw {
                logits: self.logits_buffer(self.read_out.readable()).ptr(),
                scratch: draws.scratch.ptr(),
                vocab,
                rule: self.draw_rule.ptr(),
                edits: draws.edits.ptr(),
                count: edits.edits.len(),
                repetition: edits.repetition,
                floor_offset: rule.min_p_offset(),
                out: self.drawn.ptr(),
            })?;
            let mut host = self.drawn_host.lock().unwrap_or_else(|p| p.into_inner());
            host.start(&stream, &self.drawn, 1)?;
            host.wait()
        })();
        self.edited_draws = Some(draws);
        match drawn?.first() {
            Some(&id) if id >= 0 && (id as usize) < vocab => Ok(id as u32),
            _ => Ok(edits.draw(self.logits_now()?, rule, position)),
        }
    }

    /// Copy `count` logits back (from the all-position buffer when `all`) and wait for them.
    fn read_logits(&self, count: usize, all: bool) -> Result<Vec<f32>, CudaError> {
        let stream = self.launcher.stream();
        match (&self.all_logits, all) {
            (Some(buf), true) => buf.read(stream, count),
            (None, true) => Ok(Vec::new()),
            _ => {
                let mut host = self.logits_host.lock().unwrap_or_else(|p| p.into_inner());
                let last = self.logits_buffer(self.read_out.readable());
                host.start(stream, last, count)?;
                host.wait()
            }
        }
    }

    /// Forget the sequence (length 0) and its outputs, for the next context to reuse it.
    pub(crate) fn reset(&mut self) {
        self.set_keys_drawn(None);
        self.read_out.reset();
    }
}

impl Session for CudaSession {
    fn len(&self) -> usize {
        self.read_out.len()
    }

    fn truncate(&mut self, len: usize) {
        // Positions past `len` are simply overwritten by the next step; a step run ahead
        // was for the old sequence (the wasi-nn backend truncates to the length it keeps
        // before every step: a no-op then, and the step run ahead stays).
        self.read_out.truncate(len);
    }

    fn extend(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), EngineError> {
        self.extend_chunk(tokens, all_positions, false)
    }

    fn last_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        self.logits_now()
    }

    fn all_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        self.all_logits_now()
    }

    fn argmax(&mut self) -> Result<u32, EngineError> {
        self.argmax_now()
    }

    fn draw(&mut self, rule: &DrawRule) -> Result<u32, EngineError> {
        self.draw_now(rule)
    }

    fn draw_edited(&mut self, rule: &DrawRule, edits: &Edits) -> Result<u32, EngineError> {
        self.draw_edited_now(rule, edits)
    }
}

/// The buffers of a session's draws after a request's processing.
pub(crate) struct EditedDraws {
    /// `[V]`: the processed copy of the logits drawn from.
    scratch: DevBuf<f32>,
    /// [`EDIT_WORDS`] words an edit ([`edit_words`]), for the most edits of a draw.
    edits: DevBuf<u32>,
}

impl EditedDraws {
    fn new(stream: &Arc<CudaStream>, vocab: usize, most: usize) -> Result<Self, CudaError> {
        Ok(Self {
            scratch: DevBuf::zeros(stream, vocab, "processed logits")?,
            edits: DevBuf::zeros(stream, EDIT_WORDS * most, "processed logits")?,
        })
    }
}

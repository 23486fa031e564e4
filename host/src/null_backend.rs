//! A backend that computes nothing, to measure what the host costs: `--graph NAME=null:SIZE`.
//!
//! Its contexts share batched steps through the same [`Batcher`] as the CPU and GPU backends,
//! but a step only advances each context and names its next token, a function of the
//! context's length and last token, at once. A guest then pays for everything but the forward
//! pass: its own code, the wasi-nn calls, the batcher's gather and wake-ups, and through the
//! service the HTTP streams. Its texts are not GPT-2's (nor anything's): it is for
//! measurements only.

use crate::engine::batch::{BatchModel, Batcher, SeqState, StepItem};
use crate::engine::draw::DrawRule;
use crate::engine::processing::Edits;
use crate::engine::{EngineError, Executor, Session};
use crate::model::Gpt2Config;
use std::sync::Arc;

/// The null backend as an [`Executor`] of a model's shape (its vocabulary and context).
pub struct NullExecutor {
    config: Gpt2Config,
    batcher: Arc<Batcher<NullBatch>>,
}

impl NullExecutor {
    /// Most tokens one step takes, as the GPU's default.
    pub const STEP_TOKENS: usize = 256;

    pub fn new(config: Gpt2Config) -> Self {
        let model = NullBatch {
            vocab: config.vocab_size,
        };
        Self {
            config,
            batcher: Batcher::new(model, Self::STEP_TOKENS),
        }
    }
}

impl Executor for NullExecutor {
    fn config(&self) -> Gpt2Config {
        self.config
    }
    fn new_session(&self) -> Result<Box<dyn Session>, EngineError> {
        self.batcher.session()
    }
    fn batch_counts(&self) -> Option<crate::engine::batch::BatchCounts> {
        Some(self.batcher.counts())
    }
}

struct NullBatch {
    vocab: usize,
}

/// One context: its length and the token its next step names.
struct NullSeq {
    len: usize,
    next: u32,
    vocab: usize,
}

impl NullSeq {
    /// A one-hot row at the next token: what a guest that reads logits gets.
    fn row(&self) -> Vec<f32> {
        let mut row = vec![0.0; self.vocab];
        if let Some(l) = row.get_mut(self.next as usize) {
            *l = 1.0;
        }
        row
    }
}

impl SeqState for NullSeq {
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    fn last_logits(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self.row())
    }
    fn all_logits(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self.row())
    }
    fn argmax(&self) -> Result<u32, EngineError> {
        Ok(self.next)
    }
    /// Drawn where the logits would be: the next token, as a device's draw costs the host
    /// nothing.
    fn draw(&mut self, _rule: &DrawRule) -> Result<u32, EngineError> {
        Ok(self.next)
    }
    /// Processed and drawn where the logits would be, as a device's.
    fn draw_edited(&mut self, _rule: &DrawRule, _edits: &Edits) -> Result<u32, EngineError> {
        Ok(self.next)
    }
}

impl BatchModel for NullBatch {
    type Seq = NullSeq;

    fn new_seq(&self) -> Result<NullSeq, EngineError> {
        Ok(NullSeq {
            len: 0,
            next: 0,
            vocab: self.vocab,
        })
    }

    fn step(&self, items: &mut [StepItem<'_, NullSeq>]) {
        for item in items.iter_mut() {
            let seq = &mut *item.seq;
            seq.len += item.tokens.len();
            let last = item.tokens.last().copied().unwrap_or(0) as usize;
            // spread over the vocabulary (skipping nothing: a guest may stop at any token)
            seq.next = ((seq.len * 7919 + last * 31) % self.vocab.max(1)) as u32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_advance_and_name_a_next_token_without_computing() -> Result<(), EngineError> {
        let config = Gpt2Config::preset("124M").ok_or_else(|| EngineError::device("preset"))?;
        let executor = NullExecutor::new(config);
        let mut a = executor.new_session()?;
        let mut b = executor.new_session()?;
        a.extend(&[1, 2, 3], false)?;
        b.extend(&[1, 2, 3], false)?;
        assert_eq!(a.len(), 3);
        assert_eq!(a.argmax()?, b.argmax()?, "a function of the sequence alone");
        let first = a.argmax()?;
        a.extend(&[first], false)?;
        assert_eq!(a.len(), 4);
        assert!((a.argmax()? as usize) < config.vocab_size);
        let logits = a.last_logits()?;
        assert_eq!(logits.len(), config.vocab_size);
        assert_eq!(crate::engine::argmax(&logits), a.argmax()?);
        a.truncate(2);
        assert_eq!(a.len(), 2);
        assert!(executor.batch_counts().is_some_and(|c| c.steps >= 2));
        Ok(())
    }
}

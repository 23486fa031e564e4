//! The edits a compute announces for a processed draw: made from the last compute's where
//! the sequence grew by one generated token under the same processing, and equal, at every
//! compute, to the edits made from the whole sequence.

use super::{Gpt2Context, ProcessingInputs};
use crate::engine::processing::EditedRule;
use crate::engine::{EngineError, Executor, Session};
use crate::model::Gpt2Config;
use std::sync::{Arc, Mutex};

const VOCAB: usize = 64;

/// What the fake sessions saw: each announcement, and whether the next extend fails.
#[derive(Default)]
struct Seen {
    announced: Vec<Option<Arc<EditedRule>>>,
    fail_next: bool,
}

struct FakeSession {
    len: usize,
    seen: Arc<Mutex<Seen>>,
}

impl Session for FakeSession {
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    fn extend(&mut self, tokens: &[u32], _all: bool) -> Result<(), EngineError> {
        let mut seen = self.seen.lock().expect("not poisoned");
        if std::mem::take(&mut seen.fail_next) {
            return Err(EngineError::device("a failed step"));
        }
        self.len += tokens.len();
        Ok(())
    }
    fn last_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        Ok(vec![0.0; VOCAB])
    }
    fn all_logits(&mut self) -> Result<Vec<f32>, EngineError> {
        Ok(vec![0.0; VOCAB])
    }
    fn argmax(&mut self) -> Result<u32, EngineError> {
        Ok(0)
    }
    fn announce_draw(&mut self, next: Option<Arc<EditedRule>>) {
        let mut seen = self.seen.lock().expect("not poisoned");
        seen.announced.push(next);
    }
}

struct FakeExecutor(Arc<Mutex<Seen>>);

impl Executor for FakeExecutor {
    fn config(&self) -> Gpt2Config {
        Gpt2Config {
            n_layer: 1,
            n_head: 1,
            n_embd: 8,
            n_ctx: 128,
            vocab_size: VOCAB,
        }
    }
    fn new_session(&self) -> Result<Box<dyn Session>, EngineError> {
        Ok(Box::new(FakeSession {
            len: 0,
            seen: self.0.clone(),
        }))
    }
}

/// Runs a compute over `tokens` and returns what it announced, checked against the edits of
/// the whole sequence under the context's processing.
fn compute(ctx: &mut Gpt2Context, seen: &Mutex<Seen>, tokens: &[u32]) -> Option<Arc<EditedRule>> {
    ctx.tokens = Some(tokens.to_vec());
    let ran = ctx.run();
    let announced = seen
        .lock()
        .expect("not poisoned")
        .announced
        .pop()
        .expect("an announcement a compute");
    let processing = ctx.processing.processing(VOCAB).expect("valid processing");
    // none where the sequence is shorter than generated_from (output 4 refuses it)
    let whole = processing.edits(tokens).ok().flatten();
    assert_eq!(
        announced.as_ref().map(|a| a.edits.clone()),
        whole,
        "the announced edits of {tokens:?} ({ran:?})"
    );
    announced
}

#[test]
fn announced_edits_equal_the_whole_sequences_at_every_compute() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut ctx = Gpt2Context::new(Arc::new(FakeExecutor(seen.clone()))).expect("a context");
    ctx.sampling = Some((1.0, 0.95, 0.0));
    ctx.processing = ProcessingInputs {
        penalties: (0.5, 0.25, 1.1),
        generated_from: 3,
        bias_ids: vec![7, 50 % VOCAB as i32],
        bias_values: vec![-100.0, 2.0],
    };
    let mut tokens = vec![5, 9, 5];
    compute(&mut ctx, &seen, &tokens);
    // generated tokens one at a time: made from the last compute's edits
    for token in [9, 9, 11, 5, 63] {
        tokens.push(token);
        let announced = compute(&mut ctx, &seen, &tokens);
        assert!(announced.is_some());
    }
    // two tokens at once, an earlier token changed, the same sequence again
    tokens.extend([1, 2]);
    compute(&mut ctx, &seen, &tokens);
    tokens[4] = 12;
    compute(&mut ctx, &seen, &tokens);
    compute(&mut ctx, &seen, &tokens);
    // the processing changed between two computes one token apart
    tokens.push(3);
    ctx.processing.penalties = (0.0, 1.0, 1.0);
    compute(&mut ctx, &seen, &tokens);
    // a failed step forgets the cache: the next compute starts over
    seen.lock().expect("not poisoned").fail_next = true;
    tokens.push(4);
    compute(&mut ctx, &seen, &tokens);
    tokens.push(6);
    compute(&mut ctx, &seen, &tokens);
    tokens.push(6);
    compute(&mut ctx, &seen, &tokens);
    // a prompt cut short (a new request on the context), then its generated tokens
    tokens.truncate(2);
    compute(&mut ctx, &seen, &tokens);
    for token in [8, 8] {
        tokens.push(token);
        compute(&mut ctx, &seen, &tokens);
    }
    // no sampling: nothing announced, and nothing kept for the next compute
    ctx.sampling = None;
    tokens.push(8);
    ctx.tokens = Some(tokens.clone());
    ctx.run().expect("a compute");
    let none = seen.lock().expect("not poisoned").announced.pop();
    assert_eq!(none, Some(None));
    assert!(ctx.edits_made.is_none());
}

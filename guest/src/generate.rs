//! Text generation and scoring over any forward pass: the one implementation behind both the
//! wasip1 command (`gpt2.wasm`, wasi-nn witx ABI) and the wasip2 component (`wasi:nn` WIT).

use crate::sampling::{argmax, Sampler, SamplingParams};
use crate::text::{StopMatcher, StopState, Utf8Stream};
use crate::tokenizer::Gpt2Tokenizer;

/// A model behind some ABI: token ids in, logits out.
pub trait Forward {
    /// Logits of the last position of `tokens` (`vocab` floats).
    fn last_logits(&mut self, tokens: &[u32]) -> Result<&[f32], String>;

    /// The greedy next token. Backends that compute it where the logits are override this.
    fn greedy_next(&mut self, tokens: &[u32]) -> Result<u32, String> {
        Ok(argmax(self.last_logits(tokens)?) as u32)
    }

    /// Logits of every position of `tokens` (`[T * vocab]`) from one call, if the backend
    /// offers that; `None` makes scoring fall back to one call per prefix.
    fn all_logits(&mut self, _tokens: &[u32]) -> Result<Option<Vec<f32>>, String> {
        Ok(None)
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerationParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stops: Vec<String>,
}

/// A generation in progress: call [`Generation::next`] until it returns `None`.
pub struct Generation {
    prompt_ids: Vec<u32>,
    sequence: Vec<u32>,
    generated: Vec<u32>,
    sampler: Sampler,
    stops: StopMatcher,
    utf8: Utf8Stream,
    max_tokens: usize,
    end_of_text: Option<u32>,
    finish_reason: Option<&'static str>,
    /// Seconds spent choosing tokens from logits (not in the forward pass).
    pub sampling_seconds: f64,
}

impl Generation {
    pub fn new(
        tokenizer: &Gpt2Tokenizer,
        prompt: &str,
        params: GenerationParams,
    ) -> Result<Self, String> {
        let mut prompt_ids = tokenizer.encode(prompt).map_err(|e| e.to_string())?;
        if prompt_ids.is_empty() {
            // Nothing to condition on: start from <|endoftext|>, as GPT-2 was trained.
            prompt_ids.extend(tokenizer.end_of_text());
        }
        Ok(Self {
            sequence: prompt_ids.clone(),
            prompt_ids,
            generated: Vec::new(),
            sampler: Sampler::new(params.sampling),
            stops: StopMatcher::new(params.stops),
            utf8: Utf8Stream::default(),
            max_tokens: params.max_tokens,
            end_of_text: tokenizer.end_of_text(),
            finish_reason: None,
            sampling_seconds: 0.0,
        })
    }

    /// Make one token; return the text it completes (possibly empty: a character or a possible
    /// stop string may still be open), or `None` once generation has finished.
    pub fn next(
        &mut self,
        model: &mut dyn Forward,
        tokenizer: &Gpt2Tokenizer,
    ) -> Result<Option<String>, String> {
        if self.finish_reason.is_some() {
            return Ok(None);
        }
        if self.generated.len() >= self.max_tokens {
            return Ok(Some(self.finish("length")));
        }
        let next = if self.sampler.params().temperature <= 0.0 {
            model.greedy_next(&self.sequence)?
        } else {
            let logits = model.last_logits(&self.sequence)?;
            let started = std::time::Instant::now();
            let next = self.sampler.sample(logits) as u32;
            self.sampling_seconds += started.elapsed().as_secs_f64();
            next
        };
        if Some(next) == self.end_of_text {
            return Ok(Some(self.finish("eos")));
        }
        self.sequence.push(next);
        self.generated.push(next);
        let piece = self.utf8.push(tokenizer.token_bytes().get(next));
        Ok(Some(match self.stops.push(&piece) {
            StopState::Continue(text) => text,
            StopState::Stopped(text) => {
                self.finish_reason = Some("stop");
                text
            }
        }))
    }

    /// End the generation: release held-back text.
    fn finish(&mut self, reason: &'static str) -> String {
        let tail = self.utf8.finish();
        match self.stops.push(&tail) {
            StopState::Continue(mut text) => {
                self.finish_reason = Some(reason);
                text.push_str(&self.stops.finish());
                text
            }
            StopState::Stopped(text) => {
                self.finish_reason = Some("stop");
                text
            }
        }
    }

    pub fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }
    pub fn ids(&self) -> &[u32] {
        &self.generated
    }
    /// The text so far (up to a stop string, once one was found).
    pub fn text(&self) -> &str {
        self.stops.text()
    }
    /// `length`, `eos` or `stop` once finished.
    pub fn finish_reason(&self) -> Option<&'static str> {
        self.finish_reason
    }
}

/// Perplexity by windows: feed `ids[i..i+W]`, score `ids[i+1..i+W+1]` for i = 0, W, 2W, ...
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    pub tokens_scored: usize,
    pub nll_per_token: f64,
    pub perplexity: f64,
}

pub fn perplexity(
    model: &mut dyn Forward,
    ids: &[u32],
    vocab: usize,
    window: usize,
    max_scored: Option<usize>,
) -> Result<Score, String> {
    if window == 0 {
        return Err("window must be at least 1".into());
    }
    let limit = max_scored.unwrap_or(usize::MAX);
    let (mut scored, mut nll) = (0usize, 0.0f64);
    let mut i = 0;
    while i + 1 < ids.len() && scored < limit {
        let n = window.min(ids.len() - 1 - i).min(limit - scored);
        let inputs = &ids[i..i + n];
        let targets = &ids[i + 1..i + 1 + n];
        let rows = match model.all_logits(inputs)? {
            Some(all) => all,
            // No all-positions output: one call per prefix (slow, but any backend can do it).
            None => {
                let mut all = Vec::with_capacity(n * vocab);
                for j in 1..=n {
                    all.extend_from_slice(model.last_logits(&inputs[..j])?);
                }
                all
            }
        };
        for (row, &target) in rows.chunks_exact(vocab).zip(targets) {
            nll += crate::log_sum_exp(row) - row[target as usize] as f64;
        }
        scored += n;
        i += window;
    }
    let nll_per_token = if scored > 0 {
        nll / scored as f64
    } else {
        f64::NAN
    };
    Ok(Score {
        tokens_scored: scored,
        nll_per_token,
        perplexity: nll_per_token.exp(),
    })
}

//! Text generation and scoring over any forward pass: the one implementation behind both the
//! wasip1 command (`gpt2.wasm`, wasi-nn witx ABI) and the wasip2 component (`wasi:nn` WIT).

use crate::processing::{LogitsProcessor, Processing, TokenLogprob};
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

    /// The next token drawn by the backend where the logits are, by `draw`: the host's
    /// output 4, which samples the same distribution as [`LogitsProcessor`] and [`Sampler`]
    /// (another stream of draws for a seed). `None`: the backend does not offer it (or not
    /// with this processing), and the guest samples the logits itself.
    fn sampled_next(&mut self, _tokens: &[u32], _draw: &HostDraw) -> Result<Option<u32>, String> {
        Ok(None)
    }

    /// Logits of every position of `tokens` (`[T * vocab]`) from one call, if the backend
    /// offers that; `None` makes scoring fall back to one call per prefix.
    fn all_logits(&mut self, _tokens: &[u32]) -> Result<Option<Vec<f32>>, String> {
        Ok(None)
    }

    /// Whether the last failed call was the backend refusing a sequence as too large (past
    /// the model's context): a generation whose context the guest could not learn otherwise
    /// ends there with `length`.
    fn refused_as_too_large(&self) -> bool {
        false
    }
}

/// A draw a backend makes for the guest (our host's inputs 2-7 and output 4).
#[derive(Debug, Clone, Copy)]
pub struct HostDraw<'a> {
    /// Temperature, top-p and seed (top-k is 0).
    pub sampling: &'a SamplingParams,
    /// What the logits go through first: bias, penalties, min-p.
    pub processing: &'a Processing,
    /// Whether `processing` changes anything (else the plain rule of inputs 2 and 3).
    pub processes: bool,
    /// The first position of the sequence whose tokens were generated (the prompt's length).
    pub generated_from: usize,
}

impl HostDraw<'_> {
    /// The values of the contract's inputs 2-7 for this draw, neutral where it does not
    /// process.
    pub fn inputs(&self) -> DrawInputs {
        let (s, p) = (self.sampling, self.processing);
        if !self.processes {
            return DrawInputs {
                sampling: [s.temperature, s.top_p, 0.0],
                seed: s.seed,
                ..DrawInputs::NEUTRAL
            };
        }
        let (bias_ids, bias_values) = p.logit_bias.iter().map(|&(id, b)| (id as i32, b)).unzip();
        DrawInputs {
            sampling: [s.temperature, s.top_p, p.min_p],
            seed: s.seed,
            penalties: [
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty,
            ],
            generated_from: self.generated_from as i32,
            bias_ids,
            bias_values,
        }
    }
}

/// The values of our host's inputs 2-7: `sampling` (temperature, top-p, min-p: two values
/// where min-p is 0, which every backend with output 4 takes), `seed`, `penalties`
/// (presence, frequency, repetition), `generated_from`, `bias_ids` and `bias_values`.
#[derive(Debug, Clone, PartialEq)]
pub struct DrawInputs {
    pub sampling: [f32; 3],
    pub seed: u64,
    pub penalties: [f32; 3],
    pub generated_from: i32,
    pub bias_ids: Vec<i32>,
    pub bias_values: Vec<f32>,
}

impl DrawInputs {
    const NEUTRAL: DrawInputs = DrawInputs {
        sampling: [1.0, 1.0, 0.0],
        seed: 0,
        penalties: [0.0, 0.0, 1.0],
        generated_from: 0,
        bias_ids: Vec::new(),
        bias_values: Vec::new(),
    };

    /// `sampling` as sent: without min-p where it is 0.
    pub fn sampling(&self) -> &[f32] {
        match self.sampling[2] == 0.0 {
            true => &self.sampling[..2],
            false => &self.sampling,
        }
    }

    /// Whether inputs 4-7 or min-p change anything.
    pub fn processes(&self) -> bool {
        self.sampling[2] != 0.0 || self.penalties != [0.0, 0.0, 1.0] || !self.bias_ids.is_empty()
    }
}

/// What to generate.
#[derive(Debug, Clone, Default)]
pub struct GenerationParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops where one of these appears; it is not part of the text.
    pub stops: Vec<String>,
    /// Generation stops at one of these tokens (`stop`; the token is not part of the text).
    pub stop_ids: Vec<u32>,
    /// Bias, penalties, min-p.
    pub processing: Processing,
    /// Report each generated token's log probability with this many alternatives.
    pub logprobs: Option<usize>,
    /// The text starts with the prompt's; with `logprobs`, the prompt's tokens are scored
    /// too (one call for every position).
    pub echo: bool,
    /// The model's context: prompt and generated tokens together stop there (`length`).
    pub context: Option<usize>,
}

/// What to continue: text, or token ids as they are.
#[derive(Debug, Clone, Copy)]
pub enum Prompt<'a> {
    Text(&'a str),
    Ids(&'a [u32]),
}

/// A generation in progress: call [`Generation::next`] until it returns `None`.
pub struct Generation {
    prompt_ids: Vec<u32>,
    sequence: Vec<u32>,
    generated: Vec<u32>,
    sampler: Sampler,
    processor: LogitsProcessor,
    stop_ids: Vec<u32>,
    logprobs: Option<usize>,
    /// The prompt's text, until the first piece carries it (`echo`).
    echo: Option<String>,
    echo_text: String,
    /// Whether the prompt's tokens are still to be scored (`echo` with `logprobs`).
    score_prompt: bool,
    prompt_logprobs: Vec<TokenLogprob>,
    /// Whether [`Generation::take_fresh_logprobs`] has handed out the prompt's.
    prompt_logprobs_taken: bool,
    /// Log probabilities of the generated tokens; `fresh` of them not yet taken.
    token_logprobs: Vec<TokenLogprob>,
    fresh: usize,
    /// Next-token logits already computed (the last row of the prompt's scoring).
    pending: Option<Vec<f32>>,
    context: Option<usize>,
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
        Self::with_prompt(tokenizer, Prompt::Text(prompt), params)
    }

    /// A generation from text or token ids. Errors say what is wrong in the user's terms: an
    /// id outside the vocabulary, a bias for one, a prompt longer than the context.
    pub fn with_prompt(
        tokenizer: &Gpt2Tokenizer,
        prompt: Prompt<'_>,
        params: GenerationParams,
    ) -> Result<Self, String> {
        let vocab = tokenizer.vocab_size();
        let (mut prompt_ids, echo_text) = match prompt {
            Prompt::Text(text) => (
                tokenizer.encode(text).map_err(|e| e.to_string())?,
                text.to_owned(),
            ),
            Prompt::Ids(ids) => {
                if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab)
                {
                    return Err(format!(
                        "token id {id} at position {i} of the prompt is outside the vocabulary \
                         (0..{vocab})"
                    ));
                }
                let bytes = tokenizer.token_bytes().concat(ids);
                (ids.to_vec(), String::from_utf8_lossy(&bytes).into_owned())
            }
        };
        params.processing.validate(vocab)?;
        if let Some(&id) = params.stop_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(format!(
                "stop token id {id} is outside the vocabulary (0..{vocab})"
            ));
        }
        if prompt_ids.is_empty() {
            // Nothing to condition on: start from <|endoftext|>, as GPT-2 was trained.
            prompt_ids.extend(tokenizer.end_of_text());
        }
        if let Some(context) = params.context {
            if prompt_ids.len() > context {
                return Err(format!(
                    "the prompt has {} tokens; this model's context is {context}",
                    prompt_ids.len()
                ));
            }
        }
        Ok(Self {
            sequence: prompt_ids.clone(),
            processor: LogitsProcessor::new(params.processing, &prompt_ids),
            stop_ids: params.stop_ids,
            logprobs: params.logprobs,
            echo: params.echo.then(|| echo_text.clone()),
            echo_text: if params.echo {
                echo_text
            } else {
                String::new()
            },
            score_prompt: params.echo && params.logprobs.is_some(),
            prompt_logprobs: Vec::new(),
            prompt_logprobs_taken: false,
            token_logprobs: Vec::new(),
            fresh: 0,
            pending: None,
            context: params.context,
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
        if self.score_prompt {
            self.score_prompt(model)?;
        }
        let mut piece = self.echo.take().unwrap_or_default();
        piece.push_str(&self.step(model, tokenizer)?);
        Ok(Some(piece))
    }

    /// The next token: greedy where nothing needs the logits, drawn by the backend where the
    /// request samples without top-k or logprobs (its bias, penalties and min-p applied
    /// there), else sampled from the logits.
    fn choose(&mut self, model: &mut dyn Forward) -> Result<u32, String> {
        let params = *self.sampler.params();
        let temperature = params.temperature;
        let host_draw = temperature > 0.0
            && temperature.is_finite()
            && params.top_k == 0
            && params.top_p > 0.0
            && params.top_p <= 1.0
            && self.logprobs.is_none()
            && self.pending.is_none();
        if host_draw {
            let draw = HostDraw {
                sampling: &params,
                processing: self.processor.params(),
                processes: self.processor.changes_logits(temperature),
                generated_from: self.prompt_ids.len(),
            };
            if let Some(id) = model.sampled_next(&self.sequence, &draw)? {
                return Ok(id);
            }
        }
        Ok(
            if temperature <= 0.0
                && self.logprobs.is_none()
                && self.pending.is_none()
                && !self.processor.changes_logits(temperature)
            {
                model.greedy_next(&self.sequence)?
            } else {
                let pending = self.pending.take();
                let logits = match &pending {
                    Some(logits) => logits.as_slice(),
                    None => model.last_logits(&self.sequence)?,
                };
                let started = std::time::Instant::now();
                let processed = if self.processor.changes_logits(temperature) {
                    self.processor.apply(logits, temperature)
                } else {
                    logits
                };
                let next = if temperature <= 0.0 {
                    argmax(processed) as u32
                } else {
                    self.sampler.sample(processed) as u32
                };
                if let Some(n) = self.logprobs {
                    self.token_logprobs
                        .push(TokenLogprob::from_logits(logits, next, n));
                    self.fresh += 1;
                }
                self.sampling_seconds += started.elapsed().as_secs_f64();
                next
            },
        )
    }

    /// One token, or the end.
    fn step(
        &mut self,
        model: &mut dyn Forward,
        tokenizer: &Gpt2Tokenizer,
    ) -> Result<String, String> {
        if self.generated.len() >= self.max_tokens {
            return Ok(self.finish("length"));
        }
        if self.context.is_some_and(|c| self.sequence.len() >= c) {
            return Ok(self.finish("length"));
        }
        let next = match self.choose(model) {
            Ok(next) => next,
            // the backend's refusal, the last way to learn the context
            Err(_) if !self.generated.is_empty() && model.refused_as_too_large() => {
                return Ok(self.finish("length"));
            }
            Err(e) => return Err(e),
        };
        if Some(next) == self.end_of_text {
            self.drop_fresh_logprob();
            return Ok(self.finish("eos"));
        }
        if self.stop_ids.contains(&next) {
            self.drop_fresh_logprob();
            return Ok(self.finish("stop"));
        }
        self.processor.push(next);
        self.sequence.push(next);
        self.generated.push(next);
        let piece = self.utf8.push(tokenizer.token_bytes().get(next));
        Ok(match self.stops.push(&piece) {
            StopState::Continue(text) => text,
            StopState::Stopped(text) => {
                self.finish_reason = Some("stop");
                text
            }
        })
    }

    /// A token that ends the generation is not part of it, nor is its log probability.
    fn drop_fresh_logprob(&mut self) {
        if self.fresh > 0 {
            self.token_logprobs.pop();
            self.fresh -= 1;
        }
    }

    /// Score every prompt token (the first gets none) with one call over every position,
    /// and keep the last row for the first draw.
    fn score_prompt(&mut self, model: &mut dyn Forward) -> Result<(), String> {
        self.score_prompt = false;
        let n = self.logprobs.unwrap_or(0);
        let ids = &self.prompt_ids;
        let rows = match model.all_logits(ids)? {
            Some(rows) => rows,
            None => {
                let mut rows = Vec::new();
                for end in 1..=ids.len() {
                    rows.extend_from_slice(model.last_logits(&ids[..end])?);
                }
                rows
            }
        };
        let vocab = rows.len() / ids.len().max(1);
        if vocab == 0 || rows.len() != vocab * ids.len() {
            return Err(format!(
                "the backend returned {} logits for {} positions",
                rows.len(),
                ids.len()
            ));
        }
        self.prompt_logprobs.push(TokenLogprob {
            id: ids[0],
            logprob: None,
            top: Vec::new(),
        });
        for (row, &id) in rows.chunks_exact(vocab).zip(&ids[1..]) {
            self.prompt_logprobs
                .push(TokenLogprob::from_logits(row, id, n));
        }
        self.pending = rows.chunks_exact(vocab).last().map(<[f32]>::to_vec);
        Ok(())
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
    /// The generated text so far (up to a stop string, once one was found).
    pub fn text(&self) -> &str {
        self.stops.text()
    }
    /// The prompt's text when it is echoed, else empty.
    pub fn echo_text(&self) -> &str {
        &self.echo_text
    }
    /// The prompt tokens' log probabilities (`echo` with `logprobs`; empty before the first
    /// [`Generation::next`]).
    pub fn prompt_logprobs(&self) -> &[TokenLogprob] {
        &self.prompt_logprobs
    }
    /// Log probabilities of every generated token so far (with `logprobs`).
    pub fn logprobs(&self) -> &[TokenLogprob] {
        &self.token_logprobs
    }
    /// Log probabilities of the tokens generated since the last call; the first call after
    /// the prompt was scored (`echo` with `logprobs`) starts with the prompt's.
    pub fn take_fresh_logprobs(&mut self) -> Vec<TokenLogprob> {
        let n = std::mem::take(&mut self.fresh);
        let mut fresh = Vec::new();
        if !self.prompt_logprobs_taken && !self.score_prompt {
            self.prompt_logprobs_taken = true;
            fresh.extend_from_slice(&self.prompt_logprobs);
        }
        fresh.extend_from_slice(&self.token_logprobs[self.token_logprobs.len() - n..]);
        fresh
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draw_sends_its_processing_or_neutral_inputs() {
        let sampling = SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: 4,
            ..Default::default()
        };
        let processing = Processing {
            logit_bias: vec![(11, 2.5)],
            presence_penalty: 0.5,
            min_p: 0.05,
            ..Default::default()
        };
        let draw = |processes| HostDraw {
            sampling: &sampling,
            processing: &processing,
            processes,
            generated_from: 7,
        };
        let on = draw(true).inputs();
        assert_eq!(on.sampling(), [0.9, 0.95, 0.05]);
        assert_eq!(on.penalties, [0.5, 0.0, 1.0]);
        assert_eq!((on.generated_from, on.bias_ids.as_slice()), (7, &[11][..]));
        assert!(on.processes());
        let off = draw(false).inputs();
        assert_eq!(off.sampling(), [0.9, 0.95], "two values without min-p");
        assert_eq!(off.seed, 4);
        assert!(!off.processes() && off.bias_ids.is_empty());
    }

    /// A toy model over the real vocabulary: the next token after `t` is `t + 1` (logit 5),
    /// `t + 2` gets 4, every other token 0. It counts its calls.
    struct Counter {
        vocab: usize,
        logits: Vec<f32>,
        calls: usize,
        all_calls: usize,
    }

    impl Counter {
        fn new(vocab: usize) -> Self {
            Self {
                vocab,
                logits: Vec::new(),
                calls: 0,
                all_calls: 0,
            }
        }
        fn row(&self, last: u32) -> Vec<f32> {
            let mut row = vec![0.0; self.vocab];
            row[(last as usize + 1) % self.vocab] = 5.0;
            row[(last as usize + 2) % self.vocab] = 4.0;
            row
        }
    }

    impl Forward for Counter {
        fn last_logits(&mut self, tokens: &[u32]) -> Result<&[f32], String> {
            self.calls += 1;
            self.logits = self.row(*tokens.last().ok_or("empty")?);
            Ok(&self.logits)
        }
        fn all_logits(&mut self, tokens: &[u32]) -> Result<Option<Vec<f32>>, String> {
            self.all_calls += 1;
            Ok(Some(tokens.iter().flat_map(|&t| self.row(t)).collect()))
        }
    }

    fn tokenizer() -> Gpt2Tokenizer {
        Gpt2Tokenizer::embedded().expect("the embedded tokenizer builds")
    }

    fn run(g: &mut Generation, model: &mut Counter, t: &Gpt2Tokenizer) -> String {
        let mut text = String::new();
        while let Some(piece) = g.next(model, t).expect("no error") {
            text.push_str(&piece);
        }
        text
    }

    #[test]
    fn echo_with_logprobs_scores_the_prompt_in_one_call_and_reuses_its_last_row() {
        let t = tokenizer();
        let params = GenerationParams {
            max_tokens: 2,
            logprobs: Some(2),
            echo: true,
            ..Default::default()
        };
        let mut g =
            Generation::with_prompt(&t, Prompt::Ids(&[100, 101, 7]), params).expect("test value");
        let mut model = Counter::new(t.vocab_size());
        let text = run(&mut g, &mut model, &t);
        assert_eq!(g.ids(), [8, 9]);
        assert!(text.starts_with(g.echo_text()));
        assert_eq!(g.echo_text(), t.decode(&[100, 101, 7]).expect("test value"));
        assert_eq!(
            (model.all_calls, model.calls),
            (1, 1),
            "one call per position"
        );
        let prompt = g.prompt_logprobs();
        assert_eq!(prompt.len(), 3);
        assert_eq!(prompt[0].logprob, None);
        // 101 follows 100: the top token; 7 after 101 is one of the zeros
        let lse = (5f64.exp() + 4f64.exp() + (t.vocab_size() - 2) as f64).ln();
        assert!((prompt[1].logprob.expect("test value") as f64 - (5.0 - lse)).abs() < 1e-5);
        assert!((prompt[2].logprob.expect("test value") as f64 + lse).abs() < 1e-5);
        assert_eq!(
            prompt[2].top.iter().map(|x| x.0).collect::<Vec<_>>(),
            [102, 103]
        );
        assert_eq!(g.logprobs().len(), 2);
        assert_eq!(g.logprobs()[0].id, 8);
    }

    #[test]
    fn stop_ids_bias_and_context_end_the_generation_as_asked() {
        let t = tokenizer();
        let mut model = Counter::new(t.vocab_size());
        let stop = GenerationParams {
            max_tokens: 10,
            stop_ids: vec![12],
            ..Default::default()
        };
        let mut g = Generation::with_prompt(&t, Prompt::Ids(&[9]), stop).expect("test value");
        run(&mut g, &mut model, &t);
        assert_eq!((g.ids(), g.finish_reason()), (&[10, 11][..], Some("stop")));

        // a ban on the top token makes the second one win
        let ban = GenerationParams {
            max_tokens: 1,
            processing: Processing {
                logit_bias: vec![(10, -100.0)],
                ..Default::default()
            },
            ..Default::default()
        };
        let mut g = Generation::with_prompt(&t, Prompt::Ids(&[9]), ban).expect("test value");
        run(&mut g, &mut model, &t);
        assert_eq!(g.ids(), [11]);

        let context = GenerationParams {
            max_tokens: 10,
            context: Some(4),
            ..Default::default()
        };
        let mut g =
            Generation::with_prompt(&t, Prompt::Ids(&[1, 2]), context.clone()).expect("test value");
        let text = run(&mut g, &mut model, &t);
        assert_eq!((g.ids(), g.finish_reason()), (&[3, 4][..], Some("length")));
        assert_eq!(text, g.text(), "the text made before the context is kept");
        let long = Generation::with_prompt(&t, Prompt::Ids(&[1, 2, 3, 4, 5]), context);
        assert_eq!(
            long.err().as_deref(),
            Some("the prompt has 5 tokens; this model's context is 4")
        );
    }

    #[test]
    fn bad_ids_are_refused_with_the_position() {
        let t = tokenizer();
        let vocab = t.vocab_size() as u32;
        let err = Generation::with_prompt(&t, Prompt::Ids(&[1, vocab]), Default::default());
        assert!(err
            .err()
            .expect("test value")
            .contains(&format!("token id {vocab} at position 1")));
    }
}

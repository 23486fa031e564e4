//! What OpenAI-style requests do to the logits before a token is chosen (logit bias,
//! repetition, frequency and presence penalties, min-p), and the log probabilities they
//! report for each token.
//!
//! The order is vLLM's: the bias, then the penalties (on the raw logits), then temperature
//! and the filters. Min-p keeps the tokens whose probability after temperature is at least
//! `min_p` times the top token's; it is applied by masking the others to `-inf` before the
//! sampler's top-k and top-p.
//!
//! Log probabilities are the log-softmax of the raw logits (before any of the above), as
//! OpenAI and vLLM report them.

use std::cmp::Ordering;

/// The logit processing a request asks for; the default changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct Processing {
    /// `(token id, bias)` added to the logit (OpenAI: -100 bans a token, 100 forces it).
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted once from the logit of every token generated so far (OpenAI's definition).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated so far.
    pub frequency_penalty: f32,
    /// HF / vLLM: the logit of every token of the prompt or the output is divided by this
    /// when positive, multiplied when negative (1: off).
    pub repetition_penalty: f32,
    /// Keep tokens at least this probable relative to the top one (0: off).
    pub min_p: f32,
}

impl Default for Processing {
    fn default() -> Self {
        Self {
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
        }
    }
}

impl Processing {
    /// Check the values against the vocabulary; the message names the field.
    pub fn validate(&self, vocab: usize) -> Result<(), String> {
        if let Some(&(id, _)) = self.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            return Err(format!(
                "logit_bias: token id {id} is outside the vocabulary (0..{vocab})"
            ));
        }
        if let Some(&(id, bias)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(format!("logit_bias: the bias of token {id} is {bias}"));
        }
        let finite = [self.presence_penalty, self.frequency_penalty, self.min_p];
        if !finite.iter().all(|v| v.is_finite()) {
            return Err("penalties and min_p must be finite numbers".into());
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

/// Applies a request's [`Processing`] step by step: it remembers which tokens the prompt
/// holds and how often each was generated.
pub struct LogitsProcessor {
    params: Processing,
    /// Generated count of each token id, in order of first appearance.
    counts: Vec<(u32, u32)>,
    /// The distinct tokens of the prompt and the output (for the repetition penalty).
    seen: Vec<u32>,
    seen_mask: Vec<bool>,
    /// A copy of the logits to change (the model's stay untouched for the logprobs).
    work: Vec<f32>,
}

impl LogitsProcessor {
    pub fn new(params: Processing, prompt_ids: &[u32]) -> Self {
        let mut processor = Self {
            params,
            counts: Vec::new(),
            seen: Vec::new(),
            seen_mask: Vec::new(),
            work: Vec::new(),
        };
        for &id in prompt_ids {
            processor.see(id);
        }
        processor
    }

    /// The request's processing.
    pub fn params(&self) -> &Processing {
        &self.params
    }

    /// Whether anything changes the logits besides temperature and the sampler's filters.
    pub fn changes_logits(&self, temperature: f32) -> bool {
        let p = &self.params;
        !p.logit_bias.is_empty()
            || p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || p.repetition_penalty != 1.0
            || (p.min_p > 0.0 && temperature > 0.0)
    }

    fn see(&mut self, id: u32) {
        let i = id as usize;
        if self.seen_mask.len() <= i {
            self.seen_mask.resize(i + 1, false);
        }
        if !self.seen_mask[i] {
            self.seen_mask[i] = true;
            self.seen.push(id);
        }
    }

    /// Record a generated token.
    pub fn push(&mut self, id: u32) {
        self.see(id);
        match self.counts.iter_mut().find(|(t, _)| *t == id) {
            Some((_, n)) => *n += 1,
            None => self.counts.push((id, 1)),
        }
    }

    /// The processed copy of `logits` for a draw at `temperature` (0: greedy).
    pub fn apply(&mut self, logits: &[f32], temperature: f32) -> &[f32] {
        self.work.clear();
        self.work.extend_from_slice(logits);
        let p = &self.params;
        let w = &mut self.work;
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = w.get_mut(id as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &id in &self.seen {
                if let Some(l) = w.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for &(id, n) in &self.counts {
                if let Some(l) = w.get_mut(id as usize) {
                    *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }
        if p.min_p > 0.0 && temperature > 0.0 {
            let max = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // p_i >= min_p * p_max  <=>  (l_i - l_max) / T >= ln(min_p)
            let floor = max + temperature * p.min_p.ln();
            for l in w.iter_mut() {
                if *l < floor {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        &self.work
    }
}

/// A token's log probability and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    /// `None` for the first token of a prompt (nothing predicts it).
    pub logprob: Option<f32>,
    /// The `n` most likely tokens, most likely first (ties by lower id).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// The entry of `id` drawn from the raw `logits`, with the `n` most likely alternatives.
    pub fn from_logits(logits: &[f32], id: u32, n: usize) -> Self {
        let lse = crate::log_sum_exp(logits);
        let logprob = |l: f32| (l as f64 - lse) as f32;
        let top = top_n(logits, n)
            .into_iter()
            .map(|i| (i, logprob(logits[i as usize])))
            .collect();
        Self {
            id,
            logprob: logits.get(id as usize).map(|&l| logprob(l)),
            top,
        }
    }
}

/// Ids of the `n` largest logits, largest first, ties by lower id; NaN never counts.
pub fn top_n(logits: &[f32], n: usize) -> Vec<u32> {
    // (logit, id) kept sorted, most likely first; n is small (<= 20 through the service)
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return Vec::new();
    }
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() || (best.len() == n && l <= best[n - 1].0) {
            continue;
        }
        let at = best.partition_point(|&(b, _)| b >= l);
        best.insert(at, (l, i as u32));
        best.truncate(n);
    }
    best.sort_by(|a, b| {
        b.0.partial_cmp(&a.0)
            .unwrap_or(Ordering::Equal)
            .then(a.1.cmp(&b.1))
    });
    best.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neutral_processing_changes_nothing() {
        let p = LogitsProcessor::new(Processing::default(), &[1, 2]);
        assert!(!p.changes_logits(1.0));
    }

    #[test]
    fn bias_and_penalties_follow_the_openai_and_hf_definitions() {
        let params = Processing {
            logit_bias: vec![(0, -100.0), (3, 2.5)],
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            min_p: 0.0,
        };
        // token 1 in the prompt, token 2 generated twice, token 4 once
        let mut p = LogitsProcessor::new(params, &[1]);
        p.push(2);
        p.push(4);
        p.push(2);
        let out = p.apply(&[1.0, 4.0, -2.0, 0.5, 3.0, 1.0], 1.0).to_vec();
        assert_eq!(out[0], 1.0 - 100.0);
        assert_eq!(out[1], 4.0 / 2.0); // prompt token: repetition only
        assert_eq!(out[2], -2.0 * 2.0 - (2.0 * 0.25 + 0.5)); // negative: multiplied
        assert_eq!(out[3], 0.5 + 2.5);
        assert_eq!(out[4], 3.0 / 2.0 - (0.25 + 0.5));
        assert_eq!(out[5], 1.0);
    }

    #[test]
    fn min_p_masks_tokens_below_its_share_of_the_top_after_temperature() {
        let params = Processing {
            min_p: 0.1,
            ..Default::default()
        };
        let mut p = LogitsProcessor::new(params, &[]);
        // at T = 1: p_i / p_max = exp(l_i - 5)
        let out = p.apply(&[5.0, 3.0, 2.6, 2.0], 1.0).to_vec();
        assert_eq!(out[..2], [5.0, 3.0]); // e^-2 = 0.135 stays
        assert_eq!(out[2..], [f32::NEG_INFINITY; 2]); // e^-2.4 = 0.09 goes
                                                      // at T = 2 the same ratio is reached twice as far down
        let out = p.apply(&[5.0, 3.0, 2.6, 0.0], 2.0).to_vec();
        assert_eq!(out[..3], [5.0, 3.0, 2.6]);
        assert_eq!(out[3], f32::NEG_INFINITY);
        assert!(!p.changes_logits(0.0), "greedy ignores min_p");
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_raw_logits() {
        let logits = [1.0f32, 3.0, 3.0, -1.0, f32::NAN.max(0.5)];
        let entry = TokenLogprob::from_logits(&logits, 3, 3);
        let lse = logits.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
        assert_eq!(entry.logprob, Some((-1.0 - lse) as f32));
        let ids: Vec<u32> = entry.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 2, 0], "ties by lower id");
        assert_eq!(entry.top[0].1, (3.0 - lse) as f32);
        let total: f64 = logits.iter().map(|&l| (l as f64 - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }

    #[test]
    fn top_n_skips_nan_and_handles_short_rows() {
        assert_eq!(top_n(&[0.0, f32::NAN, 2.0], 5), [2, 0]);
        assert_eq!(top_n(&[1.0, 1.0, 1.0], 2), [0, 1]);
        assert!(top_n(&[1.0], 0).is_empty());
    }

    #[test]
    fn validation_names_the_field() {
        let bad = Processing {
            logit_bias: vec![(70000, 1.0)],
            ..Default::default()
        };
        assert!(bad
            .validate(50257)
            .expect_err("an error")
            .contains("logit_bias"));
        let bad = Processing {
            repetition_penalty: 0.0,
            ..Default::default()
        };
        assert!(bad
            .validate(50257)
            .expect_err("an error")
            .contains("repetition_penalty"));
    }
}

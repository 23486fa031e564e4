//! What a request does to the logits before its draw: OpenAI's `logit_bias`, presence and
//! frequency penalties, and HF's repetition penalty. The guest names them with its draw
//! (inputs 4-7 of the graph contract) and the host applies them to the logits where they are,
//! so that a request with penalties also gets one token back instead of 50,257 logits.
//!
//! The arithmetic is the guest's own (`guest/src/processing.rs`, vLLM's order), step by step
//! in f32, so the processed logits are the same bits on either side:
//!
//! 1. each `(id, bias)` of the bias list is added to its logit, in the list's order;
//! 2. with a repetition penalty `r` other than 1, the logit of every distinct token of the
//!    sequence (prompt and generated) is divided by `r` when above 0, else multiplied;
//! 3. the logit of every distinct token generated so far (the sequence from
//!    `generated_from` on), `n` times, loses `n * frequency + presence`.
//!
//! Min-p, which masks tokens after the temperature, is part of the draw's rule
//! ([`super::draw::DrawRule::min_p`]).

/// Most entries of a bias list (OpenAI takes 300).
pub const MAX_BIAS: usize = 1024;

/// A request's processing of the logits; [`Processing::default`] changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct Processing {
    /// `(token id, bias)`, added in this order.
    bias: Vec<(u32, f32)>,
    presence: f32,
    frequency: f32,
    /// 1: off.
    repetition: f32,
    /// The first position of the sequence whose tokens count as generated.
    generated_from: usize,
}

impl Default for Processing {
    fn default() -> Self {
        Self {
            bias: Vec::new(),
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            generated_from: 0,
        }
    }
}

/// Why a processing cannot be applied.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProcessingError {
    #[error("penalties must be finite (presence {presence}, frequency {frequency}) and the repetition penalty above 0 ({repetition})")]
    Penalty {
        presence: f32,
        frequency: f32,
        repetition: f32,
    },
    #[error("logit bias: token id {id} is outside the vocabulary (0..{vocab})")]
    BiasId { id: i64, vocab: usize },
    #[error("logit bias: the bias of token {id} is {bias}, not a finite number")]
    BiasValue { id: u32, bias: f32 },
    #[error("logit bias: {ids} ids and {values} values (inputs 6 and 7 pair them)")]
    BiasLengths { ids: usize, values: usize },
    #[error("logit bias: {0} entries, more than {MAX_BIAS}")]
    BiasTooLong(usize),
    #[error("generated_from {from} is past the sequence of {len} tokens")]
    GeneratedFrom { from: usize, len: usize },
    #[error("generated_from {0} is negative")]
    NegativeGeneratedFrom(i32),
}

impl Processing {
    /// The penalties (`presence`, `frequency`: finite; `repetition`: above 0) and the bias
    /// list (`ids` and `values` in pairs, every id below `vocab`, every value finite).
    pub fn new(
        (presence, frequency, repetition): (f32, f32, f32),
        ids: &[i32],
        values: &[f32],
        generated_from: usize,
        vocab: usize,
    ) -> Result<Self, ProcessingError> {
        if !(presence.is_finite()
            && frequency.is_finite()
            && repetition.is_finite()
            && repetition > 0.0)
        {
            return Err(ProcessingError::Penalty {
                presence,
                frequency,
                repetition,
            });
        }
        if ids.len() != values.len() {
            return Err(ProcessingError::BiasLengths {
                ids: ids.len(),
                values: values.len(),
            });
        }
        if ids.len() > MAX_BIAS {
            return Err(ProcessingError::BiasTooLong(ids.len()));
        }
        let bias = (ids.iter().zip(values))
            .map(|(&id, &bias)| {
                let id = u32::try_from(id)
                    .ok()
                    .filter(|&i| (i as usize) < vocab)
                    .ok_or_else(|| ProcessingError::BiasId {
                        id: i64::from(id),
                        vocab,
                    })?;
                match bias.is_finite() {
                    true => Ok((id, bias)),
                    false => Err(ProcessingError::BiasValue { id, bias }),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            bias,
            presence,
            frequency,
            repetition,
            generated_from,
        })
    }

    /// Whether it changes no logit.
    pub fn is_neutral(&self) -> bool {
        self.bias.is_empty()
            && self.presence == 0.0
            && self.frequency == 0.0
            && self.repetition == 1.0
    }

    /// The processed copy of `logits`, the last position's of `sequence`, into `out`.
    pub fn apply(
        &self,
        logits: &[f32],
        sequence: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), ProcessingError> {
        if self.generated_from > sequence.len() {
            return Err(ProcessingError::GeneratedFrom {
                from: self.generated_from,
                len: sequence.len(),
            });
        }
        out.clear();
        out.extend_from_slice(logits);
        for &(id, bias) in &self.bias {
            if let Some(l) = out.get_mut(id as usize) {
                *l += bias;
            }
        }
        if self.repetition != 1.0 {
            for id in distinct(sequence) {
                if let Some(l) = out.get_mut(id as usize) {
                    *l = match *l > 0.0 {
                        true => *l / self.repetition,
                        false => *l * self.repetition,
                    };
                }
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            let mut generated = sequence[self.generated_from..].to_vec();
            generated.sort_unstable();
            for run in generated.chunk_by(|a, b| a == b) {
                if let Some(l) = out.get_mut(run[0] as usize) {
                    *l -= run.len() as f32 * self.frequency + self.presence;
                }
            }
        }
        Ok(())
    }
}

/// One token's processing, as a device applies it: the steps of [`Processing::apply`] that
/// touch the token `id`, in their order, with their operands (see [`Processing::edits`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Edit {
    pub id: u32,
    /// Its bias (step 1), where the bias list names it.
    pub bias: Option<f32>,
    /// It is in the sequence and the repetition penalty is not 1 (step 2).
    pub repeated: bool,
    /// `n * frequency + presence` (step 3, rounded as `apply` rounds it), where it was
    /// generated `n > 0` times and a penalty is set.
    pub penalty: Option<f32>,
    /// That `n` (0 where no penalty is set), from which the next position's penalty follows.
    pub generated: u32,
}

impl Edit {
    /// The processed value of the token's logit `l`: each step one f32 operation, in order.
    pub fn apply(&self, l: f32, repetition: f32) -> f32 {
        let mut l = l;
        if let Some(bias) = self.bias {
            l += bias;
        }
        if self.repeated {
            l = match l > 0.0 {
                true => l / repetition,
                false => l * repetition,
            };
        }
        if let Some(penalty) = self.penalty {
            l -= penalty;
        }
        l
    }
}

/// A request's processing of one position's logits as [`Edit`]s, one a token it changes, in
/// increasing id order ([`Processing::edits`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Edits {
    pub edits: Vec<Edit>,
    /// The repetition penalty, the operand of [`Edit::repeated`].
    pub repetition: f32,
    /// `(presence, frequency)` where either is set: the operands of [`Edit::penalty`].
    pub penalties: Option<(f32, f32)>,
}

/// A draw's rule and the edits of the processing before it, for a context's next position:
/// what a guest announces with its step ([`super::Session::announce_draw`]).
#[derive(Debug, Clone, PartialEq)]
pub struct EditedRule {
    pub rule: super::draw::DrawRule,
    pub edits: Edits,
}

/// How a device draws a context's next token where its guest draws by a rule: by the rule
/// alone, or by the rule after a processing's edits.
#[derive(Debug, Clone, PartialEq)]
pub enum DrawnBy {
    Rule(super::draw::DrawRule),
    Edited(std::sync::Arc<EditedRule>),
}

impl DrawnBy {
    /// The draw of the next position once `token` is appended (the rule's edits follow it).
    pub fn after(&self, token: u32) -> DrawnBy {
        match self {
            DrawnBy::Rule(rule) => DrawnBy::Rule(*rule),
            DrawnBy::Edited(e) if !e.edits.follow_tokens() => self.clone(),
            DrawnBy::Edited(e) => DrawnBy::Edited(std::sync::Arc::new(EditedRule {
                rule: e.rule,
                edits: e.edits.after(token),
            })),
        }
    }
}

impl Edits {
    /// No processing (a draw with min-p alone).
    pub fn none() -> Self {
        Self {
            edits: Vec::new(),
            repetition: 1.0,
            penalties: None,
        }
    }

    /// Whether the edits change as tokens are appended (a repetition penalty or penalties;
    /// a bias list alone stays as it is).
    pub fn follow_tokens(&self) -> bool {
        self.repetition != 1.0 || self.penalties.is_some()
    }

    /// The edits of the next position once `token` is appended to the sequence these are
    /// for: [`Processing::edits`] of the longer sequence, made from these alone. The token
    /// counts as generated (it is drawn), so only its own edit changes: it is in the
    /// sequence (the repetition penalty applies) and generated once more.
    pub fn after(&self, token: u32) -> Edits {
        if !self.follow_tokens() {
            return self.clone();
        }
        let repeated = self.repetition != 1.0;
        self.with_edit(token, |e| {
            e.repeated |= repeated;
            if let Some((presence, frequency)) = self.penalties {
                e.generated += 1;
                e.penalty = Some(e.generated as f32 * frequency + presence);
            }
        })
    }

    /// A copy with `token`'s edit (a new one where it has none, kept in id order) changed.
    fn with_edit(&self, token: u32, change: impl FnOnce(&mut Edit)) -> Edits {
        let mut next = self.clone();
        let at = match next.edits.binary_search_by_key(&token, |e| e.id) {
            Ok(at) => at,
            Err(at) => {
                let fresh = Edit {
                    id: token,
                    bias: None,
                    repeated: false,
                    penalty: None,
                    generated: 0,
                };
                next.edits.insert(at, fresh);
                at
            }
        };
        change(&mut next.edits[at]);
        next
    }

    /// The token `rule` draws for `position` from `logits` after these edits: the
    /// specification of a processed draw.
    pub fn draw(&self, mut logits: Vec<f32>, rule: &super::draw::DrawRule, position: usize) -> u32 {
        self.apply(&mut logits);
        super::draw::draw(&logits, rule, position)
    }

    /// The processed logits, in place: [`Processing::apply`]'s values.
    pub fn apply(&self, logits: &mut [f32]) {
        for e in &self.edits {
            if let Some(l) = logits.get_mut(e.id as usize) {
                *l = e.apply(*l, self.repetition);
            }
        }
    }
}

impl Processing {
    /// What [`Self::apply`] does to the logits of the last position of `sequence`, one
    /// [`Edit`] a token it changes, in increasing id order: each token's value depends on its
    /// own logit alone, so the edits can be applied in any order, or at once. None where the
    /// bias list names a token twice (its biases are added one by one, which one edit does
    /// not hold).
    pub fn edits(&self, sequence: &[u32]) -> Result<Option<Edits>, ProcessingError> {
        if self.generated_from > sequence.len() {
            return Err(ProcessingError::GeneratedFrom {
                from: self.generated_from,
                len: sequence.len(),
            });
        }
        let mut edits = std::collections::BTreeMap::<u32, Edit>::new();
        fn edit(edits: &mut std::collections::BTreeMap<u32, Edit>, id: u32) -> &mut Edit {
            edits.entry(id).or_insert(Edit {
                id,
                bias: None,
                repeated: false,
                penalty: None,
                generated: 0,
            })
        }
        for &(id, bias) in &self.bias {
            let e = edit(&mut edits, id);
            if e.bias.is_some() {
                return Ok(None);
            }
            e.bias = Some(bias);
        }
        if self.repetition != 1.0 {
            for id in distinct(sequence) {
                edit(&mut edits, id).repeated = true;
            }
        }
        let penalties = (self.presence != 0.0 || self.frequency != 0.0)
            .then_some((self.presence, self.frequency));
        if penalties.is_some() {
            let mut generated = sequence[self.generated_from..].to_vec();
            generated.sort_unstable();
            for run in generated.chunk_by(|a, b| a == b) {
                let e = edit(&mut edits, run[0]);
                e.generated = run.len() as u32;
                e.penalty = Some(e.generated as f32 * self.frequency + self.presence);
            }
        }
        Ok(Some(Edits {
            edits: edits.into_values().collect(),
            repetition: self.repetition,
            penalties,
        }))
    }
}

impl Processing {
    /// [`Self::edits`] of `sequence` made from `before`, the edits of `sequence` without its
    /// last token ([`Edits::after`]), where that token counts as generated (its position is
    /// at or past `generated_from`); None where it does not (the caller makes them whole).
    pub fn edits_after(&self, before: &Edits, sequence: &[u32]) -> Option<Edits> {
        let (&last, earlier) = sequence.split_last()?;
        (earlier.len() >= self.generated_from).then(|| before.after(last))
    }
}

/// The distinct ids of `sequence`, in increasing order.
fn distinct(sequence: &[u32]) -> Vec<u32> {
    let mut ids = sequence.to_vec();
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn processing(bias: &[(i32, f32)], penalties: (f32, f32, f32), from: usize) -> Processing {
        let (ids, values): (Vec<i32>, Vec<f32>) = bias.iter().copied().unzip();
        Processing::new(penalties, &ids, &values, from, 6).expect("valid processing")
    }

    /// The guest's own test vector (`guest/src/processing.rs`): the same values, bit for bit.
    #[test]
    fn bias_and_penalties_follow_the_openai_and_hf_definitions() {
        let p = processing(&[(0, -100.0), (3, 2.5)], (0.5, 0.25, 2.0), 1);
        // token 1 in the prompt, token 2 generated twice, token 4 once
        let sequence = [1, 2, 4, 2];
        let mut out = Vec::new();
        p.apply(&[1.0, 4.0, -2.0, 0.5, 3.0, 1.0], &sequence, &mut out)
            .expect("applied");
        assert_eq!(out[0], 1.0 - 100.0);
        assert_eq!(out[1], 4.0 / 2.0, "a prompt token: repetition only");
        assert_eq!(
            out[2],
            -2.0 * 2.0 - (2.0 * 0.25 + 0.5),
            "negative: multiplied"
        );
        assert_eq!(out[3], 0.5 + 2.5);
        assert_eq!(out[4], 3.0 / 2.0 - (0.25 + 0.5));
        assert_eq!(out[5], 1.0);
    }

    #[test]
    fn a_bias_listed_twice_adds_twice_in_order_and_neutral_changes_nothing() {
        let p = processing(&[(2, 0.1), (2, 0.2)], (0.0, 0.0, 1.0), 0);
        let mut out = Vec::new();
        p.apply(&[0.0, 0.0, 1.0, 0.0, 0.0, 0.0], &[2, 2], &mut out)
            .expect("applied");
        assert_eq!(out[2], 1.0 + 0.1 + 0.2);
        assert!(Processing::default().is_neutral() && !p.is_neutral());
        let logits = [0.5, -1.0, 2.0, 0.0, 3.0, 1.0];
        Processing::default()
            .apply(&logits, &[1, 2, 3], &mut out)
            .expect("applied");
        assert_eq!(out, logits);
    }

    /// Random processings of random logits: the edits, applied each to its own token, give
    /// `apply`'s values bit for bit (the device applies them so).
    #[test]
    fn the_edits_apply_what_apply_does() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let vocab = 64;
        for round in 0..300 {
            let logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-8.0..8.0)).collect();
            let len = rng.random_range(1..40);
            let sequence: Vec<u32> = (0..len)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect();
            // distinct bias ids, some of them
            let mut ids: Vec<i32> = (0..vocab as i32).filter(|_| rng.random_bool(0.1)).collect();
            ids.reverse();
            let values: Vec<f32> = ids.iter().map(|_| rng.random_range(-5.0..5.0)).collect();
            // each penalty set or not
            let (presence, frequency) = (rng.random_range(-2.0..2.0), rng.random_range(-1.0..1.0));
            let penalties = (
                if rng.random_bool(0.5) { presence } else { 0.0 },
                if rng.random_bool(0.5) { frequency } else { 0.0 },
                match round % 3 {
                    0 => 1.0,
                    _ => rng.random_range(0.5..2.0),
                },
            );
            let from = rng.random_range(0..=len);
            let p = Processing::new(penalties, &ids, &values, from, vocab).expect("valid");
            let mut expected = Vec::new();
            p.apply(&logits, &sequence, &mut expected).expect("applied");
            let edits = p.edits(&sequence).expect("edits").expect("distinct ids");
            let mut edited = logits.clone();
            edits.apply(&mut edited);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&edited), bits(&expected), "round {round}");
            assert!(
                edits.edits.windows(2).all(|w| w[0].id < w[1].id),
                "one edit an id, in order"
            );
        }
        let twice = processing(&[(2, 0.1), (2, 0.2)], (0.0, 0.0, 1.0), 0);
        assert_eq!(
            twice.edits(&[1]),
            Ok(None),
            "a bias named twice has no edit"
        );
        assert_eq!(
            processing(&[], (0.5, 0.0, 1.0), 3).edits(&[1, 2]),
            Err(ProcessingError::GeneratedFrom { from: 3, len: 2 })
        );
    }

    /// The edits after a token appended are the longer sequence's own, for random
    /// processings, sequences and tokens, over several tokens in a row.
    #[test]
    fn the_edits_after_a_token_are_the_longer_sequences() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let vocab = 48;
        for round in 0..300 {
            let len = rng.random_range(1..30);
            let mut sequence: Vec<u32> = (0..len)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect();
            let ids: Vec<i32> = (0..vocab as i32).filter(|_| rng.random_bool(0.1)).collect();
            let values: Vec<f32> = ids.iter().map(|_| rng.random_range(-5.0..5.0)).collect();
            let penalties = (
                [0.0, rng.random_range(-2.0..2.0)][round % 2],
                [0.0, rng.random_range(-1.0..1.0)][(round / 2) % 2],
                [1.0, rng.random_range(0.5..2.0)][(round / 4) % 2],
            );
            let from = rng.random_range(0..=len);
            let p = Processing::new(penalties, &ids, &values, from, vocab).expect("valid");
            let mut edits = p.edits(&sequence).expect("edits").expect("distinct ids");
            for _ in 0..4 {
                // often a token already there, so that counts grow
                let token = match rng.random_bool(0.5) {
                    true => sequence[rng.random_range(0..sequence.len())],
                    false => rng.random_range(0..vocab as u32),
                };
                edits = edits.after(token);
                sequence.push(token);
                let expected = p.edits(&sequence).expect("edits").expect("distinct ids");
                assert_eq!(edits, expected, "round {round}");
            }
        }
    }

    #[test]
    fn edits_after_follow_a_generated_token_only() {
        let p = processing(&[(0, 1.0)], (0.5, 0.25, 2.0), 3);
        // position 1 is before generated_from: a prompt token, which no penalty counts
        assert_eq!(p.edits_after(&Edits::none(), &[1, 2]), None);
        let before = p.edits(&[1, 2, 4]).expect("edits").expect("distinct ids");
        let longer = [1, 2, 4, 4];
        assert_eq!(
            p.edits_after(&before, &longer),
            p.edits(&longer).expect("edits")
        );
        assert_eq!(p.edits_after(&before, &[]), None);
    }

    #[test]
    fn bad_values_are_refused_with_their_field() {
        let new = |penalties, ids: &[i32], values: &[f32]| {
            Processing::new(penalties, ids, values, 0, 6).expect_err("refused")
        };
        assert!(matches!(
            new((f32::NAN, 0.0, 1.0), &[], &[]),
            ProcessingError::Penalty { .. }
        ));
        assert!(matches!(
            new((0.0, 0.0, 0.0), &[], &[]),
            ProcessingError::Penalty { .. }
        ));
        assert_eq!(
            new((0.0, 0.0, 1.0), &[6], &[1.0]),
            ProcessingError::BiasId { id: 6, vocab: 6 }
        );
        assert_eq!(
            new((0.0, 0.0, 1.0), &[-1], &[1.0]),
            ProcessingError::BiasId { id: -1, vocab: 6 }
        );
        assert!(matches!(
            new((0.0, 0.0, 1.0), &[1], &[f32::INFINITY]),
            ProcessingError::BiasValue { id: 1, .. }
        ));
        assert_eq!(
            new((0.0, 0.0, 1.0), &[1, 2], &[1.0]),
            ProcessingError::BiasLengths { ids: 2, values: 1 }
        );
        let long = vec![0; MAX_BIAS + 1];
        assert_eq!(
            new((0.0, 0.0, 1.0), &long, &vec![0.0; MAX_BIAS + 1]),
            ProcessingError::BiasTooLong(MAX_BIAS + 1)
        );
        let past = processing(&[], (0.5, 0.0, 1.0), 3);
        assert_eq!(
            past.apply(&[0.0; 6], &[1, 2], &mut Vec::new()),
            Err(ProcessingError::GeneratedFrom { from: 3, len: 2 })
        );
    }
}

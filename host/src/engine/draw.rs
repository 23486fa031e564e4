//! Drawing the next token where the logits are: the rule a guest names with its sampling
//! settings (temperature, top-p, seed), and its specification, which the CPU backend runs and
//! the GPU kernel (`draw_token` in `kernels/draw.cu`) is checked against.
//!
//! The guest still decides: it sends the rule with its `compute` and gets one token back
//! instead of 50,257 logits to read, weigh and draw from (the guest's cycle at 64 sampling
//! streams was 0.8 ms of CPU a token, most of it that). The rule samples exactly from the
//! softmax of the logits at the temperature, restricted to the top-p nucleus:
//!
//! 1. Weights `w_i = exp((l_i - max) / T)` in f64 (a NaN logit weighs 0). Without a finite
//!    largest logit (all NaN or -inf, or +inf) the draw is the greedy [`super::argmax`].
//! 2. Draw `k` (from 0): `u_k` uniform in [0, 1) from the seed, the position drawn for and
//!    `k` ([`uniform`]); the token is the first id whose cumulative weight (in id order)
//!    passes `u_k` times the total.
//! 3. With top-p below 1, the token is kept if the tokens more likely than it (a higher
//!    logit, or the same one and a lower id) weigh less than top-p of the total, i.e. if it is
//!    in the nucleus; otherwise draw `k + 1`. Each draw lands in the nucleus with probability
//!    at least top-p, so a kept draw is distributed exactly as the nucleus.
//! 4. After [`MAX_DRAWS`] draws outside the nucleus (odds below 2^-32 for top-p 0.5), the
//!    nucleus is found by sorting and draw [`MAX_DRAWS`] picks from it in order of likelihood.
//!
//! The uniforms depend on the seed and the position alone, so the token drawn for a position
//! does not depend on what was drawn before or on which other contexts share the step, and a
//! step run ahead can draw it too.

/// What the guest asks of a draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawRule {
    /// Above 0 and finite.
    pub temperature: f32,
    /// In (0, 1]; 1 keeps every token.
    pub top_p: f32,
    pub seed: u64,
}

/// Draws outside the nucleus before the nucleus is found by sorting.
pub const MAX_DRAWS: u32 = 32;

/// Why a rule cannot be drawn with.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RuleError {
    #[error("temperature {0} must be finite and above 0 (0 means greedy: ask for next_token)")]
    Temperature(f32),
    #[error("top_p {0} must be in (0, 1]")]
    TopP(f32),
}

impl DrawRule {
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Result<Self, RuleError> {
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(RuleError::Temperature(temperature));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(RuleError::TopP(top_p));
        }
        Ok(Self {
            temperature,
            top_p,
            seed,
        })
    }

    /// `1 / T` as the weights use it.
    pub fn inverse_temperature(&self) -> f64 {
        1.0 / f64::from(self.temperature)
    }
}

/// SplitMix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Draw `k`'s uniform in [0, 1) for `position`: output number `position * 64 + k + 1` of the
/// SplitMix64 sequence that starts from the mixed seed, its top 53 bits.
pub fn uniform(seed: u64, position: usize, k: u32) -> f64 {
    const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
    let counter = (position as u64)
        .wrapping_mul(64)
        .wrapping_add(u64::from(k) + 1);
    let bits = mix(mix(seed).wrapping_add(counter.wrapping_mul(GOLDEN)));
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A token's weight against the largest logit `max`.
fn weight(l: f32, max: f32, inverse_t: f64) -> f64 {
    if l.is_nan() {
        0.0
    } else {
        ((f64::from(l) - f64::from(max)) * inverse_t).exp()
    }
}

/// Whether token `j` (logit `lj`) is more likely than token `x` (logit `lx`).
fn more_likely(lj: f32, j: usize, lx: f32, x: usize) -> bool {
    lj > lx || (lj == lx && j < x)
}

/// The token `rule` draws from `logits` for `position` (the index of the token drawn: the
/// sequence's length).
pub fn draw(logits: &[f32], rule: &DrawRule, position: usize) -> u32 {
    match draw_by_rejection(logits, rule, position) {
        Drawn::Token(id) => id,
        Drawn::Undecided { weights, total } => {
            nucleus_draw(logits, &weights, total, rule, position)
        }
    }
}

/// Steps 1-3 of the rule, what the GPU kernel does.
pub enum Drawn {
    Token(u32),
    /// Every draw fell outside the nucleus; the weights and their total, for step 4.
    Undecided {
        weights: Vec<f64>,
        total: f64,
    },
}

/// Steps 1-3 of the rule: the token, or [`Drawn::Undecided`] after [`MAX_DRAWS`] draws outside
/// the nucleus.
pub fn draw_by_rejection(logits: &[f32], rule: &DrawRule, position: usize) -> Drawn {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    if !max.is_finite() {
        return Drawn::Token(super::argmax(logits));
    }
    let inverse_t = rule.inverse_temperature();
    let weights: Vec<f64> = logits.iter().map(|&l| weight(l, max, inverse_t)).collect();
    let total: f64 = weights.iter().sum();
    let top_p = f64::from(rule.top_p);
    for k in 0..MAX_DRAWS {
        let x = pick(&weights, uniform(rule.seed, position, k) * total);
        if rule.top_p >= 1.0 {
            return Drawn::Token(x as u32);
        }
        let lx = logits[x];
        let before: f64 = (logits.iter().zip(&weights).enumerate())
            .filter(|&(j, (&lj, _))| more_likely(lj, j, lx, x))
            .map(|(_, (_, &w))| w)
            .sum();
        if before < top_p * total {
            return Drawn::Token(x as u32);
        }
    }
    Drawn::Undecided { weights, total }
}

/// The first id whose cumulative weight passes `target` (the last weighing anything, where
/// rounding leaves the target past every one).
fn pick(weights: &[f64], target: f64) -> usize {
    let mut cumulative = 0.0;
    let mut last = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            last = i;
            cumulative += w;
            if cumulative > target {
                return i;
            }
        }
    }
    last
}

/// Step 4: the nucleus by sorting, then draw [`MAX_DRAWS`] from it in order of likelihood.
fn nucleus_draw(
    logits: &[f32],
    weights: &[f64],
    total: f64,
    rule: &DrawRule,
    position: usize,
) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| weights[i] > 0.0).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then_with(|| a.cmp(&b)));
    let bound = f64::from(rule.top_p) * total;
    let mut mass = 0.0;
    let mut kept = 0;
    for &i in &order {
        if mass >= bound {
            break;
        }
        mass += weights[i];
        kept += 1;
    }
    let nucleus = &order[..kept.max(1)];
    let target = uniform(rule.seed, position, MAX_DRAWS) * mass;
    let mut cumulative = 0.0;
    for &i in nucleus {
        cumulative += weights[i];
        if cumulative > target {
            return i as u32;
        }
    }
    nucleus[nucleus.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(temperature: f32, top_p: f32, seed: u64) -> DrawRule {
        DrawRule::new(temperature, top_p, seed).expect("a valid rule")
    }

    fn logits(n: usize, seed: u64, spread: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let u = uniform(seed, i, 0) as f32;
                (u - 0.5) * spread
            })
            .collect()
    }

    /// The probability of each token under the rule (softmax at T, restricted to the nucleus).
    fn expected(logits: &[f32], t: f32, top_p: f32) -> Vec<f64> {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        let w: Vec<f64> = logits
            .iter()
            .map(|&l| weight(l, max, 1.0 / f64::from(t)))
            .collect();
        let total: f64 = w.iter().sum();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let mut p = vec![0.0; logits.len()];
        let mut before = 0.0;
        for &i in &order {
            if before < f64::from(top_p) * total {
                p[i] = w[i];
            }
            before += w[i];
        }
        let kept: f64 = p.iter().sum();
        p.iter().map(|x| x / kept).collect()
    }

    /// Draw at many positions and compare the counts with the expected probabilities: each
    /// count within 5 standard deviations (plus one) of its expectation, and no token outside
    /// the nucleus drawn.
    fn check_frequencies(logits: &[f32], t: f32, top_p: f32, draws: usize) {
        let r = rule(t, top_p, 7);
        let probs = expected(logits, t, top_p);
        let mut counts = vec![0usize; logits.len()];
        for position in 0..draws {
            counts[draw(logits, &r, position) as usize] += 1;
        }
        for (i, (&c, &p)) in counts.iter().zip(&probs).enumerate() {
            let mean = p * draws as f64;
            let sd = (draws as f64 * p * (1.0 - p)).sqrt();
            assert!(
                (c as f64 - mean).abs() <= 5.0 * sd + 1.0,
                "token {i}: {c} draws, expected {mean:.1} (t {t}, top_p {top_p})"
            );
            if p == 0.0 {
                assert_eq!(c, 0, "token {i} is outside the nucleus");
            }
        }
    }

    #[test]
    fn draws_follow_the_nucleus_distribution() {
        let peaked = logits(40, 1, 8.0);
        let flat = logits(40, 2, 0.5);
        for (l, t, p) in [
            (&peaked, 1.0, 1.0),
            (&peaked, 0.7, 0.9),
            (&flat, 1.0, 0.55),
            (&flat, 2.0, 0.3),
            (&peaked, 1.3, 0.05),
        ] {
            check_frequencies(l, t, p, 20_000);
        }
    }

    /// Ties across the nucleus's edge: of four equal logits the nucleus keeps the lower ids.
    #[test]
    fn ties_at_the_edge_keep_the_lower_ids() {
        let l = vec![0.0f32, 1.0, 1.0, 1.0, 1.0, -3.0];
        let probs = expected(&l, 1.0, 0.4);
        assert!(probs[1] > 0.0 && probs[2] > 0.0 && probs[3] == 0.0 && probs[4] == 0.0);
        check_frequencies(&l, 1.0, 0.4, 20_000);
    }

    #[test]
    fn the_same_seed_and_position_draw_the_same_token() {
        let l = logits(1000, 3, 6.0);
        let (a, b) = (rule(0.8, 0.95, 11), rule(0.8, 0.95, 12));
        let first: Vec<u32> = (0..64).map(|p| draw(&l, &a, p)).collect();
        let again: Vec<u32> = (0..64).map(|p| draw(&l, &a, p)).collect();
        let other: Vec<u32> = (0..64).map(|p| draw(&l, &b, p)).collect();
        assert_eq!(first, again);
        assert_ne!(first, other);
    }

    #[test]
    fn nan_never_wins_and_degenerate_rows_are_greedy() {
        let r = rule(1.0, 1.0, 5);
        let mut l = vec![f32::NAN; 10];
        l[3] = 0.0;
        for position in 0..100 {
            assert_eq!(draw(&l, &r, position), 3);
        }
        assert_eq!(draw(&[f32::NEG_INFINITY; 4], &r, 0), 0);
        assert_eq!(draw(&[0.0, f32::INFINITY, f32::INFINITY], &r, 0), 1);
        // a tiny temperature is (almost) greedy
        let l = logits(100, 4, 4.0);
        assert_eq!(draw(&l, &rule(1e-6, 1.0, 1), 0), super::super::argmax(&l));
    }

    /// A nucleus far below half makes every draw miss now and then: past MAX_DRAWS the sorted
    /// nucleus decides, and it is still the nucleus.
    #[test]
    fn after_max_draws_the_sorted_nucleus_decides() {
        let l = logits(2000, 9, 0.1); // flat: top-p 0.01 keeps about 20 tokens
        let r = rule(1.0, 0.01, 3);
        let probs = expected(&l, 1.0, 0.01);
        for position in 0..200 {
            let x = draw(&l, &r, position) as usize;
            assert!(probs[x] > 0.0, "token {x} is outside the nucleus");
        }
    }

    #[test]
    fn rules_are_checked() {
        assert_eq!(DrawRule::new(0.0, 1.0, 0), Err(RuleError::Temperature(0.0)));
        assert!(DrawRule::new(f32::NAN, 1.0, 0).is_err());
        assert!(DrawRule::new(f32::INFINITY, 1.0, 0).is_err());
        assert_eq!(DrawRule::new(1.0, 0.0, 0), Err(RuleError::TopP(0.0)));
        assert!(DrawRule::new(1.0, 1.5, 0).is_err());
        assert!(DrawRule::new(1.0, f32::NAN, 0).is_err());
    }

    #[test]
    fn uniforms_are_in_range_and_differ_by_position_and_draw() {
        let mut seen = std::collections::HashSet::new();
        for position in 0..100 {
            for k in 0..=MAX_DRAWS {
                let u = uniform(42, position, k);
                assert!((0.0..1.0).contains(&u));
                seen.insert(u.to_bits());
            }
        }
        assert_eq!(seen.len(), 100 * (MAX_DRAWS as usize + 1));
    }
}

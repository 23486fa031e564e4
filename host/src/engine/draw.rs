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
//!    largest logit (all NaN or -inf, or +inf) the draw is the greedy [`super::argmax`]. With
//!    min-p above 0, a token whose logit is below `max + T * ln(min_p)` (computed in f32, as
//!    the guest does) weighs 0: its probability is under min-p times the top token's.
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
    /// In [0, 1]; 0 keeps every token.
    pub min_p: f32,
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
    #[error("min_p {0} must be in [0, 1]")]
    MinP(f32),
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
            min_p: 0.0,
        })
    }

    /// The same rule with min-p (in [0, 1]).
    pub fn with_min_p(self, min_p: f32) -> Result<Self, RuleError> {
        match (0.0..=1.0).contains(&min_p) {
            true => Ok(Self { min_p, ..self }),
            false => Err(RuleError::MinP(min_p)),
        }
    }

    /// Whether the GPU's draw kernel takes the rule as it is (temperature, top-p and seed).
    pub fn is_plain(&self) -> bool {
        self.min_p == 0.0
    }

    /// What min-p's floor is below the largest logit: `T * ln(min_p)` in f32, as the guest
    /// computes it (minus infinity without min-p: nothing is below the floor).
    pub fn min_p_offset(&self) -> f32 {
        self.temperature * self.min_p.ln()
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

/// Every token's [`weight`]: with AVX-512 or AVX2 where the CPU has them (the same
/// arithmetic, so the same bits, eight or four lanes at a time; over 50,257 logits 0.27 ms
/// with the library's `exp` one at a time, 0.11 ms with AVX2 on the development machine).
/// Written into `out`, which is reused from draw to draw (a fresh zeroed 400 KB a draw was
/// part of a draw's cost).
fn weigh(logits: &[f32], max: f32, inverse_t: f64, out: &mut Vec<f64>) {
    if out.len() != logits.len() {
        out.resize(logits.len(), 0.0);
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above).
        return unsafe { weights_avx512(logits, max, inverse_t, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { weights_avx2(logits, max, inverse_t, out) };
    }
    weights_in_lanes(logits, max, inverse_t, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weights_avx512(logits: &[f32], max: f32, inverse_t: f64, out: &mut [f64]) {
    weights_in_lanes(logits, max, inverse_t, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn weights_avx2(logits: &[f32], max: f32, inverse_t: f64, out: &mut [f64]) {
    weights_in_lanes(logits, max, inverse_t, out)
}

#[inline(always)]
fn weights_in_lanes(logits: &[f32], max: f32, inverse_t: f64, out: &mut [f64]) {
    for (w, &l) in out.iter_mut().zip(logits) {
        *w = weight(l, max, inverse_t);
    }
}

/// A token's weight against the largest logit `max`.
#[inline(always)]
fn weight(l: f32, max: f32, inverse_t: f64) -> f64 {
    let w = exp_weight((f64::from(l) - f64::from(max)) * inverse_t);
    if l.is_nan() {
        0.0
    } else {
        w
    }
}

/// `exp(x)` for `x <= 0` within a few ulp (as CUDA's `exp`), 0 below -708 (a weight under
/// 2^-1021 of the top token's moves no draw), without branches, so that a loop over the
/// vocabulary vectorises: 2^k times a degree-12 polynomial on `|r| <= ln 2 / 2`. The library's
/// `exp` took 290-370 us over 50,257 logits on the development machine, most of a CPU draw.
#[inline(always)]
fn exp_weight(x: f64) -> f64 {
    const LN2_HI: f64 = 0.693_147_180_369_123_8;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    // adding this rounds to an integer and leaves it in the low bits
    const ROUND: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    let clamped = x.max(-708.0);
    let shifted = clamped * std::f64::consts::LOG2_E + ROUND;
    let k = shifted - ROUND;
    let r = (clamped - k * LN2_HI) - k * LN2_LO;
    // Taylor terms to 1/12! (the first left out is below 2e-16 of the sum here), summed in
    // Estrin's order: a few dependent steps instead of twelve
    const C: [f64; 13] = [
        1.0,
        1.0,
        0.5,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5_040.0,
        1.0 / 40_320.0,
        1.0 / 362_880.0,
        1.0 / 3_628_800.0,
        1.0 / 39_916_800.0,
        1.0 / 479_001_600.0,
    ];
    let (r2, r4) = (r * r, r * r * (r * r));
    let r8 = r4 * r4;
    let q0 = (C[0] + C[1] * r) + (C[2] + C[3] * r) * r2;
    let q1 = (C[4] + C[5] * r) + (C[6] + C[7] * r) * r2;
    let q2 = (C[8] + C[9] * r) + (C[10] + C[11] * r) * r2;
    let p = (q0 + q1 * r4) + (q2 + C[12] * r4) * r8;
    // 2^k from k's low bits (k >= -1021 after the clamp)
    let k_bits = shifted.to_bits().wrapping_add(1023) << 52;
    let w = p * f64::from_bits(k_bits);
    if x < -708.0 {
        0.0
    } else {
        w
    }
}

/// The sum of the weights of the logits that `keep` keeps (branch-free, eight running sums).
fn sum_where(logits: &[f32], weights: &[f64], keep: impl Fn(f32) -> bool) -> f64 {
    let mut lanes = [0.0f64; 8];
    let (l8, w8) = (logits.chunks_exact(8), weights.chunks_exact(8));
    let mut tail = 0.0;
    for (&l, &w) in l8.remainder().iter().zip(w8.remainder()) {
        tail += if keep(l) { w } else { 0.0 };
    }
    for (ls, ws) in l8.zip(w8) {
        for ((s, &l), &w) in lanes.iter_mut().zip(ls).zip(ws) {
            *s += if keep(l) { w } else { 0.0 };
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// The sum of `values` in eight running sums (which vectorise), added in order at the end.
fn sum(values: &[f64]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let chunks = values.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (s, &v) in lanes.iter_mut().zip(chunk) {
            *s += v;
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// The token `rule` draws from `logits` for `position` (the index of the token drawn: the
/// sequence's length).
pub fn draw(logits: &[f32], rule: &DrawRule, position: usize) -> u32 {
    thread_local! {
        static WEIGHTS: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    WEIGHTS.with_borrow_mut(
        |weights| match rejection_into(logits, rule, position, weights) {
            Ok(id) => id,
            Err(total) => nucleus_draw(logits, weights, total, rule, position),
        },
    )
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
    let mut weights = Vec::new();
    match rejection_into(logits, rule, position, &mut weights) {
        Ok(id) => Drawn::Token(id),
        Err(total) => Drawn::Undecided { weights, total },
    }
}

/// Steps 1-3 with the weights into `weights`: the token, or the weights' total when
/// undecided.
fn rejection_into(
    logits: &[f32],
    rule: &DrawRule,
    position: usize,
    weights: &mut Vec<f64>,
) -> Result<u32, f64> {
    let max = largest(logits);
    if !max.is_finite() {
        return Ok(super::argmax(logits));
    }
    let inverse_t = rule.inverse_temperature();
    weigh(logits, max, inverse_t, weights);
    if rule.min_p > 0.0 {
        let floor = max + rule.min_p_offset();
        for (w, &l) in weights.iter_mut().zip(logits) {
            if l < floor {
                *w = 0.0;
            }
        }
    }
    let weights = &weights[..];
    let blocks: Vec<f64> = weights.chunks(BLOCK).map(sum).collect();
    let total = blocks.iter().sum::<f64>();
    let top_p = f64::from(rule.top_p);
    for k in 0..MAX_DRAWS {
        let x = pick(weights, &blocks, uniform(rule.seed, position, k) * total);
        if rule.top_p >= 1.0 {
            return Ok(x as u32);
        }
        let lx = logits[x];
        // (tokens tied with it count before it below its id: each weighs what it weighs)
        let above = sum_where(logits, weights, |lj| lj > lx);
        let ties = (logits[..x].iter()).filter(|&&lj| lj == lx).count();
        let before = above + ties as f64 * weights[x];
        if before < top_p * total {
            return Ok(x as u32);
        }
    }
    Err(total)
}

/// The first id whose cumulative weight passes `target` (the last weighing anything, where
/// rounding leaves the target past every one).
fn pick(weights: &[f64], blocks: &[f64], target: f64) -> usize {
    // the block the target falls in by the blocks' sums, then the token within it
    let mut cumulative = 0.0;
    for (b, &mass) in blocks.iter().enumerate() {
        if cumulative + mass > target {
            let start = b * BLOCK;
            let block = &weights[start..(start + BLOCK).min(weights.len())];
            let mut last = None;
            for (i, &w) in block.iter().enumerate() {
                if w > 0.0 {
                    last = Some(start + i);
                    cumulative += w;
                    if cumulative > target {
                        return start + i;
                    }
                }
            }
            if let Some(i) = last {
                return i;
            }
        }
        cumulative += mass;
    }
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

/// Tokens a block of [`pick`]'s first walk.
const BLOCK: usize = 64;

/// The largest logit, NaN skipped (16 running maxima, which vectorise).
fn largest(logits: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = logits.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &l) in lanes.iter_mut().zip(chunk) {
            *m = m.max(l);
        }
    }
    (lanes.iter().chain(tail)).fold(f32::NEG_INFINITY, |m, &l| m.max(l))
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

    /// The weights' exp against the library's, from 0 down past where it gives 0.
    #[test]
    fn the_weights_exp_is_within_a_few_ulp() {
        let mut x = 0.0f64;
        while x > -750.0 {
            let (ours, libm) = (exp_weight(x), x.exp());
            if x >= -708.0 {
                let off = (ours - libm).abs();
                assert!(
                    off <= 4.0 * f64::EPSILON * libm,
                    "exp({x}): {ours} against {libm}"
                );
            } else {
                assert_eq!(ours, 0.0, "exp({x})");
            }
            x -= 0.0137;
        }
        assert_eq!(exp_weight(0.0), 1.0);
        assert_eq!(exp_weight(f64::NEG_INFINITY), 0.0);
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

    /// Min-p draws what the rule without it draws from the logits with the tokens below its
    /// floor masked to -inf (as the guest masks them), at every position, and never one of
    /// those tokens.
    #[test]
    fn min_p_draws_as_the_masked_logits_do() {
        let logits = logits(5_000, 11, 12.0);
        let (t, min_p) = (0.7f32, 0.05f32);
        let max = largest(&logits);
        let floor = max + t * min_p.ln();
        let masked: Vec<f32> = (logits.iter())
            .map(|&l| if l < floor { f32::NEG_INFINITY } else { l })
            .collect();
        let kept = masked.iter().filter(|l| l.is_finite()).count();
        assert!(kept > 10 && kept < 2_000, "{kept} tokens above the floor");
        for top_p in [1.0, 0.9] {
            let with = rule(t, top_p, 5).with_min_p(min_p).expect("min_p");
            let without = rule(t, top_p, 5);
            assert!(!with.is_plain() && without.is_plain());
            for position in 0..300 {
                let id = draw(&logits, &with, position);
                assert_eq!(id, draw(&masked, &without, position), "position {position}");
                assert!(logits[id as usize] >= floor);
            }
        }
        for bad in [-0.1, 1.5, f32::NAN] {
            let refused = rule(1.0, 1.0, 0).with_min_p(bad);
            assert!(
                matches!(refused, Err(RuleError::MinP(_))),
                "{bad}: {refused:?}"
            );
        }
    }
}

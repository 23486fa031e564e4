//! Choosing the next token from logits: greedy, or temperature + top-k + top-p sampling with a
//! seeded ChaCha8 generator (the same seed gives the same choices on every platform).
//!
//! Exact and without a full sort: top-k and the nucleus are found by partial selection
//! (`select_nth_unstable`), sorting only the few candidates that survive. The order of the
//! filters follows HF transformers: temperature, then top-k, then top-p.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sampling settings. `temperature == 0` means greedy (argmax).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

/// Index of the largest value; the lowest index wins ties (as `torch.argmax` does on CPU).
/// NaN never wins.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    best
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Choose the next token id.
    pub fn sample(&mut self, logits: &[f32]) -> usize {
        let p = self.params;
        if p.temperature <= 0.0 || logits.len() < 2 {
            return argmax(logits);
        }
        let uniform: f64 = self.rng.random();
        let candidates = candidates(logits, p.top_k, p.top_p, p.temperature);
        pick(&candidates, uniform)
    }
}

/// The tokens that may be drawn with their unnormalised weights, after temperature, top-k
/// and top-p. Small sets come most likely first (ties by lower id); large nuclei come in the
/// (deterministic) order the selection left them.
pub fn candidates(logits: &[f32], top_k: usize, top_p: f32, temperature: f32) -> Vec<(usize, f64)> {
    let inv_t = 1.0 / temperature as f64;
    let max = logits[argmax(logits)] as f64;
    // exp((l - max) / T): stable, the largest weight is 1.
    let weight = |l: f32| {
        if l.is_nan() {
            0.0
        } else {
            ((l as f64 - max) * inv_t).exp()
        }
    };
    let mut all: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, weight(l)))
        .collect();
    let k = if top_k == 0 {
        all.len()
    } else {
        top_k.min(all.len())
    };
    if k < all.len() {
        all.select_nth_unstable_by(k - 1, by_likelihood);
        all.truncate(k);
    }
    if top_p < 1.0 {
        // Mass is relative to the top-k set, as HF applies top-p after top-k.
        let total: f64 = all.iter().map(|c| c.1).sum();
        let kept = nucleus(&mut all, top_p as f64 * total);
        all.truncate(kept);
    }
    if all.len() <= 4096 {
        all.sort_unstable_by(by_likelihood);
    }
    all
}

/// Most likely first; ties by lower id: a strict total order.
fn by_likelihood(a: &(usize, f64), b: &(usize, f64)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Reorder `items` so the smallest most-likely prefix whose mass reaches `target` comes first
/// and return its length (HF keeps a token while the mass before it is below top_p).
/// Repeated median selection: linear time, no full sort.
fn nucleus(items: &mut [(usize, f64)], target: f64) -> usize {
    let (mut lo, mut hi, mut mass_before) = (0usize, items.len(), 0.0f64);
    while hi - lo > 32 {
        let mid = lo + (hi - lo) / 2;
        items[lo..hi].select_nth_unstable_by(mid - lo, by_likelihood);
        let upper: f64 = items[lo..mid].iter().map(|c| c.1).sum();
        if mass_before + upper >= target {
            hi = mid; // the boundary lies among the more likely half
        } else {
            mass_before += upper;
            lo = mid;
        }
    }
    items[lo..hi].sort_unstable_by(by_likelihood);
    let mut cumulative = mass_before;
    for (i, c) in items[lo..hi].iter().enumerate() {
        cumulative += c.1;
        if cumulative >= target {
            return lo + i + 1;
        }
    }
    hi
}

/// Draw from weighted candidates with `uniform` in [0, 1).
fn pick(candidates: &[(usize, f64)], uniform: f64) -> usize {
    let total: f64 = candidates.iter().map(|c| c.1).sum();
    let mut target = uniform * total;
    for &(id, w) in candidates {
        if target < w {
            return id;
        }
        target -= w;
    }
    // Rounding left a sliver past the end: the last candidate with weight.
    candidates
        .iter()
        .rev()
        .find(|c| c.1 > 0.0)
        .map_or(0, |c| c.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = logits
            .iter()
            .map(|&l| ((l as f64 - max) / t as f64).exp())
            .collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    /// A slow reference: full sort, then HF's top-k and top-p filters.
    fn reference(logits: &[f32], top_k: usize, top_p: f32, t: f32) -> Vec<usize> {
        let probs = softmax(logits, t);
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        if top_k > 0 {
            order.truncate(top_k);
        }
        let mass: f64 = order.iter().map(|&i| probs[i]).sum();
        let mut kept = Vec::new();
        let mut cum = 0.0;
        for &i in &order {
            kept.push(i);
            cum += probs[i] / mass;
            if cum >= top_p as f64 {
                break;
            }
        }
        kept
    }

    fn random_logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random::<f32>() * 12.0 - 6.0).collect()
    }

    #[test]
    fn greedy_is_argmax_with_first_index_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.2]), 1);
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, 0.1, 5.0, 4.9]), 2);
    }

    #[test]
    fn candidate_sets_match_full_sort_reference() {
        for seed in 0..20 {
            let logits = random_logits(5000, seed);
            for &(k, p, t) in &[
                (0, 0.9, 1.0),
                (50, 1.0, 0.8),
                (40, 0.5, 1.3),
                (0, 0.999, 2.0),
                (7, 0.95, 0.7),
                (1, 0.3, 1.0),
            ] {
                let ours: Vec<usize> = candidates(&logits, k, p, t).iter().map(|c| c.0).collect();
                let mut ours_sorted = ours.clone();
                ours_sorted.sort();
                let mut want = reference(&logits, k, p, t);
                want.sort();
                assert_eq!(ours_sorted, want, "seed {seed} k {k} p {p} t {t}");
            }
        }
    }

    #[test]
    fn same_seed_same_choices_and_different_seed_differs() {
        let logits = random_logits(1000, 7);
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            seed: 42,
        };
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(params), draw(params));
        assert_ne!(draw(params), draw(SamplingParams { seed: 43, ..params }));
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        let logits = [0.0f32, 1.0, 2.0, -10.0];
        let probs = softmax(&logits, 1.0);
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            ..Default::default()
        });
        let n = 40_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&logits)] += 1;
        }
        for i in 0..4 {
            let freq = counts[i] as f64 / n as f64;
            assert!(
                (freq - probs[i]).abs() < 0.01,
                "token {i}: {freq} vs {}",
                probs[i]
            );
        }
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = random_logits(3000, 3);
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.5,
            top_k: 1,
            top_p: 1.0,
            seed: 9,
        });
        for _ in 0..10 {
            assert_eq!(s.sample(&logits), argmax(&logits));
        }
    }
}

//! The prompts a load sends: short built-in openings, or windows of token ids cut from a text
//! at random offsets, with lengths from a stated distribution, some of them long.
//!
//! A cut prompt `k` is the same on every run and in every phase (its offset and length come
//! from a ChaCha8 stream seeded with `k`): its text run alone and its text under load can be
//! compared. Lengths are uniform in `--prompt-tokens MIN-MAX`; with `--long-prompts F:N`, an
//! even share F of the prompts (prompt k when floor((k+1)F) > floor(kF)) are N tokens, +-10%.

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Openings of the built-in prompts: short, Shakespeare-like, of different lengths (so the
/// streams' contexts differ in length as well as in content).
const OPENINGS: &[&str] = &[
    "ROMEO:\n",
    "JULIET:\nWhy dost thou",
    "First Citizen:\n",
    "KING HENRY:\nNow, lords, to horse; the",
    "LADY MACBETH:\n",
    "HAMLET:\nWhat say you to",
    "GLOUCESTER:\nThe day is spent, and",
    "Second Servant:\n",
    "OTHELLO:\nSpeak, my good lord,",
    "PORTIA:\n",
    "BRUTUS:\nCome hither, Lucius; I",
    "CORIOLANUS:\nWhat news from",
    "Nurse:\n",
    "PROSPERO:\nThe isle is full of",
    "MERCUTIO:\nA plague upon",
    "QUEEN MARGARET:\n",
];

/// Characters of the prompt file tokenized (TinyShakespeare runs ~3.3 characters a token:
/// ~60k tokens, room for windows of a few thousand).
const TOKENIZED_CHARS: usize = 200_000;

/// One request's prompt, as the API takes it.
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

impl Prompt {
    pub fn json(&self) -> serde_json::Value {
        match self {
            Prompt::Text(text) => text.as_str().into(),
            Prompt::Ids(ids) => ids.clone().into(),
        }
    }

    /// A few words on it for a report.
    pub fn describe(&self) -> String {
        match self {
            Prompt::Text(text) => format!("{text:?}"),
            Prompt::Ids(ids) => format!("{} token ids from the prompt file", ids.len()),
        }
    }

    pub fn tokens(&self) -> Option<usize> {
        match self {
            Prompt::Text(_) => None,
            Prompt::Ids(ids) => Some(ids.len()),
        }
    }
}

/// How long the cut prompts are.
#[derive(Clone, Copy, Debug)]
pub struct Lengths {
    pub min: usize,
    pub max: usize,
    /// (share of the prompts, their length) of the long ones.
    pub long: Option<(f64, usize)>,
}

impl Lengths {
    /// `MIN-MAX` (or one number), and `F:N` for the long ones.
    pub fn parse(range: &str, long: Option<&str>) -> Result<Self> {
        let number = |s: &str| s.trim().parse::<usize>().with_context(|| format!("{s:?}"));
        let (min, max) = match range.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => (number(range)?, number(range)?),
        };
        if min == 0 || min > max {
            bail!("--prompt-tokens {range}: expected MIN-MAX with 1 <= MIN <= MAX");
        }
        let long = match long {
            None => None,
            Some(spec) => {
                let (share, len) = spec
                    .split_once(':')
                    .context("--long-prompts: expected SHARE:TOKENS, e.g. 0.25:800")?;
                let share: f64 = share.parse().context("--long-prompts: the share")?;
                if !(0.0..=1.0).contains(&share) {
                    bail!("--long-prompts: the share must be between 0 and 1");
                }
                Some((share, number(len)?))
            }
        };
        Ok(Self { min, max, long })
    }

    /// Whether prompt `k` is a long one.
    pub fn is_long(&self, k: usize) -> bool {
        self.long
            .is_some_and(|(share, _)| ((k + 1) as f64 * share).floor() > (k as f64 * share).floor())
    }

    /// The length of prompt `k` and where it starts in `available` tokens.
    fn window(&self, k: usize, available: usize) -> (usize, usize) {
        let mut rng = ChaCha8Rng::seed_from_u64(k as u64);
        let len = match self.long.filter(|_| self.is_long(k)) {
            Some((_, n)) => rng.random_range(n - n / 10..=n + n / 10),
            None => rng.random_range(self.min..=self.max),
        };
        let len = len.clamp(1, available);
        (len, rng.random_range(0..=available - len))
    }
}

/// Where the prompts come from.
pub enum Prompts {
    /// The built-in openings, then "Prompt K:".
    BuiltIn,
    /// Windows of these token ids.
    Cut { tokens: Vec<u32>, lengths: Lengths },
}

impl Prompts {
    /// The tokens of the first characters of `text`, through the service's `/tokenize`.
    pub fn cut(agent: &ureq::Agent, url: &str, text: &str, lengths: Lengths) -> Result<Self> {
        let end = (text.char_indices())
            .nth(TOKENIZED_CHARS)
            .map_or(text.len(), |(i, _)| i);
        let body = serde_json::json!({ "prompt": &text[..end] });
        let mut response = agent.post(format!("{url}/tokenize")).send_json(&body)?;
        let status = response.status();
        let answer: serde_json::Value = response.body_mut().read_json()?;
        if !status.is_success() {
            bail!("/tokenize: HTTP {status}: {answer}");
        }
        let tokens: Vec<u32> = serde_json::from_value(answer["tokens"].clone())
            .context("/tokenize answered without `tokens`")?;
        let longest = lengths.max.max(lengths.long.map_or(0, |(_, n)| n + n / 10));
        if tokens.len() < longest {
            bail!(
                "the prompt file holds {} tokens, fewer than a prompt of {longest}",
                tokens.len()
            );
        }
        Ok(Prompts::Cut { tokens, lengths })
    }

    /// Prompt `k`.
    pub fn get(&self, k: usize) -> Prompt {
        match self {
            Prompts::BuiltIn => Prompt::Text(
                OPENINGS
                    .get(k)
                    .map_or_else(|| format!("Prompt {k}:"), |p| (*p).to_owned()),
            ),
            Prompts::Cut { tokens, lengths } => {
                let (len, start) = lengths.window(k, tokens.len());
                Prompt::Ids(tokens[start..start + len].to_vec())
            }
        }
    }

    /// Whether prompt `k` is one of the long ones.
    pub fn is_long(&self, k: usize) -> bool {
        match self {
            Prompts::BuiltIn => false,
            Prompts::Cut { lengths, .. } => lengths.is_long(k),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarter_of_the_prompts_are_long_spread_evenly() {
        let lengths = Lengths::parse("180-220", Some("0.25:800")).expect("parses");
        let long: Vec<usize> = (0..16).filter(|&k| lengths.is_long(k)).collect();
        assert_eq!(long, vec![3, 7, 11, 15]);
        assert!(!Lengths::parse("200", None).expect("parses").is_long(3));
    }

    #[test]
    fn windows_are_the_same_every_time_and_within_the_stated_lengths() {
        let lengths = Lengths::parse("180-220", Some("0.25:800")).expect("parses");
        let prompts = Prompts::Cut {
            tokens: (0..5000).collect(),
            lengths,
        };
        for k in 0..64 {
            let (Prompt::Ids(a), Prompt::Ids(b)) = (prompts.get(k), prompts.get(k)) else {
                panic!("cut prompts are token ids");
            };
            assert_eq!(a, b, "prompt {k} is the same each time");
            let want = if lengths.is_long(k) {
                720..=880
            } else {
                180..=220
            };
            assert!(want.contains(&a.len()), "prompt {k}: {} tokens", a.len());
            // a window of consecutive tokens of the text
            assert!(a.windows(2).all(|w| w[1] == w[0] + 1));
        }
    }

    #[test]
    fn bad_lengths_are_refused() {
        assert!(Lengths::parse("220-180", None).is_err());
        assert!(Lengths::parse("0-10", None).is_err());
        assert!(Lengths::parse("100", Some("1.5:800")).is_err());
        assert!(Lengths::parse("100", Some("800")).is_err());
    }
}

//! Where the guests' token cycle went during the load: the service's `wasi_nn_cycle_*`
//! counters read before and after, as the mean time of each part and the parts' shares; and
//! how running ahead went (`wasi_nn_run_ahead_total`, by outcome).

use std::collections::BTreeMap;

const SECONDS: &str = "wasi_nn_cycle_seconds_total";
const COUNT: &str = "wasi_nn_cycle_count_total";
const RUN_AHEAD: &str = "wasi_nn_run_ahead_total";

/// Each part's (count, seconds) from a `/metrics` text, and each run-ahead outcome's count.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Totals(BTreeMap<String, (f64, f64)>, BTreeMap<String, f64>);

impl Totals {
    /// The cycle counters of a Prometheus text (none when the service has none).
    pub fn parse(text: &str) -> Self {
        let mut totals = BTreeMap::<String, (f64, f64)>::new();
        let mut outcomes = BTreeMap::<String, f64>::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((key, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            if let Some(rest) = key
                .strip_prefix(RUN_AHEAD)
                .and_then(|r| r.strip_prefix("{outcome=\""))
            {
                outcomes.insert(rest.trim_end_matches("\"}").to_owned(), value);
                continue;
            }
            let (name, part) = match key.split_once("{part=\"") {
                Some((name, rest)) => (name, rest.trim_end_matches("\"}")),
                None => continue,
            };
            let entry = totals.entry(part.to_owned()).or_default();
            match name {
                COUNT => entry.0 = value,
                SECONDS => entry.1 = value,
                _ => {}
            }
        }
        Self(totals, outcomes)
    }

    /// Read from the service at `url` (empty when it can't be read).
    pub fn fetch(agent: &ureq::Agent, url: &str) -> Self {
        let text = agent
            .get(&format!("{url}/metrics"))
            .call()
            .ok()
            .and_then(|mut r| r.body_mut().read_to_string().ok());
        text.map_or_else(Self::default, |t| Self::parse(&t))
    }

    /// How many steps run ahead each outcome counted from `before` to `self` (`hit`, `miss`,
    /// `late`); `None` when the service counts none.
    pub fn run_ahead_since(&self, before: &Self) -> Option<serde_json::Value> {
        let moved = (self.1.iter())
            .map(|(outcome, &n)| {
                (
                    outcome.clone(),
                    (n - before.1.get(outcome).copied().unwrap_or(0.0)).into(),
                )
            })
            .collect::<serde_json::Map<_, _>>();
        (!moved.is_empty()).then(|| moved.into())
    }

    /// Each part's mean in microseconds and share of the parts' time, from `before` to `self`;
    /// `None` when nothing was recorded.
    pub fn since(&self, before: &Self) -> Option<serde_json::Value> {
        let moved: Vec<(&String, f64, f64)> = (self.0.iter())
            .map(|(part, &(count, seconds))| {
                let (c0, s0) = before.0.get(part).copied().unwrap_or_default();
                (part, count - c0, seconds - s0)
            })
            .collect();
        let all: f64 = moved.iter().map(|m| m.2).sum();
        if all <= 0.0 {
            return None;
        }
        let parts = moved
            .into_iter()
            .map(|(part, count, seconds)| {
                let mean_us = if count > 0.0 {
                    seconds / count * 1e6
                } else {
                    0.0
                };
                let value = serde_json::json!({
                    "count": count, "mean_us": (mean_us * 10.0).round() / 10.0,
                    "share": (seconds / all * 1000.0).round() / 1000.0,
                });
                (part.clone(), value)
            })
            .collect::<serde_json::Map<_, _>>();
        Some(parts.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn means_and_shares_of_what_moved() {
        let before = Totals::parse(
            "# TYPE wasi_nn_cycle_seconds_total counter\n\
             wasi_nn_cycle_seconds_total{part=\"step\"} 1\n\
             wasi_nn_cycle_seconds_total{part=\"guest\"} 0.5\n\
             wasi_nn_cycle_count_total{part=\"step\"} 100\n\
             wasi_nn_cycle_count_total{part=\"guest\"} 100\n\
             wasi_nn_generation_tokens_total 7\n",
        );
        let after = Totals::parse(
            "wasi_nn_cycle_seconds_total{part=\"step\"} 4\n\
             wasi_nn_cycle_seconds_total{part=\"guest\"} 1.5\n\
             wasi_nn_cycle_count_total{part=\"step\"} 1100\n\
             wasi_nn_cycle_count_total{part=\"guest\"} 1100\n",
        );
        let report = after.since(&before).expect("moved");
        assert_eq!(report["step"]["count"], 1000.0);
        assert_eq!(report["step"]["mean_us"], 3000.0);
        assert_eq!(report["step"]["share"], 0.75);
        assert_eq!(report["guest"]["mean_us"], 1000.0);
        assert_eq!(report["guest"]["share"], 0.25);
        assert_eq!(after.since(&after), None);
        assert_eq!(Totals::parse("no metrics here"), Totals::default());
        assert_eq!(after.run_ahead_since(&before), None);
    }

    #[test]
    fn run_ahead_outcomes_that_moved() {
        let before = Totals::parse(
            "wasi_nn_run_ahead_total{outcome=\"hit\"} 10\n\
             wasi_nn_run_ahead_total{outcome=\"miss\"} 2\n",
        );
        let after = Totals::parse(
            "# TYPE wasi_nn_run_ahead_total counter\n\
             wasi_nn_run_ahead_total{outcome=\"hit\"} 110\n\
             wasi_nn_run_ahead_total{outcome=\"miss\"} 7\n\
             wasi_nn_run_ahead_total{outcome=\"late\"} 3\n",
        );
        let moved = after.run_ahead_since(&before).expect("counted");
        assert_eq!(
            (moved["hit"].as_f64(), moved["miss"].as_f64()),
            (Some(100.0), Some(5.0))
        );
        assert_eq!(moved["late"].as_f64(), Some(3.0));
    }
}

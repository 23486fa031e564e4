//! Requests that failed under `--keep-going`: when each was sent, how long it took to fail
//! and why, so a run through a load balancer that loses a replica shows that the streams it
//! held ended with an error (not a hang) and that the requests after them succeeded.

/// One failed request of the concurrent phase.
pub struct Failure {
    /// When it was sent, in seconds since the concurrent phase began.
    pub sent_s: f64,
    /// From sending it to its error, in seconds.
    pub failed_after_s: f64,
    pub error: String,
}

/// The failures of a run, and the report's fields about them.
#[derive(Default)]
pub struct Failures(pub Vec<Failure>);

/// Errors listed in the report (the count covers all).
const LISTED: usize = 20;

impl Failures {
    /// `failed`, `errors` (the first ones, oldest first), the longest time a request took to
    /// fail, and how many requests sent after the last failure succeeded (`sent_s` of each
    /// success in `succeeded_sent_s`).
    pub fn report(mut self, succeeded_sent_s: &[f64]) -> serde_json::Value {
        self.0.sort_by(|a, b| a.sent_s.total_cmp(&b.sent_s));
        let last = self.0.iter().map(|f| f.sent_s).fold(f64::NAN, f64::max);
        let after_last = succeeded_sent_s.iter().filter(|&&s| s > last).count();
        let slowest = self.0.iter().map(|f| f.failed_after_s).fold(0.0, f64::max);
        let errors: Vec<serde_json::Value> = self
            .0
            .iter()
            .take(LISTED)
            .map(|f| {
                serde_json::json!({ "sent_s": f.sent_s, "failed_after_s": f.failed_after_s,
                                    "error": f.error })
            })
            .collect();
        serde_json::json!({
            "failed": self.0.len(),
            "errors": errors,
            "slowest_failure_s": slowest,
            "last_failure_sent_s": (!self.0.is_empty()).then_some(last),
            "succeeded_after_last_failure": (!self.0.is_empty()).then_some(after_last),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Failure, Failures};

    fn failure(sent_s: f64, failed_after_s: f64) -> Failure {
        Failure {
            sent_s,
            failed_after_s,
            error: format!("sent at {sent_s}"),
        }
    }

    #[test]
    fn the_report_counts_failures_and_the_successes_after_the_last() {
        let failed = Failures(vec![
            failure(3.0, 0.2),
            failure(1.0, 0.5),
            failure(3.5, 0.1),
        ]);
        let report = failed.report(&[0.5, 2.0, 3.6, 4.0, 5.0]);
        assert_eq!(report["failed"], 3);
        assert_eq!(report["slowest_failure_s"], 0.5);
        assert_eq!(report["last_failure_sent_s"], 3.5);
        assert_eq!(report["succeeded_after_last_failure"], 3);
        // oldest first
        assert_eq!(report["errors"][0]["error"], "sent at 1");
        let none = Failures::default().report(&[1.0]);
        assert_eq!(none["failed"], 0);
        assert!(none["last_failure_sent_s"].is_null());
        assert!(none["succeeded_after_last_failure"].is_null());
    }
}

//! Where each item of a step runs, decided before anything is launched: on its session's own
//! stream (a long prompt, a prompt asking for every position's logits, a lone decode through
//! its captured decode graph), or as rows of the batched pass, waited for or run late in the
//! pass run ahead. A pure function of the items' shapes, tested below.

/// What the routing needs to know of one item.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ItemShape {
    /// Tokens this step runs for it.
    pub(crate) tokens: usize,
    /// It asks for every position's logits.
    pub(crate) all_positions: bool,
    /// It still runs: no result run ahead was taken for it and it has no error.
    pub(crate) runs: bool,
}

/// The step's circumstances.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RouteLimits {
    /// The longest prompt (or chunk) that runs as rows of the batched pass.
    pub(crate) batched_prompt: usize,
    /// Most rows of one pass.
    pub(crate) max_rows: usize,
    /// Batch-invariant steps: a lone decode runs in a batched pass too.
    pub(crate) invariant: bool,
    /// Steps run ahead for greedy contexts.
    pub(crate) run_ahead: bool,
    /// Items that took a result run ahead for them (a pass run ahead follows).
    pub(crate) hits: usize,
    /// Next steps kept for contexts whose late rows were resolved (rows of that pass).
    pub(crate) kept_next: usize,
}

/// Where a step's items run.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct StepRoute {
    /// On their sessions' own streams through the prefill path, in order.
    pub(crate) own_prompts: Vec<usize>,
    /// The step's only batched item, a single token: through its session's captured decode
    /// step (faster than a pass of one row), unless batch-invariant or late.
    pub(crate) lone_decode: Option<usize>,
    /// As rows of the batched pass, in order.
    pub(crate) batched: Vec<usize>,
    /// The batched rows join the pass run ahead for the hits and the step does not wait for
    /// them (they run late).
    pub(crate) late: bool,
}

impl StepRoute {
    /// Every item that ran on its session's own stream (prompts, then the lone decode).
    pub(crate) fn own(&self) -> Vec<usize> {
        let mut own = self.own_prompts.clone();
        own.extend(self.lone_decode);
        own
    }
}

/// Where each item runs. A short prompt always goes through the batched pass, alone or not, so
/// its logits do not depend on its company.
pub(crate) fn route(items: &[ItemShape], limits: RouteLimits) -> StepRoute {
    let mut r = StepRoute::default();
    for (i, item) in items.iter().enumerate() {
        if !item.runs {
            continue;
        }
        match item.tokens <= limits.batched_prompt && !item.all_positions {
            true => r.batched.push(i),
            false => r.own_prompts.push(i),
        }
    }
    let late_tokens: usize = r.batched.iter().map(|&i| items[i].tokens).sum();
    let others = items.len() - r.batched.len();
    r.late = limits.run_ahead
        && limits.hits > 0
        && !r.batched.is_empty()
        && others + limits.kept_next + late_tokens <= limits.max_rows;
    if let (&[i], false, false) = (&r.batched[..], r.late, limits.invariant) {
        if items[i].tokens == 1 {
            r.lone_decode = Some(i);
            r.batched.clear();
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(tokens: usize) -> ItemShape {
        ItemShape {
            tokens,
            all_positions: false,
            runs: true,
        }
    }

    fn limits(hits: usize) -> RouteLimits {
        RouteLimits {
            batched_prompt: 64,
            max_rows: 320,
            invariant: false,
            run_ahead: true,
            hits,
            kept_next: 0,
        }
    }

    #[test]
    fn short_prompts_and_decodes_share_the_pass_long_prompts_run_on_their_own() {
        let mut scores = item(10);
        scores.all_positions = true;
        let items = [item(1), item(65), item(64), scores, item(1)];
        let r = route(&items, limits(0));
        assert_eq!(r.batched, vec![0, 2, 4]);
        assert_eq!(r.own_prompts, vec![1, 3]);
        assert_eq!((r.lone_decode, r.late), (None, false));
    }

    #[test]
    fn a_lone_decode_keeps_its_own_graph_unless_batch_invariant() {
        let r = route(&[item(1)], limits(0));
        assert_eq!((r.lone_decode, r.batched.len()), (Some(0), 0));
        assert_eq!(r.own(), vec![0]);
        // beside a long prompt too: the only batched item
        let r = route(&[item(200), item(1)], limits(0));
        assert_eq!((r.own_prompts, r.lone_decode), (vec![0], Some(1)));
        // a short prompt alone still goes through the pass
        assert_eq!(route(&[item(5)], limits(0)).batched, vec![0]);
        let invariant = RouteLimits {
            invariant: true,
            ..limits(0)
        };
        assert_eq!(route(&[item(1)], invariant).batched, vec![0]);
    }

    #[test]
    fn with_hits_the_batched_rows_run_late_when_they_fit_one_pass() {
        // items 0 and 1 hit (they do not run); 2 and 3 join the pass run ahead
        let mut hit = item(1);
        hit.runs = false;
        let items = [hit, hit, item(1), item(30)];
        let r = route(&items, limits(2));
        assert_eq!((r.batched, r.late, r.lone_decode), (vec![2, 3], true, None));
        // a lone decode that runs late is not taken out of the pass
        let r = route(&[hit, item(1)], limits(1));
        assert_eq!((r.batched, r.late, r.lone_decode), (vec![1], true, None));
        // no hits, or no running ahead: waited for
        assert!(!route(&items, limits(0)).late);
        let off = RouteLimits {
            run_ahead: false,
            ..limits(2)
        };
        assert!(!route(&items, off).late);
        // more than one pass holds: waited for
        let crowded = RouteLimits {
            kept_next: 320 - 32,
            ..limits(2)
        };
        assert!(!route(&items, crowded).late);
    }

    #[test]
    fn items_that_took_a_result_or_failed_are_not_routed() {
        let mut done = item(1);
        done.runs = false;
        let r = route(&[done, done], limits(0));
        assert_eq!(r, StepRoute::default());
    }
}

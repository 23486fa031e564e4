//! Where each input's rows go in a pass's table: every input's last row first, in input order
//! (the rows whose logits are read: the LM head runs over the first rows alone), then the rows
//! before the last of whole prompts, then those of chunks of prompts too long for one pass
//! (which the split products take as bf16, as a prefill's: [`RowOrder::lo_rows`]). An input's
//! rows before its last are consecutive, for the attention's tiles.

use std::ops::Range;

/// One input's rows in a pass: the rows of the tokens before its last (consecutive), then its
/// last token's row (among the first rows of the table, whose logits are wanted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct InputRows {
    pub(super) others: Range<usize>,
    pub(super) last: usize,
}

impl InputRows {
    /// The rows in position order.
    pub(super) fn in_order(&self) -> impl Iterator<Item = usize> {
        self.others.clone().chain([self.last])
    }

    /// The row of the input's `i`-th token.
    pub(super) fn row(&self, i: usize) -> usize {
        match self.others.start + i {
            r if r < self.others.end => r,
            _ => self.last,
        }
    }
}

/// The rows of a pass's inputs.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct RowOrder {
    /// Per input, its rows.
    pub(super) inputs: Vec<InputRows>,
    /// The rows before the chunks' rows: the inputs' last rows and the whole prompts' others.
    pub(super) lo_rows: usize,
}

/// The rows of inputs of `(tokens, a chunk of a longer prompt)`, each of at least one token.
pub(super) fn order_rows(inputs: &[(usize, bool)]) -> RowOrder {
    let whole_others: usize = (inputs.iter())
        .filter(|&&(_, chunk)| !chunk)
        .map(|&(tokens, _)| tokens.saturating_sub(1))
        .sum();
    let mut next_whole = inputs.len();
    let mut next_chunk = inputs.len() + whole_others;
    let rows = (inputs.iter().enumerate())
        .map(|(last, &(tokens, chunk))| {
            let next = match chunk {
                true => &mut next_chunk,
                false => &mut next_whole,
            };
            let others = *next..*next + tokens.saturating_sub(1);
            *next = others.end;
            InputRows { others, last }
        })
        .collect();
    RowOrder {
        inputs: rows,
        lo_rows: inputs.len() + whole_others,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_rows_then_whole_prompts_then_chunks() {
        // a decode, a chunk of 4, a whole prompt of 3, a decode, a chunk of 2
        let order = order_rows(&[(1, false), (4, true), (3, false), (1, false), (2, true)]);
        let rows = |others: Range<usize>, last| InputRows { others, last };
        assert_eq!(
            order.inputs,
            vec![
                rows(5..5, 0),
                rows(7..10, 1),
                rows(5..7, 2),
                rows(7..7, 3),
                rows(10..11, 4),
            ]
        );
        // the whole prompt's rows keep their lo rows, the chunks' do not
        assert_eq!(order.lo_rows, 7);
        // every row of the pass once
        let mut all: Vec<usize> = order.inputs.iter().flat_map(InputRows::in_order).collect();
        all.sort_unstable();
        assert_eq!(all, (0..11).collect::<Vec<_>>());
        // token i of the chunk of 4: rows 7, 8, 9, then its last row 1
        let tokens: Vec<usize> = (0..4).map(|i| order.inputs[1].row(i)).collect();
        assert_eq!(tokens, vec![7, 8, 9, 1]);
    }

    #[test]
    fn decodes_alone_are_all_lo_rows() {
        let order = order_rows(&[(1, false), (1, true), (1, false)]);
        assert_eq!(order.lo_rows, 3);
        assert!(order.inputs.iter().all(|i| i.others.is_empty()));
    }
}

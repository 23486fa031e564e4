//! Which block of the batched attention takes which rows: a prompt's rows (an input of
//! several tokens) go in tiles of up to [`BT_Q`] consecutive positions, each tile one block a
//! head that reads the context's keys and values once for all of its rows; every other row
//! (a decode, a padding row) keeps a block of its own. Tiles come first in the grid: their
//! blocks run longest.

use super::order::InputRows;
use crate::cuda::ops::batch::BT_Q;

/// The attention's blocks of one pass, as the table holds them (`AttentionTiles`).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct TilePlan {
    /// Per block index (the pass's padded rows): a row, the tile `-2 - t`, or none (-1).
    pub(super) work: Vec<i32>,
    /// Per tile: its first entry of `tile_rows`, its rows.
    pub(super) tiles: Vec<i32>,
    /// The tiles' rows, each tile's in position order.
    pub(super) tile_rows: Vec<i32>,
    /// Per row of the pass: 1 in a tile, else 0.
    pub(super) tiled: Vec<i32>,
}

/// The plan for a pass of `padded` rows holding `inputs`; the rows past theirs are padding.
pub(super) fn plan(inputs: &[InputRows], padded: usize) -> TilePlan {
    let mut p = TilePlan {
        work: Vec::with_capacity(padded),
        tiled: vec![0; padded],
        ..TilePlan::default()
    };
    let prompts = inputs.iter().filter(|i| !i.others.is_empty());
    for input in prompts {
        for (i, r) in input.in_order().enumerate() {
            if i % BT_Q as usize == 0 {
                p.work.push(-2 - (p.tiles.len() / 2) as i32);
                p.tiles.extend([p.tile_rows.len() as i32, 0]);
            }
            if let Some(count) = p.tiles.last_mut() {
                *count += 1;
            }
            p.tile_rows.push(r as i32);
            p.tiled[r] = 1;
        }
    }
    let decodes = inputs.iter().filter(|i| i.others.is_empty());
    p.work.extend(decodes.map(|i| i.last as i32));
    // padding rows write the zeros the next product reads
    let n: usize = inputs.iter().map(|i| i.others.len() + 1).sum();
    p.work.extend((n..padded).map(|r| r as i32));
    p.work.resize(padded, -1);
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

    #[test]
    fn prompt_rows_go_in_tiles_first_and_every_other_row_keeps_a_block() {
        // input 0: a decode at row 0; input 1: 40 prompt rows (its last at row 1, the rest
        // at 3..42); input 2: a decode at row 2; rows 42..48 pad the pass
        let decode = |r| InputRows {
            others: r..r,
            last: r,
        };
        let input = InputRows {
            others: 3..42,
            last: 1,
        };
        let prompt: Vec<usize> = input.in_order().collect();
        let p = plan(&[decode(0), input, decode(2)], 48);
        let q = BT_Q as usize;
        let tiles = 40usize.div_ceil(q);
        let expected: Vec<i32> = (0..tiles)
            .flat_map(|t| [(t * q) as i32, (40 - t * q).min(q) as i32])
            .collect();
        assert_eq!(p.tiles, expected);
        assert_eq!(
            p.tile_rows,
            prompt.iter().map(|&r| r as i32).collect::<Vec<_>>()
        );
        let mut work: Vec<i32> = (0..tiles as i32).map(|t| -2 - t).collect();
        work.extend([0, 2]);
        work.extend(42..48);
        work.resize(48, -1);
        assert_eq!(p.work, work);
        for r in 0..48 {
            assert_eq!(p.tiled[r] == 1, prompt.contains(&r), "row {r}");
        }
    }

    #[test]
    fn every_row_is_taken_once_and_the_tables_fit_the_pass() {
        let input = |others: Range<usize>, last| InputRows { others, last };
        for inputs in [
            vec![input(1..2, 0)],
            vec![input(0..0, 0), input(1..1, 1), input(2..2, 2)],
            (0..16).map(|i| input(16 + i..17 + i, i)).collect(),
            vec![input(1..65, 0)],
        ] {
            let n: usize = inputs.iter().map(|i| i.others.len() + 1).sum();
            let padded = crate::cuda::batch::bucket(n);
            let p = plan(&inputs, padded);
            assert_eq!(p.work.len(), padded);
            assert!(p.tiles.len() <= padded && p.tile_rows.len() <= padded);
            let mut taken = vec![0; padded];
            for &w in &p.work {
                match w {
                    -1 => {}
                    w if w >= 0 => taken[w as usize] += 1,
                    w => {
                        let t = (-2 - w) as usize;
                        let (first, count) = (p.tiles[2 * t] as usize, p.tiles[2 * t + 1] as usize);
                        assert!((1..=BT_Q as usize).contains(&count));
                        for &r in &p.tile_rows[first..first + count] {
                            taken[r as usize] += 1;
                        }
                    }
                }
            }
            assert!(taken.iter().all(|&t| t == 1), "{inputs:?}: {taken:?}");
        }
    }
}

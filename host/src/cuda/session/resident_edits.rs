//! A context's processing edits kept on the GPU for the batched pass's draws. The host keeps
//! a copy of what the GPU holds (each edit and its slot); each pass a row's edits are compared
//! with it and only what changed goes up, as a list of (slot, edit) that the row's draw writes
//! before it reads the edits. A step appends one token to the sequence, which changes one edit
//! (or adds one), so a pass carries about one change a row instead of every edit: with a
//! repetition penalty or a long bias list a row has hundreds.
//!
//! The slots are in the order the edits arrived, not by id: the kernel applies each edit on
//! its own and finds a followed token's edit by scanning them, so their order does not
//! matter. Edits are never taken out one by one: a row whose edits lack one the GPU holds
//! (another request on the context, another bias list) writes all of its edits again. A
//! context has one input in a pass at most (its rows are its next positions, which depend on
//! the pass before), so no two rows of a pass write one context's edits.

use crate::cuda::buffer::DevBuf;
use crate::cuda::error::CudaError;
use crate::cuda::ops::draw::{edit_word, EDIT_WORDS};
use crate::engine::processing::Edit;
use cudarc::driver::CudaStream;
use std::sync::{Arc, Mutex};

/// One context's edits on the GPU, and the host's copy of them.
pub(crate) struct ResidentEdits {
    region: DevBuf<u32>,
    held: Mutex<Held>,
}

/// What the GPU holds, as the passes launched so far leave it: each edit with its slot, by id.
#[derive(Default)]
struct Held {
    by_id: Vec<(Edit, u32)>,
}

/// One slot's new edit, as the draw writes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Change {
    pub slot: u32,
    pub edit: Edit,
}

impl ResidentEdits {
    /// Room for `most` edits on the GPU (see [`super::max_edits`]).
    pub(crate) fn new(stream: &Arc<CudaStream>, most: usize) -> Result<Self, CudaError> {
        Ok(Self {
            region: DevBuf::zeros(stream, EDIT_WORDS * most, "resident edits")?,
            held: Mutex::default(),
        })
    }

    /// The device address of the edits, and the most they hold.
    pub(crate) fn region(&self) -> (u64, usize) {
        (self.region.ptr().addr(), self.region.len() / EDIT_WORDS)
    }

    /// The changes that make the GPU hold `edits` (distinct ids in increasing order, at most
    /// [`Self::region`]'s), appended to `out`, and the count of edits the GPU then holds; the
    /// host's copy is updated as if the draw that writes them has run (it runs before any
    /// later pass of this context: passes are ordered on their lane's stream). None when
    /// there are more than the region holds. A pass that is not launched after all must
    /// [`Self::forget`].
    pub(crate) fn update(&self, edits: &[Edit], out: &mut Vec<Change>) -> Option<u32> {
        if edits.len() > self.region().1 {
            return None;
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        Some(held.update(edits, out))
    }

    /// Forget what the GPU holds (a pass whose changes may not have been written): the next
    /// row writes all of its edits.
    pub(crate) fn forget(&self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.by_id.clear();
    }
}

impl Held {
    fn update(&mut self, edits: &[Edit], out: &mut Vec<Change>) -> u32 {
        let first = out.len();
        let mut added = Vec::new();
        let mut i = 0;
        let mut stale = false;
        for e in edits {
            while i < self.by_id.len() && self.by_id[i].0.id < e.id {
                // the GPU holds an edit these do not have
                stale = true;
                i += 1;
            }
            match self.by_id.get_mut(i) {
                Some((held, slot)) if held.id == e.id => {
                    if held != e {
                        *held = *e;
                        out.push(Change {
                            slot: *slot,
                            edit: *e,
                        });
                    }
                    i += 1;
                }
                _ => added.push(*e),
            }
        }
        if stale || i < self.by_id.len() {
            // every edit again, in their (id) order: slot k holds the k-th
            out.truncate(first);
            self.by_id = (edits.iter().zip(0..))
                .map(|(e, slot)| (*e, slot))
                .collect();
            out.extend(self.by_id.iter().map(|&(edit, slot)| Change { slot, edit }));
            return self.by_id.len() as u32;
        }
        for e in added {
            let slot = self.by_id.len() as u32;
            let at = self.by_id.partition_point(|(h, _)| h.id < e.id);
            self.by_id.insert(at, (e, slot));
            out.push(Change { slot, edit: e });
        }
        self.by_id.len() as u32
    }
}

impl Change {
    /// The change as the draw reads it: two groups of [`EDIT_WORDS`] words, the slot, then the
    /// edit ([`edit_word`]).
    pub(crate) fn words(&self) -> [u32; 2 * EDIT_WORDS] {
        let [a, b, c, d] = edit_word(&self.edit);
        [self.slot, 0, 0, 0, a, b, c, d]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edit(id: u32, generated: u32) -> Edit {
        Edit {
            id,
            bias: None,
            repeated: true,
            penalty: (generated > 0).then_some(generated as f32 * 0.5),
            generated,
        }
    }

    /// Replays changes onto a model of the GPU's region: the edits it holds, by slot.
    fn apply(region: &mut Vec<Option<Edit>>, changes: &[Change]) {
        for c in changes {
            let slot = c.slot as usize;
            if region.len() <= slot {
                region.resize(slot + 1, None);
            }
            region[slot] = Some(c.edit);
        }
    }

    /// The edits the first `count` slots hold, by id.
    fn held(region: &[Option<Edit>], count: u32) -> Vec<Edit> {
        let mut v: Vec<Edit> = region[..count as usize]
            .iter()
            .map(|e| e.expect("written"))
            .collect();
        v.sort_by_key(|e| e.id);
        v
    }

    #[test]
    fn the_gpu_holds_each_rows_edits_after_its_changes() {
        let mut h = Held::default();
        let mut region = Vec::new();
        let mut rng = 7u64;
        let mut next = |n: u64| {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) % n
        };
        let mut edits: Vec<Edit> = vec![edit(3, 0), edit(9, 1)];
        let mut small = 0;
        for step in 0..400 {
            match next(10) {
                // another request: other edits altogether
                0 if step % 7 == 0 => {
                    edits = (0..next(6)).map(|i| edit(2 * i as u32 + 1, 0)).collect();
                }
                // the token's edit changes, or a new one comes
                _ => {
                    let id = next(40) as u32;
                    match edits.binary_search_by_key(&id, |e| e.id) {
                        Ok(at) => edits[at].generated += 1,
                        Err(at) => edits.insert(at, edit(id, 1)),
                    }
                    let at = edits.binary_search_by_key(&id, |e| e.id).expect("there");
                    edits[at].penalty = Some(edits[at].generated as f32 * 0.5);
                }
            }
            let mut out = Vec::new();
            let count = h.update(&edits, &mut out);
            apply(&mut region, &out);
            assert_eq!(held(&region, count), edits, "step {step}");
            small += usize::from(out.len() <= 1);
        }
        // most steps change one edit or none
        assert!(small > 300, "{small} of 400 steps with at most one change");
    }

    #[test]
    fn a_row_without_an_edit_the_gpu_holds_writes_all_again() {
        let mut h = Held::default();
        let mut out = Vec::new();
        assert_eq!(h.update(&[edit(1, 0), edit(5, 0)], &mut out), 2);
        out.clear();
        assert_eq!(h.update(&[edit(5, 0)], &mut out), 1);
        assert_eq!(
            out,
            [Change {
                slot: 0,
                edit: edit(5, 0)
            }]
        );
        out.clear();
        assert_eq!(h.update(&[edit(5, 0)], &mut out), 1);
        assert!(out.is_empty(), "nothing changed: {out:?}");
    }
}

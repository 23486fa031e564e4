//! Running ahead: the steps a batched step launches for its greedy contexts before their
//! guests come back (`docs/design/batching.md` tells the whole story, with a state diagram).
//!
//! A layer over the batched pass: [`state`] is what it keeps between steps, [`plan`] decides
//! (pure functions over that state: which contexts get which step, which items take which
//! result), [`launch`] and [`early`] put the plan on the GPU, [`clock`] times the passes so
//! that the next step knows how long to wait for its contexts. [`state::RunAhead`] holds the state
//! under one lock; [`state::Ahead::resolve`] turns a finished pass into results.

pub(crate) mod clock;
pub(crate) mod early;
pub(crate) mod launch;
pub(crate) mod plan;
pub(crate) mod state;

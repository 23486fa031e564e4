//! `kernels/draw.cu`: the sampled draw of [`crate::engine::draw`] over rows of logits on the
//! GPU, one block a row.

use super::batch::RowTable;
use super::{kernel_args, Launcher};
use crate::cuda::buffer::DevPtr;
use crate::cuda::error::{ensure, CudaError};
use crate::engine::draw::DrawRule;
use cudarc::driver::LaunchConfig;

/// Threads of a row's block.
pub const DRAW_THREADS: u32 = 1024;
/// `MAX_DRAWS` of the rule, as the kernel takes it.
pub const MAX_DRAWS: u32 = crate::engine::draw::MAX_DRAWS;

/// A row's rule as the kernel reads it: `1 / T` and top-p as f64 bits, the seed, the
/// position drawn for.
pub fn rule_words(rule: &DrawRule, position: usize) -> [u64; 4] {
    [
        rule.inverse_temperature().to_bits(),
        f64::from(rule.top_p).to_bits(),
        rule.seed,
        position as u64,
    ]
}

/// Rows of logits and where their draws go.
#[derive(Clone, Copy, Debug)]
pub struct Draw {
    /// Row `r` at `r * stride`, `vocab` floats each.
    pub logits: DevPtr<f32>,
    pub stride: usize,
    pub rows: usize,
    pub vocab: usize,
    /// `4 * rows` words ([`rule_words`]).
    pub rules: DevPtr<u64>,
    /// `rows` tokens (-1: the draws fell outside the nucleus; the host finishes the row).
    pub out: DevPtr<i32>,
}

impl Launcher {
    pub fn draw_token(&self, a: Draw) -> Result<(), CudaError> {
        ensure(
            a.rows > 0
                && a.vocab > 0
                && a.stride >= a.vocab
                && a.logits.len() >= (a.rows - 1) * a.stride + a.vocab
                && a.rules.len() >= 4 * a.rows
                && a.out.len() >= a.rows,
            "draw",
        )?;
        let cfg = LaunchConfig {
            grid_dim: (a.rows as u32, 1, 1),
            block_dim: (DRAW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (logits, stride, v) = (a.logits.addr(), a.stride as i64, a.vocab as i32);
        let (rules, out) = (a.rules.addr(), a.out.addr());
        // SAFETY: logits holds rows rows of `stride` floats (the last `vocab` long), rules
        // 4 words a row, out one int a row (checked above).
        let mut args = kernel_args![&logits, &stride, &v, &rules, &out];
        unsafe { self.launch(&self.kernels.draw_token, cfg, 1, &mut args, "draw") }
    }

    /// The batched pass's draws: each of the table's rows with a rule in `rules` (4 words a
    /// row, [`rule_words`] for the position after the row's; zeros: none) and logits kept gets
    /// the drawn token's key in `t.keys` instead of its argmax's (`batch_draw` in
    /// `kernels/draw.cu`). Launched after the pass's LM head.
    pub fn batch_draw(&self, t: &RowTable, rules: DevPtr<u64>) -> Result<(), CudaError> {
        t.check("batched draw")?;
        ensure(rules.len() >= 4 * t.rows, "batched draw")?;
        let cfg = LaunchConfig {
            grid_dim: (t.rows as u32, 1, 1),
            block_dim: (DRAW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let v = self.config.vocab_size as i32;
        let (dst, rules, keys) = (t.logits.addr(), rules.addr(), t.keys.addr());
        // SAFETY: dst holds rows logits addresses (0 or a session's V-float buffer), rules 4
        // words a row, keys one u64 a row (checked by `t.check` and above).
        let mut args = kernel_args![&dst, &rules, &keys, &v];
        unsafe { self.launch(&self.kernels.batch_draw, cfg, 1, &mut args, "batched draw") }
    }
}

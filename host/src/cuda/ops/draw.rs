//! `kernels/draw.cu`: the sampled draw of [`crate::engine::draw`] over rows of logits on the
//! GPU, each row over the blocks [`crate::cuda::Gpu::draw_cluster`] gives (on sm_90+ a
//! thread-block cluster of 8 for a lone row, one block a row of a batched pass; one block
//! elsewhere).

use super::batch::RowTable;
use super::{kernel_args, Launcher};
use crate::cuda::buffer::DevPtr;
use crate::cuda::error::{ensure, CudaError};
use crate::engine::draw::DrawRule;
use crate::engine::processing::{Edit, Edits};
use cudarc::driver::LaunchConfig;

/// Threads of each block that draws a row.
pub const DRAW_THREADS: u32 = 1024;
/// Most blocks that draw one row (a portable cluster's size).
pub const MAX_DRAW_BLOCKS: u32 = 8;
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

/// Words of a row's rule in the batched pass's draw: [`rule_words`], then min-p's floor offset
/// and the repetition penalty, then where the row's edits are, then the penalties, then how
/// the edits follow the row's token and their count, then the changes the row's draw makes to
/// its edits first.
pub const BATCH_RULE_WORDS: usize = 9;

/// A row's edits, kept on the GPU for its context ([`ResidentEdits`]), and how they are applied.
///
/// [`ResidentEdits`]: crate::cuda::session::ResidentEdits
#[derive(Clone, Copy, Debug)]
pub struct RowEdits<'e> {
    /// The device address of the context's edits, and how many of them apply.
    pub region: u64,
    pub count: u32,
    /// The first of the row's changes to them in the pass's changes, and how many: the draw
    /// writes them before it reads the edits.
    pub changes: (u32, u32),
    pub edits: &'e Edits,
    /// They are the edits before the row's token, which is fed on the GPU: the token's own
    /// edit follows there ([`Edits::after`]).
    pub follow: bool,
}

/// A row's rule as the batched pass's draw reads it: [`rule_words`], then
/// [`DrawRule::min_p_offset`] (low half) and the repetition penalty (high half) as f32 bits,
/// then the device address of the row's edits (0: none), then the presence and frequency
/// penalties as f32 bits, then flags (bit 0: the edits follow the row's token, bit 1: the
/// penalties are set) with the count of the edits in the high half (0 and no follow: drawn
/// from the logits as they are), then the first of the row's changes in the pass's changes
/// (low half) and their count (high half).
pub fn batch_rule_words(
    rule: &DrawRule,
    position: usize,
    edits: Option<RowEdits<'_>>,
) -> [u64; BATCH_RULE_WORDS] {
    let [a, b, c, d] = rule_words(rule, position);
    let (region, count, changes, repetition, penalties, follow) = match edits {
        Some(e) => (
            e.region,
            e.count,
            e.changes,
            e.edits.repetition,
            e.edits.penalties,
            e.follow,
        ),
        None => (0, 0, (0, 0), 1.0, None, false),
    };
    let floor = u64::from(rule.min_p_offset().to_bits()) | u64::from(repetition.to_bits()) << 32;
    let (presence, frequency) = penalties.unwrap_or((0.0, 0.0));
    let flags = u64::from(follow) | u64::from(penalties.is_some()) << 1;
    [
        a,
        b,
        c,
        d,
        floor,
        region,
        u64::from(presence.to_bits()) | u64::from(frequency.to_bits()) << 32,
        flags | u64::from(count) << 32,
        u64::from(changes.0) | u64::from(changes.1) << 32,
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

/// One row's draw after its request's processing (`draw_processed` in `kernels/draw.cu`).
#[derive(Clone, Copy, Debug)]
pub struct EditedDraw {
    /// `vocab` floats, left as they are.
    pub logits: DevPtr<f32>,
    /// `vocab` floats: the processed copy drawn from.
    pub scratch: DevPtr<f32>,
    pub vocab: usize,
    /// 4 words ([`rule_words`]).
    pub rule: DevPtr<u64>,
    /// [`EDIT_WORDS`] words an edit ([`edit_words`]), `count` of them.
    pub edits: DevPtr<u32>,
    pub count: usize,
    pub repetition: f32,
    /// [`DrawRule::min_p_offset`].
    pub floor_offset: f32,
    /// One token (-1: the draws fell outside the nucleus).
    pub out: DevPtr<i32>,
}

/// Words of one edit as the kernel reads it.
pub const EDIT_WORDS: usize = 4;

/// The most times generated an edit's word holds above its steps' byte (a sequence is far
/// shorter).
const MAX_GENERATED: u32 = (1 << 24) - 1;

/// One of processing's edits as the kernel reads it, [`EDIT_WORDS`] words: the token id, its
/// steps (bit 0 the bias, bit 1 the repetition penalty, bit 2 the penalty) with the times it
/// was generated above their byte, the bias's and the penalty's bits.
pub fn edit_word(e: &Edit) -> [u32; EDIT_WORDS] {
    let steps = u32::from(e.bias.is_some())
        | u32::from(e.repeated) << 1
        | u32::from(e.penalty.is_some()) << 2
        | e.generated.min(MAX_GENERATED) << 8;
    [
        e.id,
        steps,
        e.bias.unwrap_or(0.0).to_bits(),
        e.penalty.unwrap_or(0.0).to_bits(),
    ]
}

/// Processing's edits as the kernel reads them ([`edit_word`] each).
pub fn edit_words(edits: &Edits) -> Vec<u32> {
    edits.edits.iter().flat_map(edit_word).collect()
}

impl Launcher {
    /// The grid of `rows` rows' draws, `blocks` blocks a row (1 to [`MAX_DRAW_BLOCKS`],
    /// above 1 on sm_90+ only: a cluster a row).
    fn draw_grid(&self, rows: usize, blocks: u32) -> Result<LaunchConfig, CudaError> {
        ensure(
            (1..=MAX_DRAW_BLOCKS).contains(&blocks)
                && (blocks == 1 || self.gpu.cluster_launch())
                && rows
                    .checked_mul(blocks as usize)
                    .is_some_and(|n| n <= i32::MAX as usize),
            "draw's blocks a row",
        )?;
        Ok(LaunchConfig {
            grid_dim: (rows as u32 * blocks, 1, 1),
            block_dim: (DRAW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// The token `a.rule` draws from `a.logits` after the edits (one row), over the GPU's
    /// blocks for a lone row.
    pub fn draw_edited(&self, a: EditedDraw) -> Result<(), CudaError> {
        self.lone_row(|blocks| self.draw_edited_over(a, blocks))
    }

    /// `launch` over the GPU's blocks for a lone row, or over one block where the GPU refuses
    /// that cluster at launch (a partition of too few SMs).
    fn lone_row(&self, launch: impl Fn(u32) -> Result<(), CudaError>) -> Result<(), CudaError> {
        let blocks = self.gpu.draw_cluster().0;
        launch(blocks).or_else(|e| if blocks > 1 { launch(1) } else { Err(e) })
    }

    /// [`Self::draw_edited`] over `blocks` blocks.
    pub fn draw_edited_over(&self, a: EditedDraw, blocks: u32) -> Result<(), CudaError> {
        ensure(
            a.vocab > 0
                && a.vocab <= i32::MAX as usize
                && a.logits.len() >= a.vocab
                && a.scratch.len() >= a.vocab
                && a.rule.len() >= 4
                && a.edits.len() >= EDIT_WORDS * a.count
                && a.count <= i32::MAX as usize
                && !a.out.is_empty(),
            "processed draw",
        )?;
        let cfg = self.draw_grid(1, blocks)?;
        let (logits, scratch, v) = (a.logits.addr(), a.scratch.addr(), a.vocab as i32);
        let (rule, edits, count) = (a.rule.addr(), a.edits.addr(), a.count as i32);
        let (repetition, floor_offset, out) = (a.repetition, a.floor_offset, a.out.addr());
        // SAFETY: logits and scratch hold `vocab` floats, rule 4 words, edits `count` edits of
        // EDIT_WORDS words (the kernel skips an id past the vocabulary), out one int
        // (checked above).
        let mut args = kernel_args![
            &logits,
            &scratch,
            &v,
            &rule,
            &edits,
            &count,
            &repetition,
            &floor_offset,
            &out
        ];
        unsafe {
            self.launch(
                &self.kernels.draw_processed,
                cfg,
                blocks,
                &mut args,
                "processed draw",
            )
        }
    }

    /// The tokens `a.rules` draw from `a.logits`, over the GPU's blocks for a lone row.
    pub fn draw_token(&self, a: Draw) -> Result<(), CudaError> {
        self.lone_row(|blocks| self.draw_token_over(a, blocks))
    }

    /// [`Self::draw_token`] over `blocks` blocks a row.
    pub fn draw_token_over(&self, a: Draw, blocks: u32) -> Result<(), CudaError> {
        ensure(
            a.rows > 0
                && a.vocab > 0
                && a.stride >= a.vocab
                && a.logits.len() >= (a.rows - 1) * a.stride + a.vocab
                && a.rules.len() >= 4 * a.rows
                && a.out.len() >= a.rows,
            "draw",
        )?;
        let cfg = self.draw_grid(a.rows, blocks)?;
        let (logits, stride, v) = (a.logits.addr(), a.stride as i64, a.vocab as i32);
        let (rules, out) = (a.rules.addr(), a.out.addr());
        // SAFETY: logits holds rows rows of `stride` floats (the last `vocab` long), rules
        // 4 words a row, out one int a row (checked above).
        let mut args = kernel_args![&logits, &stride, &v, &rules, &out];
        unsafe { self.launch(&self.kernels.draw_token, cfg, blocks, &mut args, "draw") }
    }

    /// The batched pass's draws: each of the table's rows with a rule in `rules`
    /// ([`BATCH_RULE_WORDS`] words a row, [`batch_rule_words`] for the position after the
    /// row's; zeros: none) and logits kept gets the drawn token's key in `t.keys` instead of
    /// its argmax's (`batch_draw` in `kernels/draw.cu`); a row with edits (in `edits`,
    /// [`EDIT_WORDS`] words each, every row's within it) is drawn from a processed copy in its
    /// row of `scratch` (`scratch_ld` floats apart). Launched after the pass's LM head, over
    /// the GPU's blocks a row for a batched pass.
    pub fn batch_draw(
        &self,
        t: &RowTable,
        rules: DevPtr<u64>,
        (scratch, scratch_ld): (DevPtr<f32>, usize),
        changes: DevPtr<u32>,
    ) -> Result<(), CudaError> {
        t.check("batched draw")?;
        let v = self.config.vocab_size;
        ensure(
            rules.len() >= BATCH_RULE_WORDS * t.rows
                && scratch_ld >= v
                && scratch.len() >= t.rows * scratch_ld,
            "batched draw",
        )?;
        let blocks = self.gpu.draw_cluster().1;
        let cfg = self.draw_grid(t.rows, blocks)?;
        let (dst, rules, keys, tokens) = (
            t.logits.addr(),
            rules.addr(),
            t.keys.addr(),
            t.tokens.addr(),
        );
        let (v, scratch, ld, changes) =
            (v as i32, scratch.addr(), scratch_ld as i64, changes.addr());
        // SAFETY: dst holds rows logits addresses (0 or a session's V-float buffer), rules
        // BATCH_RULE_WORDS words a row whose changes lie within `changes` and whose edits'
        // address is its context's region of at least their count (the pass writes both, and
        // the kernel writes no slot past the count), keys one u64 and tokens one int a row,
        // scratch rows rows of `ld >= V` floats (checked by `t.check` and above; a followed
        // token past V is left alone).
        let mut args = kernel_args![&dst, &rules, &keys, &v, &scratch, &ld, &changes, &tokens];
        unsafe {
            self.launch(
                &self.kernels.batch_draw,
                cfg,
                blocks,
                &mut args,
                "batched draw",
            )
        }
    }
}

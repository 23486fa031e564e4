//! `kernels/embed_norm.cu`: token + position embedding, LayerNorm over rows, bias add.

use super::{addr_or_null, kernel_args, Launcher, Norm};
use crate::cuda::buffer::{Act, DevPtr, Stored};
use crate::cuda::error::{ensure, CudaError};
use cudarc::driver::LaunchConfig;

/// `x[t] = wte[tokens[t]] + wpe[first + t]` for `rows` rows.
#[derive(Clone, Copy, Debug)]
pub struct Embed {
    pub out: DevPtr<f32>,
    pub tokens: DevPtr<i32>,
    pub wte: DevPtr<Stored>,
    pub wpe: DevPtr<Stored>,
    pub rows: usize,
    /// The first position; `None`: read it from `position` (a captured graph serves every
    /// step).
    pub start: Option<usize>,
    pub position: DevPtr<i32>,
    /// The LM head's argmax key, cleared for the step that starts here.
    pub argmax_key: DevPtr<u64>,
    /// One row run ahead: its token is the argmax in `argmax_key` (of the step before), its
    /// position the one after `position`'s; both are written back there (`start` is None).
    pub feed: bool,
}

/// LayerNorm of `rows` rows of `x` into `out` (f32 or bf16); with `pre_bias`, first
/// `x += pre_bias` (written back).
#[derive(Clone, Copy, Debug)]
pub struct LayerNorm {
    pub out: Act,
    pub x: DevPtr<f32>,
    pub norm: Norm,
    pub pre_bias: Option<DevPtr<Stored>>,
    pub rows: usize,
}

impl Launcher {
    pub fn embed(&self, a: Embed) -> Result<(), CudaError> {
        let c = self.config.n_embd;
        let cfg = LaunchConfig {
            grid_dim: (a.rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let fed_ok = !a.feed || a.rows == 1 && a.start.is_none();
        ensure(
            a.out.len() >= a.rows * c && a.tokens.len() >= a.rows && fed_ok,
            "embed",
        )?;
        let (c, start) = (c as i32, a.start.map_or(-1, |s| s as i32));
        let (feed, vocab) = (i32::from(a.feed), self.config.vocab_size as i32);
        let (x, tokens, wte, wpe) = (a.out.addr(), a.tokens.addr(), a.wte.addr(), a.wpe.addr());
        let (pos, key) = (a.position.addr(), a.argmax_key.addr());
        // SAFETY: out holds rows*C floats and tokens rows ids, each checked < vocab before
        // upload (a fed token is an argmax row, clamped below vocab by the kernel); positions
        // start..start+rows are < n_ctx (checked by the session; a fed position is one past the
        // last decode's, below the capacity, checked before the launch); the key is one u64.
        let mut args = kernel_args![&x, &tokens, &wte, &wpe, &c, &start, &pos, &key, &feed, &vocab];
        unsafe { self.launch(&self.kernels.embed, cfg, 1, &mut args, "embed") }
    }

    pub fn layernorm(&self, a: LayerNorm) -> Result<(), CudaError> {
        let c = self.config.n_embd;
        // one warp per row
        let cfg = LaunchConfig {
            grid_dim: (a.rows.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        ensure(a.x.len() >= a.rows * c, "layernorm")?;
        let (c, obf, rows) = (c as i32, i32::from(a.out.is_bf16()), a.rows as i32);
        let (out, x, w, b) = (a.out.addr(), a.x.addr(), a.norm.w.addr(), a.norm.b.addr());
        let pre_bias = addr_or_null(a.pre_bias);
        // SAFETY: out and x hold rows*C values; w, b and pre_bias (if any) hold C weights.
        let mut args = kernel_args![&out, &x, &w, &b, &pre_bias, &c, &obf, &rows];
        unsafe { self.launch(&self.kernels.layernorm, cfg, 1, &mut args, "layernorm") }
    }

    /// `x[r, :] += bias` for `rows` rows.
    pub fn add_bias(
        &self,
        x: DevPtr<f32>,
        bias: DevPtr<Stored>,
        rows: usize,
    ) -> Result<(), CudaError> {
        let c = self.config.n_embd;
        let cfg = LaunchConfig {
            grid_dim: ((rows * c).div_ceil(256).min(4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        ensure(x.len() >= rows * c, "bias")?;
        let (rows, c, x, bias) = (rows as i32, c as i32, x.addr(), bias.addr());
        // SAFETY: x holds rows*C floats, bias C weights.
        let mut args = kernel_args![&x, &bias, &rows, &c];
        unsafe { self.launch(&self.kernels.add_bias, cfg, 1, &mut args, "bias") }
    }
}

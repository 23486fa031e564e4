//! `kernels/matvec.cu`: batch-1 decode products `y = W x (+ b)` with a fused LayerNorm
//! prologue and the epilogues; as the LM head, the argmax of its outputs as well.

use super::{addr_or_null, kernel_args, Epilogue, KvLayer, Launcher, Norm};
use crate::cuda::buffer::{DevPtr, Stored};
use crate::cuda::error::{ensure, CudaError};
use cudarc::driver::LaunchConfig;

/// Warps per block.
pub const MV_WARPS: u32 = 4;
/// Output rows per warp.
pub const MV_ROWS_PER_WARP: u32 = 2;
const MV_ROWS_PER_BLOCK: usize = (MV_WARPS * MV_ROWS_PER_WARP) as usize;

/// `out = epilogue(W LN(x) + bias)`, W `[n, k]`.
#[derive(Clone, Copy, Debug)]
pub struct Matvec {
    pub out: DevPtr<f32>,
    pub x: DevPtr<f32>,
    pub w: DevPtr<Stored>,
    pub bias: Option<DevPtr<Stored>>,
    pub n: usize,
    pub k: usize,
    /// LayerNorm of x first.
    pub norm: Option<Norm>,
    pub epilogue: Epilogue,
    /// [`Epilogue::Qkv`]: where keys and values go, at the position in `position`.
    pub kv: Option<(KvLayer, DevPtr<i32>)>,
    /// Raise the argmax key of the outputs into this u64 (the LM head).
    pub argmax_key: Option<DevPtr<u64>>,
    /// Weights to ask L2 for while this product runs (the next kernel's).
    pub prefetch: Option<DevPtr<Stored>>,
}

impl Launcher {
    pub fn matvec(&self, a: Matvec) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (a.n.div_ceil(MV_ROWS_PER_BLOCK) as u32, 1, 1),
            block_dim: (MV_WARPS * 32, 1, 1),
            shared_mem_bytes: (a.k * 4) as u32,
        };
        let qkv = a.epilogue == Epilogue::Qkv;
        let c = self.config.n_embd;
        ensure(
            a.x.len() >= a.k
                && (qkv && a.out.len() >= c || !qkv && a.out.len() >= a.n)
                && (!qkv || a.kv.is_some()),
            "matvec",
        )?;
        let (n, k, c, mode) = (a.n as i32, a.k as i32, c as i32, a.epilogue as i32);
        let (out, x, w, bias) = (a.out.addr(), a.x.addr(), a.w.addr(), addr_or_null(a.bias));
        let (ln_w, ln_b) = a.norm.map_or((0, 0), |n| (n.w.addr(), n.b.addr()));
        let (kv_k, kv_v, pos) = match a.kv.filter(|_| qkv) {
            Some((kv, position)) => (kv.k.addr(), kv.v.addr(), position.addr()),
            None => (0, 0, 0),
        };
        let best = addr_or_null(a.argmax_key);
        let (pf, pf_bytes) = self.prefetch_args(a.prefetch);
        // SAFETY: x has k floats, w n*k weights, out n floats (or, for the QKV scatter, C
        // floats of q and the cache rows at the position, which the session keeps below its
        // capacity); best (when non-zero) one u64; pf (when non-zero) pf_bytes of weights.
        let mut args = kernel_args![
            &out, &x, &w, &bias, &n, &k, &ln_w, &ln_b, &mode, &c, &pos, &kv_k, &kv_v, &best, &pf,
            &pf_bytes
        ];
        unsafe { self.launch(&self.kernels.matvec, cfg, 1, &mut args, "matvec") }
    }
}

/// The row an LM head's argmax key names (`argmax_key` in matvec.cu: the value's
/// order-preserving bits above the complement of the row); 0 when no row set it (every logit
/// NaN).
pub fn argmax_row(key: u64) -> u32 {
    if key == 0 {
        0
    } else {
        u32::MAX - key as u32
    }
}

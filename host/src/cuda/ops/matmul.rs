//! `kernels/matmul.cu`: the tiled prefill product (no cuBLAS) with the epilogues, the
//! epilogue pass after a cuBLAS product, and f32 -> bf16 conversion.

use super::{addr_or_null, kernel_args, Epilogue, KvLayer, Launcher};
use crate::cuda::buffer::{Act, Bf16, DevPtr, Stored};
use crate::cuda::error::{ensure, CudaError};
use cudarc::driver::LaunchConfig;

/// Output rows and columns of one block's tile.
pub const TILE: u32 = 64;

/// `out = epilogue(X W^T + bias)` for `rows` rows at positions `start..`, X `[rows, k]`, W
/// `[n, k]`, out rows `out_stride` apart.
#[derive(Clone, Copy, Debug)]
pub struct Matmul {
    pub out: DevPtr<f32>,
    pub x: DevPtr<f32>,
    pub w: DevPtr<Stored>,
    pub bias: Option<DevPtr<Stored>>,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub epilogue: Epilogue,
    pub start: usize,
    /// [`Epilogue::Qkv`]: the layer's cache.
    pub kv: Option<KvLayer>,
    pub out_stride: usize,
}

/// Bias + epilogue over a product's f32 result `tmp` (`rows` x `n`) into `out` (f32 or bf16).
#[derive(Clone, Copy, Debug)]
pub struct GemmEpilogue {
    pub out: Act,
    pub tmp: DevPtr<f32>,
    pub bias: DevPtr<Stored>,
    pub rows: usize,
    pub n: usize,
    pub epilogue: Epilogue,
    pub start: usize,
    pub kv: Option<KvLayer>,
    pub out_stride: usize,
}

/// For a QKV epilogue, whether the cache holds rows `start..start + rows` of width `c`.
fn kv_rows_fit(epilogue: Epilogue, kv: Option<KvLayer>, end: usize, c: usize) -> bool {
    epilogue != Epilogue::Qkv || kv.is_some_and(|kv| kv.k.len() >= end * c && kv.v.len() >= end * c)
}

fn kv_addrs(kv: Option<KvLayer>) -> (u64, u64) {
    kv.map_or((0, 0), |kv| (kv.k.addr(), kv.v.addr()))
}

impl Launcher {
    pub fn matmul(&self, a: Matmul) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (
                a.n.div_ceil(TILE as usize) as u32,
                a.rows.div_ceil(TILE as usize) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let c = self.config.n_embd;
        let qkv = a.epilogue == Epilogue::Qkv;
        ensure(
            a.x.len() >= a.rows * a.k
                && (qkv || a.out.len() >= a.rows.saturating_sub(1) * a.out_stride + a.n)
                && kv_rows_fit(a.epilogue, a.kv, a.start + a.rows, c),
            "matmul",
        )?;
        let (rows, n, k, mode) = (a.rows as i32, a.n as i32, a.k as i32, a.epilogue as i32);
        let (c, start, stride) = (c as i32, a.start as i32, a.out_stride as i32);
        let (out, x, w, bias) = (a.out.addr(), a.x.addr(), a.w.addr(), addr_or_null(a.bias));
        let (kv_k, kv_v) = kv_addrs(a.kv);
        // SAFETY: x has rows*k floats, w n*k weights, out rows*out_stride floats (or the QKV
        // targets: q rows and cache rows start..start+rows, checked above).
        let mut args = kernel_args![
            &out, &x, &w, &bias, &rows, &n, &k, &mode, &c, &start, &kv_k, &kv_v, &stride
        ];
        unsafe { self.launch(&self.kernels.matmul, cfg, 1, &mut args, "matmul") }
    }

    pub fn gemm_epilogue(&self, a: GemmEpilogue) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (a.n.div_ceil(1024) as u32, a.rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let c = self.config.n_embd;
        ensure(
            a.tmp.len() >= a.rows * a.n && kv_rows_fit(a.epilogue, a.kv, a.start + a.rows, c),
            "GEMM epilogue",
        )?;
        let (rows, n, mode, c) = (a.rows as i32, a.n as i32, a.epilogue as i32, c as i32);
        let (start, stride, obf) = (
            a.start as i32,
            a.out_stride as i32,
            i32::from(a.out.is_bf16()),
        );
        let (out, tmp, bias) = (a.out.addr(), a.tmp.addr(), a.bias.addr());
        let (kv_k, kv_v) = kv_addrs(a.kv);
        // SAFETY: tmp holds rows*n floats; out rows*out_stride values (or the KV targets,
        // start+rows <= capacity, checked above).
        let mut args = kernel_args![
            &out, &tmp, &bias, &rows, &n, &mode, &c, &start, &kv_k, &kv_v, &stride, &obf
        ];
        unsafe {
            self.launch(
                &self.kernels.gemm_epilogue,
                cfg,
                1,
                &mut args,
                "GEMM epilogue",
            )
        }
    }

    /// `count` f32 values at `x` as bf16 at `out`.
    pub fn to_bf16(
        &self,
        out: DevPtr<Bf16>,
        x: DevPtr<f32>,
        count: usize,
    ) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (count.div_ceil(256).min(4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        ensure(out.len() >= count && x.len() >= count, "to bf16")?;
        let (count, out, x) = (count as i32, out.addr(), x.addr());
        let mut args = kernel_args![&out, &x, &count];
        // SAFETY: both buffers hold at least `count` values (checked above).
        unsafe { self.launch(&self.kernels.to_bf16, cfg, 1, &mut args, "to bf16") }
    }
}

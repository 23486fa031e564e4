//! `kernels/attention.cu`: causal attention over the KV cache. Decode: split-KV partials and
//! their combination, or (sm_90+) LayerNorm + QKV + cache append + attention in one kernel,
//! a thread-block cluster per head. Prefill: tensor-core flash attention (from bf16 QKV rows,
//! or from the cache), CUDA-core tiled flash attention, or one block per row.

use super::{kernel_args, KvLayer, Launcher, Norm};
use crate::cuda::buffer::{Act, Bf16, DevPtr, Stored};
use crate::cuda::error::{ensure, CudaError, DriverContext};
use cudarc::driver::LaunchConfig;

/// Positions per block in decode attention.
pub const ATT_CHUNK: u32 = 32;
/// Threads per decode-attention (and plain prefill) block.
pub const ATT_THREADS: u32 = 128;
/// Most blocks per head of the fused decode kernel's cluster.
pub const DA_MAX_CLUSTER: u32 = 16;
/// Most threads per block of the fused decode kernel.
pub const DA_THREADS: u32 = 256;

/// Whether `blocks` per head of `threads` each is a cluster shape the fused decode kernel
/// takes (`WASI_NN_HOST_DECODE_CLUSTER`; other values are ignored).
pub fn valid_cluster(blocks: u32, threads: u32) -> bool {
    (2..=DA_MAX_CLUSTER).contains(&blocks) && (threads == 128 || threads == 256)
}

/// The fused decode kernel's cluster shape (blocks per head, threads): the switch's when
/// valid, else 8 blocks of 256 threads, or of 128 for f32 weights past 124M's width (its 142
/// registers a thread would leave one 256-thread block per SM: measured slower there).
pub fn decode_cluster_shape(chosen: Option<(u32, u32)>, wide_f32: bool) -> (u32, u32) {
    match chosen.filter(|&(n, t)| valid_cluster(n, t)) {
        Some(shape) => shape,
        None if wide_f32 => (8, 128),
        None => (8, 256),
    }
}
/// Query rows per block of the tiled (CUDA-core) prefill attention.
pub const FA_Q: u32 = 32;
/// Query rows per block of the tensor-core prefill attentions.
pub const TC_Q: u32 = 64;
/// Threads per tensor-core prefill block.
pub const TC_THREADS: u32 = 256;
/// Dynamic shared memory of the bf16-rows prefill attention: two stages of 128 keys and
/// values, rows of 72 bf16 (`static_assert`ed against its layout in attention.cu).
pub const FA_SMEM: u32 = 2 * 2 * 128 * 72 * 2;

/// Where a prefill's kernels take its first position from.
#[derive(Clone, Copy, Debug)]
pub enum Start {
    /// A launch argument.
    Host(usize),
    /// Device memory (a captured prefill serves any prefix length).
    Device(DevPtr<i32>),
}

impl Start {
    /// (the position as an argument, the address to read it from or 0).
    fn args(self) -> (i32, u64) {
        match self {
            Start::Host(start) => (start as i32, 0),
            Start::Device(p) => (0, p.addr()),
        }
    }
}

/// Split-KV decode attention of the query in `qkv[0..C]` over positions `0..=position`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeAttention {
    pub out: DevPtr<f32>,
    pub qkv: DevPtr<f32>,
    pub kv: KvLayer,
    pub position: DevPtr<i32>,
    /// `[n_head, max_chunks, hd + 2]` scratch.
    pub partial: DevPtr<f32>,
    pub max_chunks: usize,
}

/// One decode step's LayerNorm, QKV product, cache append at `position` and attention, into
/// `out`; a cluster of `cluster` blocks of `threads` per head.
#[derive(Clone, Copy, Debug)]
pub struct FusedDecode {
    pub out: DevPtr<f32>,
    pub x: DevPtr<f32>,
    pub qkv_w: DevPtr<Stored>,
    pub qkv_b: DevPtr<Stored>,
    pub norm: Norm,
    pub kv: KvLayer,
    pub position: DevPtr<i32>,
    /// Positions the cache holds.
    pub capacity: usize,
    pub cluster: u32,
    pub threads: u32,
    /// Weights to ask L2 for while this kernel runs (the next kernel's).
    pub prefetch: Option<DevPtr<Stored>>,
}

/// Causal attention of `rows` new rows at positions `start..` into `out` (f32 or bf16).
#[derive(Clone, Copy, Debug)]
pub struct PrefillAttention {
    pub out: Act,
    pub kv: KvLayer,
    pub start: Start,
    pub rows: usize,
}

impl Launcher {
    pub fn decode_attention(&self, a: DecodeAttention) -> Result<(), CudaError> {
        let cfg = self.config;
        let (hd, chunks) = (cfg.head_dim(), a.max_chunks);
        ensure(
            a.partial.len() >= cfg.n_head * chunks * (hd + 2) && a.out.len() >= cfg.n_embd,
            "attention",
        )?;
        let (c32, hd32, chunks32) = (cfg.n_embd as i32, hd as i32, chunks as i32);
        let grid = LaunchConfig {
            grid_dim: (cfg.n_head as u32, chunks as u32, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (partial, q, k, v, pos) = (
            a.partial.addr(),
            a.qkv.addr(),
            a.kv.k.addr(),
            a.kv.v.addr(),
            a.position.addr(),
        );
        // SAFETY: the position is < capacity (checked by the session before the step); the
        // partial buffer holds n_head * max_chunks * (hd + 2) floats.
        let mut args = kernel_args![&partial, &q, &k, &v, &pos, &c32, &hd32, &chunks32];
        unsafe { self.launch(&self.kernels.att_partial, grid, 1, &mut args, "attention") }?;
        // The combine's weights, padded to whole groups of 8 floats: its unrolled loop reads
        // them 16 bytes at a time, up to 3 floats past the last chunk (compute-sanitizer's
        // memcheck found the reads out of bounds when chunks was not a multiple of 4).
        let grid = LaunchConfig {
            grid_dim: (cfg.n_head as u32, 1, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: (chunks.next_multiple_of(8) * 4) as u32,
        };
        let out = a.out.addr();
        // SAFETY: as above; out holds C floats.
        let mut args = kernel_args![&out, &partial, &pos, &hd32, &chunks32];
        unsafe { self.launch(&self.kernels.att_combine, grid, 1, &mut args, "attention") }
    }

    pub fn fused_decode(&self, a: FusedDecode) -> Result<(), CudaError> {
        let cfg = self.config;
        let c = cfg.n_embd;
        ensure(
            a.out.len() >= c
                && a.x.len() >= c
                && a.kv.k.len() >= a.capacity * c
                && (2..=DA_MAX_CLUSTER).contains(&a.cluster)
                && a.threads <= DA_THREADS,
            "QKV + attention",
        )?;
        let grid = LaunchConfig {
            grid_dim: (a.cluster, cfg.n_head as u32, 1),
            block_dim: (a.threads, 1, 1),
            shared_mem_bytes: ((c + a.capacity.div_ceil(a.cluster as usize)) * 4) as u32,
        };
        let (c32, hd32) = (c as i32, cfg.head_dim() as i32);
        let (out, x, w, b) = (a.out.addr(), a.x.addr(), a.qkv_w.addr(), a.qkv_b.addr());
        let (ln_w, ln_b, k, v, pos) = (
            a.norm.w.addr(),
            a.norm.b.addr(),
            a.kv.k.addr(),
            a.kv.v.addr(),
            a.position.addr(),
        );
        let (pf, pf_bytes) = self.prefetch_args(a.prefetch);
        // SAFETY: x holds C floats and out C floats; the weights are [3C, C] and [3C]; the
        // position is < capacity (checked by the session before the step), so the cache rows
        // exist; shared memory holds C + ceil(capacity / cluster) floats, the kernel's need;
        // pf (when non-zero) pf_bytes of weights.
        let mut args =
            kernel_args![&out, &x, &w, &b, &ln_w, &ln_b, &k, &v, &pos, &c32, &hd32, &pf, &pf_bytes];
        let func = &self.kernels.decode_qkv_att;
        unsafe { self.launch(func, grid, a.cluster, &mut args, "QKV + attention") }
    }

    /// Tensor-core attention over the prompt's bf16 QKV rows (`qkv`, `[rows, 3C]`, bias
    /// added), appending their keys and values to the fp16 cache; a cached prefix is read from
    /// the cache. bf16 mode, head size 64, sm_80+.
    pub fn prefill_attention_fresh(
        &self,
        a: PrefillAttention,
        qkv: DevPtr<Bf16>,
    ) -> Result<(), CudaError> {
        let c = self.config.n_embd;
        ensure(qkv.len() >= a.rows * 3 * c, "attention")?;
        let grid = self.tensor_core_grid(a.rows, FA_SMEM);
        self.check_rows(&a)?;
        let (start, start_ptr) = a.start.args();
        let (n32, c32, obf) = (a.rows as i32, c as i32, i32::from(a.out.is_bf16()));
        let (out, rows, k, v) = (a.out.addr(), qkv.addr(), a.kv.k.addr(), a.kv.v.addr());
        let mut args = kernel_args![&out, &rows, &k, &v, &start, &n32, &c32, &obf, &start_ptr];
        // SAFETY: start + rows <= capacity (checked by the session); qkv holds rows bf16 rows
        // of 3C, out rows rows of C; the kernel reads cache rows 0..start and writes rows
        // start..start+rows of head columns h*64.. < C.
        unsafe {
            self.launch(
                &self.kernels.att_prefill_fresh,
                grid,
                1,
                &mut args,
                "attention",
            )
        }
    }

    /// Tensor-core attention of the queries in `qkv` (`[rows, 3C]` f32) over the cache, whose
    /// rows up to start + rows hold the keys and values already. Head size 64, sm_80+.
    pub fn prefill_attention_mma(
        &self,
        a: PrefillAttention,
        qkv: DevPtr<f32>,
    ) -> Result<(), CudaError> {
        let c = self.config.n_embd;
        ensure(qkv.len() >= a.rows * 3 * c, "attention")?;
        let grid = self.tensor_core_grid(a.rows, 0);
        self.check_rows(&a)?;
        let (start, start_ptr) = a.start.args();
        let (n32, c32, obf) = (a.rows as i32, c as i32, i32::from(a.out.is_bf16()));
        let (out, q, k, v) = (a.out.addr(), qkv.addr(), a.kv.k.addr(), a.kv.v.addr());
        let mut args = kernel_args![&out, &q, &k, &v, &start, &n32, &c32, &obf, &start_ptr];
        // SAFETY: start + rows <= capacity (checked by the session); qkv holds rows rows of
        // 3C, out rows rows of C; the kernel reads cache rows 0..start+rows of head columns
        // h*64.. < C.
        unsafe {
            self.launch(
                &self.kernels.att_prefill_mma,
                grid,
                1,
                &mut args,
                "attention",
            )
        }
    }

    /// CUDA-core tiled flash attention (f32 output, head size <= 64).
    pub fn prefill_attention_tiled(
        &self,
        a: PrefillAttention,
        qkv: DevPtr<f32>,
    ) -> Result<(), CudaError> {
        let cfg = self.config;
        ensure(
            qkv.len() >= a.rows * 3 * cfg.n_embd && !a.out.is_bf16() && cfg.head_dim() <= 64,
            "attention",
        )?;
        self.check_rows(&a)?;
        let Start::Host(start) = a.start else {
            return Err(CudaError::Bounds(
                "attention: the tiled kernel takes a host start",
            ));
        };
        let grid = LaunchConfig {
            grid_dim: (cfg.n_head as u32, a.rows.div_ceil(FA_Q as usize) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (start32, n32, c32, hd32) = (
            start as i32,
            a.rows as i32,
            cfg.n_embd as i32,
            cfg.head_dim() as i32,
        );
        let (out, q, k, v) = (a.out.addr(), qkv.addr(), a.kv.k.addr(), a.kv.v.addr());
        let mut args = kernel_args![&out, &q, &k, &v, &start32, &n32, &c32, &hd32];
        // SAFETY: start + rows <= capacity (checked by the session); qkv holds rows rows of
        // 3C, out rows rows of C.
        unsafe {
            self.launch(
                &self.kernels.att_prefill_tiled,
                grid,
                1,
                &mut args,
                "attention",
            )
        }
    }

    /// One block per (head, row): any head size, f32 output.
    pub fn prefill_attention_plain(
        &self,
        a: PrefillAttention,
        qkv: DevPtr<f32>,
    ) -> Result<(), CudaError> {
        let cfg = self.config;
        ensure(
            qkv.len() >= a.rows * 3 * cfg.n_embd && !a.out.is_bf16(),
            "attention",
        )?;
        self.check_rows(&a)?;
        let Start::Host(start) = a.start else {
            return Err(CudaError::Bounds(
                "attention: the plain kernel takes a host start",
            ));
        };
        let grid = LaunchConfig {
            grid_dim: (cfg.n_head as u32, a.rows as u32, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: ((start + a.rows) * 4) as u32,
        };
        let (start32, c32, hd32) = (start as i32, cfg.n_embd as i32, cfg.head_dim() as i32);
        let (out, q, k, v) = (a.out.addr(), qkv.addr(), a.kv.k.addr(), a.kv.v.addr());
        let mut args = kernel_args![&out, &q, &k, &v, &start32, &c32, &hd32];
        // SAFETY: start + rows <= capacity (checked by the session); scores fit the shared
        // memory asked for; out holds rows*C floats.
        unsafe { self.launch(&self.kernels.att_prefill, grid, 1, &mut args, "attention") }
    }

    fn tensor_core_grid(&self, rows: usize, shared_mem_bytes: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                self.config.n_head as u32,
                rows.div_ceil(TC_Q as usize) as u32,
                1,
            ),
            block_dim: (TC_THREADS, 1, 1),
            shared_mem_bytes,
        }
    }

    /// The cache holds the rows a prefill writes (with a host start; a device start was
    /// checked when the graph's prefill was).
    fn check_rows(&self, a: &PrefillAttention) -> Result<(), CudaError> {
        let c = self.config.n_embd;
        let end = match a.start {
            Start::Host(start) => start + a.rows,
            Start::Device(_) => a.rows,
        };
        ensure(
            a.kv.k.len() >= end * c && a.kv.v.len() >= end * c,
            "attention",
        )
    }
}

/// Let the bf16-rows prefill attention use [`FA_SMEM`] bytes of dynamic shared memory.
pub(crate) fn allow_fresh_shared_memory(
    func: &cudarc::driver::CudaFunction,
) -> Result<(), CudaError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    func.set_attribute(
        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        FA_SMEM as i32,
    )
    .ctx("attention shared memory")
}

//! Kernel launchers: the only code that launches our kernels. One module per kernel family,
//! named like its file in `kernels/` (`embed_norm`, `matvec`, `matmul`, `attention`, `draw`); each
//! launcher takes typed device views ([`DevPtr`], [`Act`]) and the shapes, picks the grid, and
//! says in a `// SAFETY:` comment what the kernel touches.
//!
//! The constants both sides need (tile sizes, threads per block, epilogue modes) are
//! defined here once and handed to NVRTC as `-D` defines ([`DEFINES`]).

pub mod attention;
pub mod batch;
pub mod batch_gemm;
pub mod draw;
pub mod embed_norm;
mod kernels;
pub mod matmul;
pub mod matvec;
pub mod persistent;

use super::buffer::{Cached, DevPtr, Stored};
use super::device::Gpu;
use super::error::{CudaError, DriverContext};
use crate::engine::GpuDtype;
use crate::model::Gpt2Config;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};
use std::sync::Arc;

pub use kernels::Kernels;

/// What a matrix product does with each output value, bias already added (`EPI_*` in the
/// kernels).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(i32)]
pub enum Epilogue {
    /// `out[o] = v`
    Store = 0,
    /// `out[o] = gelu(v)`
    Gelu = 1,
    /// `out[o] += v`
    Residual = 2,
    /// q to `out`; k and v to the KV cache at the row's position
    Qkv = 3,
}

/// Every constant the kernels take from the host, as `(name, value)` defines.
pub(crate) const DEFINES: &[(&str, u32)] = &[
    ("EPI_STORE", Epilogue::Store as u32),
    ("EPI_GELU", Epilogue::Gelu as u32),
    ("EPI_RESIDUAL", Epilogue::Residual as u32),
    ("EPI_QKV", Epilogue::Qkv as u32),
    ("MV_WARPS", matvec::MV_WARPS),
    ("MV_ROWS_PER_WARP", matvec::MV_ROWS_PER_WARP),
    ("TILE", matmul::TILE),
    ("ATT_CHUNK", attention::ATT_CHUNK),
    ("ATT_THREADS", attention::ATT_THREADS),
    ("DA_MAX_CLUSTER", attention::DA_MAX_CLUSTER),
    ("DA_THREADS", attention::DA_THREADS),
    ("FA_Q", attention::FA_Q),
    ("TC_Q", attention::TC_Q),
    ("TC_THREADS", attention::TC_THREADS),
    ("FA_SMEM", attention::FA_SMEM),
    ("BL_PER", batch::BL_PER),
    ("BT_Q", batch::BT_Q),
    ("BT_SMEM", batch::BT_SMEM),
    ("BA_VALUES_SMEM", batch::BA_VALUES_SMEM),
    ("DRAW_THREADS", draw::DRAW_THREADS),
    ("MAX_DRAWS", draw::MAX_DRAWS),
    ("BATCH_RULE_WORDS", draw::BATCH_RULE_WORDS as u32),
    ("PD_WARPS", persistent::PD_WARPS),
    ("PD_MAX_SPLITS", persistent::MAX_SPLITS as u32),
];

/// One layer's KV cache, `[capacity, C]` each (f32, or fp16 with bf16 weights).
#[derive(Clone, Copy, Debug)]
pub struct KvLayer {
    pub k: DevPtr<Cached>,
    pub v: DevPtr<Cached>,
}

/// A LayerNorm's weight and bias.
#[derive(Clone, Copy, Debug)]
pub struct Norm {
    pub w: DevPtr<Stored>,
    pub b: DevPtr<Stored>,
}

/// Launches kernels of one model shape and weight dtype on one stream, with programmatic
/// dependent launch where the GPU has it (every kernel waits with `griddepcontrol.wait`
/// before touching activations).
pub struct Launcher {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) kernels: Arc<Kernels>,
    pub(crate) config: Gpt2Config,
    pub(crate) dtype: GpuDtype,
}

/// Pointers to kernel arguments, in order, for `cuLaunchKernelEx`.
macro_rules! kernel_args {
    ($($arg:expr),* $(,)?) => {
        [$($arg as *const _ as *mut std::ffi::c_void),*]
    };
}
pub(crate) use kernel_args;

/// The address of an optional view, 0 (the kernels' "none") when absent.
pub(crate) fn addr_or_null<T>(p: Option<DevPtr<T>>) -> u64 {
    p.map_or(0, DevPtr::addr)
}

impl Launcher {
    pub fn new(
        gpu: Arc<Gpu>,
        stream: Arc<CudaStream>,
        kernels: Arc<Kernels>,
        config: Gpt2Config,
        dtype: GpuDtype,
    ) -> Self {
        Self {
            gpu,
            stream,
            kernels,
            config,
            dtype,
        }
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    #[cfg(feature = "dev")]
    pub fn config(&self) -> Gpt2Config {
        self.config
    }

    pub fn dtype(&self) -> GpuDtype {
        self.dtype
    }

    /// A kernel's L2 prefetch arguments: the weights' address and bytes (0, 0: none).
    fn prefetch_args(&self, weights: Option<DevPtr<Stored>>) -> (u64, i64) {
        weights.map_or((0, 0), |w| {
            (w.addr(), (w.len() * self.dtype.bytes()) as i64)
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Launch `func` on the stream in thread-block clusters of `cluster` blocks along x (1:
    /// none).
    ///
    /// # Safety
    /// `args` must hold pointers to values of the kernel's parameter types, in order, and
    /// every device address among them must cover what the kernel touches for `cfg`;
    /// `cluster` > 1 needs sm_90 and must divide the grid's x.
    pub(crate) unsafe fn launch(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        cluster: u32,
        args: &mut [*mut std::ffi::c_void],
        what: &'static str,
    ) -> Result<(), CudaError> {
        // SAFETY: as this function's.
        unsafe { self.launch_with(func, cfg, cluster, false, args, what) }
    }

    /// Launch `func` as a cooperative grid: every block resident at once (the grid must fit
    /// the GPU at the kernel's occupancy), without programmatic dependent launch (the kernel
    /// reads what the work before it wrote from its first instruction).
    ///
    /// # Safety
    /// As [`Self::launch`]'s.
    pub(crate) unsafe fn launch_cooperative(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
        what: &'static str,
    ) -> Result<(), CudaError> {
        // SAFETY: as this function's.
        unsafe { self.launch_with(func, cfg, 1, true, args, what) }
    }

    /// # Safety
    /// As [`Self::launch`]'s.
    unsafe fn launch_with(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        cluster: u32,
        cooperative: bool,
        args: &mut [*mut std::ffi::c_void],
        what: &'static str,
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        self.gpu.ctx.bind_to_thread().ctx(what)?;
        // SAFETY: an all-zero launch attribute is valid (id 0 = ignored); we fill in up to two.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if cooperative {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attrs[n].value.cooperative = 1;
            n += 1;
        } else if self.gpu.pdl {
            attrs[n].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cluster > 1 {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = cluster;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        // SAFETY: the caller vouches for the arguments; config and attrs outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .ctx(what)
    }
}

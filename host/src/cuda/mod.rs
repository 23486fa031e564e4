//! The CUDA backend: GPT-2 forward passes on our own kernels (`kernels/*.cu`).
//!
//! - [`device`]: a GPU (`cuda:N`, each opened once per process), its capabilities and the
//!   switches that apply to it ([`crate::switches`]); [`nvrtc`] compiles the kernels with the
//!   defines it is given (PTX cached on disk). cudarc finds libcuda and libnvrtc at run time:
//!   the binary builds without CUDA.
//! - [`CudaExecutor`] holds a graph's weights on the GPU once ([`weights`]: f32, or bf16
//!   converted at load; shared as a `LoadedModel`) and its batchers ("lanes"), each a
//!   [`batch::CudaBatch`]: the batched step over many contexts. Every
//!   [`session::CudaSession`] (one per wasi-nn execution context) has its own stream, KV
//!   cache, activation buffers and captured graphs.
//! - [`ops`]: the kernel table and launchers, one module per `.cu` family, typed arguments
//!   ([`buffer`]), the constants handed to NVRTC; [`blas`]: cuBLAS and cuBLASLt for the
//!   prefill's products.
//! - [`error::CudaError`] keeps the driver's, NVRTC's and cuBLAS's errors typed.
//!
//! Unsafe code here is kernel and library launches: each passes device addresses into
//! allocations owned by the executor or the session (alive for the call), with sizes checked
//! by the launcher before the launch.

// The kernel launchers, buffers and sessions are the crate's own; the checks and benchmarks
// (`bench/`, through the `dev` feature) reach into them too. Each module is declared twice,
// with its visibility under `cfg`, so that rustfmt and the compiler see a plain `mod` item.
pub mod batch;
#[cfg(feature = "dev")]
pub mod blas;
#[cfg(not(feature = "dev"))]
pub(crate) mod blas;
#[cfg(feature = "dev")]
pub mod buffer;
#[cfg(not(feature = "dev"))]
pub(crate) mod buffer;
pub mod device;
pub mod error;
mod executor;
mod loaded;
pub mod nvrtc;
#[cfg(feature = "dev")]
pub mod ops;
#[cfg(not(feature = "dev"))]
pub(crate) mod ops;
#[cfg(feature = "dev")]
pub mod session;
#[cfg(not(feature = "dev"))]
pub(crate) mod session;
#[cfg(feature = "dev")]
pub mod weights;
#[cfg(not(feature = "dev"))]
pub(crate) mod weights;

pub use device::Gpu;
pub use error::CudaError;
pub use executor::CudaExecutor;
pub use session::CudaSession;

use crate::engine::{EngineError, GpuDtype};
use crate::model::Gpt2Config;

/// Compile every kernel with NVRTC for `arch`, no GPU needed: PTX for `compute_XY`, machine
/// code for `sm_XY` (`WASI_NN_HOST_KERNELS=DIR` compiles the files in DIR instead of the
/// built-in copies). Returns the image and the name the host looks for it by in a prebuilt
/// folder or its cache.
pub fn compile_kernels(arch: &str) -> Result<(nvrtc::KernelImage, String), CudaError> {
    let kernels_dir = crate::switches::get().measurement.kernels_dir.as_deref();
    nvrtc::compile_image(arch, ops::DEFINES, kernels_dir)
}

/// The first GPU's (`cuda:0`) name and free memory, or why there is no usable GPU; for
/// diagnostics.
pub fn describe() -> Result<String, EngineError> {
    Ok(Gpu::get(0)?.describe()?)
}

/// The bytes of all weights stored as `dtype`.
pub fn weight_bytes(config: &Gpt2Config, dtype: GpuDtype) -> usize {
    config.num_params() * dtype.bytes()
}

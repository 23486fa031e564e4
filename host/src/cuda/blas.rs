//! cuBLAS and cuBLASLt for the prefill's and the batched pass's products: a handle on the
//! session's (or pass's) stream, the GEMM scratch (f32 results before an epilogue pass, bf16
//! copies of activations for the tensor cores, the FC and QKV products' bf16 results),
//! cuBLASLt's fused-epilogue products, and the pass's plain products through cuBLASLt with
//! algorithms chosen by timing ([`lt`]).

pub(crate) mod lt;
mod tuned;

pub(crate) use lt::saved_file_name;
#[cfg(feature = "dev")]
pub use lt::time_products;
pub use lt::{Epilogue as LtEpilogue, LtPlans, Shape, Tuned};

use super::buffer::{Act, Bf16, DevBuf, DevPtr, Stored};
use super::error::CudaError;
use super::ops::Launcher;
use crate::engine::GpuDtype;
use cudarc::cublas::sys::cublasHandle_t;
use cudarc::driver::CudaStream;
use std::sync::{Arc, Mutex};
use tuned::Untuned;

/// The bias of a cuBLASLt product: in the weights' type, or f32 (cuBLASLt takes no bf16 bias
/// with an f32 result).
#[derive(Clone, Copy, Debug)]
pub enum LtBias {
    Stored(DevPtr<Stored>),
    F32(DevPtr<f32>),
}

/// A cuBLAS handle on one stream, plus the GEMM scratch for `rows` rows of width C.
pub struct Blas {
    handle: cublasHandle_t,
    /// f32 results before the epilogue pass, `[rows, 4C]`.
    pub tmp: DevBuf<f32>,
    /// bf16 copies of activations (the products' inputs in bf16 mode), `[rows, 4C]`.
    pub x_bf16: DevBuf<Bf16>,
    /// The FC product's bf16 result (the MLP projection's input), `[rows, 4C]`, apart from
    /// `x_bf16`, its input.
    pub fc_bf16: DevBuf<Bf16>,
    /// The QKV product's bf16 rows (`[rows, 3C]`, bias added) that the tensor-core attention
    /// reads the prompt's queries, keys and values from.
    pub qkv_bf16: DevBuf<Bf16>,
    /// cuBLASLt (None: not loadable, or switched off) and its workspace.
    lt: Option<lt::Lt>,
    _lt_workspace: Option<DevBuf<u8>>,
    /// [`Blas::gemm`]'s bf16 products of shapes with a timed algorithm go through cuBLASLt
    /// ([`Blas::with_tuned_products`], [`Blas::tune_products`]).
    lt_products: bool,
    /// The shapes [`Blas::gemm`] has met without a timed algorithm.
    untuned: Mutex<Untuned>,
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by us and is destroyed once.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.handle) };
    }
}

impl Blas {
    /// Whether cuBLAS (libcublas) can be loaded. Asked before the first handle: cudarc panics
    /// when it cannot find the library, and the panic's message would reach stderr.
    pub fn loadable() -> bool {
        // SAFETY: only tries to open the library by its usual names.
        unsafe { cudarc::cublas::sys::is_culib_present() }
    }

    /// cuBLAS on `stream` when the library loads, with cuBLASLt when it loads and `lt` gives
    /// the GPU's plans.
    pub fn new(
        stream: &Arc<CudaStream>,
        rows: usize,
        c: usize,
        lt: Option<&Arc<LtPlans>>,
    ) -> Option<Blas> {
        if !Self::loadable() {
            return None;
        }
        let handle = std::panic::catch_unwind(cudarc::cublas::result::create_handle)
            .ok()?
            .ok()?;
        // SAFETY: a fresh handle and a live stream of the same context.
        unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _) }.ok()?;
        let scratch = |len, what| DevBuf::<Bf16>::zeros(stream, len, what).ok();
        let tmp = DevBuf::zeros(stream, rows * 4 * c, "GEMM scratch").ok()?;
        let x_bf16 = scratch(rows * 4 * c, "GEMM scratch")?;
        let fc_bf16 = scratch(rows * 4 * c, "GEMM scratch")?;
        let qkv_bf16 = scratch(rows * 3 * c, "GEMM scratch")?;
        let (lt, lt_workspace) = match lt {
            None => (None, None),
            Some(plans) => {
                // a session's own (`LT_WORKSPACE_MB`)
                let bytes = crate::switches::get().measurement.lt_workspace;
                match DevBuf::<u8>::zeros(stream, bytes, "cuBLASLt workspace") {
                    Ok(ws) => {
                        let workspace = (ws.ptr().addr(), bytes);
                        (lt::Lt::new(workspace, plans.clone()), Some(ws))
                    }
                    Err(_) => (None, None),
                }
            }
        };
        Some(Blas {
            handle,
            tmp,
            x_bf16,
            fc_bf16,
            qkv_bf16,
            lt,
            _lt_workspace: lt_workspace,
            lt_products: false,
            untuned: Mutex::default(),
        })
    }

    /// Whether cuBLASLt is there.
    pub fn has_lt(&self) -> bool {
        self.lt.is_some()
    }

    /// `dst[rows, ldc] (+)= x[rows, k] W[n, k]^T` with f32 results; `x` is in the weights'
    /// type (bf16 tensor cores in bf16 mode). `accumulate` adds to what `dst` holds.
    pub fn gemm(
        &self,
        l: &Launcher,
        w: DevPtr<Stored>,
        x: Act,
        (rows, n, k): (usize, usize, usize),
        (dst, ldc): (DevPtr<f32>, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        if l.gpu().measurement().skip.gemm {
            return Ok(());
        }
        super::error::ensure(
            x.is_bf16() == (l.dtype() == GpuDtype::Bf16)
                && dst.len() >= rows.saturating_sub(1) * ldc + n,
            "cuBLAS GEMM",
        )?;
        if x.is_bf16() && self.tuned_product(l, w, x, (rows, n, k), (dst, ldc), accumulate)? {
            return Ok(());
        }
        // SAFETY: pointers cover W (n*k), x (rows*k) and the destination (rows*ldc, checked).
        unsafe {
            self.gemm_default(
                l,
                (w.addr(), x.addr(), dst.addr()),
                (rows, n, k),
                ldc,
                accumulate,
            )
        }
    }

    /// `gemm`'s product on cuBLAS's default algorithm.
    ///
    /// # Safety
    /// `w`, `x` and `dst` address device buffers of `n * k`, `rows * k` (the launcher's type)
    /// and `(rows - 1) * ldc + n` f32, alive until the stream has run the product.
    unsafe fn gemm_default(
        &self,
        l: &Launcher,
        (w, x, dst): (u64, u64, u64),
        (rows, n, k): (usize, usize, usize),
        ldc: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
        };
        let dtype = match l.dtype() {
            GpuDtype::F32 => cudaDataType::CUDA_R_32F,
            GpuDtype::Bf16 => cudaDataType::CUDA_R_16BF,
        };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // Row-major out[rows, n] = x[rows, k] W[n, k]^T is column-major out^T = W x^T.
        // SAFETY: the caller vouches for the pointers; scalars are host f32 as
        // CUBLAS_COMPUTE_32F expects.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                self.handle,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                rows as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                dtype,
                k as i32,
                x as *const std::ffi::c_void,
                dtype,
                k as i32,
                (&beta as *const f32).cast(),
                dst as *mut std::ffi::c_void,
                cudaDataType::CUDA_R_32F,
                ldc as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }?;
        Ok(())
    }

    /// A bf16 product through cuBLASLt with its epilogue fused: `dst (+)= epilogue(W x +
    /// bias)`; the shape's bias and output types follow `bias` and `dst`. Ok(false) when not
    /// in bf16 mode, without cuBLASLt, or when it has no algorithm for the shape: the caller
    /// then takes the cuBLAS + epilogue-kernel path.
    pub fn lt_matmul(
        &self,
        l: &Launcher,
        shape: Shape,
        w: DevPtr<Stored>,
        x: DevPtr<Bf16>,
        bias: LtBias,
        dst: Act,
    ) -> Result<bool, CudaError> {
        let Some(lt) = self.lt.as_ref().filter(|_| l.dtype() == GpuDtype::Bf16) else {
            return Ok(false);
        };
        if l.gpu().measurement().skip.gemm {
            return Ok(true);
        }
        let (bias_bf16, bias) = match bias {
            LtBias::Stored(b) => (true, b.addr()),
            LtBias::F32(b) => (false, b.addr()),
        };
        let shape = Shape {
            bias_bf16,
            out_bf16: dst.is_bf16(),
            ..shape
        };
        super::error::ensure(x.len() >= shape.rows * shape.k, "cuBLASLt product")?;
        // SAFETY: the callers pass the session's buffers and the layer's weights, which cover
        // the shape (x: rows*k bf16, checked; W: n*k, bias: n, dst: rows*ldc) and outlive the
        // stream's work.
        unsafe {
            lt.matmul(
                l.stream().cu_stream() as _,
                shape,
                (w.addr(), x.addr(), bias, dst.addr()),
            )
        }
    }
}

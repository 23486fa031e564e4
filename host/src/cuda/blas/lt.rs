//! cuBLASLt products with fused epilogues, for the bf16 prefill: `D (+)= W x + bias`, optionally
//! followed by GELU, with a bf16 or f32 result. A plan (descriptor, layouts and the algorithm the
//! heuristic picks) is built once per shape and reused; a shape cuBLASLt has no algorithm for is
//! remembered as such and the caller takes its other path.

use crate::cuda::error::CudaError;
use cudarc::cublaslt::{result as lt, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// What follows the product (before it is added to D when accumulating).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Epilogue {
    /// `+ bias`
    Bias,
    /// `gelu(. + bias)`, GELU's tanh form (as GPT-2's).
    GeluBias,
}

/// One product: `rows` x `n` results over `k`, D's leading dimension `ldc`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Shape {
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub ldc: usize,
    pub epilogue: Epilogue,
    /// D (and C) in bf16, else f32.
    pub out_bf16: bool,
    /// `D = product + D` (beta = 1) instead of `D = product`.
    pub accumulate: bool,
    /// The bias vector in bf16 (the weights' type), else f32.
    pub bias_bf16: bool,
}

impl Shape {
    /// `rows` x `n` over `k` into a dense f32 D (leading dimension n), bf16 bias, no accumulate.
    pub fn new((rows, n, k): (usize, usize, usize), epilogue: Epilogue) -> Shape {
        Shape {
            rows,
            n,
            k,
            ldc: n,
            epilogue,
            out_bf16: false,
            accumulate: false,
            bias_bf16: true,
        }
    }
}

/// Whether D (at `dst`) overlaps the bf16 activations (at `x`) of a product: other blocks may
/// still be reading those while one writes its tile, so that is never allowed.
fn output_overlaps_input(shape: &Shape, x: u64, dst: u64) -> bool {
    let x_end = x + (shape.rows * shape.k * 2) as u64;
    let d_bytes = if shape.out_bf16 { 2 } else { 4 };
    let d_end = dst + (shape.rows * shape.ldc * d_bytes) as u64;
    dst < x_end && x < d_end
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3], // A (weights), B (activations), C = D
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Plan::new` and destroyed once, here.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for layout in self.layouts {
                let _ = lt::destroy_matrix_layout(layout);
            }
        }
    }
}

fn attr<T>(
    desc: sys::cublasLtMatmulDesc_t,
    which: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> bool {
    // SAFETY: `v` is a live value of the attribute's type and size.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            which,
            (v as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    }
    .is_ok()
}

impl Plan {
    /// None when cuBLASLt cannot do this shape (no algorithm, unsupported bias type, ...).
    fn new(handle: sys::cublasLtHandle_t, s: Shape, workspace_bytes: usize) -> Option<Plan> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)
            .ok()?;
        let mut layouts = Vec::new();
        // Row-major out[rows, n] = x[rows, k] W[n, k]^T is column-major out^T = W x^T: A = W
        // (k x n, transposed), B = x (k x rows), C = D (n x rows, leading dimension ldc).
        let out_type = if s.out_bf16 { CUDA_R_16BF } else { CUDA_R_32F };
        for (ty, r, c, ld) in [
            (CUDA_R_16BF, s.k, s.n, s.k),
            (CUDA_R_16BF, s.k, s.rows, s.k),
            (out_type, s.n, s.rows, s.ldc),
        ] {
            match lt::create_matrix_layout(ty, r as u64, c as u64, ld as i64) {
                Ok(l) => layouts.push(l),
                Err(_) => {
                    // SAFETY: created above, not used elsewhere.
                    unsafe {
                        let _ = lt::destroy_matmul_desc(desc);
                        for l in layouts {
                            let _ = lt::destroy_matrix_layout(l);
                        }
                    }
                    return None;
                }
            }
        }
        let mut plan = Plan {
            desc,
            layouts: [layouts[0], layouts[1], layouts[2]],
            // SAFETY: plain data, filled in by the heuristic below before any use.
            algo: unsafe { std::mem::zeroed() },
        };
        let epilogue = match s.epilogue {
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        let ok = attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32) // CUBLAS_OP_T
            && attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32) // CUBLAS_OP_N
            && attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))
            && attr(
                desc,
                A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                &(if s.bias_bf16 { CUDA_R_16BF } else { CUDA_R_32F } as i32),
            );
        if !ok {
            return None;
        }
        let pref = lt::create_matmul_pref().ok()?;
        let ws = workspace_bytes as u64;
        // SAFETY: `pref` was just created; `ws` is a u64 as the attribute wants.
        let found = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )
            .ok()
            .and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    handle,
                    desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    pref,
                )
                .ok()
            })
        };
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        plan.algo = found?.algo;
        Some(plan)
    }
}

/// A cuBLASLt handle with its plans; the caller owns the workspace.
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: (u64, usize),
    plans: Mutex<HashMap<Shape, Option<Plan>>>,
}

// SAFETY: the handle and the plans' descriptors are only used under the `plans` lock (a plan's
// bias pointer is set and the product enqueued while it is held).
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: created by `Lt::new`, destroyed once after its plans.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Lt {
    /// None when libcublasLt cannot be loaded (cudarc panics then) or refuses a handle.
    pub(crate) fn new(workspace: (u64, usize)) -> Option<Lt> {
        let handle = std::panic::catch_unwind(lt::create_handle).ok()?.ok()?;
        Some(Lt {
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
        })
    }

    /// Enqueue `D (+)= epilogue(W x + bias)` on `stream` (W: bf16 [n, k]; x: bf16 [rows, k];
    /// bias: [n]; D at `dst`). Ok(false): no plan for this shape, nothing enqueued.
    ///
    /// # Safety
    /// The pointers must address device buffers of the sizes `shape` implies, alive until the
    /// stream has run the product.
    pub(crate) unsafe fn matmul(
        &self,
        stream: sys::cudaStream_t,
        shape: Shape,
        (w, x, bias, dst): (u64, u64, u64, u64),
    ) -> Result<bool, CudaError> {
        if output_overlaps_input(&shape, x, dst) {
            return Err(CudaError::Bounds(
                "cuBLASLt product: its output overlaps its input",
            ));
        }
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| CudaError::unavailable("cuBLASLt plans poisoned"))?;
        let plan = plans
            .entry(shape)
            .or_insert_with(|| Plan::new(self.handle, shape, self.workspace.1));
        let Some(plan) = plan.as_ref() else {
            return Ok(false);
        };
        let bias_ptr = bias as *const c_void;
        if !attr(
            plan.desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &bias_ptr,
        ) {
            return Ok(false);
        }
        let (alpha, beta) = (1.0f32, if shape.accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: the caller vouches for the device pointers; the plan's objects are alive.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                plan.layouts[0],
                x as *const c_void,
                plan.layouts[1],
                dst as *const c_void,
                plan.layouts[2],
                dst as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                self.workspace.0 as *mut c_void,
                self.workspace.1,
                stream,
            )
        }?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_over_its_input_is_refused() {
        // the FC product: 33 rows of C = 64 in, 4C out in bf16
        let fc = Shape {
            out_bf16: true,
            ..Shape::new((33, 256, 64), Epilogue::GeluBias)
        };
        let (x, x_bytes) = (1 << 20, 33 * 64 * 2);
        assert!(output_overlaps_input(&fc, x, x));
        // a result ending right at the input, or starting right after it, is fine
        let d_bytes = 33 * 256 * 2;
        assert!(!output_overlaps_input(&fc, x, x + x_bytes));
        assert!(!output_overlaps_input(&fc, x, x - d_bytes));
        assert!(output_overlaps_input(&fc, x, x - d_bytes + 2));
        assert!(output_overlaps_input(&fc, x, x + x_bytes - 2));
    }
}

//! cuBLASLt products: with fused epilogues for the bf16 prefill (`D (+)= W x + bias`,
//! optionally followed by GELU, with a bf16 or f32 result), and plain ones (`D = W x` into f32)
//! for the batched pass, whose algorithms are chosen by timing ([`tune`]) and kept between
//! runs ([`saved`]). A plan (descriptor, layouts and algorithm) is
//! built once per shape for the whole GPU ([`LtPlans`], shared by its sessions) and reused; a
//! shape cuBLASLt has no algorithm for is remembered as such and the caller takes its other
//! path.
//!
//! The heuristic that picks an algorithm costs milliseconds of the host a shape (on an H200, a
//! lone ~200-token prompt of a length not seen before launched its prefill in 12-17 ms against
//! ~1 ms), and a prompt's length is a product's rows. So the heuristic runs once for each
//! bucket of row counts ([`bucket_rows`]) at the bucket's top, and a shape takes its bucket's
//! algorithm where cuBLASLt's check accepts it for the shape's own rows, else its own
//! heuristic's.

mod saved;
mod tune;

pub(crate) use saved::file_name as saved_file_name;

#[cfg(feature = "dev")]
pub use tune::time_products;
pub use tune::Tuned;

use crate::cuda::error::CudaError;
use cudarc::cublaslt::{result as lt, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// What follows the product (before it is added to D when accumulating).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Epilogue {
    /// The product alone (no bias: the batched pass adds it in its own kernels).
    None,
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

impl Shape {
    /// A plain product (no epilogue, no bias) into f32 at `ldc` a row, as the batched pass's.
    pub fn plain((rows, n, k): (usize, usize, usize), ldc: usize, accumulate: bool) -> Shape {
        Shape {
            ldc,
            accumulate,
            bias_bf16: false,
            ..Shape::new((rows, n, k), Epilogue::None)
        }
    }
}

/// Whether D (at `dst`) overlaps the bf16 activations (at `x`) of a product: other blocks may
/// still be reading those while one writes its tile, so that is never allowed.
pub(crate) fn output_overlaps_input(shape: &Shape, x: u64, dst: u64) -> bool {
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
        // SAFETY: created by `Plan::describe` and destroyed once, here.
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

/// The row count whose heuristic the products of `rows` rows take their algorithm from: the
/// next power of two up to 64, then the next multiple of 64.
pub(crate) fn bucket_rows(rows: usize) -> usize {
    match rows {
        0..=64 => rows.next_power_of_two(),
        _ => rows.next_multiple_of(64),
    }
}

impl Plan {
    /// The descriptor and layouts of `s` (the algorithm still to be chosen); None when
    /// cuBLASLt refuses them (an unsupported bias type, ...).
    fn describe(s: Shape) -> Option<Plan> {
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
        let plan = Plan {
            desc,
            layouts: [layouts[0], layouts[1], layouts[2]],
            // SAFETY: plain data, filled in by the heuristic or the bucket's before any use.
            algo: unsafe { std::mem::zeroed() },
        };
        let epilogue = match s.epilogue {
            Epilogue::None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        let ok = attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32) // CUBLAS_OP_T
            && attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32) // CUBLAS_OP_N
            && attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))
            // a bias type is checked against the output's even with no bias to add (cuBLASLt
            // refuses a bf16 bias beside an f32 result)
            && (s.epilogue == Epilogue::None
                || attr(
                    desc,
                    A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &(if s.bias_bf16 { CUDA_R_16BF } else { CUDA_R_32F } as i32),
                ));
        ok.then_some(plan)
    }

    /// The heuristic's first algorithm for this plan within `workspace_bytes`.
    fn heuristic(
        &self,
        handle: sys::cublasLtHandle_t,
        workspace_bytes: usize,
    ) -> Option<sys::cublasLtMatmulAlgo_t> {
        self.candidates(handle, workspace_bytes, 1).first().copied()
    }

    /// Up to `most` of the heuristic's algorithms for this plan within `workspace_bytes`,
    /// its best guess first (empty: none, or cuBLASLt refused the question).
    fn candidates(
        &self,
        handle: sys::cublasLtHandle_t,
        workspace_bytes: usize,
        most: usize,
    ) -> Vec<sys::cublasLtMatmulAlgo_t> {
        let Ok(pref) = lt::create_matmul_pref() else {
            return Vec::new();
        };
        let ws = workspace_bytes as u64;
        let most = most.clamp(1, 64);
        // SAFETY: plain data, written by the heuristic.
        let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; most];
        let mut returned = 0i32;
        // SAFETY: `pref` was just created; `ws` is a u64 as the attribute wants; the plan's
        // descriptor and layouts are alive; `results` holds `most` entries.
        let found = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )
            .is_ok()
                && sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    self.desc,
                    self.layouts[0],
                    self.layouts[1],
                    self.layouts[2],
                    self.layouts[2],
                    pref,
                    most as i32,
                    results.as_mut_ptr(),
                    &mut returned,
                ) == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
        };
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        if !found {
            return Vec::new();
        }
        let returned = (returned.max(0) as usize).min(most);
        (results[..returned].iter())
            .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect()
    }

    /// Whether cuBLASLt runs `algo` for this plan's shape within `workspace_bytes`.
    fn accepts(
        &self,
        handle: sys::cublasLtHandle_t,
        algo: &sys::cublasLtMatmulAlgo_t,
        workspace_bytes: usize,
    ) -> bool {
        // SAFETY: plain data, written by the check.
        let mut result: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: the plan's descriptor and layouts are alive; `algo` and `result` are live
        // values of their types.
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(
                handle,
                self.desc,
                self.layouts[0],
                self.layouts[1],
                self.layouts[2],
                self.layouts[2],
                algo,
                &mut result,
            )
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && result.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && result.workspaceSize <= workspace_bytes
    }
}

/// The plans of one GPU's cuBLASLt products, shared by its sessions (each with its own handle
/// and workspace), and the algorithms the heuristic chose for each bucket of rows. The
/// heuristic and cuBLASLt's check run outside the lock (two sessions meeting a new shape at
/// once may both run them; the first plan made is kept, until timing or a saved file
/// replaces it), so a session that meets a new shape does not hold up the others' products.
#[derive(Default)]
pub struct LtPlans {
    cache: Mutex<PlanCache>,
}

#[derive(Default)]
struct PlanCache {
    plans: HashMap<Shape, Option<Plan>>,
    /// By shape with its rows at their bucket's top ([`bucket_rows`]).
    algos: HashMap<Shape, Option<sys::cublasLtMatmulAlgo_t>>,
    /// The algorithms chosen by timing ([`Lt::tune`]) or restored from a file of them; None:
    /// the shape runs faster on cuBLAS's default.
    tuned: HashMap<Shape, Option<sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: the plans' descriptors and layouts in the cache are only used under the `cache`
// lock (a plan's bias pointer is set and the product enqueued while it is held). A plan made
// outside it (`with_plan`, `Lt::tune`, `Lt::restore_tuned`) is owned by that one thread until
// it is put in the cache; an algorithm is plain data.
unsafe impl Send for LtPlans {}
unsafe impl Sync for LtPlans {}

impl LtPlans {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, PlanCache>, CudaError> {
        (self.cache.lock()).map_err(|_| CudaError::unavailable("cuBLASLt plans poisoned"))
    }

    /// The cache, holding the plan of `s` (made on first use, outside the lock: its bucket's
    /// algorithm where cuBLASLt accepts it, else its own heuristic's; None: cuBLASLt has none).
    fn with_plan(
        &self,
        handle: sys::cublasLtHandle_t,
        s: Shape,
        workspace_bytes: usize,
    ) -> Result<std::sync::MutexGuard<'_, PlanCache>, CudaError> {
        let bucket = {
            let cache = self.lock()?;
            if cache.plans.contains_key(&s) {
                return Ok(cache);
            }
            Shape {
                rows: bucket_rows(s.rows),
                ..s
            }
        };
        let known = self.lock()?.algos.get(&bucket).copied();
        let shared = match known {
            Some(algo) => algo,
            None => {
                let algo =
                    Plan::describe(bucket).and_then(|b| b.heuristic(handle, workspace_bytes));
                *self.lock()?.algos.entry(bucket).or_insert(algo)
            }
        };
        let plan = Plan::describe(s).and_then(|mut plan| {
            plan.algo = match shared.filter(|a| plan.accepts(handle, a, workspace_bytes)) {
                Some(algo) => algo,
                None => plan.heuristic(handle, workspace_bytes)?,
            };
            Some(plan)
        });
        let mut cache = self.lock()?;
        cache.plans.entry(s).or_insert(plan);
        Ok(cache)
    }
}

/// What [`Lt::matmul_tuned`] did with a plain product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TunedRun {
    /// Enqueued on the algorithm timing chose.
    Enqueued,
    /// Nothing: timing found cuBLAS's default faster, which the caller runs.
    Default,
    /// Nothing: no timed plan took the product (the shape is not timed yet, or its plan
    /// declined these operands); the caller runs cuBLAS's default.
    NotRun,
}

/// A cuBLASLt handle and the GPU's plans; the caller owns the workspace.
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: (u64, usize),
    plans: Arc<LtPlans>,
}

// SAFETY: the handle is used by one session, from one thread at a time.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: created by `Lt::new`, destroyed once; the plans' objects do not depend on it.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Lt {
    /// None when libcublasLt cannot be loaded (cudarc panics then) or refuses a handle.
    pub(crate) fn new(workspace: (u64, usize), plans: Arc<LtPlans>) -> Option<Lt> {
        let handle = std::panic::catch_unwind(lt::create_handle).ok()?.ok()?;
        Some(Lt {
            handle,
            workspace,
            plans,
        })
    }

    /// Enqueue the plain product of `shape` (`D = W x`, no bias) on `stream` where the shape
    /// has an algorithm chosen by timing, by this session or another (the plans are the
    /// GPU's); what was done.
    ///
    /// # Safety
    /// As [`Lt::matmul`].
    pub(crate) unsafe fn matmul_tuned(
        &self,
        stream: sys::cudaStream_t,
        shape: Shape,
        (w, x, dst): (u64, u64, u64),
    ) -> Result<TunedRun, CudaError> {
        let cache = self.plans.lock()?;
        let plan = match (cache.tuned.get(&shape), cache.plans.get(&shape)) {
            (None, _) => return Ok(TunedRun::NotRun),
            (Some(None), _) => return Ok(TunedRun::Default),
            (Some(Some(_)), Some(Some(plan))) => plan,
            (Some(Some(_)), _) => return Ok(TunedRun::NotRun),
        };
        if output_overlaps_input(&shape, x, dst) {
            return Err(CudaError::Bounds(
                "cuBLASLt product: its output overlaps its input",
            ));
        }
        // SAFETY: the caller vouches for the device pointers; the plan is alive (the lock is
        // held).
        match unsafe { self.enqueue(stream, plan, &plan.algo, shape, (w, x, 0, dst)) }? {
            true => Ok(TunedRun::Enqueued),
            false => Ok(TunedRun::NotRun),
        }
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
        let cache = (self.plans).with_plan(self.handle, shape, self.workspace.1)?;
        let Some(Some(plan)) = cache.plans.get(&shape) else {
            return Ok(false);
        };
        // SAFETY: the caller vouches for the device pointers; the plan is alive (the lock is
        // held).
        unsafe { self.enqueue(stream, plan, &plan.algo, shape, (w, x, bias, dst)) }
    }

    /// Enqueue `plan`'s product with `algo`. Ok(false): its bias could not be set.
    ///
    /// # Safety
    /// As [`Lt::matmul`]; `plan` is not used by another thread meanwhile.
    unsafe fn enqueue(
        &self,
        stream: sys::cudaStream_t,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        shape: Shape,
        (w, x, bias, dst): (u64, u64, u64, u64),
    ) -> Result<bool, CudaError> {
        let bias_ptr = bias as *const c_void;
        if shape.epilogue != Epilogue::None
            && !attr(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &bias_ptr,
            )
        {
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
                algo,
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
    fn row_buckets_are_powers_of_two_then_multiples_of_64() {
        let tops: Vec<usize> = [1, 2, 3, 5, 33, 64, 65, 128, 129, 200, 1000]
            .map(bucket_rows)
            .to_vec();
        assert_eq!(tops, [1, 2, 4, 8, 64, 64, 128, 128, 192, 256, 1024]);
        for rows in 1..3000 {
            let top = bucket_rows(rows);
            assert!(
                top >= rows && bucket_rows(top) == top,
                "{rows} in a bucket topped by {top}"
            );
        }
    }

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

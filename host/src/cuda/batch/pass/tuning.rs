//! The batched pass's cuBLAS products, each shape's algorithm chosen by timing: before a size's
//! graph is captured, every product shape a pass of that size can hand cuBLAS (the layers'
//! four over the split rows, the LM head's over the rows whose logits are wanted) is timed on
//! cuBLAS's default and on each algorithm cuBLASLt's heuristic offers, and the fastest is kept
//! ([`Blas::tune_gemm`]). The default picks by shape alone, and for the pass's few hundred
//! rows its pick can leave SMs idle.
//!
//! Not when batch-invariant: a timed choice may differ from one process to the next, and with
//! it a row's last bits.

use super::{head_ld, Pass, StepBuffers};
use crate::cuda::blas::cold_timer::ColdTimer;
use crate::cuda::blas::Blas;
use crate::cuda::buffer::{Bf16, DevPtr, Stored};
use crate::cuda::error::CudaError;
use crate::cuda::ops::Launcher;
use crate::engine::GpuDtype;

/// Timed runs of each algorithm for a shape (after an untimed one).
const TUNE_REPS: usize = 10;

/// One product shape of a pass: (rows, n, k).
pub(super) type ProductShape = (usize, usize, usize);

impl Pass {
    /// Whether the pass's products are tuned at all (bf16, not batch-invariant, the switch).
    pub(super) fn tunes_products(&self) -> bool {
        let gpu = &self.exec.gpu;
        self.exec.dtype == GpuDtype::Bf16
            && !gpu.batch_invariant()
            && gpu.measurement().gemm_tuning
            && gpu.measurement().cublaslt
    }

    /// Tune the product shapes a pass of `padded` rows with an LM head over `logit_rows` can
    /// give cuBLAS, those not tuned before. Outside a capture: it synchronizes the stream. A
    /// failure leaves the shape on cuBLAS's default.
    pub(super) fn tune_products(&self, b: &mut StepBuffers, padded: usize, logit_rows: usize) {
        if !self.tunes_products() {
            return;
        }
        let cfg = self.exec.config;
        let (c, ld) = (cfg.n_embd, head_ld(cfg.vocab_size));
        let Some(layer) = self.exec.weights.layers.first() else {
            return;
        };
        let wte = self.exec.weights.wte.ptr();
        // split rows: hi rows then lo rows; the head over the wanted rows' hi (and lo) rows,
        // or over all split rows at once when every row is wanted
        let rows = 2 * padded;
        let head_rows = if logit_rows < padded {
            logit_rows
        } else {
            rows
        };
        let shapes: [(DevPtr<Stored>, ProductShape, bool); 5] = [
            (layer.qkv_w.ptr(), (rows, 3 * c, c), false),
            (layer.proj_w.ptr(), (rows, c, c), false),
            (layer.fc_w.ptr(), (rows, 4 * c, c), false),
            (layer.fc_proj_w.ptr(), (rows, c, 4 * c), false),
            (wte, (head_rows, ld, c), true),
        ];
        let x: DevPtr<Bf16> = b.act.ptr().cast();
        let (tmp, head) = (b.blas.tmp.ptr(), b.head.ptr());
        let mut timer = None;
        for (w, shape, is_head) in shapes {
            if !b.tuned.insert(shape) {
                continue;
            }
            let timer = match &mut timer {
                Some(timer) => timer,
                None => match ColdTimer::new(b.stream(), TUNE_REPS) {
                    Ok(made) => timer.insert(made),
                    Err(e) => {
                        tracing::debug!("no timer to tune the batched products: {e}");
                        return;
                    }
                },
            };
            let (dst, ldc) = if is_head { (head, ld) } else { (tmp, shape.1) };
            if let Err(e) = tune(&b.blas, &b.launcher, timer, w, x, shape, (dst, ldc)) {
                tracing::debug!("tuning the batched product {shape:?} failed: {e}");
            }
        }
    }
}

/// Tune one shape and trace what was measured.
fn tune(
    blas: &Blas,
    l: &Launcher,
    timer: &mut ColdTimer,
    w: DevPtr<Stored>,
    x: DevPtr<Bf16>,
    shape: ProductShape,
    out: (DevPtr<f32>, usize),
) -> Result<(), CudaError> {
    let Some(t) = blas.tune_gemm(l, timer, w, x, shape, out)? else {
        return Ok(());
    };
    let (rows, n, k) = shape;
    tracing::debug!(
        rows,
        n,
        k,
        default_us = t.default_us,
        best_us = t.best_us.unwrap_or(f32::NAN),
        lt = t.lt,
        "batched product tuned"
    );
    Ok(())
}

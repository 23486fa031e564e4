//! The batched pass's plain bf16 products with algorithms chosen by timing: [`Blas::gemm`]
//! records each shape it meets without one (with its operands) and runs it on cuBLAS's
//! default; [`Blas::tune_products`] times cuBLASLt's candidates for those shapes beside the
//! default ([`super::lt::Lt::tune`]); from then on, and for shapes restored from a saved file,
//! `gemm` runs them through cuBLASLt on the kept algorithm, or on the default where it won.

use super::lt::{output_overlaps_input, Shape, Tuned, TunedRun};
use super::Blas;
use crate::cuda::buffer::{Act, DevPtr, Stored};
use crate::cuda::error::CudaError;
use crate::cuda::ops::Launcher;

/// The shapes [`Blas::gemm`] has met without a timed algorithm: every one, and those not yet
/// timed with the operands (weights, activations, output) each was first met with.
#[derive(Default)]
pub(super) struct Untuned {
    seen: std::collections::HashSet<Shape>,
    waiting: Vec<(Shape, (u64, u64, u64))>,
}

impl Blas {
    /// The same, its plain bf16 products ([`Blas::gemm`]) through cuBLASLt once
    /// [`Blas::tune_products`] (or a saved file, [`Blas::restore_tuned`]) has chosen their
    /// shape's algorithm by timing; cuBLAS's default until then.
    pub fn with_tuned_products(mut self) -> Blas {
        self.lt_products = self.lt.is_some();
        self
    }

    /// Time the candidates of every shape [`Blas::gemm`] has met untimed since the last call
    /// and keep each one's fastest ([`lt::Lt::tune`]), `runs` products a round, on the
    /// launcher's stream; from then on `gemm` runs those shapes through cuBLASLt. The outputs
    /// are overwritten. On an error the shapes not yet timed stay on cuBLAS's default.
    ///
    /// # Safety
    /// Every buffer and weight `gemm` was given since the last call must still be allocated,
    /// and its outputs must be scratch that nothing reads before writing (call it between
    /// passes, with the pass's buffers alive).
    pub unsafe fn tune_products(&self, l: &Launcher, runs: usize) -> Result<Vec<Tuned>, CudaError> {
        let Some(lt) = self.lt.as_ref() else {
            return Ok(Vec::new());
        };
        let shapes = std::mem::take(&mut self.untuned_lock()?.waiting);
        let mut tuned = Vec::with_capacity(shapes.len());
        for (shape, (w, x, dst)) in shapes {
            let (rows, n, k, ldc) = (shape.rows, shape.n, shape.k, shape.ldc);
            let mut default = || {
                // SAFETY: the recorded operands, as for `tune` below.
                unsafe { self.gemm_default(l, (w, x, dst), (rows, n, k), ldc, false) }?;
                Ok(true)
            };
            // SAFETY: recorded from `gemm`, whose checks the operands passed (an output
            // overlapping its input is never recorded); the caller vouches that they are
            // still allocated and that the output is scratch.
            let found = unsafe { lt.tune(l.stream(), shape, (w, x, 0, dst), runs, &mut default) }?;
            tuned.extend(found);
        }
        Ok(tuned)
    }

    /// Install the tuned algorithms saved at `path` for GPU `gpu` of `sms` SMs, so that
    /// [`Blas::tune_products`] does not time their shapes again; how many.
    pub fn restore_tuned(&self, path: &std::path::Path, gpu: &str, sms: usize) -> usize {
        let Some(lt) = self.lt.as_ref().filter(|_| self.lt_products) else {
            return 0;
        };
        lt.restore_tuned(path, gpu, sms).len()
    }

    /// Save every tuned algorithm of the GPU's plans to `path`, for [`Blas::restore_tuned`].
    pub fn save_tuned(&self, path: &std::path::Path, gpu: &str, sms: usize) -> std::io::Result<()> {
        match self.lt.as_ref().filter(|_| self.lt_products) {
            Some(lt) => lt.save_tuned(path, gpu, sms),
            None => Ok(()),
        }
    }

    fn untuned_lock(&self) -> Result<std::sync::MutexGuard<'_, Untuned>, CudaError> {
        (self.untuned.lock()).map_err(|_| CudaError::unavailable("cuBLASLt shapes poisoned"))
    }

    /// `gemm`'s product through cuBLASLt where its shape has a timed algorithm: Ok(true) when
    /// enqueued. Otherwise Ok(false) (the caller runs cuBLAS's default); a shape not yet
    /// timed is recorded for the next [`Blas::tune_products`] unless it accumulates or its
    /// output overlaps its input.
    /// The caller has checked the operands' sizes.
    pub(super) fn tuned_product(
        &self,
        l: &Launcher,
        w: DevPtr<Stored>,
        x: Act,
        (rows, n, k): (usize, usize, usize),
        (dst, ldc): (DevPtr<f32>, usize),
        accumulate: bool,
    ) -> Result<bool, CudaError> {
        let Some(lt) = self.lt.as_ref().filter(|_| self.lt_products) else {
            return Ok(false);
        };
        let shape = Shape::plain((rows, n, k), ldc, accumulate);
        let operands = (w.addr(), x.addr(), dst.addr());
        let cu = l.stream().cu_stream() as _;
        // SAFETY: W (n*k), x (rows*k) and the destination (rows*ldc, checked by the caller)
        // are the caller's, alive until the stream has run the product.
        match unsafe { lt.matmul_tuned(cu, shape, operands) }? {
            TunedRun::Enqueued => return Ok(true),
            TunedRun::Default => return Ok(false),
            TunedRun::NotRun => {}
        }
        if !accumulate && !output_overlaps_input(&shape, operands.1, operands.2) {
            let mut untuned = self.untuned_lock()?;
            if untuned.seen.insert(shape) {
                untuned.waiting.push((shape, operands));
            }
        }
        Ok(false)
    }
}

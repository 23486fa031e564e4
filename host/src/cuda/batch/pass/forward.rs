//! The kernels of one batched pass over a row table: every row's embedding, then each layer
//! (the products over all rows, each row's key and value appended to its own context's cache,
//! attention of each row over its own context's cache in one launch), then the LM head writing
//! each context's last row's logits with their argmax.
//!
//! bf16 product inputs are split into hi and lo halves, so that the rows see their activations
//! to ~16 bits as the one-row kernels do (in cuBLAS's products, the rows of long prompts'
//! chunks past the table's `lo_rows` take their hi halves alone, as a prefill's rows). Steps of up to [`crate::cuda::Gpu::batch_gemm_rows`]
//! rows (64 on sm_90+; every step when batch-invariant) run the products on our tensor-core
//! kernel where it fits and suits the shape, cuBLAS elsewhere and for the LM head.

use super::{head_ld, Pass, StepBuffers};
use crate::cuda::buffer::{Act, DevPtr, Stored};
use crate::cuda::error::CudaError;
use crate::cuda::ops::batch::{BatchAttention, BatchEpilogue, ResidualNorm, RowTable, Update};
use crate::cuda::ops::batch_gemm::{batch_gemm_plan, batch_gemm_suits};
use crate::cuda::ops::{Epilogue, Norm};
use crate::cuda::weights::DevLayer;
use crate::engine::GpuDtype;
use crate::switches::Skip;

impl Pass {
    /// The kernels of one batched pass over the table's rows, the attention in `splits` spans
    /// (`prompts`: some context has several rows, which read each other's keys).
    pub(crate) fn forward(
        &self,
        b: &StepBuffers,
        t: &RowTable,
        splits: usize,
        prompts: bool,
    ) -> Result<(), CudaError> {
        let pass = PassKernels::new(self, b, t);
        pass.embed()?;
        for (i, lw) in self.exec.weights.layers.iter().enumerate() {
            pass.layer(i, lw, splits, prompts)?;
        }
        // `WASI_NN_HOST_SKIP` leaves parts out, to measure what the rest costs (wrong results)
        if pass.skip.head {
            return Ok(());
        }
        pass.head()
    }
}

/// What every kernel of one pass shares.
struct PassKernels<'a> {
    pass: &'a Pass,
    b: &'a StepBuffers,
    t: &'a RowTable,
    /// The product inputs: split bf16 rows, or f32.
    act: Act,
    split: bool,
    tmp: DevPtr<f32>,
    x: DevPtr<f32>,
    skip: &'a Skip,
    /// The step is small enough for our product kernel.
    ours: bool,
    invariant: bool,
    sms: usize,
}

impl<'a> PassKernels<'a> {
    fn new(pass: &'a Pass, b: &'a StepBuffers, t: &'a RowTable) -> Self {
        let gpu = &pass.exec.gpu;
        let split = pass.exec.dtype == GpuDtype::Bf16;
        let act = match split {
            true => Act::Bf16(b.act.ptr().cast()),
            false => Act::F32(b.act.ptr()),
        };
        Self {
            pass,
            b,
            t,
            act,
            split,
            tmp: b.blas.tmp.ptr(),
            x: b.x.ptr(),
            skip: &gpu.measurement().skip,
            ours: t.rows <= gpu.batch_gemm_rows(),
            invariant: gpu.batch_invariant(),
            sms: gpu.sms(),
        }
    }

    /// The product of the rows with `w` (`n_out` x `k`) into `tmp`: on our tensor-core kernel
    /// where it fits (bf16, a small step) and suits the shape (small weights, a plan that fills
    /// the GPU), or batch-invariant wherever it fits; cuBLAS otherwise. Each product's K is cut
    /// the same way at every step size, so a row's results do not depend on the rows beside
    /// it; the hi and lo rows are summed in the kernel. Returns how the next kernel reads the
    /// product: (its input was split, planes).
    fn product(
        &self,
        w: DevPtr<Stored>,
        n_out: usize,
        k: usize,
    ) -> Result<(bool, usize), CudaError> {
        let (l, n) = (&self.b.launcher, self.t.rows);
        if let (true, Act::Bf16(a)) = (self.ours, self.act) {
            if self.invariant || batch_gemm_suits((n_out, k), self.sms) {
                let plan = batch_gemm_plan(n, n_out, k, self.sms, self.tmp.len());
                if let Some(ran) = l.batch_gemm(w, a, (n, n_out, k), self.tmp, plan) {
                    return ran.map(|()| (false, plan.planes));
                }
            }
        }
        // split: the hi rows, then the lo rows of the table's first `lo_rows` rows
        let product_rows = if self.split { n + self.t.lo_rows } else { n };
        let out = (self.tmp, n_out);
        (self.b.blas)
            .gemm(l, w, self.act, (product_rows, n_out, k), out, false)
            .map(|()| (self.split, 1))
    }

    /// x += the product (its `parts` planes) and its bias, then the LayerNorm `norm` into act.
    fn residual_norm(
        &self,
        bias: DevPtr<Stored>,
        norm: Norm,
        (split, parts): (bool, usize),
    ) -> Result<(), CudaError> {
        if self.skip.ln {
            return Ok(());
        }
        let update = Update::Product {
            tmp: self.tmp,
            bias,
            split,
            parts,
        };
        self.update_and_norm(update, norm)
    }

    /// x updated (`update`: the embedding, or a product and its bias added), then the
    /// LayerNorm `norm` of x into act.
    fn update_and_norm(&self, update: Update, norm: Norm) -> Result<(), CudaError> {
        let (x, out) = (self.x, self.act);
        let args = ResidualNorm {
            x,
            update,
            norm,
            out,
        };
        self.b.launcher.batch_residual_norm(self.t, args)
    }

    /// Every row's embedding, and the first LayerNorm.
    fn embed(&self) -> Result<(), CudaError> {
        let w = &self.pass.exec.weights;
        let update = Update::Embed {
            wte: w.wte.ptr(),
            wpe: w.wpe.ptr(),
        };
        let norm = w.layers.first().map_or(w.lnf(), |lw| lw.ln1());
        self.update_and_norm(update, norm)
    }

    /// Layer `i`: attention, projection, MLP, each with its residual and the next LayerNorm.
    fn layer(
        &self,
        i: usize,
        lw: &DevLayer,
        splits: usize,
        prompts: bool,
    ) -> Result<(), CudaError> {
        let (l, t, c) = (&self.b.launcher, self.t, self.pass.exec.config.n_embd);
        let w = &self.pass.exec.weights;
        let (qkv_split, qkv_parts) = self.product(lw.qkv_w.ptr(), 3 * c, c)?;
        if prompts {
            // rows of one prompt read each other's keys: all appended first
            l.batch_append_kv(t, self.tmp, lw.qkv_b.ptr(), (qkv_split, qkv_parts), i)?;
        }
        let attention = BatchAttention {
            out: self.act,
            tmp: self.tmp,
            bias: lw.qkv_b.ptr(),
            split: qkv_split,
            parts: qkv_parts,
            partial: self.b.partial.ptr(),
            layer: i,
            splits,
            span: self.pass.span(),
            append: !prompts,
        };
        if !self.skip.attn {
            l.batch_attention(t, attention)?;
        }
        let parts = self.product(lw.proj_w.ptr(), c, c)?;
        self.residual_norm(lw.proj_b.ptr(), lw.ln2(), parts)?;
        let (fc_split, fc_parts) = self.product(lw.fc_w.ptr(), 4 * c, c)?;
        let gelu = BatchEpilogue {
            out: self.act,
            tmp: self.tmp,
            bias: lw.fc_b.ptr(),
            n: 4 * c,
            epilogue: Epilogue::Gelu,
            split: fc_split,
            parts: fc_parts,
        };
        if !self.skip.epi {
            l.batch_epilogue(t, gelu)?;
        }
        let parts = self.product(lw.fc_proj_w.ptr(), c, 4 * c)?;
        let next_norm = w.layers.get(i + 1).map_or(w.lnf(), |next| next.ln1());
        self.residual_norm(lw.fc_proj_b.ptr(), next_norm, parts)
    }

    /// The LM head: each context's last row's logits and their argmax. Batch-invariant, on our
    /// kernel too (one slice: its many column tiles fill the GPU), so a row's logits do not
    /// depend on the step either.
    fn head(&self) -> Result<(), CudaError> {
        let (l, t, cfg) = (&self.b.launcher, self.t, self.pass.exec.config);
        let (c, n) = (cfg.n_embd, t.rows);
        let wte = self.pass.exec.weights.wte.ptr();
        let (head, ld) = (self.b.head.ptr(), head_ld(cfg.vocab_size));
        if let (true, Act::Bf16(a)) = (self.ours && self.invariant, self.act) {
            let plan = batch_gemm_plan(n, ld, c, self.sms, head.len());
            if plan.planes == 1 {
                if let Some(ran) = l.batch_gemm(wte, a, (n, ld, c), head, plan) {
                    ran?;
                    return l.batch_logits(t, head, ld, false);
                }
            }
        }
        // the rows whose logits are wanted come first: the product over those alone; split
        // rows as their hi halves, then their lo halves `n` rows further on, where
        // `batch_logits` reads them (one product over both when every row is wanted)
        let (m, blas) = (t.logit_rows, &self.b.blas);
        match self.act {
            Act::Bf16(a) if m < n => {
                blas.gemm(l, wte, Act::Bf16(a), (m, ld, c), (head, ld), false)?;
                let (a_lo, head_lo) = (Act::Bf16(a.skip(n * c)), head.skip(n * ld));
                blas.gemm(l, wte, a_lo, (m, ld, c), (head_lo, ld), false)?;
            }
            Act::Bf16(_) => blas.gemm(l, wte, self.act, (2 * n, ld, c), (head, ld), false)?,
            Act::F32(_) => blas.gemm(l, wte, self.act, (m, ld, c), (head, ld), false)?,
        }
        l.batch_logits(t, head, ld, self.split)
    }
}

//! The layers of a prefill, on the path the session's [`super::PrefillPlan`] names.
//!
//! - Through cuBLAS ([`CudaSession::prefill_layers_blas`]): LayerNorm and the attention and
//!   GELU epilogues write the next product's input directly (bf16 in bf16 mode); cuBLASLt
//!   fuses the biases where it has a plan, and the QKV product's bf16 rows feed the
//!   tensor-core attention.
//! - On our tiled kernel ([`CudaSession::prefill_layers_tiled`]), f32 activations.
//! - The causal attention of the new rows on the plan's kernel
//!   ([`CudaSession::prefill_attention`]).

use super::CudaSession;
use crate::cuda::blas::{Blas, LtBias, LtEpilogue, Shape};
use crate::cuda::buffer::{Act, Bf16, DevPtr, Stored};
use crate::cuda::error::CudaError;
use crate::cuda::ops::attention::{PrefillAttention, Start};
use crate::cuda::ops::embed_norm::LayerNorm;
use crate::cuda::ops::matmul::{GemmEpilogue, Matmul};
use crate::cuda::ops::{Epilogue, KvLayer, Norm};
use crate::cuda::weights::DevLayer;
use crate::engine::GpuDtype;

impl CudaSession {
    /// A LayerNorm (left out under `WASI_NN_HOST_SKIP=ln`).
    pub(super) fn layernorm(
        &self,
        out: Act,
        x: DevPtr<f32>,
        norm: Norm,
        pre_bias: Option<DevPtr<Stored>>,
        rows: usize,
    ) -> Result<(), CudaError> {
        if self.skip().ln {
            return Ok(());
        }
        self.launcher.layernorm(LayerNorm {
            out,
            x,
            norm,
            pre_bias,
            rows,
        })
    }

    /// The activations a product of width C reads in the weights' type: bf16 rows in bf16
    /// mode, h in f32.
    pub(super) fn product_input(&self, blas: &Blas) -> Act {
        match self.model.dtype {
            GpuDtype::Bf16 => Act::Bf16(blas.x_bf16.ptr()),
            GpuDtype::F32 => Act::F32(self.h.ptr()),
        }
    }

    /// The layers of a prefill through cuBLAS: LayerNorm and the attention and GELU epilogues
    /// write the next GEMM's input directly (bf16 in bf16 mode); the projections accumulate
    /// into the residual stream (beta = 1), with their bias fused (cuBLASLt) or added by the
    /// next LayerNorm. Returns the bias still pending on `x` (the last layer's MLP projection
    /// bias), if any.
    pub(super) fn prefill_layers_blas(
        &self,
        blas: &Blas,
        n: usize,
        start: Start,
    ) -> Result<Option<DevPtr<Stored>>, CudaError> {
        let a_4c = match self.model.dtype {
            GpuDtype::Bf16 => Act::Bf16(blas.fc_bf16.ptr()),
            GpuDtype::F32 => Act::F32(self.fc.ptr()),
        };
        let host_start = match start {
            Start::Host(s) => s,
            Start::Device(_) => 0,
        };
        let rows = BlasRows {
            n,
            start,
            host_start,
            a_c: self.product_input(blas),
            a_4c,
        };
        let x = self.x.ptr();
        let mut pending = None;
        for (i, lw) in self.model.weights.layers.iter().enumerate() {
            let kv = self.kv_layer(i);
            self.layernorm(rows.a_c, x, lw.ln1(), pending, n)?;
            let pre_bias = self.attention_blas(blas, lw, kv, rows)?;
            self.layernorm(rows.a_c, x, lw.ln2(), pre_bias, n)?;
            pending = self.mlp_blas(blas, lw, rows)?;
        }
        Ok(pending)
    }

    /// A layer's attention through cuBLAS, from the LayerNorm's output in `a_c` to the
    /// projection accumulated into `x`. Returns the projection's bias when it is still to be
    /// added (by the next LayerNorm).
    fn attention_blas(
        &self,
        blas: &Blas,
        lw: &DevLayer,
        kv: KvLayer,
        rows: BlasRows,
    ) -> Result<Option<DevPtr<Stored>>, CudaError> {
        let BlasRows {
            n,
            start,
            host_start,
            a_c,
            ..
        } = rows;
        let c = self.model.config.n_embd;
        let l = &self.launcher;
        let skip = self.skip();
        let (x, tmp) = (self.x.ptr(), blas.tmp.ptr());
        // QKV with its bias through cuBLASLt into bf16 rows, the tensor-core attention
        // reading queries, keys and values from them and appending the keys and values to
        // the cache; else a product, then a pass adding the bias and scattering keys and
        // values into the cache
        let qkv_rows = Act::Bf16(blas.qkv_bf16.ptr());
        let qkv_shape = Shape::new((n, 3 * c, c), LtEpilogue::Bias);
        let (qkv_w, qkv_b) = (lw.qkv_w.ptr(), LtBias::Stored(lw.qkv_b.ptr()));
        let fresh = self.plan.fresh_kv
            && blas.lt_matmul(l, qkv_shape, qkv_w, bf16_in(a_c), qkv_b, qkv_rows)?;
        if !fresh && matches!(start, Start::Device(_)) {
            return Err(CudaError::unavailable(
                "no cuBLASLt plan for the QKV product: the prefill cannot be captured",
            ));
        }
        if !fresh {
            blas.gemm(l, qkv_w, a_c, (n, 3 * c, c), (tmp, 3 * c), false)?;
            self.epilogue(GemmEpilogue {
                out: Act::F32(self.qkv.ptr()),
                tmp,
                bias: lw.qkv_b.ptr(),
                rows: n,
                n: 3 * c,
                epilogue: Epilogue::Qkv,
                start: host_start,
                kv: Some(kv),
                out_stride: 3 * c,
            })?;
        }
        if !skip.pattn {
            let attention = PrefillAttention {
                out: a_c,
                kv,
                start,
                rows: n,
            };
            self.prefill_attention(attention, fresh.then(|| blas.qkv_bf16.ptr()))?;
        }
        // projection into the residual stream: with its bias (cuBLASLt), or the bias is
        // left to the next LayerNorm
        let mut pre_bias = Some(lw.proj_b.ptr());
        let proj_b32 = LtBias::F32(lw.proj_b32());
        if blas.lt_matmul(
            l,
            residual(n, c, c),
            lw.proj_w.ptr(),
            bf16_in(a_c),
            proj_b32,
            Act::F32(x),
        )? {
            pre_bias = None;
        } else {
            blas.gemm(l, lw.proj_w.ptr(), a_c, (n, c, c), (x, c), true)?;
        }
        Ok(pre_bias)
    }

    /// A layer's MLP through cuBLAS, from the LayerNorm's output in `a_c` to the projection
    /// accumulated into `x`. Returns the projection's bias when it is still to be added.
    fn mlp_blas(
        &self,
        blas: &Blas,
        lw: &DevLayer,
        rows: BlasRows,
    ) -> Result<Option<DevPtr<Stored>>, CudaError> {
        let BlasRows {
            n,
            host_start,
            a_c,
            a_4c,
            ..
        } = rows;
        let c = self.model.config.n_embd;
        let l = &self.launcher;
        let (x, tmp) = (self.x.ptr(), blas.tmp.ptr());
        let gelu = Shape::new((n, 4 * c, c), LtEpilogue::GeluBias);
        let fc_b = LtBias::Stored(lw.fc_b.ptr());
        if !blas.lt_matmul(l, gelu, lw.fc_w.ptr(), bf16_in(a_c), fc_b, a_4c)? {
            blas.gemm(l, lw.fc_w.ptr(), a_c, (n, 4 * c, c), (tmp, 4 * c), false)?;
            self.epilogue(GemmEpilogue {
                out: a_4c,
                tmp,
                bias: lw.fc_b.ptr(),
                rows: n,
                n: 4 * c,
                epilogue: Epilogue::Gelu,
                start: host_start,
                kv: None,
                out_stride: 4 * c,
            })?;
        }
        let fc_proj_b32 = LtBias::F32(lw.fc_proj_b32());
        let fp_w = lw.fc_proj_w.ptr();
        if blas.lt_matmul(
            l,
            residual(n, c, 4 * c),
            fp_w,
            bf16_in(a_4c),
            fc_proj_b32,
            Act::F32(x),
        )? {
            Ok(None)
        } else {
            blas.gemm(l, fp_w, a_4c, (n, c, 4 * c), (x, c), true)?;
            Ok(Some(lw.fc_proj_b.ptr()))
        }
    }

    /// A GEMM epilogue pass (left out under `WASI_NN_HOST_SKIP=epi`).
    fn epilogue(&self, a: GemmEpilogue) -> Result<(), CudaError> {
        if self.skip().epi {
            return Ok(());
        }
        self.launcher.gemm_epilogue(a)
    }

    /// The layers of a prefill on our tiled matrix kernel (no cuBLAS), f32 activations.
    pub(super) fn prefill_layers_tiled(&self, n: usize, start: usize) -> Result<(), CudaError> {
        let c = self.model.config.n_embd;
        let l = &self.launcher;
        let (x, h, fc) = (self.x.ptr(), self.h.ptr(), self.fc.ptr());
        let product = |out, x, w, b, n_out, k, epilogue, kv, stride| {
            if self.skip().gemm {
                return Ok(());
            }
            l.matmul(Matmul {
                out,
                x,
                w,
                bias: Some(b),
                rows: n,
                n: n_out,
                k,
                epilogue,
                start,
                kv,
                out_stride: stride,
            })
        };
        for (i, lw) in self.model.weights.layers.iter().enumerate() {
            let kv = self.kv_layer(i);
            self.layernorm(Act::F32(h), x, lw.ln1(), None, n)?;
            let (qkv_w, qkv_b) = (lw.qkv_w.ptr(), lw.qkv_b.ptr());
            product(
                self.qkv.ptr(),
                h,
                qkv_w,
                qkv_b,
                3 * c,
                c,
                Epilogue::Qkv,
                Some(kv),
                3 * c,
            )?;
            if !self.skip().pattn {
                let attention = PrefillAttention {
                    out: Act::F32(h),
                    kv,
                    start: Start::Host(start),
                    rows: n,
                };
                self.prefill_attention(attention, None)?;
            }
            let (proj_w, proj_b) = (lw.proj_w.ptr(), lw.proj_b.ptr());
            product(x, h, proj_w, proj_b, c, c, Epilogue::Residual, None, c)?;
            self.layernorm(Act::F32(h), x, lw.ln2(), None, n)?;
            let (fc_w, fc_b) = (lw.fc_w.ptr(), lw.fc_b.ptr());
            product(fc, h, fc_w, fc_b, 4 * c, c, Epilogue::Gelu, None, 4 * c)?;
            let (fp_w, fp_b) = (lw.fc_proj_w.ptr(), lw.fc_proj_b.ptr());
            product(x, fc, fp_w, fp_b, c, 4 * c, Epilogue::Residual, None, c)?;
        }
        Ok(())
    }

    /// Causal attention of new rows on the plan's kernel: tensor cores (from the bf16 QKV
    /// rows `fresh`, or from the cache), else tiled, else one block per row; a bf16 output
    /// without tensor cores goes through h and a conversion.
    fn prefill_attention(
        &self,
        a: PrefillAttention,
        fresh: Option<DevPtr<Bf16>>,
    ) -> Result<(), CudaError> {
        let l = &self.launcher;
        if self.plan.tensor_cores {
            return match fresh {
                Some(rows) => l.prefill_attention_fresh(a, rows),
                None => l.prefill_attention_mma(a, self.qkv.ptr()),
            };
        }
        if fresh.is_some() || matches!(a.start, Start::Device(_)) {
            return Err(CudaError::unavailable(
                "keys and values from the QKV rows, or the first position from device memory, need the tensor-core attention",
            ));
        }
        if let Act::Bf16(out) = a.out {
            let h = self.h.ptr();
            self.prefill_attention(
                PrefillAttention {
                    out: Act::F32(h),
                    ..a
                },
                None,
            )?;
            return l.to_bf16(out, h, a.rows * self.model.config.n_embd);
        }
        if self.plan.tiled_attention {
            l.prefill_attention_tiled(a, self.qkv.ptr())
        } else {
            l.prefill_attention_plain(a, self.qkv.ptr())
        }
    }
}

/// What every layer of one prefill through cuBLAS works on.
#[derive(Clone, Copy)]
struct BlasRows {
    /// New rows, at positions `start..`.
    n: usize,
    start: Start,
    /// The first position as the epilogue passes take it (0 when `start` is in device
    /// memory).
    host_start: usize,
    /// The input of the products of width C and of the MLP's projection (bf16 in bf16 mode).
    a_c: Act,
    a_4c: Act,
}

/// A product's input as cuBLASLt takes it, as bf16 rows (f32 rows only reinterpreted:
/// cuBLASLt runs in bf16 mode alone, where the inputs are bf16).
fn bf16_in(a: Act) -> DevPtr<Bf16> {
    match a {
        Act::Bf16(p) => p,
        Act::F32(p) => p.cast(),
    }
}

/// A projection of `k` inputs accumulated into the residual stream's `n` rows of `c`.
fn residual(n: usize, c: usize, k: usize) -> Shape {
    Shape {
        accumulate: true,
        ..Shape::new((n, c, k), LtEpilogue::Bias)
    }
}

//! The model's weights on the GPU, uploaded once per graph: every tensor in the executor's
//! dtype (f32, or bf16 rounded to nearest even), plus f32 copies of the projections' biases
//! for the cuBLASLt products with an f32 result.

use super::buffer::{Bf16, DevBuf, DevPtr, Stored};
use super::error::CudaError;
use super::ops::matvec::Matvec;
use super::ops::{Epilogue, Norm};
use crate::engine::GpuDtype;
use crate::model::{Gpt2Config, Gpt2Weights};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// One weight tensor on the GPU and the allocation that owns it.
pub struct DevTensor {
    ptr: DevPtr<Stored>,
    _storage: Storage,
}

/// The allocation a [`DevTensor`] owns (held, never read).
#[allow(dead_code)]
enum Storage {
    F32(DevBuf<f32>),
    Bf16(DevBuf<Bf16>),
}

impl DevTensor {
    /// `values` on the device as `dtype`.
    pub fn upload(
        stream: &Arc<CudaStream>,
        values: &[f32],
        dtype: GpuDtype,
    ) -> Result<Self, CudaError> {
        Self::upload_padded(stream, values, values.len(), dtype)
    }

    /// `values` on the device as `dtype`, followed by zeros up to `len` elements.
    pub fn upload_padded(
        stream: &Arc<CudaStream>,
        values: &[f32],
        len: usize,
        dtype: GpuDtype,
    ) -> Result<Self, CudaError> {
        const WHAT: &str = "uploading weights";
        let len = len.max(values.len());
        Ok(match dtype {
            GpuDtype::F32 => {
                let buf = if len == values.len() {
                    DevBuf::from_host(stream, values, WHAT)?
                } else {
                    let mut padded = Vec::with_capacity(len);
                    padded.extend_from_slice(values);
                    padded.resize(len, 0.0);
                    DevBuf::from_host(stream, &padded, WHAT)?
                };
                DevTensor {
                    ptr: DevPtr::new(buf.ptr().addr(), len),
                    _storage: Storage::F32(buf),
                }
            }
            GpuDtype::Bf16 => {
                let mut bits: Vec<Bf16> = Vec::with_capacity(len);
                bits.extend(values.iter().map(|v| half::bf16::from_f32(*v).to_bits()));
                bits.resize(len, 0);
                let buf = DevBuf::from_host(stream, &bits, WHAT)?;
                DevTensor {
                    ptr: DevPtr::new(buf.ptr().addr(), len),
                    _storage: Storage::Bf16(buf),
                }
            }
        })
    }

    /// The tensor as a view (its length in elements).
    pub fn ptr(&self) -> DevPtr<Stored> {
        self.ptr
    }

    /// An f32 tensor's view as f32.
    fn ptr_f32(&self) -> DevPtr<f32> {
        DevPtr::new(self.ptr.addr(), self.ptr.len())
    }
}

/// One transformer block's weights.
pub struct DevLayer {
    pub ln1_w: DevTensor,
    pub ln1_b: DevTensor,
    pub qkv_w: DevTensor,
    pub qkv_b: DevTensor,
    pub proj_w: DevTensor,
    pub proj_b: DevTensor,
    pub ln2_w: DevTensor,
    pub ln2_b: DevTensor,
    pub fc_w: DevTensor,
    pub fc_b: DevTensor,
    pub fc_proj_w: DevTensor,
    pub fc_proj_b: DevTensor,
    /// The projections' biases in f32 (as stored, i.e. bf16-rounded in bf16 mode), for the
    /// cuBLASLt products with an f32 result (it takes no bf16 bias there).
    proj_b32: DevTensor,
    fc_proj_b32: DevTensor,
}

impl DevLayer {
    pub fn ln1(&self) -> Norm {
        Norm {
            w: self.ln1_w.ptr(),
            b: self.ln1_b.ptr(),
        }
    }
    pub fn ln2(&self) -> Norm {
        Norm {
            w: self.ln2_w.ptr(),
            b: self.ln2_b.ptr(),
        }
    }
    pub fn proj_b32(&self) -> DevPtr<f32> {
        self.proj_b32.ptr_f32()
    }
    pub fn fc_proj_b32(&self) -> DevPtr<f32> {
        self.fc_proj_b32.ptr_f32()
    }
}

/// Rows of the LM head's products over several positions: the vocabulary rounded up to a
/// multiple of 64 (`wte` has zero rows past the vocabulary up to it).
pub fn head_rows(vocab: usize) -> usize {
    vocab.div_ceil(64) * 64
}

/// Every weight of the model.
pub struct DevWeights {
    pub wte: DevTensor,
    pub wpe: DevTensor,
    pub layers: Vec<DevLayer>,
    pub lnf_w: DevTensor,
    pub lnf_b: DevTensor,
}

impl DevWeights {
    pub fn lnf(&self) -> Norm {
        Norm {
            w: self.lnf_w.ptr(),
            b: self.lnf_b.ptr(),
        }
    }

    /// The LM head over the row at `x` (final LayerNorm fused, tied to `wte`): logits into
    /// `logits`, their argmax key raised into `argmax_key`.
    pub fn lm_head(
        &self,
        config: Gpt2Config,
        logits: DevPtr<f32>,
        x: DevPtr<f32>,
        argmax_key: DevPtr<u64>,
    ) -> Matvec {
        Matvec {
            out: logits,
            x,
            w: self.wte.ptr(),
            bias: None,
            n: config.vocab_size,
            k: config.n_embd,
            norm: Some(self.lnf()),
            epilogue: Epilogue::Store,
            kv: None,
            argmax_key: Some(argmax_key),
            prefetch: None,
        }
    }

    /// Upload `weights` as `dtype` on `stream` (and wait for it).
    pub fn upload(
        stream: &Arc<CudaStream>,
        weights: &Gpt2Weights,
        dtype: GpuDtype,
    ) -> Result<Self, CudaError> {
        let up = |values: &[f32]| DevTensor::upload(stream, values, dtype);
        let up32 = |values: &[f32]| {
            let stored: Vec<f32> = match dtype {
                GpuDtype::F32 => values.to_vec(),
                GpuDtype::Bf16 => values
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect(),
            };
            DevTensor::upload(stream, &stored, GpuDtype::F32)
        };
        let layers = weights
            .layers
            .iter()
            .map(|l| {
                Ok(DevLayer {
                    ln1_w: up(&l.ln1_w)?,
                    ln1_b: up(&l.ln1_b)?,
                    qkv_w: up(&l.qkv_w)?,
                    qkv_b: up(&l.qkv_b)?,
                    proj_w: up(&l.proj_w)?,
                    proj_b: up(&l.proj_b)?,
                    ln2_w: up(&l.ln2_w)?,
                    ln2_b: up(&l.ln2_b)?,
                    fc_w: up(&l.fc_w)?,
                    fc_b: up(&l.fc_b)?,
                    fc_proj_w: up(&l.fc_proj_w)?,
                    fc_proj_b: up(&l.fc_proj_b)?,
                    proj_b32: up32(&l.proj_b)?,
                    fc_proj_b32: up32(&l.fc_proj_b)?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        // wte is read as the LM head's product too: its rows padded with zeros to
        // [`head_rows`] so that product's N is a multiple of 64 (cuBLAS then takes its Hopper
        // kernels; at N = 50257 it picked an sm75 one, 4-5x slower).
        let c = weights.config.n_embd;
        let wte_len = head_rows(weights.config.vocab_size) * c;
        let dev = DevWeights {
            wte: DevTensor::upload_padded(stream, &weights.wte, wte_len, dtype)?,
            wpe: up(&weights.wpe)?,
            layers,
            lnf_w: up(&weights.lnf_w)?,
            lnf_b: up(&weights.lnf_b)?,
        };
        use super::error::DriverContext;
        stream.synchronize().ctx("uploading weights")?;
        Ok(dev)
    }
}

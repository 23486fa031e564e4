//! The kernel table: every kernel of one weight dtype, looked up by name in the module
//! compiled for the GPU.

use super::attention::{self, valid_cluster};
use super::{batch, batch_gemm, persistent, DEFINES};
use crate::cuda::device::Gpu;
use crate::cuda::error::{CudaError, DriverContext};
use crate::cuda::nvrtc::cached_image;
use crate::engine::GpuDtype;
use cudarc::driver::CudaFunction;

/// The kernels of one weight dtype, looked up by name in the compiled module.
pub struct Kernels {
    pub(crate) embed: CudaFunction,
    pub(crate) layernorm: CudaFunction,
    pub(crate) matvec: CudaFunction,
    pub(crate) matmul: CudaFunction,
    pub(crate) att_partial: CudaFunction,
    pub(crate) att_combine: CudaFunction,
    pub(crate) decode_qkv_att: CudaFunction,
    pub(crate) att_prefill: CudaFunction,
    pub(crate) att_prefill_tiled: CudaFunction,
    pub(crate) att_prefill_mma: CudaFunction,
    pub(crate) att_prefill_fresh: CudaFunction,
    pub(crate) gemm_epilogue: CudaFunction,
    pub(crate) add_bias: CudaFunction,
    pub(crate) to_bf16: CudaFunction,
    pub(crate) batch_residual_norm: CudaFunction,
    pub(crate) batch_epilogue: CudaFunction,
    pub(crate) batch_attention: CudaFunction,
    /// Blocks of `batch_attention` the GPU runs at once, whole (four warps) and half (two),
    /// bf16 decode blocks; None where the driver did not say (whole blocks always).
    pub(crate) batch_attention_waves: Option<(usize, usize)>,
    pub(crate) batch_append_kv: CudaFunction,
    pub(crate) batch_att_combine: CudaFunction,
    pub(crate) batch_logits: CudaFunction,
    pub(crate) batch_feed: CudaFunction,
    pub(crate) draw_token: CudaFunction,
    pub(crate) draw_processed: CudaFunction,
    pub(crate) batch_draw: CudaFunction,
    /// `batch_gemm_bf16_n64` and `_n32` (64- and 32-column tiles), then their `_fold`
    /// forms (several K slices a block), where the GPU gives their blocks the shared memory
    /// they take.
    pub(crate) batch_gemm: Option<[CudaFunction; 4]>,
    /// The persistent decode kernel and the dynamic shared memory it may take (sm_90).
    pub(crate) persistent: Option<(CudaFunction, usize)>,
}

impl Kernels {
    /// The kernels for weights stored as `dtype`, from the GPU's module (compiled with our
    /// [`DEFINES`] at the first call).
    pub(crate) fn load(gpu: &Gpu, dtype: GpuDtype) -> Result<Self, CudaError> {
        let module = gpu.module(|gpu| {
            let kernels_dir = gpu.measurement().kernels_dir.as_deref();
            let settings = gpu.settings();
            let dirs = (
                settings.prebuilt_dir.as_deref(),
                settings.cache_dir.as_deref(),
            );
            let cubin = gpu.measurement().cubin;
            cached_image(gpu.compute_capability(), cubin, DEFINES, kernels_dir, dirs)
        })?;
        let suffix = match dtype {
            GpuDtype::F32 => "f32",
            GpuDtype::Bf16 => "bf16",
        };
        let f = |name: &str| Gpu::function(&module, name);
        let batch_attention = f(&format!("batch_attention_{suffix}"))?;
        // (the occupancy query needs the context current: a second dtype's load may run on a
        // thread that did not load the module)
        let batch_attention_waves = (gpu.ctx.bind_to_thread().ok())
            .and_then(|()| batch::attention_waves(&batch_attention, gpu.sms()));
        Ok(Self {
            embed: f(&format!("embed_{suffix}"))?,
            layernorm: f(&format!("layernorm_{suffix}"))?,
            matvec: f(&format!("matvec_{suffix}"))?,
            matmul: f(&format!("matmul_{suffix}"))?,
            att_partial: f(&format!("attention_decode_partial_{suffix}"))?,
            att_combine: f("attention_decode_combine")?,
            decode_qkv_att: {
                let func = f(&format!("decode_qkv_attention_{suffix}"))?;
                if (gpu.clusters.flatten()).is_some_and(|(n, t)| valid_cluster(n, t) && n > 8) {
                    // clusters above 8 blocks are allowed per kernel (sm_90 has up to 16)
                    use cudarc::driver::sys::CUfunction_attribute_enum as A;
                    func.set_attribute(A::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                        .ctx("cluster size")?;
                }
                func
            },
            att_prefill: f(&format!("attention_prefill_{suffix}"))?,
            att_prefill_tiled: f(&format!("attention_prefill_tiled_{suffix}"))?,
            att_prefill_mma: f("attention_prefill_mma")?,
            att_prefill_fresh: {
                let func = f("attention_prefill_fresh")?;
                if gpu.tensor_cores {
                    attention::allow_fresh_shared_memory(&func)?;
                }
                func
            },
            gemm_epilogue: f(&format!("gemm_epilogue_{suffix}"))?,
            add_bias: f(&format!("add_bias_{suffix}"))?,
            to_bf16: f("f32_to_bf16")?,
            batch_residual_norm: f(&format!("batch_residual_norm_{suffix}"))?,
            batch_epilogue: f(&format!("batch_epilogue_{suffix}"))?,
            batch_attention,
            batch_attention_waves,
            batch_append_kv: f(&format!("batch_append_kv_{suffix}"))?,
            batch_att_combine: f("batch_attention_combine")?,
            batch_logits: f("batch_logits")?,
            batch_feed: f("batch_feed")?,
            draw_token: f("draw_token")?,
            draw_processed: f("draw_processed")?,
            batch_draw: f("batch_draw")?,
            batch_gemm: {
                let funcs = [
                    f("batch_gemm_bf16_n64")?,
                    f("batch_gemm_bf16_n32")?,
                    f("batch_gemm_bf16_n64_fold")?,
                    f("batch_gemm_bf16_n32_fold")?,
                ];
                // GPUs with less shared memory a block than the kernel's stages take (sm_86:
                // 99 KiB) keep cuBLAS for every product
                let fits = gpu.tensor_cores
                    && (funcs.iter().enumerate()).all(|(i, func)| {
                        batch_gemm::allow_gemm_shared_memory(func, i % 2 == 0).is_ok()
                    });
                fits.then_some(funcs)
            },
            // opt-in: a GPU that will not set it up still loads the model (the graph runs)
            persistent: gpu.shared_optin().and_then(|optin| {
                let func = f(&format!("persistent_decode_{suffix}"));
                let set_up = func.and_then(|func| {
                    let limit = persistent::allow_persistent_shared_memory(&func, optin)?;
                    Ok((func, limit))
                });
                set_up
                    .inspect_err(|e| tracing::warn!("no persistent decode kernel: {e}"))
                    .ok()
            }),
        })
    }
}

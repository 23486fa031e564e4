//! The GPU: its context, the compiled kernel module, its capabilities, and [`Tuning`], the
//! run-time switches read once per process (`WASI_NN_HOST_*`, for measurements).

use super::error::{CudaError, DriverContext};
use super::ops::{attention, Kernels};
use crate::engine::GpuDtype;
use cudarc::driver::{CudaContext, CudaModule};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// Parts of a forward pass to leave out (`WASI_NN_HOST_SKIP=attn,qkv,proj,mlp,head` in the
/// decode graph, `gemm,pattn,ln,epi` in a prefill): a profiling aid; the results are then
/// wrong, only the time counts.
#[derive(Clone, Debug, Default)]
pub struct Skip {
    pub attn: bool,
    pub qkv: bool,
    pub proj: bool,
    pub mlp: bool,
    pub head: bool,
    pub gemm: bool,
    pub pattn: bool,
    pub ln: bool,
    pub epi: bool,
}

/// Every run-time switch, read once (see the README for what each is for).
#[derive(Clone, Debug)]
pub struct Tuning {
    /// Decode and prefill CUDA graphs (`WASI_NN_HOST_NO_GRAPH` turns them off).
    pub graphs: bool,
    /// Programmatic dependent launch on sm_90+ (`_NO_PDL`).
    pub pdl: bool,
    /// cuBLAS for prefill products (`_NO_CUBLAS`: our tiled kernel).
    pub cublas: bool,
    /// cuBLASLt for bf16 products with fused epilogues (`_NO_CUBLASLT`).
    pub cublaslt: bool,
    /// Tensor-core prefill attention in bf16 mode (`_NO_TC_ATTENTION`).
    pub tc_attention: bool,
    /// The tiled CUDA-core prefill attention (`_NO_TILED_ATTENTION`: one block per row).
    pub tiled_attention: bool,
    /// Tensor-core attention reading the QKV product's bf16 rows (`_NO_FRESH_KV`).
    pub fresh_kv: bool,
    /// The fused decode QKV + attention kernel on sm_90+ (`_NO_FUSED_ATTENTION`).
    pub fused_attention: bool,
    /// Blocks per head and threads of the fused decode kernel (`_DECODE_CLUSTER=8x256`).
    pub decode_cluster: Option<(u32, u32)>,
    pub skip: Skip,
    /// Our tensor-core kernel for the batched step's bf16 products instead of cuBLAS in
    /// steps of at most this many rows (`_BATCH_GEMM=ROWS`, 0 for cuBLAS everywhere; unset:
    /// [`Gpu::batch_gemm_rows`] decides).
    pub batch_gemm: Option<usize>,
    /// Steps run ahead for greedy contexts in batched steps (`_NO_RUN_AHEAD` turns it off).
    pub run_ahead: bool,
    /// A step launches its pass run ahead before the pass in flight ends, its tokens fed on
    /// the GPU (`_NO_EARLY_LAUNCH` makes it wait for that pass first).
    pub early_launch: bool,
    /// Each decode kernel asks L2 for up to this many bytes of the next kernel's weights
    /// while it runs (`_L2_PREFETCH=BYTES`, 0 turns it off; default 2 MiB).
    pub l2_prefetch: usize,
    /// Independent batchers ("lanes") the contexts are spread over, each with its own
    /// batched-step stream, so their passes run side by side on the GPU (`_BATCH_LANES=N`,
    /// 1 to 8; default 2).
    pub batch_lanes: usize,
    /// Contexts a lane takes before a new one goes to the next lane (`_LANE_FILL=N`; default
    /// 128): below that many streams all share one lane's steps.
    pub lane_fill: usize,
    /// Blocks of the batched attention the GPU runs in one wave, past which a step's rows are
    /// not cut into more spans (`_BATCH_WAVE=N`; 0: no limit; default 8 an SM).
    pub batch_wave: Option<usize>,
    /// How long a context waiting for a batched step spins before it parks
    /// (`_SPIN_US`, 0 by default).
    pub spin: std::time::Duration,
    /// A batched step waits for the last step's contexts to come back until shortly before the
    /// pass run ahead for them is expected to end on the GPU (by the time a step takes to
    /// launch its pass, and this much more), then runs with the contexts that are back
    /// (`_GATHER_MARGIN_US=N`, default 60). `_GATHER_MARGIN_US=all` waits for all of them (up
    /// to the pass's time from launch to end, at most 2 ms).
    pub gather_margin: Option<std::time::Duration>,
    /// Steps run ahead of a greedy guest at most (`_AHEAD_DEPTH=N`, 1 or 2; default 2): with
    /// 2, a context whose guest is not back when the next pass is launched still gets its
    /// next step in it.
    pub ahead_depth: usize,
    /// Compile the `.cu` files of this folder instead of the built-in ones
    /// (`WASI_NN_HOST_KERNELS=DIR`).
    pub kernels_dir: Option<PathBuf>,
    /// Batch-invariant batched steps (`_BATCH_INVARIANT`): a context's logits are the same
    /// bits whatever contexts share its steps, and alone (see [`Gpu::batch_invariant`]).
    pub batch_invariant: bool,
}

impl Tuning {
    pub fn from_env() -> Self {
        let off = |name: &str| std::env::var_os(format!("WASI_NN_HOST_{name}")).is_some();
        let decode_cluster = std::env::var("WASI_NN_HOST_DECODE_CLUSTER")
            .ok()
            .and_then(|v| {
                let (n, t) = v.split_once('x')?;
                Some((n.parse::<u32>().ok()?, t.parse::<u32>().ok()?))
            })
            .filter(|&(n, t)| {
                (2..=attention::DA_MAX_CLUSTER).contains(&n) && (t == 128 || t == 256)
            });
        let parts = std::env::var("WASI_NN_HOST_SKIP").unwrap_or_default();
        let has = |part: &str| parts.split(',').any(|s| s == part);
        Self {
            graphs: !off("NO_GRAPH"),
            pdl: !off("NO_PDL"),
            cublas: !off("NO_CUBLAS"),
            cublaslt: !off("NO_CUBLASLT"),
            tc_attention: !off("NO_TC_ATTENTION"),
            tiled_attention: !off("NO_TILED_ATTENTION"),
            fresh_kv: !off("NO_FRESH_KV"),
            fused_attention: !off("NO_FUSED_ATTENTION"),
            decode_cluster,
            skip: Skip {
                attn: has("attn"),
                qkv: has("qkv"),
                proj: has("proj"),
                mlp: has("mlp"),
                head: has("head"),
                gemm: has("gemm"),
                pattn: has("pattn"),
                ln: has("ln"),
                epi: has("epi"),
            },
            run_ahead: !off("NO_RUN_AHEAD"),
            early_launch: !off("NO_EARLY_LAUNCH"),
            l2_prefetch: std::env::var("WASI_NN_HOST_L2_PREFETCH")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(2 << 20),
            batch_lanes: std::env::var("WASI_NN_HOST_BATCH_LANES")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(2)
                .clamp(1, 8),
            lane_fill: std::env::var("WASI_NN_HOST_LANE_FILL")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(128)
                .max(1),
            batch_wave: std::env::var("WASI_NN_HOST_BATCH_WAVE")
                .ok()
                .and_then(|v| v.parse().ok()),
            batch_gemm: std::env::var("WASI_NN_HOST_BATCH_GEMM")
                .ok()
                .and_then(|v| v.parse().ok()),
            spin: std::time::Duration::from_micros(
                std::env::var("WASI_NN_HOST_SPIN_US")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            ),
            gather_margin: match std::env::var("WASI_NN_HOST_GATHER_MARGIN_US") {
                Ok(v) if v == "all" => None,
                v => Some(std::time::Duration::from_micros(
                    v.ok().and_then(|v| v.parse().ok()).unwrap_or(60),
                )),
            },
            ahead_depth: std::env::var("WASI_NN_HOST_AHEAD_DEPTH")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(2)
                .clamp(1, 2),
            kernels_dir: std::env::var_os("WASI_NN_HOST_KERNELS").map(PathBuf::from),
            batch_invariant: off("BATCH_INVARIANT"),
        }
    }
}

/// Rows of a batched step up to which its products run on our kernel by default (sm_90+).
const BATCH_GEMM_ROWS: usize = 64;

/// The GPU and its compiled kernels, shared by every graph in the process.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    name: String,
    pub(crate) tuning: Tuning,
    /// Programmatic dependent launch (sm_90+, unless switched off).
    pub(crate) pdl: bool,
    /// bf16 tensor-core instructions (mma.sync, sm_80+).
    pub(crate) tensor_cores: bool,
    /// Thread-block clusters (sm_90+): decode's LayerNorm, QKV and attention as one kernel per
    /// layer, a cluster per head; `Some(chosen)` with the switch's (blocks, threads) if set.
    pub(crate) clusters: Option<Option<(u32, u32)>>,
    /// Streaming multiprocessors.
    sms: usize,
    /// Held while a session is created or destroyed and while a graph is captured:
    /// allocation, frees and cuBLAS set-up in one thread must not meet a capture in another
    /// (seen: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED under 64 concurrent requests).
    setup: Mutex<()>,
}

impl Gpu {
    /// The first GPU (device 0), once per process.
    pub fn get() -> Result<Arc<Gpu>, CudaError> {
        static GPU: OnceLock<Mutex<Option<Arc<Gpu>>>> = OnceLock::new();
        let slot = GPU.get_or_init(|| Mutex::new(None));
        let mut slot = slot
            .lock()
            .map_err(|_| CudaError::unavailable("GPU state poisoned"))?;
        if let Some(gpu) = slot.as_ref() {
            return Ok(gpu.clone());
        }
        let gpu = Arc::new(Self::open()?);
        *slot = Some(gpu.clone());
        Ok(gpu)
    }

    fn open() -> Result<Gpu, CudaError> {
        let no_driver =
            || CudaError::unavailable("no CUDA driver (libcuda.so) found on this machine");
        // Without libcuda, cudarc panics (caught below, but its message and backtrace still
        // reach stderr); ask first so that case is a plain error.
        // SAFETY: this only tries to load the CUDA driver library by name, as cudarc would.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(no_driver());
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(0))
            .map_err(|_| no_driver())?
            .map_err(|e| CudaError::unavailable(format!("no usable GPU: {e:?}")))?;
        // We order work on each session's stream ourselves; cudarc's per-buffer event
        // tracking would add events to every launch and to captured graphs.
        // SAFETY: called before any allocation or launch on this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().ctx("compute capability")?;
        let name = ctx.name().unwrap_or_default();
        let tuning = Tuning::from_env();
        let arch = format!("compute_{major}{minor}");
        let ptx = super::nvrtc::cached_ptx(&arch, tuning.kernels_dir.as_deref())?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .ctx("loading the kernels")?;
        let clusters = (major >= 9 && tuning.fused_attention).then_some(tuning.decode_cluster);
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .ctx("multiprocessor count")?;
        Ok(Gpu {
            ctx,
            module,
            name,
            pdl: major >= 9 && tuning.pdl,
            tensor_cores: major >= 8,
            clusters,
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            tuning,
            setup: Mutex::new(()),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    /// Streaming multiprocessors.
    pub fn sms(&self) -> usize {
        self.sms
    }

    /// The most rows of a batched step whose bf16 products run on our kernel
    /// (`batch_gemm_bf16_*`) rather than cuBLAS: 64 where the kernel can fetch its weights
    /// while the kernel before it ends (programmatic dependent launch, sm_90+), none
    /// elsewhere; `WASI_NN_HOST_BATCH_GEMM=ROWS` sets it; every step when batch-invariant.
    /// From 128 rows on cuBLAS's products are faster (BENCHMARKS.md).
    pub fn batch_gemm_rows(&self) -> usize {
        if self.batch_invariant() {
            return usize::MAX;
        }
        let default = if self.pdl { BATCH_GEMM_ROWS } else { 0 };
        self.tuning.batch_gemm.unwrap_or(default)
    }

    /// Whether batched steps are batch-invariant (`WASI_NN_HOST_BATCH_INVARIANT`, bf16
    /// tensor cores): every product and the LM head on our kernel at every step size (each
    /// product's K cut the same way), each row's attention in spans of its own length, and
    /// every decode and prompt of up to a pass's rows in a batched pass, also alone. A
    /// context's logits are then the same bits whatever contexts share its steps; a long
    /// prompt's pass and a lone stream's decode pay for it (BENCHMARKS.md).
    pub fn batch_invariant(&self) -> bool {
        self.tuning.batch_invariant && self.tensor_cores
    }

    /// Whether the fused decode kernel (thread-block clusters, sm_90+) is in use.
    pub fn fused_decode(&self) -> bool {
        self.clusters.is_some()
    }

    /// Whether the GPU has bf16 tensor-core instructions (sm_80+).
    pub fn tensor_cores(&self) -> bool {
        self.tensor_cores
    }

    pub(crate) fn setup_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.setup
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The launches of `launches` on `stream` captured as a graph (None: nothing was
    /// launched). Holds the set-up lock.
    pub(crate) fn capture(
        &self,
        stream: &Arc<cudarc::driver::CudaStream>,
        launches: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<Option<cudarc::driver::CudaGraph>, CudaError> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let _setup = self.setup_lock();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .ctx("graph capture")?;
        let launched = launches();
        // the capture is ended whatever the launches did
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        launched.and(graph.ctx("graph capture"))
    }

    /// The kernels for weights stored as `dtype`.
    pub(crate) fn kernels(&self, dtype: GpuDtype) -> Result<Kernels, CudaError> {
        let suffix = match dtype {
            GpuDtype::F32 => "f32",
            GpuDtype::Bf16 => "bf16",
        };
        let f = |name: &str| {
            self.module
                .load_function(name)
                .map_err(|e| CudaError::unavailable(format!("kernel {name}: {e:?}")))
        };
        Ok(Kernels {
            embed: f(&format!("embed_{suffix}"))?,
            layernorm: f(&format!("layernorm_{suffix}"))?,
            matvec: f(&format!("matvec_{suffix}"))?,
            matmul: f(&format!("matmul_{suffix}"))?,
            att_partial: f(&format!("attention_decode_partial_{suffix}"))?,
            att_combine: f("attention_decode_combine")?,
            decode_qkv_att: {
                let func = f(&format!("decode_qkv_attention_{suffix}"))?;
                if self.clusters.flatten().is_some_and(|(n, _)| n > 8) {
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
                if self.tensor_cores {
                    attention::allow_fresh_shared_memory(&func)?;
                }
                func
            },
            gemm_epilogue: f(&format!("gemm_epilogue_{suffix}"))?,
            add_bias: f(&format!("add_bias_{suffix}"))?,
            to_bf16: f("f32_to_bf16")?,
            batch_residual_norm: f(&format!("batch_residual_norm_{suffix}"))?,
            batch_epilogue: f(&format!("batch_epilogue_{suffix}"))?,
            batch_attention: f(&format!("batch_attention_{suffix}"))?,
            batch_append_kv: f(&format!("batch_append_kv_{suffix}"))?,
            batch_att_combine: f("batch_attention_combine")?,
            batch_logits: f("batch_logits")?,
            batch_feed: f("batch_feed")?,
            batch_gemm: {
                let funcs = [
                    f("batch_gemm_bf16_n64")?,
                    f("batch_gemm_bf16_n32")?,
                    f("batch_gemm_bf16_n64_fold")?,
                    f("batch_gemm_bf16_n32_fold")?,
                ];
                // GPUs with less shared memory a block than the kernel's stages take (sm_86:
                // 99 KiB) keep cuBLAS for every product
                let fits = self.tensor_cores
                    && (funcs.iter().enumerate()).all(|(i, func)| {
                        super::ops::batch::allow_gemm_shared_memory(func, i % 2 == 0).is_ok()
                    });
                fits.then_some(funcs)
            },
        })
    }

    /// The GPU's name and free memory, for diagnostics.
    pub fn describe(&self) -> Result<String, CudaError> {
        let (free, total) = self.ctx.mem_get_info().ctx("memory info")?;
        Ok(format!(
            "{} ({} MiB free of {} MiB)",
            self.name(),
            free >> 20,
            total >> 20
        ))
    }
}

//! The GPU: its context, its capabilities, the run-time switches that apply to it
//! ([`crate::switches`]), the module of our kernels once loaded, and graph capture.

use super::error::{CudaError, DriverContext};
use super::nvrtc::KernelImage;
use crate::switches::{GpuWait, Measurement, Settings, Switches};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use std::sync::{Arc, Mutex, OnceLock};

/// Rows of a batched step up to which its products run on our kernel by default (sm_90+).
const BATCH_GEMM_ROWS: usize = 64;
/// Blocks that draw a row on sm_90+ by default: a lone row's draw over a cluster of 8 (on an
/// H200 17 us against 36 in one block); a batched pass's rows one block each (at 64 rows 2
/// blocks took 40 us against 52, at 128 rows 68 against 53; through the service neither
/// moved 64 or 256 sampled streams; docs/design/batching.md, known limits).
const DRAW_CLUSTER: (u32, u32) = (8, 1);

/// The GPU and its compiled kernels, shared by every graph in the process.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    /// Its place among the GPUs this process sees (`cuda:N`).
    ordinal: u32,
    /// `compute_XY`, the architecture the kernels are compiled for.
    arch: String,
    /// Our kernels, compiled for `arch` and loaded at the first executor ([`Self::module`]).
    module: OnceLock<Arc<CudaModule>>,
    name: String,
    switches: &'static Switches,
    /// Programmatic dependent launch (sm_90+, unless switched off).
    pub(crate) pdl: bool,
    /// bf16 tensor-core instructions (mma.sync, sm_80+).
    pub(crate) tensor_cores: bool,
    /// Thread-block clusters (sm_90+): decode's LayerNorm, QKV and attention as one kernel per
    /// layer, a cluster per head; `Some(chosen)` with the switch's (blocks, threads) if set.
    pub(crate) clusters: Option<Option<(u32, u32)>>,
    /// Blocks that draw one row of a sampled draw (a thread-block cluster on sm_90+, one block
    /// elsewhere): a lone row's draw, and the batched pass's ([`Self::draw_cluster`]).
    draw_cluster: (u32, u32),
    /// Kernels may be launched in thread-block clusters (sm_90+).
    cluster_launch: bool,
    /// Streaming multiprocessors.
    sms: usize,
    /// Dynamic shared memory a block may opt into, on sm_90+ (the persistent decode kernel's
    /// GPUs); None before sm_90.
    shared_optin: Option<usize>,
    /// Held while a session is created or destroyed and while a graph is captured:
    /// allocation, frees and cuBLAS set-up in one thread must not meet a capture in another
    /// (seen: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED under 64 concurrent requests).
    setup: Mutex<()>,
    /// The cuBLASLt products' plans, shared by the sessions' handles: the heuristic that
    /// picks an algorithm runs once for the GPU, not once a session.
    pub(crate) lt_plans: Arc<crate::cuda::blas::lt::LtPlans>,
}

impl Gpu {
    /// GPU `ordinal` (`cuda:N`, counted among the GPUs `CUDA_VISIBLE_DEVICES` leaves
    /// visible), opened once per process.
    pub fn get(ordinal: u32) -> Result<Arc<Gpu>, CudaError> {
        static GPUS: OnceLock<Mutex<Vec<Arc<Gpu>>>> = OnceLock::new();
        let opened = GPUS.get_or_init(|| Mutex::new(Vec::new()));
        let mut opened = opened
            .lock()
            .map_err(|_| CudaError::unavailable("GPU state poisoned"))?;
        if let Some(gpu) = opened.iter().find(|gpu| gpu.ordinal == ordinal) {
            return Ok(gpu.clone());
        }
        let gpu = Arc::new(Self::open(ordinal)?);
        opened.push(gpu.clone());
        Ok(gpu)
    }

    fn open(ordinal: u32) -> Result<Gpu, CudaError> {
        let no_driver =
            || CudaError::unavailable("no CUDA driver (libcuda.so) found on this machine");
        // Without libcuda, cudarc panics (caught below, but its message and backtrace still
        // reach stderr); ask first so that case is a plain error.
        // SAFETY: this only tries to load the CUDA driver library by name, as cudarc would.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(no_driver());
        }
        let count = std::panic::catch_unwind(CudaContext::device_count)
            .map_err(|_| no_driver())?
            .map_err(|e| CudaError::unavailable(format!("no usable GPU: {e:?}")))?;
        if i64::from(ordinal) >= i64::from(count) {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES")
                .map(|v| format!(" with CUDA_VISIBLE_DEVICES={v}"))
                .unwrap_or_default();
            let seen = match count {
                0 => "no GPU".to_owned(),
                1 => "one GPU, cuda:0".to_owned(),
                n => format!("{n} GPUs, cuda:0 to cuda:{}", n - 1),
            };
            return Err(CudaError::unavailable(format!(
                "cuda:{ordinal}: this process sees {seen}{visible}"
            )));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal as usize))
            .map_err(|_| no_driver())?
            .map_err(|e| CudaError::unavailable(format!("no usable GPU: {e:?}")))?;
        // We order work on each session's stream ourselves; cudarc's per-buffer event
        // tracking would add events to every launch and to captured graphs.
        // SAFETY: called before any allocation or launch on this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().ctx("compute capability")?;
        let name = ctx.name().unwrap_or_default();
        let switches = crate::switches::get();
        let measurement = &switches.measurement;
        set_gpu_wait(&ctx, switches.settings.sync);
        let clusters =
            (major >= 9 && measurement.fused_attention).then_some(measurement.decode_cluster);
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .ctx("multiprocessor count")?;
        let draw_cluster = match major >= 9 {
            true => measurement.draw_cluster.unwrap_or(DRAW_CLUSTER),
            false => (1, 1),
        };
        let shared_optin = if major >= 9 {
            let bytes = ctx
                .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                .ctx("shared memory a block")?;
            usize::try_from(bytes).ok()
        } else {
            None
        };
        Ok(Gpu {
            shared_optin,
            ctx,
            ordinal,
            arch: format!("compute_{major}{minor}"),
            module: OnceLock::new(),
            name,
            pdl: major >= 9 && measurement.pdl,
            tensor_cores: major >= 8,
            clusters,
            draw_cluster,
            cluster_launch: major >= 9,
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            switches,
            setup: Mutex::new(()),
            lt_plans: Arc::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its place among the GPUs this process sees (`cuda:N`).
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The production settings ([`crate::switches::Settings`]).
    pub fn settings(&self) -> &Settings {
        &self.switches.settings
    }

    /// The measurement switches ([`crate::switches::Measurement`]).
    pub fn measurement(&self) -> &Measurement {
        &self.switches.measurement
    }

    /// The architecture of the kernels' PTX (`compute_XY`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The compute capability as the architectures name it (`"90"`: `sm_90`, `compute_90`).
    pub fn compute_capability(&self) -> &str {
        self.arch.trim_start_matches("compute_")
    }

    /// The kernels' module: `load` compiles and loads it at the first call (the PTX); later
    /// calls share it.
    pub(crate) fn module(
        &self,
        load: impl FnOnce(&Self) -> Result<KernelImage, CudaError>,
    ) -> Result<Arc<CudaModule>, CudaError> {
        let _setup = self.setup_lock();
        if let Some(module) = self.module.get() {
            return Ok(module.clone());
        }
        let image = match load(self)? {
            KernelImage::Cubin(bytes) => cudarc::nvrtc::Ptx::from_binary(bytes),
            KernelImage::Ptx(text) => cudarc::nvrtc::Ptx::from_src(text),
        };
        let module = (self.ctx).load_module(image).ctx("loading the kernels")?;
        Ok(self.module.get_or_init(|| module).clone())
    }

    /// A kernel of `module` by name.
    pub(crate) fn function(
        module: &Arc<CudaModule>,
        name: &str,
    ) -> Result<CudaFunction, CudaError> {
        module
            .load_function(name)
            .map_err(|e| CudaError::unavailable(format!("kernel {name}: {e:?}")))
    }

    /// Whether sessions may decode through the persistent kernel here (sm_90+).
    pub fn has_persistent_decode(&self) -> bool {
        self.shared_optin.is_some()
    }

    /// Dynamic shared memory a block may opt into on sm_90+ (None before).
    pub(crate) fn shared_optin(&self) -> Option<usize> {
        self.shared_optin
    }

    /// Blocks that draw a row: `(a lone row's draw, the batched pass's)`.
    pub fn draw_cluster(&self) -> (u32, u32) {
        self.draw_cluster
    }

    /// Whether kernels may be launched in thread-block clusters (sm_90+).
    pub fn cluster_launch(&self) -> bool {
        self.cluster_launch
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
        self.measurement().batch_gemm.unwrap_or(default)
    }

    /// Whether batched steps are batch-invariant (`WASI_NN_HOST_BATCH_INVARIANT`, bf16
    /// tensor cores): every product and the LM head on our kernel at every step size (each
    /// product's K cut the same way), each row's attention in spans of its own length, and
    /// every decode and prompt of up to a pass's rows in a batched pass, also alone. A
    /// context's logits are then the same bits whatever contexts share its steps; a long
    /// prompt's pass and a lone stream's decode pay for it (BENCHMARKS.md).
    pub fn batch_invariant(&self) -> bool {
        self.settings().batch_invariant && self.tensor_cores
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

/// The context's way of waiting for the GPU (`WASI_NN_HOST_SYNC`). A driver without
/// `cuCtxSetFlags` (before CUDA 12.1) keeps its own choice, with a warning.
fn set_gpu_wait(ctx: &CudaContext, wait: GpuWait) {
    use cudarc::driver::sys::CUctx_flags as F;
    let flag = match wait {
        GpuWait::Yield => F::CU_CTX_SCHED_YIELD,
        GpuWait::Spin => F::CU_CTX_SCHED_SPIN,
        GpuWait::Block => F::CU_CTX_SCHED_BLOCKING_SYNC,
        GpuWait::Auto => F::CU_CTX_SCHED_AUTO,
    };
    let set = || -> Result<(), CudaError> {
        ctx.bind_to_thread().ctx("binding the context")?;
        let mut flags = 0u32;
        // SAFETY: the context is current on this thread (bound above); the calls read its
        // flags and replace the scheduling bits alone, which no launch depends on.
        unsafe { cudarc::driver::sys::cuCtxGetFlags(&mut flags) }
            .result()
            .ctx("the context's flags")?;
        let sched = F::CU_CTX_SCHED_MASK as u32;
        // SAFETY: as above.
        unsafe { cudarc::driver::sys::cuCtxSetFlags((flags & !sched) | flag as u32) }
            .result()
            .ctx("the context's scheduling")
    };
    // a driver library without the symbol panics in cudarc's loader
    match std::panic::catch_unwind(set) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("waiting for the GPU as the driver chooses: {e}"),
        Err(_) => tracing::warn!("waiting for the GPU as the driver chooses: no cuCtxSetFlags"),
    }
}

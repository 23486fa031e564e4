//! The CUDA backend: GPT-2 forward passes on our own kernels (`kernels/*.cu`).
//!
//! - The kernels are compiled once per process with NVRTC for the GPU at hand (PTX cached on
//!   disk by source hash and architecture) and loaded with the driver API through cudarc,
//!   which finds libcuda and libnvrtc at run time (the binary builds without CUDA).
//! - [`CudaExecutor`] holds the weights on the GPU once (f32, or bf16 converted at load); every
//!   [`CudaSession`] (one per wasi-nn execution context) has its own stream, KV cache and
//!   activation buffers.
//! - A decode step is one CUDA graph (captured on the session's first step) of
//!   `1 + 6 * n_layer + 1` kernels that read the token and position from device memory; only
//!   the last position's logits come back. Several new tokens go through as one batched
//!   prefill of matrix-matrix kernels.
//!
//! Unsafe code here is kernel launches: each launch passes device pointers that point into
//! allocations owned by the executor or the session (alive for the call), with sizes checked
//! on the host before the first launch (see `CudaSession::extend`).

use crate::backend::{Executor, Gpt2Error, Session};
use crate::cublaslt::{Epilogue, Shape};
use crate::model::{Gpt2Config, Gpt2Weights};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};
use std::sync::{Arc, Mutex, OnceLock};

/// Storage type of the weights on the GPU. Activations, the KV cache and logits stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum GpuDtype {
    #[default]
    F32,
    Bf16,
}

const KERNEL_SOURCES: [(&str, &str); 5] = [
    ("common.cuh", include_str!("../../kernels/common.cuh")),
    ("embed_norm.cu", include_str!("../../kernels/embed_norm.cu")),
    ("matvec.cu", include_str!("../../kernels/matvec.cu")),
    ("matmul.cu", include_str!("../../kernels/matmul.cu")),
    ("attention.cu", include_str!("../../kernels/attention.cu")),
];

/// Dynamic shared memory of the bf16-rows prefill attention (FA_SMEM in attention.cu).
const FA_SMEM_BYTES: u32 = 2 * 2 * 128 * 72 * 2;

/// Positions per block in decode attention (ATT_CHUNK in attention.cu).
const ATT_CHUNK: usize = 32;
/// Threads per attention block (ATT_THREADS in attention.cu).
const ATT_THREADS: u32 = 128;
/// Most blocks per head of the fused decode QKV + attention (DA_MAX_CLUSTER in attention.cu).
const DA_MAX_CLUSTER: u32 = 16;
/// Epilogue modes (enum Epilogue in common.cuh).
const EPI_STORE: i32 = 0;
const EPI_GELU: i32 = 1;
const EPI_RESIDUAL: i32 = 2;
const EPI_QKV: i32 = 3;
/// Matrix-vector rows per block (MV_WARPS * MV_ROWS_PER_WARP in matvec.cu).
const MV_ROWS_PER_BLOCK: usize = 8;

/// Where a prefill's kernels take its first position from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Start {
    /// A launch argument.
    Host(usize),
    /// `ids[0]` (a captured prefill serves any prefix length).
    Device,
}

/// Captured prefills kept per session (by prompt length), and so twice that many lengths
/// remembered: a length is captured the second time it is seen.
const PREFILL_GRAPHS: usize = 4;

/// Profiling aid: `WASI_NN_HOST_SKIP=attn,qkv,proj,mlp,head` (decode graph) or
/// `gemm,pattn,ln,epi` (prefill) leaves those kernels out; the results are then wrong, only the time counts.
fn profile_skip(part: &str) -> bool {
    static SKIP: OnceLock<String> = OnceLock::new();
    SKIP.get_or_init(|| std::env::var("WASI_NN_HOST_SKIP").unwrap_or_default())
        .split(',')
        .any(|s| s == part)
}

/// Pointers to kernel arguments, in order, for `cuLaunchKernelEx`.
macro_rules! kernel_args {
    ($($arg:expr),* $(,)?) => {
        [$($arg as *const _ as *mut std::ffi::c_void),*]
    };
}

fn device_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Gpt2Error + '_ {
    move |e| {
        let text = format!("{e:?}");
        if text.contains("OUT_OF_MEMORY") {
            Gpt2Error::Device(format!("{what}: out of GPU memory"))
        } else {
            Gpt2Error::Device(format!("{what}: {text}"))
        }
    }
}

/// One translation unit of every kernel file: the header pasted in place of its includes.
/// `WASI_NN_HOST_KERNELS=DIR` reads the files from DIR instead of the copies built into the
/// binary (development: trying kernel variants without a rebuild).
pub fn kernel_source() -> Result<String, Gpt2Error> {
    let dir = std::env::var_os("WASI_NN_HOST_KERNELS").map(std::path::PathBuf::from);
    let mut src = String::new();
    for (name, built_in) in KERNEL_SOURCES {
        let text = match &dir {
            Some(dir) => std::fs::read_to_string(dir.join(name)).map_err(|e| {
                Gpt2Error::Device(format!(
                    "WASI_NN_HOST_KERNELS: {}: {e}",
                    dir.join(name).display()
                ))
            })?,
            None => built_in.to_string(),
        };
        src.push_str(&format!("// ---- {name}\n"));
        for line in text.lines() {
            if !line.starts_with("#include \"common.cuh\"") && !line.starts_with("#pragma once") {
                src.push_str(line);
                src.push('\n');
            }
        }
    }
    Ok(src)
}

/// Compile all kernels to PTX for `arch` (e.g. `compute_90`) with NVRTC. Used at start-up
/// (through a disk cache) and by the CI check that every kernel compiles.
pub fn compile_kernels(arch: &str) -> Result<String, Gpt2Error> {
    compile_source(kernel_source()?, arch)
}

fn compile_source(source: String, arch: &str) -> Result<String, Gpt2Error> {
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        ..Default::default()
    };
    let compiled = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(source, opts))
        .map_err(|_| {
            Gpt2Error::Device("NVRTC (libnvrtc) was not found; set LD_LIBRARY_PATH".into())
        })?;
    let ptx = compiled
        .map_err(|e| Gpt2Error::Device(format!("NVRTC failed to compile the kernels: {e:?}")))?;
    Ok(ptx.to_src())
}

fn cache_dir() -> Option<std::path::PathBuf> {
    if let Some(dir) = std::env::var_os("WASI_NN_HOST_CACHE") {
        return Some(dir.into());
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?;
    Some(base.join("wasi-nn-host"))
}

/// PTX for `arch`, from the disk cache when the same source was compiled before.
fn cached_ptx(arch: &str) -> Result<String, Gpt2Error> {
    use std::hash::{Hash, Hasher};
    let source = kernel_source()?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut hasher);
    arch.hash(&mut hasher);
    let file = cache_dir().map(|d| d.join(format!("kernels-{:016x}-{arch}.ptx", hasher.finish())));
    if let Some(ptx) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return Ok(ptx);
    }
    let ptx = compile_source(source, arch)?;
    if let Some(file) = file {
        // A cache we cannot write is only slower.
        let _ = file.parent().map(std::fs::create_dir_all);
        let _ = std::fs::write(&file, &ptx);
    }
    Ok(ptx)
}

struct Kernels {
    embed: CudaFunction,
    layernorm: CudaFunction,
    matvec: CudaFunction,
    matmul: CudaFunction,
    att_partial: CudaFunction,
    att_combine: CudaFunction,
    decode_qkv_att: CudaFunction,
    att_prefill: CudaFunction,
    att_prefill_tiled: CudaFunction,
    att_prefill_mma: CudaFunction,
    att_prefill_fresh: CudaFunction,
    gemm_epilogue: CudaFunction,
    add_bias: CudaFunction,
    to_bf16: CudaFunction,
}

/// The GPU and its compiled kernels, shared by every graph in the process.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    module: Arc<cudarc::driver::CudaModule>,
    name: String,
    /// Programmatic dependent launch (sm_90+; WASI_NN_HOST_NO_PDL turns it off).
    pdl: bool,
    /// bf16 tensor-core instructions (mma.sync, sm_80+).
    tensor_cores: bool,
    /// Thread-block clusters (sm_90+): decode's QKV and attention as one kernel per layer,
    /// a cluster per head (WASI_NN_HOST_NO_FUSED_ATTENTION turns it off), of the blocks and
    /// threads given by WASI_NN_HOST_DECODE_CLUSTER=8x256 (else see `qkv_attention`).
    clusters: Option<Option<(u32, u32)>>,
    /// Held while a session is created or destroyed and while a decode graph is captured:
    /// allocation, frees and cuBLAS set-up in one thread must not meet a capture in another
    /// (seen: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED under 64 concurrent requests).
    setup: Mutex<()>,
}

/// The fused decode kernel's (cluster, threads) on a GPU of compute capability `major`.
fn decode_clusters(major: i32) -> Option<Option<(u32, u32)>> {
    if major < 9 || std::env::var_os("WASI_NN_HOST_NO_FUSED_ATTENTION").is_some() {
        return None;
    }
    let chosen = std::env::var("WASI_NN_HOST_DECODE_CLUSTER")
        .ok()
        .and_then(|v| {
            let (n, t) = v.split_once('x')?;
            Some((n.parse::<u32>().ok()?, t.parse::<u32>().ok()?))
        })
        .filter(|&(n, t)| (2..=DA_MAX_CLUSTER).contains(&n) && (t == 128 || t == 256));
    Some(chosen)
}

impl Gpu {
    /// The first GPU (device 0), once per process.
    pub fn get() -> Result<Arc<Gpu>, Gpt2Error> {
        static GPU: OnceLock<Mutex<Option<Arc<Gpu>>>> = OnceLock::new();
        let slot = GPU.get_or_init(|| Mutex::new(None));
        let mut slot = slot
            .lock()
            .map_err(|_| Gpt2Error::Device("GPU state poisoned".into()))?;
        if let Some(gpu) = slot.as_ref() {
            return Ok(gpu.clone());
        }
        let gpu = Arc::new(Self::open()?);
        *slot = Some(gpu.clone());
        Ok(gpu)
    }

    fn open() -> Result<Gpu, Gpt2Error> {
        // cudarc panics when libcuda cannot be loaded: turn that into an error.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(0))
            .map_err(|_| {
                Gpt2Error::Device("no CUDA driver (libcuda.so) found on this machine".into())
            })?
            .map_err(|e| Gpt2Error::Device(format!("no usable GPU: {e:?}")))?;
        // We order work on each session's stream ourselves; cudarc's per-buffer event
        // tracking would add events to every launch and to captured graphs.
        // SAFETY: called before any allocation or launch on this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(device_err("compute capability"))?;
        let name = ctx.name().unwrap_or_default();
        let ptx = cached_ptx(&format!("compute_{major}{minor}"))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(device_err("loading the kernels"))?;
        let pdl = major >= 9 && std::env::var_os("WASI_NN_HOST_NO_PDL").is_none();
        Ok(Gpu {
            ctx,
            module,
            name,
            pdl,
            tensor_cores: major >= 8,
            clusters: decode_clusters(major),
            setup: Mutex::new(()),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn setup_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.setup
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn kernels(&self, dtype: GpuDtype) -> Result<Kernels, Gpt2Error> {
        let suffix = match dtype {
            GpuDtype::F32 => "f32",
            GpuDtype::Bf16 => "bf16",
        };
        let f = |name: &str| {
            self.module
                .load_function(name)
                .map_err(|e| Gpt2Error::Device(format!("kernel {name}: {e:?}")))
        };
        Ok(Kernels {
            embed: f(&format!("embed_{suffix}"))?,
            layernorm: f(&format!("layernorm_{suffix}"))?,
            matvec: f(&format!("matvec_{suffix}"))?,
            matmul: f(&format!("matmul_{suffix}"))?,
            att_partial: f("attention_decode_partial")?,
            att_combine: f("attention_decode_combine")?,
            decode_qkv_att: {
                let func = f(&format!("decode_qkv_attention_{suffix}"))?;
                if self.clusters.flatten().is_some_and(|(n, _)| n > 8) {
                    // clusters above 8 blocks are allowed per kernel (sm_90 has up to 16)
                    use cudarc::driver::sys::CUfunction_attribute_enum as A;
                    func.set_attribute(A::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                        .map_err(device_err("cluster size"))?;
                }
                func
            },
            att_prefill: f("attention_prefill")?,
            att_prefill_tiled: f("attention_prefill_tiled")?,
            att_prefill_mma: f("attention_prefill_mma")?,
            att_prefill_fresh: {
                let func = f("attention_prefill_fresh")?;
                if self.tensor_cores {
                    use cudarc::driver::sys::CUfunction_attribute_enum as A;
                    let bytes = FA_SMEM_BYTES as i32;
                    func.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
                        .map_err(device_err("attention shared memory"))?;
                }
                func
            },
            gemm_epilogue: f(&format!("gemm_epilogue_{suffix}"))?,
            add_bias: f(&format!("add_bias_{suffix}"))?,
            to_bf16: f("f32_to_bf16")?,
        })
    }
}

/// A weight tensor on the GPU: its device address and the allocation that owns it.
struct DevTensor {
    ptr: u64,
    _f32: Option<CudaSlice<f32>>,
    _bf16: Option<CudaSlice<u16>>,
}

impl DevTensor {
    fn upload(
        stream: &Arc<CudaStream>,
        values: &[f32],
        dtype: GpuDtype,
    ) -> Result<Self, Gpt2Error> {
        let err = device_err("uploading weights");
        Ok(match dtype {
            GpuDtype::F32 => {
                let slice = stream.clone_htod(values).map_err(&err)?;
                let ptr = slice.device_ptr(stream).0;
                DevTensor {
                    ptr,
                    _f32: Some(slice),
                    _bf16: None,
                }
            }
            GpuDtype::Bf16 => {
                let bits: Vec<u16> = values
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_bits())
                    .collect();
                let slice = stream.clone_htod(&bits).map_err(&err)?;
                let ptr = slice.device_ptr(stream).0;
                DevTensor {
                    ptr,
                    _f32: None,
                    _bf16: Some(slice),
                }
            }
        })
    }
}

struct DevLayer {
    ln1_w: DevTensor,
    ln1_b: DevTensor,
    qkv_w: DevTensor,
    qkv_b: DevTensor,
    proj_w: DevTensor,
    proj_b: DevTensor,
    ln2_w: DevTensor,
    ln2_b: DevTensor,
    fc_w: DevTensor,
    fc_b: DevTensor,
    fc_proj_w: DevTensor,
    fc_proj_b: DevTensor,
    /// The projections' biases in f32 (as stored, i.e. bf16-rounded in bf16 mode), for the
    /// cuBLASLt products with an f32 result (it takes no bf16 bias there).
    proj_b32: DevTensor,
    fc_proj_b32: DevTensor,
}

struct DevWeights {
    wte: DevTensor,
    wpe: DevTensor,
    layers: Vec<DevLayer>,
    lnf_w: DevTensor,
    lnf_b: DevTensor,
}

struct ExecutorInner {
    gpu: Arc<Gpu>,
    config: Gpt2Config,
    dtype: GpuDtype,
    kernels: Kernels,
    weights: DevWeights,
    max_kv_bytes: usize,
}

/// GPT-2 on the GPU: weights uploaded once, shared by every session.
pub struct CudaExecutor(Arc<ExecutorInner>, Arc<SessionPool>);

/// Idle sessions of one executor, reused by new execution contexts: a request then skips the
/// allocation of its KV cache and buffers, the cuBLAS set-up and the decode-graph capture.
/// A reused session starts empty (length 0); nothing of the previous sequence is readable.
struct SessionPool {
    idle: Mutex<Vec<CudaSession>>,
    max_idle: usize,
}

/// A pooled session: goes back to the pool when its execution context is dropped.
struct PooledSession {
    session: Option<CudaSession>,
    pool: Arc<SessionPool>,
}

impl Drop for PooledSession {
    fn drop(&mut self) {
        if let Some(mut session) = self.session.take() {
            session.len = 0;
            session.all_rows = 0;
            if let Ok(mut idle) = self.pool.idle.lock() {
                if idle.len() < self.pool.max_idle {
                    idle.push(session);
                    return;
                }
            }
            drop(session);
        }
    }
}

impl PooledSession {
    fn get(&mut self) -> Result<&mut CudaSession, Gpt2Error> {
        self.session
            .as_mut()
            .ok_or_else(|| Gpt2Error::Device("session already released".into()))
    }
}

impl Session for PooledSession {
    fn len(&self) -> usize {
        self.session.as_ref().map_or(0, |s| s.len)
    }
    fn truncate(&mut self, len: usize) {
        if let Some(s) = self.session.as_mut() {
            s.truncate(len);
        }
    }
    fn extend(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), Gpt2Error> {
        self.get()?.extend(tokens, all_positions)
    }
    fn last_logits(&mut self) -> Result<Vec<f32>, Gpt2Error> {
        self.get()?.last_logits()
    }
    fn all_logits(&mut self) -> Result<Vec<f32>, Gpt2Error> {
        self.get()?.all_logits()
    }
    fn argmax(&mut self) -> Result<u32, Gpt2Error> {
        self.get()?.argmax()
    }
}

impl CudaExecutor {
    /// Upload `weights` (converted to `dtype`) to the GPU. `max_kv_bytes` caps each session's KV cache.
    pub fn new(
        weights: &Gpt2Weights,
        dtype: GpuDtype,
        max_kv_bytes: usize,
    ) -> Result<Self, Gpt2Error> {
        let config = weights.config;
        if !config.n_embd.is_multiple_of(8)
            || config.n_embd > 2048
            || !config.head_dim().is_multiple_of(16)
            || config.head_dim() > 128
        {
            return Err(Gpt2Error::Device(format!(
                "the CUDA kernels need n_embd % 8 == 0, n_embd <= 2048 and head_dim % 16 == 0, <= 128 (got {config:?})"
            )));
        }
        let gpu = Gpu::get()?;
        let kernels = gpu.kernels(dtype)?;
        let stream = gpu.ctx.default_stream();
        let up = |values: &[f32]| DevTensor::upload(&stream, values, dtype);
        let up32 = |values: &[f32]| {
            let stored: Vec<f32> = match dtype {
                GpuDtype::F32 => values.to_vec(),
                GpuDtype::Bf16 => values
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect(),
            };
            DevTensor::upload(&stream, &stored, GpuDtype::F32)
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
            .collect::<Result<Vec<_>, Gpt2Error>>()?;
        let dev = DevWeights {
            wte: up(&weights.wte)?,
            wpe: up(&weights.wpe)?,
            layers,
            lnf_w: up(&weights.lnf_w)?,
            lnf_b: up(&weights.lnf_b)?,
        };
        stream
            .synchronize()
            .map_err(device_err("uploading weights"))?;
        // Keep up to 8 GiB of idle sessions (their KV caches and buffers) for reuse.
        let session_bytes = 2 * config.n_layer * config.n_ctx * config.n_embd * 4
            + config.n_ctx * 16 * config.n_embd * 4;
        let pool = Arc::new(SessionPool {
            idle: Mutex::new(Vec::new()),
            max_idle: ((8usize << 30) / session_bytes.max(1)).clamp(1, 64),
        });
        Ok(Self(
            Arc::new(ExecutorInner {
                gpu,
                config,
                dtype,
                kernels,
                weights: dev,
                max_kv_bytes,
            }),
            pool,
        ))
    }

    pub fn gpu_name(&self) -> &str {
        self.0.gpu.name()
    }

    /// Open a session with its concrete type (benchmarks use its timing hooks).
    pub fn open(&self) -> Result<CudaSession, Gpt2Error> {
        CudaSession::new(self.0.clone())
    }
}

impl Executor for CudaExecutor {
    fn config(&self) -> Gpt2Config {
        self.0.config
    }
    fn new_session(&self) -> Result<Box<dyn Session>, Gpt2Error> {
        let reused = self.1.idle.lock().ok().and_then(|mut idle| idle.pop());
        let session = match reused {
            Some(session) => session,
            None => self.open()?,
        };
        Ok(Box::new(PooledSession {
            session: Some(session),
            pool: self.1.clone(),
        }))
    }
}

/// Device buffers of one session, each with its address.
struct Buf {
    slice: CudaSlice<f32>,
    ptr: u64,
}

impl Buf {
    fn new(stream: &Arc<CudaStream>, len: usize, what: &str) -> Result<Self, Gpt2Error> {
        let slice = stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(device_err(what))?;
        let ptr = slice.device_ptr(stream).0;
        Ok(Buf { slice, ptr })
    }
}

/// One sequence on the GPU: KV cache, activations, and the captured decode graph.
pub struct CudaSession {
    exec: Arc<ExecutorInner>,
    stream: Arc<CudaStream>,
    /// Positions the KV cache can hold (n_ctx unless the per-session cap is lower).
    capacity: usize,
    len: usize,
    k_cache: Buf, // [L, capacity, C]
    v_cache: Buf,
    x: Buf,   // residual stream [capacity, C]
    h: Buf,   // LayerNorm / attention output [capacity, C]
    qkv: Buf, // [capacity, 3C]
    fc: Buf,  // [capacity, 4C]
    partial: Buf,
    logits: Buf, // [V]
    all_logits: Option<Buf>,
    /// [position, ids...]: the decode step's position (or a captured prefill's first one),
    /// then the token ids (one for a decode step), so a step uploads both in one copy.
    ids: CudaSlice<i32>,
    tokens_ptr: u64,      // ids[1..]
    pos_ptr: u64,         // ids[0]
    next: CudaSlice<u64>, // [1] the argmax key of the last logits (see `argmax_row`)
    next_ptr: u64,
    /// Rows of all-position logits from the last extend (0 when not asked for).
    all_rows: usize,
    max_chunks: usize,
    graph: Option<CudaGraph>,
    graph_failed: bool,
    /// Captured prefills by (prompt length, all positions), most recently used last.
    prefill_graphs: Vec<((usize, bool), CudaGraph)>,
    /// Prompt shapes seen (a shape is captured when it comes again).
    prefill_seen: Vec<(usize, bool)>,
    prefill_graphs_on: bool,
    /// cuBLAS for prefill products (None: our tiled kernel), with its scratch buffers.
    blas: Option<Blas>,
}

/// A cuBLAS handle on the session's stream, plus GEMM scratch: f32 results before the
/// epilogue, and bf16 copies of activations (tensor-core inputs in bf16 mode).
struct Blas {
    handle: cudarc::cublas::sys::cublasHandle_t,
    tmp: Buf,
    x_bf16: CudaSlice<u16>,
    x_bf16_ptr: u64,
    /// The FC product's bf16 result (the MLP projection's input): [rows, 4C], apart from
    /// x_bf16, its input.
    _fc_bf16: CudaSlice<u16>,
    fc_bf16_ptr: u64,
    /// The QKV product's bf16 rows ([rows, 3C], bias added) that the tensor-core attention
    /// reads the prompt's queries, keys and values from.
    qkv_bf16: CudaSlice<u16>,
    qkv_bf16_ptr: u64,
    /// cuBLASLt for bf16 products with fused bias / GELU epilogues (None: not loadable, or
    /// `WASI_NN_HOST_NO_CUBLASLT`), and its workspace.
    lt: Option<crate::cublaslt::Lt>,
    _lt_workspace: Option<CudaSlice<u8>>,
}

/// cuBLASLt workspace per session.
const LT_WORKSPACE_BYTES: usize = 4 << 20;

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by us and is destroyed once.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.handle) };
    }
}

impl Blas {
    /// cuBLAS when the library loads (cudarc panics when it cannot find it).
    fn new(stream: &Arc<CudaStream>, rows: usize, c: usize) -> Option<Blas> {
        if std::env::var_os("WASI_NN_HOST_NO_CUBLAS").is_some() {
            return None;
        }
        let handle = std::panic::catch_unwind(cudarc::cublas::result::create_handle)
            .ok()?
            .ok()?;
        // SAFETY: a fresh handle and a live stream of the same context.
        unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _) }.ok()?;
        let tmp = Buf::new(stream, rows * 4 * c, "GEMM scratch").ok()?;
        let x_bf16 = stream.alloc_zeros::<u16>(rows * 4 * c).ok()?;
        let x_bf16_ptr = x_bf16.device_ptr(stream).0;
        let fc_bf16 = stream.alloc_zeros::<u16>(rows * 4 * c).ok()?;
        let fc_bf16_ptr = fc_bf16.device_ptr(stream).0;
        let qkv_bf16 = stream.alloc_zeros::<u16>(rows * 3 * c).ok()?;
        let qkv_bf16_ptr = qkv_bf16.device_ptr(stream).0;
        let (lt, lt_workspace) = match std::env::var_os("WASI_NN_HOST_NO_CUBLASLT") {
            Some(_) => (None, None),
            None => match stream.alloc_zeros::<u8>(LT_WORKSPACE_BYTES) {
                Ok(ws) => {
                    let ptr = ws.device_ptr(stream).0;
                    (
                        crate::cublaslt::Lt::new((ptr, LT_WORKSPACE_BYTES)),
                        Some(ws),
                    )
                }
                Err(_) => (None, None),
            },
        };
        Some(Blas {
            handle,
            tmp,
            x_bf16,
            x_bf16_ptr,
            _fc_bf16: fc_bf16,
            fc_bf16_ptr,
            qkv_bf16,
            qkv_bf16_ptr,
            lt,
            _lt_workspace: lt_workspace,
        })
    }
}

// SAFETY: the session's device state is only touched through `&mut self` (the `Session`
// methods that launch work take `&mut self`); `&self` methods read plain integers. The raw
// handles inside `CudaGraph` are used from one thread at a time as a result.
unsafe impl Send for CudaSession {}
unsafe impl Sync for CudaSession {}

impl CudaSession {
    fn new(exec: Arc<ExecutorInner>) -> Result<Self, Gpt2Error> {
        let gpu = exec.gpu.clone();
        let _setup = gpu.setup_lock();
        let cfg = exec.config;
        let c = cfg.n_embd;
        let per_position = 2 * cfg.n_layer * c * 4;
        let capacity = cfg.n_ctx.min(exec.max_kv_bytes / per_position);
        if capacity == 0 {
            return Err(Gpt2Error::Device(format!(
                "the per-context KV cap of {} bytes is below one position ({per_position} bytes)",
                exec.max_kv_bytes
            )));
        }
        let stream = exec
            .gpu
            .ctx
            .new_stream()
            .map_err(device_err("creating a stream"))?;
        let max_chunks = capacity.div_ceil(ATT_CHUNK);
        let kv = cfg.n_layer * capacity * c;
        let ids = stream
            .alloc_zeros::<i32>(capacity + 1)
            .map_err(device_err("token buffer"))?;
        let next = stream
            .alloc_zeros::<u64>(1)
            .map_err(device_err("argmax buffer"))?;
        let pos_ptr = ids.device_ptr(&stream).0;
        let tokens_ptr = pos_ptr + 4;
        let next_ptr = next.device_ptr(&stream).0;
        Ok(Self {
            k_cache: Buf::new(&stream, kv, "KV cache")?,
            v_cache: Buf::new(&stream, kv, "KV cache")?,
            x: Buf::new(&stream, capacity * c, "activations")?,
            h: Buf::new(&stream, capacity * c, "activations")?,
            qkv: Buf::new(&stream, capacity * 3 * c, "activations")?,
            fc: Buf::new(&stream, capacity * 4 * c, "activations")?,
            partial: Buf::new(
                &stream,
                cfg.n_head * max_chunks * (cfg.head_dim() + 2),
                "attention scratch",
            )?,
            logits: Buf::new(&stream, cfg.vocab_size, "logits")?,
            all_logits: None,
            ids,
            tokens_ptr,
            pos_ptr,
            next,
            next_ptr,
            all_rows: 0,
            max_chunks,
            capacity,
            len: 0,
            graph: None,
            graph_failed: false,
            prefill_graphs: Vec::new(),
            prefill_seen: Vec::new(),
            prefill_graphs_on: true,
            blas: Blas::new(&stream, capacity, c),
            stream,
            exec,
        })
    }

    /// Launch `func` on the session's stream, with programmatic dependent launch where the GPU
    /// has it (every kernel waits with `griddepcontrol.wait` before touching activations).
    ///
    /// # Safety
    /// `args` must hold pointers to values of the kernel's parameter types, in order, and every
    /// device pointer among them must cover what the kernel touches for `cfg`.
    unsafe fn launch(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), cudarc::driver::DriverError> {
        // SAFETY: passed on from the caller.
        unsafe { self.launch_cluster(func, cfg, 1, args) }
    }

    /// [`Self::launch`] in thread-block clusters of `cluster` blocks along x (1: none).
    ///
    /// # Safety
    /// As for [`Self::launch`]; `cluster` > 1 needs sm_90 and must divide the grid's x.
    unsafe fn launch_cluster(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        cluster: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        self.exec.gpu.ctx.bind_to_thread()?;
        // SAFETY: an all-zero launch attribute is valid (id 0 = ignored); we fill in up to two.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if self.exec.gpu.pdl {
            attrs[n].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cluster > 1 {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = cluster;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        // SAFETY: the caller vouches for the arguments; config and attr outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }

    fn kv_layer(&self, l: usize) -> (u64, u64) {
        let offset = (l * self.capacity * self.exec.config.n_embd * 4) as u64;
        (self.k_cache.ptr + offset, self.v_cache.ptr + offset)
    }

    /// y = W x (+ LN prologue, epilogue) for one vector.
    #[allow(clippy::too_many_arguments)]
    fn matvec(
        &self,
        out: u64,
        x: u64,
        w: u64,
        bias: u64,
        n: usize,
        k: usize,
        ln: (u64, u64),
        mode: i32,
        kv: (u64, u64),
    ) -> Result<(), Gpt2Error> {
        self.matvec_argmax(out, x, w, bias, (n, k), ln, mode, kv, 0)
    }

    /// The LM head for the row at `x`: logits (final LayerNorm fused) into `logits`, and
    /// their argmax key into `next` (cleared by the step's embedding kernel).
    fn lm_head(&self, x: u64) -> Result<(), Gpt2Error> {
        let (cfg, w) = (self.exec.config, &self.exec.weights);
        let (logits, lnf) = (self.logits.ptr, (w.lnf_w.ptr, w.lnf_b.ptr));
        let shape = (cfg.vocab_size, cfg.n_embd);
        self.matvec_argmax(
            logits,
            x,
            w.wte.ptr,
            0,
            shape,
            lnf,
            EPI_STORE,
            (0, 0),
            self.next_ptr,
        )
    }

    /// [`Self::matvec`], with the argmax key of the outputs raised into `best` when non-zero.
    #[allow(clippy::too_many_arguments)]
    fn matvec_argmax(
        &self,
        out: u64,
        x: u64,
        w: u64,
        bias: u64,
        (n, k): (usize, usize),
        ln: (u64, u64),
        mode: i32,
        kv: (u64, u64),
        best: u64,
    ) -> Result<(), Gpt2Error> {
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(MV_ROWS_PER_BLOCK) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (k * 4) as u32,
        };
        let (n, k, c) = (n as i32, k as i32, self.exec.config.n_embd as i32);
        let pos = if mode == EPI_QKV { self.pos_ptr } else { 0u64 };
        // SAFETY: pointers address live buffers of at least the sizes the kernel touches:
        // x has k floats, w has n*k weights, out has n floats (or the QKV scatter targets),
        // best (when non-zero) one u64.
        let mut args = kernel_args![
            &out, &x, &w, &bias, &n, &k, &ln.0, &ln.1, &mode, &c, &pos, &kv.0, &kv.1, &best
        ];
        unsafe { self.launch(&self.exec.kernels.matvec, cfg, &mut args) }
            .map_err(device_err("matvec"))
    }

    /// Y = X W^T (+ epilogue) for `rows` rows at positions start..start+rows.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        out: u64,
        x: u64,
        w: u64,
        bias: u64,
        rows: usize,
        n: usize,
        k: usize,
        mode: i32,
        start: usize,
        kv: (u64, u64),
        out_stride: usize,
    ) -> Result<(), Gpt2Error> {
        if profile_skip("gemm") {
            return Ok(());
        }
        if let Some(blas) = &self.blas {
            // Tensor cores for bf16 weights (activations rounded to bf16), exact f32 otherwise.
            return self.blas_matmul(
                blas,
                out,
                x,
                w,
                bias,
                (rows, n, k),
                mode,
                start,
                kv,
                out_stride,
            );
        }
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(64) as u32, rows.div_ceil(64) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, n, k) = (rows as i32, n as i32, k as i32);
        let (c, start, stride) = (
            self.exec.config.n_embd as i32,
            start as i32,
            out_stride as i32,
        );
        // SAFETY: x has rows*k floats, w n*k weights, out rows*out_stride floats (or the QKV
        // targets, with start+rows <= capacity checked by the caller).
        let mut args = kernel_args![
            &out, &x, &w, &bias, &rows, &n, &k, &mode, &c, &start, &kv.0, &kv.1, &stride
        ];
        unsafe { self.launch(&self.exec.kernels.matmul, cfg, &mut args) }
            .map_err(device_err("matmul"))
    }

    /// `out = epilogue(W x + b)` through cuBLAS for f32 activations `x`: (bf16 copies of them,)
    /// GEMM into scratch, then our epilogue kernel (or straight into `out` for a plain store).
    #[allow(clippy::too_many_arguments)]
    fn blas_matmul(
        &self,
        blas: &Blas,
        out: u64,
        x: u64,
        w: u64,
        bias: u64,
        (rows, n, k): (usize, usize, usize),
        mode: i32,
        start: usize,
        kv: (u64, u64),
        out_stride: usize,
    ) -> Result<(), Gpt2Error> {
        let x = match self.exec.dtype {
            GpuDtype::F32 => x,
            GpuDtype::Bf16 => {
                self.to_bf16(blas.x_bf16_ptr, x, rows * k)?;
                blas.x_bf16_ptr
            }
        };
        if mode == EPI_STORE && bias == 0 {
            return self.gemm(blas, w, x, (rows, n, k), (out, out_stride), false);
        }
        self.gemm(blas, w, x, (rows, n, k), (blas.tmp.ptr, n), false)?;
        self.epilogue(
            blas,
            (out, false),
            bias,
            (rows, n),
            mode,
            start,
            kv,
            out_stride,
        )
    }

    /// `count` f32 values at `x` as bf16 at `out`.
    fn to_bf16(&self, out: u64, x: u64, count: usize) -> Result<(), Gpt2Error> {
        let cfg = LaunchConfig {
            grid_dim: (count.div_ceil(256).min(4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let count = count as i32;
        let mut args = kernel_args![&out, &x, &count];
        // SAFETY: the caller passes buffers of at least `count` f32 / u16 values.
        unsafe { self.launch(&self.exec.kernels.to_bf16, cfg, &mut args) }
            .map_err(device_err("to bf16"))
    }

    /// cuBLAS: `dst[rows, ldc] (+)= x[rows, k] W[n, k]^T`, f32 results; `x` is in the weights'
    /// type (bf16 tensor cores in bf16 mode). `accumulate` adds to what `dst` holds (residuals).
    fn gemm(
        &self,
        blas: &Blas,
        w: u64,
        x: u64,
        (rows, n, k): (usize, usize, usize),
        (dst, ldc): (u64, usize),
        accumulate: bool,
    ) -> Result<(), Gpt2Error> {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
        };
        if profile_skip("gemm") {
            return Ok(());
        }
        let dtype = match self.exec.dtype {
            GpuDtype::F32 => cudaDataType::CUDA_R_32F,
            GpuDtype::Bf16 => cudaDataType::CUDA_R_16BF,
        };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // Row-major out[rows, n] = x[rows, k] W[n, k]^T is column-major out^T = W x^T.
        // SAFETY: pointers cover W (n*k), x (rows*k) and the destination (rows*ldc); scalars are
        // host f32 as CUBLAS_COMPUTE_32F expects.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                blas.handle,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                rows as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                dtype,
                k as i32,
                x as *const std::ffi::c_void,
                dtype,
                k as i32,
                (&beta as *const f32).cast(),
                dst as *mut std::ffi::c_void,
                cudaDataType::CUDA_R_32F,
                ldc as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| Gpt2Error::Device(format!("cuBLAS GEMM: {e:?}")))
    }

    /// A bf16 product through cuBLASLt with its epilogue fused, pointers `(w, x, bias, dst)`.
    /// Ok(false) when not in bf16 mode, without cuBLASLt, or when it has no algorithm for the
    /// shape: the caller then takes the cuBLAS + epilogue-kernel path.
    fn lt_matmul(
        &self,
        blas: &Blas,
        shape: Shape,
        ptrs: (u64, u64, u64, u64),
    ) -> Result<bool, Gpt2Error> {
        let Some(lt) = blas
            .lt
            .as_ref()
            .filter(|_| self.exec.dtype == GpuDtype::Bf16)
        else {
            return Ok(false);
        };
        if profile_skip("gemm") {
            return Ok(true);
        }
        // SAFETY: the callers pass the session's buffers and the layer's weights, which cover
        // the shape (x: rows*k bf16, W: n*k, bias: n, dst: rows*ldc) and outlive the stream work.
        unsafe { lt.matmul(self.stream.cu_stream() as _, shape, ptrs) }.map_err(Gpt2Error::Device)
    }

    /// Bias + epilogue over the GEMM scratch (`rows` x `n`) into `out` (bf16 when `out.1`).
    #[allow(clippy::too_many_arguments)]
    fn epilogue(
        &self,
        blas: &Blas,
        (out, out_bf16): (u64, bool),
        bias: u64,
        (rows, n): (usize, usize),
        mode: i32,
        start: usize,
        kv: (u64, u64),
        out_stride: usize,
    ) -> Result<(), Gpt2Error> {
        if profile_skip("epi") {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(1024) as u32, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, n, c) = (rows as i32, n as i32, self.exec.config.n_embd as i32);
        let (start, stride, obf) = (start as i32, out_stride as i32, i32::from(out_bf16));
        let mut args = kernel_args![
            &out,
            &blas.tmp.ptr,
            &bias,
            &rows,
            &n,
            &mode,
            &c,
            &start,
            &kv.0,
            &kv.1,
            &stride,
            &obf
        ];
        // SAFETY: tmp holds rows*n floats; out rows*out_stride values (or the KV targets,
        // start+rows <= capacity).
        unsafe { self.launch(&self.exec.kernels.gemm_epilogue, cfg, &mut args) }
            .map_err(device_err("GEMM epilogue"))
    }

    /// LayerNorm of `rows` rows of `x` into `out` (bf16 when `out.1`); with `pre_bias` != 0,
    /// first `x += pre_bias` (written back).
    fn layernorm(
        &self,
        (out, out_bf16): (u64, bool),
        x: u64,
        (w, b): (u64, u64),
        pre_bias: u64,
        rows: usize,
    ) -> Result<(), Gpt2Error> {
        if profile_skip("ln") {
            return Ok(());
        }
        // one warp per row
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (c, obf) = (self.exec.config.n_embd as i32, i32::from(out_bf16));
        let rows = rows as i32;
        // SAFETY: out and x hold rows*C values; w, b and pre_bias (if any) hold C weights.
        let mut args = kernel_args![&out, &x, &w, &b, &pre_bias, &c, &obf, &rows];
        unsafe { self.launch(&self.exec.kernels.layernorm, cfg, &mut args) }
            .map_err(device_err("layernorm"))
    }

    /// `x[r, :] += bias` for `rows` rows.
    fn add_bias(&self, x: u64, bias: u64, rows: usize) -> Result<(), Gpt2Error> {
        let c = self.exec.config.n_embd;
        let cfg = LaunchConfig {
            grid_dim: ((rows * c).div_ceil(256).min(4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, c) = (rows as i32, c as i32);
        // SAFETY: x holds rows*C floats, bias C weights.
        let mut args = kernel_args![&x, &bias, &rows, &c];
        unsafe { self.launch(&self.exec.kernels.add_bias, cfg, &mut args) }
            .map_err(device_err("bias"))
    }

    fn embed(&self, rows: usize, start: i32) -> Result<(), Gpt2Error> {
        let w = &self.exec.weights;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let c = self.exec.config.n_embd as i32;
        // SAFETY: token ids were checked < vocab and positions < n_ctx before upload; next
        // holds one u64.
        let mut args = kernel_args![
            &self.x.ptr,
            &self.tokens_ptr,
            &w.wte.ptr,
            &w.wpe.ptr,
            &c,
            &start,
            &self.pos_ptr,
            &self.next_ptr
        ];
        unsafe { self.launch(&self.exec.kernels.embed, cfg, &mut args) }
            .map_err(device_err("embed"))
    }

    /// The kernels of one decode step (token in tokens[0], position in pos[0]).
    fn decode_kernels(&self) -> Result<(), Gpt2Error> {
        let cfg = self.exec.config;
        let w = &self.exec.weights;
        let c = cfg.n_embd;
        // Profiling aid: WASI_NN_HOST_SKIP=attn,qkv,proj,mlp,head leaves kernels out of the
        // captured step (the numbers are then wrong; only the timing means something).
        let skip = profile_skip;
        self.embed(1, -1)?;
        for (l, lw) in w.layers.iter().enumerate() {
            let kv = self.kv_layer(l);
            let none = (0, 0);
            if self.exec.gpu.clusters.is_some() {
                if !skip("attn") {
                    self.qkv_attention(lw, kv)?;
                }
            } else if !skip("qkv") {
                self.matvec(
                    self.qkv.ptr,
                    self.x.ptr,
                    lw.qkv_w.ptr,
                    lw.qkv_b.ptr,
                    3 * c,
                    c,
                    (lw.ln1_w.ptr, lw.ln1_b.ptr),
                    EPI_QKV,
                    kv,
                )?;
            }
            if !skip("attn") && self.exec.gpu.clusters.is_none() {
                self.decode_attention(kv)?;
            }
            if !skip("proj") {
                self.matvec(
                    self.x.ptr,
                    self.h.ptr,
                    lw.proj_w.ptr,
                    lw.proj_b.ptr,
                    c,
                    c,
                    none,
                    EPI_RESIDUAL,
                    none,
                )?;
            }
            if !skip("mlp") {
                self.matvec(
                    self.fc.ptr,
                    self.x.ptr,
                    lw.fc_w.ptr,
                    lw.fc_b.ptr,
                    4 * c,
                    c,
                    (lw.ln2_w.ptr, lw.ln2_b.ptr),
                    EPI_GELU,
                    none,
                )?;
                self.matvec(
                    self.x.ptr,
                    self.fc.ptr,
                    lw.fc_proj_w.ptr,
                    lw.fc_proj_b.ptr,
                    c,
                    4 * c,
                    none,
                    EPI_RESIDUAL,
                    none,
                )?;
            }
        }
        if !skip("head") {
            self.lm_head(self.x.ptr)?;
        }
        Ok(())
    }

    /// LayerNorm, QKV product and attention of one decode step in one kernel: a cluster of
    /// blocks per head (sm_90+); the new key and value are appended to the cache at pos[0]
    /// and the attention output goes to h.
    fn qkv_attention(&self, lw: &DevLayer, kv: (u64, u64)) -> Result<(), Gpt2Error> {
        let cfg = self.exec.config;
        let c = cfg.n_embd;
        let chosen = self.exec.gpu.clusters.ok_or_else(|| {
            Gpt2Error::Device("the fused decode attention needs sm_90 clusters".into())
        })?;
        // 8 blocks per head; 128 threads for f32 weights past 124M's width (its 142 registers
        // a thread would leave one 256-thread block per SM: measured slower there)
        let wide_f32 = self.exec.dtype == GpuDtype::F32 && c > 768;
        let (cluster, threads) = chosen.unwrap_or(if wide_f32 { (8, 128) } else { (8, 256) });
        let grid = LaunchConfig {
            grid_dim: (cluster, cfg.n_head as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: ((c + self.capacity.div_ceil(cluster as usize)) * 4) as u32,
        };
        let (c32, hd32) = (c as i32, cfg.head_dim() as i32);
        // SAFETY: x holds C floats and h C floats; the weights are [3C, C] and [3C]; the
        // position is < capacity (checked before the step), so the cache rows exist; shared
        // memory holds C + ceil(capacity / cluster) floats, the kernel's need.
        let mut args = kernel_args![
            &self.h.ptr,
            &self.x.ptr,
            &lw.qkv_w.ptr,
            &lw.qkv_b.ptr,
            &lw.ln1_w.ptr,
            &lw.ln1_b.ptr,
            &kv.0,
            &kv.1,
            &self.pos_ptr,
            &c32,
            &hd32
        ];
        let func = &self.exec.kernels.decode_qkv_att;
        unsafe { self.launch_cluster(func, grid, cluster, &mut args) }
            .map_err(device_err("QKV + attention"))
    }

    /// Attention of the query in qkv[0..C] over positions 0..=pos of one layer's cache,
    /// split across blocks, then combined into h.
    fn decode_attention(&self, kv: (u64, u64)) -> Result<(), Gpt2Error> {
        let cfg = self.exec.config;
        let (c32, hd32, chunks) = (
            cfg.n_embd as i32,
            cfg.head_dim() as i32,
            self.max_chunks as i32,
        );
        let grid = LaunchConfig {
            grid_dim: (cfg.n_head as u32, self.max_chunks as u32, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the position is < capacity (checked before the step); the partial
        // buffer holds n_head * max_chunks * (hd + 2) floats.
        let mut args = kernel_args![
            &self.partial.ptr,
            &self.qkv.ptr,
            &kv.0,
            &kv.1,
            &self.pos_ptr,
            &c32,
            &hd32,
            &chunks
        ];
        unsafe { self.launch(&self.exec.kernels.att_partial, grid, &mut args) }
            .map_err(device_err("attention"))?;
        let grid = LaunchConfig {
            grid_dim: (cfg.n_head as u32, 1, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: (self.max_chunks * 4) as u32,
        };
        // SAFETY: as above; h holds C floats.
        let mut args = kernel_args![
            &self.h.ptr,
            &self.partial.ptr,
            &self.pos_ptr,
            &hd32,
            &chunks
        ];
        unsafe { self.launch(&self.exec.kernels.att_combine, grid, &mut args) }
            .map_err(device_err("attention"))
    }

    /// One decode step through the captured graph (captured on first use).
    fn decode(&mut self, token: u32) -> Result<(), Gpt2Error> {
        let err = device_err("decode step");
        self.upload_ids(Some(self.len), &[token as i32])?;
        if self.graph.is_none()
            && !self.graph_failed
            && std::env::var_os("WASI_NN_HOST_NO_GRAPH").is_none()
        {
            match self.capture("decode graph", Self::decode_kernels) {
                Ok(graph) => self.graph = graph,
                Err(e) => {
                    // Run this session's steps kernel by kernel instead of failing the request.
                    tracing::warn!("decode graph capture failed, running without a graph: {e}");
                    self.graph_failed = true;
                }
            }
        }
        match &self.graph {
            Some(graph) => graph.launch().map_err(&err),
            None => self.decode_kernels(),
        }
    }

    /// The launches of `launches` captured on the session's stream as a graph (None: nothing
    /// was launched). Holds the setup lock (see [`Gpu::setup`]).
    fn capture(
        &self,
        what: &str,
        launches: impl FnOnce(&Self) -> Result<(), Gpt2Error>,
    ) -> Result<Option<CudaGraph>, Gpt2Error> {
        let gpu = self.exec.gpu.clone();
        let _setup = gpu.setup_lock();
        let err = device_err(what);
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(&err)?;
        let launched = launches(self);
        // the capture is ended whatever the launches did
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        launched.and(graph.map_err(&err))
    }

    /// A batched prefill of `tokens` at positions len..len+n.
    fn prefill(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), Gpt2Error> {
        let cfg = self.exec.config;
        let (n, start) = (tokens.len(), self.len);
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        if all_positions && self.all_logits.is_none() {
            self.all_logits = Some(Buf::new(
                &self.stream,
                self.capacity * cfg.vocab_size,
                "logits of every position",
            )?);
        }
        let key = (n, all_positions);
        if self.prefill_graphable() {
            let cached = self.prefill_graphs.iter().position(|(k, _)| *k == key);
            let graphed = cached.is_some() || self.prefill_seen.contains(&key);
            // a captured prefill reads its first position from ids[0]
            self.upload_ids(graphed.then_some(start), &ids)?;
            if let Some(i) = cached {
                // most recently used last
                let entry = self.prefill_graphs.remove(i);
                let launched = entry.1.launch().map_err(device_err("prefill graph"));
                self.prefill_graphs.push(entry);
                return launched;
            }
            if graphed {
                if let Some(graph) = self.capture_prefill(n, all_positions) {
                    graph.launch().map_err(device_err("prefill graph"))?;
                    if self.prefill_graphs.len() >= PREFILL_GRAPHS {
                        self.prefill_graphs.remove(0);
                    }
                    self.prefill_graphs.push((key, graph));
                    return Ok(());
                }
            } else {
                if self.prefill_seen.len() >= 2 * PREFILL_GRAPHS {
                    self.prefill_seen.remove(0);
                }
                self.prefill_seen.push(key);
            }
        } else {
            self.upload_ids(None, &ids)?;
        }
        self.prefill_kernels(n, start, all_positions, false)
    }

    /// Upload token ids to ids[1..], and with `first` the position to ids[0], in one copy.
    fn upload_ids(&mut self, first: Option<usize>, tokens: &[i32]) -> Result<(), Gpt2Error> {
        let err = device_err("uploading token ids");
        match first {
            Some(pos) => {
                let mut all = Vec::with_capacity(tokens.len() + 1);
                all.push(pos as i32);
                all.extend_from_slice(tokens);
                let mut dst = self.ids.slice_mut(0..all.len());
                self.stream.memcpy_htod(&all, &mut dst).map_err(err)
            }
            None => {
                let mut dst = self.ids.slice_mut(1..1 + tokens.len());
                self.stream.memcpy_htod(tokens, &mut dst).map_err(err)
            }
        }
    }

    /// Whether prefills may be captured as graphs: the bf16 path whose every kernel takes the
    /// first position from device memory (cuBLASLt QKV, tensor-core attention), and not
    /// turned off (`WASI_NN_HOST_NO_GRAPH`, or [`Self::set_prefill_graphs`]).
    fn prefill_graphable(&self) -> bool {
        self.prefill_graphs_on
            && !self.graph_failed
            && self.tensor_core_attention()
            && self.blas.as_ref().is_some_and(|b| b.lt.is_some())
            && std::env::var_os("WASI_NN_HOST_NO_GRAPH").is_none()
            && std::env::var_os("WASI_NN_HOST_NO_FRESH_KV").is_none()
    }

    /// Capture the prefill of `n` tokens (ids in ids[1..], the first position in ids[0]) as a
    /// graph; None (and no more prefill graphs for this session) when capture fails.
    fn capture_prefill(&mut self, n: usize, all_positions: bool) -> Option<CudaGraph> {
        let launches = |s: &Self| s.prefill_kernels(n, 0, all_positions, true);
        match self.capture("prefill graph", launches) {
            Ok(graph) => graph,
            Err(e) => {
                tracing::warn!("prefill graph capture failed, running prefills eagerly: {e}");
                self.prefill_graphs_on = false;
                None
            }
        }
    }

    /// The launches of a prefill of the `n` ids in `tokens` at positions start..start+n
    /// (with `graphed`, the kernels read the first position from ids[0] instead: a graph).
    fn prefill_kernels(
        &self,
        n: usize,
        start: usize,
        all_positions: bool,
        graphed: bool,
    ) -> Result<(), Gpt2Error> {
        let (cfg, c) = (self.exec.config, self.exec.config.n_embd);
        self.embed(n, if graphed { -1 } else { start as i32 })?;
        let w = &self.exec.weights;
        if let Some(blas) = &self.blas {
            // The last layer's MLP bias is still to be added to the rows that are read next.
            let pending = self.prefill_layers_blas(blas, n, start, graphed)?;
            if pending != 0 {
                let first = if all_positions { 0 } else { n - 1 };
                self.add_bias(self.x.ptr + (first * c * 4) as u64, pending, n - first)?;
            }
        } else {
            self.prefill_layers_tiled(n, start)?;
        }
        if let Some(all) = self.all_logits.as_ref().filter(|_| all_positions) {
            let (v, lnf) = (cfg.vocab_size, (w.lnf_w.ptr, w.lnf_b.ptr));
            if let Some(blas) = &self.blas {
                // the final LayerNorm writes the head product's input in the weights' type
                let bf16 = self.exec.dtype == GpuDtype::Bf16;
                let a = if bf16 { blas.x_bf16_ptr } else { self.h.ptr };
                self.layernorm((a, bf16), self.x.ptr, lnf, 0, n)?;
                self.gemm(blas, w.wte.ptr, a, (n, v, c), (all.ptr, v), false)?;
            } else {
                let (h, none) = (self.h.ptr, (0, 0));
                self.layernorm((h, false), self.x.ptr, lnf, 0, n)?;
                self.matmul(all.ptr, h, w.wte.ptr, 0, n, v, c, EPI_STORE, start, none, v)?;
            }
        }
        self.lm_head(self.x.ptr + ((n - 1) * c * 4) as u64)
    }

    /// The layers of a prefill through cuBLAS: LayerNorm and the attention and GELU epilogues
    /// write the next GEMM's input directly (bf16 in bf16 mode); the projections accumulate
    /// into the residual stream (beta = 1) and their bias is added by the next LayerNorm.
    /// Returns the bias still pending on `x` (the last layer's MLP projection bias).
    fn prefill_layers_blas(
        &self,
        blas: &Blas,
        n: usize,
        start: usize,
        graphed: bool,
    ) -> Result<u64, Gpt2Error> {
        let c = self.exec.config.n_embd;
        let bf16 = self.exec.dtype == GpuDtype::Bf16;
        let (a_c, a_4c) = if bf16 {
            (blas.x_bf16_ptr, blas.fc_bf16_ptr)
        } else {
            (self.h.ptr, self.fc.ptr)
        };
        let (x, tmp, none) = (self.x.ptr, blas.tmp.ptr, (0, 0));
        let mut pending = 0;
        for (l, lw) in self.exec.weights.layers.iter().enumerate() {
            let kv = self.kv_layer(l);
            self.layernorm((a_c, bf16), x, (lw.ln1_w.ptr, lw.ln1_b.ptr), pending, n)?;
            // QKV with its bias through cuBLASLt into bf16 rows, the tensor-core attention
            // reading queries, keys and values from them and appending the keys and values to
            // the cache; else a product, then a pass adding the bias and scattering keys and
            // values into the cache
            let qkv_lt = Shape {
                out_bf16: true,
                ..Shape::new((n, 3 * c, c), Epilogue::Bias)
            };
            let qkv_args = (lw.qkv_w.ptr, a_c, lw.qkv_b.ptr, blas.qkv_bf16_ptr);
            let fresh = (self.tensor_core_attention()
                && std::env::var_os("WASI_NN_HOST_NO_FRESH_KV").is_none()
                && self.lt_matmul(blas, qkv_lt, qkv_args)?)
            .then_some(blas.qkv_bf16_ptr);
            if fresh.is_none() && graphed {
                return Err(Gpt2Error::Device(
                    "no cuBLASLt plan for the QKV product: the prefill cannot be captured".into(),
                ));
            }
            if fresh.is_none() {
                self.gemm(blas, lw.qkv_w.ptr, a_c, (n, 3 * c, c), (tmp, 3 * c), false)?;
                let (qkv, qkv_b) = ((self.qkv.ptr, false), lw.qkv_b.ptr);
                self.epilogue(blas, qkv, qkv_b, (n, 3 * c), EPI_QKV, start, kv, 3 * c)?;
            }
            let first = if graphed {
                Start::Device
            } else {
                Start::Host(start)
            };
            self.prefill_attention(kv, first, n, (a_c, bf16), fresh)?;
            // projection into the residual stream: with its bias (cuBLASLt), or the bias is
            // left to the next LayerNorm
            let proj = (lw.proj_w.ptr, a_c, lw.proj_b32.ptr, x);
            let mut pre_bias = lw.proj_b.ptr;
            let residual = |k| Shape {
                accumulate: true,
                bias_bf16: false,
                ..Shape::new((n, c, k), Epilogue::Bias)
            };
            if self.lt_matmul(blas, residual(c), proj)? {
                pre_bias = 0;
            } else {
                self.gemm(blas, lw.proj_w.ptr, a_c, (n, c, c), (x, c), true)?;
            }
            let ln2 = (lw.ln2_w.ptr, lw.ln2_b.ptr);
            self.layernorm((a_c, bf16), x, ln2, pre_bias, n)?;
            let fc = (lw.fc_w.ptr, a_c, lw.fc_b.ptr, a_4c);
            let gelu = Shape {
                out_bf16: true,
                ..Shape::new((n, 4 * c, c), Epilogue::GeluBias)
            };
            if !self.lt_matmul(blas, gelu, fc)? {
                self.gemm(blas, lw.fc_w.ptr, a_c, (n, 4 * c, c), (tmp, 4 * c), false)?;
                let fc = (a_4c, bf16);
                self.epilogue(
                    blas,
                    fc,
                    lw.fc_b.ptr,
                    (n, 4 * c),
                    EPI_GELU,
                    start,
                    none,
                    4 * c,
                )?;
            }
            let fp = (lw.fc_proj_w.ptr, a_4c, lw.fc_proj_b32.ptr, x);
            if self.lt_matmul(blas, residual(4 * c), fp)? {
                pending = 0;
            } else {
                self.gemm(blas, lw.fc_proj_w.ptr, a_4c, (n, c, 4 * c), (x, c), true)?;
                pending = lw.fc_proj_b.ptr;
            }
        }
        Ok(pending)
    }

    /// The layers of a prefill on our tiled matrix kernel (no cuBLAS), f32 activations.
    fn prefill_layers_tiled(&self, n: usize, start: usize) -> Result<(), Gpt2Error> {
        let c = self.exec.config.n_embd;
        let (x, h, none) = (self.x.ptr, self.h.ptr, (0, 0));
        for (l, lw) in self.exec.weights.layers.iter().enumerate() {
            let kv = self.kv_layer(l);
            self.layernorm((h, false), x, (lw.ln1_w.ptr, lw.ln1_b.ptr), 0, n)?;
            let (qkv_w, qkv_b) = (lw.qkv_w.ptr, lw.qkv_b.ptr);
            self.matmul(
                self.qkv.ptr,
                h,
                qkv_w,
                qkv_b,
                n,
                3 * c,
                c,
                EPI_QKV,
                start,
                kv,
                3 * c,
            )?;
            self.prefill_attention(kv, Start::Host(start), n, (h, false), None)?;
            let (proj_w, proj_b) = (lw.proj_w.ptr, lw.proj_b.ptr);
            self.matmul(x, h, proj_w, proj_b, n, c, c, EPI_RESIDUAL, start, none, c)?;
            self.layernorm((h, false), x, (lw.ln2_w.ptr, lw.ln2_b.ptr), 0, n)?;
            let (fc, fc_w, fc_b) = (self.fc.ptr, lw.fc_w.ptr, lw.fc_b.ptr);
            self.matmul(fc, h, fc_w, fc_b, n, 4 * c, c, EPI_GELU, start, none, 4 * c)?;
            let (fp_w, fp_b) = (lw.fc_proj_w.ptr, lw.fc_proj_b.ptr);
            self.matmul(x, fc, fp_w, fp_b, n, c, 4 * c, EPI_RESIDUAL, start, none, c)?;
        }
        Ok(())
    }

    /// Causal attention of `n` new rows at positions start.. (q in qkv, keys in the cache).
    /// Causal attention of `n` new rows into `out` (bf16 when `out.1`).
    fn prefill_attention(
        &self,
        kv: (u64, u64),
        start: Start,
        n: usize,
        (out, out_bf16): (u64, bool),
        fresh: Option<u64>,
    ) -> Result<(), Gpt2Error> {
        if profile_skip("pattn") {
            return Ok(());
        }
        if (fresh.is_some() || start == Start::Device) && !self.tensor_core_attention() {
            return Err(Gpt2Error::Device(
                "keys and values from the QKV rows, or the first position from device memory, need the tensor-core attention".into(),
            ));
        }
        let (start, start_ptr) = match start {
            Start::Host(start) => (start, 0u64),
            Start::Device => (0, self.pos_ptr),
        };
        if out_bf16 && !self.tensor_core_attention() {
            self.prefill_attention(kv, Start::Host(start), n, (self.h.ptr, false), None)?;
            return self.to_bf16(out, self.h.ptr, n * self.exec.config.n_embd);
        }
        let cfg = self.exec.config;
        let hd = cfg.head_dim();
        let (start32, n32, c32, hd32) = (start as i32, n as i32, cfg.n_embd as i32, hd as i32);
        if self.tensor_core_attention() {
            let obf = i32::from(out_bf16);
            let mut grid = LaunchConfig {
                grid_dim: (cfg.n_head as u32, n.div_ceil(64) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            if let Some(qkv) = fresh {
                grid.shared_mem_bytes = FA_SMEM_BYTES;
                let mut args =
                    kernel_args![&out, &qkv, &kv.0, &kv.1, &start32, &n32, &c32, &obf, &start_ptr];
                // SAFETY: start + n <= capacity (checked in extend); qkv holds n bf16 rows of
                // 3C, out n rows of C; the kernel reads cache rows 0..start and writes rows
                // start..start+n of head columns h*64.. < C.
                return unsafe {
                    self.launch(&self.exec.kernels.att_prefill_fresh, grid, &mut args)
                }
                .map_err(device_err("attention"));
            }
            let q = self.qkv.ptr;
            let mut args =
                kernel_args![&out, &q, &kv.0, &kv.1, &start32, &n32, &c32, &obf, &start_ptr];
            // SAFETY: start + n <= capacity (checked in extend); qkv holds n rows of 3C, out n
            // rows of C; the kernel reads cache rows 0..start+n of head columns h*64.. < C.
            return unsafe { self.launch(&self.exec.kernels.att_prefill_mma, grid, &mut args) }
                .map_err(device_err("attention"));
        }
        if hd <= 64 && std::env::var_os("WASI_NN_HOST_NO_TILED_ATTENTION").is_none() {
            let grid = LaunchConfig {
                grid_dim: (cfg.n_head as u32, n.div_ceil(32) as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = kernel_args![
                &out,
                &self.qkv.ptr,
                &kv.0,
                &kv.1,
                &start32,
                &n32,
                &c32,
                &hd32
            ];
            // SAFETY: start + n <= capacity (checked in extend); qkv holds n rows of 3C, h n rows of C.
            return unsafe { self.launch(&self.exec.kernels.att_prefill_tiled, grid, &mut args) }
                .map_err(device_err("attention"));
        }
        let grid = LaunchConfig {
            grid_dim: (cfg.n_head as u32, n as u32, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: ((start + n) * 4) as u32,
        };
        let mut args = kernel_args![&out, &self.qkv.ptr, &kv.0, &kv.1, &start32, &c32, &hd32];
        // SAFETY: start + n <= capacity (checked in extend); scores fit the shared memory
        // asked for; h holds n*C floats.
        unsafe { self.launch(&self.exec.kernels.att_prefill, grid, &mut args) }
            .map_err(device_err("attention"))
    }

    /// Whether prefill attention runs on tensor cores (bf16 mode, head size 64, sm_80+;
    /// `WASI_NN_HOST_NO_TC_ATTENTION` turns it off).
    fn tensor_core_attention(&self) -> bool {
        self.exec.dtype == GpuDtype::Bf16
            && self.exec.config.head_dim() == 64
            && self.exec.gpu.tensor_cores
            && std::env::var_os("WASI_NN_HOST_NO_TC_ATTENTION").is_none()
    }

    /// Wait for the session's stream (for timing).
    pub fn synchronize(&self) -> Result<(), Gpt2Error> {
        self.stream.synchronize().map_err(device_err("synchronize"))
    }

    /// Turn the capture of repeated prefill shapes on or off (benchmarks of the eager path).
    pub fn set_prefill_graphs(&mut self, on: bool) {
        self.prefill_graphs_on = on;
        if !on {
            self.prefill_graphs.clear();
            self.prefill_seen.clear();
        }
    }

    /// GPU time of a prefill of `tokens` from position 0, without the host's launch costs: the
    /// prefill's launches captured once as a CUDA graph, replayed `iters` times (benchmarks).
    pub fn prefill_gpu_ms(&mut self, tokens: &[u32], iters: usize) -> Result<f64, Gpt2Error> {
        let err = device_err("prefill graph");
        self.len = 0;
        self.check(tokens.len())?;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        self.upload_ids(None, &ids)?;
        self.stream.synchronize().map_err(&err)?;
        let graph = self
            .capture("prefill graph", |s| {
                s.prefill_kernels(tokens.len(), 0, false, false)
            })?
            .ok_or_else(|| Gpt2Error::Device("empty prefill graph".into()))?;
        graph.launch().map_err(&err)?;
        self.stream.synchronize().map_err(&err)?;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            graph.launch().map_err(&err)?;
        }
        self.stream.synchronize().map_err(&err)?;
        self.len = tokens.len();
        Ok(t.elapsed().as_secs_f64() * 1e3 / iters.max(1) as f64)
    }

    /// Run one decode step without copying logits back (benchmarks of the GPU part alone).
    pub fn decode_only(&mut self, token: u32) -> Result<(), Gpt2Error> {
        self.check(1)?;
        self.decode(token)?;
        self.len += 1;
        Ok(())
    }

    fn check(&self, n: usize) -> Result<(), Gpt2Error> {
        if self.len + n > self.capacity {
            return Err(Gpt2Error::Device(format!(
                "sequence of {} tokens exceeds this context's KV capacity of {} positions",
                self.len + n,
                self.capacity
            )));
        }
        Ok(())
    }
}

impl Session for CudaSession {
    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) {
        // Positions past `len` are simply overwritten by the next step.
        self.len = self.len.min(len);
    }

    fn extend(&mut self, tokens: &[u32], all_positions: bool) -> Result<(), Gpt2Error> {
        let vocab = self.exec.config.vocab_size;
        if tokens.is_empty() {
            return Err(Gpt2Error::EmptySequence);
        }
        self.check(tokens.len())?;
        if tokens.iter().any(|&t| t as usize >= vocab) {
            return Err(Gpt2Error::Device("token id outside the vocabulary".into()));
        }
        if tokens.len() == 1 && !all_positions {
            self.decode(tokens[0])?;
        } else {
            self.prefill(tokens, all_positions)?;
        }
        self.all_rows = if all_positions { tokens.len() } else { 0 };
        self.len += tokens.len();
        Ok(())
    }

    fn last_logits(&mut self) -> Result<Vec<f32>, Gpt2Error> {
        let vocab = self.exec.config.vocab_size;
        self.read(vocab, false)
    }

    fn all_logits(&mut self) -> Result<Vec<f32>, Gpt2Error> {
        let count = self.all_rows * self.exec.config.vocab_size;
        self.read(count, true)
    }

    fn argmax(&mut self) -> Result<u32, Gpt2Error> {
        let err = device_err("reading the argmax");
        let mut out = [0u64; 1];
        self.stream
            .memcpy_dtoh(&self.next, &mut out)
            .map_err(&err)?;
        self.stream.synchronize().map_err(&err)?;
        Ok(argmax_row(out[0]))
    }
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        // Free the graph and cuBLAS under the set-up lock; the buffers follow (stream-ordered).
        let gpu = self.exec.gpu.clone();
        let _setup = gpu.setup_lock();
        let _ = self.stream.synchronize();
        self.graph = None;
        self.blas = None;
    }
}

impl CudaSession {
    /// Copy `count` logits back (from the all-position buffer when `all`) and wait for them.
    fn read(&self, count: usize, all: bool) -> Result<Vec<f32>, Gpt2Error> {
        let err = device_err("reading logits");
        let src = match (&self.all_logits, all) {
            (Some(buf), true) => &buf.slice,
            (None, true) => return Ok(Vec::new()),
            _ => &self.logits.slice,
        };
        let mut out = vec![0.0f32; count];
        self.stream
            .memcpy_dtoh(&src.slice(0..count), &mut out)
            .map_err(&err)?;
        self.stream.synchronize().map_err(&err)?;
        Ok(out)
    }
}

/// The row an LM head's argmax key names (`argmax_key` in matvec.cu: the value's
/// order-preserving bits above the complement of the row); 0 when no row set it (every logit NaN).
fn argmax_row(key: u64) -> u32 {
    if key == 0 {
        0
    } else {
        u32::MAX - key as u32
    }
}

/// Print the GPU's name and whether it can be used; for diagnostics.
pub fn describe() -> Result<String, Gpt2Error> {
    let gpu = Gpu::get()?;
    let (free, total) = gpu.ctx.mem_get_info().map_err(device_err("memory info"))?;
    Ok(format!(
        "{} ({} MiB free of {} MiB)",
        gpu.name(),
        free >> 20,
        total >> 20
    ))
}

/// The dtype a weight tensor would have on the GPU, and the bytes of all weights.
pub fn weight_bytes(config: &Gpt2Config, dtype: GpuDtype) -> usize {
    config.num_params()
        * match dtype {
            GpuDtype::F32 => 4,
            GpuDtype::Bf16 => 2,
        }
}

/// Each kernel alone against the CPU reference functions, on fresh random inputs of several
/// sizes (`wasi-nn-host check-cuda` and `tests/tests/cuda.rs` run it). For bf16 weights the
/// reference uses the same bf16-rounded weights, so both sides multiply the same numbers.
pub mod kernel_checks {
    use super::*;
    use crate::cpu;
    use crate::model::random_weights;
    use rand::{Rng, SeedableRng};

    /// One kernel on one size: the worst `|gpu - cpu| / max(1, |cpu|)`.
    #[derive(Debug, Clone, serde::Serialize)]
    pub struct KernelReport {
        pub kernel: String,
        pub dtype: String,
        pub size: String,
        pub max_error: f32,
        pub tolerance: f32,
        pub passed: bool,
    }

    fn bf16_round(v: &[f32]) -> Vec<f32> {
        v.iter()
            .map(|x| half::bf16::from_f32(*x).to_f32())
            .collect()
    }

    use crate::gpu_check::scaled_error;

    struct Bench<'a> {
        s: &'a mut CudaSession,
        rng: rand_chacha::ChaCha8Rng,
    }

    impl Bench<'_> {
        fn random(&mut self, n: usize) -> Vec<f32> {
            (0..n)
                .map(|_| self.rng.random::<f32>() * 2.0 - 1.0)
                .collect()
        }
        fn put(
            &mut self,
            which: fn(&mut CudaSession) -> &mut CudaSlice<f32>,
            values: &[f32],
        ) -> Result<(), Gpt2Error> {
            let stream = self.s.stream.clone();
            let mut dst = which(self.s).slice_mut(0..values.len());
            stream
                .memcpy_htod(values, &mut dst)
                .map_err(device_err("upload"))
        }
        fn get(
            &self,
            which: fn(&CudaSession) -> &CudaSlice<f32>,
            n: usize,
        ) -> Result<Vec<f32>, Gpt2Error> {
            let mut out = vec![0.0f32; n];
            self.s
                .stream
                .memcpy_dtoh(&which(self.s).slice(0..n), &mut out)
                .map_err(device_err("download"))?;
            self.s.synchronize()?;
            Ok(out)
        }
        /// Where prefill attention writes: the projection's bf16 input in the fused bf16 mode,
        /// else h (f32).
        fn attention_out(&self, fused: bool) -> (u64, bool) {
            if fused {
                (self.x_bf16_ptr(), true)
            } else {
                (self.s.h.ptr, false)
            }
        }
        /// `n` values of what `attention_out` named.
        fn get_attention_out(&self, out: (u64, bool), n: usize) -> Result<Vec<f32>, Gpt2Error> {
            if out.1 {
                self.get_bf16(n)
            } else {
                self.get(|s| &s.h.slice, n)
            }
        }
        /// The bf16 GEMM-input buffer (0 without cuBLAS).
        fn x_bf16_ptr(&self) -> u64 {
            self.s.blas.as_ref().map_or(0, |blas| blas.x_bf16_ptr)
        }
        /// The bf16 QKV rows buffer (0 without cuBLAS).
        fn qkv_bf16_ptr(&self) -> u64 {
            self.s.blas.as_ref().map_or(0, |blas| blas.qkv_bf16_ptr)
        }
        /// Upload `values` (bf16-exact) as bf16 QKV rows.
        fn put_bf16(&mut self, values: &[f32]) -> Result<(), Gpt2Error> {
            let bits: Vec<u16> = values
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let stream = self.s.stream.clone();
            let blas =
                self.s.blas.as_mut().ok_or_else(|| {
                    Gpt2Error::Device("no cuBLAS, so no bf16 QKV rows buffer".into())
                })?;
            let mut dst = blas.qkv_bf16.slice_mut(0..bits.len());
            stream
                .memcpy_htod(&bits, &mut dst)
                .map_err(device_err("upload"))
        }
        fn get_bf16(&self, n: usize) -> Result<Vec<f32>, Gpt2Error> {
            let blas = self.s.blas.as_ref().ok_or_else(|| {
                Gpt2Error::Device("no cuBLAS, so no bf16 activation buffer".into())
            })?;
            let mut out = vec![0u16; n];
            self.s
                .stream
                .memcpy_dtoh(&blas.x_bf16.slice(0..n), &mut out)
                .map_err(device_err("download"))?;
            self.s.synchronize()?;
            Ok(out
                .iter()
                .map(|&v| half::bf16::from_bits(v).to_f32())
                .collect())
        }
    }

    /// Run every kernel on random inputs for a few model widths, in f32 and bf16.
    pub fn run(seed: u64) -> Result<Vec<KernelReport>, Gpt2Error> {
        let mut reports = Vec::new();
        for (i, &(n_head, n_embd, n_ctx, vocab_size)) in
            [(4, 64, 96, 301), (4, 256, 160, 1000), (12, 768, 300, 5003)]
                .iter()
                .enumerate()
        {
            let config = Gpt2Config {
                n_layer: 1,
                n_head,
                n_embd,
                n_ctx,
                vocab_size,
            };
            let weights = random_weights(config, seed.wrapping_add(i as u64));
            for dtype in [GpuDtype::F32, GpuDtype::Bf16] {
                let reference = match dtype {
                    GpuDtype::F32 => weights.clone(),
                    GpuDtype::Bf16 => weights.bf16_rounded(),
                };
                let exec = CudaExecutor::new(&weights, dtype, usize::MAX)?;
                let mut session = exec.open()?;
                let mut bench = Bench {
                    s: &mut session,
                    rng: rand_chacha::ChaCha8Rng::seed_from_u64(
                        seed ^ (i as u64 * 7919 + dtype as u64),
                    ),
                };
                let size = format!("C{n_embd} H{n_head} T{n_ctx} V{vocab_size}");
                let mut report = |kernel: &str, ours: &[f32], want: &[f32], tolerance: f32| {
                    let max_error = scaled_error(ours, want);
                    reports.push(KernelReport {
                        kernel: kernel.to_owned(),
                        dtype: format!("{dtype:?}").to_lowercase(),
                        size: size.clone(),
                        max_error,
                        tolerance,
                        passed: max_error <= tolerance,
                    });
                };
                check_one(&mut bench, &exec.0.weights, &reference, dtype, &mut report)?;
            }
        }
        Ok(reports)
    }

    fn check_one(
        b: &mut Bench<'_>,
        dev: &DevWeights,
        w: &Gpt2Weights,
        dtype: GpuDtype,
        report: &mut impl FnMut(&str, &[f32], &[f32], f32),
    ) -> Result<(), Gpt2Error> {
        let cfg = w.config;
        let (c, v) = (cfg.n_embd, cfg.vocab_size);
        let (lw, dl) = (&w.layers[0], &dev.layers[0]);
        let none = (0u64, 0u64);

        // matvec: LayerNorm prologue, bias + GELU epilogue (the FC step of decode)
        let x = b.random(c);
        b.put(|s| &mut s.x.slice, &x)?;
        b.s.matvec(
            b.s.fc.ptr,
            b.s.x.ptr,
            dl.fc_w.ptr,
            dl.fc_b.ptr,
            4 * c,
            c,
            (dl.ln2_w.ptr, dl.ln2_b.ptr),
            EPI_GELU,
            none,
        )?;
        let mut h = vec![0.0; c];
        cpu::layer_norm(&mut h, &x, &lw.ln2_w, &lw.ln2_b);
        let mut want = vec![0.0; 4 * c];
        cpu::linear(&mut want, &h, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
        want.iter_mut().for_each(|v| *v = cpu::gelu(*v));
        report(
            "matvec+layernorm+gelu",
            &b.get(|s| &s.fc.slice, 4 * c)?,
            &want,
            1e-4,
        );

        // matvec: k = 4C, bias + residual epilogue (the MLP projection)
        let (fc_in, x0) = (b.random(4 * c), b.random(c));
        b.put(|s| &mut s.fc.slice, &fc_in)?;
        b.put(|s| &mut s.x.slice, &x0)?;
        b.s.matvec(
            b.s.x.ptr,
            b.s.fc.ptr,
            dl.fc_proj_w.ptr,
            dl.fc_proj_b.ptr,
            c,
            4 * c,
            none,
            EPI_RESIDUAL,
            none,
        )?;
        let mut delta = vec![0.0; c];
        cpu::linear(
            &mut delta,
            &fc_in,
            &lw.fc_proj_w,
            Some(&lw.fc_proj_b),
            4 * c,
            c,
        );
        let want: Vec<f32> = x0.iter().zip(&delta).map(|(a, d)| a + d).collect();
        report("matvec+residual", &b.get(|s| &s.x.slice, c)?, &want, 1e-4);

        // the LM head (matvec over the vocabulary, final LayerNorm fused) and its argmax, from
        // a cleared key
        b.put(|s| &mut s.x.slice, &x)?;
        let stream = b.s.stream.clone();
        stream
            .memset_zeros(&mut b.s.next)
            .map_err(device_err("clear"))?;
        b.s.lm_head(b.s.x.ptr)?;
        let mut h = vec![0.0; c];
        cpu::layer_norm(&mut h, &x, &w.lnf_w, &w.lnf_b);
        let mut want = vec![0.0; v];
        cpu::linear(&mut want, &h, &w.wte, None, c, v);
        let logits = b.get(|s| &s.logits.slice, v)?;
        report("matvec lm-head", &logits, &want, 1e-4);
        let argmax = |logits: &[f32]| [crate::backend::argmax(logits) as f32];
        report("argmax", &[b.s.argmax()? as f32], &argmax(&logits), 0.0);
        // with the key still set by larger logits, the embedding kernel must clear it
        let big: Vec<f32> = x.iter().map(|v| v * 8.0).collect();
        b.put(|s| &mut s.x.slice, &big)?;
        b.s.lm_head(b.s.x.ptr)?;
        b.s.embed(1, 0)?;
        b.s.lm_head(b.s.x.ptr)?;
        let logits = b.get(|s| &s.logits.slice, v)?;
        let gpu = b.s.argmax()? as f32;
        report("argmax after embed clears", &[gpu], &argmax(&logits), 0.0);

        // prefill products (cuBLAS or the tiled kernel) at several row counts
        for rows in [1usize, 7, 70] {
            let xs = b.random(rows * c);
            b.put(|s| &mut s.h.slice, &xs)?;
            b.s.matmul(
                b.s.fc.ptr,
                b.s.h.ptr,
                dl.fc_w.ptr,
                dl.fc_b.ptr,
                rows,
                4 * c,
                c,
                EPI_GELU,
                0,
                none,
                4 * c,
            )?;
            // bf16 through cuBLAS rounds the activations to bf16 as well
            let xr = if dtype == GpuDtype::Bf16 && b.s.blas.is_some() {
                bf16_round(&xs)
            } else {
                xs
            };
            let mut want = vec![0.0; rows * 4 * c];
            cpu::linear(&mut want, &xr, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
            want.iter_mut().for_each(|v| *v = cpu::gelu(*v));
            report(
                &format!("matmul+gelu rows={rows}"),
                &b.get(|s| &s.fc.slice, rows * 4 * c)?,
                &want,
                1e-3,
            );
        }

        // cuBLASLt products with fused epilogues (bf16 prefill): GELU + bias into f32 on inputs
        // large enough to tell GELU's tanh form from erf's (they differ by ~1e-4 near 1.5),
        // into bf16 as the prefill uses it, and bias + accumulate into the residual stream
        if dtype == GpuDtype::Bf16 && b.s.blas.as_ref().is_some_and(|bl| bl.lt.is_some()) {
            let rows = 33;
            let act: Vec<f32> = b.random(rows * c).iter().map(|v| v * 4.0).collect();
            let x0 = b.random(rows * c);
            b.put(|s| &mut s.h.slice, &act)?;
            b.put(|s| &mut s.x.slice, &x0)?;
            let xb = b.x_bf16_ptr();
            b.s.to_bf16(xb, b.s.h.ptr, rows * c)?;
            let act_r = bf16_round(&act);
            let mut gelu_ref = vec![0.0; rows * 4 * c];
            cpu::linear(&mut gelu_ref, &act_r, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
            gelu_ref.iter_mut().for_each(|v| *v = cpu::gelu(*v));
            let mut delta = vec![0.0; rows * c];
            cpu::linear(&mut delta, &act_r, &lw.proj_w, Some(&lw.proj_b), c, c);
            let res_ref: Vec<f32> = x0.iter().zip(&delta).map(|(a, d)| a + d).collect();
            // the f32 products take an f32 bias (cuBLASLt has no bf16 bias with an f32 result)
            b.put(|s| &mut s.h.slice, &lw.fc_b)?;
            let (fc_ptr, x_ptr, fc_b32) = (b.s.fc.ptr, b.s.x.ptr, b.s.h.ptr);
            let gelu = Shape::new((rows, 4 * c, c), Epilogue::GeluBias);
            let run = |b: &mut Bench<'_>, what: &str| -> Result<bool, Gpt2Error> {
                let Some(blas) = b.s.blas.as_ref() else {
                    return Ok(false);
                };
                let s = &*b.s;
                match what {
                    "gelu f32" => {
                        let shape = Shape {
                            bias_bf16: false,
                            ..gelu
                        };
                        s.lt_matmul(blas, shape, (dl.fc_w.ptr, xb, fc_b32, fc_ptr))
                    }
                    "gelu bf16" => {
                        let shape = Shape {
                            out_bf16: true,
                            ..gelu
                        };
                        s.lt_matmul(blas, shape, (dl.fc_w.ptr, xb, dl.fc_b.ptr, fc_ptr))
                    }
                    _ => {
                        let shape = Shape {
                            accumulate: true,
                            bias_bf16: false,
                            ..Shape::new((rows, c, c), Epilogue::Bias)
                        };
                        s.lt_matmul(blas, shape, (dl.proj_w.ptr, xb, dl.proj_b32.ptr, x_ptr))
                    }
                }
            };
            for what in ["gelu f32", "gelu bf16", "residual"] {
                let name = format!("cublaslt {what}");
                if !run(b, what)? {
                    // no algorithm for this shape: the prefill takes the cuBLAS path instead
                    report(&format!("{name} (no plan; cuBLAS path)"), &[], &[], 0.0);
                    continue;
                }
                let (got, want, tolerance) = match what {
                    "gelu f32" => (b.get(|s| &s.fc.slice, rows * 4 * c)?, &gelu_ref, 2e-5),
                    "gelu bf16" => {
                        let words = b.get(|s| &s.fc.slice, rows * 2 * c)?;
                        let got = words
                            .iter()
                            .flat_map(|w| {
                                let bits = w.to_bits();
                                [bits as u16, (bits >> 16) as u16]
                            })
                            .map(|h| half::bf16::from_bits(h).to_f32())
                            .collect();
                        (got, &gelu_ref, 1e-2)
                    }
                    _ => (b.get(|s| &s.x.slice, rows * c)?, &res_ref, 1e-3),
                };
                report(&name, &got, want, tolerance);
            }
        }

        // layernorm over rows: plain, with a pending bias, and into bf16 (the fused prefill)
        let rows = 5;
        let fused = dtype == GpuDtype::Bf16 && b.s.blas.is_some();
        for (pre, to_bf16) in [(false, false), (true, false), (true, true)] {
            if to_bf16 && !fused {
                continue;
            }
            let xs = b.random(rows * c);
            b.put(|s| &mut s.x.slice, &xs)?;
            let pre_bias = if pre { dl.proj_b.ptr } else { 0 };
            let out = if to_bf16 { b.x_bf16_ptr() } else { b.s.h.ptr };
            let ln1 = (dl.ln1_w.ptr, dl.ln1_b.ptr);
            b.s.layernorm((out, to_bf16), b.s.x.ptr, ln1, pre_bias, rows)?;
            let biased: Vec<f32> = xs
                .chunks(c)
                .flat_map(|r| {
                    r.iter()
                        .zip(&lw.proj_b)
                        .map(|(a, p)| if pre { a + p } else { *a })
                })
                .collect();
            let mut want = vec![0.0; rows * c];
            cpu::layer_norm(&mut want, &biased, &lw.ln1_w, &lw.ln1_b);
            let (got, tolerance) = if to_bf16 {
                (b.get_bf16(rows * c)?, 1e-2)
            } else {
                (b.get(|s| &s.h.slice, rows * c)?, 1e-4)
            };
            let name = format!("layernorm pre_bias={pre} to_bf16={to_bf16}");
            report(&name, &got, &want, tolerance);
            if pre {
                let x_after = b.get(|s| &s.x.slice, rows * c)?;
                report("layernorm pre_bias written back", &x_after, &biased, 1e-6);
            }
        }

        // the fused prefill's products: a projection accumulating into the residual stream,
        // and the FC product with its GELU epilogue writing the next product's input
        if b.s.blas.is_some() {
            let rows = 33;
            let (act, x0) = (b.random(rows * c), b.random(rows * c));
            b.put(|s| &mut s.h.slice, &act)?;
            b.put(|s| &mut s.x.slice, &x0)?;
            let bf16 = dtype == GpuDtype::Bf16;
            let (a, a_4c) = if bf16 {
                let xb = b.x_bf16_ptr();
                b.s.to_bf16(xb, b.s.h.ptr, rows * c)?;
                (xb, xb)
            } else {
                (b.s.h.ptr, b.s.fc.ptr)
            };
            let act_r = if bf16 { bf16_round(&act) } else { act };
            if let Some(blas) = b.s.blas.as_ref() {
                let s = &*b.s;
                s.gemm(blas, dl.proj_w.ptr, a, (rows, c, c), (s.x.ptr, c), true)?;
                s.gemm(
                    blas,
                    dl.fc_w.ptr,
                    a,
                    (rows, 4 * c, c),
                    (blas.tmp.ptr, 4 * c),
                    false,
                )?;
                let out = (a_4c, bf16);
                s.epilogue(
                    blas,
                    out,
                    dl.fc_b.ptr,
                    (rows, 4 * c),
                    EPI_GELU,
                    0,
                    none,
                    4 * c,
                )?;
            }
            let mut delta = vec![0.0; rows * c];
            cpu::linear(&mut delta, &act_r, &lw.proj_w, None, c, c);
            let want: Vec<f32> = x0.iter().zip(&delta).map(|(a, d)| a + d).collect();
            report(
                "gemm accumulate",
                &b.get(|s| &s.x.slice, rows * c)?,
                &want,
                1e-3,
            );
            let mut want = vec![0.0; rows * 4 * c];
            cpu::linear(&mut want, &act_r, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
            want.iter_mut().for_each(|v| *v = cpu::gelu(*v));
            let (got, tolerance) = if bf16 {
                (b.get_bf16(rows * 4 * c)?, 1e-2)
            } else {
                (b.get(|s| &s.fc.slice, rows * 4 * c)?, 1e-3)
            };
            report(
                &format!("gemm + gelu epilogue to_bf16={bf16}"),
                &got,
                &want,
                tolerance,
            );
        }

        // embedding of a few tokens at a start position
        let (n, start) = (4usize, 3usize);
        let tokens: Vec<i32> = (0..n).map(|_| b.rng.random_range(0..v as i32)).collect();
        b.s.upload_ids(None, &tokens)?;
        b.s.embed(n, start as i32)?;
        let want: Vec<f32> = tokens
            .iter()
            .enumerate()
            .flat_map(|(t, &tok)| (0..c).map(move |k| (t, tok as usize, k)))
            .map(|(t, tok, k)| w.wte[tok * c + k] + w.wpe[(start + t) * c + k])
            .collect();
        report("embed", &b.get(|s| &s.x.slice, n * c)?, &want, 1e-6);

        // attention: random keys and values for the whole context, then decode at the last
        // position and prefill the last rows
        let len = cfg.n_ctx;
        let (keys, values) = (b.random(len * c), b.random(len * c));
        b.put(|s| &mut s.k_cache.slice, &keys)?;
        b.put(|s| &mut s.v_cache.slice, &values)?;
        let kv = b.s.kv_layer(0);
        // Tensor cores see fp16 queries, keys and values (and round the probabilities).
        let (tc, tolerance) = if b.s.tensor_core_attention() {
            (true, 3e-3)
        } else {
            (false, 2e-4)
        };
        let round = |v: &[f32]| {
            v.iter()
                .map(|&x| {
                    if tc {
                        half::f16::from_f32(x).to_f32()
                    } else {
                        x
                    }
                })
                .collect::<Vec<f32>>()
        };
        let (keys_r, values_r) = (round(&keys), round(&values));
        let mut qkv = Vec::new();
        // a whole prompt (a partial last tile), then a few rows after a long prefix
        for (start, q_rows) in [(0usize, len), (len - 40, 40), (10, len - 10)] {
            qkv = b.random(q_rows * 3 * c);
            b.put(|s| &mut s.qkv.slice, &qkv)?;
            let out = b.attention_out(fused);
            b.s.prefill_attention(kv, Start::Host(start), q_rows, out, None)?;
            let mut want = vec![0.0; q_rows * c];
            let visible = (start + q_rows) * c;
            cpu::attention(
                &mut want,
                &round(&qkv),
                (&keys_r[..visible], &values_r[..visible]),
                start,
                cfg.n_head,
                c,
            );
            let got = b.get_attention_out(out, q_rows * c)?;
            let name = format!(
                "attention prefill start={start} rows={q_rows} to_bf16={}",
                out.1
            );
            // a bf16 output is rounded too
            report(&name, &got, &want, if out.1 { 1e-2 } else { tolerance });
        }
        b.s.upload_ids(Some(len - 1), &[])?;
        b.s.decode_attention(kv)?;
        let mut want = vec![0.0; c];
        cpu::attention(
            &mut want,
            &qkv[..3 * c],
            (&keys, &values),
            len - 1,
            cfg.n_head,
            c,
        );
        report("attention decode", &b.get(|s| &s.h.slice, c)?, &want, 2e-4);

        // the tensor-core attention reading the prompt's queries, keys and values from bf16
        // QKV rows (after a prefix in the f32 cache) and appending them to the cache; it sees
        // bf16 everywhere (the prefix is rounded on the way, probabilities too)
        let (mut keys, mut values) = (keys, values);
        if tc {
            let bf16 = |v: &[f32]| -> Vec<f32> {
                v.iter()
                    .map(|&x| half::bf16::from_f32(x).to_f32())
                    .collect()
            };
            for (start, q_rows) in [(0usize, len - 3), (len - 70, 70)] {
                let rows_qkv = bf16(&b.random(q_rows * 3 * c));
                b.put_bf16(&rows_qkv)?;
                let out = b.attention_out(fused);
                let rows_ptr = b.qkv_bf16_ptr();
                b.s.prefill_attention(kv, Start::Host(start), q_rows, out, Some(rows_ptr))?;
                for (t, row) in rows_qkv.chunks(3 * c).enumerate() {
                    let at = (start + t) * c;
                    keys[at..at + c].copy_from_slice(&row[c..2 * c]);
                    values[at..at + c].copy_from_slice(&row[2 * c..]);
                }
                let visible = (start + q_rows) * c;
                let mut want = vec![0.0; q_rows * c];
                let cache = (&bf16(&keys[..visible]), &bf16(&values[..visible]));
                cpu::attention(
                    &mut want,
                    &rows_qkv,
                    (cache.0, cache.1),
                    start,
                    cfg.n_head,
                    c,
                );
                let got = b.get_attention_out(out, q_rows * c)?;
                let name = format!("attention prefill bf16 rows start={start} rows={q_rows}");
                report(&name, &got, &want, 1e-2);
                let k_got = b.get(|s| &s.k_cache.slice, visible)?;
                let v_got = b.get(|s| &s.v_cache.slice, visible)?;
                let got = [&k_got[start * c..], &v_got[start * c..]].concat();
                let want = [&keys[start * c..visible], &values[start * c..visible]].concat();
                let name = format!("attention prefill bf16 rows appended start={start}");
                report(&name, &got, &want, 0.0);
            }
        }

        // the fused decode step (sm_90 clusters): LayerNorm + QKV + cache append + attention,
        // at the last position, at one where some blocks of a cluster get no positions, and at 0
        if b.s.exec.gpu.clusters.is_some() {
            for pos in [len - 1, 5, 0] {
                let x = b.random(c);
                b.put(|s| &mut s.x.slice, &x)?;
                b.s.upload_ids(Some(pos), &[])?;
                b.s.qkv_attention(dl, kv)?;
                let mut normed = vec![0.0; c];
                cpu::layer_norm(&mut normed, &x, &lw.ln1_w, &lw.ln1_b);
                let mut qkv = vec![0.0; 3 * c];
                cpu::linear(&mut qkv, &normed, &lw.qkv_w, Some(&lw.qkv_b), c, 3 * c);
                keys[pos * c..(pos + 1) * c].copy_from_slice(&qkv[c..2 * c]);
                values[pos * c..(pos + 1) * c].copy_from_slice(&qkv[2 * c..]);
                let mut want = vec![0.0; c];
                let visible = (pos + 1) * c;
                let cache = (&keys[..visible], &values[..visible]);
                cpu::attention(&mut want, &qkv, cache, pos, cfg.n_head, c);
                let name = format!("decode qkv+attention (clusters) pos={pos}");
                report(&name, &b.get(|s| &s.h.slice, c)?, &want, 2e-4);
                let k_row = b.get(|s| &s.k_cache.slice, visible)?;
                let v_row = b.get(|s| &s.v_cache.slice, visible)?;
                let appended = [&k_row[pos * c..], &v_row[pos * c..]].concat();
                let name = format!("decode qkv+attention cache append pos={pos}");
                report(&name, &appended, &qkv[c..], 1e-4);
            }
        }
        Ok(())
    }
}

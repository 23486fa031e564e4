//! The wasmtime side: one [`Host`] holds the engine, the linkers (WASI preview 1 + wasi-nn's
//! witx ABI; WASI preview 2 + `wasi:nn` WIT for components) and the preloaded graphs;
//! [`Host::run`] starts a fresh, sandboxed instance of a guest module with its own WASI
//! context and its own wasi-nn state (its own execution contexts and KV caches) over the
//! shared weights.
//!
//! Starting an instance is made cheap three ways: guests are linked once when loaded
//! ([`GuestModule`], [`GuestComponent`]: wasmtime's `InstancePre`); their memories come from
//! wasmtime's pooling allocator ([`InstancePool`]: slots reserved once, reused) as
//! copy-on-write mappings of the module's initial memory image; and a module may be
//! pre-initialised at build time ([`preinitialize`]) so its own set-up (for `gpt2.wasm`, the
//! tokenizer) is already in that image.

mod component;
mod init_deadline;
mod module;
mod preinit;
mod preinit_component;
mod snapshot_mark;
pub mod wit_nn;
pub mod witx;

pub use component::{
    Completion, ComponentGeneration, ComponentSnapshot, ComponentState, GuestComponent, Piece,
    Prompt, Sampling, Score, TokenLogprob, TopLogprob,
};
pub use init_deadline::INIT_TIME_LIMIT;
pub use module::{GuestModule, GuestState};
pub use preinit::{has_init_export, preinitialize, PreinitError, INIT_EXPORT};
pub use preinit_component::{is_component, preinitialize_component};
pub use snapshot_mark::{is_preinitialised, SNAPSHOT_SECTION};

use crate::engine::{Device, EngineOptions, GpuDtype};
use crate::wasi_nn::{Gpt2Backend, Gpt2Error, GraphSet};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, Linker, PoolingAllocationConfig, ProfilingStrategy,
    Store, StoreLimits, StoreLimitsBuilder, UpdateDeadline,
};

/// Errors of the host library.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("graph `{name}`: {source}")]
    Graph {
        name: String,
        #[source]
        source: Box<Gpt2Error>,
    },
    #[error("{path}: {message}")]
    Module { path: PathBuf, message: String },
    #[error("cannot pre-open directory {path}: {message}")]
    Dir { path: PathBuf, message: String },
    #[error("wasmtime: {0}")]
    Wasmtime(String),
    #[error("guest trapped: {0}")]
    Trap(String),
    #[error("the guest ran past its time limit of {0:?}")]
    Timeout(Duration),
    #[error("the guest used up its fuel ({0} units: RunOptions::fuel, `--fuel`)")]
    OutOfFuel(u64),
    #[error("RunOptions::fuel needs a host built with HostBuilder::fuel_metering(true)")]
    FuelNotMetered,
    #[error("the run was cancelled")]
    Cancelled,
    #[error(
        "all {max_instances} instance slots are in use (InstancePool::max_instances); try \
         again when a run has finished"
    )]
    Busy { max_instances: u32 },
}

/// How often the engine's epoch advances: the granularity of time limits and cancellation.
const EPOCH_TICK: Duration = Duration::from_millis(5);

pub(crate) fn wasmtime_err(e: wasmtime::Error) -> HostError {
    HostError::Wasmtime(format!("{e:?}"))
}

/// The pooling instance allocator's size: how many guest instances may be alive at once and
/// how large each may grow. The pool reserves its address space once, when the host is
/// built (about 4 GiB of virtual memory, not resident, per memory slot), and every instance
/// takes a slot and gives it back; a guest's memory starts as a copy-on-write mapping of its
/// module's initial image, so an instance costs neither a copy of its data nor fresh mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstancePool {
    /// Guest instances (modules and components together) that may be alive at once; one more
    /// is refused with [`HostError::Busy`] until a run ends.
    pub max_instances: u32,
    /// The most linear memory one instance may have: the size of a pool slot. A guest whose
    /// initial memory is larger cannot be instantiated, and growth past it fails in the guest
    /// (as an allocation failure). [`RunOptions::max_memory_bytes`] caps each run below it.
    pub max_memory_bytes: usize,
    /// Bytes at the start of each memory slot that stay resident when an instance ends,
    /// reset to the image's contents in place, instead of being handed back to the kernel
    /// (`madvise`, whose unmapping flushes the TLB of every core running the process, and
    /// whose pages the next instance faults in again). Where Linux has the `PAGEMAP_SCAN`
    /// ioctl (6.7 and later) only the pages the guest wrote are reset; elsewhere all of them
    /// are, with `memset`, which costs more than it saves for memories of tens of MiB. See
    /// [`InstancePool::DEFAULT_KEEP_RESIDENT`].
    pub keep_resident_bytes: usize,
}

impl InstancePool {
    /// Kept resident by default where only the written pages are reset (`PAGEMAP_SCAN`): on
    /// the null backend at 256 streams the service then used 14.0-14.4 us of CPU a token
    /// against 21.4-22.5 (docs/design/tried-and-dropped.md has the `memset` case).
    pub const DEFAULT_KEEP_RESIDENT: usize = 64 << 20;

    /// [`InstancePool::DEFAULT_KEEP_RESIDENT`] where the kernel has `PAGEMAP_SCAN`, else 0.
    pub fn default_keep_resident() -> usize {
        match PoolingAllocationConfig::is_pagemap_scan_available() {
            true => Self::DEFAULT_KEEP_RESIDENT,
            false => 0,
        }
    }
}

impl Default for InstancePool {
    fn default() -> Self {
        Self {
            max_instances: 128,
            max_memory_bytes: 4 << 30,
            keep_resident_bytes: Self::default_keep_resident(),
        }
    }
}

/// What one guest instance may hold in the pool: a module is one core instance with one
/// memory and one table; a component up to these (ours: 3 core instances, the Rust program and
/// wit-component's shims, 1 memory, 2 tables; a component built with the preview 1 adapter has
/// a second memory). A component with more is refused when it is loaded (a clear wasmtime
/// error naming the limit).
const CORE_INSTANCES_PER_GUEST: u32 = 8;
const MEMORIES_PER_GUEST: u32 = 2;
const TABLES_PER_GUEST: u32 = 4;
/// Bytes of each table slot kept resident alongside the memories (none when
/// [`InstancePool::keep_resident_bytes`] is 0): a guest's tables are written whole when it
/// is instantiated, so handing their pages back to the kernel meant an unmapping and its TLB
/// flush when the instance ended, then page faults when the next one filled them; kept, they
/// are zeroed in place (null backend, 256 streams, here: 27 page faults a request against
/// 30-32).
const TABLE_KEEP_RESIDENT: usize = 1 << 20;

impl InstancePool {
    /// wasmtime's pooling configuration: enough of everything for `max_instances` guests.
    fn wasmtime_config(&self) -> PoolingAllocationConfig {
        let n = self.max_instances;
        let mut pool = PoolingAllocationConfig::new();
        pool.total_component_instances(n)
            .total_core_instances(n.saturating_mul(CORE_INSTANCES_PER_GUEST))
            .total_memories(n.saturating_mul(MEMORIES_PER_GUEST))
            .total_tables(n.saturating_mul(TABLES_PER_GUEST))
            .total_stacks(n)
            .total_gc_heaps(n)
            .max_core_instances_per_component(CORE_INSTANCES_PER_GUEST)
            .max_memories_per_component(MEMORIES_PER_GUEST)
            .max_tables_per_component(TABLES_PER_GUEST)
            .max_memory_size(self.max_memory_bytes)
            .linear_memory_keep_resident(self.keep_resident_bytes)
            .table_keep_resident(self.keep_resident_bytes.min(TABLE_KEEP_RESIDENT))
            // reset only the pages a guest wrote, where the kernel can tell which
            .pagemap_scan(wasmtime::Enabled::Auto);
        pool
    }
}

/// Counts the guest instances alive, up to the pool's `max_instances`.
struct InstanceSlots {
    live: AtomicUsize,
    max: Option<u32>,
}

/// One guest instance's place in [`InstanceSlots`], given back when dropped (after the
/// instance's store: declare it first).
pub(crate) struct InstanceSlot<'a>(&'a InstanceSlots);

impl InstanceSlots {
    fn acquire(&self) -> Result<InstanceSlot<'_>, HostError> {
        let Some(max) = self.max else {
            self.live.fetch_add(1, Ordering::Relaxed);
            return Ok(InstanceSlot(self));
        };
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                (live < max as usize).then_some(live + 1)
            })
            .map_err(|_| HostError::Busy { max_instances: max })?;
        Ok(InstanceSlot(self))
    }
}

impl Drop for InstanceSlot<'_> {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Builds a [`Host`]: graphs by name, the device override, limits.
///
/// With a device ([`HostBuilder::new`], the CLI's `--device`) every graph runs there. Without
/// one ([`HostBuilder::auto`]) a guest's wasi-nn `load` (model bytes) picks the device with
/// its execution target (`cpu` or `gpu`; `tpu` is an error), and graphs preloaded here (and
/// loaded by name, which passes no target) run on the CPU.
pub struct HostBuilder {
    device: Option<Device>,
    dtype: GpuDtype,
    max_load_bytes: usize,
    max_kv_bytes: usize,
    kv_pool_bytes: Option<usize>,
    warm_contexts: usize,
    gpu: u32,
    graphs: GraphSet,
    contexts: HashMap<String, usize>,
    pool: Option<InstancePool>,
    metered: bool,
}

impl Default for HostBuilder {
    fn default() -> Self {
        Self::auto()
    }
}

impl HostBuilder {
    /// Every graph runs on `device`, whatever the guest's execution target says.
    pub fn new(device: Device) -> Self {
        Self::auto().device(Some(device))
    }

    /// No device override: the guest's execution target picks the device of the graphs it
    /// loads from bytes; preloaded graphs run on the CPU.
    pub fn auto() -> Self {
        Self {
            device: None,
            dtype: GpuDtype::F32,
            max_load_bytes: Gpt2Backend::DEFAULT_MAX_LOAD_BYTES,
            max_kv_bytes: EngineOptions::DEFAULT_MAX_KV_BYTES,
            kv_pool_bytes: None,
            warm_contexts: 0,
            gpu: 0,
            graphs: GraphSet::default(),
            contexts: HashMap::new(),
            pool: Some(InstancePool::default()),
            metered: false,
        }
    }

    /// Set (`Some`) or clear (`None`) the device override. Call it before
    /// [`HostBuilder::graph`]: graphs are loaded onto the device when they are added.
    pub fn device(mut self, device: Option<Device>) -> Self {
        self.device = device;
        self
    }

    /// Which GPU [`Device::Cuda`] is: N of `cuda:N`, counted among the GPUs
    /// `CUDA_VISIBLE_DEVICES` leaves visible (0 by default). Call it before
    /// [`HostBuilder::graph`].
    pub fn gpu(mut self, gpu: u32) -> Self {
        self.gpu = gpu;
        self
    }

    /// The device override and GPU `spec` names (`--device cpu|cuda|cuda:N`).
    pub fn device_spec(self, spec: crate::DeviceSpec) -> Self {
        self.device(Some(spec.device)).gpu(spec.gpu)
    }

    /// The largest model a guest may pass to wasi-nn `load` as bytes.
    pub fn max_load_bytes(mut self, bytes: usize) -> Self {
        self.max_load_bytes = bytes;
        self
    }

    /// Storage type of GPU weights (`--dtype`): f32, or bf16 converted at load.
    pub fn dtype(mut self, dtype: GpuDtype) -> Self {
        self.dtype = dtype;
        self
    }

    /// Cap on each execution context's KV cache (GPU).
    pub fn max_kv_bytes(mut self, bytes: usize) -> Self {
        self.max_kv_bytes = bytes;
        self
    }

    /// Cap on the KV caches of all contexts of one graph together (they share batched
    /// steps); a context that would pass it gets an error, the others go on. By default 4 GiB
    /// on the CPU, three quarters of the free GPU memory on the GPU (where each context counts
    /// with its session's other buffers too).
    pub fn kv_pool_bytes(mut self, bytes: usize) -> Self {
        self.kv_pool_bytes = Some(bytes);
        self
    }

    /// Contexts made ready per GPU graph when it loads (`--warm-contexts`): their KV caches
    /// and buffers allocated up front, so a burst of requests doesn't wait for them.
    pub fn warm_contexts(mut self, n: usize) -> Self {
        self.warm_contexts = n;
        self
    }

    /// How guest instances are allocated: from a pool of reserved slots (`Some`, the default:
    /// [`InstancePool::default`], 128 instances alive at once, up to 4 GiB of memory each), or
    /// with fresh mappings per instance and no limit on their number (`None`: wasmtime's
    /// on-demand allocator, which reserves nothing up front).
    pub fn instance_pool(mut self, pool: Option<InstancePool>) -> Self {
        self.pool = pool;
        self
    }

    /// Load the model at `path` (HF folder or llm.c file) and register it as `name`.
    pub fn graph(self, name: &str, path: &Path) -> Result<Self, HostError> {
        let weights = crate::model::load_path(path).map_err(|e| HostError::Graph {
            name: name.to_owned(),
            source: Box::new(Gpt2Error::from(e)),
        })?;
        self.graph_from_weights(name, weights)
    }

    /// Register already-loaded weights as `name`.
    pub fn graph_from_weights(
        mut self,
        name: &str,
        weights: crate::model::Gpt2Weights,
    ) -> Result<Self, HostError> {
        self.contexts.insert(name.to_owned(), weights.config.n_ctx);
        let executor =
            self.backend()
                .executor_from(weights)
                .map_err(|source| HostError::Graph {
                    name: name.to_owned(),
                    source: Box::new(source),
                })?;
        self.graphs.insert_executor(name, executor);
        Ok(self)
    }

    /// Register an executor of the embedder's own as `name` (a backend of its own, or
    /// [`crate::null_backend::NullExecutor`] to measure the host).
    pub fn graph_executor(
        mut self,
        name: &str,
        executor: Arc<dyn crate::engine::Executor>,
    ) -> Self {
        self.contexts
            .insert(name.to_owned(), executor.config().n_ctx);
        self.graphs.insert_executor(name, executor);
        self
    }

    fn backend(&self) -> Gpt2Backend {
        Gpt2Backend::with_device_override(self.device, self.max_load_bytes)
            .with_dtype(self.dtype)
            .with_max_kv_bytes(self.max_kv_bytes)
            .with_kv_pool_bytes(self.kv_pool_bytes)
            .with_warm_contexts(self.warm_contexts)
            .with_gpu(self.gpu)
    }

    /// Count what guests execute, so that [`RunOptions::fuel`] can bound a run's work
    /// whatever the machine's load (wall time, [`RunOptions::timeout`], bounds it too). Off by
    /// default: the counting makes guest code slower.
    pub fn fuel_metering(mut self, on: bool) -> Self {
        self.metered = on;
        self
    }

    pub fn build(self) -> Result<Host, HostError> {
        let mut config = Config::new();
        config.epoch_interruption(true);
        config.consume_fuel(self.metered);
        // a guest's memory starts as a copy-on-write mapping of its module's initial image
        config.memory_init_cow(true);
        // the guests are synchronous (wasip1 modules, wasip2 components): without this,
        // every host call of a component also runs the component model's async task
        // bookkeeping (a host task made and dropped, the current thread switched)
        config.concurrency_support(false);
        if crate::switches::get().measurement.perf_map {
            config.profiler(ProfilingStrategy::PerfMap);
        }
        if let Some(pool) = &self.pool {
            config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool.wasmtime_config()));
        }
        let engine = Engine::new(&config).map_err(|e| {
            HostError::Wasmtime(format!(
                "cannot create the engine{}: {e:?}",
                if self.pool.is_some() {
                    " (its instance pool reserves about 4 GiB of address space per memory \
                     slot: lower InstancePool::max_instances, or use no pool)"
                } else {
                    ""
                }
            ))
        })?;
        // A ticker advances the epoch so instances can be timed out or cancelled; it stops
        // once the engine is gone.
        let weak = engine.weak();
        std::thread::Builder::new()
            .name("wasi-nn-host-epoch".into())
            .spawn(move || {
                while let Some(engine) = weak.upgrade() {
                    engine.increment_epoch();
                    drop(engine);
                    std::thread::sleep(EPOCH_TICK);
                }
            })
            .map_err(|e| HostError::Wasmtime(format!("epoch thread: {e}")))?;
        let linker = module::module_linker(&engine).map_err(wasmtime_err)?;
        let component_linker = component::component_linker(&engine).map_err(wasmtime_err)?;
        Ok(Host {
            backend: self.backend(),
            engine,
            linker,
            component_linker,
            graphs: self.graphs,
            contexts: self.contexts,
            pool: self.pool,
            metered: self.metered,
            slots: InstanceSlots {
                live: AtomicUsize::new(0),
                max: self.pool.map(|p| p.max_instances),
            },
        })
    }
}

/// The memory cap of `options` as store limits.
pub(crate) fn store_limits(options: &RunOptions) -> StoreLimits {
    let mut limits = StoreLimitsBuilder::new();
    if let Some(bytes) = options.max_memory_bytes {
        limits = limits.memory_size(bytes);
    }
    limits.build()
}

/// The run's fuel, on a host that meters it (without a bound, as much as a store holds).
pub(crate) fn arm_fuel<T>(
    store: &mut Store<T>,
    options: &RunOptions,
    metered: bool,
) -> Result<(), HostError> {
    match (metered, options.fuel) {
        (false, None) => Ok(()),
        (false, Some(_)) => Err(HostError::FuelNotMetered),
        (true, fuel) => store
            .set_fuel(fuel.unwrap_or(u64::MAX))
            .map_err(wasmtime_err),
    }
}

/// Every epoch tick the instance checks its deadline and its cancel flag, and stops (traps
/// with `Interrupt`) once either says so.
pub(crate) fn arm_deadline<T>(store: &mut Store<T>, options: &RunOptions) {
    let deadline = options.timeout.map(|t| Instant::now() + t);
    let cancel = options.cancel.clone();
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(move |_| {
        let cancelled = cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed));
        if cancelled || deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(wasmtime::Trap::Interrupt.into());
        }
        Ok(UpdateDeadline::Continue(1))
    });
}

/// Why an instance could not be created: the pool is full (a guard against any count this
/// host's own slots missed), or anything else wasmtime says.
pub(crate) fn instantiate_error(host: &Host, e: wasmtime::Error) -> HostError {
    match (
        e.downcast_ref::<wasmtime::PoolConcurrencyLimitError>(),
        host.pool,
    ) {
        (Some(_), Some(pool)) => HostError::Busy {
            max_instances: pool.max_instances,
        },
        _ => wasmtime_err(e),
    }
}

/// Why a run stopped with an error: cancelled, out of time, out of fuel, or a trap.
pub(crate) fn run_error(options: &RunOptions, e: wasmtime::Error) -> HostError {
    let trap = e.downcast_ref::<wasmtime::Trap>();
    if options
        .cancel
        .as_ref()
        .is_some_and(|c| c.load(Ordering::Relaxed))
    {
        HostError::Cancelled
    } else if trap == Some(&wasmtime::Trap::Interrupt) {
        HostError::Timeout(options.timeout.unwrap_or_default())
    } else if trap == Some(&wasmtime::Trap::OutOfFuel) {
        HostError::OutOfFuel(options.fuel.unwrap_or(u64::MAX))
    } else {
        HostError::Trap(format!("{e:?}"))
    }
}

/// Receives a guest's stdout as it is written.
pub type OutputCallback = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// A loaded host: compile guests with [`Host::load_module`], run them with [`Host::run`].
/// `Host` is `Send + Sync`: share one (e.g. in an `Arc`) and run many instances at once from
/// several threads; each run is a fresh sandboxed instance with its own wasi-nn contexts
/// (KV caches) over the graphs' shared weights.
pub struct Host {
    backend: Gpt2Backend,
    engine: Engine,
    linker: Linker<GuestState>,
    component_linker: wasmtime::component::Linker<ComponentState>,
    graphs: GraphSet,
    /// Each preloaded graph's context length.
    contexts: HashMap<String, usize>,
    pool: Option<InstancePool>,
    /// Guests' execution is counted ([`HostBuilder::fuel_metering`]).
    metered: bool,
    slots: InstanceSlots,
}

/// How to run one guest instance.
#[derive(Default, Clone)]
pub struct RunOptions {
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// Host directories and the guest path each is pre-opened at (read-only).
    pub dirs: Vec<(PathBuf, String)>,
    /// Capture stdout and stderr (up to this many bytes each) instead of inheriting them.
    pub capture: Option<usize>,
    /// Receive stdout as it is written (takes precedence over `capture` for stdout).
    pub on_stdout: Option<OutputCallback>,
    /// Cap on the instance's linear memory, in bytes.
    pub max_memory_bytes: Option<usize>,
    /// Wall-clock limit for the run; the instance is stopped when it passes.
    pub timeout: Option<Duration>,
    /// A bound on the run's work, in wasmtime's fuel (about one unit per wasm instruction;
    /// host calls, such as wasi-nn's forward passes, count as the call alone): the instance
    /// is stopped when it is used up. Needs [`HostBuilder::fuel_metering`].
    pub fuel: Option<u64>,
    /// Set this flag to stop the instance (for example when the client went away).
    pub cancel: Option<Arc<AtomicBool>>,
}

/// What a guest run ended with.
#[derive(Debug)]
pub struct RunOutcome {
    pub exit_code: i32,
    /// Captured output (empty unless [`RunOptions::capture`] was set).
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Time from the [`Host::run`] call to the guest's `_start` entry: its WASI context, its
    /// store and its instantiation (what the guest then does to get ready is its own time).
    pub start_latency: Duration,
}

impl Host {
    /// Names of the preloaded graphs.
    pub fn graph_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.graphs.names().map(str::to_owned).collect();
        names.sort();
        names
    }

    /// The context length (positions) of the preloaded graph `name`.
    pub fn graph_context(&self, name: &str) -> Option<usize> {
        self.contexts.get(name).copied()
    }

    /// The device of the preloaded graphs: the override, else the CPU.
    pub fn device(&self) -> Device {
        self.backend.device()
    }

    /// The device of the preloaded graphs as `--device` names it (`cpu`, `cuda:N`).
    pub fn device_spec(&self) -> crate::DeviceSpec {
        crate::DeviceSpec {
            device: self.device(),
            gpu: self.backend.gpu(),
        }
    }

    /// Bytes the open contexts hold in the preloaded graphs' KV pools, and the pools' caps,
    /// summed over the graphs (`None`: none has a pool).
    pub fn kv_pool(&self) -> Option<(usize, usize)> {
        self.graphs.kv_pool()
    }

    /// What the preloaded graphs' batchers have done, summed over the graphs (`None`: none
    /// batches).
    pub fn batch_counts(&self) -> Option<crate::engine::batch::BatchCounts> {
        self.graphs.batch_counts()
    }

    /// The device override (`--device`), if any; without one the guest's execution target
    /// picks the device of the graphs it loads from bytes.
    pub fn device_override(&self) -> Option<Device> {
        self.backend.device_override()
    }

    /// The instance pool, if instances come from one ([`HostBuilder::instance_pool`]).
    pub fn instance_pool(&self) -> Option<InstancePool> {
        self.pool
    }

    /// Guest instances alive now.
    pub fn live_instances(&self) -> usize {
        self.slots.live.load(Ordering::Relaxed)
    }

    /// A place for one more instance, or [`HostError::Busy`] when the pool is full.
    pub(crate) fn instance_slot(&self) -> Result<InstanceSlot<'_>, HostError> {
        self.slots.acquire()
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(crate) fn backend(&self) -> &Gpt2Backend {
        &self.backend
    }

    pub(crate) fn graphs(&self) -> &GraphSet {
        &self.graphs
    }

    pub(crate) fn component_linker(&self) -> &wasmtime::component::Linker<ComponentState> {
        &self.component_linker
    }
}

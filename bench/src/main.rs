//! `wasi-nn-bench`: the GPU checks against the CPU reference (`check-cuda`) and backend-only
//! timings (`bench`), for the GPU machine (a binary built elsewhere runs there) and this one.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Instant;
use wasi_nn_host::engine::Session;
use wasi_nn_host::model;
use wasi_nn_host::{executor_for, Device, EngineOptions, GpuDtype};

#[derive(Parser)]
#[command(
    name = "wasi-nn-bench",
    version,
    about = "Check and measure the GPT-2 backend"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The model and where it runs.
#[derive(clap::Args)]
struct Target {
    /// A model path, or `random:SIZE` (e.g. random:124M) for deterministic random weights.
    #[arg(long, default_value = "random:124M")]
    model: String,
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: GpuDtype,
}

#[derive(Subcommand)]
enum Command {
    /// Concurrent greedy streams on one executor (no guest): aggregate tokens/s at each
    /// stream count, and how the contexts shared batched steps.
    Streams {
        #[command(flatten)]
        target: Target,
        /// Stream counts, comma-separated.
        #[arg(long, default_value = "1,4,16", value_delimiter = ',')]
        streams: Vec<usize>,
        /// Prompt tokens per stream (distinct prompts).
        #[arg(long, default_value_t = 16)]
        prompt: usize,
        /// Greedy steps per stream.
        #[arg(long, default_value_t = 64)]
        steps: usize,
    },
    /// Measure backend-only decode time per token (no guest), and the memory-bandwidth floor.
    Bench {
        #[command(flatten)]
        target: Target,
        /// Context length before the timed decode steps.
        #[arg(long, default_value_t = 128)]
        context: usize,
        /// Timed decode steps (after 3 warm-up steps).
        #[arg(long, default_value_t = 20)]
        steps: usize,
        /// Also time a prefill of this many tokens (GPU).
        #[arg(long)]
        prefill: Option<usize>,
    },
    /// Measure guest start-up: `Host::run` to `_start`, a 1-token request, a decode step
    /// (greedy on the embedded default model, on the CPU).
    Startup {
        /// Guest modules or components to compare (default: gpt2.wasm and gpt2.preinit.wasm
        /// from target/wasm32-wasip1/release-wasm). Components run through
        /// `generate_with_component` (no start-up or in-guest times).
        #[arg(long = "module")]
        modules: Vec<PathBuf>,
        /// Requests of each kind per module (after 3 warm-up requests).
        #[arg(long, default_value_t = 50)]
        runs: usize,
        /// wasmtime's on-demand instance allocator (fresh mappings per instance) instead of
        /// the host's instance pool.
        #[arg(long)]
        on_demand: bool,
        /// The pool's InstancePool::keep_resident_bytes (default: the pool's own).
        #[arg(long, default_value_t = wasi_nn_host::runtime::InstancePool::default_keep_resident())]
        keep_resident: usize,
    },
    /// Time the sampled draw alone (`draw_token`) at each row count over each number of
    /// blocks a row (flat random logits, top-p 0.95), microseconds a launch.
    DrawSpeed {
        /// Rows drawn at once, comma-separated.
        #[arg(long, default_value = "1,64,128", value_delimiter = ',')]
        rows: Vec<usize>,
        /// Blocks a row (above 1: a thread-block cluster, sm_90+), comma-separated.
        #[arg(long, default_value = "1,2,4,8", value_delimiter = ',')]
        blocks: Vec<u32>,
        #[arg(long, default_value_t = 50257)]
        vocab: usize,
        /// Timed runs of 20 launches each (after 3 warm-up runs).
        #[arg(long, default_value_t = 50)]
        runs: usize,
    },
    /// Time the batched pass's cuBLAS products of a model's layer at each row count (bf16):
    /// cuBLAS's default algorithm, cuBLASLt's heuristic and the candidate timing keeps, each
    /// kept one's results checked against the default's; one JSON line a shape.
    GemmSpeed {
        /// The model whose products (QKV, projection, MLP up, MLP down) are timed:
        /// random:SIZE (only its shape is used).
        #[arg(long, default_value = "random:1558M")]
        model: String,
        /// Product rows, comma-separated.
        #[arg(
            long,
            default_value = "64,128,192,256,320,448,576",
            value_delimiter = ','
        )]
        rows: Vec<usize>,
        /// Products in each timed graph.
        #[arg(long, default_value_t = 10)]
        runs: usize,
    },
    /// Check the CUDA backend against the CPU reference (the GPU tests, from one binary).
    CheckCuda {
        /// Models to compare besides the kernel sweep: paths or random:SIZE.
        #[arg(long = "model")]
        models: Vec<String>,
        /// Prompt tokens and greedy steps per model.
        #[arg(long, default_value_t = 16)]
        prompt: usize,
        #[arg(long, default_value_t = 64)]
        steps: usize,
        /// Only the checks of contexts sharing batched steps (no kernel or one-context
        /// model checks).
        #[arg(long)]
        batched_only: bool,
        /// Only the out-of-memory check: contexts with ~3 GB KV caches opened until one is
        /// refused (by the KV pool's cap, then with the pool uncapped by the driver).
        #[arg(long)]
        out_of_memory: bool,
        /// Seed of the random inputs (default: the process id, fresh inputs each run); the
        /// same seed gives the same inputs, to compare two kernel builds' results.
        #[arg(long)]
        seed: Option<u64>,
    },
}

fn main() -> Result<()> {
    // RUST_LOG as the host's CLI takes it (warnings by default)
    let filter = tracing_subscriber::EnvFilter::try_from_default_env();
    let filter = filter.unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Streams {
            target:
                Target {
                    model,
                    device,
                    dtype,
                },
            streams,
            prompt,
            steps,
        } => {
            let weights = model::load_spec(&model)?;
            let options = EngineOptions {
                dtype,
                ..Default::default()
            };
            let executor = executor_for(weights, device, &options)?;
            for n in streams {
                concurrent_streams(&model, executor.as_ref(), n, prompt, steps)?;
            }
        }
        Command::Bench {
            target:
                Target {
                    model,
                    device,
                    dtype,
                },
            context,
            steps,
            prefill,
        } => match device {
            Device::Cpu => bench(&model, context, steps)?,
            Device::Cuda => bench_cuda(&model, dtype, context, steps, prefill)?,
        },
        Command::CheckCuda {
            models,
            prompt,
            steps,
            batched_only,
            out_of_memory,
            seed,
        } => match out_of_memory {
            true => check_out_of_memory()?,
            false => check_cuda(&models, prompt, steps, batched_only, seed)?,
        },
        Command::DrawSpeed {
            rows,
            blocks,
            vocab,
            runs,
        } => draw_speed(&rows, &blocks, vocab, runs)?,
        Command::GemmSpeed { model, rows, runs } => gemm_speed(&model, &rows, runs)?,
        Command::Startup {
            modules,
            runs,
            on_demand,
            keep_resident,
        } => {
            let pool = (!on_demand).then_some(wasi_nn_host::InstancePool {
                keep_resident_bytes: keep_resident,
                ..Default::default()
            });
            startup(modules, runs, pool)?
        }
    }
    Ok(())
}

/// The median; NaN (null in the JSON) when nothing was measured (`--steps 0`).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Memory copy bandwidth (read + write bytes per second) over a buffer much larger than cache.
fn copy_bandwidth() -> f64 {
    use rayon::prelude::*;
    let n = 1 << 27; // 512 MiB of f32
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s));
            t.elapsed().as_secs_f64()
        })
        .collect();
    std::hint::black_box(&dst);
    2.0 * (n * 4) as f64 / median(times)
}

fn bench(spec: &str, context: usize, steps: usize) -> Result<()> {
    let device = Device::Cpu;
    let weights = model::load_spec(spec)?;
    let config = weights.config;
    let weight_bytes = weights.nbytes(4);
    let executor = executor_for(weights, device, &EngineOptions::default())?;
    let mut session = executor.new_session()?;
    if context + 3 + steps > config.n_ctx {
        bail!(
            "context {context} + {steps} steps exceeds n_ctx {}",
            config.n_ctx
        );
    }
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919) % config.vocab_size as u32)
        .collect();
    let t = Instant::now();
    session.extend(&prompt, false)?;
    let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut next = 50u32;
    for _ in 0..3 {
        session.extend(&[next], false)?;
        session.last_logits()?;
    }
    let times: Vec<f64> = (0..steps)
        .map(|i| {
            next = (next + 101 * i as u32) % config.vocab_size as u32;
            let t = Instant::now();
            let r = session
                .extend(&[next], false)
                .and_then(|_| session.last_logits());
            std::hint::black_box(&r);
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let decode_ms = median(times);
    let bw = if device == Device::Cpu {
        copy_bandwidth()
    } else {
        f64::NAN
    };
    let floor_ms = weight_bytes as f64 / bw * 1e3;
    let line = serde_json::json!({
        "model": spec, "device": format!("{device:?}").to_lowercase(), "threads": rayon::current_num_threads(),
        "params": config.num_params(), "weight_MB": weight_bytes as f64 / 1e6,
        "context": context, "prefill_ms": prefill_ms, "decode_ms_per_token": decode_ms,
        "copy_GBps": bw / 1e9, "floor_ms_per_token": floor_ms,
    });
    println!("{line}");
    Ok(())
}

/// GPU decode timing: the graph step alone (synchronised clock over batches of steps) and the
/// backend step as the guest gets it (graph + logits copy back), plus prefill.
fn bench_cuda(
    spec: &str,
    dtype: GpuDtype,
    context: usize,
    steps: usize,
    prefill: Option<usize>,
) -> Result<()> {
    let weights = model::load_spec(spec)?;
    let config = weights.config;
    let executor = wasi_nn_bench::checks::gpu_executor(&weights, dtype)?;
    drop(weights);
    if context + 10 * (steps + 2) > config.n_ctx {
        bail!(
            "context {context} + {} steps exceeds n_ctx {}",
            10 * (steps + 2),
            config.n_ctx
        );
    }
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919) % config.vocab_size as u32)
        .collect();
    let mut session = executor.open()?;
    session.extend(&prompt, false)?;
    // graph-only steps, 10 per sample
    let mut samples = Vec::new();
    for i in 0..steps + 2 {
        session.synchronize()?;
        let t = Instant::now();
        for j in 0..5 {
            session.decode_only(((i * 5 + j) * 131 % config.vocab_size) as u32)?;
        }
        session.synchronize()?;
        if i >= 2 {
            samples.push(t.elapsed().as_secs_f64() * 1e3 / 5.0);
        }
    }
    let graph_ms = median(samples);
    // where the persistent kernel's last step went (WASI_NN_HOST_PERSISTENT_TRACE)
    let phases = session.persistent_trace()?.map(|trace| phases_json(&trace));
    session.truncate(context);
    let mut samples = Vec::new();
    for i in 0..steps + 2 {
        let t = Instant::now();
        for j in 0..5 {
            session.extend(&[((i * 5 + j) * 577 % config.vocab_size) as u32], false)?;
            session.last_logits()?;
        }
        if i >= 2 {
            samples.push(t.elapsed().as_secs_f64() * 1e3 / 5.0);
        }
    }
    let step_ms = median(samples);
    // greedy: only the argmax comes back
    session.truncate(context);
    let mut samples = Vec::new();
    let mut next = 11u32;
    for i in 0..steps + 2 {
        let t = Instant::now();
        for _ in 0..5 {
            session.extend(&[next], false)?;
            next = session.argmax()?;
        }
        if i >= 2 {
            samples.push(t.elapsed().as_secs_f64() * 1e3 / 5.0);
        }
    }
    let greedy_ms = median(samples);
    let (mut prefill_ms, mut prefill_enqueue_ms, mut prefill_gpu_ms) = (None, None, None);
    let mut prefill_graph_ms = None;
    if let Some(n) = prefill {
        let ids: Vec<u32> = (0..n as u32)
            .map(|i| (i * 31 + 7) % config.vocab_size as u32)
            .collect();
        // eager: every kernel launched from the host, as for a prompt length seen once
        session.set_prefill_graphs(false);
        let (mut times, mut enqueue) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            session.truncate(0);
            session.synchronize()?;
            let t = Instant::now();
            session.extend(&ids, false)?;
            enqueue.push(t.elapsed().as_secs_f64() * 1e3);
            session.argmax()?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        prefill_ms = Some(median(times[2..].to_vec()));
        // a length seen before: the session replays the prefill it captured
        session.set_prefill_graphs(true);
        let mut graphed = Vec::new();
        for _ in 0..9 {
            session.truncate(0);
            session.synchronize()?;
            let t = Instant::now();
            session.extend(&ids, false)?;
            session.argmax()?;
            graphed.push(t.elapsed().as_secs_f64() * 1e3);
        }
        // the first is eager, the second captures
        prefill_graph_ms = Some(median(graphed[4..].to_vec()));
        // host time to issue the prefill's launches (close to prefill_ms: launch-bound)
        prefill_enqueue_ms = Some(median(enqueue[2..].to_vec()));
        // the same launches replayed as one CUDA graph: the GPU's own time
        prefill_gpu_ms = Some(session.prefill_gpu_ms(&ids, 20)?);
    }
    let line = serde_json::json!({
        "model": spec, "device": "cuda", "gpu": executor.gpu().name(), "dtype": format!("{dtype:?}").to_lowercase(),
        "params": config.num_params(), "weight_MB": wasi_nn_host::cuda::weight_bytes(&config, dtype) as f64 / 1e6,
        "context": context, "graph_ms_per_token": graph_ms, "backend_ms_per_token": step_ms, "backend_greedy_ms_per_token": greedy_ms,
        "prefill_tokens": prefill, "prefill_ms": prefill_ms, "prefill_repeat_ms": prefill_graph_ms, "prefill_enqueue_ms": prefill_enqueue_ms, "prefill_gpu_ms": prefill_gpu_ms,
        "persistent_phases": phases,
    });
    println!("{line}");
    Ok(())
}

/// A persistent decode step's trace as JSON: the whole step and each kind of phase's mean
/// parts, in microseconds (see `phase_times`).
fn phases_json(trace: &[u64]) -> serde_json::Value {
    let (kinds, total) = wasi_nn_host::cuda::ops::persistent::phase_times(trace);
    let names = [
        "qkv",
        "attention",
        "projection",
        "fc",
        "fc_projection",
        "head",
    ];
    let by_kind: serde_json::Map<_, _> = (names.iter().zip(kinds))
        .map(|(name, [stage, products, epilogue, straggle, wait])| {
            let parts = serde_json::json!({"stage_us": stage, "products_us": products,
                "epilogue_us": epilogue, "last_block_us": straggle, "counter_wait_us": wait});
            (name.to_string(), parts)
        })
        .collect();
    serde_json::json!({"total_us": total, "mean_per_phase": by_kind})
}

fn startup(
    mut modules: Vec<PathBuf>,
    runs: usize,
    pool: Option<wasi_nn_host::InstancePool>,
) -> Result<()> {
    if modules.is_empty() {
        let dir = PathBuf::from("target/wasm32-wasip1/release-wasm");
        modules = ["gpt2.wasm", "gpt2.preinit.wasm"]
            .iter()
            .map(|name| dir.join(name))
            .filter(|path| path.is_file())
            .collect();
        if modules.is_empty() {
            bail!("no module under {}; pass --module PATH", dir.display());
        }
    }
    let model = wasi_nn_host::find_default_model()
        .with_context(|| format!("{} not found", wasi_nn_host::DEFAULT_MODEL_DIR))?;
    let host = wasi_nn_host::HostBuilder::new(Device::Cpu)
        .instance_pool(pool)
        .graph("gpt2", &model)?
        .build()?;
    for report in wasi_nn_bench::startup::run(&host, &modules, runs)? {
        let mut line = serde_json::to_value(&report)?;
        line["allocator"] = match pool {
            Some(pool) => format!("pooling, keep_resident {}", pool.keep_resident_bytes),
            None => "on-demand".into(),
        }
        .into();
        println!("{line}");
    }
    Ok(())
}

fn draw_speed(rows: &[usize], blocks: &[u32], vocab: usize, runs: usize) -> Result<()> {
    println!("GPU: {}", wasi_nn_host::cuda::describe()?);
    let config = model::Gpt2Config {
        n_layer: 1,
        n_head: 4,
        n_embd: 64,
        n_ctx: 64,
        vocab_size: vocab,
    };
    let weights = model::random_weights(config, 1);
    let exec = wasi_nn_bench::checks::gpu_executor(&weights, GpuDtype::Bf16)?;
    for (n, b, us) in
        wasi_nn_bench::kernels::draw_speed(&exec.launcher()?, vocab, rows, blocks, runs)?
    {
        println!("draw rows {n} blocks {b} {us:.1} us");
    }
    Ok(())
}

fn gemm_speed(spec: &str, rows: &[usize], runs: usize) -> Result<()> {
    println!("GPU: {}", wasi_nn_host::cuda::describe()?);
    let size = spec.strip_prefix("random:").unwrap_or(spec);
    let Some(c) = model::Gpt2Config::preset(size).map(|config| config.n_embd) else {
        anyhow::bail!("{spec}: gemm-speed takes random:SIZE");
    };
    // a one-layer model of tiny width: the launcher and its stream, no weights to speak of
    let config = model::Gpt2Config {
        n_layer: 1,
        n_head: 4,
        n_embd: 64,
        n_ctx: 64,
        vocab_size: 256,
    };
    let exec =
        wasi_nn_bench::checks::gpu_executor(&model::random_weights(config, 1), GpuDtype::Bf16)?;
    let shapes = [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)];
    for line in wasi_nn_bench::kernels::gemm_speed(&exec.launcher()?, &shapes, rows, runs)? {
        println!("{}", serde_json::to_string(&line)?);
    }
    Ok(())
}

fn check_cuda(
    models: &[String],
    prompt_len: usize,
    steps: usize,
    batched_only: bool,
    seed: Option<u64>,
) -> Result<()> {
    use wasi_nn_bench::checks;
    println!("GPU: {}", wasi_nn_host::cuda::describe()?);
    let seed = seed.unwrap_or_else(|| std::process::id() as u64);
    let (mut failed, mut total) = match batched_only {
        true => (0, 0),
        false => one_context_checks(models, prompt_len, steps, seed)?,
    };
    // contexts sharing batched steps: an awkward small model and each model asked for
    let mut batched = checks::batched_sweep(seed)?;
    for spec in models {
        let weights = model::load_spec(spec)?;
        batched.push(checks::compare_batched(
            spec,
            weights.clone(),
            GpuDtype::F32,
            6,
            steps,
            1e-3,
        )?);
        batched.push(checks::compare_batched(
            spec,
            weights.clone(),
            GpuDtype::Bf16,
            6,
            steps,
            5e-2,
        )?);
        // more contexts than a 64-row pass holds once their prompts are in
        batched.push(checks::compare_batched(
            spec,
            weights.clone(),
            GpuDtype::Bf16,
            24,
            steps,
            5e-2,
        )?);
        // enough that a decode pass's attention blocks take more than one wave of whole
        // blocks, so that they run with half the warps (124M's 96-row passes on an H200).
        // Wider models' 96-row passes overflow a wave of half blocks too, and their 80
        // contexts would hold tens of GB: not run for them.
        if weights.config.n_embd <= 768 {
            batched.push(checks::compare_batched(
                spec,
                weights,
                GpuDtype::Bf16,
                80,
                steps,
                5e-2,
            )?);
        }
    }
    for r in &batched {
        println!("{}", serde_json::to_string(r)?);
        failed += usize::from(!r.passed);
    }
    total += batched.len();
    // contexts that draw their tokens, run ahead with their draws
    for spec in models {
        let weights = model::load_spec(spec)?;
        for dtype in [GpuDtype::F32, GpuDtype::Bf16] {
            for processed in [false, true] {
                let r =
                    checks::compare_batched_draws(spec, &weights, dtype, (8, steps), processed)?;
                println!("{}", serde_json::to_string(&r)?);
                failed += usize::from(!r.passed);
                total += 1;
            }
        }
    }
    // Whether a context's rows run late depends on when its prompt meets the others' step (on
    // the smallest model, they sometimes meet none): some checks must have seen it, each check
    // compares whatever ran late.
    let run_ahead = wasi_nn_host::switches::get().measurement.run_ahead;
    if run_ahead && batched.iter().all(|r| r.ahead_late == 0) {
        println!("no context's rows ran late in any batched check");
        failed += 1;
        total += 1;
    }
    if failed > 0 {
        bail!("{failed} of {total} GPU checks failed");
    }
    println!("all {total} GPU checks passed");
    Ok(())
}

fn check_out_of_memory() -> Result<()> {
    println!("GPU: {}", wasi_nn_host::cuda::describe()?);
    let reports = wasi_nn_bench::checks::kv_out_of_memory(std::process::id() as u64)?;
    for r in &reports {
        println!("{}", serde_json::to_string(r)?);
    }
    if reports.iter().any(|r| !r.passed) {
        bail!("the out-of-memory check failed");
    }
    println!("out-of-memory check passed");
    Ok(())
}

/// The kernel checks (any failure stops here), then the one-context model checks:
/// (failed, run) of the latter.
fn one_context_checks(
    models: &[String],
    prompt_len: usize,
    steps: usize,
    seed: u64,
) -> Result<(usize, usize)> {
    use wasi_nn_bench::checks;
    let mut kernel_failures = 0;
    let kernel_reports = wasi_nn_bench::kernels::run(seed)?;
    for r in &kernel_reports {
        println!("{}", serde_json::to_string(r)?);
        kernel_failures += usize::from(!r.passed);
    }
    if kernel_failures > 0 {
        bail!(
            "{kernel_failures} of {} kernel checks failed",
            kernel_reports.len()
        );
    }
    println!("all {} kernel checks passed", kernel_reports.len());
    let mut reports = checks::kernel_sweep(seed)?;
    let loaded = (models.iter())
        .map(|spec| Ok((spec.clone(), model::load_spec(spec)?)))
        .collect::<Result<Vec<_>>>()?;
    for (spec, weights) in &loaded {
        let p = checks::prompt(prompt_len, weights.config.vocab_size, 1);
        for (dtype, tolerance) in [(GpuDtype::F32, 1e-3), (GpuDtype::Bf16, 5e-2)] {
            let r = checks::compare(spec, weights.clone(), dtype, &p, steps, tolerance)?;
            reports.push(r);
        }
    }
    // the persistent decode kernel, where the GPU has it
    if wasi_nn_host::cuda::Gpu::get(0)?.has_persistent_decode() {
        reports.extend(checks::persistent_sweep(seed, &loaded, steps)?);
    } else {
        println!("no persistent decode kernel on this GPU (before sm_90): its checks skipped");
    }
    let mut failed = 0;
    for r in &reports {
        println!("{}", serde_json::to_string(r)?);
        failed += usize::from(!r.passed);
    }
    Ok((failed, reports.len()))
}

/// `n` threads, each a context with its own prompt, all stepping greedily at once. The
/// aggregate is timed from when every context is made (their prompts and steps), so that
/// making the sessions is not counted as decoding.
fn concurrent_streams(
    spec: &str,
    executor: &dyn wasi_nn_host::engine::Executor,
    n: usize,
    prompt_len: usize,
    steps: usize,
) -> Result<()> {
    let vocab = executor.config().vocab_size as u32;
    let barrier = std::sync::Barrier::new(n);
    let made = std::sync::OnceLock::new();
    let started = Instant::now();
    let per_stream: Vec<Result<f64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let (barrier, made) = (&barrier, &made);
                scope.spawn(move || -> Result<f64> {
                    let prompt: Vec<u32> = (0..prompt_len as u32)
                        .map(|t| (t * 7919 + i as u32 * 104_729 + 1) % vocab)
                        .collect();
                    let mut session = executor.new_session()?;
                    if barrier.wait().is_leader() {
                        let _ = made.set(Instant::now());
                    }
                    session.extend(&prompt, false)?;
                    let decode = Instant::now();
                    for _ in 0..steps {
                        let next = session.argmax()?;
                        session.extend(&[next], false)?;
                    }
                    Ok(decode.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("stream panicked")))
            .collect()
    });
    let made = made.get().copied().unwrap_or(started);
    let (setup, seconds) = (made - started, made.elapsed().as_secs_f64());
    let mut ms_per_token = per_stream.into_iter().collect::<Result<Vec<f64>>>()?;
    ms_per_token.sort_by(f64::total_cmp);
    let b = executor.batch_counts().unwrap_or_default();
    let line = serde_json::json!({
        "batched_steps_so_far": b.steps, "mean_step_items": b.items as f64 / b.steps.max(1) as f64, "largest_step": b.largest,
        "mean_step_ms": b.step_seconds * 1e3 / b.steps.max(1) as f64, "gather_s_so_far": b.gather_seconds, "step_s_so_far": b.step_seconds, "ahead_hits_so_far": b.speculation.hits, "ahead_misses_so_far": b.speculation.misses, "ahead_late_so_far": b.speculation.deferred, "ahead_early_so_far": b.speculation.overlapped,
        "what": "streams", "model": spec, "streams": n, "prompt_tokens": prompt_len, "steps": steps,
        "setup_seconds": setup.as_secs_f64(), "seconds": seconds, "tokens_per_s": (n * steps) as f64 / seconds,
        "stream_ms_per_token_median": median(ms_per_token),
    });
    println!("{line}");
    Ok(())
}

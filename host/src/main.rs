//! `wasi-nn-host`: run WASI-NN guests over our GPT-2 backend, write random checkpoints,
//! compile the kernels. (Checks and benchmarks live in `bench/`: `wasi-nn-bench`.)

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use wasi_nn_host::model::{self, Gpt2Config, StorageDtype};
use wasi_nn_host::runtime::{HostBuilder, RunOptions};
use wasi_nn_host::{DeviceSpec, GpuDtype};

/// jemalloc for the CLI and the service: with glibc's malloc the service's RSS grew with every
/// round of concurrent requests (its per-thread arenas kept freed memory: flat with
/// `MALLOC_ARENA_MAX=1`, growing ~5 KB a request with 8 clients; on the GPU machine +108 MB
/// over 27,392 requests); jemalloc returns what it frees.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "wasi-nn-host",
    version,
    about = "Run WebAssembly guests with WASI-NN over our GPT-2 backend"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a guest module (`_start`) with WASI preview 1 and wasi-nn.
    Run {
        /// The guest, e.g. gpt2.wasm.
        module: PathBuf,
        /// Preload a graph: NAME=PATH (HF folder, llm.c .bin, random:SIZE for deterministic
        /// random weights, or null:SIZE, a backend that computes nothing, to measure the
        /// host). Without any, `gpt2` is the embedded default model (models/gpt2-shakespeare).
        #[arg(long = "graph", value_name = "NAME=PATH")]
        graphs: Vec<String>,
        /// Where forward passes run, for every graph (overrides the guest's execution target):
        /// cpu, cuda (the first GPU) or cuda:N. Without it, a model the guest loads from bytes
        /// runs where its wasi-nn execution target says (cpu, or gpu = cuda:0), and preloaded
        /// graphs (--graph, loaded by name) run on the CPU.
        #[arg(long, value_name = "cpu|cuda|cuda:N")]
        device: Option<DeviceSpec>,
        /// Storage type of the weights on the GPU (converted at load).
        #[arg(long, value_enum, default_value = "f32")]
        dtype: GpuDtype,
        /// Grant the guest read access to a host directory: HOST[::GUEST] (GUEST defaults to HOST).
        #[arg(long = "dir", value_name = "HOST[::GUEST]")]
        dirs: Vec<String>,
        /// Largest model (bytes) a guest may pass to wasi-nn `load`.
        #[arg(long, default_value_t = wasi_nn_host::Gpt2Backend::DEFAULT_MAX_LOAD_BYTES)]
        max_load_bytes: usize,
        /// Bound the guest's work in wasmtime fuel (about one unit per wasm instruction;
        /// forward passes count as one call); the guest runs somewhat slower with it counted.
        #[arg(long)]
        fuel: Option<u64>,
        /// Arguments for the guest (after `--`).
        #[arg(last = true)]
        guest_args: Vec<String>,
    },
    /// Pre-initialise a guest module: run its `wizer-initialize` export once and write the
    /// snapshot (e.g. gpt2.wasm with its tokenizer built), which starts without that work.
    Preinit {
        /// The module to pre-initialise (it must export `wizer-initialize`).
        input: PathBuf,
        /// Where to write the pre-initialised module.
        output: PathBuf,
    },
    /// Serve OpenAI-style completions over HTTP with the guest component (`gpt2:text`).
    Serve(wasi_nn_host::serve::ServeArgs),
    /// Write deterministic random weights of a GPT-2 size (124M, 355M, 774M, 1558M).
    RandomCheckpoint {
        #[arg(long, default_value = "124M")]
        size: String,
        /// Output: a folder (HF layout) or, with --llmc, a .bin file.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value = "f32")]
        dtype: StorageDtype,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write an llm.c checkpoint (f32 = version 3, bf16 = version 5) instead.
        #[arg(long)]
        llmc: bool,
    },
    /// Compile every CUDA kernel with NVRTC (no GPU needed): PTX for an architecture such as
    /// compute_90, machine code (CUBIN) for one such as sm_90.
    CompileKernels {
        #[arg(long, default_value = "compute_90")]
        arch: String,
        /// Also write the image to this file (the PTX e.g. for `ptxas -v`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Also write it into this folder under the name a GPU of that architecture looks
        /// for (`WASI_NN_HOST_PREBUILT=DIR`: its first start skips the compile).
        #[arg(long)]
        into: Option<PathBuf>,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Run {
            module,
            graphs,
            device,
            dtype,
            dirs,
            max_load_bytes,
            fuel,
            guest_args,
        } => run_guest(
            &module,
            &graphs,
            GuestHost {
                device,
                dtype,
                max_load_bytes,
            },
            &dirs,
            fuel,
            guest_args,
        )?,
        Command::Preinit { input, output } => {
            let wasm =
                std::fs::read(&input).with_context(|| format!("reading {}", input.display()))?;
            let started = std::time::Instant::now();
            let snapshot = wasi_nn_host::runtime::preinitialize(&wasm)
                .with_context(|| format!("pre-initialising {}", input.display()))?;
            std::fs::write(&output, &snapshot)
                .with_context(|| format!("writing {}", output.display()))?;
            eprintln!(
                "pre-initialised {} -> {} ({} bytes, {:.1} s)",
                input.display(),
                output.display(),
                snapshot.len(),
                started.elapsed().as_secs_f64()
            );
        }
        Command::Serve(args) => {
            let builder = HostBuilder::auto()
                .device_spec(args.device)
                .dtype(args.dtype)
                .warm_contexts(args.warm_contexts)
                .fuel_metering(args.fuel.is_some())
                .instance_pool(Some(args.instance_pool()));
            let builder = with_graphs(builder, &args.graph_specs()?)?;
            wasi_nn_host::serve::run(builder.build()?, &args)?;
        }
        Command::RandomCheckpoint {
            size,
            out,
            dtype,
            seed,
            llmc,
        } => random_checkpoint(&size, &out, dtype, seed, llmc)?,
        Command::CompileKernels { arch, out, into } => compile_kernels(&arch, out, into)?,
    }
    Ok(())
}

/// `wasi-nn-host compile-kernels`: the image for `arch`, written where asked, and a line
/// saying what was made.
fn compile_kernels(arch: &str, out: Option<PathBuf>, into: Option<PathBuf>) -> Result<()> {
    use wasi_nn_host::cuda::nvrtc::KernelImage;
    let (image, name) = wasi_nn_host::cuda::compile_kernels(arch)?;
    let into = into.map(|dir| dir.join(&name));
    if let Some(dir) = into.as_ref().and_then(|file| file.parent()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    for file in out.iter().chain(&into) {
        std::fs::write(file, image.bytes())
            .with_context(|| format!("writing {}", file.display()))?;
    }
    match &image {
        KernelImage::Ptx(ptx) => {
            let kernels = ptx.lines().filter(|l| l.contains(".entry")).count();
            println!(
                "compiled {kernels} kernels for {arch} ({} bytes of PTX)",
                ptx.len()
            );
        }
        KernelImage::Cubin(bytes) => {
            println!(
                "compiled the kernels for {arch} ({} bytes of CUBIN)",
                bytes.len()
            );
        }
    }
    Ok(())
}

/// Where `run` puts the guest's graphs.
struct GuestHost {
    device: Option<DeviceSpec>,
    dtype: GpuDtype,
    max_load_bytes: usize,
}

/// `wasi-nn-host run`: one guest with the graphs given, its exit code as ours.
fn run_guest(
    module: &Path,
    graphs: &[String],
    GuestHost {
        device,
        dtype,
        max_load_bytes,
    }: GuestHost,
    dirs: &[String],
    fuel: Option<u64>,
    guest_args: Vec<String>,
) -> Result<()> {
    let builder = HostBuilder::auto()
        .device(device.map(|d| d.device))
        .gpu(device.map_or(0, |d| d.gpu))
        .dtype(dtype)
        .max_load_bytes(max_load_bytes)
        .fuel_metering(fuel.is_some());
    let specs = graphs
        .iter()
        .map(|spec| {
            spec.split_once('=')
                .with_context(|| format!("--graph {spec}: expected NAME=PATH"))
        })
        .collect::<Result<Vec<_>>>()?;
    let builder = with_graphs(builder, &specs)?;
    let host = builder.build()?;
    let options = RunOptions {
        args: guest_args,
        dirs: dirs
            .iter()
            .map(|d| match d.split_once("::") {
                Some((h, g)) => (PathBuf::from(h), g.to_owned()),
                None => (PathBuf::from(d), d.clone()),
            })
            .collect(),
        fuel,
        ..Default::default()
    };
    let wasm = host.load_module(module)?;
    let program = module
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "guest.wasm".into());
    let outcome = host.run(&wasm, &program, &options)?;
    std::process::exit(outcome.exit_code);
}

/// `wasi-nn-host random-checkpoint`: deterministic random weights of a GPT-2 shape, written
/// as an HF folder or an llm.c checkpoint.
fn random_checkpoint(
    size: &str,
    out: &Path,
    dtype: StorageDtype,
    seed: u64,
    llmc: bool,
) -> Result<()> {
    let config = Gpt2Config::preset(size).with_context(|| format!("unknown size {size}"))?;
    let weights = model::random_weights(config, seed);
    if llmc {
        let bf16 = match dtype {
            StorageDtype::F32 => false,
            StorageDtype::Bf16 => true,
            StorageDtype::F16 => bail!("llm.c checkpoints are f32 or bf16"),
        };
        std::fs::write(out, model::write_llmc(&weights, bf16))
            .with_context(|| format!("writing {}", out.display()))?;
    } else {
        model::write_hf_checkpoint(&weights, out, dtype)?;
    }
    eprintln!(
        "wrote {} ({} parameters)",
        out.display(),
        config.num_params()
    );
    Ok(())
}

/// Load each `(name, spec)` graph (a path, `random:SIZE` or `null:SIZE`); without any, `gpt2` is the
/// embedded default model.
fn with_graphs(mut builder: HostBuilder, graphs: &[(&str, &str)]) -> Result<HostBuilder> {
    if graphs.is_empty() {
        let dir = wasi_nn_host::find_default_model().with_context(|| {
            format!(
                "the default model ({}) was not found under the current directory or the \
                 executable's; pass --graph gpt2=PATH",
                wasi_nn_host::DEFAULT_MODEL_DIR
            )
        })?;
        builder = builder.graph("gpt2", &dir)?;
    }
    for (name, spec) in graphs {
        if let Some(size) = spec.strip_prefix("null:") {
            let config = model::Gpt2Config::preset(size)
                .with_context(|| format!("{spec}: null: takes a size as random: does"))?;
            let executor = wasi_nn_host::null_backend::NullExecutor::new(config);
            builder = builder.graph_executor(name, std::sync::Arc::new(executor));
            continue;
        }
        builder = builder.graph_from_weights(name, model::load_spec(spec)?)?;
    }
    Ok(builder)
}

//! `wasi-nn-host`: a wasmtime embedding that runs WebAssembly guests with WASI and WASI-NN,
//! backed by our own GPT-2 implementation.
//!
//! The rooms, in the order a token passes them (dependencies point down this list only):
//! - [`runtime`]: the wasmtime host that instantiates guests: preview 1 modules (witx
//!   `wasi_ephemeral_nn`) and components (`wasi:nn` WIT, world `gpt2:text`).
//! - [`wasi_nn`]: our backend behind wasmtime-wasi-nn's traits: the graph contract (inputs,
//!   outputs, errors) and the KV-cache prefix reuse, shared by both devices.
//! - [`engine`]: what both devices share: [`Device`], the [`engine::Executor`] /
//!   [`engine::Session`] traits, the engine error, a session pool.
//! - [`cpu`]: the CPU reference forward pass (the specification).
//! - [`cuda`]: the CUDA backend (our kernels, NVRTC, cuBLAS/cuBLASLt).
//! - [`model`]: GPT-2 configs, f32 weights and the HF / llm.c loaders.
//! - [`guest_cycle`]: where a guest's token cycle goes (the step, reading logits, the
//!   guest's own time), summed over the process.
//! - [`switches`]: every `WASI_NN_HOST_*` switch, read once: production settings and
//!   measurement switches.
//!
//! Above them, `serve` (cargo feature `serve`, on by default): the OpenAI-style HTTP
//! completions service over the component, behind `wasi-nn-host serve`.
//!
//! ```no_run
//! use wasi_nn_host::{Device, HostBuilder, RunOptions};
//! # fn main() -> Result<(), wasi_nn_host::HostError> {
//! let host = HostBuilder::new(Device::Cpu)
//!     .graph("gpt2", std::path::Path::new("models/gpt2-shakespeare"))?
//!     .build()?;
//! let module = host.load_module(std::path::Path::new("target/gpt2.wasm"))?;
//! let options = RunOptions { args: vec!["ROMEO:".into()], ..Default::default() };
//! let outcome = host.run(&module, "gpt2.wasm", &options)?;
//! assert_eq!(outcome.exit_code, 0);
//! # Ok(()) }
//! ```

pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod guest_cycle;
pub mod model;
pub mod null_backend;
pub mod runtime;
#[cfg(feature = "serve")]
pub mod serve;
pub mod switches;
pub mod wasi_nn;

pub use engine::{Device, DeviceSpec, EngineError, EngineOptions, GpuDtype};
pub use runtime::{
    GuestModule, Host, HostBuilder, HostError, InstancePool, RunOptions, RunOutcome,
};
pub use wasi_nn::{Gpt2Backend, Gpt2Error};

use std::sync::Arc;

/// Where the embedded default model lives, relative to the repository root.
pub const DEFAULT_MODEL_DIR: &str = "models/gpt2-shakespeare";

/// Find the default model: under the current directory or any ancestor of it or of the
/// running executable (so `target/release/wasi-nn-host` finds the repository's copy).
pub fn find_default_model() -> Option<std::path::PathBuf> {
    let mut roots = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd);
    }
    if let Ok(exe) = std::env::current_exe() {
        roots.push(exe);
    }
    roots
        .iter()
        .flat_map(|r| r.ancestors())
        .map(|dir| dir.join(DEFAULT_MODEL_DIR))
        .find(|dir| dir.join("config.json").is_file())
}

/// Load `weights` onto `device` as an executor set up as `options` say.
pub fn executor_for(
    weights: model::Gpt2Weights,
    device: Device,
    options: &EngineOptions,
) -> Result<Arc<dyn engine::Executor>, EngineError> {
    match device {
        Device::Cpu => Ok(Arc::new(cpu::CpuExecutor::new(
            Arc::new(weights),
            options
                .kv_pool_bytes
                .unwrap_or(EngineOptions::DEFAULT_KV_POOL_BYTES),
        ))),
        Device::Cuda => Ok(Arc::new(cuda::CudaExecutor::new(&weights, options)?)),
    }
}

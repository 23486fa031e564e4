//! `wasi-nn-host`: a wasmtime embedding that runs WebAssembly guests with WASI preview 1 and
//! WASI-NN, backed by our own GPT-2 implementation.
//!
//! - [`model`]: GPT-2 configs, f32 weights and the HF / llm.c loaders.
//! - [`cpu`]: the CPU reference forward pass (the specification).
//! - [`backend`]: the wasi-nn backend traits over an [`backend::Executor`] (CPU or CUDA).
//! - [`runtime`]: the wasmtime host that instantiates guests (WASI preview 1 modules).
//! - [`component`]: the same for the guest as a component (WASI preview 2, `wasi:nn` WIT).
//! - `serve` (cargo feature `serve`, on by default): the OpenAI-style HTTP completions service
//!   over the component, behind `wasi-nn-host serve`.
//!
//! ```no_run
//! use wasi_nn_host::{backend::Device, runtime::{HostBuilder, RunOptions}};
//! # fn main() -> Result<(), wasi_nn_host::runtime::HostError> {
//! let host = HostBuilder::new(Device::Cpu)
//!     .graph("gpt2", std::path::Path::new("models/gpt2-shakespeare"))?
//!     .build()?;
//! let module = host.load_module(std::path::Path::new("target/gpt2.wasm"))?;
//! let options = RunOptions { args: vec!["ROMEO:".into()], ..Default::default() };
//! let outcome = host.run(&module, "gpt2.wasm", &options)?;
//! assert_eq!(outcome.exit_code, 0);
//! # Ok(()) }
//! ```

pub mod backend;
pub mod component;
pub mod cpu;
mod cublaslt;
pub mod cuda;
pub mod gpu_check;
pub mod model;
pub mod runtime;
#[cfg(feature = "serve")]
pub mod serve;

pub use backend::{Device, Gpt2Backend, Gpt2Error, GpuDtype};
pub use runtime::{Host, HostBuilder, HostError, RunOptions, RunOutcome};

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

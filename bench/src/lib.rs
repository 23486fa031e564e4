//! Checks and benchmarks of the GPT-2 backend, kept out of the host library: they reach it
//! through its public API, plus the kernel launchers and benchmark hooks of its `dev`
//! feature.
//!
//! - [`kernels`]: the kernel workbench: each kernel alone against the CPU reference.
//! - [`checks`]: whole models on the GPU against the CPU reference (prefill, decode graph,
//!   repeated prefills, scoring), and the sweep over awkward sizes.
//! - [`startup`]: guest start-up and short requests through the whole host path.

pub mod checks;
pub mod kernels;
pub mod startup;

//! llm.c checkpoints (`.bin`): any bytes give weights or an error.
#![no_main]

#[path = "bounded_alloc.rs"]
mod bounded_alloc;

#[global_allocator]
static ALLOCATOR: bounded_alloc::Bounded = bounded_alloc::Bounded;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = wasi_nn_host::model::parse_llmc(data, "fuzz input");
});

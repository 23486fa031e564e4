//! An HF checkpoint as a guest's `load` passes it: `model.safetensors` and `config.json`
//! bytes. The input's first 4 bytes (little-endian, modulo what follows) say where the
//! safetensors end and the config begins.
#![no_main]

#[path = "bounded_alloc.rs"]
mod bounded_alloc;

#[global_allocator]
static ALLOCATOR: bounded_alloc::Bounded = bounded_alloc::Bounded;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((head, rest)) = data.split_first_chunk::<4>() else {
        return;
    };
    let split = u32::from_le_bytes(*head) as usize % (rest.len() + 1);
    let (weights, config) = rest.split_at(split);
    let _ = wasi_nn_host::model::load_buffers(&[weights, config]);
});

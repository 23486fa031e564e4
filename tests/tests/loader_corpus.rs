//! The model loaders against a generated corpus of broken files: every truncation point of
//! the headers and many of the body, seeded bit flips, and headers that claim huge sizes,
//! for llm.c checkpoints and HF safetensors + config.json. Every input must give a result or
//! an error: no panic, and no allocation anywhere near a size the file claims (this test
//! binary's allocator records the largest single allocation).

use integration_tests::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use wasi_nn_host::model;

/// The system allocator, recording the largest single allocation.
struct Recording;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged.
unsafe impl GlobalAlloc for Recording {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: allocated above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: as for alloc.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Recording = Recording;

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Load every variant; return (loaded, refused). A panic fails the test with the case.
fn load_all(cases: Vec<(String, Vec<Vec<u8>>)>, limit: usize) -> (usize, usize) {
    let (mut ok, mut refused) = (0, 0);
    for (name, buffers) in cases {
        let slices: Vec<&[u8]> = buffers.iter().map(Vec::as_slice).collect();
        LARGEST.store(0, Ordering::Relaxed);
        let result = std::panic::catch_unwind(|| model::load_buffers(&slices).map(|_| ()));
        let largest = LARGEST.load(Ordering::Relaxed);
        match result {
            Ok(Ok(())) => ok += 1,
            Ok(Err(e)) => {
                assert!(
                    !e.to_string().is_empty(),
                    "{name}: an error without a message"
                );
                refused += 1
            }
            Err(_) => panic!("{name}: the loader panicked"),
        }
        assert!(
            largest <= limit,
            "{name}: allocated {largest} bytes at once (the file is {} bytes)",
            buffers.iter().map(Vec::len).sum::<usize>()
        );
    }
    (ok, refused)
}

/// Truncations (every header length, then 64 through the body), 400 seeded bit flips, and
/// fields set to huge values at `huge_at`.
fn corpus(
    what: &str,
    buffers: &[Vec<u8>],
    target: usize,
    header: usize,
    huge_at: &[(usize, &[u8])],
    seed: u64,
) -> Vec<(String, Vec<Vec<u8>>)> {
    let original = &buffers[target];
    let with = |bytes: Vec<u8>| {
        let mut all = buffers.to_vec();
        all[target] = bytes;
        all
    };
    let mut cases = Vec::new();
    let lengths = (0..header.min(original.len()))
        .chain((0..64).map(|i| header + (original.len() - header) * i / 64))
        .chain([original.len() - 1]);
    for len in lengths {
        cases.push((
            format!("{what} truncated to {len}"),
            with(original[..len].to_vec()),
        ));
    }
    let mut rng = Rng(seed);
    for i in 0..400 {
        let mut bytes = original.clone();
        // half the flips in the header, where the sizes are
        let at = if i % 2 == 0 {
            rng.below(header)
        } else {
            rng.below(bytes.len())
        };
        bytes[at] ^= 1 << rng.below(8);
        cases.push((format!("{what} bit flip at {at}"), with(bytes)));
    }
    for &(at, value) in huge_at {
        let mut bytes = original.clone();
        bytes[at..at + value.len()].copy_from_slice(value);
        cases.push((format!("{what} field at {at} = {value:?}"), with(bytes)));
    }
    cases
}

/// Largest single allocation allowed while loading the tiny model (its weights are < 1 MB):
/// far below any size a broken header claims.
const LIMIT: usize = 64 << 20;

#[test]
fn broken_llmc_checkpoints_give_errors_not_panics_or_huge_allocations() {
    let bin = std::fs::read(fixture("tiny_llmc.bin")).expect("read");
    let max = i32::MAX.to_le_bytes();
    let big = (1i32 << 30).to_le_bytes();
    // header: magic, version, maxT, V, L, H, C, padded V (4 bytes each)
    let huge: Vec<(usize, &[u8])> = (2..8)
        .flat_map(|field| [(field * 4, &max[..]), (field * 4, &big[..])])
        .collect();
    let cases = corpus("llm.c", &[bin], 0, 1024, &huge, 7);
    let n = cases.len();
    let (ok, refused) = load_all(cases, LIMIT);
    eprintln!("llm.c corpus: {n} files, {ok} loaded, {refused} refused");
    assert_eq!(ok + refused, n);
    assert!(refused > n / 2, "most broken files are refused");
}

#[test]
fn broken_safetensors_and_configs_give_errors_not_panics_or_huge_allocations() {
    let st = std::fs::read(fixture("tiny/model.safetensors")).expect("read");
    let config = std::fs::read(fixture("tiny/config.json")).expect("read");
    let header = 8 + u64::from_le_bytes(st[..8].try_into().expect("8 bytes")) as usize;
    let huge_len = u64::MAX.to_le_bytes();
    let mid_len = (1u64 << 40).to_le_bytes();
    let huge = [(0, &huge_len[..]), (0, &mid_len[..])];
    let mut cases = corpus(
        "safetensors",
        &[st.clone(), config.clone()],
        0,
        header,
        &huge,
        11,
    );
    // config.json: truncations and flips, and sizes that claim the world
    cases.extend(corpus(
        "config.json",
        &[st.clone(), config.clone()],
        1,
        config.len(),
        &[],
        13,
    ));
    let base: serde_json::Value = serde_json::from_slice(&config).expect("json");
    for (field, value) in [
        ("n_layer", serde_json::json!(1u64 << 40)),
        ("n_layer", serde_json::json!(-1)),
        ("n_embd", serde_json::json!(1u64 << 32)),
        ("n_head", serde_json::json!(0)),
        ("vocab_size", serde_json::json!(u64::MAX)),
        ("n_positions", serde_json::json!(1u64 << 31)),
        ("n_positions", serde_json::json!(1.5)),
        ("n_embd", serde_json::json!("big")),
    ] {
        let mut c = base.clone();
        c[field] = value.clone();
        cases.push((
            format!("config.json {field} = {value}"),
            vec![st.clone(), c.to_string().into_bytes()],
        ));
    }
    let n = cases.len();
    let (ok, refused) = load_all(cases, LIMIT);
    eprintln!("safetensors + config corpus: {n} files, {ok} loaded, {refused} refused");
    assert_eq!(ok + refused, n);
    assert!(refused > n / 2, "most broken files are refused");
}

//! Shared helpers for the integration tests: fixture paths and readers, tolerant comparison,
//! and a host with the default model for running `gpt2.wasm`.

use std::path::{Path, PathBuf};
use wasi_nn_host::model::Gpt2Weights;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new(".."))
        .to_owned()
}

pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

pub fn shakespeare_dir() -> PathBuf {
    repo_root().join(wasi_nn_host::DEFAULT_MODEL_DIR)
}

/// The guest module built by this crate's build script.
pub fn gpt2_wasm() -> PathBuf {
    PathBuf::from(env!("GPT2_WASM"))
}

/// `gpt2.wasm` pre-initialised (its tokenizer built into the snapshot) with the library's
/// [`wasi_nn_host::runtime::preinitialize`], as `wasi-nn-host preinit` and the scripts do.
/// Written once beside [`gpt2_wasm`] (`gpt2.preinit.wasm`) and reused while it is newer than
/// the module it came from. (Not in the build script: that would need wasmtime as a
/// build-dependency, compiled a second time.)
pub fn gpt2_preinit_wasm() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| preinitialised(&gpt2_wasm(), "gpt2.preinit.wasm"))
        .clone()
}

/// [`gpt2_component`] pre-initialised (its `wizer-initialize` export has built the
/// tokenizer), cached like [`gpt2_preinit_wasm`] (`gpt2_component.preinit.wasm`).
pub fn gpt2_component_preinit() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| preinitialised(&gpt2_component(), "gpt2_component.preinit.wasm"))
        .clone()
}

/// `plain` pre-initialised into `name` beside it, reused while newer than `plain` and marked
/// as a snapshot (one written before the marker existed is made again).
fn preinitialised(plain: &Path, name: &str) -> PathBuf {
    let out = plain.with_file_name(name);
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if let (Some(made), Some(source)) = (modified(&out), modified(plain)) {
        let marked =
            std::fs::read(&out).is_ok_and(|w| wasi_nn_host::runtime::is_preinitialised(&w));
        if made > source && marked {
            return out;
        }
    }
    let wasm = std::fs::read(plain).unwrap_or_else(|e| panic!("{}: {e}", plain.display()));
    let snapshot = wasi_nn_host::runtime::preinitialize(&wasm)
        .unwrap_or_else(|e| panic!("pre-initialising {}: {e}", plain.display()));
    // written under a name of its own, then renamed: another test binary may read it
    let tmp = out.with_extension(format!("{}.tmp", std::process::id()));
    std::fs::write(&tmp, snapshot).unwrap_or_else(|e| panic!("{}: {e}", tmp.display()));
    std::fs::rename(&tmp, &out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    out
}

/// The guest component (wasm32-wasip2) built by this crate's build script.
pub fn gpt2_component() -> PathBuf {
    PathBuf::from(env!("GPT2_COMPONENT"))
}

/// The hostile `wasi:nn` WIT guest (`tests/nn-probe`, a wasm32-wasip2 command component).
pub fn nn_probe() -> PathBuf {
    PathBuf::from(env!("NN_PROBE"))
}

pub fn read_json(name: &str) -> serde_json::Value {
    let path = fixture(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Rows of little-endian f32 of length `row`.
pub fn read_f32_rows(name: &str, row: usize) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    values.chunks_exact(row).map(<[f32]>::to_vec).collect()
}

pub fn ids(value: &serde_json::Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {value}"))
        .iter()
        .map(|v| v.as_u64().unwrap_or_else(|| panic!("not an id: {v}")) as u32)
        .collect()
}

pub fn id_lists(value: &serde_json::Value) -> Vec<Vec<u32>> {
    value
        .as_array()
        .map(|a| a.iter().map(ids).collect())
        .unwrap_or_default()
}

/// Assert `|ours - reference| <= rel * max(1, |reference|)` for every element; report the
/// worst element on failure. Returns the largest scaled error seen.
pub fn assert_close(ours: &[f32], reference: &[f32], rel: f32, what: &str) -> f32 {
    assert_eq!(ours.len(), reference.len(), "{what}: length");
    let mut worst = (0usize, 0.0f32);
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        let err = (a - b).abs() / b.abs().max(1.0);
        assert!(!err.is_nan(), "{what}: NaN at {i} ({a} vs {b})");
        if err > worst.1 {
            worst = (i, err);
        }
    }
    let (i, err) = worst;
    assert!(
        err <= rel,
        "{what}: element {i}: {} vs reference {} (scaled error {err:e} > {rel:e})",
        ours[i],
        reference[i]
    );
    err
}

/// Greedy decoding on the CPU reference: one prefill, then one position per step.
pub fn cpu_greedy(weights: &std::sync::Arc<Gpt2Weights>, prompt: &[u32], steps: usize) -> Vec<u32> {
    let model = wasi_nn_host::cpu::CpuModel::new(weights.clone());
    let mut cache = Default::default();
    let mut logits = model.forward(&mut cache, prompt, false);
    let mut out = Vec::new();
    for _ in 0..steps {
        let next = argmax(&logits) as u32;
        out.push(next);
        logits = model.forward(&mut cache, &[next], false);
    }
    out
}

/// First index of the maximum (as torch.argmax).
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

//! Loaders: dtypes (fp32/fp16/bf16, llm.c v3/v5), sharded safetensors, names with and
//! without `transformer.`, and an error naming the file and the fault for malformed input.

use integration_tests::*;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use wasi_nn_host::cpu::CpuModel;
use wasi_nn_host::model::{self, Gpt2Config, Gpt2Weights, StorageDtype};

fn tmp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("wasi-nn-host-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("tmp dir");
    dir
}

fn logits(weights: Gpt2Weights) -> Vec<f32> {
    CpuModel::new(Arc::new(weights)).forward(
        &mut Default::default(),
        &[3, 14, 159, 265, 358],
        false,
    )
}

fn tiny() -> Gpt2Weights {
    model::load_path(&fixture("tiny")).expect("tiny")
}

fn load_err(path: &Path) -> String {
    match model::load_path(path) {
        Ok(_) => panic!("{} should not load", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn half_precision_checkpoints_load_and_agree() {
    let reference = logits(tiny());
    for (dtype, tolerance) in [
        (StorageDtype::F32, 0.0f32),
        (StorageDtype::F16, 5e-3),
        (StorageDtype::Bf16, 3e-2),
    ] {
        let dir = tmp(&format!("{dtype:?}"));
        model::write_hf_checkpoint(&tiny(), &dir, dtype).expect("write");
        let ours = logits(model::load_path(&dir).expect("load"));
        let err = assert_close(
            &ours,
            &reference,
            tolerance.max(1e-6),
            &format!("{dtype:?}"),
        );
        eprintln!("{dtype:?}: worst scaled error {err:e}");
    }
    for bf16 in [false, true] {
        let dir = tmp(&format!("llmc-{bf16}"));
        let path = dir.join("model.bin");
        std::fs::write(&path, model::write_llmc(&tiny(), bf16)).expect("write");
        let ours = logits(model::load_path(&path).expect("load llm.c"));
        assert_close(&ours, &reference, if bf16 { 3e-2 } else { 1e-6 }, "llm.c");
    }
}

#[test]
fn sharded_checkpoint_with_prefixed_names_loads() {
    let src = std::fs::read(fixture("tiny/model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&src).expect("parse");
    let dir = tmp("sharded");
    let mut weight_map = HashMap::new();
    let names = st.names();
    for (shard, chunk) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", shard + 1);
        let tensors: Vec<(String, safetensors::tensor::TensorView)> = chunk
            .iter()
            .map(|n| (format!("transformer.{n}"), st.tensor(n).expect("tensor")))
            .collect();
        for (n, _) in &tensors {
            weight_map.insert(n.clone(), file.clone());
        }
        safetensors::serialize_to_file(tensors, None, &dir.join(&file)).expect("write shard");
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
    std::fs::copy(fixture("tiny/config.json"), dir.join("config.json")).expect("config");
    let sharded = model::load_path(&dir).expect("sharded");
    assert_eq!(sharded.wte, tiny().wte);
    assert_eq!(logits(sharded), logits(tiny()));
}

#[test]
fn malformed_files_are_refused_with_the_file_and_the_fault() {
    let dir = tmp("malformed");
    // llm.c: truncated, bad magic, bad version, trailing data
    let bin = std::fs::read(fixture("tiny_llmc.bin")).expect("read");
    let path = dir.join("x.bin");
    let write = |bytes: &[u8]| std::fs::write(&path, bytes).expect("write");
    write(&bin[..bin.len() - 100]);
    let e = load_err(&path);
    assert!(e.contains("x.bin") && e.contains("truncated"), "{e}");
    write(&bin[..100]);
    assert!(load_err(&path).contains("shorter than the 1024-byte llm.c header"));
    let mut bad = bin.clone();
    bad[4] = 4; // version 4
    write(&bad);
    assert!(load_err(&path).contains("unsupported version 4"));
    let mut bad = bin.clone();
    bad[0] ^= 1;
    write(&bad);
    assert!(load_err(&path).contains("bad magic"));
    let mut longer = bin.clone();
    longer.extend([0u8; 8]);
    write(&longer);
    assert!(load_err(&path).contains("trailing data"));
    let mut zero_heads = bin.clone();
    zero_heads[5 * 4..6 * 4].copy_from_slice(&0i32.to_le_bytes());
    write(&zero_heads);
    assert!(load_err(&path).contains("num_heads"));

    // HF folders
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).expect("dir");
    assert!(load_err(&hf).contains("config.json"), "missing config");
    std::fs::copy(fixture("tiny/config.json"), hf.join("config.json")).expect("copy");
    assert!(load_err(&hf).contains("no model.safetensors"));
    let st = std::fs::read(fixture("tiny/model.safetensors")).expect("read");
    std::fs::write(hf.join("model.safetensors"), &st[..st.len() / 2]).expect("write");
    let e = load_err(&hf);
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors"),
        "{e}"
    );
    std::fs::write(
        hf.join("model.safetensors"),
        b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
    )
    .expect("write");
    assert!(load_err(&hf).contains("missing tensor `h.0.ln_1.weight`"));
    // shape mismatch: a config that disagrees with the tensors
    std::fs::write(hf.join("model.safetensors"), &st).expect("write");
    let mut cfg: serde_json::Value = read_json("tiny/config.json");
    cfg["n_embd"] = 96.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).expect("write");
    assert!(load_err(&hf).contains("has shape"));
    cfg["n_embd"] = 48.into();
    cfg["n_head"] = 5.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).expect("write");
    assert!(load_err(&hf).contains("not a multiple of n_head"));
    cfg["n_head"] = 3.into();
    cfg["activation_function"] = "relu".into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).expect("write");
    assert!(load_err(&hf).contains("activation_function `relu`"));
    std::fs::write(hf.join("config.json"), "{not json").expect("write");
    assert!(load_err(&hf).contains("not a GPT-2 config.json"));
    // an integer tensor where weights belong
    std::fs::copy(fixture("tiny/config.json"), hf.join("config.json")).expect("copy");
    let parsed = safetensors::SafeTensors::deserialize(&st).expect("parse");
    let ints = vec![0u8; 48 * 4];
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = parsed
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "h.0.ln_1.weight")
        .collect();
    tensors.push((
        "h.0.ln_1.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![48], &ints)
            .expect("view"),
    ));
    safetensors::serialize_to_file(tensors, None, &hf.join("model.safetensors")).expect("write");
    assert!(load_err(&hf).contains("dtype I32"));
    // a plain file that is neither
    std::fs::write(&path, b"hello").expect("write");
    assert!(load_err(&path).contains("not an llm.c checkpoint"));
    assert!(load_err(&dir.join("missing.bin")).contains("missing.bin"));
}

#[test]
fn random_checkpoints_are_deterministic_and_round_trip() {
    let config = Gpt2Config {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        n_ctx: 16,
        vocab_size: 300,
    };
    let a = model::random_weights(config, 5);
    let b = model::random_weights(config, 5);
    let c = model::random_weights(config, 6);
    assert_eq!(a.wte, b.wte);
    assert_eq!(a.layers[1].fc_w, b.layers[1].fc_w);
    assert_ne!(a.wte, c.wte);
    assert_eq!(a.wte.len(), 300 * 32);
    let dir = tmp("random");
    model::write_hf_checkpoint(&a, &dir, StorageDtype::F32).expect("write");
    let back = model::load_path(&dir).expect("load");
    assert_eq!(back.layers[0].qkv_w, a.layers[0].qkv_w);
    assert_eq!(back.config, config);
    // presets have the published parameter counts
    let p = |s: &str| Gpt2Config::preset(s).map(|c| c.num_params()).unwrap_or(0);
    assert_eq!(p("124M"), 124_439_808);
    assert_eq!(p("1558M"), 1_557_611_200);
    // and shapes of GPT-2's vocabulary and context
    let tiny = Gpt2Config::preset("2x2x64").expect("a shape");
    assert_eq!((tiny.n_layer, tiny.n_head, tiny.n_embd), (2, 2, 64));
    assert_eq!((tiny.vocab_size, tiny.n_ctx), (50257, 1024));
    for bad in [
        "2x3x64",
        "0x1x8",
        "2x2",
        "2x2x64x1",
        "axbxc",
        "2x2x0",
        "1x1x99999",
    ] {
        assert!(Gpt2Config::preset(bad).is_none(), "{bad}");
    }
}

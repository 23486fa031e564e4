//! The CPU backend against HF transformers' numbers (fixtures made by
//! `tests/fixtures/make_fixtures.py`): last-position logits within 1e-4 (scaled by
//! max(1, |ref|)) and identical 64-token greedy continuations, for the shakespeare model
//! (fp16 checkpoint, `transformer.` names) and a tiny random model loaded both from HF
//! safetensors (names without prefix) and from llm.c's format.

use integration_tests::*;
use std::sync::Arc;
use wasi_nn_host::cpu::CpuModel;
use wasi_nn_host::model::{self, Gpt2Weights};

const REL: f32 = 1e-4;

fn last_logits(weights: &Arc<Gpt2Weights>, prompt: &[u32]) -> Vec<f32> {
    CpuModel::new(weights.clone()).forward(&mut Default::default(), prompt, false)
}

fn check_model(weights: Gpt2Weights, fixture_json: &str, logits_bin: &str) {
    let weights = Arc::new(weights);
    let fixture = read_json(fixture_json);
    let prompts = id_lists(&fixture["prompt_ids"]);
    let reference = read_f32_rows(logits_bin, weights.config.vocab_size);
    assert_eq!(prompts.len(), reference.len());
    for (i, (prompt, want)) in prompts.iter().zip(&reference).enumerate() {
        let err = assert_close(
            &last_logits(&weights, prompt),
            want,
            REL,
            &format!("{fixture_json} prompt {i}"),
        );
        eprintln!(
            "{fixture_json} prompt {i} ({} tokens): worst scaled error {err:e}",
            prompt.len()
        );
    }
    let greedy = id_lists(&fixture["greedy_64"]);
    assert!(!greedy.is_empty());
    for (i, want) in greedy.iter().enumerate() {
        assert_eq!(
            &cpu_greedy(&weights, &prompts[i], want.len()),
            want,
            "{fixture_json} greedy {i}"
        );
    }
}

#[test]
fn shakespeare_matches_hf_logits_and_greedy_ids() {
    let weights = model::load_path(&shakespeare_dir()).expect("load shakespeare");
    assert_eq!(weights.config.n_layer, 8);
    check_model(weights, "shakespeare.json", "shakespeare_logits.bin");
}

#[test]
fn tiny_from_hf_safetensors_matches_hf() {
    let weights = model::load_path(&fixture("tiny")).expect("load tiny safetensors");
    check_model(weights, "tiny.json", "tiny_logits.bin");
}

#[test]
fn tiny_from_llmc_matches_hf() {
    let weights = model::load_path(&fixture("tiny_llmc.bin")).expect("load tiny llm.c");
    assert_eq!(weights.config.vocab_size, 1000, "padded rows are dropped");
    check_model(weights, "tiny.json", "tiny_logits.bin");
}

#[test]
fn full_context_prompt_is_in_the_fixture() {
    // The last tiny prompt fills the whole context (128 positions); check_model covers it.
    let prompts = id_lists(&read_json("tiny.json")["prompt_ids"]);
    let weights = model::load_path(&fixture("tiny")).expect("load tiny");
    assert_eq!(prompts.last().map(Vec::len), Some(weights.config.n_ctx));
}

#[test]
fn loaded_bytes_equal_loaded_files() {
    // wasi-nn `load` from guest bytes: llm.c alone, or safetensors + config.json.
    let from_file = model::load_path(&fixture("tiny")).expect("tiny");
    let st = std::fs::read(fixture("tiny/model.safetensors")).expect("read");
    let cfg = std::fs::read(fixture("tiny/config.json")).expect("read");
    let from_bytes = model::load_buffers(&[&st, &cfg]).expect("safetensors bytes");
    assert_eq!(from_file.wte, from_bytes.wte);
    assert_eq!(
        from_file.layers[1].fc_proj_w,
        from_bytes.layers[1].fc_proj_w
    );
    let bin = std::fs::read(fixture("tiny_llmc.bin")).expect("read");
    let from_llmc = model::load_buffers(&[&bin]).expect("llm.c bytes");
    assert_eq!(from_file.layers[0].qkv_w, from_llmc.layers[0].qkv_w);
    assert_eq!(from_file.wpe, from_llmc.wpe);
}

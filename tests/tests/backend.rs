//! The wasi-nn backend through its traits: prefix-cache reuse and rewind, the range output,
//! loading from bytes, and every kind of bad input, each refused with a clear error while the
//! backend keeps serving.

use integration_tests::*;
use std::sync::Arc;
use wasi_nn_host::cpu::CpuExecutor;
use wasi_nn_host::model;
use wasi_nn_host::wasi_nn::{Gpt2Backend, Gpt2Context, Gpt2Error};
use wasi_nn_host::Device;
use wasmtime_wasi_nn::backend::{BackendExecutionContext, BackendInner, Id};
use wasmtime_wasi_nn::wit::{ExecutionTarget, TensorType};
use wasmtime_wasi_nn::Tensor;

fn tiny_context() -> Gpt2Context {
    let weights = model::load_path(&fixture("tiny")).expect("tiny");
    Gpt2Context::new(Arc::new(CpuExecutor::new(Arc::new(weights), 1 << 30))).expect("context")
}

fn tokens_tensor(ids: &[i32]) -> Tensor {
    Tensor::new(
        vec![1, ids.len() as u32],
        TensorType::I32,
        ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
    )
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn compute(ctx: &mut Gpt2Context, ids: &[u32]) -> Vec<f32> {
    let ids: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
    ctx.set_input_tensor(0, &tokens_tensor(&ids))
        .expect("set_input");
    ctx.run().expect("compute");
    f32s(&ctx.output_tensor(0).expect("output 0"))
}

fn sequence(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % 1000)
        .collect()
}

#[test]
fn step_by_step_equals_one_prefill() {
    let seq = sequence(40, 1);
    let mut stepwise = tiny_context();
    let mut last = Vec::new();
    for n in 1..=seq.len() {
        last = compute(&mut stepwise, &seq[..n]);
        assert_eq!(
            stepwise.last_reused(),
            n - 1,
            "each step reuses the whole prefix"
        );
    }
    let mut prefill = tiny_context();
    let once = compute(&mut prefill, &seq);
    assert_eq!(prefill.last_reused(), 0);
    assert_close(&last, &once, 1e-5, "stepwise vs prefill");
}

#[test]
fn rewind_after_divergence_equals_a_fresh_run() {
    let first = sequence(30, 2);
    let mut second = first[..12].to_vec();
    second.extend(sequence(20, 3));
    let mut ctx = tiny_context();
    compute(&mut ctx, &first);
    let rewound = compute(&mut ctx, &second);
    assert_eq!(ctx.last_reused(), 12, "kept exactly the common prefix");
    assert_eq!(ctx.cached_len(), second.len());
    let fresh = compute(&mut tiny_context(), &second);
    assert_close(&rewound, &fresh, 1e-6, "rewound vs fresh");
    // A shorter sequence that is a prefix of the cache: only its last position is recomputed.
    let shorter = compute(&mut ctx, &second[..5]);
    assert_eq!(ctx.last_reused(), 4);
    assert_close(
        &shorter,
        &compute(&mut tiny_context(), &second[..5]),
        1e-6,
        "prefix of cache",
    );
    // The same sequence again recomputes only its last position.
    compute(&mut ctx, &second[..5]);
    assert_eq!(ctx.last_reused(), 4);
}

#[test]
fn range_output_holds_every_position_from_logits_from() {
    let seq = sequence(16, 4);
    let mut ctx = tiny_context();
    compute(&mut ctx, &seq[..10]); // a cached prefix that logits_from must override
    ctx.set_input_tensor(
        1,
        &Tensor::new(vec![1], TensorType::I32, 3i32.to_le_bytes().to_vec()),
    )
    .expect("logits_from");
    let ids: Vec<i32> = seq.iter().map(|&v| v as i32).collect();
    ctx.set_input_tensor(0, &tokens_tensor(&ids))
        .expect("input");
    ctx.run().expect("compute");
    assert_eq!(ctx.last_reused(), 3);
    let range = ctx.output_tensor(1).expect("output 1");
    assert_eq!(range.dimensions, vec![1, 13, 1000]);
    let rows = f32s(&range);
    for (i, row) in rows.chunks_exact(1000).enumerate() {
        let want = compute(&mut tiny_context(), &seq[..3 + i + 1]);
        assert_close(row, &want, 1e-5, &format!("range row {i}"));
    }
    let last = f32s(&ctx.output_tensor(0).expect("output 0"));
    assert_eq!(last, rows[12 * 1000..].to_vec());
}

#[test]
fn bad_inputs_get_clear_errors_and_the_context_keeps_serving() {
    let mut ctx = tiny_context();
    let good = tokens_tensor(&[1, 2, 3]);
    let check = |ctx: &mut Gpt2Context, tensor: Tensor, want: &str| {
        let err = ctx.set_input_tensor(0, &tensor).expect_err(want);
        let msg = err.to_string();
        assert!(msg.contains(want), "`{msg}` should mention `{want}`");
        // still serving
        ctx.set_input_tensor(0, &good).expect("good input");
        ctx.run().expect("compute after a refused input");
    };
    // compute before any input
    let mut fresh = tiny_context();
    assert!(matches!(fresh.run(), Err(Gpt2Error::NoInput)));
    assert!(matches!(
        fresh.output_tensor(0),
        Err(Gpt2Error::NotComputed(0))
    ));
    check(
        &mut ctx,
        tokens_tensor(&[1, -1, 3]),
        "token id -1 at position 1",
    );
    check(
        &mut ctx,
        tokens_tensor(&[1, 1000]),
        "token id 1000 at position 1",
    );
    check(&mut ctx, tokens_tensor(&[]), "empty");
    check(
        &mut ctx,
        tokens_tensor(&vec![7; 129]),
        "longer than the model's context of 128",
    );
    check(
        &mut ctx,
        Tensor::new(vec![1, 2], TensorType::Fp32, vec![0; 8]),
        "must be an I32 tensor",
    );
    check(
        &mut ctx,
        Tensor::new(vec![2, 2], TensorType::I32, vec![0; 16]),
        "dimensions [2, 2]",
    );
    check(
        &mut ctx,
        Tensor::new(vec![1, 3], TensorType::I32, vec![0; 8]),
        "do not fit 8 bytes",
    );
    check(
        &mut ctx,
        Tensor::new(vec![1, u32::MAX], TensorType::I32, vec![0; 8]),
        "do not fit",
    );
    // unknown input and output indices, and output 1 without logits_from
    assert!(ctx.set_input_tensor(2, &good).is_err());
    assert!(matches!(
        ctx.set_input_tensor(8, &good),
        Err(Gpt2Error::NoSuchInput(_))
    ));
    assert!(matches!(
        ctx.output_tensor(7),
        Err(Gpt2Error::NoSuchOutput(_))
    ));
    assert!(matches!(ctx.output_tensor(1), Err(Gpt2Error::NoAllLogits)));
    // logits_from past the end of the sequence
    ctx.set_input_tensor(
        1,
        &Tensor::new(vec![1], TensorType::I32, 9i32.to_le_bytes().to_vec()),
    )
    .expect("logits_from");
    assert!(matches!(
        ctx.run(),
        Err(Gpt2Error::LogitsFromOutOfRange { .. })
    ));
    // Through the wasi-nn trait, errors come back as values too.
    let err = BackendExecutionContext::set_input(&mut ctx, Id::Name("nope".into()), &good);
    assert!(err.is_err());
}

#[test]
fn backend_loads_guest_bytes_and_refuses_bad_ones() {
    let mut backend = Gpt2Backend::new(Device::Cpu, 1 << 20);
    let bin = std::fs::read(fixture("tiny_llmc.bin")).expect("read");
    let graph = backend
        .load(&[&bin], ExecutionTarget::Cpu)
        .expect("llm.c bytes");
    let mut ctx = graph.init_execution_context().expect("context");
    ctx.set_input(Id::Index(0), &tokens_tensor(&[5, 6]))
        .expect("input");
    ctx.compute().expect("compute");
    assert_eq!(
        ctx.get_output(Id::Index(0)).expect("out").dimensions,
        vec![1, 1000]
    );

    let st = std::fs::read(fixture("tiny/model.safetensors")).expect("read");
    let cfg = std::fs::read(fixture("tiny/config.json")).expect("read");
    assert!(backend.load(&[&st, &cfg], ExecutionTarget::Cpu).is_ok());
    assert!(
        backend.load(&[&st], ExecutionTarget::Cpu).is_err(),
        "safetensors without config"
    );
    assert!(
        backend
            .load(&[&bin[..bin.len() - 4]], ExecutionTarget::Cpu)
            .is_err(),
        "truncated"
    );
    assert!(backend.load(&[b"garbage"], ExecutionTarget::Cpu).is_err());
    assert!(backend.load(&[], ExecutionTarget::Cpu).is_err());
    let mut small = Gpt2Backend::new(Device::Cpu, 1000);
    assert!(
        small.load(&[&bin], ExecutionTarget::Cpu).is_err(),
        "over the size limit"
    );
    // still serving after all of that
    assert!(backend.load(&[&bin], ExecutionTarget::Cpu).is_ok());
}

#[test]
fn wit_compute_with_next_token_only_returns_the_greedy_token_alone() {
    use wasmtime_wasi_nn::backend::NamedTensor;
    let mut ctx = tiny_context();
    let ids = sequence(9, 3);
    let logits = compute(&mut ctx, &ids);
    let want = wasi_nn_host::engine::argmax(&logits) as i32;
    let mut fresh = tiny_context();
    let ids32: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
    let inputs = vec![
        NamedTensor {
            name: "input_ids".to_owned(),
            tensor: tokens_tensor(&ids32),
        },
        NamedTensor {
            name: wasi_nn_host::wasi_nn::NEXT_TOKEN_ONLY.to_owned(),
            tensor: Tensor::new(vec![1], TensorType::I32, 1i32.to_le_bytes().to_vec()),
        },
    ];
    let outputs = fresh
        .compute(Some(inputs))
        .expect("compute")
        .expect("named outputs");
    assert_eq!(outputs.len(), 1, "only the next token comes back");
    assert_eq!(outputs[0].name, "next_token");
    assert_eq!(outputs[0].tensor.data, want.to_le_bytes().to_vec());
}

fn sampling_tensor(temperature: f32, top_p: f32) -> Tensor {
    let bytes = [temperature, top_p]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    Tensor::new(vec![2], TensorType::Fp32, bytes)
}

fn seed_tensor(seed: u64) -> Tensor {
    Tensor::new(vec![1], TensorType::I64, seed.to_le_bytes().to_vec())
}

/// Output 4 through the witx path (inputs set by index, kept until set again): the token the
/// rule draws from output 0's logits for the next position; the same seed and position draw
/// it again, alone or after other steps.
#[test]
fn output_4_draws_what_the_rule_draws_from_the_logits() {
    use wasi_nn_host::engine::draw::{draw, DrawRule};
    let mut ctx = tiny_context();
    ctx.set_input_tensor(2, &sampling_tensor(0.9, 0.8))
        .expect("sampling");
    ctx.set_input_tensor(3, &seed_tensor(12345)).expect("seed");
    let mut ids = sequence(7, 2);
    let mut drawn = Vec::new();
    for _ in 0..12 {
        let logits = compute(&mut ctx, &ids);
        let rule = DrawRule::new(0.9, 0.8, 12345).expect("rule");
        let want = draw(&logits, &rule, ids.len());
        let got = ctx.output_tensor(4).expect("output 4");
        assert_eq!(got.dimensions, vec![1]);
        assert_eq!(got.data, (want as i32).to_le_bytes().to_vec());
        drawn.push(want);
        ids.push(want);
    }
    // another context, other steps in between: the same draws at the same positions
    let mut other = tiny_context();
    other
        .set_input_tensor(2, &sampling_tensor(0.9, 0.8))
        .expect("sampling");
    other
        .set_input_tensor(3, &seed_tensor(12345))
        .expect("seed");
    compute(&mut other, &sequence(30, 9));
    let mut again = sequence(7, 2);
    for &want in &drawn {
        compute(&mut other, &again);
        let got = other.sampled_token().expect("output 4");
        assert_eq!(got, want);
        again.push(got);
    }
    // a different seed draws other tokens somewhere in twelve steps
    other
        .set_input_tensor(3, &seed_tensor(54321))
        .expect("seed");
    let mut third = sequence(7, 2);
    let mut differ = false;
    for &want in &drawn {
        compute(&mut other, &third);
        let got = other.sampled_token().expect("output 4");
        differ |= got != want;
        third.push(want);
    }
    assert!(differ, "seed 54321 drew the same 12 tokens as seed 12345");
}

#[test]
fn sampling_inputs_are_checked() {
    let mut ctx = tiny_context();
    compute(&mut ctx, &sequence(4, 1));
    // output 4 without input 2
    assert!(matches!(ctx.output_tensor(4), Err(Gpt2Error::NoDrawRule)));
    for (t, p) in [
        (0.0, 1.0),
        (-1.0, 1.0),
        (f32::NAN, 0.9),
        (1.0, 0.0),
        (1.0, 1.01),
    ] {
        let refused = ctx.set_input_tensor(2, &sampling_tensor(t, p));
        assert!(
            matches!(refused, Err(Gpt2Error::BadRule(_))),
            "temperature {t}, top_p {p}: {refused:?}"
        );
    }
    let wrong_type = Tensor::new(vec![2], TensorType::I32, vec![0; 8]);
    assert!(matches!(
        ctx.set_input_tensor(2, &wrong_type),
        Err(Gpt2Error::WrongTensorType { index: 2, .. })
    ));
    let wrong_shape = Tensor::new(vec![1], TensorType::I64, vec![0; 16]);
    assert!(matches!(
        ctx.set_input_tensor(3, &wrong_shape),
        Err(Gpt2Error::WrongShape { index: 3, .. })
    ));
    // the context still serves, and a good rule draws
    ctx.set_input_tensor(2, &sampling_tensor(1.0, 0.95))
        .expect("sampling");
    compute(&mut ctx, &sequence(5, 1));
    assert!(ctx.sampled_token().is_ok());
}

/// Through the WIT ABI: `sampling` and `seed` with the call, and `sampled_token` alone back.
#[test]
fn wit_compute_with_sampling_returns_the_sampled_token_alone() {
    use wasi_nn_host::engine::draw::{draw, DrawRule};
    use wasmtime_wasi_nn::backend::NamedTensor;
    let ids = sequence(11, 4);
    let mut ctx = tiny_context();
    let logits = compute(&mut ctx, &ids);
    let want = draw(
        &logits,
        &DrawRule::new(1.0, 0.9, 7).expect("rule"),
        ids.len(),
    ) as i32;
    let ids32: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
    let named = |name: &str, tensor: Tensor| NamedTensor {
        name: name.to_owned(),
        tensor,
    };
    let mut fresh = tiny_context();
    let outputs = fresh
        .compute(Some(vec![
            named("input_ids", tokens_tensor(&ids32)),
            named("sampling", sampling_tensor(1.0, 0.9)),
            named("seed", seed_tensor(7)),
        ]))
        .expect("compute")
        .expect("named outputs");
    assert_eq!(outputs.len(), 1, "only the sampled token comes back");
    assert_eq!(outputs[0].name, "sampled_token");
    assert_eq!(outputs[0].tensor.data, want.to_le_bytes().to_vec());
    // the settings applied to that call alone: the next call without them gets logits
    let outputs = fresh
        .compute(Some(vec![named("input_ids", tokens_tensor(&ids32))]))
        .expect("compute")
        .expect("named outputs");
    assert_eq!(outputs[0].name, "logits");
}

fn f32_tensor(values: &[f32]) -> Tensor {
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    Tensor::new(vec![values.len() as u32], TensorType::Fp32, bytes)
}

fn i32_tensor(values: &[i32]) -> Tensor {
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    Tensor::new(vec![values.len() as u32], TensorType::I32, bytes)
}

/// Output 4 with min-p, penalties and a logit bias (witx inputs 2 and 4-7, kept until set
/// again): each token is the rule's draw from the logits processed by the specification, for
/// the sequence as it grows; the bias forces what it forces.
#[test]
fn output_4_draws_from_the_processed_logits() {
    use wasi_nn_host::engine::draw::{draw, DrawRule};
    use wasi_nn_host::engine::processing::Processing;
    let mut ctx = tiny_context();
    ctx.set_input_tensor(2, &f32_tensor(&[0.9, 0.95, 0.02]))
        .expect("sampling with min_p");
    ctx.set_input_tensor(3, &seed_tensor(99)).expect("seed");
    ctx.set_input_tensor(4, &f32_tensor(&[0.4, 0.3, 1.3]))
        .expect("penalties");
    let prompt = sequence(6, 5);
    ctx.set_input_tensor(5, &i32_tensor(&[prompt.len() as i32]))
        .expect("generated_from");
    ctx.set_input_tensor(6, &i32_tensor(&[3, 17]))
        .expect("bias ids");
    ctx.set_input_tensor(7, &f32_tensor(&[1.5, -2.0]))
        .expect("bias values");
    let processing = Processing::new((0.4, 0.3, 1.3), &[3, 17], &[1.5, -2.0], prompt.len(), 1000)
        .expect("processing");
    let rule = DrawRule::new(0.9, 0.95, 99)
        .and_then(|r| r.with_min_p(0.02))
        .expect("rule");
    let mut ids = prompt.clone();
    let mut processed = Vec::new();
    for _ in 0..12 {
        let logits = compute(&mut ctx, &ids);
        processing
            .apply(&logits, &ids, &mut processed)
            .expect("processed");
        let want = draw(&processed, &rule, ids.len());
        let got = ctx.sampled_token().expect("output 4");
        assert_eq!(got, want);
        ids.push(got);
    }
    // a bias of +100 on one token draws it at every step
    ctx.set_input_tensor(4, &f32_tensor(&[0.0, 0.0, 1.0]))
        .expect("no penalties");
    ctx.set_input_tensor(6, &i32_tensor(&[42]))
        .expect("bias id");
    ctx.set_input_tensor(7, &f32_tensor(&[100.0]))
        .expect("bias value");
    for _ in 0..4 {
        compute(&mut ctx, &ids);
        let got = ctx.sampled_token().expect("output 4");
        assert_eq!(got, 42);
        ids.push(got);
    }
}

#[test]
fn processing_inputs_are_checked() {
    let mut ctx = tiny_context();
    ctx.set_input_tensor(2, &sampling_tensor(1.0, 0.9))
        .expect("sampling");
    let refused = |ctx: &mut Gpt2Context, index: u32, tensor: Tensor| {
        let result = ctx.set_input_tensor(index, &tensor);
        assert!(
            matches!(
                result,
                Err(Gpt2Error::BadProcessing(_)
                    | Gpt2Error::BadRule(_)
                    | Gpt2Error::WrongShape { .. }
                    | Gpt2Error::WrongTensorType { .. })
            ),
            "input {index}: {result:?}"
        );
    };
    refused(&mut ctx, 2, f32_tensor(&[1.0, 0.9, 1.5]));
    refused(&mut ctx, 4, f32_tensor(&[f32::NAN, 0.0, 1.0]));
    refused(&mut ctx, 4, f32_tensor(&[0.0, 0.0, 0.0]));
    refused(&mut ctx, 4, f32_tensor(&[0.0, 0.0]));
    refused(&mut ctx, 5, i32_tensor(&[1, 2]));
    refused(&mut ctx, 5, i32_tensor(&[-3]));
    refused(&mut ctx, 6, i32_tensor(&[1000]));
    refused(&mut ctx, 6, i32_tensor(&[-1]));
    refused(&mut ctx, 7, i32_tensor(&[1]));
    // ids and values that do not pair, and generated_from past the sequence: at the draw
    ctx.set_input_tensor(6, &i32_tensor(&[1, 2])).expect("ids");
    ctx.set_input_tensor(7, &f32_tensor(&[1.0]))
        .expect("values");
    compute(&mut ctx, &sequence(5, 2));
    assert!(matches!(
        ctx.sampled_token(),
        Err(Gpt2Error::BadProcessing(_))
    ));
    ctx.set_input_tensor(7, &f32_tensor(&[1.0, 2.0]))
        .expect("values");
    ctx.set_input_tensor(5, &i32_tensor(&[9])).expect("past");
    compute(&mut ctx, &sequence(5, 2));
    assert!(matches!(
        ctx.sampled_token(),
        Err(Gpt2Error::BadProcessing(_))
    ));
    // the context still serves
    ctx.set_input_tensor(5, &i32_tensor(&[5]))
        .expect("generated_from");
    compute(&mut ctx, &sequence(5, 2));
    assert!(ctx.sampled_token().is_ok());
}

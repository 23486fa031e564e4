//! A hostile guest of the `wasi:nn` WIT ABI, for the tests (`tests/tests/wit_bad_input.rs`).
//!
//! `nn-probe matrix` makes every kind of bad call that cannot trap and prints one line per
//! call: `name ok ...` or `name error <code> <message>`; after each bad call it makes a
//! well-formed one (`name/after`), which must work. Other arguments name one call that must
//! trap the instance: `bad-handle`, `bad-pointer`, `tensor-flood`, `tensor-bytes`.

use std::process::ExitCode;

wit_bindgen::generate!({
    world: "wasi:nn/ml",
    path: "../../wit/deps/wasi-nn",
    generate_all,
});

use wasi::nn::errors::Error;
use wasi::nn::graph::{self, ExecutionTarget, Graph, GraphEncoding};
use wasi::nn::inference::GraphExecutionContext;
use wasi::nn::tensor::{Tensor, TensorType};

/// The preloaded graph the host names `gpt2` (the embedded Shakespeare model: 50257 ids,
/// 512 positions).
const GRAPH: &str = "gpt2";
const VOCAB: u32 = 50257;

fn report<T>(name: &str, result: Result<T, Error>, ok: impl FnOnce(&T) -> String) {
    match result {
        Ok(value) => println!("{name} ok {}", ok(&value)),
        Err(e) => println!("{name} error {:?} {}", e.code(), e.data()),
    }
}

fn ids(values: &[i64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| (v as i32).to_le_bytes())
        .collect()
}

fn tensor(dims: &[u32], ty: TensorType, data: Vec<u8>) -> Tensor {
    Tensor::new(dims, ty, &data)
}

fn compute(
    context: &GraphExecutionContext,
    inputs: Vec<(&str, Tensor)>,
) -> Result<Vec<(String, Tensor)>, Error> {
    let inputs = inputs
        .into_iter()
        .map(|(name, t)| (name.to_owned(), t))
        .collect();
    context.compute(inputs)
}

fn describe(outputs: &[(String, Tensor)]) -> String {
    outputs
        .iter()
        .map(|(name, t)| format!("{name}{:?}:{}", t.dimensions(), t.data().len()))
        .collect::<Vec<_>>()
        .join(",")
}

/// A well-formed call on `context`: the logits of two tokens.
fn good(context: &GraphExecutionContext, name: &str) {
    let input = tensor(&[1, 2], TensorType::I32, ids(&[464, 318]));
    report(
        &format!("{name}/after"),
        compute(context, vec![("input_ids", input)]),
        |o| describe(o),
    );
}

fn matrix() {
    report(
        "load-by-name-unknown",
        graph::load_by_name("no-such-graph"),
        |_| String::new(),
    );
    let garbage = vec![vec![0xde, 0xad, 0xbe, 0xef]];
    report(
        "load-garbage",
        graph::load(&garbage, GraphEncoding::Autodetect, ExecutionTarget::Cpu),
        |_| String::new(),
    );
    report(
        "load-nothing",
        graph::load(&[], GraphEncoding::Autodetect, ExecutionTarget::Cpu),
        |_| String::new(),
    );
    report(
        "load-onnx",
        graph::load(&garbage, GraphEncoding::Onnx, ExecutionTarget::Cpu),
        |_| String::new(),
    );
    report(
        "load-tpu",
        graph::load(&garbage, GraphEncoding::Autodetect, ExecutionTarget::Tpu),
        |_| String::new(),
    );
    // past the host's load limit (the test sets it to 1 MiB)
    let big = vec![vec![0u8; 3 << 20]];
    report(
        "load-too-large",
        graph::load(&big, GraphEncoding::Autodetect, ExecutionTarget::Cpu),
        |_| String::new(),
    );
    let graph: Graph = match graph::load_by_name(GRAPH) {
        Ok(g) => g,
        Err(e) => {
            println!("load-by-name error {:?} {}", e.code(), e.data());
            return;
        }
    };
    let context = match graph.init_execution_context() {
        Ok(c) => c,
        Err(e) => {
            println!("init error {:?} {}", e.code(), e.data());
            return;
        }
    };
    // a fresh context given nothing to compute
    report("no-inputs", compute(&context, vec![]), |o| describe(o));
    good(&context, "no-inputs");
    let cases: Vec<(&str, Vec<(&str, Tensor)>)> = vec![
        (
            "dims-not-bytes",
            vec![("input_ids", tensor(&[1, 3], TensorType::I32, ids(&[1, 2])))],
        ),
        (
            "dims-overflow",
            vec![(
                "input_ids",
                tensor(&[u32::MAX, u32::MAX], TensorType::I32, ids(&[1])),
            )],
        ),
        (
            "rank-3",
            vec![(
                "input_ids",
                tensor(&[1, 1, 2], TensorType::I32, ids(&[1, 2])),
            )],
        ),
        (
            "wrong-type",
            vec![(
                "input_ids",
                tensor(&[1, 2], TensorType::Fp32, 1.5f32.to_le_bytes().repeat(2)),
            )],
        ),
        (
            "id-past-vocab",
            vec![(
                "input_ids",
                tensor(&[1, 2], TensorType::I32, ids(&[1, VOCAB as i64])),
            )],
        ),
        (
            "id-negative",
            vec![("input_ids", tensor(&[1, 2], TensorType::I32, ids(&[1, -1])))],
        ),
        (
            "empty-sequence",
            vec![("input_ids", tensor(&[1, 0], TensorType::I32, Vec::new()))],
        ),
        (
            "past-context",
            vec![(
                "input_ids",
                tensor(&[1, 600], TensorType::I32, ids(&[13; 600])),
            )],
        ),
        (
            "logits-from-past-end",
            vec![
                ("input_ids", tensor(&[1, 2], TensorType::I32, ids(&[1, 2]))),
                ("logits_from", tensor(&[1], TensorType::I32, ids(&[5]))),
            ],
        ),
        (
            "logits-from-wrong-shape",
            vec![
                ("input_ids", tensor(&[1, 2], TensorType::I32, ids(&[1, 2]))),
                ("logits_from", tensor(&[2], TensorType::I32, ids(&[0, 0]))),
            ],
        ),
    ];
    for (name, inputs) in cases {
        report(name, compute(&context, inputs), |o| describe(o));
        good(&context, name);
    }
    // Every position's logits come back as a second output.
    let inputs = vec![
        (
            "input_ids",
            tensor(&[1, 3], TensorType::I32, ids(&[1, 2, 3])),
        ),
        ("logits_from", tensor(&[1], TensorType::I32, ids(&[0]))),
    ];
    report("range-logits", compute(&context, inputs), |o| describe(o));
    // A tensor reads back what it was made of.
    let t = tensor(&[2, 2], TensorType::U8, vec![1, 2, 3, 4]);
    println!(
        "tensor-roundtrip ok {:?} {:?} {:?}",
        t.dimensions(),
        t.ty(),
        t.data()
    );
}

/// Calls that must trap the instance.
fn trap(case: &str) -> ExitCode {
    match case {
        // a handle this instance never had
        "bad-handle" => {
            // SAFETY: deliberately wrong; the host must trap this instance and nothing else.
            let t = unsafe { Tensor::from_handle(0x7fff_0000) };
            println!("{:?}", t.dimensions());
        }
        // a string whose bytes are outside linear memory
        "bad-pointer" => {
            #[cfg(target_arch = "wasm32")]
            {
                #[link(wasm_import_module = "wasi:nn/graph@0.2.0-rc-2024-10-28")]
                extern "C" {
                    #[link_name = "load-by-name"]
                    fn load_by_name(ptr: *const u8, len: usize, ret: *mut u8);
                }
                let mut ret = [0u8; 16];
                // SAFETY: deliberately out of bounds; the host must refuse it before reading.
                unsafe { load_by_name(0xffff_0000usize as *const u8, 4096, ret.as_mut_ptr()) };
                println!("returned {ret:?}");
            }
        }
        // tensors made and kept until the host says no
        "tensor-flood" => {
            let mut kept = Vec::new();
            for i in 0..1_000_000u32 {
                kept.push(tensor(&[1], TensorType::I32, i.to_le_bytes().to_vec()));
            }
            println!("kept {}", kept.len());
        }
        // 64 MiB tensors kept until the host says no
        "tensor-bytes" => {
            let data = vec![0u8; 64 << 20];
            let mut kept = Vec::new();
            for _ in 0..64 {
                kept.push(Tensor::new(&[data.len() as u32], TensorType::U8, &data));
                println!("holding {}", kept.len());
            }
        }
        other => {
            eprintln!("nn-probe: unknown case `{other}`");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let case = std::env::args().nth(1).unwrap_or_else(|| "matrix".into());
    if case == "matrix" {
        matrix();
        return ExitCode::SUCCESS;
    }
    trap(&case)
}

//! `gpt2.wasm` under a stock WASI-NN runtime: a `wasi_ephemeral_nn` written here that offers
//! only the plain contract (no output 2, no input 1, no output 3, no KV cache: every compute
//! runs the whole sequence and output 0 holds every position's logits), over our CPU model.
//! The guest must compute once per token, ask output 0 with a buffer of the right size (one
//! refused read, on the first step, to learn that it holds every position), give the same
//! text as under our host, and stop at the model's context however it can learn it:
//! `--context`, the model's `config.json`, or the backend refusing a sequence as too large.

use integration_tests::*;
use std::sync::OnceLock;
use wasi_nn_host::wasi_nn::Gpt2Backend;
use wasi_nn_host::Device;
use wasmtime::{Caller, Engine, Extern, Linker, Module, Store};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};
use wasmtime_wasi_nn::backend::Id;
use wasmtime_wasi_nn::wit::TensorType;
use wasmtime_wasi_nn::{Graph, Tensor};

const SUCCESS: i32 = 0;
const INVALID_ARGUMENT: i32 = 1;
const TOO_LARGE: i32 = 7;

/// What the guest asked of the stock backend.
#[derive(Debug, Default, Clone)]
struct Counts {
    computes: usize,
    /// computes refused as too large
    refused: usize,
    /// output 0 reads, and those refused for a small buffer
    reads: usize,
    small_buffer: usize,
    /// reads of any other output (refused: there are none)
    other_outputs: usize,
    loads_from_bytes: usize,
}

struct Stock {
    wasi: WasiP1Ctx,
    graph: Graph,
    /// the longest sequence this backend computes (`None`: no limit, as stock runtimes)
    limit: Option<usize>,
    tokens: Vec<u8>,
    /// every position's logits of the last compute
    logits: Vec<u8>,
    counts: Counts,
}

fn graph() -> Graph {
    static GRAPH: OnceLock<Graph> = OnceLock::new();
    GRAPH
        .get_or_init(|| {
            Gpt2Backend::new(Device::Cpu, 1 << 30)
                .load_path(&shakespeare_dir())
                .expect("load the model")
        })
        .clone()
}

fn engine_and_module() -> &'static (Engine, Module) {
    static EM: OnceLock<(Engine, Module)> = OnceLock::new();
    EM.get_or_init(|| {
        let engine = Engine::default();
        let module = Module::from_file(&engine, gpt2_wasm()).expect("compile gpt2.wasm");
        (engine, module)
    })
}

fn u32_at(memory: &[u8], at: u32) -> u32 {
    let at = at as usize;
    u32::from_le_bytes([memory[at], memory[at + 1], memory[at + 2], memory[at + 3]])
}

fn put_u32(memory: &mut [u8], at: u32, value: u32) {
    let at = at as usize;
    memory[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

fn memory<'a>(caller: &'a mut Caller<'_, Stock>) -> (&'a mut [u8], &'a mut Stock) {
    let Some(Extern::Memory(memory)) = caller.get_export("memory") else {
        panic!("the guest exports its memory");
    };
    memory.data_and_store_mut(caller)
}

/// The plain contract's six functions (the guest is trusted here: this tests the guest).
fn linker(engine: &Engine) -> Linker<Stock> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |s: &mut Stock| &mut s.wasi).expect("WASI");
    const M: &str = "wasi_ephemeral_nn";
    linker
        .func_wrap(
            M,
            "load",
            |mut caller: Caller<'_, Stock>, _: u32, _: u32, _: i32, _: i32, result: u32| {
                let (memory, stock) = memory(&mut caller);
                stock.counts.loads_from_bytes += 1;
                put_u32(memory, result, 0);
                SUCCESS
            },
        )
        .expect("load");
    linker
        .func_wrap(
            M,
            "load_by_name",
            |mut caller: Caller<'_, Stock>, _: u32, _: u32, result: u32| {
                let (memory, _) = memory(&mut caller);
                put_u32(memory, result, 0);
                SUCCESS
            },
        )
        .expect("load_by_name");
    linker
        .func_wrap(
            M,
            "init_execution_context",
            |mut caller: Caller<'_, Stock>, _: u32, result: u32| {
                let (memory, _) = memory(&mut caller);
                put_u32(memory, result, 0);
                SUCCESS
            },
        )
        .expect("init");
    linker
        .func_wrap(
            M,
            "set_input",
            |mut caller: Caller<'_, Stock>, _: u32, index: u32, tensor: u32| {
                if index != 0 {
                    return INVALID_ARGUMENT;
                }
                let (memory, stock) = memory(&mut caller);
                let data = u32_at(memory, tensor + 12) as usize;
                let len = u32_at(memory, tensor + 16) as usize;
                stock.tokens = memory[data..data + len].to_vec();
                SUCCESS
            },
        )
        .expect("set_input");
    linker
        .func_wrap(M, "compute", |mut caller: Caller<'_, Stock>, _: u32| {
            let stock = caller.data_mut();
            let t = stock.tokens.len() / 4;
            if stock.limit.is_some_and(|limit| t > limit) {
                stock.counts.refused += 1;
                return TOO_LARGE;
            }
            stock.counts.computes += 1;
            // no cache: a fresh context runs the whole sequence every time
            let mut context = stock.graph.init_execution_context().expect("context");
            let ids = Tensor::new(vec![1, t as u32], TensorType::I32, stock.tokens.clone());
            let from = Tensor::new(vec![1], TensorType::I32, 0i32.to_le_bytes().to_vec());
            context.set_input(Id::Index(0), &ids).expect("ids");
            context.set_input(Id::Index(1), &from).expect("logits_from");
            context.compute().expect("compute");
            stock.logits = context.get_output(Id::Index(1)).expect("all logits").data;
            SUCCESS
        })
        .expect("compute");
    linker
        .func_wrap(
            M,
            "get_output",
            |mut caller: Caller<'_, Stock>, _: u32, index: u32, out: u32, max: u32, result: u32| {
                let (memory, stock) = memory(&mut caller);
                if index != 0 {
                    stock.counts.other_outputs += 1;
                    return INVALID_ARGUMENT;
                }
                stock.counts.reads += 1;
                let n = stock.logits.len();
                if n > max as usize {
                    stock.counts.small_buffer += 1;
                    return TOO_LARGE;
                }
                memory[out as usize..out as usize + n].copy_from_slice(&stock.logits);
                put_u32(memory, result, n as u32);
                SUCCESS
            },
        )
        .expect("get_output");
    linker
}

struct Outcome {
    exit_code: i32,
    stdout: String,
    stderr: String,
    counts: Counts,
}

fn run(args: &[&str], limit: Option<usize>, dir: Option<&std::path::Path>) -> Outcome {
    let (engine, module) = engine_and_module();
    let out = MemoryOutputPipe::new(1 << 20);
    let err = MemoryOutputPipe::new(1 << 20);
    let mut wasi = WasiCtxBuilder::new();
    let mut argv = vec!["gpt2.wasm".to_owned()];
    argv.extend(args.iter().map(|s| s.to_string()));
    wasi.args(&argv).stdout(out.clone()).stderr(err.clone());
    if let Some(dir) = dir {
        wasi.preopened_dir(dir, "model", FsPerms::ReadOnly)
            .expect("grant the model folder");
    }
    let state = Stock {
        wasi: wasi.build_p1(),
        graph: graph(),
        limit,
        tokens: Vec::new(),
        logits: Vec::new(),
        counts: Counts::default(),
    };
    let mut store = Store::new(engine, state);
    let instance = linker(engine)
        .instantiate(&mut store, module)
        .expect("instantiate");
    let start = instance
        .get_typed_func::<(), ()>(&mut store, "_start")
        .expect("_start");
    let exit_code = match start.call(&mut store, ()) {
        Ok(()) => 0,
        Err(e) => match e.downcast_ref::<I32Exit>() {
            Some(exit) => exit.0,
            None => panic!("the guest trapped: {e:?}"),
        },
    };
    Outcome {
        exit_code,
        stdout: String::from_utf8_lossy(&out.contents()).into_owned(),
        stderr: String::from_utf8_lossy(&err.contents()).into_owned(),
        counts: store.data().counts.clone(),
    }
}

fn json(outcome: &Outcome) -> serde_json::Value {
    assert_eq!(outcome.exit_code, 0, "stderr: {}", outcome.stderr);
    let line = outcome.stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

const PROMPT: &str = "To be, or not to be: that is the question.";

#[test]
fn on_a_stock_backend_each_token_costs_one_compute_and_one_read_and_the_text_is_ours() {
    let tokens = 12;
    let outcome = run(
        &["--json", "--max-tokens", &tokens.to_string(), PROMPT],
        None,
        None,
    );
    let out = json(&outcome);
    let c = &outcome.counts;
    assert_eq!(c.computes, tokens, "one compute per token: {c:?}");
    // outputs 3 (the context) and 2 (the greedy token) probed once each, output 0 refused
    // once (one row asked), then sized right
    assert_eq!(c.other_outputs, 2, "{c:?}");
    assert_eq!(c.small_buffer, 1, "{c:?}");
    assert_eq!(c.reads, tokens + 1, "{c:?}");
    // the same ids as HF transformers' greedy continuation under our own host
    let fixture = read_json("shakespeare.json");
    let prompts = fixture["prompts"].as_array().expect("prompts");
    let i = prompts
        .iter()
        .position(|p| p == PROMPT)
        .unwrap_or_else(|| panic!("{PROMPT:?} is a fixture prompt"));
    let greedy = id_lists(&fixture["greedy_64"]);
    assert_eq!(ids(&out["ids"]), greedy[i][..tokens].to_vec());
}

#[test]
fn on_a_stock_backend_the_guest_stops_at_the_context_however_it_learns_it() {
    // the backend's refusal: it keeps what it made and ends with length
    let prompt_len = {
        let out = json(&run(&["--json", "--max-tokens", "1", PROMPT], None, None));
        out["prompt_ids"].as_array().expect("prompt ids").len()
    };
    let outcome = run(
        &["--json", "--max-tokens", "50", PROMPT],
        Some(prompt_len + 4),
        None,
    );
    let out = json(&outcome);
    assert_eq!(out["finish_reason"], "length", "{out}");
    assert_eq!(out["ids"].as_array().map(Vec::len), Some(5), "{out}");
    assert_eq!(outcome.counts.refused, 1);
    // --context: no refusal needed
    let context = (prompt_len + 3).to_string();
    let outcome = run(
        &[
            "--json",
            "--max-tokens",
            "50",
            "--context",
            &context,
            PROMPT,
        ],
        None,
        None,
    );
    let out = json(&outcome);
    assert_eq!(out["finish_reason"], "length");
    assert_eq!(out["ids"].as_array().map(Vec::len), Some(3), "{out}");
    assert_eq!(outcome.counts.computes, 3);
    // the model's config.json, when the guest loads the model's bytes itself
    let dir = std::env::temp_dir().join(format!("stock-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = serde_json::json!({ "n_positions": prompt_len + 2, "n_embd": 192 });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    std::fs::write(
        dir.join("model.safetensors"),
        b"(this backend ignores the bytes)",
    )
    .expect("weights");
    let outcome = run(
        &["--json", "--max-tokens", "50", "--model", "model", PROMPT],
        None,
        Some(&dir),
    );
    std::fs::remove_dir_all(&dir).ok();
    let out = json(&outcome);
    assert_eq!(outcome.counts.loads_from_bytes, 1);
    assert_eq!(out["finish_reason"], "length");
    assert_eq!(out["ids"].as_array().map(Vec::len), Some(2), "{out}");
}

//! The full path: `gpt2.wasm` under our wasmtime host, forward passes through wasi-nn on the
//! CPU backend; compared with HF transformers' numbers.

use integration_tests::*;
use std::sync::OnceLock;
use wasi_nn_host::runtime::{GuestModule, Host, HostBuilder, RunOptions, RunOutcome};
use wasi_nn_host::Device;

fn host() -> &'static (Host, GuestModule) {
    static HOST: OnceLock<(Host, GuestModule)> = OnceLock::new();
    HOST.get_or_init(|| {
        let host = HostBuilder::new(Device::Cpu)
            .graph("gpt2", &shakespeare_dir())
            .expect("load the default model")
            .graph("tiny", &fixture("tiny"))
            .expect("load tiny")
            .build()
            .expect("host");
        let module = host.load_module(&gpt2_wasm()).expect("compile gpt2.wasm");
        (host, module)
    })
}

fn run_with(args: &[&str], dirs: Vec<(std::path::PathBuf, String)>) -> RunOutcome {
    let (host, module) = host();
    let options = RunOptions {
        args: args.iter().map(|s| s.to_string()).collect(),
        dirs,
        capture: Some(1 << 30),
        ..Default::default()
    };
    host.run(module, "gpt2.wasm", &options).expect("guest ran")
}

fn run(args: &[&str]) -> RunOutcome {
    run_with(args, Vec::new())
}

/// Run and parse the last stdout line as JSON; the run must succeed.
fn run_json(args: &[&str]) -> serde_json::Value {
    let out = run(args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.exit_code,
        0,
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

#[test]
fn greedy_text_through_the_guest_equals_hf() {
    let fixture = read_json("shakespeare.json");
    let prompts = fixture["prompts"].as_array().expect("prompts").clone();
    let greedy = id_lists(&fixture["greedy_64"]);
    for (i, prompt) in prompts.iter().enumerate().take(2) {
        let prompt = prompt.as_str().expect("prompt");
        let out = run_json(&["--json", "--max-tokens", "64", prompt]);
        assert_eq!(
            ids(&out["prompt_ids"]),
            ids(&fixture["prompt_ids"][i]),
            "tokenizer, prompt {i}"
        );
        assert_eq!(ids(&out["ids"]), greedy[i], "greedy ids, prompt {i}");
        assert_eq!(out["timings"]["generated_tokens"], 64);
    }
    // The streamed text is the decoded ids.
    let streamed = run(&["--max-tokens", "64", "ROMEO:"]);
    let text = String::from_utf8(streamed.stdout).expect("utf-8");
    let want = fixture["greedy_64_text"][0].as_str().expect("text");
    assert_eq!(text.trim_end_matches('\n'), want.trim_end_matches('\n'));
}

#[test]
fn logits_through_the_guest_equal_hf_and_tokenizer_matches() {
    let fixture = read_json("shakespeare.json");
    let reference = read_f32_rows("shakespeare_logits.bin", 50257);
    for (i, prompt) in fixture["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .enumerate()
    {
        let out = run_json(&["--logits", prompt.as_str().expect("prompt")]);
        assert_eq!(
            ids(&out["prompt_ids"]),
            ids(&fixture["prompt_ids"][i]),
            "tokenizer, prompt {i}"
        );
        let logits: Vec<f32> = out["logits"]
            .as_array()
            .expect("logits")
            .iter()
            .map(|v| v.as_f64().expect("number") as f32)
            .collect();
        assert_close(
            &logits,
            &reference[i],
            1e-4,
            &format!("guest logits, prompt {i}"),
        );
    }
}

#[test]
fn perplexity_through_the_guest_equals_pytorch() {
    let text = std::fs::read(repo_root().join("tests/data/tinyshakespeare.txt")).expect("data");
    let dir = std::env::temp_dir().join(format!("gpt2-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    std::fs::write(dir.join("val.txt"), &text[1_011_177..]).expect("write split");
    let out = run_with(
        &[
            "--perplexity",
            "data/val.txt",
            "--window",
            "512",
            "--max-scored",
            "8192",
        ],
        vec![(dir, "data".into())],
    );
    assert_eq!(out.exit_code, 0, "{}", String::from_utf8_lossy(&out.stderr));
    let ours: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let want = &read_json("shakespeare.json")["perplexity"];
    assert_eq!(ours["tokens_total"], 33803, "validation split tokens");
    assert_eq!(ours["tokens_scored"], 8192);
    let (a, b) = (
        ours["perplexity"].as_f64().expect("ppl"),
        want["perplexity"].as_f64().expect("ppl"),
    );
    eprintln!("perplexity: ours {a}, PyTorch {b}");
    assert!((a - b).abs() / b < 1e-4, "perplexity {a} vs PyTorch {b}");
}

#[test]
fn the_guest_sees_no_files_unless_granted() {
    let out = run(&["--perplexity", "/etc/hostname", "--window", "8"]);
    assert_eq!(out.exit_code, 1);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dir"));
}

#[test]
fn sampling_is_seeded_and_stops_where_asked() {
    let sample = |seed: &str| {
        run_json(&[
            "--json",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--top-k",
            "200",
            "--seed",
            seed,
            "--max-tokens",
            "40",
            "JULIET:",
        ])
    };
    let a = sample("7");
    assert_eq!(
        ids(&a["ids"]),
        ids(&sample("7")["ids"]),
        "same seed, same text"
    );
    assert_ne!(
        ids(&a["ids"]),
        ids(&sample("8")["ids"]),
        "another seed, another text"
    );
    assert_eq!(ids(&a["ids"]).len(), 40);

    // Greedy after "ROMEO:" is "\nNurse:\nNurse:..."; stop at the first "Nurse".
    let stopped = run_json(&["--json", "--stop", "Nurse", "--max-tokens", "30", "ROMEO:"]);
    assert_eq!(stopped["text"], "\n");
    assert_eq!(stopped["finish_reason"], "stop");
    let streamed = run(&["--stop", "Nurse", "--max-tokens", "30", "ROMEO:"]);
    assert_eq!(
        String::from_utf8_lossy(&streamed.stdout),
        "\n\n",
        "stop text is never printed"
    );

    // An empty prompt starts from <|endoftext|>.
    let empty = run_json(&["--json", "--max-tokens", "3", ""]);
    assert_eq!(ids(&empty["prompt_ids"]), vec![50256]);
}

#[test]
fn unknown_graph_and_bad_options_fail_cleanly_and_the_host_keeps_serving() {
    let out = run(&["--graph", "nope", "hello"]);
    assert_eq!(out.exit_code, 1);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot load graph `nope`"));
    for bad in [
        &["--top-p", "0", "x"][..],
        &["--temperature", "-1", "x"],
        &["--bogus"],
        &[],
    ] {
        let out = run(bad);
        assert_eq!(out.exit_code, 1, "{bad:?}");
    }
    // A prompt longer than the tiny model's context: a clear error, not a crash.
    let long = "a ".repeat(200);
    let out = run(&["--graph", "tiny", "--max-tokens", "1", &long]);
    assert_eq!(out.exit_code, 1);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the prompt has 201 tokens; this model's context is 128"),
        "{stderr}"
    );
    let ok = run_json(&["--json", "--max-tokens", "2", "ROMEO:"]);
    assert_eq!(ids(&ok["ids"]).len(), 2);
}

#[test]
fn raw_witx_calls_with_bad_arguments_get_error_codes() {
    let (host, _) = host();
    let module = host
        .load_module(&repo_root().join("tests/guests/witx_bad_input.wat"))
        .expect("compile wat");
    let out = host
        .run(
            &module,
            "bad.wasm",
            &RunOptions {
                capture: Some(1 << 16),
                ..Default::default()
            },
        )
        .expect("run");
    let codes = String::from_utf8(out.stdout).expect("ascii");
    // unknown name (not-found), load ok, init ok, compute without input, F32 input,
    // id >= vocab, id < 0 (invalid-argument each), valid input, compute, too-small buffer
    // (too-large), get_output, size check, no output 4, garbage model bytes
    // (invalid-argument each), compute again.
    assert_eq!(codes.trim_end(), "800111100700110");
}

#[test]
fn pointers_outside_guest_memory_get_invalid_argument_and_never_a_panic() {
    let (host, module) = host();
    let bad = host
        .load_module(&repo_root().join("tests/guests/witx_bad_pointer.wat"))
        .expect("compile wat");
    let out = host
        .run(
            &bad,
            "bad.wasm",
            &RunOptions {
                capture: Some(1 << 16),
                ..Default::default()
            },
        )
        .expect("the instance runs to its end");
    assert_eq!(out.exit_code, 0);
    // name, result, ok, result, ok, record, dimensions, data, output buffer, builders,
    // a 4 GiB builder, 2^29 builders (invalid-argument each), then the well-formed calls
    let codes = String::from_utf8(out.stdout).expect("ascii");
    assert_eq!(codes.trim_end(), "110101111111000");
    let ok = host
        .run(
            module,
            "gpt2.wasm",
            &RunOptions {
                args: vec!["--max-tokens".into(), "3".into(), "x".into()],
                capture: Some(1 << 20),
                ..Default::default()
            },
        )
        .expect("run after");
    assert_eq!(ok.exit_code, 0);
}

#[test]
fn instance_limits_stop_runaway_guests() {
    use wasi_nn_host::runtime::HostError;
    let (host, module) = host();
    let slow = RunOptions {
        args: vec!["--max-tokens".into(), "400".into(), "x".into()],
        capture: Some(1 << 20),
        timeout: Some(std::time::Duration::from_millis(50)),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let result = host.run(module, "gpt2.wasm", &slow);
    assert!(matches!(result, Err(HostError::Timeout(_))), "{result:?}");
    assert!(started.elapsed() < std::time::Duration::from_millis(500));
    // The embedded tokenizer alone needs more than 4 MiB of linear memory.
    let small = RunOptions {
        args: vec!["x".into()],
        capture: Some(1 << 20),
        max_memory_bytes: Some(4 << 20),
        ..Default::default()
    };
    match host.run(module, "gpt2.wasm", &small) {
        Ok(out) => assert_ne!(out.exit_code, 0),
        Err(e) => assert!(matches!(e, HostError::Trap(_)), "{e}"),
    }
    // and the host still serves
    let ok = run_json(&["--json", "--max-tokens", "2", "ROMEO:"]);
    assert_eq!(ids(&ok["ids"]).len(), 2);
}

#[test]
fn a_generation_that_reaches_the_context_ends_with_length_and_keeps_its_text() {
    // " a" is one token: a 500-token prompt on a 512-token model
    let prompt = " a".repeat(500);
    let out = run_json(&["--json", "--max-tokens", "100", &prompt]);
    assert_eq!(out["finish_reason"], "length");
    assert_eq!(ids(&out["prompt_ids"]).len(), 500);
    assert_eq!(
        ids(&out["ids"]).len(),
        12,
        "up to the context learned from output 3"
    );
    assert!(!out["text"].as_str().unwrap_or_default().is_empty());
    // a context given on the command line wins
    let out = run_json(&["--json", "--context", "505", "--max-tokens", "100", &prompt]);
    assert_eq!(ids(&out["ids"]).len(), 5);
    // a prompt beyond the context: the message says it in user terms
    let out = run(&["--json", &" a".repeat(600)]);
    assert_ne!(out.exit_code, 0);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the prompt has 600 tokens; this model's context is 512"),
        "{stderr}"
    );
}

#[test]
fn an_instance_cannot_use_handles_it_did_not_make() {
    let (host, module) = host();
    let foreign = host
        .load_module(&repo_root().join("tests/guests/witx_foreign_handles.wat"))
        .expect("compile wat");
    // another instance runs at the same time and holds contexts 0 and 1 of its own
    std::thread::scope(|scope| {
        let other = scope.spawn(|| {
            let options = RunOptions {
                args: vec!["--max-tokens".into(), "40".into(), "ROMEO:".into()],
                capture: Some(1 << 20),
                ..Default::default()
            };
            host.run(module, "gpt2.wasm", &options).expect("run")
        });
        let out = host
            .run(
                &foreign,
                "foreign.wasm",
                &RunOptions {
                    capture: Some(1 << 16),
                    ..Default::default()
                },
            )
            .expect("run");
        // init with graph handles 0..3, then set_input, compute, get_output with context
        // handles 0..3: none of them is this instance's
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim_end(),
            "1111".repeat(3)
        );
        assert_eq!(other.join().expect("other").exit_code, 0);
    });
}

#[test]
fn fuel_bounds_a_guest_work_whatever_the_time() {
    use wasi_nn_host::runtime::HostError;
    // a metered host: a guest that loops forever stops when its fuel is used up (no time
    // limit set), and gpt2.wasm with enough fuel gives the same text as without the meter
    let metered = HostBuilder::new(Device::Cpu)
        .graph("gpt2", &shakespeare_dir())
        .expect("load the default model")
        .fuel_metering(true)
        .build()
        .expect("metered host");
    let spin = metered
        .load_module(&repo_root().join("tests/guests/spin.wat"))
        .expect("compile spin.wat");
    let started = std::time::Instant::now();
    let result = metered.run(
        &spin,
        "spin.wasm",
        &RunOptions {
            fuel: Some(50_000_000),
            ..Default::default()
        },
    );
    assert!(
        matches!(result, Err(HostError::OutOfFuel(50_000_000))),
        "{result:?}"
    );
    assert!(
        result
            .err()
            .is_some_and(|e| e.to_string().contains("used up its fuel")),
        "the error says what happened"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    let gpt2 = metered
        .load_module(&gpt2_wasm())
        .expect("compile gpt2.wasm");
    let args = ["--max-tokens", "8", "ROMEO:"];
    let fueled = metered
        .run(
            &gpt2,
            "gpt2.wasm",
            &RunOptions {
                args: args.iter().map(|s| s.to_string()).collect(),
                capture: Some(1 << 20),
                fuel: Some(u64::MAX / 2),
                ..Default::default()
            },
        )
        .expect("a run with enough fuel");
    assert_eq!(fueled.exit_code, 0);
    assert_eq!(fueled.stdout, run_with(&args, vec![]).stdout);
    // too little fuel for the same run: stopped, and the next run is fine
    let starved = RunOptions {
        args: args.iter().map(|s| s.to_string()).collect(),
        capture: Some(1 << 20),
        fuel: Some(1_000),
        ..Default::default()
    };
    let result = metered.run(&gpt2, "gpt2.wasm", &starved);
    assert!(
        matches!(result, Err(HostError::OutOfFuel(1_000))),
        "{result:?}"
    );
    // an unmetered host cannot bound fuel: it says so instead of ignoring it
    let (host, module) = host();
    let result = host.run(module, "gpt2.wasm", &starved);
    assert!(
        matches!(result, Err(HostError::FuelNotMetered)),
        "{result:?}"
    );
}

/// A request that samples with temperature and top-p alone is drawn by the host (output 4):
/// each token the guest made is the rule's draw from the CPU reference's logits for its
/// position; with top-k as well, the guest samples the logits itself (other tokens).
#[test]
fn temperature_and_top_p_alone_are_drawn_by_the_host() {
    use wasi_nn_host::engine::draw::{draw, DrawRule};
    let args = |top_k: &'static str| {
        [
            "--json",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--top-k",
            top_k,
            "--seed",
            "3",
            "--max-tokens",
            "24",
            "JULIET:",
        ]
    };
    let out = run_json(&args("0"));
    let (prompt, made) = (ids(&out["prompt_ids"]), ids(&out["ids"]));
    assert_eq!(made.len(), 24);
    let weights = std::sync::Arc::new(
        wasi_nn_host::model::load_path(&shakespeare_dir()).expect("the embedded model"),
    );
    let model = wasi_nn_host::cpu::CpuModel::new(weights);
    let mut cache = Default::default();
    let mut logits = model.forward(&mut cache, &prompt, false);
    let rule = DrawRule::new(0.9, 0.9, 3).expect("rule");
    for (i, &id) in made.iter().enumerate() {
        assert_eq!(id, draw(&logits, &rule, prompt.len() + i), "token {i}");
        logits = model.forward(&mut cache, &[id], false);
    }
    let guest_sampled = run_json(&args("200"));
    assert_ne!(ids(&guest_sampled["ids"]), made);
}

/// A request with min-p, penalties and a logit bias is drawn by the host too (inputs 4-7):
/// each token is the rule's draw from the CPU reference's logits for its position, processed
/// by the host's specification; with top-k as well, the guest samples itself (other tokens).
#[test]
fn penalties_bias_and_min_p_are_applied_and_drawn_by_the_host() {
    use wasi_nn_host::engine::draw::{draw, DrawRule};
    use wasi_nn_host::engine::processing::Processing;
    let args = |top_k: &'static str| {
        [
            "--json",
            "--temperature",
            "0.9",
            "--top-p",
            "0.95",
            "--top-k",
            top_k,
            "--min-p",
            "0.01",
            "--presence-penalty",
            "0.6",
            "--frequency-penalty",
            "0.4",
            "--repetition-penalty",
            "1.2",
            "--logit-bias",
            "11:2.5",
            "--logit-bias",
            "198:-100",
            "--seed",
            "5",
            "--max-tokens",
            "24",
            "JULIET:",
        ]
    };
    let out = run_json(&args("0"));
    let (prompt, made) = (ids(&out["prompt_ids"]), ids(&out["ids"]));
    assert_eq!(made.len(), 24);
    assert!(!made.contains(&198), "the banned token was drawn: {made:?}");
    let weights = std::sync::Arc::new(
        wasi_nn_host::model::load_path(&shakespeare_dir()).expect("the embedded model"),
    );
    let vocab = weights.config.vocab_size;
    let model = wasi_nn_host::cpu::CpuModel::new(weights);
    let processing = Processing::new(
        (0.6, 0.4, 1.2),
        &[11, 198],
        &[2.5, -100.0],
        prompt.len(),
        vocab,
    )
    .expect("processing");
    let rule = DrawRule::new(0.9, 0.95, 5)
        .and_then(|r| r.with_min_p(0.01))
        .expect("rule");
    let mut cache = Default::default();
    let mut logits = model.forward(&mut cache, &prompt, false);
    let mut sequence = prompt.clone();
    let mut processed = Vec::new();
    for (i, &id) in made.iter().enumerate() {
        processing
            .apply(&logits, &sequence, &mut processed)
            .expect("processed");
        assert_eq!(id, draw(&processed, &rule, sequence.len()), "token {i}");
        sequence.push(id);
        logits = model.forward(&mut cache, &[id], false);
    }
    let guest_sampled = run_json(&args("200"));
    assert_ne!(ids(&guest_sampled["ids"]), made);
}

/// Nothing a guest wrote, in its memory or its table, reaches the next guest in its pool slot,
/// whether the slot's memory and tables go back to the kernel or stay resident and are reset
/// in place (the default where Linux
/// has PAGEMAP_SCAN, and with `memset` where it has not): one guest at a time, so that each
/// takes the slot the last one left, and then eight at once.
#[test]
fn a_guest_never_sees_what_the_guest_before_it_in_its_slot_wrote() {
    use wasi_nn_host::InstancePool;
    for keep_resident_bytes in [0, 64 << 20, InstancePool::default_keep_resident()] {
        let host = HostBuilder::new(Device::Cpu)
            .instance_pool(Some(InstancePool {
                max_instances: 8,
                keep_resident_bytes,
                ..Default::default()
            }))
            .build()
            .expect("host");
        let guest = host
            .load_module(&repo_root().join("tests/guests/memory_reset.wat"))
            .expect("compile memory_reset.wat");
        let run = || {
            host.run(&guest, "memory_reset.wasm", &RunOptions::default())
                .map(|out| out.exit_code)
        };
        for i in 0..12 {
            assert_eq!(
                run().ok(),
                Some(0),
                "run {i}, keep resident {keep_resident_bytes}"
            );
        }
        std::thread::scope(|scope| {
            let runs: Vec<_> = (0..8).map(|_| scope.spawn(run)).collect();
            for r in runs {
                assert_eq!(r.join().ok().and_then(|r| r.ok()), Some(0));
            }
        });
    }
}

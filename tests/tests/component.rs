//! The guest as a component (wasm32-wasip2, `wasi:nn` WIT) under the same host and backend:
//! the same text as the wasip1 command, streamed piece by piece, and the same perplexity.

use integration_tests::*;
use wasi_nn_host::runtime::{ComponentSnapshot, Sampling};
use wasi_nn_host::{Device, HostBuilder, RunOptions};

fn sampling(max_tokens: u32, temperature: f32, stop: Vec<String>) -> Sampling {
    Sampling {
        max_tokens,
        temperature,
        top_k: 0,
        top_p: 0.9,
        seed: 3,
        stop,
        ..Default::default()
    }
}

#[test]
fn the_component_generates_what_the_command_generates() {
    let host = HostBuilder::new(Device::Cpu)
        .graph("gpt2", &shakespeare_dir())
        .expect("model")
        .build()
        .expect("host");
    let component = host
        .load_component(&gpt2_component())
        .expect("compile component");
    let module = host.load_module(&gpt2_wasm()).expect("compile module");
    let limits = RunOptions {
        timeout: Some(std::time::Duration::from_secs(60)),
        max_memory_bytes: Some(1 << 30),
        ..Default::default()
    };
    let command = |args: &[&str]| -> serde_json::Value {
        let mut all = vec!["--json".to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        let options = RunOptions {
            args: all,
            capture: Some(1 << 20),
            ..Default::default()
        };
        let out = host.run(&module, "gpt2.wasm", &options).expect("run");
        serde_json::from_slice(&out.stdout).expect("json")
    };

    // greedy: identical ids and text to the command and to HF's greedy continuation
    let fixture = read_json("shakespeare.json");
    let mut pieces = Vec::new();
    let completion = host
        .generate_with_component(
            &component,
            "gpt2",
            "ROMEO:",
            &sampling(64, 0.0, vec![]),
            &limits,
            |p| pieces.push(p.text.clone()),
        )
        .expect("run")
        .expect("generate");
    assert_eq!(completion.ids, id_lists(&fixture["greedy_64"])[0]);
    assert_eq!(completion.prompt_ids, ids(&fixture["prompt_ids"][0]));
    assert_eq!(pieces.concat(), completion.text);
    assert!(pieces.len() > 30, "streamed in pieces");
    assert_eq!(completion.finish_reason, "length");

    // sampled with a seed and a stop string: the same as the command with the same settings
    let want = command(&[
        "--max-tokens",
        "40",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--stop",
        "\n\n",
        "JULIET:",
    ]);
    let got = host
        .generate_with_component(
            &component,
            "gpt2",
            "JULIET:",
            &sampling(40, 0.9, vec!["\n\n".into()]),
            &limits,
            |_| {},
        )
        .expect("run")
        .expect("generate");
    assert_eq!(serde_json::json!(got.ids), want["ids"]);
    assert_eq!(serde_json::json!(got.text), want["text"]);
    assert_eq!(serde_json::json!(got.finish_reason), want["finish_reason"]);

    // sampled with a bias, penalties and min-p (drawn by the host from the processed
    // logits): the same as the command with the same settings
    let want = command(&[
        "--max-tokens",
        "40",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--min-p",
        "0.02",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "0.3",
        "--repetition-penalty",
        "1.3",
        "--logit-bias",
        "11:3",
        "--logit-bias",
        "198:-100",
        "--seed",
        "3",
        "JULIET:",
    ]);
    let processed = Sampling {
        logit_bias: vec![(11, 3.0), (198, -100.0)],
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        repetition_penalty: 1.3,
        min_p: 0.02,
        ..sampling(40, 0.9, vec![])
    };
    let got = host
        .generate_with_component(&component, "gpt2", "JULIET:", &processed, &limits, |_| {})
        .expect("run")
        .expect("generate");
    assert_eq!(serde_json::json!(got.ids), want["ids"]);
    assert!(!got.ids.contains(&198), "a banned token: {:?}", got.ids);

    // scoring through the range output, equal to the command's
    let text =
        std::fs::read_to_string(repo_root().join("tests/data/tinyshakespeare.txt")).expect("data");
    let text = &text[1_011_177..1_011_177 + 4000];
    let score = host
        .perplexity_with_component(&component, "gpt2", text, 128, Some(300), &limits)
        .expect("run")
        .expect("score");
    let dir = std::env::temp_dir().join(format!("gpt2-component-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    std::fs::write(dir.join("t.txt"), text).expect("write");
    let options = RunOptions {
        args: [
            "--perplexity",
            "d/t.txt",
            "--window",
            "128",
            "--max-scored",
            "300",
        ]
        .map(String::from)
        .to_vec(),
        dirs: vec![(dir, "d".into())],
        capture: Some(1 << 20),
        ..Default::default()
    };
    let out = host.run(&module, "gpt2.wasm", &options).expect("run");
    let want: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(score.tokens_scored, 300);
    let (a, b) = (score.perplexity, want["perplexity"].as_f64().expect("ppl"));
    assert!((a - b).abs() / b < 1e-9, "component {a} vs command {b}");

    // an unknown graph is an error value, not a trap
    let err = host
        .generate_with_component(
            &component,
            "nope",
            "x",
            &sampling(3, 0.0, vec![]),
            &limits,
            |_| {},
        )
        .expect("run");
    assert!(err.expect_err("unknown graph").contains("nope"));
}

/// The component pre-initialised by `wasi-nn-host preinit` (its tokenizer built into the
/// snapshot), and the plain one pre-initialised at load as `serve` loads it, complete exactly
/// like the plain one, greedy and sampled with a seed, and still report errors as values.
#[test]
fn the_preinitialised_component_gives_the_plain_components_completions() {
    let host = HostBuilder::new(Device::Cpu)
        .graph("gpt2", &shakespeare_dir())
        .expect("model")
        .build()
        .expect("host");
    let plain = host
        .load_component(&gpt2_component())
        .expect("compile component");
    let preinit_path = gpt2_component_preinit();
    let snapshot = std::fs::read(&preinit_path).expect("read the snapshot");
    assert!(wasi_nn_host::runtime::is_component(&snapshot));
    assert!(wasi_nn_host::runtime::is_preinitialised(&snapshot));
    assert!(!wasi_nn_host::runtime::is_preinitialised(
        &std::fs::read(gpt2_component()).expect("read the component")
    ));
    let preinit = host
        .load_component(&preinit_path)
        .expect("compile the pre-initialised component");
    // what `serve` loads: a snapshot as it is, a plain component pre-initialised at load
    let (_, given) = host
        .load_component_preinitialised(&preinit_path)
        .expect("load the snapshot");
    assert_eq!(given, ComponentSnapshot::Given);
    let (at_load, made) = host
        .load_component_preinitialised(&gpt2_component())
        .expect("load the plain component");
    assert!(
        matches!(made, ComponentSnapshot::MadeAtLoad { .. }),
        "{made:?}"
    );
    let limits = RunOptions {
        timeout: Some(std::time::Duration::from_secs(60)),
        max_memory_bytes: Some(1 << 30),
        ..Default::default()
    };
    for (prompt, params) in [
        ("ROMEO:", sampling(32, 0.0, vec![])),
        ("JULIET:", sampling(32, 0.9, vec!["\n\n".into()])),
        ("First Citizen:", sampling(24, 1.2, vec![])),
    ] {
        let run = |component| {
            let mut pieces = Vec::new();
            let completion = host
                .generate_with_component(component, "gpt2", prompt, &params, &limits, |p| {
                    pieces.push(p.text.clone())
                })
                .expect("run")
                .expect("generate");
            (completion, pieces)
        };
        let (want, want_pieces) = run(&plain);
        for snapshot in [&preinit, &at_load] {
            let (got, got_pieces) = run(snapshot);
            assert_eq!(got.prompt_ids, want.prompt_ids, "{prompt}");
            assert_eq!(got.ids, want.ids, "{prompt}");
            assert_eq!(got.text, want.text, "{prompt}");
            assert_eq!(got.finish_reason, want.finish_reason, "{prompt}");
            assert_eq!(got_pieces, want_pieces, "{prompt}");
        }
    }
    let err = host
        .generate_with_component(
            &preinit,
            "nope",
            "x",
            &sampling(3, 0.0, vec![]),
            &limits,
            |_| {},
        )
        .expect("run");
    assert!(err.expect_err("unknown graph").contains("nope"));
}

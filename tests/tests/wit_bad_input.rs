//! The `wasi:nn` WIT ABI (components) against a hostile guest (`tests/nn-probe`): every bad
//! call gets the error code that fits and a message, the next well-formed call works, calls
//! the component model cannot express as errors (a handle the instance never had, a pointer
//! outside its memory, resources or tensor bytes past the instance's limits) trap that
//! instance alone, and nothing panics; the host serves the next instance as before.

use integration_tests::*;
use std::collections::HashMap;
use std::sync::OnceLock;
use wasi_nn_host::runtime::{GuestModule, Host, HostBuilder, HostError, RunOptions};

fn host() -> &'static (Host, GuestModule) {
    static HOST: OnceLock<(Host, GuestModule)> = OnceLock::new();
    HOST.get_or_init(|| {
        // no device override, so the guest's execution target counts (tpu is refused);
        // preloaded graphs run on the CPU
        let host = HostBuilder::auto()
            .max_load_bytes(1 << 20)
            .graph("gpt2", &shakespeare_dir())
            .expect("load the default model")
            .build()
            .expect("host");
        let probe = host.load_module(&nn_probe()).expect("compile nn-probe");
        (host, probe)
    })
}

fn run(case: &str) -> Result<String, HostError> {
    let (host, probe) = host();
    let options = RunOptions {
        args: vec![case.to_owned()],
        capture: Some(1 << 20),
        ..Default::default()
    };
    host.run(probe, "nn-probe", &options).map(|out| {
        assert_eq!(
            out.exit_code,
            0,
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
}

/// `name -> (ok | error <Code>, rest)` of the matrix run.
fn matrix() -> HashMap<String, (String, String)> {
    let out = run("matrix").expect("the matrix runs to its end");
    out.lines()
        .map(|line| {
            let mut parts = line.splitn(3, ' ');
            let name = parts.next().unwrap_or_default().to_owned();
            let outcome = parts.next().unwrap_or_default();
            let rest = parts.next().unwrap_or_default();
            if outcome == "error" {
                let (code, message) = rest.split_once(' ').unwrap_or((rest, ""));
                (name, (format!("error {code}"), message.to_owned()))
            } else {
                (name, (outcome.to_owned(), rest.to_owned()))
            }
        })
        .collect()
}

#[test]
fn every_bad_wit_call_gets_the_code_that_fits_and_the_next_call_works() {
    let results = matrix();
    let expect = [
        ("load-by-name-unknown", "NotFound", "no graph named"),
        ("load-garbage", "InvalidArgument", ""),
        ("load-nothing", "InvalidArgument", ""),
        ("load-onnx", "InvalidEncoding", "autodetect"),
        ("load-tpu", "UnsupportedOperation", "tpu"),
        ("load-too-large", "TooLarge", ""),
        ("no-inputs", "InvalidArgument", "input 0"),
        ("dims-not-bytes", "InvalidArgument", "do not fit"),
        ("dims-overflow", "InvalidArgument", "do not fit"),
        ("rank-3", "InvalidArgument", "do not fit"),
        ("wrong-type", "InvalidArgument", "I32"),
        ("id-past-vocab", "InvalidArgument", "outside the vocabulary"),
        ("id-negative", "InvalidArgument", "outside the vocabulary"),
        ("empty-sequence", "InvalidArgument", "empty"),
        ("past-context", "TooLarge", "context of 512"),
        ("logits-from-past-end", "InvalidArgument", "logits_from"),
        ("logits-from-wrong-shape", "InvalidArgument", "input 1"),
    ];
    for (name, code, words) in expect {
        let (outcome, message) = results
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing from {results:?}"));
        assert_eq!(
            outcome,
            &format!("error ErrorCode::{code}"),
            "{name}: {message}"
        );
        assert!(
            message.contains(words),
            "{name}: the message `{message}` should say `{words}`"
        );
        if let Some((after, outputs)) = results.get(&format!("{name}/after")) {
            assert_eq!(after, "ok", "{name}/after: {outputs}");
            assert_eq!(outputs, "logits[1, 50257]:201028", "{name}/after");
        }
    }
    let calls_after = results.keys().filter(|k| k.ends_with("/after")).count();
    assert_eq!(calls_after, 11, "a good call after each bad compute");
    let (outcome, outputs) = &results["range-logits"];
    assert_eq!(outcome, "ok");
    assert_eq!(
        outputs,
        "logits[1, 50257]:201028,range_logits[1, 3, 50257]:603084"
    );
    assert_eq!(
        results["tensor-roundtrip"].1,
        "[2, 2] TensorType::U8 [1, 2, 3, 4]"
    );
}

#[test]
fn calls_the_component_model_cannot_answer_trap_that_instance_alone() {
    let cases = [
        ("bad-handle", "unknown handle index"),
        ("bad-pointer", "out of bounds"),
        ("tensor-flood", "at most 4096 wasi-nn resources"),
        ("tensor-bytes", "bytes of wasi-nn tensors"),
    ];
    for (case, words) in cases {
        match run(case) {
            Err(HostError::Trap(message)) => assert!(
                message.contains(words),
                "{case}: the trap `{message}` should say `{words}`"
            ),
            other => panic!("{case}: expected a trap, got {other:?}"),
        }
        // the host serves the next instance as before
        let results = matrix();
        assert_eq!(results["no-inputs/after"].0, "ok", "after {case}");
    }
}

//! Who chooses the device. A guest that loads a model from bytes (`gpt2.wasm --model DIR`,
//! wasi-nn `load`) passes an execution target, which picks the device (`cpu` -> CPU, `gpu` ->
//! CUDA, `tpu` -> an error) unless the host has a device override (`--device`). Graphs loaded
//! by name carry no target and run where the host put them.

use integration_tests::*;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;
use wasi_nn_host::runtime::{GuestModule, Host, HostBuilder, RunOptions, RunOutcome};
use wasi_nn_host::wasi_nn::{Gpt2Backend, Gpt2Error};
use wasi_nn_host::Device;
use wasmtime_wasi_nn::wit::ExecutionTarget;

/// A host with the shakespeare model preloaded as `gpt2`, and `gpt2.wasm` compiled for it.
fn make_host(builder: HostBuilder) -> (Host, GuestModule) {
    let host = builder
        .graph("gpt2", &shakespeare_dir())
        .expect("load the default model")
        .build()
        .expect("host");
    let module = host.load_module(&gpt2_wasm()).expect("compile gpt2.wasm");
    (host, module)
}

/// No device override: the CLI without `--device`.
fn auto_host() -> &'static (Host, GuestModule) {
    static HOST: OnceLock<(Host, GuestModule)> = OnceLock::new();
    HOST.get_or_init(|| make_host(HostBuilder::auto()))
}

/// `--device cpu`.
fn cpu_host() -> &'static (Host, GuestModule) {
    static HOST: OnceLock<(Host, GuestModule)> = OnceLock::new();
    HOST.get_or_init(|| make_host(HostBuilder::new(Device::Cpu)))
}

/// Run `gpt2.wasm` with the host directory `model_dir` granted at `model` (as `--dir
/// HOST::model`); the run itself must not trap, time out or crash.
fn run((host, module): &(Host, GuestModule), model_dir: PathBuf, args: &[&str]) -> RunOutcome {
    let options = RunOptions {
        args: args.iter().map(|s| s.to_string()).collect(),
        dirs: vec![(model_dir, "model".into())],
        capture: Some(1 << 20),
        timeout: Some(Duration::from_secs(120)),
        ..Default::default()
    };
    host.run(module, "gpt2.wasm", &options)
        .unwrap_or_else(|e| panic!("{args:?}: the guest did not finish cleanly: {e}"))
}

/// The greedy ids of a `--json` run, which must succeed.
fn greedy_ids(host: &(Host, GuestModule), args: &[&str]) -> Vec<u32> {
    let out = run(host, shakespeare_dir(), args);
    assert_eq!(
        out.exit_code,
        0,
        "{args:?}: stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let json: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{args:?}: {e}: {line}"));
    ids(&json["ids"])
}

#[test]
fn model_loaded_from_bytes_for_target_cpu_equals_the_named_graph() {
    let fixture = read_json("shakespeare.json");
    let host = auto_host();
    assert_eq!(host.0.device_override(), None);
    for i in [0, 2] {
        let prompt = fixture["prompts"][i].as_str().expect("prompt");
        let hf: Vec<u32> = id_lists(&fixture["greedy_64"])[i][..12].to_vec();
        let named = greedy_ids(host, &["--json", "--max-tokens", "12", prompt]);
        assert_eq!(named, hf, "named graph, prompt {i}");
        let loaded = greedy_ids(
            host,
            &[
                "--model",
                "model",
                "--target",
                "cpu",
                "--json",
                "--max-tokens",
                "12",
                prompt,
            ],
        );
        assert_eq!(loaded, named, "--model through --dir, prompt {i}");
    }
    // --model really reads the files: without the directory granted there is nothing to load.
    let missing = run(
        host,
        shakespeare_dir(),
        &["--model", "elsewhere", "--max-tokens", "2", "ROMEO:"],
    );
    assert_eq!(missing.exit_code, 1);
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("--model elsewhere") && stderr.contains("--dir"),
        "{stderr}"
    );
}

#[test]
fn target_gpu_without_a_gpu_and_without_device_is_a_clear_error() {
    if let Ok(gpu) = wasi_nn_host::cuda::describe() {
        eprintln!("SKIPPED: a GPU is present ({gpu}), so --target gpu would run on it");
        return;
    }
    let host = auto_host();
    let started = std::time::Instant::now();
    let out = run(
        host,
        fixture("tiny"),
        &[
            "--model",
            "model",
            "--target",
            "gpu",
            "--max-tokens",
            "2",
            "x",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.exit_code, 1, "stderr: {stderr}");
    assert!(out.stdout.is_empty(), "nothing generated");
    assert!(
        stderr.contains("execution target gpu") && stderr.contains("GPU"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(60), "no hang");
    // The backend's own error names the cause.
    let backend = Gpt2Backend::auto(1 << 30);
    let st = std::fs::read(fixture("tiny/model.safetensors")).expect("read");
    let cfg = std::fs::read(fixture("tiny/config.json")).expect("read");
    match backend.load_bytes(&[&st, &cfg], ExecutionTarget::Gpu) {
        Err(e @ Gpt2Error::TargetDevice(_)) => {
            let message = e.to_string();
            assert!(
                message.contains("execution target gpu") && message.contains("CUDA"),
                "{message}"
            );
        }
        Err(e) => panic!("expected a device error, got {e}"),
        Ok(_) => panic!("a GPU graph without a GPU"),
    }
    // and the host keeps serving
    let ids = greedy_ids(
        host,
        &["--model", "model", "--json", "--max-tokens", "2", "ROMEO:"],
    );
    assert_eq!(ids.len(), 2);
}

#[test]
fn device_override_runs_target_gpu_on_the_cpu() {
    let host = cpu_host();
    assert_eq!(host.0.device_override(), Some(Device::Cpu));
    let named = greedy_ids(host, &["--json", "--max-tokens", "8", "ROMEO:"]);
    let loaded = greedy_ids(
        host,
        &[
            "--model",
            "model",
            "--target",
            "gpu",
            "--json",
            "--max-tokens",
            "8",
            "ROMEO:",
        ],
    );
    assert_eq!(loaded, named);
    assert_eq!(named.len(), 8);
    // The override wins over every target, tpu included.
    let tpu = greedy_ids(
        host,
        &[
            "--model",
            "model",
            "--target",
            "tpu",
            "--json",
            "--max-tokens",
            "8",
            "ROMEO:",
        ],
    );
    assert_eq!(tpu, named);
}

#[test]
fn target_tpu_is_refused_cleanly() {
    let out = run(
        auto_host(),
        fixture("tiny"),
        &["--model", "model", "--target", "tpu", "x"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.exit_code, 1, "{stderr}");
    assert!(stderr.contains("execution target tpu"), "{stderr}");
    let backend = Gpt2Backend::auto(1 << 30);
    let bin = std::fs::read(fixture("tiny_llmc.bin")).expect("read");
    let err = backend
        .load_bytes(&[&bin], ExecutionTarget::Tpu)
        .err()
        .expect("no TPU");
    assert!(
        matches!(err, Gpt2Error::UnsupportedTarget("tpu")),
        "{err:?}"
    );
    assert!(err.to_string().contains("not supported"), "{err}");
}

#[test]
fn the_device_for_each_target_with_and_without_an_override() {
    let auto = Gpt2Backend::auto(1 << 30);
    assert_eq!(auto.device_override(), None);
    assert_eq!(auto.device(), Device::Cpu, "host-loaded graphs: CPU");
    assert_eq!(
        auto.device_for(ExecutionTarget::Cpu).ok(),
        Some(Device::Cpu)
    );
    assert_eq!(
        auto.device_for(ExecutionTarget::Gpu).ok(),
        Some(Device::Cuda)
    );
    assert!(auto.device_for(ExecutionTarget::Tpu).is_err());
    for device in [Device::Cpu, Device::Cuda] {
        let fixed = Gpt2Backend::new(device, 1 << 30);
        assert_eq!(fixed.device(), device);
        for target in [
            ExecutionTarget::Cpu,
            ExecutionTarget::Gpu,
            ExecutionTarget::Tpu,
        ] {
            assert_eq!(fixed.device_for(target).ok(), Some(device));
        }
    }
    // A target-cpu load on the auto backend works anywhere; its graph runs.
    let bin = std::fs::read(fixture("tiny_llmc.bin")).expect("read");
    let graph = auto
        .load_bytes(&[&bin], ExecutionTarget::Cpu)
        .expect("cpu graph");
    assert!(graph.init_execution_context().is_ok());
    assert_eq!(
        HostBuilder::default()
            .build()
            .expect("host")
            .device_override(),
        None
    );
}

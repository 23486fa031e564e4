//! Instant guests: the pre-initialised `gpt2.wasm` behaves exactly like the plain one (the same
//! outputs for the same arguments, files granted at run time), and the instance pool keeps
//! serving, refuses cleanly when full, and keeps the limits (memory cap, time limit). Timings
//! are `wasi-nn-bench startup`'s business, not asserted here.

use integration_tests::*;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard};
use std::time::Duration;
use wasi_nn_host::runtime::{
    has_init_export, GuestModule, Host, HostBuilder, HostError, InstancePool, RunOptions,
    RunOutcome,
};
use wasi_nn_host::Device;

/// A host with the default model and both modules: (plain, pre-initialised).
/// The tests of this file run side by side, except the one that times a run's time limit: it
/// runs alone (on a 2-core machine the others' runs delayed its timed-out run past its bound).
static TIMED_ALONE: RwLock<()> = RwLock::new(());

fn beside_others() -> RwLockReadGuard<'static, ()> {
    TIMED_ALONE.read().unwrap_or_else(|p| p.into_inner())
}

fn host() -> &'static (Host, GuestModule, GuestModule) {
    static HOST: OnceLock<(Host, GuestModule, GuestModule)> = OnceLock::new();
    HOST.get_or_init(|| {
        let host = HostBuilder::new(Device::Cpu)
            .graph("gpt2", &shakespeare_dir())
            .expect("load the default model")
            .build()
            .expect("host");
        let (plain, pre) = load_both(&host);
        (host, plain, pre)
    })
}

fn load_both(host: &Host) -> (GuestModule, GuestModule) {
    let plain = host.load_module(&gpt2_wasm()).expect("compile gpt2.wasm");
    let pre = host
        .load_module(&gpt2_preinit_wasm())
        .expect("compile gpt2.preinit.wasm");
    (plain, pre)
}

/// A host of its own with the default model and an instance pool of `pool`.
fn pooled_host(pool: Option<InstancePool>) -> (Host, GuestModule, GuestModule) {
    let host = HostBuilder::new(Device::Cpu)
        .instance_pool(pool)
        .graph("gpt2", &shakespeare_dir())
        .expect("load the default model")
        .build()
        .expect("host");
    let (plain, pre) = load_both(&host);
    (host, plain, pre)
}

/// A directory with `val.txt`: 20 kB of TinyShakespeare's validation split.
fn val_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let text = std::fs::read(repo_root().join("tests/data/tinyshakespeare.txt"))
            .expect("tests/data/tinyshakespeare.txt");
        let dir = std::env::temp_dir().join(format!("gpt2-instant-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        std::fs::write(dir.join("val.txt"), &text[1_011_177..1_031_177]).expect("val.txt");
        dir
    })
    .clone()
}

fn options(args: &[&str]) -> RunOptions {
    RunOptions {
        args: args.iter().map(|s| s.to_string()).collect(),
        capture: Some(1 << 26),
        ..Default::default()
    }
}

fn run(host: &Host, module: &GuestModule, options: &RunOptions) -> RunOutcome {
    host.run(module, "gpt2.wasm", options).expect("guest ran")
}

/// stdout with the measured times taken out of JSON lines (`timings`, `ms`): everything else
/// must be equal byte for byte.
fn without_times(stdout: &[u8]) -> String {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(
            |line| match serde_json::from_str::<serde_json::Value>(line) {
                Ok(serde_json::Value::Object(mut object)) => {
                    object.remove("timings");
                    object.remove("ms");
                    serde_json::Value::Object(object).to_string()
                }
                _ => line.to_owned(),
            },
        )
        .collect::<Vec<_>>()
        .join("\n")
}

/// Run both modules with `options`; their exit codes, stdout (less times) and stderr agree.
fn assert_same(host: &Host, plain: &GuestModule, pre: &GuestModule, options: &RunOptions) {
    let a = run(host, plain, options);
    let b = run(host, pre, options);
    let what = &options.args;
    assert_eq!(a.exit_code, b.exit_code, "{what:?}");
    assert_eq!(
        String::from_utf8_lossy(&a.stderr),
        String::from_utf8_lossy(&b.stderr),
        "{what:?}"
    );
    assert_eq!(
        without_times(&a.stdout),
        without_times(&b.stdout),
        "{what:?}"
    );
}

#[test]
fn the_snapshot_lost_its_init_export_and_the_plain_module_keeps_it() {
    let _shared = beside_others();
    let (_, plain, pre) = host();
    assert!(has_init_export(plain.module().expect("a module")));
    assert!(!has_init_export(pre.module().expect("a module")));
}

#[test]
fn the_preinitialised_guest_gives_the_plain_guests_outputs() {
    let _shared = beside_others();
    let (host, plain, pre) = host();
    let cases: &[&[&str]] = &[
        // greedy, streamed and as JSON
        &["--max-tokens", "64", "ROMEO:"],
        &["--json", "--max-tokens", "32", "But, soft! what light"],
        // sampled with a seed, streamed and as JSON
        &[
            "--temperature",
            "0.8",
            "--seed",
            "42",
            "--max-tokens",
            "48",
            "ROMEO:",
        ],
        &[
            "--json",
            "--temperature",
            "0.9",
            "--top-p",
            "0.9",
            "--top-k",
            "200",
            "--seed",
            "7",
            "--max-tokens",
            "40",
            "JULIET:",
        ],
        &[
            "--stream-json",
            "--temperature",
            "1.2",
            "--seed",
            "3",
            "--max-tokens",
            "20",
            "café ☃",
        ],
        // the prompt's logits
        &["--logits", "ROMEO:"],
        &[
            "--logits",
            "First Citizen:\nBefore we proceed any further, hear me speak.",
        ],
        // stops, the empty prompt, errors
        &["--json", "--stop", "Nurse", "--max-tokens", "30", "ROMEO:"],
        &["--json", "--max-tokens", "3", ""],
        &["--top-p", "0", "x"],
        &["--graph", "nope", "hello"],
        &["--tokenizer", "/nope.json", "x"],
        &[],
    ];
    for args in cases {
        assert_same(host, plain, pre, &options(args));
    }
    // The text is the reference text (HF's greedy continuation) in both.
    let fixture = read_json("shakespeare.json");
    let want = fixture["greedy_64_text"][0].as_str().expect("text");
    let out = run(host, pre, &options(&["--max-tokens", "64", "ROMEO:"]));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(text.trim_end_matches('\n'), want.trim_end_matches('\n'));
}

#[test]
fn the_preinitialised_guest_sees_the_files_granted_to_its_run() {
    let _shared = beside_others();
    let (host, plain, pre) = host();
    let args = [
        "--perplexity",
        "data/val.txt",
        "--window",
        "128",
        "--max-scored",
        "256",
    ];
    let granted = RunOptions {
        dirs: vec![(val_dir(), "data".into())],
        ..options(&args)
    };
    assert_same(host, plain, pre, &granted);
    let out = run(host, pre, &granted);
    assert_eq!(out.exit_code, 0, "{}", String::from_utf8_lossy(&out.stderr));
    // and nothing granted, nothing seen (the snapshot holds no preopens)
    let out = run(host, pre, &options(&args));
    assert_eq!(out.exit_code, 1);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dir"));
}

#[test]
fn the_on_demand_allocator_runs_both_modules_alike() {
    let _shared = beside_others();
    let (host, plain, pre) = pooled_host(None);
    assert_eq!(host.instance_pool(), None);
    assert_same(
        &host,
        &plain,
        &pre,
        &options(&["--json", "--max-tokens", "8", "ROMEO:"]),
    );
}

#[test]
fn the_pool_keeps_serving_after_many_runs() {
    let _shared = beside_others();
    let pool = InstancePool {
        max_instances: 2,
        ..Default::default()
    };
    let (host, plain, pre) = pooled_host(Some(pool));
    let reference = run(
        &host,
        &plain,
        &options(&["--json", "--max-tokens", "2", "x"]),
    );
    for i in 0..300 {
        // mostly the snapshot; now and then the plain module takes a slot the snapshot used
        let module = if i % 25 == 0 { &plain } else { &pre };
        let out = run(
            &host,
            module,
            &options(&["--json", "--max-tokens", "2", "x"]),
        );
        assert_eq!(
            out.exit_code,
            0,
            "run {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            without_times(&out.stdout),
            without_times(&reference.stdout),
            "run {i}"
        );
    }
    // two at a time from four threads: the pool's two slots, taken and given back
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (host, pre) = (&host, &pre);
            scope.spawn(move || {
                for i in 0..25 {
                    match host.run(pre, "gpt2.wasm", &options(&["--max-tokens", "1", "x"])) {
                        Ok(out) => assert_eq!(out.exit_code, 0, "thread {t}, run {i}"),
                        Err(HostError::Busy { max_instances }) => assert_eq!(max_instances, 2),
                        Err(e) => panic!("thread {t}, run {i}: {e}"),
                    }
                }
            });
        }
    });
    assert_eq!(host.live_instances(), 0);
}

#[test]
fn a_full_pool_says_busy_and_serves_again_once_a_run_ends() {
    let _shared = beside_others();
    let pool = InstancePool {
        max_instances: 1,
        ..Default::default()
    };
    let (host, _, pre) = pooled_host(Some(pool));
    let cancel = Arc::new(AtomicBool::new(false));
    let long = RunOptions {
        cancel: Some(cancel.clone()),
        ..options(&["--max-tokens", "500", "ROMEO:"])
    };
    std::thread::scope(|scope| {
        let running = scope.spawn(|| host.run(&pre, "gpt2.wasm", &long));
        while host.live_instances() == 0 && !running.is_finished() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let refused = host.run(&pre, "gpt2.wasm", &options(&["x"]));
        assert!(
            matches!(refused, Err(HostError::Busy { max_instances: 1 })),
            "{refused:?}"
        );
        assert!(refused
            .err()
            .is_some_and(|e| e.to_string().contains("instance slots are in use")));
        cancel.store(true, std::sync::atomic::Ordering::Relaxed);
        let first = running.join().expect("the long run's thread");
        assert!(matches!(first, Err(HostError::Cancelled)), "{first:?}");
    });
    assert_eq!(host.live_instances(), 0);
    let out = run(&host, &pre, &options(&["--max-tokens", "2", "x"]));
    assert_eq!(out.exit_code, 0);
}

/// `--perplexity` over the validation text with `window`: the guest holds `window` rows of
/// logits at once (`window * 50257 * 4` bytes: 51 MB for 256).
fn scoring(window: usize, cap: Option<usize>) -> RunOptions {
    let window = window.to_string();
    RunOptions {
        dirs: vec![(val_dir(), "data".into())],
        max_memory_bytes: cap,
        ..options(&[
            "--perplexity",
            "data/val.txt",
            "--window",
            &window,
            "--max-scored",
            &window,
        ])
    }
}

/// Does the run fail (a trap, or a non-zero exit)?
fn fails(result: Result<RunOutcome, HostError>) -> bool {
    match result {
        Ok(out) => out.exit_code != 0,
        Err(e) => matches!(e, HostError::Trap(_) | HostError::Wasmtime(_)),
    }
}

#[test]
fn the_memory_cap_holds_for_both_modules() {
    let _shared = beside_others();
    let (host, plain, pre) = host();
    for module in [plain, pre] {
        // below what the guest needs to start
        let tiny = RunOptions {
            max_memory_bytes: Some(4 << 20),
            ..options(&["x"])
        };
        assert!(fails(host.run(module, "gpt2.wasm", &tiny)));
        // enough to start, not to hold 256 rows of logits; then enough for 16
        let run = |options: &RunOptions| host.run(module, "gpt2.wasm", options);
        assert!(fails(run(&scoring(256, Some(40 << 20)))));
        let roomy = run(&scoring(256, Some(256 << 20))).expect("256 rows fit in 256 MiB");
        assert_eq!(
            roomy.exit_code,
            0,
            "{}",
            String::from_utf8_lossy(&roomy.stderr)
        );
        let ok = run(&scoring(16, Some(40 << 20))).expect("a small window fits");
        assert_eq!(ok.exit_code, 0, "{}", String::from_utf8_lossy(&ok.stderr));
    }
}

#[test]
fn pool_limits_hold_for_both_modules() {
    let _alone = TIMED_ALONE.write().unwrap_or_else(|p| p.into_inner());
    // slots of 40 MiB: the pool's own cap on every instance
    let pool = InstancePool {
        max_instances: 2,
        max_memory_bytes: 40 << 20,
        ..Default::default()
    };
    let (host, plain, pre) = pooled_host(Some(pool));
    for module in [&plain, &pre] {
        let slow = RunOptions {
            timeout: Some(Duration::from_millis(50)),
            ..options(&["--max-tokens", "400", "x"])
        };
        let started = std::time::Instant::now();
        let result = host.run(module, "gpt2.wasm", &slow);
        assert!(matches!(result, Err(HostError::Timeout(_))), "{result:?}");
        assert!(started.elapsed() < Duration::from_millis(500));
        assert!(fails(host.run(module, "gpt2.wasm", &scoring(256, None))));
        let ok = host
            .run(module, "gpt2.wasm", &scoring(16, None))
            .expect("a small window fits");
        assert_eq!(ok.exit_code, 0, "{}", String::from_utf8_lossy(&ok.stderr));
    }
    assert_eq!(host.live_instances(), 0);
    let out = run(&host, &pre, &options(&["--max-tokens", "2", "x"]));
    assert_eq!(out.exit_code, 0);
}

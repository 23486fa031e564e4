//! A long-running host holds steady: 10,000 guest runs, each loading the graph by name,
//! making an execution context (its own KV cache) and running an inference, leave the host's
//! resident memory where it was after the first runs. What an instance makes goes with it.

use integration_tests::*;
use wasi_nn_host::{Device, HostBuilder, RunOptions};

/// Resident set size of this process, in bytes (Linux).
fn rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

#[test]
fn ten_thousand_guest_runs_leave_memory_steady() {
    let host = HostBuilder::new(Device::Cpu)
        .graph("gpt2", &shakespeare_dir())
        .expect("model")
        .build()
        .expect("host");
    let module = host
        .load_module(&repo_root().join("tests/guests/witx_step.wat"))
        .expect("compile");
    let options = RunOptions {
        capture: Some(1 << 10),
        ..Default::default()
    };
    let run = |i: usize| {
        let out = host.run(&module, "step.wasm", &options).expect("run");
        assert_eq!(out.exit_code, 0, "run {i}");
    };
    // warm up: the allocator's pools, the batcher's buffers
    for i in 0..500 {
        run(i);
    }
    let Some(start) = rss() else {
        eprintln!("skipped: no /proc/self/statm on this system");
        return;
    };
    let started = std::time::Instant::now();
    for i in 500..10_000 {
        run(i);
    }
    let end = rss().expect("statm");
    let grown = end as i64 - start as i64;
    eprintln!(
        "10,000 guest runs ({:.1} s for the last 9,500): RSS {:.1} MB after 500, {:.1} MB after \
         10,000 ({:+.1} MB)",
        started.elapsed().as_secs_f64(),
        start as f64 / 1e6,
        end as f64 / 1e6,
        grown as f64 / 1e6
    );
    // each run makes a context with a KV cache for the model's whole context (8 layers x 512
    // positions x 192 x 2 x 4 bytes = 6.3 MB): 9,500 of them kept would be 60 GB
    assert!(
        grown < 32 << 20,
        "RSS grew by {grown} bytes over 9,500 runs"
    );
}

//! Out of memory on the GPU's KV caches (its own test binary: it fills the GPU, so it must not
//! run beside the other GPU tests). Without a GPU it prints why and skips; on the GPU machine
//! `wasi-nn-bench check-cuda --out-of-memory` runs the same check.

#[test]
fn a_context_the_gpu_has_no_memory_for_is_refused_alone() {
    if let Err(e) = wasi_nn_host::cuda::describe() {
        eprintln!("out-of-memory check: SKIPPED, no usable GPU: {e}");
        return;
    }
    let reports = wasi_nn_bench::checks::kv_out_of_memory(std::process::id() as u64)
        .expect("out-of-memory check");
    assert_eq!(reports.len(), 2);
    for r in &reports {
        assert!(r.passed, "{r:?}");
    }
}

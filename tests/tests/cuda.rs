//! The CUDA backend against the CPU reference. Without a GPU these tests print why and skip;
//! on the GPU machine `wasi-nn-bench check-cuda` runs the same checks (`wasi_nn_bench`) from one
//! binary (see BENCHMARKS.md for the commands and results).

use integration_tests::*;
use wasi_nn_bench::checks as gpu_check;
use wasi_nn_host::model;
use wasi_nn_host::GpuDtype;

fn gpu_or_skip(test: &str) -> bool {
    match wasi_nn_host::cuda::describe() {
        Ok(gpu) => {
            eprintln!("{test}: running on {gpu}");
            true
        }
        Err(e) => {
            eprintln!("{test}: SKIPPED, no usable GPU: {e}");
            false
        }
    }
}

#[test]
fn each_kernel_alone_matches_the_cpu_reference() {
    if !gpu_or_skip("kernel checks") {
        return;
    }
    let reports = wasi_nn_bench::kernels::run(std::process::id() as u64).expect("kernel checks");
    assert!(reports.len() > 40);
    for r in &reports {
        assert!(r.passed, "{r:?}");
    }
}

#[test]
fn kernels_on_random_models_of_awkward_sizes_match_the_cpu() {
    if !gpu_or_skip("kernel sweep") {
        return;
    }
    let reports = gpu_check::kernel_sweep(std::process::id() as u64).expect("sweep");
    for r in &reports {
        assert!(r.passed, "{r:?}");
    }
}

#[test]
fn contexts_sharing_batched_steps_match_the_cpu_and_their_runs_alone() {
    if !gpu_or_skip("batched steps") {
        return;
    }
    let reports = gpu_check::batched_sweep(std::process::id() as u64).expect("batched sweep");
    for r in &reports {
        assert!(r.passed, "{r:?}");
    }
}

#[test]
fn contexts_drawing_their_tokens_in_batched_steps_draw_by_the_rule() {
    if !gpu_or_skip("batched draws") {
        return;
    }
    let weights = wasi_nn_host::model::load_path(&shakespeare_dir()).expect("model");
    for dtype in [GpuDtype::F32, GpuDtype::Bf16] {
        for processed in [false, true] {
            let r = gpu_check::compare_batched_draws(
                "shakespeare",
                &weights,
                dtype,
                (8, 24),
                processed,
            )
            .expect("batched draws");
            assert!(r.passed, "{r:?}");
        }
    }
}

#[test]
fn shakespeare_on_the_gpu_matches_the_cpu_in_f32_and_bf16() {
    if !gpu_or_skip("shakespeare") {
        return;
    }
    let weights = model::load_path(&shakespeare_dir()).expect("load");
    let prompt = ids(&read_json("shakespeare.json")["prompt_ids"][1]);
    let f32 = gpu_check::compare(
        "shakespeare",
        weights.clone(),
        GpuDtype::F32,
        &prompt,
        64,
        1e-3,
    )
    .expect("f32");
    assert!(f32.passed && f32.greedy_agree == 64, "{f32:?}");
    let bf16 = gpu_check::compare("shakespeare", weights, GpuDtype::Bf16, &prompt, 64, 5e-2)
        .expect("bf16");
    assert!(bf16.passed, "{bf16:?}");
}

#[test]
fn no_gpu_is_a_clear_error_not_a_crash() {
    if wasi_nn_host::cuda::describe().is_ok() {
        eprintln!("a GPU is present: nothing to check here");
        return;
    }
    let weights = model::load_path(&fixture("tiny")).expect("tiny");
    let err = wasi_nn_host::executor_for(
        weights,
        wasi_nn_host::Device::Cuda,
        &wasi_nn_host::EngineOptions::default(),
    )
    .err()
    .expect("no executor without a GPU");
    assert!(err.to_string().contains("device"), "{err}");
}

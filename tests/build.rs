//! Builds the guests for the tests (as wasmtime builds its test programs): `gpt2.wasm` for
//! wasm32-wasip1, the component and the hostile `wasi:nn` probe (`tests/nn-probe`) for
//! wasm32-wasip2, with a nested cargo in its own target directory so it never waits on the
//! lock of the outer build. The paths reach the tests as `GPT2_WASM`, `GPT2_COMPONENT` and
//! `NN_PROBE`.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest
        .parent()
        .expect("tests/ sits in the workspace root")
        .to_owned();
    let target_dir = root.join("target").join("guest");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let builds = [
        ("gpt2-guest", "--bin=gpt2", "wasm32-wasip1"),
        ("gpt2-component", "--lib", "wasm32-wasip2"),
        ("nn-probe", "--bin=nn-probe", "wasm32-wasip2"),
    ];
    for (package, kind, target) in builds {
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(&root)
            .args(["build", "-p", package, kind, "--target", target])
            .args(["--profile", "release-wasm", "--target-dir"])
            .arg(&target_dir);
        // Flags meant for the host build must not leak into the wasm build.
        for var in [
            "RUSTFLAGS",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_TARGET",
            "RUSTC_WRAPPER",
            "RUSTC_WORKSPACE_WRAPPER",
            "CLIPPY_ARGS",
            "CLIPPY_CONF_DIR",
        ] {
            cmd.env_remove(var);
        }
        let status = cmd.status().expect("run cargo to build the guest");
        assert!(
            status.success(),
            "building {package} for {target} failed; is the target installed? \
             (`rustup toolchain install` in the repository root adds it)"
        );
    }
    let wasm = target_dir.join("wasm32-wasip1/release-wasm/gpt2.wasm");
    println!("cargo:rustc-env=GPT2_WASM={}", wasm.display());
    let component = target_dir.join("wasm32-wasip2/release-wasm/gpt2_component.wasm");
    println!("cargo:rustc-env=GPT2_COMPONENT={}", component.display());
    let probe = target_dir.join("wasm32-wasip2/release-wasm/nn-probe.wasm");
    println!("cargo:rustc-env=NN_PROBE={}", probe.display());
    for path in [
        ".cargo/config.toml",
        "guest/src",
        "guest/assets",
        "guest/Cargo.toml",
        "guest/component",
        "tests/nn-probe",
        "wit",
        "Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }
}

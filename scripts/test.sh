#!/usr/bin/env bash
# The project's tests: formatting, lints, and every test of the workspace (release mode: the
# CPU reference runs real models). GPU tests skip with a printed reason where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --all --check
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
# the library as embedders without HTTP build it
cargo clippy --release -p wasi-nn-host --no-default-features --lib --quiet -- -D warnings
cargo clippy --quiet -p gpt2-guest --target wasm32-wasip1 --profile release-wasm -- -D warnings
cargo clippy --quiet -p gpt2-component --target wasm32-wasip2 --profile release-wasm -- -D warnings
cargo test --release --workspace
scripts/check-kernels.sh

#!/usr/bin/env bash
# Builds gpt2.wasm and the host, then generates text with the embedded default model.
# Usage: scripts/demo.sh [GUEST OPTIONS] [PROMPT]   (default prompt: "ROMEO:")
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --quiet -p gpt2-guest --bin gpt2 --target wasm32-wasip1 --profile release-wasm
cargo build --quiet --release -p wasi-nn-host
[ $# -gt 0 ] || set -- --max-tokens 120 --temperature 0.8 --top-p 0.95 --seed 42 "ROMEO:"
exec target/release/wasi-nn-host run target/wasm32-wasip1/release-wasm/gpt2.wasm -- "$@"

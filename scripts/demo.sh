#!/usr/bin/env bash
# Builds gpt2.wasm and the host, pre-initialises gpt2.wasm (its tokenizer built into the
# module: gpt2.preinit.wasm), then generates text with the embedded default model.
# Usage: scripts/demo.sh [GUEST OPTIONS] [PROMPT]   (default prompt: "ROMEO:")
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# cargo's progress goes to stderr; the generated text is the only thing on stdout
if [ ! -x target/release/wasi-nn-host ]; then
  echo "demo.sh: the first build compiles gpt2.wasm and the host: about 10 minutes on 2 cores" >&2
fi
cargo build -p gpt2-guest --bin gpt2 --target wasm32-wasip1 --profile release-wasm
cargo build --release -p wasi-nn-host
wasm=target/wasm32-wasip1/release-wasm
if [ ! "$wasm/gpt2.preinit.wasm" -nt "$wasm/gpt2.wasm" ]; then
  target/release/wasi-nn-host preinit "$wasm/gpt2.wasm" "$wasm/gpt2.preinit.wasm"
fi
[ $# -gt 0 ] || set -- --max-tokens 120 --temperature 0.8 --top-p 0.95 --seed 42 "ROMEO:"
exec target/release/wasi-nn-host run "$wasm/gpt2.preinit.wasm" -- "$@"

#!/usr/bin/env bash
# The service as clients see it: the official `openai` Python package against
# `wasi-nn-host serve`, and the demo page in headless Chromium (Debian's chromium and
# chromium-driver, installed here with apt-get where missing). Called by scripts/test.sh.
# The client packages go into a virtual environment under target/.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --release -p wasi-nn-host
cargo build --quiet -p gpt2-component --lib --target wasm32-wasip2 --profile release-wasm
wasm=target/wasm32-wasip2/release-wasm
# made again when older than the component, or from before snapshots carried their marker
if [ ! "$wasm/gpt2_component.preinit.wasm" -nt "$wasm/gpt2_component.wasm" ] ||
  ! tail -c 64 "$wasm/gpt2_component.preinit.wasm" | grep -q 'wasi-nn-host:preinitialised'; then
  target/release/wasi-nn-host preinit "$wasm/gpt2_component.wasm" "$wasm/gpt2_component.preinit.wasm"
fi
venv=target/python-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -c 'import openai, selenium' 2>/dev/null ||
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'openai>=1.40,<4' 'selenium>=4.20,<5'
if ! command -v chromedriver >/dev/null || ! { command -v chromium || command -v chromium-browser; } >/dev/null; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver >/dev/null
fi
export WASI_NN_HOST="$PWD/target/release/wasi-nn-host"
export GPT2_COMPONENT="$PWD/$wasm/gpt2_component.preinit.wasm"
"$venv/bin/python" -m unittest discover -s tests/python -p 'test_*.py' -v

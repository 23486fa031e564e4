#!/usr/bin/env bash
# The project's tests: formatting, lints, and every test of the workspace (release mode: the
# CPU reference runs real models). GPU tests skip with a printed reason where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/check-format.sh
# every relative link of the Markdown files resolves (files and headings)
python3 scripts/check-links.py
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
# the library as embedders without HTTP build it
cargo clippy --release -p wasi-nn-host --no-default-features --lib --quiet -- -D warnings
cargo clippy --quiet -p gpt2-guest --target wasm32-wasip1 --profile release-wasm -- -D warnings
cargo clippy --quiet -p gpt2-component --target wasm32-wasip2 --profile release-wasm -- -D warnings
cargo test --release --workspace
# the CLI and the load generator in one build (the features the workspace's tests unified:
# the library is not compiled again)
cargo build --release --quiet -p wasi-nn-host -p wasi-nn-bench --bin wasi-nn-host --bin loadgen
# the guest's unit tests in wasm too: the sampler's simd128 lanes must draw what the portable
# ones draw (the pinned stream)
guest_tests=$(cargo test --quiet -p gpt2-guest --lib --target wasm32-wasip1 --profile release-wasm \
  --no-run --message-format=json | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])')
target/release/wasi-nn-host run "$guest_tests"
scripts/check-kernels.sh
# the service through the official `openai` Python client, and the demo page in headless Chromium
scripts/test-python.sh
# a short soak of the service binary (16 concurrent clients on the CPU): every text equal to its
# prompt run alone, the RSS not growing after the first third of the rounds
soak=target/soak-cpu
mkdir -p "$soak"
cp target/release/wasi-nn-host target/release/loadgen "$soak/"
target/release/wasi-nn-host preinit target/guest/wasm32-wasip2/release-wasm/gpt2_component.wasm \
  "$soak/gpt2_component.wasm" >/dev/null
bench/soak.sh "$soak" 45 "$soak/soak.jsonl" cpu
# replicas behind a real load balancer (Debian's haproxy, installed here where missing):
# texts equal to their prompts alone, one replica killed and one drained mid-load
if ! command -v haproxy >/dev/null; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq haproxy >/dev/null
fi
bench/scale-out.sh "$soak" cpu,cpu
# the Kubernetes manifests against the Kubernetes and CRD schemas, and their invariants
scripts/check-kubernetes.sh
# the container image, built from Debian's packages (debootstrap) and run with host networking:
# the same completions as the plain binary (installs docker.io and debootstrap where missing)
scripts/test-image.sh

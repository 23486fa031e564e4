#!/usr/bin/env bash
# The guest's sampler (issue 12): microseconds per token of the sampler alone (native and in
# wasm, on synthetic logits and on real rows from the embedded model and from random 124M
# weights), then gpt2.wasm end to end as it reports itself (`sampling_ms_per_token`).
#   bench/sampling.sh
# Needs target/release/wasi-nn-host and the release-wasm builds of gpt2.wasm and of the
# sampling_bench example:
#   cargo build --release -p wasi-nn-host
#   cargo build -p gpt2-guest --bin gpt2 --example sampling_bench --target wasm32-wasip1 --profile release-wasm
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/release/wasi-nn-host
W=target/wasm32-wasip1/release-wasm/gpt2.wasm
S=target/wasm32-wasip1/release-wasm/examples/sampling_bench.wasm
rows=$(mktemp -d)
trap 'rm -rf "$rows"' EXIT

# Logit rows: the embedded model after prompts of several lengths, and random 124M weights.
i=0
for prompt in "ROMEO:" "JULIET:" "First Citizen:" "KING RICHARD III:" \
    "ROMEO: What light through yonder window breaks" "To be, or not to be"; do
  $B run $W -- --logits "$prompt" 2>/dev/null | tail -1 > "$rows/model$i.json"
  i=$((i + 1))
done
$B run --graph gpt2=random:124M $W -- --logits "ROMEO:" 2>/dev/null | tail -1 > "$rows/random124M.json"

echo "== the sampler alone, native"
cargo run --quiet --release -p gpt2-guest --example sampling_bench -- "$rows"/*.json
echo "== the sampler alone, in wasm (wasmtime, simd128)"
$B run --dir "$rows::rows" $S -- $(cd "$rows" && ls *.json | sed 's|^|rows/|')

echo "== gpt2.wasm end to end: sampling_ms_per_token (and ms_per_token)"
report() {
  python3 -c 'import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); t=d["timings"]; print("%-44s sampling %7.1f us/token   whole token %6.2f ms" % (sys.argv[1], t["sampling_ms_per_token"]*1e3, t["ms_per_token"]))' "$1"
}
for args in "--temperature 1" "--temperature 1 --top-k 50" "--temperature 1 --top-p 0.9" \
    "--temperature 1 --top-k 50 --top-p 0.9"; do
  $B run $W -- --json --max-tokens 200 $args --seed 1 "ROMEO:" 2>/dev/null | report "embedded model, 200 tokens, $args"
done
for args in "--temperature 1" "--temperature 1 --top-p 0.9"; do
  $B run --graph gpt2=random:124M $W -- --json --max-tokens 30 $args --seed 1 "ROMEO:" 2>/dev/null \
    | report "random 124M, 30 tokens, $args"
done

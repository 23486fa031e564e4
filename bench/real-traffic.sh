#!/usr/bin/env bash
# Every row of BENCHMARKS.md's real-traffic table (issue 32), on the GPU machine, with its
# right-sized PyTorch peer in the same call:
#   bash bench/real-traffic.sh [BIN_DIR]   (default .device/bin: wasi-nn-host, loadgen and
#                                          gpt2_component.wasm, pre-initialised; xz or not)
# The peer: bench/torch_gpt2.py's captured step with its static cache sized to the workload
# (384 positions for 180-220-token prompts and 128 tokens; 136 for the 4-6-token prompts),
# the token drawn on the GPU (argmax or top-p). Ours: the service (124M, then 1558M, bf16)
# under loadgen, 128-token completions of prompts cut from TinyShakespeare. Lines as `peer`
# and `load` print them; the JSON lines go to $OUT (peer.jsonl, traffic.jsonl.xz).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-lib.sh
describe
unpack "${1:-.device/bin}" /tmp/real-traffic-bin

peer sizes=124M cache=384 sampler=argmax,top_p
peer sizes=124M cache=136 sampler=argmax
peer sizes=1558M cache=384 sampler=argmax,top_p

SAMPLED=(--temperature 1 --top-p 0.95)
MIXED=(--long-prompts 0.25:800)
serve random:124M 256
load greedy-1 --concurrency 1 --duration 5 --no-check
load sampled-1 --concurrency 1 --duration 5 "${SAMPLED[@]}" --no-check
load greedy-64 --concurrency 64 --duration 8 --no-check
load sampled-64 --concurrency 64 --duration 8 "${SAMPLED[@]}" --no-check
load sampled-256 --concurrency 256 --duration 8 "${SAMPLED[@]}" --no-check
load mixed-64 --concurrency 64 --duration 8 "${MIXED[@]}" --no-check
load mixed-sampled-64 --concurrency 64 --duration 8 "${MIXED[@]}" "${SAMPLED[@]}" --no-check
load greedy-64-short --concurrency 64 --duration 8 --prompt-tokens 4-6 --no-check
load greedy-256-short --concurrency 256 --duration 8 --prompt-tokens 4-6 --no-check
# the texts of 64 greedy streams against their prompts alone
load greedy-64-check --concurrency 64 --requests 1
stop
# the processed rows against a plain sampled load on one fresh server
serve random:124M 256
load sampled-64-plain --concurrency 64 --duration 6 "${SAMPLED[@]}" --no-check
load sampled-64-presence --concurrency 64 --duration 6 "${SAMPLED[@]}" --field presence_penalty=0.5 --no-check
load sampled-64-all --concurrency 64 --duration 6 "${SAMPLED[@]}" --field presence_penalty=0.5 \
  --field frequency_penalty=0.3 --field repetition_penalty=1.1 --field 'logit_bias={"50256":-100,"13":2}' --no-check
stop
serve random:1558M 64
load 1558M-greedy-64 --concurrency 64 --duration 8 --no-check
load 1558M-sampled-64 --concurrency 64 --duration 8 "${SAMPLED[@]}" --no-check
stop
# compressed (its files, with peer.err, serve.log and traffic.err, are five of the 8 the device
# tool brings back)
xz -f "$OUT/traffic.jsonl"
echo "end $(date +%T)"

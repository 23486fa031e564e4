#!/usr/bin/env bash
# Concurrency benchmark of the HTTP service (`wasi-nn-host serve`): streams at 1, 8, 32 and 64
# clients.
# Usage: bench/concurrency.sh DIR DEVICE DTYPE GRAPH
#   DIR holds wasi-nn-host, gpt2_component.wasm and loadgen; GRAPH is a path or random:SIZE,
#   served as `gpt2`.
set -uo pipefail
dir=${1:-carry}; device=${2:-cuda}; dtype=${3:-bf16}; graph=${4:-random:124M}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
$dir/wasi-nn-host serve --component $dir/gpt2_component.wasm --port 18123 --device $device --dtype $dtype --graph gpt2=$graph 2>/tmp/server.log &
server=$!
for _ in $(seq 100); do curl -sf http://127.0.0.1:18123/health >/dev/null && break; sleep 0.2; done
for c in 1 8 32 64; do
  requests=$(( c >= 32 ? 2 : 4 ))
  $dir/loadgen --url http://127.0.0.1:18123 --concurrency $c --requests $requests --max-tokens 128
done
kill $server

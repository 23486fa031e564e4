#!/usr/bin/env bash
# Where the period goes at 64 and 256 sampled streams (issue 32), on the GPU machine:
#   bash bench/period.sh [BIN_DIR]   (default .device/bin, as bench/real-traffic.sh)
# Each load leaves a part of the batched pass out (WASI_NN_HOST_SKIP: the products, attention,
# the LayerNorms and epilogues, the LM head, the sampled draw; results are wrong, only the time
# counts), 8 s of 128-token completions of ~200-token prompts at temperature 1 and top-p 0.95;
# then the batched steps' trace of the whole pass (mean / p10 / p50 / p90 past the first third
# of the steps; at 256 streams the two lanes' passes overlap on the GPU). A part's share of the
# period is 1 - (tokens/s of the whole) / (tokens/s without it).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-lib.sh
describe
unpack "${1:-.device/bin}" /tmp/period-bin
SAMPLED=(--temperature 1 --top-p 0.95)
for skip in none gemm attn ln,epi head draw; do
  for n in 64 256; do
    serve random:124M 256 WASI_NN_HOST_SKIP=$skip
    load "sampled-$n-skip-$skip" --concurrency "$n" --duration 8 "${SAMPLED[@]}" --no-check
    stop
  done
done
# the steps' trace
for n in 64 256; do
  : > "$OUT/serve.log"
  serve random:124M 256 RUST_LOG=wasi_nn_host::cuda::batch=debug NO_COLOR=1
  load "sampled-$n-trace" --concurrency "$n" --duration 8 "${SAMPLED[@]}" --no-check
  stop
  step_trace "$OUT/serve.log"
done
rm -f "$OUT/serve.log"
echo "end $(date +%T)"

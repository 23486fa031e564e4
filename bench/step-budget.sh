#!/usr/bin/env bash
# The batched step's budget (`WASI_NN_HOST_STEP_TOKENS`; a pass holds the budget and a chunk
# past it) against the loads it trades between, on the GPU machine:
#   bash bench/step-budget.sh [BIN_DIR] [BUDGETS]   (default .device/bin, "256 512 1024")
# Each budget serves 124M bf16 in turn, twice, alternating (machines drift): 64 and 256
# sampled streams of ~200-token prompts, where a bigger budget takes the prompts that arrive
# together in fewer passes (their first tokens sooner) and makes each of those passes longer
# (the other streams' gaps), and 64 greedy streams with a quarter of the prompts ~800 tokens.
# Lines as `load` prints them, labelled BUDGET/LOAD; the JSON lines into $OUT/traffic.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-lib.sh
describe
unpack "${1:-.device/bin}" /tmp/step-budget-bin
budgets=${2:-256 512 1024}
SAMPLED=(--temperature 1 --top-p 0.95)
for round in 1 2; do
  for budget in $budgets; do
    serve random:124M 256 WASI_NN_HOST_STEP_TOKENS="$budget" || continue
    load "$budget/sampled-64" --concurrency 64 --duration 8 "${SAMPLED[@]}" --no-check
    load "$budget/sampled-256" --concurrency 256 --duration 8 "${SAMPLED[@]}" --no-check
    load "$budget/mixed-64" --concurrency 64 --duration 8 --long-prompts 0.25:800 --no-check
    stop
  done
  echo "round $round done $(date +%T)"
done

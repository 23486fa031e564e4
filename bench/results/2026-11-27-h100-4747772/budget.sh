#!/usr/bin/env bash
# device call (issue 32): the step's token budget (WASI_NN_HOST_STEP_TOKENS) at 128, 256 and
# 320, alternating, with sampled ~200-token prompts at 64 and 256 streams, a quarter ~800-token
# prompts among 64 (the others' gap), greedy short prompts; 1558M at 128 and 256
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
echo "build: $(cat .device/COMMIT)"
d=/tmp/b; mkdir -p $d
for f in .device/bin/*.xz; do xz -dc "$f" > $d/$(basename "${f%.xz}"); done; chmod +x $d/wasi-nn-host $d/loadgen $d/wasi-nn-bench
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
url=http://127.0.0.1:18125
load() { local name=$1; shift; timeout 100 $d/loadgen --url $url --max-tokens 128 --prompt-file tests/data/tinyshakespeare.txt "$@" --no-check --label $name --json-out $OUT/traffic.jsonl 2>>$OUT/traffic.err | python3 -c "
import json,sys
r=json.loads(sys.stdin.read()); print('$name', round(r['tokens_per_s']), 'ttft p50/p99', round(r['ttft_ms_p50'],2), round(r['ttft_ms_p99'],2), 'gap p50/p99', round(r['gap_ms_p50'],3), round(r['gap_ms_p99'],3), 'others gap p99', (r.get('other_prompts') or {}).get('gap_ms_p99'))"; }
serve() { local model=$1 warm=$2; shift 2; env "$@" $d/wasi-nn-host serve --component $d/gpt2_component.wasm --port 18125 --device cuda --dtype bf16 --graph gpt2=$model --max-instances 320 --warm-contexts $warm 2>>$OUT/serve.log &
  for _ in $(seq 1500); do curl -sf $url/health >/dev/null && break; sleep 0.2; done; }
for round in 1 2; do
  for st in 128 256 320; do
    serve random:124M 256 WASI_NN_HOST_STEP_TOKENS=$st
    load sampled-64-st$st-$round --concurrency 64 --duration 8 --temperature 1 --top-p 0.95
    load sampled-256-st$st-$round --concurrency 256 --duration 8 --temperature 1 --top-p 0.95
    load mixed-sampled-64-st$st-$round --concurrency 64 --duration 8 --long-prompts 0.25:800 --temperature 1 --top-p 0.95
    [ $round = 1 ] && load greedy-short-64-st$st-$round --concurrency 64 --duration 6 --prompt-tokens 4-6
    kill %1; wait
  done
  echo "t=$(( $(date +%s)-T0 ))s"
done
for st in 128 256 128 256; do
  [ $(( $(date +%s)-T0 )) -gt 510 ] && { echo "out of time before 1558M $st"; break; }
  serve random:1558M 64 WASI_NN_HOST_STEP_TOKENS=$st
  load 1558M-sampled-64-st$st --concurrency 64 --duration 8 --temperature 1 --top-p 0.95
  kill %1; wait
done
echo "t=$(( $(date +%s)-T0 ))s"

#!/usr/bin/env bash
# device call (issue 32): at 1558M, the batched attention's wave limit (spans a row may be cut
# into) against the default, alternating, twice; then ncu's stall reasons for the 124M pass's
# product, LayerNorm and attention kernels at 64 rows (the engine alone, 5-token prompts)
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "build: $(cat .device/COMMIT)"
d=/tmp/b; mkdir -p $d
for f in .device/bin/*.xz; do xz -dc "$f" > $d/$(basename "${f%.xz}"); done; chmod +x $d/wasi-nn-host $d/loadgen $d/wasi-nn-bench
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
url=http://127.0.0.1:18125
load() { local name=$1; shift; timeout 100 $d/loadgen --url $url --max-tokens 128 --prompt-file tests/data/tinyshakespeare.txt "$@" --no-check --label $name --json-out $OUT/traffic.jsonl 2>>$OUT/traffic.err | python3 -c "
import json,sys
r=json.loads(sys.stdin.read()); print('$name', round(r['tokens_per_s']), 'ttft p50/p99', round(r['ttft_ms_p50'],2), round(r['ttft_ms_p99'],2), 'gap p50/p99', round(r['gap_ms_p50'],3), round(r['gap_ms_p99'],3))"; }
serve() { local model=$1 warm=$2; shift 2; env "$@" $d/wasi-nn-host serve --component $d/gpt2_component.wasm --port 18125 --device cuda --dtype bf16 --graph gpt2=$model --max-instances 320 --warm-contexts $warm 2>>$OUT/serve.log &
  for _ in $(seq 1500); do curl -sf $url/health >/dev/null && break; sleep 0.2; done; }
for round in 1 2; do
  for sw in X=1 WASI_NN_HOST_BATCH_WAVE=0 WASI_NN_HOST_BATCH_WAVE=2112 WASI_NN_HOST_BATCH_WAVE=528; do
    [ $(( $(date +%s)-T0 )) -gt 330 ] && { echo "out of time before $sw"; break 2; }
    serve random:1558M 64 $sw
    load 1558M-sampled-64-${sw#WASI_NN_HOST_}-$round --concurrency 64 --duration 8 --temperature 1 --top-p 0.95
    kill %1; wait
  done
done
echo "t=$(( $(date +%s)-T0 ))s"
NCU=/usr/local/cuda/bin/ncu
timeout 200 $NCU --cache-control none --clock-control none --graph-profiling node --launch-skip 2000 --launch-count 40 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
  -k regex:"batch_gemm|batch_residual_norm|batch_attention_bf16" \
  $d/wasi-nn-bench streams --device cuda --dtype bf16 --model random:124M --streams 64 --prompt 5 --steps 64 > $OUT/ncu-stalls.txt 2>&1
echo "ncu rc=$? $(wc -l < $OUT/ncu-stalls.txt) lines"
grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Compute \(SM\) Throughput|Warp Cycles Per Issued|Registers Per|Theoretical Occ|L2 Cache Throughput" $OUT/ncu-stalls.txt | head -120
echo "t=$(( $(date +%s)-T0 ))s"

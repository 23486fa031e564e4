#!/usr/bin/env bash
# device call (issue 32): the batched pass's cuBLAS products tuned by timing (cuBLASLt's
# heuristic candidates against cuBLAS's default) — what tuning found per shape, the checks,
# and A/B in the service (alternating, same machine) at 124M and 1558M
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
echo "build: $(cat .device/COMMIT)"
d=/tmp/b; mkdir -p $d
for f in .device/bin/*.xz; do xz -dc "$f" > $d/$(basename "${f%.xz}"); done; chmod +x $d/wasi-nn-host $d/loadgen $d/wasi-nn-bench
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
url=http://127.0.0.1:18125
s=$(date +%s); timeout 130 $d/wasi-nn-bench check-cuda --model models/gpt2-shakespeare --model random:124M --prompt 16 --steps 32 > $OUT/checks.log 2>&1
echo "checks rc=$? $(( $(date +%s)-s ))s $(grep -c '"passed":true' $OUT/checks.log) passed, $(grep -c '"passed":false' $OUT/checks.log) failed"
grep -h '"passed":false' $OUT/checks.log | cut -c1-300 | head
load() { local name=$1; shift; timeout 100 $d/loadgen --url $url --max-tokens 128 --prompt-file tests/data/tinyshakespeare.txt "$@" --label $name --json-out $OUT/traffic.jsonl 2>>$OUT/traffic.err | python3 -c "
import json,sys
r=json.loads(sys.stdin.read()); print('$name', round(r['tokens_per_s']), 'ttft p50/p99', round(r['ttft_ms_p50'],2), round(r['ttft_ms_p99'],2), 'gap p50/p99', round(r['gap_ms_p50'],3), round(r['gap_ms_p99'],3), r['texts_equal_single_stream'])"; }
serve() { local model=$1 warm=$2 tag=$3; shift 3; s=$(date +%s)
  env NO_COLOR=1 RUST_LOG=wasi_nn_host::cuda::batch::pass=debug "$@" $d/wasi-nn-host serve --component $d/gpt2_component.wasm --port 18125 --device cuda --dtype bf16 --graph gpt2=$model --max-instances 320 --warm-contexts $warm 2>/tmp/serve-$tag.log &
  for _ in $(seq 1500); do curl -sf $url/health >/dev/null && break; sleep 0.2; done; echo "start $tag $(( $(date +%s)-s ))s"; }
tunings() { python3 - $1 <<'PY'
import re, sys
for line in open(sys.argv[1], errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    if "batched product tuned" not in line: continue
    f = dict(re.findall(r"(\w+)=([\w.]+)", line))
    print(f"  tuned rows {f['rows']:>4} n {f['n']:>5} k {f['k']:>4}: default {float(f['default_us']):7.1f} us, lt best {float(f['best_us']):7.1f} us, kept lt {f['lt']}")
PY
}
for round in 1 2; do
  for sw in X=1 WASI_NN_HOST_NO_GEMM_TUNING=1; do
    tag=124M-${sw%%=*}-$round
    serve random:124M 256 $tag $sw
    [ $round = 1 ] && [ $sw = X=1 ] && tunings /tmp/serve-$tag.log > $OUT/tunings-124M.txt
    load sampled-64-$tag --concurrency 64 --duration 8 --temperature 1 --top-p 0.95 --no-check
    load sampled-256-$tag --concurrency 256 --duration 8 --temperature 1 --top-p 0.95 --no-check
    load greedy-short-256-$tag --concurrency 256 --duration 8 --prompt-tokens 4-6 --no-check
    load greedy-short-64-$tag --concurrency 64 --duration 8 --prompt-tokens 4-6 --no-check
    kill %1; wait
  done
done
echo "t=$(( $(date +%s)-T0 ))s"
for sw in X=1 WASI_NN_HOST_NO_GEMM_TUNING=1 X=1; do
  [ $(( $(date +%s)-T0 )) -gt 500 ] && { echo "out of time before 1558M $sw"; break; }
  tag=1558M-${sw%%=*}
  serve random:1558M 64 $tag $sw
  [ $sw = X=1 ] && tunings /tmp/serve-$tag.log > $OUT/tunings-1558M.txt
  load 1558M-sampled-64-$tag --concurrency 64 --duration 8 --temperature 1 --top-p 0.95 --no-check
  kill %1; wait
done
grep -c "kept lt true" $OUT/tunings-*.txt; grep -c "kept lt false" $OUT/tunings-*.txt; head -80 $OUT/tunings-124M.txt | awk 'NR%3==1' | head -30; awk 'NR%4==1' $OUT/tunings-1558M.txt | head -20
echo "t=$(( $(date +%s)-T0 ))s"

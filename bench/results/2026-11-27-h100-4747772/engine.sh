#!/usr/bin/env bash
# device call (issue 32): the engine alone (no guest, no HTTP) at 64 and 256 greedy streams of
# short prompts; at 1558M the batched-step trace and the parts of the pass left out
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
echo "build: $(cat .device/COMMIT)"
d=/tmp/b; mkdir -p $d
for f in .device/bin/*.xz; do xz -dc "$f" > $d/$(basename "${f%.xz}"); done; chmod +x $d/wasi-nn-host $d/loadgen $d/wasi-nn-bench
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
url=http://127.0.0.1:18125
timeout 150 $d/wasi-nn-bench streams --device cuda --dtype bf16 --model random:124M --streams 64,64,256,256 --prompt 5 --steps 256 2>$OUT/streams.err | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print('engine-only', r['streams'], round(r['tokens_per_s']), 'per-stream decode', round(r['streams']/r['stream_ms_per_token_median']*1e3), 'items', round(r['mean_step_items'],1), 'step_ms', round(r['mean_step_ms'],3))"
echo "t=$(( $(date +%s)-T0 ))s"
summ() { python3 - $1 <<'PY'
import re, sys, statistics as st
rows = []
for line in open(sys.argv[1], errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    if "batched step" not in line: continue
    f = dict(re.findall(r"(\w+)=(\d+)", line))
    if "pass_gpu_us" in f: rows.append({k: int(v) for k, v in f.items()})
rows = rows[len(rows)//3:]
print(f"  steps {len(rows)}; early {sum(1 for r in rows if r.get('early'))}")
for k in ["items", "hit", "batched", "run_ahead", "late", "pass_gpu_us", "gap_gpu_us", "step_us", "resolve_us", "own_launch_us"]:
    v = [r.get(k, 0) for r in rows]
    if v: print(f"  {k:14s} mean {st.mean(v):9.1f} p10 {sorted(v)[len(v)//10]:7d} p50 {st.median(v):8.0f} p90 {sorted(v)[9*len(v)//10]:7d}")
PY
}
load() { local name=$1; shift; timeout 100 $d/loadgen --url $url --max-tokens 128 --prompt-file tests/data/tinyshakespeare.txt "$@" --no-check --label $name --json-out $OUT/traffic.jsonl 2>>$OUT/traffic.err | python3 -c "
import json,sys
r=json.loads(sys.stdin.read()); print('$name', round(r['tokens_per_s']), 'ttft p50/p99', round(r['ttft_ms_p50'],2), round(r['ttft_ms_p99'],2), 'gap p50/p99', round(r['gap_ms_p50'],3), round(r['gap_ms_p99'],3))"; }
for sw in X=1 WASI_NN_HOST_SKIP=gemm WASI_NN_HOST_SKIP=attn WASI_NN_HOST_SKIP=ln,epi,head; do
  [ $(( $(date +%s)-T0 )) -gt 470 ] && { echo "out of time before $sw"; break; }
  s=$(date +%s)
  env NO_COLOR=1 RUST_LOG=wasi_nn_host::cuda::batch=debug $sw $d/wasi-nn-host serve --component $d/gpt2_component.wasm --port 18125 --device cuda --dtype bf16 --graph gpt2=random:1558M --max-instances 320 --warm-contexts 64 2>/tmp/serve-$sw.log &
  for _ in $(seq 1500); do curl -sf $url/health >/dev/null && break; sleep 0.2; done
  echo "start $(( $(date +%s)-s ))s"
  tag=${sw#WASI_NN_HOST_}; tag=${tag//[=,]/-}
  load 1558M-sampled-64-$tag --concurrency 64 --duration 8 --temperature 1 --top-p 0.95
  kill %1; wait
  summ /tmp/serve-$sw.log
  echo "t=$(( $(date +%s)-T0 ))s"
done

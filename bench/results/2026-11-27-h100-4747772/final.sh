#!/usr/bin/env bash
# device call (issue 32): the GPU checks, then every row of BENCHMARKS.md's real-traffic table
# on one build, the right-sized PyTorch peer in the call; the texts against their prompts alone
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
echo "build: $(cat .device/COMMIT)"
d=/tmp/b; mkdir -p $d
for f in .device/bin/*.xz; do xz -dc "$f" > $d/$(basename "${f%.xz}"); done; chmod +x $d/wasi-nn-host $d/loadgen $d/wasi-nn-bench
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
peer() { grep bfloat16 $1 | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print('peer', r.get('size', ''), r['batch'], r['cache'], r['sampler'], r['graph_tok_per_s'], r['graph_ms_per_step'])"; }
timeout 150 python3 bench/torch_gpt2.py graph sizes=124M cache=384 sampler=argmax,top_p > $OUT/peer.jsonl 2>$OUT/peer.err; peer $OUT/peer.jsonl
timeout 100 python3 bench/torch_gpt2.py graph sizes=124M cache=136 sampler=argmax > $OUT/peer-136.jsonl 2>>$OUT/peer.err; peer $OUT/peer-136.jsonl
timeout 200 python3 bench/torch_gpt2.py graph sizes=1558M cache=384 sampler=argmax,top_p > $OUT/peer-1558M.jsonl 2>>$OUT/peer.err; peer $OUT/peer-1558M.jsonl
s=$(date +%s); timeout 130 $d/wasi-nn-bench check-cuda --model models/gpt2-shakespeare --model random:124M --prompt 16 --steps 32 > $OUT/checks.log 2>&1
echo "checks rc=$? $(( $(date +%s)-s ))s $(grep -c '"passed":true' $OUT/checks.log) passed, $(grep -c '"passed":false' $OUT/checks.log) failed"
grep -h '"passed":false' $OUT/checks.log | cut -c1-300 | head
url=http://127.0.0.1:18125
serve() { local model=$1 warm=$2; shift 2; env "$@" $d/wasi-nn-host serve --component $d/gpt2_component.wasm --port 18125 --device cuda --dtype bf16 --graph gpt2=$model --max-instances 320 --warm-contexts $warm 2>>$OUT/serve.log &
  for _ in $(seq 1500); do curl -sf $url/health >/dev/null && break; sleep 0.2; done; }
load() { local name=$1; shift; timeout 150 $d/loadgen --url $url --max-tokens 128 --prompt-file tests/data/tinyshakespeare.txt "$@" --label $name --json-out $OUT/traffic.jsonl 2>>$OUT/traffic.err | python3 -c "
import json,sys
r=json.loads(sys.stdin.read()); print('$name', round(r['tokens_per_s']), 'ttft p50/p99', round(r['ttft_ms_p50'],2), round(r['ttft_ms_p99'],2), 'gap p50/p99', round(r['gap_ms_p50'],3), round(r['gap_ms_p99'],3), r['texts_equal_single_stream'], 'others gap p99', (r.get('other_prompts') or {}).get('gap_ms_p99'))"; }
serve random:124M 256 X=1
load greedy-1 --concurrency 1 --duration 6 --no-check
load sampled-1 --concurrency 1 --duration 6 --temperature 1 --top-p 0.95 --no-check
load greedy-64 --concurrency 64 --duration 10 --no-check
load sampled-64 --concurrency 64 --duration 10 --temperature 1 --top-p 0.95 --no-check
load sampled-256 --concurrency 256 --duration 10 --temperature 1 --top-p 0.95 --no-check
load mixed-64 --concurrency 64 --duration 10 --long-prompts 0.25:800 --no-check
load mixed-sampled-64 --concurrency 64 --duration 10 --long-prompts 0.25:800 --temperature 1 --top-p 0.95 --no-check
load greedy-64-short --concurrency 64 --duration 10 --prompt-tokens 4-6 --no-check
load greedy-256-short --concurrency 256 --duration 10 --prompt-tokens 4-6 --no-check
load greedy-64-check --concurrency 64 --requests 1
kill %1; wait
serve random:124M 256 WASI_NN_HOST_BATCH_INVARIANT=1
load invariant-sampled-check-16 --concurrency 16 --requests 2 --temperature 1 --top-p 0.95
load invariant-mixed-check-16 --concurrency 16 --requests 1 --long-prompts 0.25:800 --temperature 1 --top-p 0.95
kill %1; wait
serve random:1558M 64 X=1
load 1558M-greedy-64 --concurrency 64 --duration 10 --no-check
load 1558M-sampled-64 --concurrency 64 --duration 10 --temperature 1 --top-p 0.95 --no-check
kill %1; wait

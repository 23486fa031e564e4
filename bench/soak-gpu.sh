#!/usr/bin/env bash
# GPU soak of the service (issue 14): 64 concurrent greedy streams, round after round for
# SECONDS seconds, every text checked against its prompt run alone (loadgen does that each
# round); the service's RSS and the GPU's used memory after every round (OUT-memory.jsonl),
# so the curve shows whether anything grows or only settles.
# Usage: bench/soak-gpu.sh DIR [SECONDS] [OUT.jsonl]
#   DIR holds wasi-nn-host, gpt2_component.wasm (pre-initialised) and loadgen.
# Prints one JSON line per round and a summary; exits non-zero if a round failed, a text
# differed, or memory grew by more than 64 MiB (RSS) or 256 MiB (GPU) after the first round.
set -uo pipefail
dir=$1 seconds=${2:-180} out=${3:-soak-gpu.jsonl}
port=18124 url=http://127.0.0.1:18124
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
"$dir/wasi-nn-host" serve --component "$dir/gpt2_component.wasm" --port $port --device cuda \
  --dtype bf16 --max-instances 320 --warm-contexts 64 --graph gpt2=random:124M 2>/tmp/soak-server.log &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 300); do curl -sf "$url/health" >/dev/null && break; sleep 0.2; done
rss() { awk '/VmRSS/ {print $2 * 1024}' /proc/$server/status; }
gpu() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
: > "$out"
memory=${out%.jsonl}-memory.jsonl
: > "$memory"
failed=0 round=0 start=$(date +%s)
while [ $(( $(date +%s) - start )) -lt "$seconds" ]; do
  round=$((round + 1))
  "$dir/loadgen" --url "$url" --concurrency 64 --requests 4 --max-tokens 128 --json-out "$out" \
    --label "soak round $round" >/dev/null 2>/tmp/soak-loadgen.log || failed=1
  tail -1 "$out" | grep -q '"texts_equal_single_stream":"256 of 256"' || failed=1
  if [ $round = 1 ]; then rss0=$(rss); gpu0=$(gpu); fi
  echo "{\"round\":$round,\"seconds\":$(( $(date +%s) - start )),\"rss_bytes\":$(rss),\"gpu_mib\":$(gpu)}" >> "$memory"
done
rss1=$(rss) gpu1=$(gpu)
requests=$(python3 -c "import json; print(sum(json.loads(l)['requests'] for l in open('$out')))")
grown=$(( rss1 - rss0 > 64 * 1048576 || gpu1 - gpu0 > 256 ))
[ $grown = 0 ] || failed=1
echo "{\"what\":\"soak-gpu\",\"seconds\":$(( $(date +%s) - start )),\"rounds\":$round,\"requests\":$requests,\"rss_bytes_after_round_1\":$rss0,\"rss_bytes_at_end\":$rss1,\"gpu_mib_after_round_1\":$gpu0,\"gpu_mib_at_end\":$gpu1,\"failed\":$failed}"
exit $failed

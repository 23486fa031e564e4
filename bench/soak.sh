#!/usr/bin/env bash
# Soak of the service (issue 14): concurrent greedy streams, round after round for SECONDS
# seconds, every text checked against its prompt run alone (loadgen does that each round); the
# service's RSS, its heaps (/metrics: jemalloc for the Rust side, glibc's malloc for C libraries)
# and on the GPU its used memory after every round (OUT-memory.jsonl), so the curve shows
# whether anything grows or only settles, and where.
# Usage: bench/soak.sh DIR [SECONDS] [OUT.jsonl] [cuda|cpu]
#   DIR holds wasi-nn-host, gpt2_component.wasm (pre-initialised) and loadgen. cuda: 124M
#   bf16 random weights, 64 streams of 128 tokens; cpu: the embedded model, 16 streams of 16.
#   OUT.jsonl (or "") defaults to soak-DEVICE.jsonl in a new results folder,
#   bench/results/<date>-<gpu>-<commit>/, with the summary line (soak-DEVICE-summary.json)
#   and a manifest.json (bench/manifest.sh).
# Prints one JSON line per round and a summary; exits non-zero if a round failed, a text
# differed, or memory grew after the first third of the rounds by more than 32 MiB (RSS) or
# 256 MiB (GPU).
set -uo pipefail
command="bench/soak.sh${*:+$(printf ' %q' "$@")}"
dir=$1 seconds=${2:-180} out=${3:-} device=${4:-cuda}
port=18124 url=http://127.0.0.1:18124
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
case $device in
  cuda) serve=(--device cuda --dtype bf16 --max-instances 320 --warm-contexts 64 --graph gpt2=random:124M)
        load=(--concurrency 64 --requests 4 --max-tokens 128) ;;
  cpu) serve=(--device cpu) load=(--concurrency 16 --requests 4 --max-tokens 16) ;;
  *) echo "device: cuda or cpu" >&2; exit 2 ;;
esac
run=""
if [ -z "$out" ]; then
  . "$(dirname "$0")/manifest.sh"
  bench_run_dir "$device" || exit 2
  run=$bench_dir
  out=$run/soak-$device.jsonl
fi
"$dir/wasi-nn-host" serve --component "$dir/gpt2_component.wasm" --port $port "${serve[@]}" \
  2>/tmp/soak-server.log &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 300); do curl -sf "$url/health" >/dev/null && break; sleep 0.2; done
rss() { awk '/VmRSS/ {print $2 * 1024}' /proc/$server/status; }
# the heaps as /metrics reports them: jemalloc (the Rust side) and glibc's malloc (C libraries)
heap() {
  curl -sf "$url/metrics" | awk '/^wasi_nn_heap_bytes\{allocator="jemalloc"\}/ {j = $2}
    /^wasi_nn_heap_bytes\{allocator="libc"\}/ {l = $2}
    END {printf "\"heap_jemalloc_bytes\":%d,\"heap_libc_bytes\":%d", j, l}'
}
gpu() {
  if [ "$device" = cuda ]; then nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1
  else echo 0; fi
}
: > "$out"
memory=${out%.jsonl}-memory.jsonl
: > "$memory"
failed=0 round=0 start=$(date +%s)
while [ $(( $(date +%s) - start )) -lt "$seconds" ]; do
  round=$((round + 1))
  "$dir/loadgen" --url "$url" "${load[@]}" --json-out "$out" --label "soak round $round" \
    >/dev/null 2>/tmp/soak-loadgen.log || failed=1
  tail -1 "$out" | grep -q '"texts_equal_single_stream":"\([0-9]*\) of \1"' || failed=1
  echo "{\"round\":$round,\"seconds\":$(( $(date +%s) - start )),\"rss_bytes\":$(rss),\"gpu_mib\":$(gpu),$(heap)}" >> "$memory"
done
# memory after the first third of the rounds (warm-up, the allocator settling) and at the end
third=$(( (round + 2) / 3 ))
read -r rss0 gpu0 < <(python3 -c "import json; r=[json.loads(l) for l in open('$memory')][$third-1]; print(r['rss_bytes'], r['gpu_mib'])")
rss1=$(rss) gpu1=$(gpu)
requests=$(python3 -c "import json; print(sum(json.loads(l)['requests'] for l in open('$out')))")
grown=$(( rss1 - rss0 > 32 * 1048576 || gpu1 - gpu0 > 256 ))
[ $grown = 0 ] || failed=1
summary="{\"what\":\"soak\",\"device\":\"$device\",\"seconds\":$(( $(date +%s) - start )),\"rounds\":$round,\"requests\":$requests,\"rss_bytes_after_round_$third\":$rss0,\"rss_bytes_at_end\":$rss1,\"gpu_mib_after_round_$third\":$gpu0,\"gpu_mib_at_end\":$gpu1,\"failed\":$failed}"
if [ -n "$run" ]; then
  echo "$summary" > "${out%.jsonl}-summary.json"
  bench_record "$run" "$command" "" "$out" "$memory" "${out%.jsonl}-summary.json"
fi
echo "$summary"
exit $failed

#!/usr/bin/env bash
# What the host costs a token without a forward pass: the service on the null backend
# (`--graph gpt2=null:124M`, every step answered at once) under loadgen, 128-token completions
# of 4-6-token prompts, greedy and sampled, at several concurrencies; the service's CPU a
# token from /proc (user + system). Everything but the device's work is there: the guests,
# the wasi-nn calls, the batcher, HTTP; the GPU backend's own host work (its run-ahead, its
# waits for the GPU) is not.
#   bash bench/host-cost.sh DIR|local [OUT.jsonl] [LEVELS]   (default LEVELS "16 64 256")
# Each JSON line is loadgen's, with `service_us_per_token` added.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/service.sh"
bench_binaries "$1"
out=${2:-/dev/null}
levels=${3:-16 64 256}
port=${PORT:-18203}
bench_serve "$port" --graph gpt2=null:124M --max-instances 320
trap 'kill $server 2>/dev/null' EXIT
ticks() { awk '{print $14 + $15}' "/proc/$server/stat"; }
hz=$(getconf CLK_TCK)
for sampler in greedy sampled; do
  args=()
  [ "$sampler" = sampled ] && args=(--temperature 1 --top-p 0.95)
  for c in $levels; do
    # a short warm-up: the guests' first instances, the connections
    "$loadgen" --url "$url" --concurrency "$c" --duration 2 --max-tokens 128 \
      --prompt-tokens 4-6 --no-check "${args[@]}" >/dev/null 2>&1
    before=$(ticks)
    line=$("$loadgen" --url "$url" --concurrency "$c" --duration 6 --max-tokens 128 \
      --prompt-tokens 4-6 --no-check "${args[@]}" --label "null-$sampler-$c" 2>/dev/null)
    after=$(ticks)
    echo "$line" | python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
r['service_us_per_token'] = ($after - $before) * 1e6 / $hz / r['tokens']
print(json.dumps(r))
print('$sampler', $c, 'streams:', round(r['tokens_per_s']), 'tokens/s,',
      round(r['service_us_per_token'], 1), 'us of the service a token', file=sys.stderr)" >> "$out"
  done
done

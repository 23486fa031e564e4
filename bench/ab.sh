#!/usr/bin/env bash
# Two builds of the host on one GPU, alternating, to tell a change from the noise of the
# machine: one stream's decode through gpt2.wasm, and the service at 1, 64 and 256 streams
# (sustained load, 128-token completions). Each round runs both builds, the second round in
# the other order; the first round also checks every concurrent text against its prompt alone.
#   bench/ab.sh A_DIR B_DIR GUESTS_DIR [ROUNDS] [OUT.jsonl]
# A_DIR and B_DIR hold a wasi-nn-host each (e.g. the build before a change and after it);
# GUESTS_DIR holds gpt2.wasm, the pre-initialised gpt2_component.wasm and loadgen. Prints a JSON
# line per measurement ({"what": "ab", "build": "A"|"B", ...}) and, last, the medians by build
# and workload with B / A.
set -uo pipefail
a=$1 b=$2 guests=$3 rounds=${4:-3} out=${5:-/dev/null}
model=${AB_MODEL:-random:124M}
port=18124
url=http://127.0.0.1:$port
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
: >"$out"
emit() { echo "$1" | tee -a "$out"; }

# one stream through gpt2.wasm: 256 greedy tokens, the guest's own ms a token
single() {
  local build=$1 dir=$2 round=$3
  "$dir/wasi-nn-host" run "$guests/gpt2.wasm" --device cuda --dtype bf16 --graph "gpt2=$model" \
    -- --json --max-tokens 256 "The" | tail -1 | python3 -c "
import json, sys
t = json.load(sys.stdin)['timings']
print(json.dumps({'what': 'ab', 'build': '$build', 'round': $round, 'workload': 'single-stream',
                  'ms_per_token': t['ms_per_token']}))"
}

# the service under sustained load at 1, 64 and 256 streams
service() {
  local build=$1 dir=$2 round=$3 check=()
  [ "$round" -gt 1 ] && check=(--no-check)
  "$dir/wasi-nn-host" serve --component "$guests/gpt2_component.wasm" --port $port \
    --device cuda --dtype bf16 --graph "gpt2=$model" --max-instances 320 --warm-contexts 256 \
    2>"/tmp/ab-server-$build.log" &
  local server=$!
  for _ in $(seq 600); do
    curl -sf "$url/health" >/dev/null && break
    kill -0 $server 2>/dev/null || break
    sleep 0.2
  done
  for streams in 1 64 256; do
    local load=(--duration 6)
    [ "$streams" = 1 ] && load=(--requests 8)
    "$guests/loadgen" --url "$url" --concurrency $streams "${load[@]}" --max-tokens 128 \
      "${check[@]}" --label "$build" | tail -1 | python3 -c "
import json, sys
r = json.load(sys.stdin)
r.update({'what': 'ab', 'build': '$build', 'round': $round, 'workload': 'service-$streams'})
print(json.dumps(r))" || echo "{\"what\": \"ab\", \"build\": \"$build\", \"workload\": \"service-$streams\", \"failed\": true}"
  done
  kill $server 2>/dev/null
  wait $server 2>/dev/null
}

for round in $(seq "$rounds"); do
  order="A B"
  [ $((round % 2)) = 0 ] && order="B A"
  for build in $order; do
    dir=$a
    [ "$build" = B ] && dir=$b
    emit "$(single $build "$dir" "$round")"
    while read -r line; do emit "$line"; done < <(service $build "$dir" "$round")
  done
done

python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    if r.get('failed'):
        print('FAILED', r)
        continue
    value = r.get('ms_per_token', r.get('tokens_per_s'))
    by.setdefault((r['workload'], r['build']), []).append(value)
for workload in ['single-stream', 'service-1', 'service-64', 'service-256']:
    a, b = by.get((workload, 'A'), []), by.get((workload, 'B'), [])
    if a and b:
        ma, mb = statistics.median(a), statistics.median(b)
        unit = 'ms/token' if workload == 'single-stream' else 'tokens/s'
        print(f'{workload:14} A {ma:10.3f}  B {mb:10.3f} {unit:9}  B/A {mb / ma:.3f}  '
              f'(A {min(a):.3f}-{max(a):.3f}, B {min(b):.3f}-{max(b):.3f})')
checked = [r for r in rows if r.get('texts_equal_single_stream')]
for r in checked:
    print('texts equal to alone', r['build'], r['workload'], r['texts_equal_single_stream'])
EOF

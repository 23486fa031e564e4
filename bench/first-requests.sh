#!/usr/bin/env bash
# The first requests after start (a lone prompt's prefill, its cuBLASLt plans and captured
# graphs), on the GPU machine:
#   bash bench/first-requests.sh [BIN_DIR [SERVERS]]   (default .device/bin, 2 fresh servers)
# Each server: the seconds from start until it answers (the first on a machine also compiles
# the kernels, cached on disk after: 23.6 s against 2.3-2.9 on an H200), then eight
# one-token greedy completions one after the other, of prompts cut from TinyShakespeare at
# lengths 900, 700, 1000, 900, 450, 1300, 700 and 1600 characters (the 4th and 7th repeat a
# length: its graph is captured then), each with its seconds to the first byte and in all,
# then the batched step's own launch of each (us, from the step trace: the prefill's launch
# on its session's stream).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-lib.sh
describe
unpack "${1:-.device/bin}" /tmp/first-requests-bin
CUTS=(900 700 1000 900 450 1300 700 1600)
for cut in "${CUTS[@]}"; do
  python3 - "$cut" > "/tmp/first-request-$cut.json" <<'PY'
import json, sys
text = open("tests/data/tinyshakespeare.txt").read()[:int(sys.argv[1])]
print(json.dumps({"prompt": text, "max_tokens": 1, "temperature": 0, "stream": True}))
PY
done
for server in $(seq "${2:-2}"); do
  : > "$OUT/serve.log"
  started=$(date +%s.%N)
  serve random:124M 256 RUST_LOG=wasi_nn_host::cuda::batch=debug NO_COLOR=1 || exit 1
  echo "server $server answered after $(python3 -c "print(round($(date +%s.%N) - $started, 2))") s"
  echo "prompt chars, seconds to the first byte and in all"
  for cut in "${CUTS[@]}"; do
    echo "$cut $(curl -s -o /dev/null -w '%{time_starttransfer} %{time_total}' "$URL/v1/completions" \
      -H 'content-type: application/json' -d "@/tmp/first-request-$cut.json")"
  done
  stop
  echo "own_launch_us $(grep -o 'items=1 .*own_launch_us=[0-9]*' "$OUT/serve.log" | grep -o 'own_launch_us=[0-9]*' \
    | cut -d= -f2 | tr '\n' ' ')"
done
rm -f "$OUT/serve.log"
echo "end $(date +%T)"

#!/usr/bin/env bash
# Helpers for scripts run on the GPU machine over a copy of the tree (the device tool), sourced:
#   source bench/device-lib.sh
#   unpack .device/bin /tmp/b          # binaries built elsewhere, xz-compressed or not
#   step WASI_NN_HOST_X=1 -- --dtype bf16 --model random:124M --context 128
#   read -r -a NEW <<< "$(kernel_arm new .device/kernels-new)"; checks new "${NEW[@]}"
#   serve random:124M 256 WASI_NN_HOST_X=1; load sampled-64 --concurrency 64 ...; stop
#   alternate 2 loads new "old BIN=/tmp/old"    # an A/B, a fresh server each arm and round
#   peer sizes=124M cache=384 sampler=top_p     # PyTorch's captured step, the same call
#   kernel_times 124M-64 3000 600 '^batch_' -- "$BIN/wasi-nn-bench" streams --device cuda ...
#   service_kernels sampled-64 random:124M 256 -- --concurrency 64 --duration 60 --no-check
#   memory_efficiency qkv 2300 '^batch_gemm_bf16_n64$' -- "$BIN/wasi-nn-bench" streams ...
# Each prints one line a measurement; what it ran comes first, so a log reads on its own.

export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${OUT:=/tmp/out}"
mkdir -p "$OUT"

# The GPU and its driver, and the build (`.device/COMMIT` where the caller wrote one).
describe() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "cpu: $(nproc) x $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
  [ -f .device/COMMIT ] && echo "build: $(cat .device/COMMIT)"
  return 0
}

# Copy the binaries of folder $1 into folder $2, decompressing `.xz` ones; BIN is then $2.
unpack() {
  local from=$1 to=$2 f
  mkdir -p "$to"
  for f in "$from"/*; do
    case "$f" in
      *.xz) xz -dc "$f" > "$to/$(basename "${f%.xz}")" ;;
      *) cp "$f" "$to/" ;;
    esac
  done
  chmod +x "$to"/* 2>/dev/null
  BIN=$to
}

# One `wasi-nn-bench bench` run: NAME=VALUE switches, `--`, then bench's arguments (after
# `--device cuda --steps ${STEPS:-40}`). Prints the switches, the arguments, the graph step
# and the greedy backend step in ms, and the persistent kernel's phases where traced (each
# kind: stage / products / epilogue / until the last block / the counter's wait, us).
step() {
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  local line
  line=$(env "${envs[@]}" timeout "${STEP_TIMEOUT:-100}" "$BIN/wasi-nn-bench" bench --device cuda \
    --steps "${STEPS:-40}" "$@" 2>&1 | python3 -c "
import json, sys
text = sys.stdin.read()
try:
    r = json.loads(text.strip().splitlines()[-1])
except (ValueError, IndexError):
    print('failed:', (text.strip().splitlines() or [''])[0][:300]); sys.exit()
p = r.get('persistent_phases')
phases = ''
if p:
    parts = ['stage_us', 'products_us', 'epilogue_us', 'last_block_us', 'counter_wait_us']
    phases = ' '.join(k + '=' + '/'.join(f'{v[part]:.1f}' for part in parts)
                      for k, v in p['mean_per_phase'].items()) + f\" total={p['total_us']:.0f}\"
print(r['graph_ms_per_token'], r['backend_greedy_ms_per_token'], phases)")
  echo "${envs[*]} $*: $line"
}

# The GPU checks (`check-cuda` with the models named, 16-token prompts, 32 steps), into
# $OUT/checks-$1.log, NAME=VALUE switches after the name set for them and check-cuda's own
# arguments after `--`; prints the count passed and failed and the failures' first lines.
#   checks new "${NEW[@]}"          (NEW an arm of `kernel_arm`)
checks() {
  local name=$1 s rc envs=()
  shift
  while [ $# -gt 0 ] && [[ $1 == [A-Z]*=* ]]; do envs+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  s=$(date +%s)
  env "${envs[@]}" timeout "${CHECK_TIMEOUT:-200}" "$BIN/wasi-nn-bench" check-cuda \
    --model models/gpt2-shakespeare --model random:124M --prompt 16 --steps 32 "$@" > "$OUT/checks-$name.log" 2>&1
  rc=$?
  echo "checks $name rc=$rc $(( $(date +%s) - s ))s $(grep -c '"passed":true' "$OUT/checks-$name.log") passed," \
    "$(grep -c '"passed":false' "$OUT/checks-$name.log") failed"
  grep -h '"passed":false' "$OUT/checks-$name.log" | cut -c1-300 | head
}

# One arm of a kernels' A/B, as NAME=VALUE switches: the host compiles the `.cu` files of
# folder $2 instead of its own, into a cache of the arm's own (/tmp/kc-$1), so that both arms
# pay the folder's path alike:
#   read -r -a NEW <<< "$(kernel_arm new .device/kernels-new)"
#   checks new "${NEW[@]}"; alternate 2 loads "new ${NEW[*]}" "old ${OLD[*]}"
kernel_arm() {
  echo "WASI_NN_HOST_KERNELS=$(cd "$2" && pwd) WASI_NN_HOST_CACHE=/tmp/kc-$1"
}

# The service's command line, model $1 with $2 warm contexts on port ${PORT:-18125} (DEVICE,
# default cuda, and DTYPE, default bf16, choose the backend), into SERVER_COMMAND; URL its
# address.
server_command() {
  URL=http://127.0.0.1:${PORT:-18125}
  SERVER_COMMAND=("$BIN/wasi-nn-host" serve --component "$BIN/gpt2_component.wasm" --port "${PORT:-18125}"
    --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}" --graph "gpt2=$1" --max-instances 320 --warm-contexts "$2")
}
# Whether the service at URL answers within $1 tries, 0.2 s apart.
answers() {
  for _ in $(seq "$1"); do curl -sf "$URL/health" >/dev/null && return 0; sleep 0.2; done
  return 1
}

# The service on port ${PORT:-18125} with model $1 (random:SIZE or a path) and $2 warm
# contexts, the switches after them set; waits until it answers. `stop` ends it.
serve() {
  server_command "$1" "$2"
  shift 2
  env "$@" "${SERVER_COMMAND[@]}" 2>>"$OUT/serve.log" &
  SERVER=$!
  answers 1500 && return 0
  echo "the service did not answer"
  return 1
}
stop() {
  kill "$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  return 0
}

# Arms of an A/B on one machine, alternating for ROUNDS rounds, each arm a fresh server of
# MODEL (default random:124M, 256 warm contexts) running the caller's function LOADS with the
# arm's name and the round (its `load` labels should carry both):
#   loads() { load "$1-sampled64-$2" --concurrency 64 --duration 6 --no-check; }
#   alternate 2 loads new "old BIN=/tmp/old" "db WASI_NN_HOST_KERNELS=$PWD/k-db"
# An arm is its name, then NAME=VALUE switches for its server; BIN=DIR serves the binaries of
# DIR instead of $BIN.
alternate() {
  local rounds=$1 loads=$2 round arm name words bin
  shift 2
  for round in $(seq "$rounds"); do
    for arm in "$@"; do
      read -r -a words <<< "$arm"
      name=${words[0]} bin=$BIN
      local envs=()
      for w in "${words[@]:1}"; do
        case $w in
          BIN=*) bin=${w#BIN=} ;;
          *) envs+=("$w") ;;
        esac
      done
      BIN=$bin serve "${MODEL:-random:124M}" "${WARM:-256}" "${envs[@]}" || continue
      BIN=$bin "$loads" "$name" "$round"
      stop
    done
  done
}

# One loadgen run against the service, labelled $1, loadgen's arguments after it (128 tokens,
# prompts cut from TinyShakespeare); its JSON line into $OUT/traffic.jsonl, a summary printed.
load() {
  local name=$1
  shift
  timeout "${LOAD_TIMEOUT:-150}" "$BIN/loadgen" --url "$URL" --max-tokens 128 \
    --prompt-file tests/data/tinyshakespeare.txt "$@" --label "$name" \
    --json-out "$OUT/traffic.jsonl" 2>>"$OUT/traffic.err" | python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
others = (r.get('other_prompts') or {}).get('gap_ms_p99')
later = r.get('after_first_wave') or {}
print('$name', round(r['tokens_per_s']), 'ttft p50/p99', round(r['ttft_ms_p50'], 2), round(r['ttft_ms_p99'], 2),
      'gap p50/p99', round(r['gap_ms_p50'], 3), round(r['gap_ms_p99'], 3), r['texts_equal_single_stream'],
      'others gap p99', others, 'after the first wave ttft p50/p99', later.get('ttft_ms_p50'), later.get('ttft_ms_p99'))"
}

# PyTorch's step (`bench/torch_gpt2.py graph` with the arguments given), its lines added to
# $OUT/peer.jsonl (one file for every peer run: the device tool brings back 8 files at most),
# a line each printed.
peer() {
  timeout "${PEER_TIMEOUT:-200}" python3 bench/torch_gpt2.py graph "$@" 2>>"$OUT/peer.err" \
    | tee -a "$OUT/peer.jsonl" | grep bfloat16 | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('peer', r.get('size', ''), 'batch', r['batch'], 'cache', r['cache'], r['sampler'],
          round(r['graph_tok_per_s']), 'tokens/s', r['graph_ms_per_step'], 'ms a step')"
}

# The batched steps' trace in a service log (the server run with
# RUST_LOG=wasi_nn_host::cuda::batch=debug): the steps past the first third, and for each of
# their fields (contexts, rows run ahead, late rows, the pass's GPU time, the GPU's idle time
# before it, the step's own time) the mean, p10, p50 and p90.
#   step_trace "$OUT/serve.log"
step_trace() {
  python3 - "$1" <<'PY'
import re, sys, statistics as st
rows = []
for line in open(sys.argv[1], errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    if "batched step" not in line or "pass_gpu_us" not in line:
        continue
    rows.append({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)})
rows = rows[len(rows) // 3:]
print(f"  steps {len(rows)}")
for k in ["items", "run_ahead", "late", "pass_gpu_us", "gap_gpu_us", "step_us"]:
    v = sorted(r.get(k, 0) for r in rows)
    if v:
        print(f"  {k:12s} mean {st.mean(v):9.1f} p10 {v[len(v) // 10]:7d} p50 {v[len(v) // 2]:7d} p90 {v[9 * len(v) // 10]:7d}")
PY
}

# Every kernel's time at the GPU's own clocks (ncu, `--clock-control none`) over a command:
#   kernel_times NAME SKIP COUNT REGEX -- COMMAND...
# the launches matching REGEX after the first SKIP, COUNT of them, into $OUT/ncu-NAME.csv.xz;
# prints each kernel and grid's launches, mean time and share, largest share first.
kernel_times() {
  local name=$1 skip=$2 count=$3 regex=$4
  shift 4
  [ "${1:-}" = -- ] && shift
  timeout "${NCU_TIMEOUT:-300}" /usr/local/cuda/bin/ncu --clock-control none --kernel-name "regex:$regex" \
    --launch-skip "$skip" --launch-count "$count" --metrics gpu__time_duration.sum --csv "$@" \
    > "$OUT/ncu-$name.csv" 2>>"$OUT/ncu.err"
  python3 "$BENCH_DIR/pass-kernels.py" --by-grid "$OUT/ncu-$name.csv"
  xz -f -T0 "$OUT/ncu-$name.csv"
}

# Every kernel's time in the service itself (ncu, `--clock-control none`; ncu serialises the
# kernels, so passes grow and run longer while it measures): the server of model $2 with $3
# warm contexts (`server_command`; its port must be free) under ncu,
# the launches after the first ${SKIP:-6000}, ${COUNT:-2500} of them, while `load` (labelled
# $1, loadgen's arguments after `--`) runs; the CSV into $OUT/ncu-svc-$1.csv.xz and
# bench/pass-kernels.py's summary (each kernel, then the passes by rows) printed and kept.
#   service_kernels 1558M-sampled-64 random:1558M 0 -- --concurrency 64 --duration 30 ...
service_kernels() {
  local name=$1 model=$2 warm=$3 ncu pid
  shift 3
  [ "${1:-}" = -- ] && shift
  server_command "$model" "$warm"
  if answers 1; then
    echo "a service already answers at $URL"
    return 1
  fi
  timeout "${NCU_TIMEOUT:-200}" "${NCU:-/usr/local/cuda/bin/ncu}" --clock-control none --launch-skip "${SKIP:-6000}" \
    --launch-count "${COUNT:-2500}" --metrics gpu__time_duration.sum --csv "${SERVER_COMMAND[@]}" \
    > "$OUT/ncu-svc-$name.csv" 2>> "$OUT/ncu-svc.err" &
  ncu=$!
  if answers 600; then
    load "ncu-$name" "$@"
  else
    echo "the service under ncu did not answer"
  fi
  # end the server on this port (ncu's child), not ncu, so that ncu writes its report
  for pid in $(pgrep -x wasi-nn-host); do
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- "--port ${PORT:-18125} " && kill -TERM "$pid"
  done
  wait "$ncu"
  python3 "$BENCH_DIR/pass-kernels.py" "$OUT/ncu-svc-$name.csv" | tee "$OUT/ncu-svc-summary-$name.txt"
  xz -f -T0 "$OUT/ncu-svc-$name.csv"
}

# How one launch of a kernel uses memory, instruction by instruction (ncu's SourceCounters and
# its source page, SASS): the launch of the kernels matching REGEX after the first SKIP of
# them, over a command; the page into $OUT/source-NAME.csv.xz and bench/memory-efficiency.py's
# summary (each memory instruction's L2 sectors and shared-memory wavefronts against ncu's
# ideal) printed:
#   memory_efficiency qkv 2300 '^batch_gemm_bf16_n64$' -- "$BIN/wasi-nn-bench" streams ...
memory_efficiency() {
  local name=$1 skip=$2 regex=$3 ncu=${NCU:-/usr/local/cuda/bin/ncu}
  shift 3
  [ "${1:-}" = -- ] && shift
  timeout "${NCU_TIMEOUT:-150}" "$ncu" --section SourceCounters --kernel-name "regex:$regex" \
    --launch-skip "$skip" --launch-count 1 -o "/tmp/source-$name" -f "$@" > /dev/null 2>> "$OUT/ncu.err"
  "$ncu" -i "/tmp/source-$name.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/source-$name.csv" 2>> "$OUT/ncu.err"
  echo "memory $name: $(python3 "$BENCH_DIR/memory-efficiency.py" "$OUT/source-$name.csv")"
  xz -f -T0 "$OUT/source-$name.csv"
}

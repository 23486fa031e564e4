#!/usr/bin/env bash
# Replicas of `wasi-nn-host serve` behind HAProxy (least connections, health checks on
# /health), on loopback, driven by loadgen; the plumbing of docs/deploy.md tested and measured.
#
# Usage: bench/scale-out.sh DIR DEVICES [PHASE...]
#   DIR      holds wasi-nn-host, loadgen and gpt2_component.wasm (pre-initialised)
#   DEVICES  one replica per entry, as --device takes it: cpu,cpu or cuda:0,cuda:1
#   PHASE    any of (default: equal kill drain)
#     equal       every text through the balancer equals its prompt run alone, and every
#                 replica served some of them
#     kill        one replica is killed (SIGKILL) while it streams: its clients get an error
#                 within seconds (no hang), the requests after it succeed through the others,
#                 and the survivors end with no guest running, nothing queued, no KV held
#     drain       one replica gets SIGTERM while it streams: it fails its health checks while
#                 it still accepts (--shutdown-delay), then stops accepting; not one request
#                 fails, and it exits within its delay and --shutdown-grace
#     throughput  timed loads (LOAD_ARGS, no check) of S streams a replica for each S in
#                 STREAMS (default 8): the JSON lines only, for measurements
# Environment:
#   SERVE_ARGS  more flags for every replica (e.g. --dtype bf16 --graph gpt2=random:124M)
#   LOAD_ARGS   loadgen's load (default: 8 streams of 16-token completions, 3 each; the kill
#               and drain phases run it for PHASE_SECONDS instead, default 8)
#   OUT         where the JSON lines go (default: a temporary file, printed at the end)
#   PORT        the balancer's port (default 18200; replicas on the ports after it)
# Exits non-zero when a phase's check fails. Each phase is bounded (loadgen's timeouts, a
# deadline on every wait).
set -uo pipefail
dir=$1 devices=$2
shift 2
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(equal kill drain)
IFS=, read -r -a device <<<"$devices"
n=${#device[@]}
for phase in "${phases[@]}"; do
  case $phase in kill|drain) [ "$n" -ge 2 ] ||
    { echo "scale-out: $phase needs two replicas or more (DEVICES: a,b)" >&2; exit 2; } ;; esac
done
command -v haproxy >/dev/null || { echo "scale-out: haproxy is not installed" >&2; exit 2; }
serve_args=(${SERVE_ARGS:-})
load_args=(${LOAD_ARGS:---concurrency 8 --requests 3 --max-tokens 16})
port=${PORT:-18200}
delay=2 grace=20
work=$(mktemp -d)
out=${OUT:-$work/scale-out.jsonl}
: >>"$out"
pids=() haproxy_pid=""
failed=0

cleanup() {
  for pid in "${pids[@]}" $haproxy_pid; do kill -9 "$pid" 2>/dev/null; done
  wait 2>/dev/null
  [ -z "${OUT:-}" ] && cp "$out" "$work.jsonl" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

check() {  # check CONDITION-TEXT OK(0/1)
  if [ "$2" = 0 ]; then echo "  ok: $1"; else echo "  FAILED: $1"; failed=1; fi
}

replica_port() { echo $((port + 1 + $1)); }

start_replica() {  # start_replica I
  local i=$1 p
  p=$(replica_port "$i")
  "$dir/wasi-nn-host" serve --component "$dir/gpt2_component.wasm" --port "$p" \
    --device "${device[$i]}" --shutdown-delay $delay --shutdown-grace $grace "${serve_args[@]}" 2>>"$work/replica-$i.log" &
  pids[$i]=$!
}

wait_healthy() {  # wait_healthy URL SECONDS
  local deadline=$(( $(date +%s) + $2 ))
  until curl -sf "$1/health" >/dev/null; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

field() {  # field I NAME: a number from replica I's /health
  curl -sf --max-time 2 "http://127.0.0.1:$(replica_port "$1")/health" |
    python3 -c "import json,sys; print(json.load(sys.stdin)['$2'])" 2>/dev/null || echo -1
}

metric() {  # metric I NAME: a gauge from replica I's /metrics
  curl -sf --max-time 2 "http://127.0.0.1:$(replica_port "$1")/metrics" |
    awk -v m="$2" '$1 == m {print $2; found = 1} END {if (!found) print -1}'
}

wait_streaming() {  # wait_streaming I COUNT SECONDS: until replica I runs COUNT guests
  local deadline=$(( $(date +%s) + $3 ))
  until [ "$(field "$1" active)" -ge "$2" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.05
  done
}

# Least connections suits long streams of unequal length; a server is out after two failed
# checks 500 ms apart and back after two good ones. A request whose connection fails (a
# replica gone, or draining and no longer accepting) is sent again to another server; a
# stream already under way is not (its client gets the error). Without http-no-delay HAProxy
# holds a stream's small chunks back to send them together (seen: tokens arriving in bursts
# ~25 ms apart, first tokens 30-90 ms later than from the replica itself).
write_haproxy() {
  {
    cat <<EOF
global
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response
    option http-buffer-request
    option http-no-delay
frontend completions
    bind 127.0.0.1:$port
    default_backend replicas
backend replicas
    balance leastconn
    option httpchk GET /health
    http-check expect status 200
    default-server inter 500ms fall 2 rise 2
EOF
    for i in "${!device[@]}"; do
      echo "    server replica$i 127.0.0.1:$(replica_port "$i") check"
    done
  } >"$work/haproxy.cfg"
}

load() {  # load LABEL [LOADGEN ARGS...]: one loadgen run through the balancer
  local label=$1
  shift
  timeout 600 "$dir/loadgen" --url "http://127.0.0.1:$port" "${load_args[@]}" --label "$label" \
    --json-out "$out" "$@" >"$work/$label.json" 2>"$work/$label.err"
}

report() {  # report LABEL FIELD...: fields of a load's JSON line
  python3 - "$work/$1.json" "${@:2}" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read() or "{}")
print(" ".join(str(r.get(k)) for k in sys.argv[2:]))
PY
}

for i in "${!device[@]}"; do start_replica "$i"; done
for i in "${!device[@]}"; do
  wait_healthy "http://127.0.0.1:$(replica_port "$i")" 300 ||
    { echo "replica $i did not start"; cat "$work/replica-$i.log"; exit 1; }
done
write_haproxy
haproxy -f "$work/haproxy.cfg" -db >"$work/haproxy.log" 2>&1 &
haproxy_pid=$!
wait_healthy "http://127.0.0.1:$port" 30 || { echo "haproxy did not start"; cat "$work/haproxy.log"; exit 1; }
sleep 1.5  # two good checks of every server
echo "scale-out: $n replicas (${devices}) behind haproxy on 127.0.0.1:$port"

for phase in "${phases[@]}"; do
  echo "phase $phase"
  case $phase in
    equal)
      before=()
      for i in "${!device[@]}"; do before[$i]=$(field "$i" served); done
      load equal
      status=$?
      read -r tps equal < <(report equal tokens_per_s texts_equal_single_stream)
      check "loadgen passed, texts equal to their prompts alone: $equal ($tps tokens/s)" $status
      for i in "${!device[@]}"; do
        served=$(( $(field "$i" served) - before[i] ))
        check "replica $i (${device[$i]}) served $served requests" $(( served <= 0 ))
      done
      ;;
    kill)
      victim=0
      survivors=()
      for i in "${!device[@]}"; do [ "$i" = $victim ] || survivors+=("$i"); done
      load kill --duration "${PHASE_SECONDS:-8}" --keep-going --request-timeout 60 &
      loadgen=$!
      # the concurrent phase has begun once the victim streams several at once (the
      # reference phase runs one stream at a time)
      wait_streaming $victim 2 120
      check "replica $victim streams before the kill" $?
      kill -9 "${pids[$victim]}"
      wait "${pids[$victim]}" 2>/dev/null
      unset "pids[$victim]"
      wait $loadgen
      status=$?
      read -r done lost slowest after equal < <(report kill requests failed slowest_failure_s succeeded_after_last_failure texts_equal_single_stream)
      check "loadgen ended (status $status): $done requests done, texts equal: $equal" $status
      check "the killed replica's streams failed: $lost" $(( lost < 1 ))
      check "each failed within ${slowest}s (no hang: < 10 s)" "$(python3 -c "print(int(not $slowest < 10))")"
      check "requests sent after the last failure succeeded: $after" $(( after < 1 ))
      sleep 1
      for i in "${survivors[@]}"; do
        active=$(field "$i" active) queued=$(field "$i" queued)
        kv=$(metric "$i" wasi_nn_kv_cache_usage_ratio)
        check "survivor $i: $active guests running, $queued queued, KV share $kv" \
          "$(python3 -c "print(int(not ($active == 0 and $queued == 0 and $kv == 0)))")"
      done
      curl -sf --max-time 60 "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
        -d '{"prompt":"ROMEO:","max_tokens":4,"temperature":0}' >/dev/null
      check "a request through the balancer after the kill" $?
      start_replica $victim
      wait_healthy "http://127.0.0.1:$(replica_port $victim)" 300
      check "replica $victim restarted" $?
      sleep 1.5
      ;;
    drain)
      victim=$(( n - 1 ))
      load drain --duration "${PHASE_SECONDS:-8}" --keep-going --request-timeout 60 &
      loadgen=$!
      wait_streaming $victim 2 120
      check "replica $victim streams before SIGTERM" $?
      signalled=$(date +%s.%N)
      kill -TERM "${pids[$victim]}"
      wait "${pids[$victim]}"
      code=$?
      took=$(python3 -c "import time; print(round(time.time() - $signalled, 2))")
      unset "pids[$victim]"
      check "replica $victim exited with status $code after ${took}s (delay ${delay}s + grace ${grace}s)" \
        "$(python3 -c "print(int(not ($code == 0 and $took < $delay + $grace)))")"
      wait $loadgen
      status=$?
      read -r done lost equal < <(report drain requests failed texts_equal_single_stream)
      check "loadgen passed (status $status): $done requests, texts equal: $equal" $status
      check "no request failed while replica $victim drained: $lost" $(( lost != 0 ))
      start_replica $victim
      wait_healthy "http://127.0.0.1:$(replica_port $victim)" 300
      check "replica $victim restarted" $?
      sleep 1.5
      ;;
    throughput)
      for streams in ${STREAMS:-8}; do
        load "throughput-$n-x$streams" --concurrency $((streams * n)) --no-check
        status=$?
        read -r tps ttft50 ttft99 gap50 gap99 < <(report "throughput-$n-x$streams" tokens_per_s ttft_ms_p50 ttft_ms_p99 gap_ms_p50 gap_ms_p99)
        check "$n replica(s) x $streams streams: $tps tokens/s, first token p50/p99 $ttft50/$ttft99 ms, gap p50/p99 $gap50/$gap99 ms" $status
      done
      ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
  [ $failed = 0 ] || { for f in "$work"/*.err; do echo "--- $f"; tail -5 "$f"; done; }
done
echo "scale-out: $( [ $failed = 0 ] && echo passed || echo FAILED ) (JSON lines: ${OUT:-$work.jsonl})"
exit $failed

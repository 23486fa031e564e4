#!/usr/bin/env bash
# Concurrency benchmark of the HTTP service (`wasi-nn-host serve`) as its users see it: loadgen
# at 1, 4, 16 and 64 concurrent streams (and 256 with --256), each level first running its
# prompts alone for the reference texts; the JSON lines go to PREFIX.jsonl, the chart
# (bench/chart.py) to PREFIX.svg. By default PREFIX is in a new results folder,
# bench/results/<date>-<gpu>-<commit>/, whose manifest.json records the command (see
# bench/manifest.sh and bench/results/README.md).
# Usage: bench/concurrency.sh [DIR [DEVICE [DTYPE [GRAPH]]]] [options]
#   DIR holds wasi-nn-host, gpt2_component.wasm and loadgen; `local` takes them from this
#   checkout's release builds (target/) and serves the pre-initialised component
#   (gpt2_component.preinit.wasm beside it, made with `wasi-nn-host preinit` when missing or
#   older than the component). GRAPH is a path or random:SIZE, served as `gpt2`;
#   `embedded` serves the built-in shakespeare model. Defaults: carry cuda bf16 random:124M.
# Options:
#   --256              also run 256 streams
#   --levels "1 4 16"  the concurrencies instead (overrides --256)
#   --max-tokens N     tokens per request (default 128)
#   --requests N       requests per client (default: 4 up to 16 streams, 2 up to 64, then 1)
#   --duration S       instead: each client sends requests back to back for S seconds (a
#                      sustained load; the first wave and the last tail weigh little in it)
#   --out PREFIX       output files PREFIX.jsonl and PREFIX.svg, no manifest (default: the
#                      run's results folder, concurrency-DEVICE-DTYPE-MODEL, with a manifest);
#                      PREFIX.jsonl is emptied first unless --append
#   --append           add to PREFIX.jsonl (e.g. a second dtype on the same chart)
#   --peer FILE        PyTorch's JSON lines (python3 bench/torch_gpt2.py graph > FILE), drawn
#                      beside ours
#   --port N           the service's port (default 18123)
# On CUDA the service makes as many contexts ready at start as the largest level
# (--warm-contexts: their KV caches allocated up front), so the first wave of requests
# measures serving, not allocation.
# Exits non-zero if any level failed or its texts differed from the single-stream texts.
set -uo pipefail
command="bench/concurrency.sh${*:+$(printf ' %q' "$@")}"
positional=() levels="1 4 16 64" extra="" max_tokens=128 requests="" duration="" out="" append=0 peer=""
port=18123
while [ $# -gt 0 ]; do
  case $1 in
    --256) extra=256 ;;
    --levels) levels=$2; extra=""; shift ;;
    --max-tokens) max_tokens=$2; shift ;;
    --requests) requests=$2; shift ;;
    --duration) duration=$2; shift ;;
    --out) out=$2; shift ;;
    --append) append=1 ;;
    --peer) peer=$2; shift ;;
    --port) port=$2; shift ;;
    --*) echo "unknown option $1 (see the usage at the top of $0)" >&2; exit 2 ;;
    *) positional+=("$1") ;;
  esac
  shift
done
dir=${positional[0]:-carry}; device=${positional[1]:-cuda}; dtype=${positional[2]:-bf16}
graph=${positional[3]:-random:124M}
here=$(dirname "$0")
. "$here/service.sh"
bench_binaries "$dir" || exit 1
run=""
if [ -z "$out" ]; then
  . "$here/manifest.sh"
  bench_run_dir "$device" || exit 1
  run=$bench_dir
  model=$(basename "$graph"); model=${model#random:}
  out=$run/concurrency-$device-$dtype-$model
fi
jsonl=$out.jsonl svg=$out.svg
[ $append = 1 ] || : > "$jsonl"
graph_args=() label="$device $dtype $graph"
if [ "$graph" = embedded ]; then
  label="$device $dtype shakespeare (embedded)"
else
  graph_args=(--graph "gpt2=$graph")
fi
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

most=0
for c in $levels $extra; do [ "$c" -gt "$most" ] && most=$c; done
warm=0
[ "$device" = cuda ] && warm=$most
bench_serve "$port" --device "$device" --dtype "$dtype" --max-instances 320 --warm-contexts "$warm" \
  "${graph_args[@]}"
ok=$?
trap 'kill $server 2>/dev/null' EXIT
[ $ok = 0 ] || exit 1

failed=0
for c in $levels $extra; do
  r=${requests:-$(( c <= 16 ? 4 : c <= 64 ? 2 : 1 ))}
  load=(--requests "$r")
  [ -n "$duration" ] && load=(--duration "$duration")
  if ! "$loadgen" --url "$url" --concurrency "$c" "${load[@]}" --max-tokens "$max_tokens" \
      --label "$label" --json-out "$jsonl"; then
    echo "loadgen at $c streams failed" >&2
    failed=1
  fi
done
kill $server 2>/dev/null
wait $server 2>/dev/null

python3 "$here/chart.py" "$jsonl" "$svg" ${peer:+--peer "$peer"} || failed=1
[ -n "$run" ] && bench_record "$run" "$command" "$peer" "$jsonl" "$svg"
echo "JSON lines: $jsonl; chart: $svg"
exit $failed

#!/usr/bin/env bash
# Where the host's CPU goes under a load: the service (`wasi-nn-host serve`) under loadgen at
# one concurrency, with a system-wide `perf record` over the middle of the load. Writes, into
# the run's results folder (bench/results/<date>-<gpu>-<commit>/, with its manifest; see
# bench/manifest.sh), the load's JSON line and the profile three ways: by thread name, by
# thread and object (the service's code, the kernel, the guests' compiled code, libc, the
# CUDA driver, the load generator) and by thread and function (the first 150). With
# --callers, the service's own call graph instead: its functions by the share of its
# samples spent in and below each, then by their own share, then the callers each share
# comes through; and every sampled stack folded (NAME.folded.xz, bench/fold-stacks.py), the
# guests' functions named through wasmtime's perf map (WASI_NN_HOST_PERF_MAP).
# Usage: bench/host-profile.sh [DIR [DEVICE [DTYPE [GRAPH]]]] [options] [-- LOADGEN_ARGS...]
#   DIR holds wasi-nn-host, gpt2_component.wasm and loadgen; `local` takes them from this
#   checkout's release builds (target/), the component pre-initialised (bench/service.sh). GRAPH is a path or random:SIZE, served as `gpt2`;
#   `embedded` serves the built-in shakespeare model. Defaults: carry cuda bf16 random:124M.
#   LOADGEN_ARGS go to loadgen after `--no-check` (e.g. `--prompt-file
#   tests/data/tinyshakespeare.txt --prompt-tokens 4-6`, or `--temperature 1 --top-p 0.95`).
# Options:
#   --concurrency N   streams (default 256)
#   --max-tokens N    tokens a request (default 128)
#   --record S        seconds recorded, from 3 s into the load (default 5); the load lasts S + 6
#   --frequency HZ    samples a second a CPU (default 999)
#   --port N          the service's port (default 18124)
#   --callers         record the service alone with call graphs (`perf record -g -p`); its
#                     binary must keep frame pointers, e.g. built with
#                     RUSTFLAGS="-C force-frame-pointers=yes" into another target folder
#                     (without them a chain stops at the first frame of the service's code)
# PERF names the perf command (default `perf`); the machine must allow system-wide sampling
# (perf_event_paranoid <= 0, or root). A build without debug information still has its
# function names.
set -uo pipefail
command="bench/host-profile.sh${*:+$(printf ' %q' "$@")}"
positional=() concurrency=256 max_tokens=128 record=5 frequency=999 port=18124 load_args=()
callers=0
while [ $# -gt 0 ]; do
  case $1 in
    --concurrency) concurrency=$2; shift ;;
    --max-tokens) max_tokens=$2; shift ;;
    --record) record=$2; shift ;;
    --frequency) frequency=$2; shift ;;
    --port) port=$2; shift ;;
    --callers) callers=1 ;;
    --) shift; load_args=("$@"); break ;;
    --*) echo "unknown option $1 (see the usage at the top of $0)" >&2; exit 2 ;;
    *) positional+=("$1") ;;
  esac
  shift
done
dir=${positional[0]:-carry}; device=${positional[1]:-cuda}; dtype=${positional[2]:-bf16}
graph=${positional[3]:-random:124M}
perf=${PERF:-perf}
if ! $perf --version >/dev/null 2>&1; then
  echo "host-profile: no perf (\`$perf --version\` failed); set PERF to a perf command" >&2
  exit 2
fi
here=$(dirname "$0")
. "$here/service.sh"
bench_binaries "$dir" || exit 1
. "$here/manifest.sh"
bench_run_dir "$device" || exit 1
name=host-profile-$device-$concurrency
[ $callers = 1 ] && name=$name-callers
# the guests' compiled functions named for perf (wasmtime's perf map)
[ $callers = 1 ] && export WASI_NN_HOST_PERF_MAP=1
graph_args=(--graph "gpt2=$graph")
[ "$graph" = embedded ] && graph_args=()
warm=0
[ "$device" = cuda ] && warm=$concurrency
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
scratch=$(mktemp -d)
bench_serve "$port" --device "$device" --dtype "$dtype" --max-instances $(( concurrency + 64 )) \
  --warm-contexts "$warm" "${graph_args[@]}"
ok=$?
trap 'kill $server 2>/dev/null; rm -rf "$scratch"' EXIT
[ $ok = 0 ] || exit 1
load() {
  "$loadgen" --url "$url" --concurrency "$concurrency" --max-tokens "$max_tokens" --no-check "${load_args[@]}" "$@"
}
# the first requests compile and allocate; the profile is of the load after them
load --duration 3 >/dev/null || exit 1
load --duration $(( record + 6 )) --label "$name" --json-out "$bench_dir/$name.jsonl" >/dev/null &
loader=$!
sleep 3
scope=(-a)
[ $callers = 1 ] && scope=(-g -p "$server")
$perf record "${scope[@]}" -F "$frequency" -o "$scratch/perf.data" -- sleep "$record" \
  2>"$scratch/record.log" ||
  { echo "perf record failed:" >&2; cat "$scratch/record.log" >&2; exit 1; }
wait $loader || { echo "loadgen failed" >&2; exit 1; }
report() {
  $perf report -i "$scratch/perf.data" --no-children --stdio --sort "$1" 2>/dev/null |
    grep -v '^#' | grep -v '^$' | head -"$2"
}
if [ $callers = 1 ]; then
  # the caller chains of a per-process record (a system-wide one with chains took too long to
  # report), bounded in time all the same
  {
    echo "# $command"
    echo "# the service's functions by their share of its samples in and below each (children)"
    timeout 300 $perf report -i "$scratch/perf.data" --children --stdio --sort sym -g none \
      --percent-limit 0.3 2>/dev/null | grep -v '^#' | grep -v '^$' | head -250
    echo "# by their own share (self)"
    timeout 300 $perf report -i "$scratch/perf.data" --no-children --stdio --sort sym -g none 2>/dev/null |
      grep -v '^#' | grep -v '^$' | head -100
    echo "# the callers each share came through, 1.5% and up"
    timeout 300 $perf report -i "$scratch/perf.data" --children --stdio --sort sym \
      --percent-limit 1.5 -g caller,0.5,callee,function,percent 2>/dev/null |
      grep -v '^#' | grep -v '^$' | head -1500
  } > "$bench_dir/$name.txt"
  # every sampled stack, folded (bench/fold-stacks.py), for any other cut of the profile
  timeout 300 $perf script -i "$scratch/perf.data" -F comm,ip,sym,dso 2>/dev/null |
    python3 "$here/fold-stacks.py" --dso | xz -T0 > "$bench_dir/$name.folded.xz"
else
  {
    echo "# $command"
    echo "# samples by thread name"
    report comm 20
    echo "# by thread name and object"
    report comm,dso 30
    echo "# by thread name and function"
    report comm,sym 150
  } > "$bench_dir/$name.txt"
fi
files=("$bench_dir/$name.jsonl" "$bench_dir/$name.txt")
[ $callers = 1 ] && files+=("$bench_dir/$name.folded.xz")
bench_record "$bench_dir" "$command" "" "${files[@]}"
head -30 "$bench_dir/$name.txt"
echo "profile: $bench_dir/$name.txt"

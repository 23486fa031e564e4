#!/usr/bin/env bash
# Nsight Compute on the GPU machine: the GPU time of every kernel of one eager 1000-token
# prefill (124M bf16), summed per kernel name. Profiled kernels run one at a time (no overlap
# between them, no programmatic dependent launch), so the sum is above the graph-replay time;
# it says where the time goes, not how long the prefill takes.   bench/profile.sh DIR [OUTDIR]
# OUTDIR defaults to a new results folder, bench/results/<date>-<gpu>-<commit>/, with a
# manifest.json (bench/manifest.sh); the per-kernel sums go to prefill-kernels.txt there too.
set -uo pipefail
command="bench/profile.sh${*:+$(printf ' %q' "$@")}"
dir=${1:-carry}
out=${2:-} run=""
if [ -z "$out" ]; then
  . "$(dirname "$0")/manifest.sh"
  bench_run_dir cuda || exit 2
  run=$bench_dir
  out=$run
fi
export PATH=$PATH:/usr/local/cuda/bin
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
# the session's first launches are the prompt's prefill (86 kernels at 124M: the embedding, 7 a layer, the LM head)
"$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum -c 86 --csv \
  "$dir/wasi-nn-bench" bench --device cuda --dtype bf16 --model random:124M --context 1000 --steps 0 \
  >"$out/prefill-kernels.csv"
python3 - "$out/prefill-kernels.csv" <<'PY' | if [ -n "$run" ]; then tee "$run/prefill-kernels.txt"; else cat; fi
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
names, total = {}, 0.0
for r in rows[head + 1:]:
    d = dict(zip(rows[head], r))
    if "Metric Value" not in d:
        continue
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[d["Metric Unit"]]
    us = float(d["Metric Value"].replace(",", "")) * scale
    n, t = names.get(d["Kernel Name"], (0, 0.0))
    names[d["Kernel Name"]] = (n + 1, t + us)
    total += us
for name, (n, t) in sorted(names.items(), key=lambda kv: -kv[1][1]):
    print(f"{t:9.1f} us {n:3d} x {t / n:7.2f}  {name[:70]}")
print(f"{total:9.1f} us in all")
PY
status=$?
[ -n "$run" ] && bench_record "$run" "$command" "" "$run/prefill-kernels.csv" "$run/prefill-kernels.txt"
exit $status

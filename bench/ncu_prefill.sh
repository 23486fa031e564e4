#!/usr/bin/env bash
# Where a 1024-token prefill's time goes, kernel by kernel (Nsight Compute's gpu__time_duration,
# clocks left alone), on the GPU machine:  bench/ncu_prefill.sh DIR [MODEL] [DTYPE]
set -uo pipefail
dir=${1:-carry}
model=${2:-random:124M}
dtype=${3:-bf16}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
out=$(mktemp)
"$ncu" --clock-control none --graph-profiling graph --metrics gpu__time_duration.sum --csv \
  "$dir/wasi-nn-host" bench --device cuda --dtype "$dtype" --model "$model" --context 8 --steps 1 --prefill 1024 \
  >"$out" 2>/dev/null
python3 - "$out" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
at = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
head, rows = rows[at], [r for r in rows[at + 1:] if len(r) == len(rows[at])]
name_i, val_i, unit_i = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
names = [r[name_i] for r in rows]
last = max(i for i, n in enumerate(names) if n.startswith("embed"))
total = collections.OrderedDict()
count = collections.Counter()
for r in rows[last:]:
    v = float(r[val_i].replace(",", ""))
    v *= {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[r[unit_i]]
    k = r[name_i].split("(")[0][:60]
    total[k] = total.get(k, 0) + v
    count[k] += 1
s = sum(total.values())
print("units:", sorted({r[unit_i] for r in rows[last:]}), "first values:", [r[val_i] for r in rows[last:last + 3]])
print(f"prefill kernels: {sum(count.values())} launches, {s:.1f} us of kernel time")
for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{v:9.1f} us {100*v/s:5.1f}% {count[k]:4d}x {k}")
PY

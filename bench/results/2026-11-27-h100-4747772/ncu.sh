#!/usr/bin/env bash
# device call (issue 32): each kernel of the batched pass, timed by ncu (one metric, caches and
# clocks left alone), at 64 greedy streams of 5-token prompts and 64 streams of 200-token
# prompts (chunks beside decodes); the engine alone, no guest
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "build: $(cat .device/COMMIT)"
d=/tmp/b; mkdir -p $d
for f in .device/bin/wasi-nn-bench.xz; do xz -dc "$f" > $d/$(basename "${f%.xz}"); done; chmod +x $d/wasi-nn-bench
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
summ() { python3 - "$1" "$2" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
data = []
for r in rows:
    if hdr is None:
        if "Kernel Name" in r: hdr = r
        continue
    if len(r) != len(hdr): continue
    data.append(dict(zip(hdr, r)))
data = [x for x in data if x.get("Metric Name") == "gpu__time_duration.sum"]
print(f"  {len(data)} kernels profiled ({sys.argv[2]})")
# keep only batched-pass kernels (names start with batch_ or are cuBLAS/lt in the pass)
g = collections.defaultdict(list)
for x in data:
    name = x["Kernel Name"].split("(")[0][:60]
    v = float(x["Metric Value"].replace(",", ""))
    unit = x.get("Metric Unit", "")
    if unit in ("usecond", "us"): v *= 1e3
    elif unit in ("msecond", "ms"): v *= 1e6
    g[(name, x.get("Grid Size", ""), x.get("Block Size", ""))].append(v)
tot = sum(sum(v) for v in g.values())
for k, v in sorted(g.items(), key=lambda kv: -sum(kv[1]))[:45]:
    print(f"  {sum(v)/tot*100:5.1f}%  n={len(v):5d}  mean {sum(v)/len(v)/1e3:8.2f} us  {k[0]}  grid {k[1]} block {k[2]}")
PY
}
for cfg in "5 24" "200 24"; do
  set -- $cfg
  s=$(date +%s)
  timeout 200 $NCU --metrics gpu__time_duration.sum --cache-control none --clock-control none --graph-profiling node --csv --log-file $OUT/ncu-p$1.csv \
    $d/wasi-nn-bench streams --device cuda --dtype bf16 --model random:124M --streams 64 --prompt $1 --steps $2 > $OUT/ncu-p$1.out 2>&1
  echo "ncu prompt $1 rc=$? $(( $(date +%s)-s ))s"; tail -2 $OUT/ncu-p$1.out | cut -c1-300
  summ $OUT/ncu-p$1.csv "prompt $1"
  xz -f $OUT/ncu-p$1.csv
done
# the same runs without ncu: the pass's GPU time between its events, as the trace reports it
for p in 5 200; do
  NO_COLOR=1 RUST_LOG=wasi_nn_host::cuda::batch=debug timeout 100 $d/wasi-nn-bench streams --device cuda --dtype bf16 --model random:124M --streams 64,64 --prompt $p --steps 128 > /tmp/s$p.out 2>/tmp/s$p.log
  python3 - /tmp/s$p.log $p <<'PY'
import re, sys, statistics as st
rows = []
for line in open(sys.argv[1], errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    if "batched step" not in line: continue
    f = dict(re.findall(r"(\w+)=(\d+)", line))
    if "pass_gpu_us" in f: rows.append({k: int(v) for k, v in f.items()})
rows = rows[len(rows)//2:]
print(f"prompt {sys.argv[2]} events: steps {len(rows)}")
for k in ["items", "run_ahead", "late", "pass_gpu_us", "gap_gpu_us", "step_us"]:
    v = [r.get(k, 0) for r in rows]
    if v: print(f"  {k:14s} mean {st.mean(v):9.1f} p10 {sorted(v)[len(v)//10]:7d} p50 {st.median(v):8.0f} p90 {sorted(v)[9*len(v)//10]:7d}")
PY
  tail -1 /tmp/s$p.out | cut -c1-200
done
echo "t=$(( $(date +%s)-T0 ))s"

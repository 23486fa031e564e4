# Sourced by the bench scripts: the folder a run's results go to, and its manifest.json
# (bench/results/README.md says what the folder names and the manifest's fields mean).
#
#   bench_run_dir DEVICE
#       Sets bench_dir to the run's folder and creates it: $BENCH_RESULTS when set, else
#       bench/results/<date>-<gpu>-<commit>/ (date UTC; gpu from nvidia-smi, `cpu` for
#       DEVICE cpu; commit from $BENCH_COMMIT, else this checkout's HEAD, else `unknown`).
#       Scripts called one after another in a call share the folder.
#   bench_record DIR COMMAND PEER FILE...
#       Adds COMMAND (with the WASI_NN_HOST_* switches of its environment) and its FILEs to
#       DIR/manifest.json, creating the manifest with the date, GPU, driver and build first.
#       PEER: the PyTorch peer's JSON lines given to the command, or "" for none; copied into
#       DIR as peer.jsonl when it is elsewhere and DIR has none.
# Set BENCH_COMMIT on a machine whose copy of the repository has no git history: the binaries
# a script runs are built elsewhere, and only the person running it knows from which commit.

bench_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

bench_gpu_name() {
  command -v nvidia-smi >/dev/null 2>&1 &&
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
}

# "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA GeForce RTX 4090" -> rtx4090
bench_gpu_slug() {
  echo "$1" | tr 'A-Z' 'a-z' | tr -s ' -' '\n\n' | awk '
    $0 == "nvidia" || $0 == "geforce" || $0 == "" { next }
    /^[0-9]+$/ { print prev $0; found = 1; exit }
    /[0-9]/ { print $0; found = 1; exit }
    { prev = $0 }
    END { if (!found) print "gpu" }'
}

bench_commit() {
  if [ -n "${BENCH_COMMIT:-}" ]; then
    echo "$BENCH_COMMIT"
  else
    git -C "$bench_root" rev-parse --short=7 HEAD 2>/dev/null || echo unknown
  fi
}

bench_run_dir() {
  local device=${1:-cuda} dir gpu
  if [ -n "${BENCH_RESULTS:-}" ]; then
    dir=$BENCH_RESULTS
  else
    gpu=cpu
    if [ "$device" != cpu ]; then
      gpu=$(bench_gpu_slug "$(bench_gpu_name)")
    fi
    dir=$bench_root/bench/results/$(date -u +%F)-$gpu-$(bench_commit)
  fi
  mkdir -p "$dir" || return 1
  bench_dir=$dir bench_device=$device
}

bench_record() {
  local dir=$1 command=$2 peer=$3
  shift 3
  local source="not recorded" dirty=""
  if [ -n "${BENCH_COMMIT:-}" ]; then
    source="from BENCH_COMMIT"
  elif git -C "$bench_root" rev-parse HEAD >/dev/null 2>&1; then
    source="the HEAD of the checkout that ran the script; the binaries it ran were not checked against it"
    [ -n "$(git -C "$bench_root" status --porcelain --untracked-files=no 2>/dev/null)" ] &&
      dirty="; that checkout had uncommitted changes"
  fi
  # the peer's JSON lines go into the folder too
  if [ -n "$peer" ] && [ -f "$peer" ] && [ ! -e "$dir/peer.jsonl" ] &&
      [ "$(cd "$(dirname "$peer")" && pwd)" != "$(cd "$dir" && pwd)" ]; then
    cp "$peer" "$dir/peer.jsonl" && set -- "$@" "$dir/peer.jsonl"
  fi
  local driver
  driver=$(command -v nvidia-smi >/dev/null 2>&1 &&
    nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  BENCH_DIR=$dir BENCH_CMD=$command BENCH_PEER=$peer BENCH_GPU=$(bench_gpu_name) \
    BENCH_DRIVER=$driver BENCH_BUILD="$(bench_commit) ($source$dirty)" BENCH_DEVICE=${bench_device:-} \
    python3 - "$@" <<'PY' || echo "bench_record: could not write $dir/manifest.json" >&2
import json, os, sys, time
e = os.environ
path = os.path.join(e["BENCH_DIR"], "manifest.json")
try:
    with open(path, encoding="utf-8") as f:
        m = json.load(f)
except FileNotFoundError:
    m = {"date": time.strftime("%Y-%m-%d", time.gmtime()),
         "gpu": (f"none used (device cpu; the machine's: {e['BENCH_GPU'] or 'none'})"
                 if e["BENCH_DEVICE"] == "cpu" else e["BENCH_GPU"] or "none (no nvidia-smi)"),
         "driver": e["BENCH_DRIVER"] or "not recorded",
         "build": e["BENCH_BUILD"],
         "commands": [], "peer": "none given to the scripts", "files": {}}
files = [os.path.relpath(f, e["BENCH_DIR"]) for f in sys.argv[1:] if os.path.exists(f)]
switches = {k: v for k, v in sorted(e.items()) if k.startswith("WASI_NN_HOST_")}
m["commands"].append({"command": e["BENCH_CMD"], "switches": switches or "none", "files": files})
for f in files:
    what = "written by " + e["BENCH_CMD"].split()[0]
    if f == "peer.jsonl" and e["BENCH_PEER"]:
        what = "a copy of " + e["BENCH_PEER"] + ", the peer given to " + e["BENCH_CMD"].split()[0]
    m["files"].setdefault(f, what)
if e["BENCH_PEER"]:
    version = "not recorded"
    try:
        for line in open(e["BENCH_PEER"], encoding="utf-8"):
            if '"env"' in line:
                version = "torch " + json.loads(line).get("torch", "?")
    except OSError:
        pass
    m["peer"] = {"what": "PyTorch (bench/torch_gpt2.py), given as " + e["BENCH_PEER"],
                 "version": version}
with open(path, "w", encoding="utf-8") as f:
    json.dump(m, f, indent=2, ensure_ascii=False)
    f.write("\n")
PY
}

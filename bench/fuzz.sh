#!/usr/bin/env bash
# Fuzz the model loaders (fuzz/: llm.c checkpoints, HF config.json, safetensors + config as a
# guest's `load` passes them) for a fixed time each, on stable Rust (cargo-fuzz with
# `--sanitizer none`: libFuzzer's coverage guidance without ASan; the targets' allocator aborts
# on any single allocation over 64 MiB, so a claimed size that gets allocated is a crash).
# Seeds: the tiny test checkpoints. Prints one JSON line per target (executions, seconds,
# corpus size, crashes) and exits non-zero if any target crashed.
# Usage: bench/fuzz.sh [SECONDS_PER_TARGET] [OUT.jsonl]
#   OUT.jsonl defaults to fuzz.jsonl in a new results folder, bench/results/<date>-cpu-<commit>/,
#   with a manifest.json (bench/manifest.sh).
set -uo pipefail
command="bench/fuzz.sh${*:+$(printf ' %q' "$@")}"
cd "$(dirname "$0")/.."
seconds=${1:-120} out=${2:-} run=""
if [ -z "$out" ]; then
  . bench/manifest.sh
  bench_run_dir cpu || exit 2
  run=$bench_dir
  out=$run/fuzz.jsonl
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
work=fuzz/corpus
mkdir -p "$work"/{llmc,hf_config,hf_checkpoint} fuzz/artifacts
cp tests/fixtures/tiny_llmc.bin "$work/llmc/seed-tiny"
cp tests/fixtures/tiny/config.json "$work/hf_config/seed-tiny"
cp models/gpt2-shakespeare/config.json "$work/hf_config/seed-shakespeare"
# hf_checkpoint: 4 bytes (little-endian: where the safetensors end), the safetensors, the config
python3 - "$work/hf_checkpoint/seed-tiny" <<'PY'
import struct, sys
weights = open("tests/fixtures/tiny/model.safetensors", "rb").read()
config = open("tests/fixtures/tiny/config.json", "rb").read()
open(sys.argv[1], "wb").write(struct.pack("<I", len(weights)) + weights + config)
PY
: > "$out"
failed=0
for target in llmc hf_config hf_checkpoint; do
  log=fuzz/$target.log
  cargo fuzz run --sanitizer none "$target" "$work/$target" -- -max_total_time="$seconds" \
    -max_len=1048576 -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1
  status=$?
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  corpus=$(ls "$work/$target" | wc -l)
  crashes=$(ls fuzz/artifacts/$target 2>/dev/null | wc -l)
  [ $status = 0 ] && [ "$crashes" = 0 ] || failed=1
  echo "{\"target\":\"$target\",\"seconds\":$seconds,\"executions\":${runs:-0},\"corpus\":$corpus,\"crashes\":$crashes,\"exit\":$status}" | tee -a "$out"
done
[ -n "$run" ] && bench_record "$run" "$command (cargo-fuzz $(cargo fuzz --version 2>/dev/null | awk '{print $NF}'))" "" "$out"
exit $failed

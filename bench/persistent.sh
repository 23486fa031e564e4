#!/usr/bin/env bash
# The persistent decode kernel against the graph of per-layer kernels, on the GPU machine:
#   bash bench/persistent.sh [BIN_DIR]     (default .device/bin: wasi-nn-bench, xz or not)
# Alternating step times (124M and 1558M bf16, 124M f32), the phase trace, and where a phase's
# time goes: the kernel compiled from kernels/ with one part taken out (results wrong, time
# only; through WASI_NN_HOST_KERNELS): no wait for the weights, no loader at all, no LayerNorm,
# no wait at the counter. Lines as `step` prints them (bench/device-lib.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-lib.sh
describe
unpack "${1:-.device/bin}" /tmp/persistent-bin
P=WASI_NN_HOST_PERSISTENT_DECODE
T=WASI_NN_HOST_PERSISTENT_TRACE=1
for _ in 1 2; do
  for p in 0 1; do step $P=$p -- --dtype bf16 --model random:124M --context 128; done
done
step $P=1 $T -- --dtype bf16 --model random:124M --context 128
# each variant: kernels/ with one piece of persistent.cu replaced
python3 - <<'PY'
import pathlib, shutil
src = pathlib.Path("kernels/persistent.cu").read_text()
variants = {
    "no-weight-wait": [("        mbar_wait(&full[slot], (seq / a.slots) & 1);",
                        "        if (seq < 0) mbar_wait(&full[slot], (seq / a.slots) & 1);")],
    "no-loader": [("        mbar_wait(&full[slot], (seq / a.slots) & 1);",
                   "        if (seq < 0) mbar_wait(&full[slot], (seq / a.slots) & 1);"),
                  ("    if ((threadIdx.x & 31) != 0) return;\n    int c = a.c, seq = 0;",
                   "    return;\n    int c = a.c, seq = 0;")],
    "no-layernorm": [("    if (ln_w == nullptr) {\n        for (int i = t * 4;", "    if (true) {\n        for (int i = t * 4;")],
    "no-counter-wait": [("            if (seen >= target) break;", "            if (true) break;")],
}
for name, edits in variants.items():
    text = src
    for old, new in edits:
        if text.count(old) != 1:
            print(f"variant {name}: its line is not in persistent.cu once; skipped")
            break
        text = text.replace(old, new)
    else:
        out = pathlib.Path("/tmp/persistent-variants") / name
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree("kernels", out)
        (out / "persistent.cu").write_text(text)
PY
for v in /tmp/persistent-variants/*; do
  step $P=1 $T WASI_NN_HOST_KERNELS="$v" -- --dtype bf16 --model random:124M --context 128
done
for p in 0 1; do step $P=$p -- --dtype bf16 --model random:1558M --context 128; done
step $P=1 $T -- --dtype bf16 --model random:1558M --context 128
for p in 0 1; do step $P=$p -- --dtype f32 --model random:124M --context 128; done

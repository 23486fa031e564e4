#!/usr/bin/env python3
"""Reads `ptxas -v` output on stdin and fails when a kernel spills registers to local memory,
except the kernels named after `--allow`, each with the most bytes of spill stores or loads it
may have (its own and those of the functions it calls out of line).

    ptxas -arch=sm_90 -v kernels.ptx 2>&1 | scripts/kernel-spills.py --allow persistent_decode_f32=116

Spills turn a kernel's register traffic into local-memory loads and stores in its loops; a
kernel that fits its launch bounds under one ptxas can spill under the next (the batched
attention did under CUDA 13's), so the check runs the ptxas the GPU machines compile with."""
import argparse
import re
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--allow", nargs="*", default=[], help="KERNEL=BYTES: the most bytes of spill stores or loads it may have")
    args = parser.parse_args()
    allowed = {name: int(bytes_) for name, bytes_ in (a.split("=", 1) for a in args.allow)}
    kernel, spills, seen = None, {}, 0
    for line in sys.stdin:
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            kernel, seen = entry.group(1), seen + 1
            continue
        stores = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if stores and kernel is not None:
            spills[kernel] = max(spills.get(kernel, 0), int(stores.group(1)), int(stores.group(2)))
    if seen == 0:
        print("kernel-spills: no kernel in ptxas's output", file=sys.stderr)
        return 1
    bad = [(k, b) for k, b in sorted(spills.items()) if b > allowed.get(k, 0)]
    for k, b in bad:
        print(f"kernel-spills: {k} spills {b} bytes (allowed {allowed.get(k, 0)})", file=sys.stderr)
    print(f"kernel-spills: {seen} kernels, {len(bad)} over their allowance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

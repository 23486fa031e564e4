#!/usr/bin/env python3
"""Folds `perf script -F comm,ip,sym[,dso]` output of a recording with call chains (`perf
record -g`) into one line a distinct stack, root first: `thread;caller;...;leaf COUNT`, the
most frequent first. The lines are the input of flame-graph tools, and a stack's share is its
count over the total; `grep` and `awk` sum any part of them.

A frame perf could not name (a guest's compiled code without a perf map) is named by its
object where the input has the `dso` field (`[unknown in libfoo.so]`), so that its samples
stay one stack; without it, by its address. Input without call chains is refused: each sample
would fold into its leaf alone, and most of the profile's meaning with it."""
import argparse
import collections
import os
import sys


def frame_name(line, with_dso):
    """The name of one call-chain line: `ADDRESS SYMBOL [(DSO)]`."""
    parts = line.split(None, 1)
    rest = parts[1].strip() if len(parts) > 1 else "[unknown]"
    dso = None
    if with_dso and rest.endswith(")") and " (" in rest:
        rest, dso = rest[: rest.rindex(" (")], rest[rest.rindex(" (") + 2 : -1]
    if rest in ("", "[unknown]"):
        rest = f"[unknown in {os.path.basename(dso)}]" if dso else "0x" + parts[0]
    return rest.replace(";", ":")


def fold(lines, with_dso=False):
    stacks = collections.Counter()
    comm, frames = None, []
    samples = chained = 0

    def end_sample():
        nonlocal samples, chained
        if comm is not None:
            samples += 1
            chained += bool(frames)
            stacks[";".join([comm] + frames[::-1])] += 1

    for line in lines:
        if not line.strip():
            end_sample()
            comm, frames = None, []
        elif line[0] == "\t":
            frames.append(frame_name(line, with_dso))
        else:
            # a sample's header (perf pads the thread's name with spaces; call-chain lines
            # start with a tab): without call chains one follows the other, no blank line
            end_sample()
            comm, frames = line.strip().replace(" ", "_") or "?", []
    end_sample()
    return stacks, samples, chained


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dso", action="store_true", help="the input has the dso field")
    args = parser.parse_args()
    stacks, samples, chained = fold(sys.stdin, args.dso)
    if samples and not chained:
        sys.exit(f"fold-stacks: none of {samples} samples has a call chain (record with -g)")
    for stack, count in stacks.most_common():
        print(stack, count)


if __name__ == "__main__":
    main()

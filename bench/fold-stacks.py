#!/usr/bin/env python3
"""Folds `perf script -F comm,ip,sym` output into one line a distinct stack, root first:
`thread;caller;...;leaf COUNT`, the most frequent first. The lines are the input of flame-graph
tools, and a stack's share is its count over the total; `grep` and `awk` sum any part of them.
A frame perf could not name is its address (a guest's compiled code without a perf map)."""
import collections
import sys


def fold(lines):
    stacks = collections.Counter()
    comm, frames = None, []
    for line in lines:
        if not line.strip():
            if comm is not None:
                stacks[";".join([comm] + frames[::-1])] += 1
            comm, frames = None, []
        elif line[0] in " \t":
            parts = line.split(None, 1)
            name = parts[1].strip() if len(parts) > 1 else "[unknown]"
            if name == "[unknown]":
                name = "0x" + parts[0]
            frames.append(name.replace(";", ":"))
        else:
            comm = line.strip().replace(" ", "_") or "?"
    if comm is not None:
        stacks[";".join([comm] + frames[::-1])] += 1
    return stacks


if __name__ == "__main__":
    for stack, count in fold(sys.stdin).most_common():
        print(stack, count)

# Summarises an ncu CSV of `--metrics gpu__time_duration.sum` over the service (device-lib's
# `service_kernels`): each kernel's launches, mean time and share, with its commonest grids;
# then the batched passes it caught. A pass is the launches of one stream from the kernel
# after a `batch_draw` to the next `batch_draw` (a pass's last kernel); passes are grouped by
# their rows (the draw's grid), their kernels' times summed by kernel (cuBLAS's products as
# one). Launches on streams without a `batch_draw` (lone sessions' decodes and draws) are
# summed apart. With --by-grid, only each kernel and grid's launches, mean time and share
# (device-lib's `kernel_times`).
#   python3 bench/pass-kernels.py [--by-grid] FILE.csv
import collections
import csv
import sys

# ncu's time units, in nanoseconds
UNITS = {'ns': 1.0, 'nsecond': 1.0, 'us': 1e3, 'usecond': 1e3, 'ms': 1e6, 'msecond': 1e6}


def launches(path):
    """(kernel, stream, grid, ns) of each launch, in order."""
    rows = csv.reader(line for line in open(path) if line.startswith('"'))
    head = next(rows, None)
    if head is None:
        return
    col = {name: i for i, name in enumerate(head)}
    for r in rows:
        unit = r[col['Metric Unit']]
        if unit not in UNITS:
            sys.exit(f'{path}: a time in {unit!r}, not one of {sorted(UNITS)}')
        value = float(r[col['Metric Value']].replace(',', '')) * UNITS[unit]
        yield r[col['Kernel Name']].split('(')[0][:60], r[col['Stream']], r[col['Grid Size']], value


def part(name):
    """The part of a pass a kernel is: its own name, or cuBLAS for the library's kernels."""
    library = ('nvjet', 'sm90_', 'sm80_', 'cutlass', 'gemv', 'gemm', 'void cublas')
    return 'cuBLAS' if name.startswith(library) or 'cublas' in name.lower() else name


def by_grid(path):
    times = collections.defaultdict(list)
    for name, _, grid, ns in launches(path):
        times[(name, grid)].append(ns)
    total = sum(sum(v) for v in times.values()) or 1.0
    for (name, grid), v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        print(name, grid, len(v), f'{sum(v) / len(v) / 1000:.2f} us', f'{100 * sum(v) / total:.1f}%')


def main(path):
    every = list(launches(path))
    times, grids = collections.defaultdict(list), collections.defaultdict(collections.Counter)
    for name, _, grid, ns in every:
        times[name].append(ns)
        grids[name][grid] += 1
    total = sum(sum(v) for v in times.values()) or 1.0
    print('kernels', len(every))
    for name, v in sorted(times.items(), key=lambda kv: -sum(kv[1]))[:30]:
        top = ' '.join(f'{g}x{n}' for g, n in grids[name].most_common(3))
        print(f'{name:60s} n={len(v):5d} mean={sum(v) / len(v) / 1000:7.2f} us '
              f'{100 * sum(v) / total:5.1f}%  {top}')
    streams = collections.defaultdict(list)
    for launch in every:
        streams[launch[1]].append(launch)
    by_rows, apart = collections.defaultdict(list), collections.defaultdict(float)
    for stream, ones in streams.items():
        if not any(name == 'batch_draw' for name, *_ in ones):
            for name, _, _, ns in ones:
                apart[part(name)] += ns
            continue
        passes, current = [], []
        for launch in ones:
            current.append(launch)
            if launch[0] == 'batch_draw':
                passes.append(current)
                current = []
        # the stream's first pass may have begun before the capture
        for p in passes[1:]:
            by_rows[p[-1][2]].append(p)
    for rows, group in sorted(by_rows.items(), key=lambda kv: -len(kv[1])):
        parts = collections.defaultdict(float)
        for p in group:
            for name, _, _, ns in p:
                parts[part(name)] += ns / len(group)
        whole = sum(parts.values())
        shares = ', '.join(f'{k} {v / 1000:.1f} us ({100 * v / whole:.0f}%)'
                           for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        kernels = sum(len(p) for p in group) / len(group)
        print(f'passes drawing {rows}: {len(group)}, {whole / 1000:.1f} us and {kernels:.0f} kernels each: {shares}')
    if apart:
        print('on streams without a batched pass: ' + ', '.join(
            f'{k} {v / 1000:.1f} us' for k, v in sorted(apart.items(), key=lambda kv: -kv[1])))


if __name__ == '__main__':
    if sys.argv[1] == '--by-grid':
        by_grid(sys.argv[2])
    else:
        main(sys.argv[1])

# Summarises an ncu CSV of `--metrics gpu__time_duration.sum` over the service (device-lib's
# `service_kernels`): each kernel's launches, mean time and share, with its commonest grids;
# then the batched passes it caught, each from the kernel after one `batch_draw` to the next
# `batch_draw` (a pass's last kernel), by its rows (the draw's grid) and their kernels' times
# grouped (cuBLAS's products as one).
#   python3 bench/pass-kernels.py FILE.csv
import collections
import csv
import sys


def kernel_rows(path):
    rows = csv.reader(line for line in open(path) if line.startswith('"'))
    next(rows, None)
    for r in rows:
        yield r[4].split('(')[0][:60], r[8], float(r[-1].replace(',', ''))


def main(path):
    launches = list(kernel_rows(path))
    times, grids = collections.defaultdict(list), collections.defaultdict(collections.Counter)
    for name, grid, ns in launches:
        times[name].append(ns)
        grids[name][grid] += 1
    total = sum(sum(v) for v in times.values()) or 1.0
    print('kernels', len(launches))
    for name, v in sorted(times.items(), key=lambda kv: -sum(kv[1]))[:30]:
        top = ' '.join(f'{g}x{n}' for g, n in grids[name].most_common(3))
        print(f'{name:60s} n={len(v):5d} mean={sum(v) / len(v) / 1000:7.2f} us '
              f'{100 * sum(v) / total:5.1f}%  {top}')
    passes, current = [], []
    for launch in launches:
        current.append(launch)
        if launch[0] == 'batch_draw':
            passes.append(current)
            current = []
    by_rows = collections.defaultdict(list)
    for p in passes[1:]:  # the first may have begun before the capture
        rows = next(grid for name, grid, _ in p if name == 'batch_draw')
        by_rows[rows].append(p)
    for rows, group in sorted(by_rows.items(), key=lambda kv: -len(kv[1])):
        parts = collections.defaultdict(float)
        for p in group:
            for name, _, ns in p:
                key = 'cuBLAS' if name.startswith('nvjet') or 'cublas' in name else name
                parts[key] += ns / len(group)
        whole = sum(parts.values())
        shares = ', '.join(f'{k} {v / 1000:.1f} us ({100 * v / whole:.0f}%)'
                           for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        kernels = sum(len(p) for p in group) / len(group)
        print(f'passes drawing {rows}: {len(group)}, {whole / 1000:.1f} us and {kernels:.0f} kernels each: {shares}')


if __name__ == '__main__':
    main(sys.argv[1])

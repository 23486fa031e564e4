# Summarises ncu's source page (`ncu -i REPORT --page source --csv --print-source sass`, with
# the SourceCounters section collected) for one kernel launch: each executed instruction that
# touches global or shared memory, with the L2 sectors and shared-memory wavefronts it took
# against ncu's ideal for its addresses, worst ratio first. A copy whose rows land at addresses
# the hardware must split (cp.async into rows padded to 144 bytes, say) shows up here as a
# ratio above 1 (device-lib's `memory_efficiency`).
#   python3 bench/memory-efficiency.py FILE.csv [--all]
import csv
import sys

COLUMNS = {
    'inst': 'Instructions Executed',
    'l2': 'L2 Theoretical Sectors Global',
    'l2_ideal': 'L2 Theoretical Sectors Global Ideal',
    'smem': 'L1 Wavefronts Shared',
    'smem_ideal': 'L1 Wavefronts Shared Ideal',
}


def number(text):
    text = text.replace(',', '').strip()
    return float(text) if text else 0.0


def accesses(path):
    """(SASS, inst, l2, l2_ideal, smem, smem_ideal) of each executed memory instruction."""
    rows = list(csv.reader(open(path)))
    head = next((i for i, r in enumerate(rows) if 'Source' in r and COLUMNS['inst'] in r), None)
    if head is None:
        sys.exit(f'{path}: no source page with {COLUMNS["inst"]!r} (was SourceCounters collected?)')
    col = {name: i for i, name in enumerate(rows[head])}
    missing = [c for c in COLUMNS.values() if c not in col]
    if missing:
        sys.exit(f'{path}: no column {missing[0]!r}')
    for r in rows[head + 1:]:
        if len(r) < len(rows[head]):
            continue
        v = {k: number(r[col[c]]) for k, c in COLUMNS.items()}
        if v['inst'] and (v['l2_ideal'] or v['smem_ideal']):
            yield r[col['Source']].strip(), v


def ratio(got, ideal):
    return got / ideal if ideal else 1.0


def main():
    path = sys.argv[1]
    show_all = '--all' in sys.argv[2:]
    found = list(accesses(path))
    found.sort(key=lambda a: -max(ratio(a[1]['l2'], a[1]['l2_ideal']), ratio(a[1]['smem'], a[1]['smem_ideal'])))
    total = {k: sum(v[k] for _, v in found) for k in COLUMNS}
    print(f'{len(found)} memory instructions executed: L2 sectors {total["l2"]:.0f} (ideal {total["l2_ideal"]:.0f}),'
          f' shared wavefronts {total["smem"]:.0f} (ideal {total["smem_ideal"]:.0f})')
    for sass, v in found:
        l2, smem = ratio(v['l2'], v['l2_ideal']), ratio(v['smem'], v['smem_ideal'])
        if show_all or l2 > 1.0 or smem > 1.0:
            print(f'  {sass[:60]:60} x{v["inst"]:.0f}  L2 {l2:.2f}x of ideal  shared {smem:.2f}x of ideal')


if __name__ == '__main__':
    main()

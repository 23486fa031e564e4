#!/usr/bin/env python3
"""Chart of the service under concurrent streams, from loadgen's JSON lines, as an SVG.

Usage: python3 bench/chart.py SOURCE [OUT.svg] [--peer PEER_JSONL] [--peer-size 124M]
                              [--peer-what manual_static_kv] [--peer-batches 1,64,256]
                              [--title TEXT]

SOURCE is one file of loadgen's JSON lines, or a results folder (bench/results/<run>/): then
every `*.jsonl` in it is read except `peer*.jsonl` and `soak*.jsonl`, each file's series named
after the file, and `peer.jsonl` is the peer unless --peer names another. OUT defaults to
`chart.svg` in the folder, or the file's name with `.svg`.

Two panels against concurrency (log scales): aggregate tokens/s, and the p99 gap between
streamed tokens. One line per `label` of the loadgen lines (several runs at one concurrency:
every point drawn, the line through their median); a run whose texts differed from the
single-stream texts is crossed out in red.

With a peer, the PyTorch rows of bench/torch_gpt2.py (one batch decoded per step: static KV
cache, CUDA graph) are drawn beside ours as points, one series per dtype: graph_tok_per_s on
the first panel and graph_ms_per_step, the gap between one stream's tokens at that batch, on
the second. Lines of the files that are not JSON objects are skipped.

Only the Python standard library: the SVG is written by hand.
"""
import argparse
import json
import math
import os
import statistics
import sys
from xml.sax.saxutils import escape

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22"]
PEER_COLOURS = ["#ff7f0e", "#7f7f7f", "#e377c2", "#000000"]
FONT = 'font-family="DejaVu Sans, Helvetica, Arial, sans-serif"'


def read_jsonl(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def number(v):
    """A positive finite float, or None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None


def texts_differ(row):
    """True when the row's text check counted a mismatch ("N of M" with N < M)."""
    check = row.get("texts_equal_single_stream")
    if not isinstance(check, str):
        return False
    try:
        equal, total = (int(x) for x in check.split(" of "))
    except ValueError:
        return False
    return equal != total


def ours(rows):
    """{label: [(concurrency, tok/s, gap p99 ms, texts differ, row)]} in first-seen order."""
    series = {}
    for row in rows:
        c = number(row.get("concurrency"))
        if c is None or "tokens_per_s" not in row:
            continue
        label = row.get("label") or "wasi-nn-host"
        if row.get("_file"):
            label = f"{row['_file']}: {label}"
        point = (c, number(row.get("tokens_per_s")), number(row.get("gap_ms_p99")),
                 texts_differ(row), row)
        series.setdefault(label, []).append(point)
    return series


def peers(rows, what, size, batches):
    """{series name: [(batch, tok/s, ms per step, False, row)]}, one series per dtype."""
    series = {}
    for row in rows:
        if row.get("what") != what or row.get("size") != size:
            continue
        batch = number(row.get("batch"))
        if batch is None or (batches and int(batch) not in batches):
            continue
        dtype = str(row.get("dtype", "?")).replace("torch.", "")
        name = f"PyTorch {what} {size} {dtype}"
        point = (batch, number(row.get("graph_tok_per_s")),
                 number(row.get("graph_ms_per_step")), False, row)
        series.setdefault(name, []).append(point)
    return series


def sources(path):
    """(loadgen rows, the folder's peer.jsonl or None) of a file or a results folder."""
    if not os.path.isdir(path):
        return read_jsonl(path), None
    names = sorted(n for n in os.listdir(path) if n.endswith(".jsonl")
                   and not n.startswith(("peer", "soak")))
    rows = []
    for name in names:
        for row in read_jsonl(os.path.join(path, name)):
            if len(names) > 1:
                row["_file"] = name[:-len(".jsonl")]
            rows.append(row)
    peer = os.path.join(path, "peer.jsonl")
    return rows, peer if os.path.exists(peer) else None


def log_ticks(lo, hi):
    """Ticks between lo and hi at round mantissas: 1-2-5 per decade, finer on short ranges."""
    ticks = []
    for mantissas in ((1, 2, 5), (1, 2, 3, 5), (1, 1.5, 2, 3, 4, 5, 6, 8),
                      (1, 1.2, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0 ** e
                 for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
                 for m in mantissas if lo <= m * 10.0 ** e <= hi]
        if len(ticks) >= 3:
            break
    return ticks


def fmt(v):
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.3g}"


class Panel:
    def __init__(self, x0, y0, w, h, xs, ys, title, xlabel, ylabel):
        self.x0, self.y0, self.w, self.h = x0, y0, w, h
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.xticks = sorted(set(xs))
        self.xlo, self.xhi = min(xs) / 1.5, max(xs) * 1.5
        self.ylo, self.yhi = min(ys) / 1.4, max(ys) * 1.4

    def x(self, v):
        f = math.log(v / self.xlo) / math.log(self.xhi / self.xlo)
        return self.x0 + f * self.w

    def y(self, v):
        f = math.log(v / self.ylo) / math.log(self.yhi / self.ylo)
        return self.y0 + self.h - f * self.h

    def frame(self):
        out = [f'<rect x="{self.x0}" y="{self.y0}" width="{self.w}" height="{self.h}" '
               'fill="white" stroke="#444"/>']
        for t in log_ticks(self.ylo, self.yhi):
            y = self.y(t)
            out.append(f'<line x1="{self.x0}" y1="{y:.1f}" x2="{self.x0 + self.w}" y2="{y:.1f}" '
                       'stroke="#ddd"/>')
            out.append(f'<text x="{self.x0 - 6}" y="{y + 4:.1f}" text-anchor="end" '
                       f'font-size="11" {FONT}>{fmt(t)}</text>')
        for t in self.xticks:
            x = self.x(t)
            out.append(f'<line x1="{x:.1f}" y1="{self.y0}" x2="{x:.1f}" y2="{self.y0 + self.h}" '
                       'stroke="#eee"/>')
            out.append(f'<text x="{x:.1f}" y="{self.y0 + self.h + 16}" text-anchor="middle" '
                       f'font-size="11" {FONT}>{t:g}</text>')
        out.append(f'<text x="{self.x0 + self.w / 2}" y="{self.y0 - 10}" text-anchor="middle" '
                   f'font-size="14" font-weight="bold" {FONT}>{escape(self.title)}</text>')
        out.append(f'<text x="{self.x0 + self.w / 2}" y="{self.y0 + self.h + 36}" '
                   f'text-anchor="middle" font-size="12" {FONT}>{escape(self.xlabel)}</text>')
        cy = self.y0 + self.h / 2
        out.append(f'<text x="{self.x0 - 48}" y="{cy}" text-anchor="middle" font-size="12" '
                   f'transform="rotate(-90 {self.x0 - 48} {cy})" {FONT}>'
                   f'{escape(self.ylabel)}</text>')
        return out

    def series(self, points, colour, peer):
        """points: [(x, y, differ, tooltip)], y may be None (skipped)."""
        points = [p for p in points if p[1] is not None]
        out = []
        by_x = {}
        for x, y, _, _ in points:
            by_x.setdefault(x, []).append(y)
        line = [(self.x(x), self.y(statistics.median(ys))) for x, ys in sorted(by_x.items())]
        if len(line) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in line)
            dash = ' stroke-dasharray="5,4"' if peer else ""
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                       f'stroke-width="{1.5 if peer else 2}"{dash}/>')
        for x, y, differ, tip in points:
            px, py = self.x(x), self.y(y)
            tip = f"<title>{escape(tip)}</title>"
            if peer:
                out.append(f'<rect x="{px - 5:.1f}" y="{py - 5:.1f}" width="10" height="10" '
                           f'fill="white" stroke="{colour}" stroke-width="2">{tip}</rect>')
            else:
                out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{colour}">'
                           f'{tip}</circle>')
            if differ:
                out.append(f'<path d="M{px - 7:.1f},{py - 7:.1f} L{px + 7:.1f},{py + 7:.1f} '
                           f'M{px - 7:.1f},{py + 7:.1f} L{px + 7:.1f},{py - 7:.1f}" '
                           'stroke="red" stroke-width="2.5"/>')
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="loadgen's JSON lines, or a results folder")
    ap.add_argument("out", nargs="?",
                    help="the SVG to write (default: chart.svg in the folder, or SOURCE.svg)")
    ap.add_argument("--peer", help="bench/torch_gpt2.py's JSON lines")
    ap.add_argument("--peer-size", default="124M")
    ap.add_argument("--peer-what", default="manual_static_kv")
    ap.add_argument("--peer-batches", default="1,64,256",
                    help="comma-separated batches to draw (empty: all)")
    ap.add_argument("--title", default="wasi-nn-host serve under concurrent streams")
    args = ap.parse_args()

    rows, folder_peer = sources(args.source)
    args.peer = args.peer or folder_peer
    if args.out is None:
        if os.path.isdir(args.source):
            args.out = os.path.join(args.source, "chart.svg")
        else:
            args.out = os.path.splitext(args.source)[0] + ".svg"
    mine = ours(rows)
    if not mine:
        sys.exit(f"{args.source}: no loadgen lines (JSON objects with concurrency, tokens_per_s)")
    theirs = {}
    if args.peer:
        batches = {int(b) for b in args.peer_batches.split(",") if b.strip()}
        theirs = peers(read_jsonl(args.peer), args.peer_what, args.peer_size, batches)
        if not theirs:
            print(f"{args.peer}: no {args.peer_what} rows of size {args.peer_size}",
                  file=sys.stderr)

    every = [p for s in (*mine.values(), *theirs.values()) for p in s]
    xs = [p[0] for p in every]
    toks = [p[1] for p in every if p[1] is not None] or [1.0]
    gaps = [p[2] for p in every if p[2] is not None] or [1.0]

    width, pw, ph, top = 980, 380, 300, 70
    xlabel = "concurrent streams" + (" (PyTorch: batch)" if theirs else "")
    left = Panel(90, top, pw, ph, xs, toks, "aggregate tokens/s", xlabel, "tokens/s")
    right = Panel(90 + pw + 110, top, pw, ph, xs, gaps, "p99 gap between tokens of a stream",
                  xlabel, "ms" + (" (PyTorch: ms per step)" if theirs else ""))
    legend = [(name, COLOURS[i % len(COLOURS)], False) for i, name in enumerate(mine)]
    legend += [(name, PEER_COLOURS[i % len(PEER_COLOURS)], True)
               for i, name in enumerate(theirs)]
    any_differ = any(p[3] for s in mine.values() for p in s)
    legend_rows = len(legend) + any_differ
    height = top + ph + 60 + 20 * legend_rows + 10

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="24" text-anchor="middle" font-size="16" '
           f'font-weight="bold" {FONT}>{escape(args.title)}</text>']
    max_tokens = sorted({r[4].get("max_tokens") for s in mine.values() for r in s} - {None})
    if max_tokens:
        sub = "greedy streams of max_tokens " + ", ".join(str(m) for m in max_tokens)
        out.append(f'<text x="{width / 2}" y="42" text-anchor="middle" font-size="12" '
                   f'fill="#555" {FONT}>{escape(sub)}</text>')
    out += left.frame() + right.frame()

    for (name, colour, _), points in zip(legend, mine.values()):
        for panel, k, unit in ((left, 1, "tok/s"), (right, 2, "ms")):
            pts = []
            for p in points:
                row = p[4]
                tip = (f"{name}: {p[0]:g} streams, {p[k]:.4g} {unit}" if p[k] else name)
                if row.get("texts_equal_single_stream"):
                    tip += f", texts equal: {row['texts_equal_single_stream']}"
                pts.append((p[0], p[k], p[3], tip))
            out += panel.series(pts, colour, peer=False)
    for (name, colour, _), points in zip(legend[len(mine):], theirs.values()):
        for panel, k, unit in ((left, 1, "tok/s"), (right, 2, "ms/step")):
            pts = [(p[0], p[k], False,
                    f"{name}: batch {p[0]:g}, {p[k]:.4g} {unit}" if p[k] else name)
                   for p in points]
            out += panel.series(pts, colour, peer=True)

    y = top + ph + 62
    for name, colour, peer in legend:
        if peer:
            out.append(f'<line x1="90" y1="{y}" x2="120" y2="{y}" stroke="{colour}" '
                       'stroke-width="1.5" stroke-dasharray="5,4"/>')
            out.append(f'<rect x="100" y="{y - 5}" width="10" height="10" fill="white" '
                       f'stroke="{colour}" stroke-width="2"/>')
            name += " (graph_tok_per_s; graph_ms_per_step)"
        else:
            out.append(f'<line x1="90" y1="{y}" x2="120" y2="{y}" stroke="{colour}" '
                       'stroke-width="2"/>')
            out.append(f'<circle cx="105" cy="{y}" r="4" fill="{colour}"/>')
        out.append(f'<text x="130" y="{y + 4}" font-size="12" {FONT}>{escape(name)}</text>')
        y += 20
    if any_differ:
        out.append(f'<path d="M98,{y - 7} L112,{y + 7} M98,{y + 7} L112,{y - 7}" '
                   'stroke="red" stroke-width="2.5"/>')
        out.append(f'<text x="130" y="{y + 4}" font-size="12" {FONT}>texts differ from the '
                   'single-stream texts</text>')
    out.append("</svg>")
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Kernel times of the last ubatch of an ncu run of llama-bench, two KV types side by side.

    python gpu/ncu_last_ubatch.py A.csv B.csv

Each CSV is `ncu --metrics gpu__time_duration.sum --csv llama-bench ... -p 512 -n 0 -r 1`. A
ubatch's graph ends with two get_rows launches (the output rows), so the last ubatch is what
follows the third-last get_rows. Prints each file's total GPU time for it, then the kernels
whose time differs by more than 5 us, largest difference first (A minus B).
"""
import collections
import csv
import re
import sys


def load(path: str) -> list[tuple[str, float]]:
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    rows = []
    for r in csv.DictReader(lines[start:] if start is not None else []):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        v = v/1000.0 if r.get("Metric Unit") in ("ns", "nsecond") else v
        rows.append((re.sub(r"^void ", "", re.sub(r"[<(].*", "", r["Kernel Name"]).strip())[:44], v))
    return rows


def last_ubatch(rows: list[tuple[str, float]]) -> tuple[collections.Counter, collections.Counter]:
    idx = [i for i, (n, _) in enumerate(rows) if n.startswith("k_get_rows")]
    first = idx[-3] + 1 if len(idx) >= 3 else 0
    t, c = collections.Counter(), collections.Counter()
    for n, v in rows[first:]:
        t[n] += v
        c[n] += 1
    return t, c


a, b = (last_ubatch(load(p)) for p in sys.argv[1:3])
for p, (t, c) in zip(sys.argv[1:3], (a, b)):
    print(f"{p}: last ubatch {sum(c.values())} kernels, {sum(t.values()):.0f} us GPU time")
for n in sorted(set(a[0]) | set(b[0]), key=lambda n: -(a[0][n] - b[0][n])):
    if abs(a[0][n] - b[0][n]) > 5:
        print(f"  {a[0][n]:9.1f} us ({a[1][n]:3d}x)  {b[0][n]:9.1f} us ({b[1][n]:3d}x)  diff {a[0][n] - b[0][n]:8.1f}  {n}")

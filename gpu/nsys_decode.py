#!/usr/bin/env python3
"""Where the time of the last tokens (or ubatches) goes, from an nsys trace (gpu/run.sh timeline).

    python gpu/nsys_decode.py TRACE.sqlite [N] [GAP_US]

Splits the kernels of the trace into segments at every idle gap of the GPU of GAP_US (default
30) or more, which is where the host works between two llama_decode calls (inputs, the mask,
sampling), and prints the last N segments (default 8): the wall time from a segment's first
kernel to the next one's, the GPU busy time (the union of kernel intervals), the idle gap before
it and the kernels that took the most time. Wall minus busy is time the GPU waited.
"""
import collections
import sqlite3
import sys

db = sqlite3.connect(sys.argv[1])
n_seg = int(sys.argv[2]) if len(sys.argv) > 2 else 8
gap_ns = float(sys.argv[3] if len(sys.argv) > 3 else 30)*1000
rows = db.execute(
    "SELECT k.start, k.end, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
    "JOIN StringIds s ON s.id = k.shortName ORDER BY k.start").fetchall()
if not rows:
    sys.exit("no kernels in the trace")
segs, cur, end = [], [], None
for r in rows:
    if end is not None and r[0] - end >= gap_ns:
        segs.append(cur)
        cur = []
    cur.append(r)
    end = r[1] if end is None else max(end, r[1])
segs.append(cur)
print(f"{len(rows)} kernels in {len(segs)} segments (idle gaps >= {gap_ns/1000:.0f} us); the last {min(n_seg, len(segs))}:")
for k in range(max(0, len(segs) - n_seg), len(segs)):
    ks = segs[k]
    nxt = segs[k + 1][0][0] if k + 1 < len(segs) else max(e for _, e, _ in ks)
    wall = nxt - ks[0][0]
    busy, end = 0, 0
    for s, e, _ in ks:
        busy += max(0, e - max(s, end))
        end = max(end, e)
    gap = (ks[0][0] - max(e for _, e, _ in segs[k - 1]))/1000 if k > 0 else 0.0
    by = collections.Counter()
    for s, e, n in ks:
        by[n[:32]] += e - s
    top = ", ".join(f"{n} {v/1000:.0f}" for n, v in by.most_common(6))
    print(f"  {len(ks):5d} kernels, wall {wall/1e6:7.3f} ms, busy {busy/1e6:7.3f} ms, idle before {gap:6.0f} us | us: {top}")

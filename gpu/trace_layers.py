#!/usr/bin/env python3
"""One decoded layer's attention chain, from gpu/trace/kernel_trace.cpp traces.

    python gpu/trace_layers.py A.trace [B.trace ...]

For every attention launch of a trace (a kernel whose name matches ATTENTION) that a combine
follows, the chain from the end of the last RoPE launch before it to the end of that combine, in
three parts: the cache writes (the RoPE's end to the end of the last launch before the
attention: upstream's set_rows, or oscar2's rotate-store), the attention (to its end) and the
combine (to its end). Medians over the layers, µs. Why: the kernels overlap (programmatic
dependent launches), so their durations, which trace_summary.py sums by name, include their
waits; these ends are what the next layer waits for. Use it on decode steps of one sequence
(`TRACE_RUNS="-d 4096 -p 0 -n 32|16" bash gpu/run.sh trace`), where the attention is one launch a
layer.
"""
import re
import statistics
import sys

from trace_summary import load

ATTENTION = re.compile(r"flash_attn_ext_(vec|f16|tile)|k_fa_int2|k_fa_partial")
COMBINE = re.compile(r"combine")
ROPE = re.compile(r"rope")


def kernels(path: str) -> list[tuple[int, int, str]]:
    """The kernel records (start, end, name) by start."""
    recs, _ = load(path)
    return [(start, end, name) for kind, start, end, name, _ in recs if kind == "K"]


def chains(recs: list[tuple[int, int, str]]) -> list[tuple[float, float, float, float]]:
    """(writes, attention, combine, total) per layer, µs."""
    out = []
    for i, (_, a_end, name) in enumerate(recs):
        if not ATTENTION.search(name) or i + 1 >= len(recs) or not COMBINE.search(recs[i + 1][2]):
            continue
        r = i - 1
        while r >= 0 and not ROPE.search(recs[r][2]):
            r -= 1
        if r < 0:
            continue
        rope_end = recs[r][1]
        before_end = max(e for _, e, _ in recs[r:i])  # the last launch before the attention
        c_end = recs[i + 1][1]
        out.append(((before_end - rope_end) / 1e3, (a_end - before_end) / 1e3, (c_end - a_end) / 1e3, (c_end - rope_end) / 1e3))
    return out


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(f"{'trace':40s} {'layers':>6s} {'writes':>7s} {'attention':>9s} {'combine':>7s} {'total':>7s}  (medians, us)")
    for path in sys.argv[1:]:
        c = chains(kernels(path))
        if not c:
            sys.exit(f"{path}: no attention launch followed by a combine")
        med = [statistics.median(x) for x in zip(*c)]
        print(f"{path[-40:]:40s} {len(c):6d} {med[0]:7.2f} {med[1]:9.2f} {med[2]:7.2f} {med[3]:7.2f}")


if __name__ == "__main__":
    main()

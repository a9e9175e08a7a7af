#!/usr/bin/env python3
"""Where the time of the last decode calls goes, from gpu/trace/kernel_trace.cpp traces.

    python gpu/trace_summary.py N A.trace [B.trace]

A decode call ends with its device-to-host copy of the logits, so the calls are the stretches
between those copies. For the last N calls of each trace (N = 1: the timed prefill ubatch of
`llama-bench -p 512 -n 0 -r 1`; N = 16: the last 16 tokens of `-n 32`), per call on average:
- wall: from the end of the previous call's copy to the end of this one's (host time included);
- GPU busy: the union of the kernel, copy and memset intervals; idle = wall - busy, the time the
  GPU waited for the host (launches, graph updates, synchronization);
- by kernel name, the time and the launch count; with two traces, side by side, largest
  difference (A - B) first, only names that differ by more than 1 us a call;
- the host's two gaps, medians over the calls: from the previous call's copy to this call's
  first input copy (the host between steps: the batch, the cache's slots, the graph's inputs
  such as the mask), and from the last input copy to the first kernel.
"""
import collections
import lzma
import re
import shutil
import subprocess
import sys


def load(path: str) -> tuple[list[tuple], list[tuple]]:
    """The device records (kernels, copies, memsets) by start, and the graph launches (start, end).
    (A trace as gpu/run.sh brings it back, PATH.xz, is read as well.)"""
    recs, launches = [], []
    for line in (lzma.open(path, "rt") if path.endswith(".xz") else open(path)):
        f = line.rstrip("\n").split("\t")
        if f[0] == "D":
            sys.exit(f"{path}: CUPTI dropped {f[1]} records; the trace has holes")
        if f[0] in ("K", "C", "S"):
            recs.append((f[0], int(f[1]), int(f[2]), f[6] if f[0] == "K" else f[5], f[6] if f[0] != "K" else ""))
        elif f[0] == "R" and f[6].startswith("cudaGraphLaunch"):
            launches.append((int(f[1]), int(f[2])))
    if not recs:
        sys.exit(f"{path}: no records (was the injection library loaded?)")
    return sorted(recs, key=lambda r: r[1]), launches


def median(x: list[float]) -> float:
    return sorted(x)[len(x)//2] if x else float("nan")


def graph_launch_us(cs: list[list[tuple]], launches: list[tuple]) -> float:
    """Median duration of the graph launch that begins within each call, us (nan: no API records)."""
    return median([(e - s)/1e3 for c in cs for s, e in launches if c[0][2] <= s < c[-1][1]])


def short_names(mangled: set[str]) -> dict[str, str]:
    names = list(mangled)
    plain = names
    if shutil.which("c++filt"):
        plain = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    out = {}
    for m, p in zip(names, plain):
        p = re.sub(r"^void ", "", p)
        p = re.sub(r"[<(].*", "", p).strip()
        out[m] = p.split("::")[-1][:40] if "::" in p and not p.startswith("cutlass") else p[:40]
    return out


def calls(recs: list[tuple], n: int) -> list[list[tuple]]:
    # a call: everything after the previous DtoH copy, up to and including its own DtoH copy
    ends = [i for i, r in enumerate(recs) if r[0] == "C" and r[3] == "2"]
    if len(ends) < n + 1:
        sys.exit(f"only {len(ends)} device-to-host copies in the trace, {n + 1} needed")
    return [recs[ends[j - 1]:ends[j] + 1] for j in range(len(ends) - n, len(ends))]


def busy_ns(recs: list[tuple]) -> int:
    total, cur_s, cur_e = 0, None, None
    for r in sorted(recs[1:], key=lambda r: r[1]):
        if cur_e is None or r[1] > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0
            cur_s, cur_e = r[1], r[2]
        else:
            cur_e = max(cur_e, r[2])
    return total + ((cur_e - cur_s) if cur_e is not None else 0)


def host_gaps(cs: list[list[tuple]]) -> tuple[float, float]:
    """Median host gaps of the calls, us: before the first input copy, and inputs to first kernel."""
    before, inputs = [], []
    for c in cs:
        rs = c[1:]
        first_k = next(r for r in rs if r[0] == "K")
        copies = [r for r in rs if r[0] == "C" and r[1] < first_k[1]]
        if copies:
            before.append(copies[0][1] - c[0][2])
            inputs.append(first_k[1] - max(r[2] for r in copies))
    return median(before)/1e3, median(inputs)/1e3


def summarize(path: str, n: int):
    recs, launches = load(path)
    cs = calls(recs, n)
    names = short_names({r[3] for c in cs for r in c if r[0] == "K"})
    t, cnt = collections.Counter(), collections.Counter()
    wall = busy = 0
    for c in cs:
        wall += c[-1][2] - c[0][2]   # from the previous copy's end (c[0] is that copy)
        busy += busy_ns(c)
        for r in c[1:]:
            key = names[r[3]] if r[0] == "K" else {"C": "(copy kind " + r[3] + ")", "S": "(memset)"}[r[0]]
            t[key] += (r[2] - r[1])/1e3/n
            cnt[key] += 1
    return wall/1e3/n, busy/1e3/n, t, cnt, host_gaps(cs), graph_launch_us(cs, launches)


def main():
    n = int(sys.argv[1])
    res = [(p, summarize(p, n)) for p in sys.argv[2:4]]
    for p, (wall, busy, t, cnt, (before, inputs), launch) in res:
        print(f"{p}: last {n} call(s), per call: wall {wall:.1f} us, GPU busy {busy:.1f} us, "
              f"GPU idle {wall - busy:.1f} us, {sum(cnt.values())/n:.0f} launches, kernel time {sum(t.values()):.1f} us; "
              f"host gaps (medians): before the inputs {before:.1f} us, inputs to first kernel {inputs:.1f} us"
              + (f"; graph launch (median) {launch:.1f} us" if launch == launch else ""))
    (_, (_, _, ta, ca, _, _)), (_, (_, _, tb, cb, _, _)) = res[0], res[-1]
    keys = sorted(set(ta) | set(tb), key=lambda k: -(ta[k] - tb[k]) if len(res) > 1 else -ta[k])
    for k in keys:
        if len(res) == 1:
            print(f"  {ta[k]:10.1f} us ({ca[k]/n:5.0f}x)  {k}")
        elif abs(ta[k] - tb[k]) > 1.0:
            print(f"  {ta[k]:10.1f} us ({ca[k]/n:5.0f}x)  {tb[k]:10.1f} us ({cb[k]/n:5.0f}x)  diff {ta[k] - tb[k]:9.1f}  {k}")


if __name__ == "__main__":
    main()

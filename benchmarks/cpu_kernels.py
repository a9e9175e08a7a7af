#!/usr/bin/env python3
"""CPU kernel throughput of oscar2 against q4_0 (and q8_0), measured side by side in one run.

    .venv/bin/python benchmarks/cpu_kernels.py [--mib 64] [--reps 5]

A benchmark, not a test: it prints numbers and ratios, it asserts nothing. Both types go
through ggml's own CPU type traits of the installed patched build (`from_float`, the
quantization of a cache write, and `vec_dot`, the K·Q product of CPU flash attention),
single-threaded, on the same Gaussian data, one long row per call so that the ctypes call
costs nothing next to the kernel. oscar2 is measured for both block sizes: G=128 (head_dim
>= 128) and G=64 (head_dim 64, the bundled model). A cache write of oscar2 also clips each
group at the layer's clip ratio, which `from_float` (no clip) does not: the last rows time that
write at the reference ratios of K (0.96) and V (0.92).
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from oscar_gguf.format.gguf_keys import DEFAULT_CLIP_K, DEFAULT_CLIP_V
from oscar_gguf.format.oscar2 import OSCAR2_64_TYPE_ID, OSCAR2_TYPE_ID
from oscar_gguf.ggml_ctypes import GGML

TYPES = {"q4_0": 2, "q8_0": 8, "oscar2": OSCAR2_TYPE_ID, "oscar2_64": OSCAR2_64_TYPE_ID}


def best_of(reps: int, fn) -> float:
    """Fastest of `reps` runs, in seconds (the least disturbed by other processes)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="f32 input per call, MiB (default 64)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    g = GGML()
    n = args.mib * (1 << 20) // 4
    n -= n % 256
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    y = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    print(f"{platform.processor() or platform.machine()}, 1 thread, {n / 1e6:.1f} M elements per call, "
          f"best of {args.reps}")
    rows = {}
    for name, t in TYPES.items():
        tr = g.cpu_traits(t)
        q = g.cpu_from_float(t, x)
        quant_s = best_of(args.reps, lambda: g.cpu_from_float(t, x))
        # y in the type's vec_dot_type (q8_0 for q4_0/q8_0, f32 for oscar2)
        yq = g.cpu_from_float(tr.vec_dot_type, y) if tr.vec_dot_type not in (0,) else y
        dot_s = best_of(args.reps, lambda: g.vec_dot(t, q, yq, n))
        rows[name] = (n / quant_s / 1e6, n / dot_s / 1e6, len(q) * 8 / n)
    base = rows["q4_0"]
    print(f"{'type':10s} {'bits/el':>8s} {'quantize Mel/s':>15s} {'vs q4_0':>8s} {'vec_dot Mel/s':>14s} {'vs q4_0':>8s}")
    for name, (qr, dr, bits) in rows.items():
        print(f"{name:10s} {bits:8.2f} {qr:15.1f} {qr / base[0]:7.2f}x {dr:14.1f} {dr / base[1]:7.2f}x")
    print(f"{'cache write':16s} {'quantize Mel/s':>15s} {'vs q4_0':>8s}")
    for group in (128, 64):
        for side, clip in (("K", DEFAULT_CLIP_K), ("V", DEFAULT_CLIP_V)):
            qs = best_of(args.reps, lambda: g.oscar2_quantize(x, group, clip))
            qr = n / qs / 1e6
            print(f"G={group:<3d} {side} c={clip:.2f} {qr:15.1f} {qr / base[0]:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

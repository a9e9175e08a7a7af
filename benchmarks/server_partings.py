#!/usr/bin/env python3
"""How far a greedy answer moves with the ubatch shape alone: the numbers behind TIE_NATS.

    .venv/bin/python benchmarks/server_partings.py [-n 48] [--types f16,oscar2] [MODEL]

A study, not a test. llama-server on the CPU (-np 8, one thread, tests/test_hardening_server.py's
settings and prompts, the oscar2 runs with its window of 16 + 64), each prompt sent alone, once to
a server with ubatches of 512 and once to one with ubatches of 16. llama.cpp's CPU flash
attention takes its tiled path for 64 query rows or more and the row-by-row one below that, so
the two servers differ in nothing but that. Per KV type it prints where the greedy answers part
(prompt, step, by how much the first server's choice led the token the second took) and the
largest change of a top token's log-probability before any parting. Default model: the bundled
one with random rotations, as the test builds it.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import test_hardening_server as hs  # noqa: E402  (the test's prompts, requests and criterion)
from gguf_fixtures import with_rotations  # noqa: E402
from oscar_gguf import bundled_model_path  # noqa: E402
from oscar_gguf.runtime import LlamaServer  # noqa: E402


def answers(model: Path, kv: str, ubatch: int, n: int) -> dict[int, list]:
    cache = hs.OSCAR_WINDOW if kv == "oscar2" else ["-ctk", kv, "-ctv", kv, "-fa", "on"]
    args = ["-c", "4096", "-np", "8", "-t", hs.THREADS, "--no-warmup", "-b", str(max(64, ubatch)), "-ub", str(ubatch), *cache]
    with LlamaServer(model, args, start_timeout=180) as srv:
        out = {}
        for pi, prompt in enumerate(hs.PROMPTS):
            status, r = hs.post(srv.port, "/completion", hs.body(prompt, n=n, **hs.GREEDY))
            if status != 200:
                raise SystemExit(f"server_partings: prompt {pi}: HTTP {status}")
            out[pi] = hs.steps(r)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF (default: the bundled model with random rotations)")
    ap.add_argument("-n", type=int, default=48, help="greedy tokens per prompt (default 48)")
    ap.add_argument("--types", default="f16,oscar2")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model) if a.model else with_rotations(bundled_model_path(), Path(tmp) / "random.gguf", "random")
        for kv in a.types.split(","):
            big, small = answers(model, kv, 512, a.n), answers(model, kv, 16, a.n)
            partings, moved = [], 0.0
            for pi in big:
                p = hs.parting(big[pi], small[pi])
                if p is not None:
                    partings.append(f"prompt {pi} step {p[0]} (lead {p[3]:.3f})")
                before = big[pi][:p[0]] if p is not None else big[pi]
                for (x, top), (_, other) in zip(before, small[pi]):
                    moved = max(moved, abs(top[x] - other[x]))
            print(f"{kv}: {len(partings)} of {len(big)} answers part: {', '.join(partings) or 'none'}; "
                  f"largest change of a top token's log-probability before any parting: {moved:.3f} nats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Redraw docs/gpu-h100-tg.png (decode tokens/s against depth) from the H100 results in gpu/results/.

    .venv/bin/python gpu/plot_tg.py [--out PATH]

Panels: the full benchmark of each shape (gpu/run.sh bench, 2 repetitions, plus the d131072
run with 1), for the current kernels (gpu/results/h100-speed/) and for those of 6239e1a
(gpu/results/h100-speed-baseline/), to show the change.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from oscar_gguf.measure.plots import rate_vs_depth  # noqa: E402

RESULTS = REPO / "gpu" / "results"
CURRENT = RESULTS / "h100-speed"
BASELINE = RESULTS / "h100-speed-baseline"
PLOT = REPO / "docs" / "gpu-h100-tg.png"


def bench_series(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tg points of bench_<type>.json, plus the d131072 figures of d131072.json."""
    series: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(folder.glob("bench_*.json")):
        kv = f.stem[len("bench_"):]
        series[kv] = [(r["n_depth"], r["avg_ts"]) for r in json.loads(f.read_text()) if r["n_gen"] and not r["n_prompt"]]
    deep = folder / "d131072.json"
    if deep.exists():
        for kv, ts in json.loads(deep.read_text())["tg32_d131072_tokens_per_s"].items():
            series.setdefault(kv, []).append((131072, ts))
    return {kv: series[kv] for kv in ("f16", "q8_0", "q4_0", "oscar2") if kv in series}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PLOT, help=f"where to write the PNG (default: {PLOT.relative_to(REPO)})")
    args = ap.parse_args()
    panels = {
        "Llama-3.1-8B shape, tg (9871ad2, 2026-11-25)": bench_series(CURRENT / "llama3-8b"),
        "Qwen3-8B shape, tg (9871ad2, 2026-11-25)": bench_series(CURRENT / "qwen3-8b"),
        "Llama-3.1-8B shape, tg (6239e1a, 2026-11-23)": bench_series(BASELINE / "llama3-8b"),
        "Qwen3-8B shape, tg (6239e1a, 2026-11-23)": bench_series(BASELINE / "qwen3-8b"),
    }
    out = rate_vs_depth(panels, args.out,
                        "decode tokens/s against depth, H100, llama-bench -fa 1, random q4_0 weights")
    print(out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Redraw docs/gpu-h100-tg.png (decode tokens/s against depth) from the H100 results in gpu/results/.

    .venv/bin/python gpu/plot_tg.py

Panels: the full benchmark of each shape (gpu/run.sh bench, 2 repetitions, plus the d131072
run), and the `gpu/run.sh quick` runs of the newest kernels (f16 and oscar2, same run).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from oscar_gguf.plots import rate_vs_depth  # noqa: E402

RESULTS = REPO / "gpu" / "results"


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


def quick_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    """tg lines of a `gpu/run.sh quick` log: 'quick T tgN dD: X tok/s'."""
    series: dict[str, list[tuple[int, float]]] = {}
    for m in re.finditer(r"quick (\S+) tg\d+ d(\d+): ([\d.]+) tok/s", path.read_text()):
        series.setdefault(m.group(1), []).append((int(m.group(2)), float(m.group(3))))
    return {kv: series[kv] for kv in ("f16", "oscar2") if kv in series}


def main() -> None:
    panels = {
        "Llama-3.1-8B shape, tg (6239e1a, 2 reps)": bench_series(RESULTS / "2026-11-23-rot-llama3-8b"),
        "Qwen3-8B shape, tg (6239e1a, 2 reps)": bench_series(RESULTS / "2026-11-23-rot-qwen3-8b"),
        "Llama-3.1-8B, 1054f79 (2 reps)":
            quick_series(RESULTS / "2026-11-24-window-lanes" / "quick-llama3-8b.txt"),
        "Qwen3-8B, 1054f79 (1 rep)":
            quick_series(RESULTS / "2026-11-24-window-lanes" / "quick-qwen3-8b-1rep.txt"),
    }
    out = rate_vs_depth(panels, REPO / "docs" / "gpu-h100-tg.png",
                        "decode tokens/s against depth, H100, llama-bench -fa 1, random q4_0 weights")
    print(out)


if __name__ == "__main__":
    main()

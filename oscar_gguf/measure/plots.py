"""Figures of the measuring tools, as PNG files that appear whole or not at all.

matplotlib runs with the Agg backend: the tools run on headless machines and in CI.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from ..atomic import atomic_path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str | Path) -> Path:
    plt = _pyplot()
    with atomic_path(path) as tmp:
        # the format is given explicitly: the temporary name does not end in .png
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    return Path(path)


def kld_vs_bits(points: Sequence[tuple[str, float, float]], path: str | Path, title: str,
                footnote: str = "") -> Path:
    """Scatter of mean KLD (log scale) against bits per element, one labelled point each.

    points: (label, bits_per_element, mean_kld); points with KLD <= 0 (the f16 reference)
    cannot sit on a log axis and are listed in the footnote instead.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    shown = [(lbl, b, k) for lbl, b, k in points if k is not None and k > 0 and b is not None]
    zero = [lbl for lbl, b, k in points if k is not None and k <= 0]
    markers = "osD^v<>pXh*"
    for i, (lbl, b, k) in enumerate(shown):
        ax.scatter([b], [k], s=60, marker=markers[i % len(markers)], label=lbl, zorder=3)
        ax.annotate(lbl, (b, k), textcoords="offset points", xytext=(6, 4), fontsize=8)
    if shown:
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        xs = [b for _, b, _ in shown]
        ax.set_xlim(min(xs) / 1.25, max(max(xs) * 1.4, 4.0))
        ticks = sorted({2.0, 2.5, 4.0, 4.5, 8.0, 8.5, 16.0} | {round(x, 2) for x in xs})
        ticks = [t for t in ticks if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks], fontsize=8)
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no setting produced a KLD", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("KV bits per element (effective, at this context)")
    ax.set_ylabel("mean KL divergence vs f16 KV (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    notes = [f"{', '.join(zero)}: reference, KLD 0"] if zero else []
    if footnote:
        notes.append(footnote)
    if notes:
        fig.text(0.01, -0.02, "\n".join(notes), fontsize=7, va="top")
    return _save(fig, path)


def rate_vs_depth(panels: dict[str, dict[str, list[tuple[int, float]]]], path: str | Path, title: str) -> Path:
    """One panel per test (e.g. "pp512", "tg64"): tokens/s against context depth, a line per KV type."""
    plt = _pyplot()
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.2), squeeze=False)
    for ax, (test, series) in zip(axes[0], panels.items()):
        for label, pts in series.items():
            pts = sorted(pts)
            if pts:
                ax.plot([d for d, _ in pts], [v for _, v in pts], marker="o", label=label)
        ax.set_title(test)
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel("tokens / s")
        depths = sorted({d for pts in series.values() for d, _ in pts})
        if len(depths) > 2 and depths[-1] > 0 and depths[1] > 0 and depths[-1] / max(depths[1], 1) >= 8:
            ax.set_xscale("symlog", linthresh=max(depths[1], 1))
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def accuracy_heatmaps(grids: dict[str, list[list[float | None]]], lengths: Sequence[int],
                      depths: Sequence[float], path: str | Path, title: str) -> Path:
    """One heat map per setting: passkey accuracy by context length (rows) and depth (columns)."""
    import numpy as np
    plt = _pyplot()
    n = max(1, len(grids))
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + 1.2, (0.45 * len(lengths) + 1.8) * rows + 0.4),
                             squeeze=False, layout="constrained")
    im = None
    for k, (ax, (name, grid)) in enumerate(zip(axes.flat, grids.items())):
        a = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
        im = ax.imshow(a, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(depths)))
        ax.set_xticklabels([f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)))
        ax.set_yticklabels([str(x) for x in lengths], fontsize=7)
        ax.set_xlabel("needle depth", fontsize=8)
        if k % cols == 0:
            ax.set_ylabel("context tokens", fontsize=8)
        for i in range(a.shape[0]):
            for j in range(a.shape[1]):
                txt = "–" if np.isnan(a[i, j]) else f"{a[i, j]:.0%}"
                ax.text(j, i, txt, ha="center", va="center", fontsize=7)
    for ax in list(axes.flat)[len(grids):]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.9, label="accuracy")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)

"""Reading llama-perplexity's output: the statistics of a `--kl-divergence` run, and the PPL
and chunk count of the `--kl-divergence-base` reference run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf)"
_PM = r"\s*(?:±|\+/-)\s*"
_RE_MEAN_PPL = re.compile(r"Mean PPL\(Q\)\s*:\s*" + _NUM + _PM + _NUM)
_RE_BASE_PPL = re.compile(r"Mean PPL\(base\)\s*:\s*" + _NUM + _PM + _NUM)
_RE_MEAN_KLD = re.compile(r"Mean\s+KLD:\s*" + _NUM + _PM + _NUM)
_RE_KLD_99 = re.compile(r"99\.0%\s+KLD:\s*" + _NUM)
_RE_SAME_TOP = re.compile(r"Same top p:\s*" + _NUM + _PM + _NUM + r"\s*%")
_RE_FINAL = re.compile(r"Final estimate: PPL = " + _NUM + _PM + _NUM)
_RE_CHUNKS = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks")
RE_TOO_FEW_TOKENS = re.compile(r"tokenizes to only (\d+) tokens")
RE_KLD_CHUNK = re.compile(r"^\s*(\d+)\s+" + _NUM + _PM + _NUM + r"\s+" + _NUM + _PM + _NUM + r"\s+" + _NUM
                           + _PM + _NUM + r"\s+" + _NUM + _PM + _NUM + r"\s*%\s+" + _NUM + _PM + _NUM + r"\s*%",
                           re.M)
RE_PPL_CHUNK = re.compile(r"\[(\d+)\]" + _NUM + ",")


@dataclass
class KLDStats:
    ppl: float | None = None
    ppl_err: float | None = None
    ppl_base: float | None = None
    mean_kld: float | None = None
    mean_kld_err: float | None = None
    kld_99: float | None = None
    same_top_p: float | None = None  # percent
    same_top_p_err: float | None = None


def parse_kld_output(log: str) -> KLDStats | None:
    """Statistics of a `--kl-divergence` run, or None if it printed none.

    llama-perplexity prints its final statistics only from 100 scored tokens on; below
    that the last per-chunk line still gives PPL, mean KLD and same-top-p (no 99% KLD).
    """
    s = KLDStats()
    if m := _RE_MEAN_PPL.search(log):
        s.ppl, s.ppl_err = float(m[1]), float(m[2])
    if m := _RE_BASE_PPL.search(log):
        s.ppl_base = float(m[1])
    if m := _RE_MEAN_KLD.search(log):
        s.mean_kld, s.mean_kld_err = float(m[1]), float(m[2])
    if m := _RE_KLD_99.search(log):
        s.kld_99 = float(m[1])
    if m := _RE_SAME_TOP.search(log):
        s.same_top_p, s.same_top_p_err = float(m[1]), float(m[2])
    if s.mean_kld is None:
        rows = RE_KLD_CHUNK.findall(log)
        if not rows:
            return None
        r = rows[-1]
        s.ppl, s.ppl_err = float(r[1]), float(r[2])
        s.mean_kld, s.mean_kld_err = float(r[5]), float(r[6])
        s.same_top_p, s.same_top_p_err = float(r[9]), float(r[10])
    return s


def parse_base_output(log: str) -> tuple[float | None, float | None, int | None]:
    """(PPL, its uncertainty, chunks) of a `--kl-divergence-base` run."""
    ppl = err = chunks = None
    if m := _RE_FINAL.search(log):
        ppl, err = float(m[1]), float(m[2])
    if m := _RE_CHUNKS.search(log):
        chunks = int(m[1])
    return ppl, err, chunks

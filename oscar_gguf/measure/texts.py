"""The texts the package ships: the held-out evaluation text and the calibration corpus, and
the check that an evaluation text is not (part of) the calibration text.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
EVAL_TEXT = DATA_DIR / "eval" / "botchan.txt"
CALIB_DIR = DATA_DIR / "calib"


def _normalized_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _shingles(words: list[str], n: int = 8) -> set[int]:
    return {hash(tuple(words[i:i + n])) for i in range(0, max(0, len(words) - n + 1))}


def read_text_file(p: Path) -> str:
    import bz2
    import gzip
    import lzma
    opener = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}.get(p.suffix, open)
    with opener(p, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def calibration_texts(calib_dir: Path = CALIB_DIR) -> dict[str, str]:
    """The calibration corpus shipped with the package, file name -> text."""
    out = {}
    if not calib_dir.is_dir():
        return out
    for p in sorted(calib_dir.rglob("*")):
        if not p.is_file() or p.name.upper().startswith(("SOURCES", "LICENSE", "README")):
            continue
        if p.suffix in (".txt", ".gz", ".xz", ".bz2") or p.name.endswith(".txt"):
            try:
                out[str(p.relative_to(calib_dir))] = read_text_file(p)
            except OSError:
                continue
    return out


def calibration_overlap(text: str, calib: dict[str, str] | None = None, n: int = 8) -> tuple[float, str | None]:
    """Share of the text's word 8-grams that also occur in the calibration corpus, and the
    calibration file it overlaps most. Case, punctuation and line breaks are ignored, so a
    re-wrapped or re-encoded copy of the calibration text is still caught."""
    calib = calibration_texts() if calib is None else calib
    words = _normalized_words(text)
    mine = _shingles(words, n)
    if not mine:
        return 0.0, None
    best, best_name = 0.0, None
    for name, ctext in calib.items():
        share = len(mine & _shingles(_normalized_words(ctext), n)) / len(mine)
        if share > best:
            best, best_name = share, name
    return best, best_name


def overlap_warning(text_path: Path, text: str, info_calib_corpus: str | None = None,
                    threshold: float = 0.05) -> str | None:
    """A warning when the evaluation text is (part of) the calibration text, else None."""
    share, name = calibration_overlap(text)
    if share >= threshold:
        return (f"WARNING: {share:.0%} of {text_path.name} also occurs in the calibration corpus "
                f"({name}); KLD on calibration text overstates OSCAR's quality. Use held-out text.")
    if info_calib_corpus:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if text_path.name in info_calib_corpus or digest[:16] in info_calib_corpus:
            return (f"WARNING: the model's calibration provenance ({info_calib_corpus!r}) names "
                    f"{text_path.name}; evaluate on held-out text instead.")
    return None

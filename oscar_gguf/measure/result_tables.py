"""Benchmark results as tables: aligned text, Markdown and JSON. A result is its rows (dataclasses)
and its meta (model, date, machine, command); a subclass says how a row reads as cells."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar


def aligned(table: list[list[str]]) -> list[str]:
    """Each column right-aligned to its widest cell."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in table]


@dataclass
class ResultTable:
    rows: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    TITLE: ClassVar[str] = ""
    N_LEFT: ClassVar[int] = 1   # columns of names (left-aligned in Markdown); the rest are figures

    def caption(self) -> str:
        raise NotImplementedError

    def table(self) -> list[list[str]]:
        """The header row, then a row of cells per result row."""
        raise NotImplementedError

    def to_text(self) -> str:
        return "\n".join([self.caption(), *aligned(self.table())])

    def to_markdown(self) -> str:
        m, t = self.meta, self.table()
        head = [f"# {self.TITLE}: {Path(m.get('model', '')).name}", "",
                f"{self.caption()}; {m.get('date')}, {m.get('machine')}.", "",
                *([f"Command: `{m['command']}`", ""] if m.get("command") else [])]
        lines = ["| " + " | ".join(t[0]) + " |", "|" + "---|" * self.N_LEFT + "---:|" * (len(t[0]) - self.N_LEFT)]
        return "\n".join(head + lines + ["| " + " | ".join(row) + " |" for row in t[1:]])

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "rows": [asdict(r) for r in self.rows]}, indent=2)

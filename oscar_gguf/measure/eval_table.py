"""The table `oscar eval` writes: one row per KV setting, as text, Markdown, CSV and JSON."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .csv_rows import dataclass_rows_csv


@dataclass
class EvalRow:
    key: str
    setting: str
    cache_type: str
    bits_per_element: float | None = None
    kv_mib: float | None = None      # main cache + high-precision window
    ppl: float | None = None
    ppl_err: float | None = None
    mean_kld: float | None = None
    mean_kld_err: float | None = None
    kld_99: float | None = None
    same_top_p: float | None = None
    seconds: float | None = None
    status: str = "ok"       # ok | reference | skipped | failed
    note: str = ""
    window_mib: float | None = None  # the window's share of kv_mib


COLUMNS = [("setting", "setting"), ("bits/elem", "bits_per_element"), ("KV MiB", "kv_mib"),
           ("PPL", "ppl"), ("mean KLD", "mean_kld"), ("99% KLD", "kld_99"), ("same top-p %", "same_top_p")]


def _fmt(attr: str, v) -> str:
    if v is None:
        return "—"
    if attr == "bits_per_element":
        return f"{v:.3g}" if v < 10 else f"{v:.1f}"
    if attr == "kv_mib":
        return f"{v:.2f}"
    if attr == "ppl":
        return f"{v:.4f}"
    if attr in ("mean_kld", "kld_99"):
        return f"{v:.5f}"
    if attr == "same_top_p":
        return f"{v:.2f}"
    return str(v)


@dataclass
class Table:
    rows: list[EvalRow]
    meta: dict = field(default_factory=dict)

    def row(self, key: str) -> EvalRow | None:
        return next((r for r in self.rows if r.key == key), None)

    def _cells(self) -> list[list[str]]:
        return [[_fmt(a, getattr(r, a)) if a != "setting" else r.setting for _, a in COLUMNS] for r in self.rows]

    def notes(self) -> list[str]:
        return [f"{r.setting}: {r.status}{' – ' + r.note if r.note else ''}"
                for r in self.rows if r.status != "ok"]

    def to_text(self) -> str:
        heads = [h for h, _ in COLUMNS]
        cells = self._cells()
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
        line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))
        out = [line(heads), "  ".join("-" * w for w in widths), *(line(c) for c in cells)]
        if self.notes():
            out += ["", "notes:", *("  " + n for n in self.notes())]
        return "\n".join(out)

    def to_markdown(self) -> str:
        heads = [h for h, _ in COLUMNS]
        out = ["| " + " | ".join(heads) + " |", "|" + "|".join(["---"] + ["---:"] * (len(heads) - 1)) + "|"]
        out += ["| " + " | ".join(c) + " |" for c in self._cells()]
        if self.notes():
            out += [""] + [f"- {n}" for n in self.notes()]
        return "\n".join(out)

    def to_csv(self) -> str:
        return dataclass_rows_csv(self.rows, EvalRow)

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "rows": [asdict(r) for r in self.rows]}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Table":
        d = json.loads(text)
        return cls(rows=[EvalRow(**r) for r in d["rows"]], meta=d.get("meta", {}))

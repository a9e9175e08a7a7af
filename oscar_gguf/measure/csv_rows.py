"""Result rows as CSV, for every measuring tool's table."""
from __future__ import annotations

import csv
import io
from dataclasses import asdict
from typing import Sequence


def dataclass_rows_csv(rows: Sequence, row_type: type) -> str:
    """CSV of dataclass rows, one column per field of row_type, None as an empty cell."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(row_type.__dataclass_fields__), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in asdict(r).items()})
    return buf.getvalue()

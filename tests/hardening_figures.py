"""The hardening tests' measured figures: printed, and collected as JSON in
$OSCAR_HARDENING_OUT when it is set (docs/hardening.md quotes them)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def record(section: str, values: dict) -> None:
    print(f"\n[hardening] {section}: {json.dumps(values)}")
    out = os.environ.get("OSCAR_HARDENING_OUT")
    if out:
        p = Path(out)
        data = json.loads(p.read_text()) if p.exists() else {}
        data[section] = values
        p.write_text(json.dumps(data, indent=1))

"""`oscar fuzz` (register) and `python -m oscar_gguf.fuzz`, which also starts the workers
(`--worker loader|python`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .runner import Fuzzer, run_fuzz
from .workers import worker_main

DESCRIPTION = "`oscar fuzz`: bounded fuzzing of everything that parses OSCAR inputs."

def _add_args(ap: argparse.ArgumentParser):
    ap.add_argument("--seconds", type=float, default=60, help="time budget for the whole run (default 60)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated cases (default 0)")
    ap.add_argument("--targets", default="gguf,artifact,zoo", help="comma list of gguf, artifact, zoo")
    ap.add_argument("--case-timeout", type=float, default=20, help="seconds before a case counts as a hang (default 20)")
    ap.add_argument("--failures", type=Path, help="folder for failing cases (default: a temp folder)")
    ap.add_argument("--json", type=Path, help="write the report as JSON here")
    ap.add_argument("--replay", type=Path, help="run one saved case again (its case.json)")
    ap.add_argument("-q", "--quiet", action="store_true")


def _cmd(args) -> int:
    targets = [t for t in args.targets.split(",") if t]
    bad = [t for t in targets if t not in ("gguf", "artifact", "zoo")]
    if bad:
        print(f"oscar fuzz: error: unknown target {bad[0]!r}", file=sys.stderr)
        return 2
    if args.replay:
        case = json.loads(Path(args.replay).read_text())["case"]
        fz = Fuzzer(0, args.seed, targets, failures_dir=args.failures)
        rep = fz.replay(case)
    else:
        rep = run_fuzz(args.seconds, args.seed, targets, failures_dir=args.failures,
                       case_timeout=args.case_timeout, log=None if args.quiet else print)
    print(rep.summary())
    if args.json:
        args.json.write_text(json.dumps(rep.to_json(), indent=1, default=str))
    return 1 if rep.failures else 0


def register(subparsers) -> None:
    p = subparsers.add_parser("fuzz", help="fuzz the GGUF/artifact/RotationZoo readers and the llama.cpp loader")
    _add_args(p)
    p.set_defaults(func=_cmd)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1])
    ap = argparse.ArgumentParser(prog="oscar fuzz", description=DESCRIPTION)
    _add_args(ap)
    return _cmd(ap.parse_args(argv))

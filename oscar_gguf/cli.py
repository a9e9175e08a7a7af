"""`oscar` command line: one entry point with subcommands."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="oscar", description="OSCAR 2-bit KV cache for llama.cpp / GGUF")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the main job on the bundled model")
    d.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2-135M)")
    sub.add_parser("version", help="print versions of the package and the patched library")
    from .measure_cli import register as _reg_measure
    _reg_measure(sub)
    from .calibrate.cli import register as _reg_cal
    _reg_cal(sub)
    args = ap.parse_args(argv)
    if getattr(args, "func", None) is not None:
        return args.func(args)
    if args.cmd == "version":
        from . import __version__
        from .runtime import patchset_version
        print(f"oscar-gguf {__version__}, libllama patch set {patchset_version()}")
        return 0
    if args.cmd == "demo":
        from .demo import run_demo
        return run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

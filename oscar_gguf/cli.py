"""`oscar` command line: one entry point with subcommands."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="oscar", description="OSCAR 2-bit KV cache for llama.cpp / GGUF")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the main job on the bundled model")
    d.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2-135M)")
    d.add_argument("--out", default="oscar-demo", help="output and cache folder (default ./oscar-demo)")
    d.add_argument("--quick", action="store_true", help="small sizes (CI): a few minutes on 2 CPU cores")
    d.add_argument("--force", action="store_true", help="redo every step, even if its results are cached")
    d.add_argument("--tokens", type=int, default=None, help="calibration tokens (default 4096; --quick 512)")
    d.add_argument("--seq-len", type=int, default=None, help="calibration chunk length (default 1024; --quick 512)")
    d.add_argument("--rotation", choices=("learned", "key-eigen-dc", "hadamard", "oscar"), default=None,
                   help="calibration rotation recipe (default key-eigen-dc; learned is better and much slower)")
    d.add_argument("--ctx", type=int, default=None, help="evaluation context (default 1024; --quick 512)")
    d.add_argument("--chunks", type=int, default=None, help="evaluation chunks (default 2; --quick 1)")
    d.add_argument("--text", default=None, help="held-out evaluation text (default: the shipped Botchan)")
    d.add_argument("--long-ctx", type=int, default=None, help="long context of the KV memory table (default 131072)")
    d.add_argument("--prompt-tokens", type=int, default=None, help="generation prompt tokens (default 768; --quick 400)")
    d.add_argument("--gen-tokens", type=int, default=None, help="generated tokens (default 32; --quick 16)")
    d.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for llama.cpp (default: all)")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    sub.add_parser("version", help="print versions of the package and the patched library")
    ins = sub.add_parser("inspect", help="show the OSCAR metadata and rotation health of a GGUF")
    ins.add_argument("model", help="GGUF file")
    sub.add_parser("convert", help="same as oscar-convert (see oscar-convert --help)", add_help=False)
    from .measure.cli import register as _reg_measure
    _reg_measure(sub)
    from .calibrate.cli import register as _reg_cal
    _reg_cal(sub)
    from .fuzz.cli import register as _reg_fuzz
    _reg_fuzz(sub)
    from .pypi_models import register as _reg_fetch
    _reg_fetch(sub)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        from .convert import main as convert_main
        return convert_main(argv[1:])
    args = ap.parse_args(argv)
    if getattr(args, "func", None) is not None:
        return args.func(args)
    if args.cmd == "version":
        from . import __version__
        from .runtime import patchset_version
        print(f"oscar-gguf {__version__}, libllama patch set {patchset_version()}")
        return 0
    if args.cmd == "inspect":
        from .convert import inspect_report
        from .format.gguf_read import GGUFError
        try:
            print(inspect_report(args.model))
        except GGUFError as e:
            print(f"oscar inspect: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "demo":
        from .measure.demo import run_demo
        return run_demo(args)
    return 2


def run_subcommands(register, argv: list[str] | None = None) -> int:
    """Parse argv with the subcommands that register(subparsers) adds, and run the chosen one:
    the stand-alone entries (`python -m oscar_gguf.calibrate.cli ...`) of a part of `oscar`."""
    ap = argparse.ArgumentParser(prog="oscar")
    sub = ap.add_subparsers(dest="cmd", required=True)
    register(sub)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

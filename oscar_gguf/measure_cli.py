"""`oscar eval`, `oscar synth` and `oscar bench`: the measuring tools on the command line.

`register(subparsers)` adds the three subcommands to the `oscar` parser; each sets
`func`, which returns the exit code. Bad input prints one line and exits with 2, the
way argparse does for its own errors.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return vals


def _float_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return vals


def _str_list(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return vals


def _chunks(text: str) -> int | None:
    if text == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def _command_line() -> str:
    return "oscar " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _fail(cmd: str, msg: str) -> int:
    print(f"oscar {cmd}: error: {msg}", file=sys.stderr)
    return 2


def _user_errors():
    from .evaluate import EvalError
    from .paths import MissingComponentError
    from .synth import SynthError
    return (EvalError, SynthError, MissingComponentError, FileNotFoundError, ValueError)


# ---- eval ------------------------------------------------------------------------------------


def cmd_eval(args) -> int:
    from . import evaluate, passkey
    try:
        if args.passkey:
            res = passkey.run_passkey(args.model, lengths=args.lengths, depths=args.depths, trials=args.trials,
                                      settings=args.settings or passkey.PASSKEY_SETTINGS, out_dir=args.out,
                                      n_threads=args.threads, extra_args=shlex.split(args.llama_args),
                                      seed=args.seed, progress=not args.no_progress, command=_command_line())
            print(res.to_text())
            print(f"\nwrote {args.out}/passkey.csv, passkey.json, passkey.txt"
                  + (", passkey.png" if res.trials else ""))
            return 0 if res.trials else 1  # every setting failed or was skipped
        table = evaluate.run_eval(args.model, text=args.text, ctx=args.ctx, chunks=args.chunks,
                                  settings=args.settings, out_dir=args.out, n_threads=args.threads,
                                  extra_args=shlex.split(args.llama_args), progress=not args.no_progress,
                                  reuse_base=not args.no_cache, command=_command_line())
    except _user_errors() as e:
        return _fail("eval", str(e))
    m = table.meta
    print(f"{Path(m['model']).name}, ctx {m['ctx']}, {m['chunks']} chunks of {Path(m['text']).name}, "
          f"{m['date']}, {m['machine']}")
    print(table.to_text())
    print(f"\nwrote {args.out}/eval.csv, eval.json, eval.md, eval.png")
    return 0


def _add_eval(sub) -> None:
    from .evaluate import SETTINGS
    from .passkey import DEFAULT_DEPTHS, PASSKEY_SETTINGS
    keys = ", ".join(f"{s.key} ({s.name})" for s in SETTINGS)
    p = sub.add_parser("eval", help="KV-cache quality vs f16 (KLD, PPL) on held-out text; --passkey for long context",
                       description="Runs llama-perplexity with f16 KV as the reference, then once per KV setting, "
                                   "on held-out text (never the calibration text). Settings: " + keys)
    p.add_argument("model", help="model GGUF (with OSCAR rotations for the OSCAR rows)")
    p.add_argument("--text", default=None, help="evaluation text (default: the shipped held-out corpus, Botchan)")
    p.add_argument("--ctx", type=_positive_int, default=2048, help="context per chunk (default 2048)")
    p.add_argument("--chunks", type=_chunks, default=16, help="chunks of --ctx tokens, or 'all' (default 16)")
    p.add_argument("--settings", type=_str_list, default=None,
                   help="comma-separated setting keys (default: all; with --passkey: "
                        + ",".join(PASSKEY_SETTINGS) + ")")
    p.add_argument("-o", "--out", default="oscar-eval", help="output folder (default ./oscar-eval)")
    p.add_argument("-t", "--threads", type=_positive_int, default=None, help="CPU threads for llama.cpp")
    p.add_argument("--llama-args", default="", help="extra flags for every llama.cpp run, e.g. \"-ngl 99\"")
    p.add_argument("--no-cache", action="store_true", help="redo the f16 reference run even if cached")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("long context (--passkey)")
    g.add_argument("--passkey", action="store_true", help="needle-in-a-haystack passkey retrieval instead of KLD")
    g.add_argument("--lengths", type=_int_list, default=None,
                   help="context lengths in tokens (default: halvings of the trained context, up to 4)")
    g.add_argument("--depths", type=_float_list, default=list(DEFAULT_DEPTHS),
                   help="needle depths in [0,1] (default " + ",".join(map(str, DEFAULT_DEPTHS)) + ")")
    g.add_argument("--trials", type=_positive_int, default=2, help="prompts per length and depth (default 2)")
    g.add_argument("--seed", type=int, default=1234, help="seed of the pass keys (default 1234)")
    p.set_defaults(func=cmd_eval)


# ---- synth -----------------------------------------------------------------------------------


def cmd_synth(args) -> int:
    from . import synth
    try:
        synth.write_synthetic(args.shape, args.weights, args.output, rotations=args.rotations, seed=args.seed,
                              vocab=args.vocab, overwrite=args.force, progress=not args.no_progress)
    except _user_errors() as e:
        return _fail("synth", str(e))
    return 0


def _add_synth(sub) -> None:
    from .synth import SHAPES, WEIGHT_TYPES
    shapes = ", ".join(f"{k} ({v.description})" for k, v in SHAPES.items())
    p = sub.add_parser("synth", help="random-weight GGUF with a real model's shapes, for speed work",
                       description="Writes a GGUF whose tensors have the shapes of a real model and random "
                                   "values (quantized types as raw random blocks). Shapes: " + shapes)
    p.add_argument("--shape", required=True, choices=list(SHAPES), metavar="SHAPE", help=", ".join(SHAPES))
    p.add_argument("--weights", default="q4_0", choices=list(WEIGHT_TYPES), help="weight type (default q4_0)")
    p.add_argument("--rotations", action="store_true",
                   help="add random orthogonal OSCAR rotations and the oscar.* metadata")
    p.add_argument("-o", "--output", required=True, help="output GGUF")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", default=None, help="vocab-only GGUF to copy the tokenizer from "
                                                 "(default: from the pinned llama.cpp tree)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_synth)


# ---- bench -----------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from . import bench
    from .synth import model_info
    try:
        if args.roofline_only:
            if not args.bandwidth:
                return _fail("bench", "--roofline-only needs --bandwidth GB/s")
            info = model_info(args.model)
            rows = bench.roofline(info, args.types, args.depths, args.bandwidth,
                                  window=bench._window_from_args(info, shlex.split(args.oscar_args)))
            print(bench.roofline_text(rows))
            return 0
        res = bench.run_bench(args.model, kv_types=args.types, depths=args.depths, n_prompt=args.p, n_gen=args.n,
                              ngl=args.ngl, reps=args.reps, n_threads=args.threads,
                              extra_args=shlex.split(args.llama_args), oscar_args=shlex.split(args.oscar_args),
                              out_dir=args.out, bandwidth_gbs=args.bandwidth, progress=not args.no_progress,
                              command=_command_line())
    except _user_errors() as e:
        return _fail("bench", str(e))
    print(f"{Path(res.meta['model']).name}, {res.meta['date']}, {res.meta['machine']}")
    print(res.to_text())
    if res.roofline:
        print()
        print(bench.roofline_text(res.roofline, res.meta.get("n_gen")))
    print(f"\nwrote {args.out}/bench.csv, bench.json, bench.txt" + (", bench.png" if res.rows else ""))
    return 0 if res.rows else 1


def _add_bench(sub) -> None:
    from .bench import DEFAULT_DEPTHS, DEFAULT_TYPES
    p = sub.add_parser("bench", help="llama-bench per KV type and depth, ratios vs f16, plot, roofline",
                       description="Runs llama-bench -fa 1 once per KV type at the same depths and prints "
                                   "tokens/s with ratios to f16.")
    p.add_argument("model", help="model GGUF (e.g. from `oscar synth`)")
    p.add_argument("--types", type=_str_list, default=list(DEFAULT_TYPES),
                   help="KV types (default " + ",".join(DEFAULT_TYPES) + ")")
    p.add_argument("-d", "--depths", type=_int_list, default=list(DEFAULT_DEPTHS),
                   help="context depths (default " + ",".join(map(str, DEFAULT_DEPTHS)) + ")")
    p.add_argument("-p", type=int, default=512, help="prompt tokens of the pp test (0: none; default 512)")
    p.add_argument("-n", type=int, default=64, help="generated tokens of the tg test (0: none; default 64)")
    p.add_argument("-ngl", type=int, default=99, help="layers on the GPU (default 99)")
    p.add_argument("-r", "--reps", type=_positive_int, default=None, help="repetitions (llama-bench default 5)")
    p.add_argument("-t", "--threads", type=_positive_int, default=None)
    p.add_argument("--llama-args", default="", help="extra llama-bench flags for every run")
    p.add_argument("--oscar-args", default="", help="extra flags for the oscar2 runs only, "
                                                    "e.g. \"--oscar-sink 0 --oscar-recent 0\"")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="measured copy bandwidth in GB/s: adds the memory roofline of decode")
    p.add_argument("--roofline-only", action="store_true", help="print the roofline without running llama-bench")
    p.add_argument("-o", "--out", default="oscar-bench", help="output folder (default ./oscar-bench)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench)


def register(subparsers) -> None:
    """Add eval, synth and bench to the `oscar` subcommands."""
    _add_eval(subparsers)
    _add_synth(subparsers)
    _add_bench(subparsers)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (python -m oscar_gguf.measure_cli ...), same as `oscar ...`."""
    ap = argparse.ArgumentParser(prog="oscar")
    sub = ap.add_subparsers(dest="cmd", required=True)
    register(sub)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""`oscar eval`, `synth`, `bench` (with `--serve`: llama-server under concurrent clients), `agreement`
and `check-rows`: the measuring tools on the command line.

`register(subparsers)` adds the subcommands to the `oscar` parser; each sets
`func`, which returns the exit code. Bad input prints one line and exits with 2, the
way argparse does for its own errors.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def _number_list(kind: type, what: str):
    """An argparse type: comma-separated numbers of a kind, at least one."""
    def parse(text: str) -> list:
        try:
            vals = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError("empty list")
        return vals
    return parse


_int_list = _number_list(int, "integers")
_float_list = _number_list(float, "numbers")


def _str_list(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return vals


def _positive_int(text: str, expected: str = "an integer") -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError("must be above 0")
    return x


def _chunks(text: str) -> int | None:
    return None if text == "all" else _positive_int(text, "a number or 'all'")


def _command_line() -> str:
    return "oscar " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _fail(cmd: str, msg: str) -> int:
    print(f"oscar {cmd}: error: {msg}", file=sys.stderr)
    return 2


def _user_errors():
    from ..paths import MissingComponentError
    from .synth import SynthError
    from .tool_runs import EvalError
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
    from .settings import SETTINGS
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


# options of one mode only; given to the other, they would be silently ignored
_BENCH_ONLY = {"depths": "-d", "p": "-p", "n": "-n", "reps": "-r", "rounds": "--rounds", "bandwidth": "--bandwidth",
               "roofline_only": "--roofline-only"}
_SERVE_ONLY = {"clients": "-np", "prompt_tokens": "--prompt-tokens", "gen_tokens": "--gen-tokens", "ctx": "--ctx"}
_EQUAL_ONLY = {"seq_ctx": "--seq-ctx", "layouts": "--layouts", "equal_gen": "--equal-gen"}
# the modes of `oscar bench`, the flag that picks each, and the options only it takes
_MODES = {"llama-bench": (None, _BENCH_ONLY), "--serve": ("serve", _SERVE_ONLY),
          "--equal-memory": ("equal_memory", _EQUAL_ONLY)}


def _given(args, options: dict) -> dict:
    return {k: v for k, v in vars(args).items() if k in options and v not in (None, False)}


def _mode_error(args) -> str | None:
    """Why the options given do not make one mode of `oscar bench`, or None."""
    picked = [m for m, (dest, _) in _MODES.items() if dest and getattr(args, dest) not in (None, False)]
    if len(picked) > 1:
        return f"{picked[0]} does not go with {picked[1]}"
    mode = picked[0] if picked else "llama-bench"
    for other, (_, options) in _MODES.items():
        stray = _given(args, options) if other != mode else {}
        if stray:
            flag = options[next(iter(stray))]
            return f"{flag} goes with {other if other != 'llama-bench' else 'llama-bench runs'}, not {mode}"
    if args.cpu and mode != "llama-bench":
        return f"--cpu does not go with {mode}"
    return None


def cmd_bench(args) -> int:
    from ..format.gguf_read import model_info
    from . import bench
    from .kv_memory import window_from_args
    why = _mode_error(args)
    if why:
        return _fail("bench", why)
    if args.model is None and not args.cpu:
        return _fail("bench", "give a model GGUF (only --cpu defaults to the bundled model)")
    if args.ngl is None:
        args.ngl = 0 if args.cpu else 99
    if args.serve:
        return _cmd_serve(args)
    if args.equal_memory is not None:
        return _cmd_equal_memory(args)
    if args.cpu:
        from .. import bundled_model_path
        args.model = args.model or str(bundled_model_path())
    depths = args.depths or list(bench.CPU_DEPTHS if args.cpu else bench.DEFAULT_DEPTHS)
    n_gen = args.n if args.n is not None else (bench.CPU_GEN if args.cpu else bench.DEFAULT_GEN)
    try:
        if args.roofline_only:
            if not args.bandwidth:
                return _fail("bench", "--roofline-only needs --bandwidth GB/s")
            info = model_info(args.model)
            rows = bench.roofline(info, args.types, depths, args.bandwidth,
                                  window=window_from_args(info, shlex.split(args.oscar_args)))
            print(bench.roofline_text(rows))
            return 0
        res = bench.run_bench(args.model, kv_types=args.types, depths=depths,
                              n_prompt=bench.DEFAULT_PROMPT if args.p is None else args.p,
                              n_gen=n_gen,
                              ngl=args.ngl, reps=args.reps, n_threads=args.threads, rounds=args.rounds or 1,
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


def _cmd_serve(args) -> int:
    from . import serve
    try:
        res = serve.run_serve(args.model, kv_types=args.types, ngl=args.ngl, n_threads=args.threads,
                              extra_args=shlex.split(args.llama_args), oscar_args=shlex.split(args.oscar_args),
                              out_dir=args.out, progress=not args.no_progress, command=_command_line(),
                              **_given(args, _SERVE_ONLY))
    except _user_errors() as e:
        return _fail("bench", str(e))
    return _print_result(res, args.out, "serve")


def _print_result(res, out: str, stem: str) -> int:
    """A serving or equal-memory result as the tools print it, and the files it was written to."""
    print(f"{Path(res.meta['model']).name}, {res.meta['date']}, {res.meta['machine']}")
    print(res.to_text())
    print(f"\nwrote {out}/{stem}.json, {stem}.md, {stem}.txt")
    return 0


def _cmd_equal_memory(args) -> int:
    from . import equal_memory
    try:
        res = equal_memory.run_equal_memory(
            args.model, args.equal_memory, n_ctx=args.seq_ctx or equal_memory.DEFAULT_SEQ_CTX,
            n_gen=args.equal_gen or equal_memory.DEFAULT_GEN, kv_types=args.types,
            layouts=args.layouts or equal_memory.LAYOUTS, ngl=args.ngl, n_threads=args.threads,
            extra_args=shlex.split(args.llama_args), oscar_args=shlex.split(args.oscar_args), out_dir=args.out,
            command=_command_line(), log=None if not args.no_progress else (lambda m: None))
    except _user_errors() as e:
        return _fail("bench", str(e))
    return _print_result(res, args.out, "equal_memory")


def _add_bench(sub) -> None:
    from .bench import CPU_DEPTHS, CPU_GEN, DEFAULT_DEPTHS, DEFAULT_GEN, DEFAULT_PROMPT, DEFAULT_TYPES
    from .serve import DEFAULT_CLIENTS, DEFAULT_SLOTS
    from .serve import DEFAULT_GEN as SERVE_GEN, DEFAULT_PROMPT as SERVE_PROMPT
    from .equal_memory import DEFAULT_GEN as EQ_GEN, DEFAULT_SEQ_CTX as EQ_CTX, LAYOUTS
    p = sub.add_parser("bench", help="llama-bench per KV type and depth, ratios vs f16, plot, roofline; "
                                     "--serve: llama-server under concurrent clients",
                       description="Runs llama-bench -fa 1 once per KV type at the same depths and prints "
                                   "tokens/s with ratios to f16. With --serve, runs llama-server per KV type "
                                   "with -np N and with its default slots, under N concurrent streaming "
                                   "clients, and prints decode tokens/s, time to first token and "
                                   "inter-token latency.")
    p.add_argument("model", nargs="?", default=None,
                   help="model GGUF (e.g. from `oscar synth`); with --cpu, default: the bundled model")
    p.add_argument("--cpu", action="store_true",
                   help="attention on the CPU: -ngl 0, depths " + ",".join(map(str, CPU_DEPTHS)) +
                        f", tg{CPU_GEN} (each still settable)")
    p.add_argument("--types", type=_str_list, default=list(DEFAULT_TYPES),
                   help="KV types (default " + ",".join(DEFAULT_TYPES) + ")")
    p.add_argument("-d", "--depths", type=_int_list, default=None,
                   help="context depths (default " + ",".join(map(str, DEFAULT_DEPTHS)) + ")")
    p.add_argument("-p", type=int, default=None,
                   help=f"prompt tokens of the pp test (0: none; default {DEFAULT_PROMPT})")
    p.add_argument("-n", type=int, default=None,
                   help=f"generated tokens of the tg test (0: none; default {DEFAULT_GEN})")
    p.add_argument("-ngl", type=int, default=None, help="layers on the GPU (default 99; 0 with --cpu)")
    p.add_argument("-r", "--reps", type=_positive_int, default=None, help="repetitions (llama-bench default 5)")
    p.add_argument("--rounds", type=_positive_int, default=None,
                   help="run every type this many times, alternating the order, and report each row's median "
                        "(default 1): for machines whose speed drifts")
    p.add_argument("-t", "--threads", type=_positive_int, default=None)
    p.add_argument("--llama-args", default="", help="extra llama-bench (llama-server with --serve) flags for every run")
    p.add_argument("--oscar-args", default="", help="extra flags for the oscar2 runs only, "
                                                    "e.g. \"--oscar-sink 0 --oscar-recent 0\"")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="measured copy bandwidth in GB/s: adds the memory roofline of decode")
    p.add_argument("--roofline-only", action="store_true", help="print the roofline without running llama-bench")
    p.add_argument("-o", "--out", default="oscar-bench", help="output folder (default ./oscar-bench)")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("serving (--serve)")
    g.add_argument("--serve", action="store_true", help="llama-server under concurrent streaming clients instead "
                                                        "of llama-bench; writes serve.json, serve.md, serve.txt")
    g.add_argument("-np", dest="clients", type=_int_list, default=None,
                   help=f"client counts: a server with -np N per count, and the default ({DEFAULT_SLOTS} unified "
                        "slots) under each (default " + ",".join(map(str, DEFAULT_CLIENTS)) + ")")
    g.add_argument("--prompt-tokens", type=_positive_int, default=None,
                   help=f"prompt tokens per client (default {SERVE_PROMPT})")
    g.add_argument("--gen-tokens", type=_positive_int, default=None,
                   help=f"generated tokens per client, at least 2 (default {SERVE_GEN})")
    g.add_argument("--ctx", type=_positive_int, default=None,
                   help="context per slot (default: prompt + generated tokens, rounded up to 256)")
    g = p.add_argument_group("equal memory (--equal-memory)")
    g.add_argument("--equal-memory", type=_positive_float, default=None, metavar="GIB",
                   help="per KV type and cache layout, the most sequences whose KV cache fits GIB GiB, "
                        "each filled and decoded together (llama-batched-bench); writes equal_memory.json, "
                        ".md, .txt")
    g.add_argument("--seq-ctx", type=_positive_int, default=None,
                   help=f"tokens per sequence (default {EQ_CTX})")
    g.add_argument("--equal-gen", type=_positive_int, default=None,
                   help=f"of them, decoded together at the end (default {EQ_GEN})")
    g.add_argument("--layouts", type=_str_list, default=None,
                   help="cache layouts: " + ",".join(LAYOUTS) + " (one KV stream per sequence, or one unified "
                        "cache; default both)")
    p.set_defaults(func=cmd_bench)


def _window(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        sink, recent = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SINK,RECENT (two integers), got {text!r}") from None
    if sink < 0 or recent < 0:
        raise argparse.ArgumentTypeError("the window sizes must not be negative")
    return sink, recent


def _add_model_and_text(p, what: str) -> None:
    """The converted model and the text of the runtime-vs-simulation checks."""
    from .texts import EVAL_TEXT
    p.add_argument("model", help="GGUF with OSCAR rotations (oscar-convert's output)")
    p.add_argument("--text", default=str(EVAL_TEXT), help=f"{what} (default: the shipped Botchan)")


def _add_threads(p) -> None:
    p.add_argument("-t", "--threads", type=_positive_int, default=2, help="llama.cpp threads (default 2)")


def _add_agreement(sub) -> None:
    from ..format.gguf_keys import DEFAULT_WINDOW
    from .agreement import DEFAULT_TOLERANCE
    a = sub.add_parser("agreement", help="llama.cpp's oscar2 cache against `oscar simulate` on the same input",
                       description="Mean next-token KL of llama.cpp's oscar2 cache (llama-perplexity) and of the "
                                   "simulation (transformers with the bit-exact quantizer), on the same chunks, "
                                   "rotations, clip ratios and window. Exit 0 when their ratio is within the "
                                   "tolerance of 1, 1 when not, 2 on bad input.")
    _add_model_and_text(a, "held-out text")
    a.add_argument("--ctx", type=_positive_int, default=1024, help="context of each chunk (default 1024)")
    a.add_argument("--chunks", type=_positive_int, default=1, help="chunks (default 1)")
    a.add_argument("--window", type=_window, default=DEFAULT_WINDOW,
                   help=f"SINK,RECENT tokens in f16 (default {DEFAULT_WINDOW[0]},{DEFAULT_WINDOW[1]})")
    a.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"largest |ratio - 1| that passes (default {DEFAULT_TOLERANCE})")
    _add_threads(a)
    a.set_defaults(func=_run_agreement)


def _run_agreement(args) -> int:
    from .agreement import measure_agreement
    from .tool_runs import EvalError
    try:
        res = measure_agreement(args.model, args.text, args.ctx, args.chunks, args.window, args.threads)
    except (EvalError, ValueError) as e:
        return _fail("agreement", str(e))
    ok = res.within(args.tolerance)
    print(res.line() + ("" if ok else f": outside the tolerance {args.tolerance}"))
    return 0 if ok else 1


def _add_check_rows(sub) -> None:
    c = sub.add_parser("check-rows", help="llama.cpp's stored K/V cache rows against transformers and the quantizer",
                       description="Decode the first TOKENS tokens of a text in llama.cpp with an oscar2 cache and "
                                   "compare, layer by layer, what it writes into the cache with the transformers "
                                   "model's rotated K and V and with the bit-exact quantizer. Exit 0 when every "
                                   "stored row equals the quantizer's and every layer's input is within the "
                                   "tolerance, 1 when not, 2 on bad input.")
    _add_model_and_text(c, "text")
    c.add_argument("--tokens", type=_positive_int, default=64, help="tokens to decode (default 64)")
    c.add_argument("--tolerance", type=float, default=0.1,
                   help="largest relative error of a layer's input against transformers (default 0.1)")
    _add_threads(c)
    c.set_defaults(func=_run_check_rows)


def _run_check_rows(args) -> int:
    from .agreement import perplexity_chunks
    from .cache_rows import check_rows
    from .tool_runs import EvalError
    try:
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
        tokens = perplexity_chunks(Path(args.model), text, args.tokens, 1)[0].tolist()
        report = check_rows(args.model, tokens, n_threads=args.threads)
    except (EvalError, ValueError, OSError) as e:
        return _fail("check-rows", str(e))
    print(report.table())
    ok = report.all_stored_equal() and report.worst_input_error() <= args.tolerance
    return 0 if ok else 1


def register(subparsers) -> None:
    """Add the measuring tools to the `oscar` subcommands."""
    _add_eval(subparsers)
    _add_synth(subparsers)
    _add_bench(subparsers)
    _add_agreement(subparsers)
    _add_check_rows(subparsers)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (python -m oscar_gguf.measure.cli ...), same as `oscar ...`."""
    from ..cli import run_subcommands
    return run_subcommands(register, argv)


if __name__ == "__main__":
    sys.exit(main())

"""`oscar calibrate` and `oscar simulate`: argparse wiring and one-line errors.

The `oscar` entry point calls register(subparsers); each subcommand sets `func`, which
returns the exit code: 0 on success, 2 for bad input (with a one-line message saying
what to do, no traceback), 1 for an unexpected failure (OSCAR_DEBUG=1 shows the traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..format.gguf_keys import DEFAULT_CLIP_K, DEFAULT_CLIP_V, DEFAULT_WINDOW
from .plan import DEFAULT_BUDGET, DEFAULT_THRESHOLD

EXIT_BAD_INPUT = 2


def _window(s: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in s.split(","))
        if a < 0 or b < 0:
            raise ValueError
        return a, b
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SINK,RECENT like 64,256 (or 0,0), got {s!r}") from None


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _non_negative(s: str) -> float:
    import math
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}")
    return v


def register(subparsers) -> None:
    c = subparsers.add_parser(
        "calibrate", help="fit OSCAR K/V rotations and clip ratios for a model",
        description="Fit per-layer OSCAR rotations (K: qqt, V: sst) and clip ratios, and write them to a "
                    "safetensors artifact for oscar-convert.")
    c.add_argument("model", metavar="MODEL", help="local Hugging Face model folder, Hub id (org/name) or GGUF file")
    c.add_argument("--out", required=True, metavar="ROT.safetensors", help="artifact to write")
    c.add_argument("--text", default=None, metavar="FILE|DIR|JSONL",
                   help="calibration text (default: the corpus bundled with oscar-gguf)")
    c.add_argument("--tokens", type=_positive, default=32768, help="tokens for the statistics (default 32768)")
    c.add_argument("--seq-len", type=_positive, default=None, help="tokens per chunk (default min(2048, context))")
    c.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    c.add_argument("--clip", choices=("fixed", "search"), default="search",
                   help=f"fixed: {DEFAULT_CLIP_K} (K) / {DEFAULT_CLIP_V} (V); search: per layer on held-out chunks (default)")
    c.add_argument("--rotation", choices=("key-eigen-dc", "learned", "hadamard", "oscar"), default="key-eigen-dc",
                   help="rotation recipe (default key-eigen-dc: the keys' eigenbasis with the top directions on "
                        "the group-constant Hadamard rows; learned: Hadamard refined through the 2-bit "
                        "quantizer, minutes per model on a CPU; oscar: OSCAR's U·H·P_br on the qqt/sst "
                        "covariances)")
    c.add_argument("--backend", choices=("auto", "hf", "llama"), default="auto",
                   help="capture with transformers (hf) or llama.cpp (llama, GGUF only); auto: llama for a GGUF")
    c.add_argument("--window", type=_window, default=DEFAULT_WINDOW, metavar="SINK,RECENT",
                   help="f16 window of the runtime, left out of the clip objectives (default %d,%d)" % DEFAULT_WINDOW)
    c.add_argument("--f16-k-budget", type=_non_negative, default=DEFAULT_BUDGET, metavar="BITS",
                   help="precision plan: layers whose INT2 keys change their attention output by more than "
                        "--f16-k-threshold keep an f16 K cache, worst first, within BITS added bits per cached "
                        f"element (default {DEFAULT_BUDGET}; 0: no plan; needs --clip search)")
    c.add_argument("--f16-k-threshold", type=_non_negative, default=DEFAULT_THRESHOLD, metavar="ERR",
                   help=f"relative squared error of the attention output from INT2 keys (default {DEFAULT_THRESHOLD})")
    c.add_argument("--threads", type=_positive, default=None,
                   help="CPU threads for llama.cpp and torch (default: all cores)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_guarded(run_calibrate))

    s = subparsers.add_parser(
        "simulate", help="simulated oscar2 KV cache: next-token KL and attention error on held-out text",
        description="Run the model with a simulated oscar2 KV cache (bit-exact quantizer) for: no rotation, "
                    "Hadamard, Hadamard with the artifact's clips, OSCAR with fixed clips and OSCAR with the "
                    "artifact's clips, each with and without the f16 window; report mean next-token KL "
                    "against the unquantized model and per-layer attention-output error.")
    s.add_argument("model", metavar="MODEL", help="local Hugging Face model folder, Hub id or GGUF file")
    s.add_argument("rotations", metavar="ROT", help="artifact written by oscar calibrate")
    s.add_argument("--text", required=True, metavar="HELDOUT",
                   help="held-out evaluation text (never the calibration text)")
    s.add_argument("--tokens", type=_positive, default=16384, help="tokens to evaluate (default 16384)")
    s.add_argument("--seq-len", type=_positive, default=1024, help="tokens per chunk (default 1024)")
    s.add_argument("--window", type=_window, default=DEFAULT_WINDOW, metavar="SINK,RECENT")
    s.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    s.add_argument("--per-layer", action="store_true", help="also print the per-layer attention-output error")
    s.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    s.add_argument("--threads", type=_positive, default=None, help="CPU threads for torch (default: all cores)")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=_guarded(run_simulate))


def _guarded(fn):
    def run(args) -> int:
        from ..paths import MissingComponentError
        from .capture_hf import UnsupportedModelError
        from .capture_llama import LlamaBackendError
        from .corpus import CorpusError
        from .models import ModelError

        try:
            return fn(args)
        except (ModelError, CorpusError, UnsupportedModelError, LlamaBackendError, MissingComponentError,
                ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
            if os.environ.get("OSCAR_DEBUG"):
                raise
            print(f"oscar {args.cmd}: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            print(f"oscar {args.cmd}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            if os.environ.get("OSCAR_DEBUG"):
                raise
            print(f"oscar {args.cmd}: failed: {type(e).__name__}: {e} (run with OSCAR_DEBUG=1 for details)",
                  file=sys.stderr)
            return 1
    return run


def _check_output(out: Path, inputs: list[str | None]) -> None:
    """Never overwrite an input, a GGUF or a folder."""
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file name like rot.safetensors")
    for i in inputs:
        if i and Path(i).exists() and Path(i).resolve() == out.resolve():
            raise ValueError(f"--out {out} is one of the inputs; choose another file name")
    if out.is_file():
        with open(out, "rb") as f:
            if f.read(4) == b"GGUF":
                raise ValueError(f"--out {out} is an existing GGUF file; refusing to overwrite it")


def _set_threads(n: int | None) -> None:
    if n:
        import torch
        torch.set_num_threads(n)


def run_calibrate(args) -> int:
    from .artifact import save_artifact
    from .pipeline import calibrate_file

    out = Path(args.out)
    _check_output(out, [args.model, args.text])
    _set_threads(args.threads)
    run = calibrate_file(args.model, text=args.text, tokens=args.tokens, seq_len=args.seq_len, device=args.device,
                         clip=args.clip, backend=args.backend, window=args.window, progress=not args.quiet,
                         rotation=args.rotation, threads=args.threads,
                         f16_k_budget=args.f16_k_budget, f16_k_threshold=args.f16_k_threshold)
    save_artifact(out, run.artifact)
    a = run.artifact
    print(f"wrote {out}: {len(a.layers)} layers, head_dim {a.head_dim}, {a.tokens} tokens, backend {run.backend}, "
          f"{a.method}, {run.seconds:.0f} s, peak RSS {run.peak_rss_mib:.0f} MiB")
    if args.clip == "search":
        print("clip_k: " + " ".join(f"{c:.3f}" for c in a.clip_k))
        print("clip_v: " + " ".join(f"{c:.3f}" for c in a.clip_v))
        print("K-only output error: " + a.extra.get("k_output_error", ""))
        print("f16 K cache in layers: " + (" ".join(map(str, a.f16_k_layers)) or "none"))
    return 0


def run_simulate(args) -> int:
    from .pipeline import simulate_file

    if args.json:
        _check_output(Path(args.json), [args.model, args.rotations, args.text])
    _set_threads(args.threads)
    results, configs, n_tok = simulate_file(args.model, args.rotations, text=args.text, tokens=args.tokens,
                                            seq_len=args.seq_len, device=args.device, window=args.window,
                                            progress=not args.quiet)
    print(f"simulated oscar2 KV on {n_tok} held-out tokens (chunks of {args.seq_len}, KL over each chunk's "
          f"second half)")
    print(f"{'configuration':44s} {'mean KL':>9s} {'same top1':>9s} {'attn err':>9s}")
    rows = []
    for c in configs:
        r = results[c.label]
        errs = r.layer_errors()
        mean_err = sum(errs.values()) / max(1, len(errs))
        print(f"{c.label:44s} {r.mean_kl:9.4f} {100 * r.same_top1:8.2f}% {mean_err:9.4f}")
        rows.append({"config": c.name, "window": list(c.window), "mean_kl": r.mean_kl, "same_top1": r.same_top1,
                     "attn_rel_err_mean": mean_err, "attn_rel_err": {str(k): v for k, v in errs.items()},
                     "positions": r.positions})
    if args.per_layer:
        print("per-layer relative attention-output error ‖ΔO‖²/‖O‖²:")
        for c in configs:
            errs = results[c.label].layer_errors()
            print(f"  {c.label}: " + " ".join(f"{e:.3f}" for e in errs.values()))
    if args.json:
        from ..atomic import write_text_atomic
        write_text_atomic(Path(args.json), json.dumps({"tokens": n_tok, "seq_len": args.seq_len,
                                                        "results": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m oscar_gguf.calibrate.cli calibrate|simulate ...` (the same as `oscar ...`)."""
    from ..cli import run_subcommands
    return run_subcommands(register, argv)


if __name__ == "__main__":
    sys.exit(main())

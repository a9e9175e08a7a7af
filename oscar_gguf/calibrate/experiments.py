"""The quality study behind the README numbers: simulated oscar2 KV on held-out text.

    python -m oscar_gguf.calibrate.experiments --model MODEL.gguf --eval-text HELDOUT.txt --out DIR

Calibration uses the bundled corpus only (statistics chunks, then held-out calibration
chunks for every clip search); the evaluation text is used for nothing but the final KL.
Writes DIR/results.json, DIR/table.md and the artifacts of the two OSCAR recipes.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..quant import DEFAULT_CLIP_K, DEFAULT_CLIP_V, GROUP_SIZE, type_for_head_dim
from .artifact import save_artifact
from .calibrator import Calibrator, ModelInfo
from .capture_hf import attention_tap, decoder, mask_to_bool
from .clip import ClipSearch
from .corpus import ChunkPlan, make_chunks
from .fit import hadamard
from .models import ModelRef, hf_bos_prefix, hf_encode
from .simulate import KVConfig, run_simulation
from .variants import dc_rotation, fake_quantize_refit, predicted_k_transform_gain, whitening_k_transform

WINDOW = (64, 256)
NO_WINDOW = (0, 0)


def load_fp32(path: Path, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.to(device).eval(), tok


def research_parser(prog: str, eval_tokens: int) -> argparse.ArgumentParser:
    """The arguments this study and study.py share."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--model", required=True)
    ap.add_argument("--eval-text", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calib-tokens", type=int, default=32768)
    ap.add_argument("--calib-seq", type=int, default=2048)
    ap.add_argument("--clip-chunks", type=int, default=4)
    ap.add_argument("--eval-tokens", type=int, default=eval_tokens)
    ap.add_argument("--eval-seq", type=int, default=1024)
    return ap


@dataclass
class Research:
    """What both studies start from: the fp32 model, its head size and oscar2 group, and the
    calibration chunks (statistics, held out for clips) of the bundled corpus."""
    out: Path
    dev: str
    model: object
    encode: object
    prefix: list
    n_layers: int
    d: int
    group: int
    stat: np.ndarray
    held: np.ndarray


def research_setup(args) -> Research:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_fp32(Path(args.model), args.device)
    encode, prefix = hf_encode(tok), hf_bos_prefix(tok)
    d = model.config.head_dim
    # calibration text only: the evaluation text is read later, for the final KL alone
    plan = ChunkPlan(args.calib_seq, args.calib_tokens // args.calib_seq, args.clip_chunks)
    stat, held = make_chunks(None, encode, prefix, plan)
    return Research(out, args.device, model, encode, prefix, model.config.num_hidden_layers, d,
                    GROUP_SIZE[type_for_head_dim(d)], stat, held)


def run_passes(model, cal: Calibrator, stat, held, dev):
    base = decoder(model)
    while cal.pass_name:
        with cal:
            for c in (held if cal.pass_name == "clips" else stat):
                base(torch.as_tensor(c, dtype=torch.long, device=dev)[None], use_cache=False)


def clip_search(model, rotations, cq, group, held, window, dev) -> ClipSearch:
    """Per-layer and per-head clip errors of `rotations` on the held-out calibration chunks."""
    search = ClipSearch(rotations, cq, group, window=window)

    def handler(call):
        q, k, v = (x.transpose(1, 2) for x in (call.query, call.key, call.value))
        allowed = None if call.mask is None else mask_to_bool(call.mask, q.shape[1], k.shape[1], q.device)[0, 0]
        for b in range(q.shape[0]):
            search.observe(call.layer, q[b], k[b], v[b], call.scaling, allowed)
        return None

    with torch.no_grad(), attention_tap(model, handler):
        for c in held:
            decoder(model)(torch.as_tensor(c, dtype=torch.long, device=dev)[None], use_cache=False)
    return search


def main(argv=None) -> int:
    ap = research_parser("python -m oscar_gguf.calibrate.experiments", eval_tokens=32768)
    ap.add_argument("--set", default="main,explore",
                    help="config sets: main, explore; or 'default' alone: calibrate with the package's default "
                         "recipe (calibrate_hf_model) and run `oscar simulate`'s comparison on it")
    ap.add_argument("--artifact", action="append", default=[], metavar="NAME=PATH",
                    help="also evaluate a saved artifact (its rotations and clips)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the evaluation loop")
    args = ap.parse_args(argv)
    t0 = time.time()
    setup = research_setup(args)
    out, dev, model, encode, prefix = setup.out, setup.dev, setup.model, setup.encode, setup.prefix
    n_layers, d, group, stat, held = setup.n_layers, setup.d, setup.group, setup.stat, setup.held
    if args.set == "default":
        return verify_default(args, model, encode, prefix, group, out, t0)
    cal = Calibrator(model, clip="search", window=WINDOW, rotation="oscar",
                     info=ModelInfo("llama", n_layers, "hf", model=str(args.model)))
    run_passes(model, cal, stat, held, dev)
    art_spec = cal.result(corpus="oscar-gguf default corpus")
    save_artifact(out / "oscar_spec_search.safetensors", art_spec)
    st = cal.state
    print(f"calibrated in {time.time() - t0:.0f} s", flush=True)
    cq = {i: s.query_covariances() for i, s in st.layers.items()}

    rot = {
        "none": {i: (np.eye(d), np.eye(d)) for i in st.layers},
        "hadamard": {i: (hadamard(d), hadamard(d)) for i in st.layers},
        "oscar": {i: (r[0], r[2]) for i, r in st.rotations.items()},
        "oscar-dc": {i: (dc_rotation(s.k_covariance(), group)[0], dc_rotation(s.v_covariance(), group)[0])
                     for i, s in st.layers.items()},
    }
    searches = {}
    for name, r in rot.items():
        searches[name, WINDOW] = clip_search(model, r, cq, group, held, WINDOW, dev)
    searches["oscar", NO_WINDOW] = clip_search(model, rot["oscar"], cq, group, held, NO_WINDOW, dev)
    searches["oscar-dc", NO_WINDOW] = clip_search(model, rot["oscar-dc"], cq, group, held, NO_WINDOW, dev)
    print(f"clip searches done at {time.time() - t0:.0f} s", flush=True)

    ones = np.ones(n_layers, np.float32)
    fixed = (np.full(n_layers, DEFAULT_CLIP_K, np.float32), np.full(n_layers, DEFAULT_CLIP_V, np.float32))

    def rk(name):
        return None if name == "none" else {i: v[0] for i, v in rot[name].items()}

    def rv(name):
        return None if name == "none" else {i: v[1] for i, v in rot[name].items()}

    def cfg(label, name, clips, window, **kw):
        return KVConfig(label, rk(name), rv(name), clips[0], clips[1], group, window=window, **kw)

    configs = []
    sets = set(args.set.split(","))
    for w in (NO_WINDOW, WINDOW):
        sw = searches["oscar", w]
        if "main" in sets:
            configs += [
                cfg("no rotation, clip 1.0", "none", (ones, ones), w),
                cfg("Hadamard, clip 1.0", "hadamard", (ones, ones), w),
                cfg("Hadamard, clips .96/.92", "hadamard", fixed, w),
                cfg("Hadamard, OSCAR's searched clips", "hadamard", sw.best(n_layers), w),
                cfg("Hadamard, own searched clips", "hadamard", searches["hadamard", WINDOW].best(n_layers)
                    if w == WINDOW else clip_search(model, rot["hadamard"], cq, group, held, w, dev).best(n_layers), w),
                cfg("OSCAR, clip 1.0", "oscar", (ones, ones), w),
                cfg("OSCAR, clips .96/.92", "oscar", fixed, w),
                cfg("OSCAR, searched clips", "oscar", sw.best(n_layers), w),
            ]
        if "explore" in sets:
            sdc = searches["oscar-dc", w]
            configs += [
                cfg("OSCAR, searched clips (other window objective)", "oscar",
                    searches["oscar", WINDOW if w == NO_WINDOW else NO_WINDOW].best(n_layers), w),
                cfg("OSCAR, per-head searched clips [runtime change]", "oscar", sw.best_per_head(n_layers), w),
                cfg("OSCAR, searched clips, LSQ refit encoder [runtime change]", "oscar", sw.best(n_layers), w,
                    quantizer=fake_quantize_refit),
                cfg("OSCAR-DC, clip 1.0", "oscar-dc", (ones, ones), w),
                cfg("OSCAR-DC, clips .96/.92", "oscar-dc", fixed, w),
                cfg("OSCAR-DC, searched clips", "oscar-dc", sdc.best(n_layers), w),
                cfg("OSCAR-DC, per-head searched clips [runtime change]", "oscar-dc", sdc.best_per_head(n_layers), w),
                cfg("OSCAR-DC, searched clips, LSQ refit encoder [runtime change]", "oscar-dc", sdc.best(n_layers), w,
                    quantizer=fake_quantize_refit),
            ]
            # non-orthogonal, attention-aware K transform; V keeps OSCAR-DC
            kt = {i: whitening_k_transform(s.k_covariance(), s.query_covariances().mean(0).cpu().numpy())
                  for i, s in st.layers.items()}
            configs.append(KVConfig("K·A / q·A⁻ᵀ transform, V OSCAR-DC, searched clips [runtime change]", None,
                                    rv("oscar-dc"), sdc.best(n_layers)[0], sdc.best(n_layers)[1], group,
                                    window=w, k_transform=kt))

    from .artifact import load_artifact
    for spec in args.artifact:
        name, path = spec.split("=", 1)
        a = load_artifact(path).to_hf_layout()
        for w in (NO_WINDOW, WINDOW):
            configs.append(KVConfig(f"artifact {name}", a.k_rot, a.v_rot, a.clip_k, a.clip_v, group, window=w))

    gains = {i: predicted_k_transform_gain(s.k_covariance(), s.query_covariances().mean(0).cpu().numpy())
             for i, s in st.layers.items()}
    # the OSCAR-DC recipe as an artifact too
    art_dc = cal.result(corpus="oscar-gguf default corpus")
    art_dc.k_rot = {i: v[0].astype(np.float32) for i, v in rot["oscar-dc"].items()}
    art_dc.v_rot = {i: v[1].astype(np.float32) for i, v in rot["oscar-dc"].items()}
    art_dc.clip_k, art_dc.clip_v = searches["oscar-dc", WINDOW].best(n_layers)
    art_dc.method = "oscar-dc-qqt-sst/clip-search"
    save_artifact(out / "oscar_dc_search.safetensors", art_dc)

    ev_plan = ChunkPlan(args.eval_seq, args.eval_tokens // args.eval_seq, 0)
    ev, _ = make_chunks(args.eval_text, encode, prefix, ev_plan)
    print(f"evaluating {len(configs)} configs on {len(ev)} chunks of {args.eval_seq}", flush=True)
    deadline = None if args.budget is None else time.monotonic() + args.budget
    torch.manual_seed(0)
    res = run_simulation(model, ev, configs, deadline=deadline)
    rows = []
    for c in configs:
        r = res[c.label]
        errs = r.layer_errors()
        rows.append({"config": c.name, "window": list(c.window), "mean_kl": r.mean_kl, "same_top1": r.same_top1,
                     "attn_rel_err_mean": float(np.mean(list(errs.values()))), "chunk_kl": r.chunk_kl,
                     "attn_rel_err": {str(k): v for k, v in errs.items()}})
    clips = {f"{n}|{w[0]},{w[1]}": {"k": s.best(n_layers)[0].tolist(), "v": s.best(n_layers)[1].tolist()}
             for (n, w), s in searches.items()}
    n_eval = res[configs[0].label].positions // (args.eval_seq - args.eval_seq // 2)
    result = {"model": str(args.model), "eval_text": str(args.eval_text), "eval_tokens": n_eval * args.eval_seq,
              "eval_seq": args.eval_seq, "calib_tokens": int(len(stat) * args.calib_seq),
              "clip_chunks": len(held), "device": dev, "seconds": time.time() - t0, "results": rows,
              "clips": clips, "k_transform_predicted_gain": gains}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = ["| configuration | window | mean KL | same top-1 | attn err |", "|---|---|---|---|---|"]
    for row in rows:
        w = "64/256" if row["window"] != [0, 0] else "none"
        lines.append(f"| {row['config']} | {w} | {row['mean_kl']:.4f} | {100 * row['same_top1']:.1f} % | "
                     f"{row['attn_rel_err_mean']:.4f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


def verify_default(args, model, encode, prefix, group, out: Path, t0: float) -> int:
    """The package's own default path (HF backend, fp32) and `oscar simulate`'s table."""
    from .artifact import load_artifact
    from .pipeline import calibrate_hf_model
    from .simulate import standard_configs

    info = ModelInfo("llama", model.config.num_hidden_layers, "hf", model=str(args.model))
    art = calibrate_hf_model(model, encode, prefix, tokens=args.calib_tokens, seq_len=args.calib_seq, clip="search",
                             progress=False, info=info)
    save_artifact(out / "default_recipe.safetensors", art)
    print(f"default recipe {art.method} calibrated at {time.time() - t0:.0f} s", flush=True)
    configs = standard_configs(art, WINDOW)
    for spec in args.artifact:
        name, path = spec.split("=", 1)
        a = load_artifact(path).to_hf_layout()
        for w in (NO_WINDOW, WINDOW):
            configs.append(KVConfig(f"artifact {name} ({a.method})", a.k_rot, a.v_rot, a.clip_k, a.clip_v, group,
                                    window=w))
    ev, _ = make_chunks(args.eval_text, encode, prefix, ChunkPlan(args.eval_seq, args.eval_tokens // args.eval_seq, 0))
    deadline = None if args.budget is None else time.monotonic() + args.budget
    res = run_simulation(model, ev, configs, deadline=deadline)
    rows = [{"config": c.name, "window": list(c.window), "mean_kl": res[c.label].mean_kl,
             "same_top1": res[c.label].same_top1, "chunk_kl": res[c.label].chunk_kl,
             "attn_rel_err_mean": float(np.mean(list(res[c.label].layer_errors().values())))} for c in configs]
    (out / "default.json").write_text(json.dumps({"method": art.method, "clip_k": art.clip_k.tolist(),
                                                  "clip_v": art.clip_v.tolist(), "results": rows,
                                                  "seconds": time.time() - t0}, indent=1))
    for r in rows:
        w = "64/256" if r["window"] != [0, 0] else "none"
        print(f"| {r['config']} | {w} | {r['mean_kl']:.4f} | {100 * r['same_top1']:.1f} % | {r['attn_rel_err_mean']:.4f} |")
    print(f"done in {time.time() - t0:.0f} s, {len(rows[0]['chunk_kl'])} chunks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

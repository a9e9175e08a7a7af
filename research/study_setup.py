"""What the simulation studies share: their arguments, the fp32 model and the calibration chunks,
the calibration passes, clip searches over held-out chunks, and the evaluation and its table.

Calibration uses the bundled corpus only (statistics chunks, then held-out calibration chunks
for every clip search); the evaluation text is used for nothing but the final KL.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oscar_gguf.calibrate.artifact import load_artifact
from oscar_gguf.calibrate.calibrator import Calibrator
from oscar_gguf.calibrate.capture_hf import attention_tap, decoder, mask_to_bool
from oscar_gguf.calibrate.corpus import ChunkPlan, make_chunks
from oscar_gguf.calibrate.models import hf_bos_prefix, hf_encode
from oscar_gguf.calibrate.simulate import KVConfig, run_simulation
from oscar_gguf.format.gguf_keys import DEFAULT_WINDOW
from oscar_gguf.format.oscar2 import group_size

from .simulated_variants import StudyClipSearch

WINDOW = DEFAULT_WINDOW
NO_WINDOW = (0, 0)


def load_fp32(path: Path, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.to(device).eval(), tok


def study_parser(prog: str, eval_tokens: int) -> argparse.ArgumentParser:
    """The arguments every study takes."""
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
    ap.add_argument("--artifact", action="append", default=[], metavar="NAME=PATH",
                    help="also evaluate a saved artifact (its rotations and clips)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the evaluation loop")
    return ap


@dataclass
class Study:
    """What every study starts from: the fp32 model, its head size and oscar2 group, and the
    calibration chunks (statistics, held out for clips) of the bundled corpus."""
    args: argparse.Namespace
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


def study_setup(args) -> Study:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_fp32(Path(args.model), args.device)
    encode, prefix = hf_encode(tok), hf_bos_prefix(tok)
    d = model.config.head_dim
    # calibration text only: the evaluation text is read later, for the final KL alone
    plan = ChunkPlan(args.calib_seq, args.calib_tokens // args.calib_seq, args.clip_chunks)
    stat, held = make_chunks(None, encode, prefix, plan)
    return Study(args, out, args.device, model, encode, prefix, model.config.num_hidden_layers, d,
                 group_size(d), stat, held)


def run_passes(study: Study, cal: Calibrator) -> None:
    base = decoder(study.model)
    while cal.pass_name:
        with cal:
            for c in (study.held if cal.pass_name == "clips" else study.stat):
                base(torch.as_tensor(c, dtype=torch.long, device=study.dev)[None], use_cache=False)


def run_clip_search(study: Study, search: StudyClipSearch) -> StudyClipSearch:
    """Feed the held-out calibration chunks to a clip search."""
    def handler(call):
        q, k, v = (x.transpose(1, 2) for x in (call.query, call.key, call.value))
        allowed = None if call.mask is None else mask_to_bool(call.mask, q.shape[1], k.shape[1], q.device)[0, 0]
        for b in range(q.shape[0]):
            search.observe(call.layer, q[b], k[b], v[b], call.scaling, allowed)

    with torch.no_grad(), attention_tap(study.model, handler):
        for c in study.held:
            decoder(study.model)(torch.as_tensor(c, dtype=torch.long, device=study.dev)[None], use_cache=False)
    return search


def clip_search(study: Study, rotations, cq, window=WINDOW, **variant) -> StudyClipSearch:
    """Per-layer and per-head clip errors of `rotations` on the held-out calibration chunks."""
    return run_clip_search(study, StudyClipSearch(rotations, cq, study.group, window=window, **variant))


def artifact_configs(study: Study, windows=(NO_WINDOW, WINDOW), label: str = "artifact {name}") -> list[KVConfig]:
    """The --artifact NAME=PATH files as configs, in HF layout, at each window."""
    out = []
    for spec in study.args.artifact:
        name, path = spec.split("=", 1)
        a = load_artifact(path).to_hf_layout()
        for w in windows:
            out.append(KVConfig(label.format(name=name, method=a.method), a.k_rot, a.v_rot, a.clip_k, a.clip_v,
                                study.group, window=w))
    return out


def evaluate(study: Study, configs: list[KVConfig]):
    """Mean KL of every config on the evaluation text, within --budget seconds."""
    a = study.args
    ev, _ = make_chunks(a.eval_text, study.encode, study.prefix, ChunkPlan(a.eval_seq, a.eval_tokens // a.eval_seq, 0))
    print(f"evaluating {len(configs)} configs on up to {len(ev)} chunks of {a.eval_seq}", flush=True)
    deadline = None if a.budget is None else time.monotonic() + a.budget
    torch.manual_seed(0)
    return run_simulation(study.model, ev, configs, deadline=deadline)


def result_rows(configs: list[KVConfig], res) -> list[dict]:
    rows = []
    for c in configs:
        r = res[c.label]
        errs = r.layer_errors()
        rows.append({"config": c.name, "window": list(c.window), "mean_kl": r.mean_kl, "same_top1": r.same_top1,
                     "attn_rel_err_mean": float(np.mean(list(errs.values()))), "chunk_kl": r.chunk_kl,
                     "positions": r.positions, "attn_rel_err": {str(k): v for k, v in errs.items()}})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| configuration | window | mean KL | same top-1 | attn err |", "|---|---|---|---|---|"]
    for row in rows:
        w = "%d/%d" % tuple(row["window"]) if row["window"] != [0, 0] else "none"
        lines.append(f"| {row['config']} | {w} | {row['mean_kl']:.4f} | {100 * row['same_top1']:.1f} % | "
                     f"{row['attn_rel_err_mean']:.4f} |")
    return "\n".join(lines)

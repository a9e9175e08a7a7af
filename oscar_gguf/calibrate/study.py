"""Second-stage study: which orthogonal rotation actually suits the oscar2 quantizer?

    python -m oscar_gguf.calibrate.study --model MODEL.gguf --eval-text HELDOUT.txt --out DIR

The first study (experiments.py) found plain Hadamard ahead of OSCAR's calibrated rotation
on SmolLM2-135M. This one measures, with everything calibrated on the bundled corpus and the
held-out text used only for the final KL:
- where the loss is (K only / V only quantized);
- candidate rotations: Hadamard in HF and in llama.cpp order, randomised Hadamards, OSCAR,
  OSCAR-DC, the eigenbasis of the keys' own covariance, and a rotation learned per layer
  through the runtime quantizer (variants.learn_rotation);
- a per-layer choice among the candidates by the calibration objective (held-out calibration
  chunks), which still gives one orthogonal matrix per layer for K and for V;
- the LSQ refit encoder with clips searched for it, and a non-orthogonal K transform built
  from the keys' covariance (both need runtime changes).
"""
from __future__ import annotations

import json
import time

import numpy as np
import torch

from .calibrator import Calibrator, ModelInfo
from .capture_hf import attention_tap, decoder
from .clip import ClipSearch
from .corpus import ChunkPlan, make_chunks
from .experiments import WINDOW, NO_WINDOW, clip_search, research_parser, research_setup, run_passes
from .fit import hadamard, oscar_rotation
from .simulate import KVConfig, run_simulation
from .variants import (dc_rotation, fake_quantize_refit, hadamard_llama_order, learn_rotation,
                       random_sign_hadamard, whitening_k_transform)


def capture_samples(model, chunks, dev, skip: int):
    """Per layer: keys [N, d], values [N, d] and per-row KV head index, positions >= skip."""
    out: dict[int, dict[str, list]] = {}

    def handler(call):
        k = call.key[0].transpose(0, 1)[skip:]           # [T', H_kv, d]
        v = call.value[0].transpose(0, 1)[skip:]
        o = out.setdefault(call.layer, {"k": [], "v": [], "h": []})
        n, h, d = k.shape
        o["k"].append(k.reshape(-1, d).float())
        o["v"].append(v.reshape(-1, d).float())
        o["h"].append(torch.arange(h, device=k.device).repeat(n))
        return None

    with torch.no_grad(), attention_tap(model, handler):
        for c in chunks:
            decoder(model)(torch.as_tensor(c, dtype=torch.long, device=dev)[None], use_cache=False)
    return {i: {k: torch.cat(v) for k, v in o.items()} for i, o in out.items()}


def main(argv=None) -> int:
    ap = research_parser("python -m oscar_gguf.calibrate.study", eval_tokens=65536)
    ap.add_argument("--sample-chunks", type=int, default=2)
    ap.add_argument("--learn-steps", type=int, default=200)
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--artifact", action="append", default=[], metavar="NAME=PATH")
    args = ap.parse_args(argv)
    t0 = time.time()
    setup = research_setup(args)
    out, dev, model, encode, prefix = setup.out, setup.dev, setup.model, setup.encode, setup.prefix
    n_layers, d, group, stat, held = setup.n_layers, setup.d, setup.group, setup.stat, setup.held
    cal = Calibrator(model, clip="fixed", window=WINDOW, info=ModelInfo("llama", n_layers, "hf"))
    run_passes(model, cal, stat, held, dev)
    st = cal.state
    cq = {i: s.query_covariances() for i, s in st.layers.items()}
    log = {"seconds": {}}

    def stamp(what):
        log["seconds"][what] = round(time.time() - t0, 1)
        print(f"{what} at {time.time() - t0:.0f} s", flush=True)

    stamp("calibrated")
    H = hadamard(d)
    cand = {
        "none": {i: (np.eye(d), np.eye(d)) for i in st.layers},
        "hadamard": {i: (H, H) for i in st.layers},
        "hadamard-llama-order": {i: (hadamard_llama_order(d), H) for i in st.layers},
        "oscar": {i: (r[0], r[2]) for i, r in st.rotations.items()},
        "oscar-dc": {i: (dc_rotation(s.k_covariance(), group)[0], dc_rotation(s.v_covariance(), group)[0])
                     for i, s in st.layers.items()},
        "key-eigen-dc": {i: (dc_rotation(s.key_covariance(), group)[0], dc_rotation(s.v_covariance(), group)[0])
                         for i, s in st.layers.items()},
        # OSCAR's formula on the keys' own covariance: isolates the DC placement from the covariance
        "key-eigen": {i: (oscar_rotation(s.key_covariance())[0], st.rotations[i][2]) for i, s in st.layers.items()},
    }
    for seed in (1, 2, 3):
        rs = random_sign_hadamard(d, seed)
        cand[f"hadamard-signs{seed}"] = {i: (rs, rs) for i in st.layers}
    searches = {name: clip_search(model, r, cq, group, held, WINDOW, dev) for name, r in cand.items()}
    stamp("candidate clip searches")

    # learned rotations, initialised at Hadamard, with Hadamard's searched clips
    samples = capture_samples(model, stat[:args.sample_chunks], dev, skip=WINDOW[0])
    hk, hv = searches["hadamard"].best(n_layers)
    learned = {}
    for i, s in st.layers.items():
        smp = samples[i]
        c_mean = st.layers[i].query_covariances().mean(0).float()
        # sst token weights for V: w = k C_h kᵀ, normalised per head
        c_h = st.layers[i].query_covariances().float().to(smp["k"].device)
        w = torch.zeros(len(smp["k"]), device=smp["k"].device)
        for h in range(c_h.shape[0]):
            sel = smp["h"] == h
            kh = smp["k"][sel]
            wh = ((kh @ c_h[h]) * kh).sum(1)
            w[sel] = wh / wh.mean()                             # normalised per KV head, as in stats.py
        rk = learn_rotation(smp["k"], c_mean, group, float(hk[i]), H, steps=args.learn_steps)
        rv = learn_rotation(smp["v"], None, group, float(hv[i]), H, steps=args.learn_steps, token_weight=w)
        learned[i] = (rk, rv)
    cand["learned"] = learned
    searches["learned"] = clip_search(model, learned, cq, group, held, WINDOW, dev)
    stamp("learned rotations")

    errs = {name: s.min_errors() for name, s in searches.items()}
    totals = {name: {"k": sum(e[0] for e in v.values()), "v": sum(e[1] for e in v.values())}
              for name, v in errs.items()}
    # per layer, the best candidate for K and for V on the held-out calibration chunks
    pick_k = {i: min(errs, key=lambda n: errs[n][i][0]) for i in st.layers}
    pick_v = {i: min(errs, key=lambda n: errs[n][i][1]) for i in st.layers}
    selected = {i: (cand[pick_k[i]][i][0], cand[pick_v[i]][i][1]) for i in st.layers}
    ck_sel = np.array([searches[pick_k[i]].best(n_layers)[0][i] for i in range(n_layers)], np.float32)
    cv_sel = np.array([searches[pick_v[i]].best(n_layers)[1][i] for i in range(n_layers)], np.float32)

    # refit encoder: clips searched for that encoder
    refit_h = clip_search_q(model, cand["hadamard"], cq, group, held, dev, fake_quantize_refit)
    refit_l = clip_search_q(model, learned, cq, group, held, dev, fake_quantize_refit)
    # non-orthogonal K transform from the keys' covariance and the queries'
    kt = {i: whitening_k_transform(s.key_covariance(), s.query_covariances().mean(0).cpu().numpy())
          for i, s in st.layers.items()}
    kt_search = ClipSearch({i: (kt[i][0], H) for i in st.layers}, cq, group, window=WINDOW, k_score={i: kt[i][1] for i in kt})
    run_search(model, kt_search, held, dev)
    stamp("refit and K-transform searches")

    def rot(name, part):
        return None if name == "none" else {i: v[part] for i, v in cand[name].items()}

    def cfg(label, name, clips, window=WINDOW, **kw):
        return KVConfig(label, rot(name, 0), rot(name, 1), clips[0], clips[1], group, window=window, **kw)

    configs = []
    for name in cand:
        configs.append(cfg(f"{name}, searched clips", name, searches[name].best(n_layers)))
    configs.append(KVConfig("per-layer choice, searched clips", {i: v[0] for i, v in selected.items()},
                            {i: v[1] for i, v in selected.items()}, ck_sel, cv_sel, group, window=WINDOW))
    for name in ("none", "hadamard", "oscar", "learned"):
        clips = searches[name].best(n_layers)
        configs.append(cfg(f"{name}, searched clips, K only", name, clips, quantize_v=False))
        configs.append(cfg(f"{name}, searched clips, V only", name, clips, quantize_k=False))
    configs.append(cfg("hadamard, refit encoder, clips searched for it [runtime change]", "hadamard",
                       refit_h.best(n_layers), quantizer=fake_quantize_refit))
    configs.append(cfg("learned, refit encoder, clips searched for it [runtime change]", "learned",
                       refit_l.best(n_layers), quantizer=fake_quantize_refit))
    configs.append(KVConfig("K·A/q·A⁻ᵀ from key+query covariances, V Hadamard [runtime change]", None, rot("hadamard", 1),
                            kt_search.best(n_layers)[0], kt_search.best(n_layers)[1], group, window=WINDOW,
                            k_transform=kt))
    for name in ("hadamard", "learned", "oscar"):
        configs.append(cfg(f"{name}, searched clips", name, searches[name].best(n_layers), window=NO_WINDOW))
    from .artifact import load_artifact
    for spec in args.artifact:
        label, path = spec.split("=", 1)
        a = load_artifact(path).to_hf_layout()
        configs.append(KVConfig(f"artifact {label}", a.k_rot, a.v_rot, a.clip_k, a.clip_v, group, window=WINDOW))

    ev, _ = make_chunks(args.eval_text, encode, prefix, ChunkPlan(args.eval_seq, args.eval_tokens // args.eval_seq, 0))
    print(f"evaluating {len(configs)} configs on up to {len(ev)} chunks", flush=True)
    deadline = None if args.budget is None else time.monotonic() + args.budget
    res = run_simulation(model, ev, configs, deadline=deadline)
    rows = []
    for c in configs:
        r = res[c.label]
        e = r.layer_errors()
        rows.append({"config": c.name, "window": list(c.window), "mean_kl": r.mean_kl, "same_top1": r.same_top1,
                     "attn_rel_err_mean": float(np.mean(list(e.values()))), "chunk_kl": r.chunk_kl,
                     "positions": r.positions})
    log.update(results=rows, calib_error_totals=totals, pick_k=pick_k, pick_v=pick_v,
               eval_chunks=len(rows[0]["chunk_kl"]), eval_seq=args.eval_seq,
               clips={n: {"k": s.best(n_layers)[0].tolist(), "v": s.best(n_layers)[1].tolist()}
                      for n, s in searches.items()})
    np.savez(out / "learned_rotations.npz", **{f"k{i}": v[0] for i, v in learned.items()},
             **{f"v{i}": v[1] for i, v in learned.items()})
    (out / "study.json").write_text(json.dumps(log, indent=1, default=str))
    for row in rows:
        w = "64/256" if row["window"] != [0, 0] else "none"
        print(f"| {row['config']} | {w} | {row['mean_kl']:.4f} | {100 * row['same_top1']:.1f} % | "
              f"{row['attn_rel_err_mean']:.4f} |")
    print("calibration-objective totals (K score error, V output error) at each candidate's best clips:")
    for n, t in sorted(totals.items(), key=lambda x: x[1]["k"]):
        print(f"  {n:24s} K {t['k']:.4g}  V {t['v']:.4g}")
    print("picked for K:", {n: sum(1 for v in pick_k.values() if v == n) for n in set(pick_k.values())})
    print("picked for V:", {n: sum(1 for v in pick_v.values() if v == n) for n in set(pick_v.values())})
    stamp("done")
    return 0


def run_search(model, search: ClipSearch, held, dev) -> None:
    from .capture_hf import mask_to_bool

    def handler(call):
        q, k, v = (x.transpose(1, 2) for x in (call.query, call.key, call.value))
        allowed = None if call.mask is None else mask_to_bool(call.mask, q.shape[1], k.shape[1], q.device)[0, 0]
        for b in range(q.shape[0]):
            search.observe(call.layer, q[b], k[b], v[b], call.scaling, allowed)

    with torch.no_grad(), attention_tap(model, handler):
        for c in held:
            decoder(model)(torch.as_tensor(c, dtype=torch.long, device=dev)[None], use_cache=False)


def clip_search_q(model, rotations, cq, group, held, dev, quantizer) -> ClipSearch:
    s = ClipSearch(rotations, cq, group, window=WINDOW, quantizer=quantizer)
    run_search(model, s, held, dev)
    return s


if __name__ == "__main__":
    raise SystemExit(main())

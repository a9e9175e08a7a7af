"""Second-stage study: which orthogonal rotation actually suits the oscar2 quantizer?

    python -m research.rotation_study --model MODEL.gguf --eval-text HELDOUT.txt --out DIR

The first study (config_study.py) found plain Hadamard ahead of OSCAR's calibrated rotation
on SmolLM2-135M. This one measures, with everything calibrated on the bundled corpus and the
held-out text used only for the final KL:
- where the loss is (K only / V only quantized);
- candidate rotations: Hadamard in HF and in llama.cpp order, randomised Hadamards, OSCAR,
  OSCAR-DC, the eigenbasis of the keys' own covariance, and a rotation learned per layer
  through the runtime quantizer (oscar_gguf.calibrate.rotations.learn_rotation);
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

from oscar_gguf.calibrate.calibrator import ArtifactSource, Calibrator
from oscar_gguf.calibrate.capture_hf import attention_tap, decoder
from oscar_gguf.calibrate.oscar_rotation import hadamard, oscar_rotation
from oscar_gguf.calibrate.rotations import dc_rotation, learn_rotation, sst_token_weights

from .simulated_variants import (StudyKVConfig, fake_quantize_refit, hadamard_llama_order, random_sign_hadamard,
                                 whitening_k_transform)
from .study_setup import (NO_WINDOW, WINDOW, Study, artifact_configs, clip_search, evaluate, result_rows, run_passes,
                          study_parser, study_setup, table)


def capture_samples(study: Study, chunks, skip: int):
    """Per layer: keys and values [N, H_kv, d] at positions >= skip."""
    out: dict[int, dict[str, list]] = {}

    def handler(call):
        o = out.setdefault(call.layer, {"k": [], "v": []})
        o["k"].append(call.key[0].transpose(0, 1)[skip:].float())      # [T', H_kv, d]
        o["v"].append(call.value[0].transpose(0, 1)[skip:].float())
        return None

    with torch.no_grad(), attention_tap(study.model, handler):
        for c in chunks:
            decoder(study.model)(torch.as_tensor(c, dtype=torch.long, device=study.dev)[None], use_cache=False)
    return {i: {k: torch.cat(v) for k, v in o.items()} for i, o in out.items()}


def candidates(study: Study, st) -> dict[str, dict]:
    d, group, h = study.d, study.group, hadamard(study.d)
    cand = {
        "none": {i: (np.eye(d), np.eye(d)) for i in st.layers},
        "hadamard": {i: (h, h) for i in st.layers},
        "hadamard-llama-order": {i: (hadamard_llama_order(d), h) for i in st.layers},
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
    return cand


def learned_rotations(study: Study, st, clips: tuple[np.ndarray, np.ndarray], steps: int, sample_chunks: int) -> dict:
    """Rotations learned per layer from Hadamard, at Hadamard's searched clips."""
    samples = capture_samples(study, study.stat[:sample_chunks], skip=WINDOW[0])
    h = hadamard(study.d)
    learned = {}
    for i, s in st.layers.items():
        k, v = samples[i]["k"], samples[i]["v"]
        c_h = s.query_covariances().float()
        w = sst_token_weights(k, c_h).reshape(-1)            # the V rows' sst weights, per KV head
        kf, vf = k.reshape(-1, study.d), v.reshape(-1, study.d)
        rk = learn_rotation(kf, c_h.mean(0), study.group, float(clips[0][i]), h, steps=steps)
        rv = learn_rotation(vf, None, study.group, float(clips[1][i]), h, steps=steps, token_weight=w)
        learned[i] = (rk, rv)
    return learned


def per_layer_choice(study: Study, st, cand: dict, searches: dict) -> tuple[StudyKVConfig, dict]:
    """Per layer, the candidate with the least calibration error for K and for V."""
    n = study.n_layers
    errs = {name: s.min_errors() for name, s in searches.items()}
    pick_k = {i: min(errs, key=lambda c: errs[c][i][0]) for i in st.layers}
    pick_v = {i: min(errs, key=lambda c: errs[c][i][1]) for i in st.layers}
    ck = np.array([searches[pick_k[i]].best(n)[0][i] for i in range(n)], np.float32)
    cv = np.array([searches[pick_v[i]].best(n)[1][i] for i in range(n)], np.float32)
    cfg = StudyKVConfig("per-layer choice, searched clips", {i: cand[pick_k[i]][i][0] for i in st.layers},
                        {i: cand[pick_v[i]][i][1] for i in st.layers}, ck, cv, study.group, window=WINDOW)
    totals = {name: {"k": sum(e[0] for e in v.values()), "v": sum(e[1] for e in v.values())} for name, v in errs.items()}
    return cfg, {"calib_error_totals": totals, "pick_k": pick_k, "pick_v": pick_v}


def variant_configs(study: Study, st, cand: dict, cq: dict) -> list[StudyKVConfig]:
    """The refit encoder with clips searched for it, and a non-orthogonal K transform."""
    n, group = study.n_layers, study.group
    h = hadamard(study.d)
    out = [StudyKVConfig(f"{name}, refit encoder, clips searched for it [runtime change]",
                         {i: v[0] for i, v in cand[name].items()}, {i: v[1] for i, v in cand[name].items()},
                         *clip_search(study, cand[name], cq, quantizer=fake_quantize_refit).best(n), group,
                         window=WINDOW, quantizer=fake_quantize_refit)
           for name in ("hadamard", "learned")]
    kt = {i: whitening_k_transform(s.key_covariance(), s.query_covariances().mean(0).cpu().numpy())
          for i, s in st.layers.items()}
    kt_search = clip_search(study, {i: (kt[i][0], h) for i in st.layers}, cq, k_score={i: kt[i][1] for i in kt})
    out.append(StudyKVConfig("K·A/q·A⁻ᵀ from key+query covariances, V Hadamard [runtime change]", None,
                             {i: h for i in st.layers}, *kt_search.best(n), group, window=WINDOW, k_transform=kt))
    return out


def main(argv=None) -> int:
    ap = study_parser("python -m research.rotation_study", eval_tokens=65536)
    ap.add_argument("--sample-chunks", type=int, default=2)
    ap.add_argument("--learn-steps", type=int, default=200)
    args = ap.parse_args(argv)
    t0 = time.time()
    study = study_setup(args)
    n = study.n_layers
    cal = Calibrator(study.model, clip="fixed", window=WINDOW, source=ArtifactSource("llama", n, "hf"))
    run_passes(study, cal)
    st = cal.state
    cq = {i: s.query_covariances() for i, s in st.layers.items()}
    log = {"seconds": {}}

    def stamp(what):
        log["seconds"][what] = round(time.time() - t0, 1)
        print(f"{what} at {time.time() - t0:.0f} s", flush=True)

    stamp("calibrated")
    cand = candidates(study, st)
    searches = {name: clip_search(study, r, cq) for name, r in cand.items()}
    stamp("candidate clip searches")
    cand["learned"] = learned = learned_rotations(study, st, searches["hadamard"].best(n), args.learn_steps,
                                                  args.sample_chunks)
    searches["learned"] = clip_search(study, learned, cq)
    stamp("learned rotations")
    choice, picks = per_layer_choice(study, st, cand, searches)
    variants = variant_configs(study, st, cand, cq)
    stamp("refit and K-transform searches")

    def cfg(label, name, window=WINDOW, **variant):
        part = (lambda j: None if name == "none" else {i: v[j] for i, v in cand[name].items()})
        return StudyKVConfig(label, part(0), part(1), *searches[name].best(n), study.group, window=window, **variant)

    configs = [cfg(f"{name}, searched clips", name) for name in cand] + [choice]
    for name in ("none", "hadamard", "oscar", "learned"):
        configs += [cfg(f"{name}, searched clips, K only", name, quantize_v=False),
                    cfg(f"{name}, searched clips, V only", name, quantize_k=False)]
    configs += variants
    configs += [cfg(f"{name}, searched clips", name, window=NO_WINDOW) for name in ("hadamard", "learned", "oscar")]
    configs += artifact_configs(study, windows=(WINDOW,))

    rows = result_rows(configs, evaluate(study, configs))
    log.update(results=rows, **picks, eval_chunks=len(rows[0]["chunk_kl"]), eval_seq=args.eval_seq,
               clips={c: {"k": s.best(n)[0].tolist(), "v": s.best(n)[1].tolist()} for c, s in searches.items()})
    np.savez(study.out / "learned_rotations.npz", **{f"k{i}": v[0] for i, v in learned.items()},
             **{f"v{i}": v[1] for i, v in learned.items()})
    (study.out / "study.json").write_text(json.dumps(log, indent=1, default=str))
    print(table(rows))
    print("calibration-objective totals (K score error, V output error) at each candidate's best clips:")
    for c, t in sorted(picks["calib_error_totals"].items(), key=lambda x: x[1]["k"]):
        print(f"  {c:24s} K {t['k']:.4g}  V {t['v']:.4g}")
    for part in ("k", "v"):
        pick = picks[f"pick_{part}"]
        print(f"picked for {part.upper()}:", {c: sum(1 for v in pick.values() if v == c) for c in set(pick.values())})
    stamp("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which KV configuration, in simulation: rotation (none, Hadamard, OSCAR, OSCAR-DC) x clip ratios
(none, the paper's pair, searched) x window, on held-out text; and variants that would need a
runtime change (per-head clips, an LSQ refit encoder, a non-orthogonal K transform).

    python -m research.config_study --model MODEL.gguf --eval-text HELDOUT.txt --out DIR
    python -m research.config_study --set default ...   # the package's default recipe, `oscar simulate`'s rows

Writes DIR/results.json, DIR/table.md and the artifacts of the two OSCAR recipes (study_setup.py
says which text is used for what).
"""
from __future__ import annotations

import json
import time

import numpy as np

from oscar_gguf.calibrate.artifact import save_artifact
from oscar_gguf.calibrate.calibrator import ArtifactSource, Calibrator
from oscar_gguf.calibrate.oscar_rotation import hadamard
from oscar_gguf.calibrate.rotations import dc_rotation
from oscar_gguf.format.gguf_keys import DEFAULT_CLIP_K, DEFAULT_CLIP_V

from .simulated_variants import (StudyKVConfig, fake_quantize_refit, predicted_k_transform_gain,
                                 whitening_k_transform)
from .study_setup import (NO_WINDOW, WINDOW, Study, artifact_configs, clip_search, evaluate, result_rows, run_passes,
                          study_parser, study_setup, table)


def candidate_rotations(study: Study, st) -> dict[str, dict]:
    d, group = study.d, study.group
    return {
        "none": {i: (np.eye(d), np.eye(d)) for i in st.layers},
        "hadamard": {i: (hadamard(d), hadamard(d)) for i in st.layers},
        "oscar": {i: (r[0], r[2]) for i, r in st.rotations.items()},
        "oscar-dc": {i: (dc_rotation(s.k_covariance(), group)[0], dc_rotation(s.v_covariance(), group)[0])
                     for i, s in st.layers.items()},
    }


class Configs:
    """The rows of the comparison, named after their rotation and clips."""

    def __init__(self, study: Study, rot: dict, searches: dict, cq: dict):
        self.study, self.rot, self.searches, self.cq = study, rot, searches, cq
        n = study.n_layers
        self.ones = (np.ones(n, np.float32), np.ones(n, np.float32))
        self.fixed = (np.full(n, DEFAULT_CLIP_K, np.float32), np.full(n, DEFAULT_CLIP_V, np.float32))

    def part(self, name: str, which: int):
        return None if name == "none" else {i: v[which] for i, v in self.rot[name].items()}

    def cfg(self, label, name, clips, window, **variant):
        return StudyKVConfig(label, self.part(name, 0), self.part(name, 1), clips[0], clips[1], self.study.group,
                             window=window, **variant)

    def best(self, name, window):
        return self.searches[name, window].best(self.study.n_layers)

    def main_rows(self, w) -> list:
        own_hadamard = self.best("hadamard", WINDOW) if w == WINDOW else \
            clip_search(self.study, self.rot["hadamard"], self.cq, w).best(self.study.n_layers)
        return [
            self.cfg("no rotation, clip 1.0", "none", self.ones, w),
            self.cfg("Hadamard, clip 1.0", "hadamard", self.ones, w),
            self.cfg("Hadamard, clips .96/.92", "hadamard", self.fixed, w),
            self.cfg("Hadamard, OSCAR's searched clips", "hadamard", self.best("oscar", w), w),
            self.cfg("Hadamard, own searched clips", "hadamard", own_hadamard, w),
            self.cfg("OSCAR, clip 1.0", "oscar", self.ones, w),
            self.cfg("OSCAR, clips .96/.92", "oscar", self.fixed, w),
            self.cfg("OSCAR, searched clips", "oscar", self.best("oscar", w), w),
        ]

    def explore_rows(self, w, st) -> list:
        n = self.study.n_layers
        sw, sdc = self.searches["oscar", w], self.searches["oscar-dc", w]
        other = WINDOW if w == NO_WINDOW else NO_WINDOW
        # non-orthogonal, attention-aware K transform; V keeps OSCAR-DC
        kt = {i: whitening_k_transform(s.k_covariance(), s.query_covariances().mean(0).cpu().numpy())
              for i, s in st.layers.items()}
        return [
            self.cfg("OSCAR, searched clips (other window objective)", "oscar", self.best("oscar", other), w),
            self.cfg("OSCAR, per-head searched clips [runtime change]", "oscar", sw.best_per_head(n), w),
            self.cfg("OSCAR, searched clips, LSQ refit encoder [runtime change]", "oscar", sw.best(n), w,
                     quantizer=fake_quantize_refit),
            self.cfg("OSCAR-DC, clip 1.0", "oscar-dc", self.ones, w),
            self.cfg("OSCAR-DC, clips .96/.92", "oscar-dc", self.fixed, w),
            self.cfg("OSCAR-DC, searched clips", "oscar-dc", sdc.best(n), w),
            self.cfg("OSCAR-DC, per-head searched clips [runtime change]", "oscar-dc", sdc.best_per_head(n), w),
            self.cfg("OSCAR-DC, searched clips, LSQ refit encoder [runtime change]", "oscar-dc", sdc.best(n), w,
                     quantizer=fake_quantize_refit),
            StudyKVConfig("K·A / q·A⁻ᵀ transform, V OSCAR-DC, searched clips [runtime change]", None,
                          self.part("oscar-dc", 1), sdc.best(n)[0], sdc.best(n)[1], self.study.group, window=w,
                          k_transform=kt),
        ]


def save_dc_artifact(study: Study, cal: Calibrator, rot: dict, searches: dict) -> None:
    """The OSCAR-DC recipe as an artifact too."""
    art = cal.result(corpus="oscar-gguf default corpus")
    art.k_rot = {i: v[0].astype(np.float32) for i, v in rot["oscar-dc"].items()}
    art.v_rot = {i: v[1].astype(np.float32) for i, v in rot["oscar-dc"].items()}
    art.clip_k, art.clip_v = searches["oscar-dc", WINDOW].best(study.n_layers)
    art.method = "oscar-dc-qqt-sst/clip-search"
    save_artifact(study.out / "oscar_dc_search.safetensors", art)


def main(argv=None) -> int:
    ap = study_parser("python -m research.config_study", eval_tokens=32768)
    ap.add_argument("--set", default="main,explore",
                    help="config sets: main, explore; or 'default' alone: calibrate with the package's default "
                         "recipe (calibrate_hf_model) and run `oscar simulate`'s comparison on it")
    args = ap.parse_args(argv)
    t0 = time.time()
    study = study_setup(args)
    if args.set == "default":
        return verify_default(study, t0)
    cal = Calibrator(study.model, clip="search", window=WINDOW, rotation="oscar",
                     source=ArtifactSource("llama", study.n_layers, "hf", model=str(args.model)))
    run_passes(study, cal)
    save_artifact(study.out / "oscar_spec_search.safetensors", cal.result(corpus="oscar-gguf default corpus"))
    st = cal.state
    print(f"calibrated in {time.time() - t0:.0f} s", flush=True)
    cq = {i: s.query_covariances() for i, s in st.layers.items()}
    rot = candidate_rotations(study, st)
    searches = {(name, WINDOW): clip_search(study, r, cq) for name, r in rot.items()}
    for name in ("oscar", "oscar-dc"):
        searches[name, NO_WINDOW] = clip_search(study, rot[name], cq, NO_WINDOW)
    print(f"clip searches done at {time.time() - t0:.0f} s", flush=True)

    rows_of = Configs(study, rot, searches, cq)
    configs = []
    sets = set(args.set.split(","))
    for w in (NO_WINDOW, WINDOW):
        configs += rows_of.main_rows(w) if "main" in sets else []
        configs += rows_of.explore_rows(w, st) if "explore" in sets else []
    configs += artifact_configs(study)
    save_dc_artifact(study, cal, rot, searches)

    res = evaluate(study, configs)
    rows = result_rows(configs, res)
    n_layers = study.n_layers
    clips = {f"{n}|{w[0]},{w[1]}": {"k": s.best(n_layers)[0].tolist(), "v": s.best(n_layers)[1].tolist()}
             for (n, w), s in searches.items()}
    gains = {i: predicted_k_transform_gain(s.k_covariance(), s.query_covariances().mean(0).cpu().numpy())
             for i, s in st.layers.items()}
    n_eval = res[configs[0].label].positions // (args.eval_seq - args.eval_seq // 2)
    result = {"model": str(args.model), "eval_text": str(args.eval_text), "eval_tokens": n_eval * args.eval_seq,
              "eval_seq": args.eval_seq, "calib_tokens": int(len(study.stat) * args.calib_seq),
              "clip_chunks": len(study.held), "device": study.dev, "seconds": time.time() - t0, "results": rows,
              "clips": clips, "k_transform_predicted_gain": gains}
    (study.out / "results.json").write_text(json.dumps(result, indent=1))
    (study.out / "table.md").write_text(table(rows) + "\n")
    print(table(rows))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


def verify_default(study: Study, t0: float) -> int:
    """The package's own default path (HF backend, fp32) and `oscar simulate`'s table."""
    from oscar_gguf.calibrate.pipeline import calibrate_hf_model
    from oscar_gguf.calibrate.simulate import standard_configs

    args = study.args
    source = ArtifactSource("llama", study.n_layers, "hf", model=str(args.model))
    art = calibrate_hf_model(study.model, study.encode, study.prefix, tokens=args.calib_tokens,
                             seq_len=args.calib_seq, clip="search", progress=False, source=source)
    save_artifact(study.out / "default_recipe.safetensors", art)
    print(f"default recipe {art.method} calibrated at {time.time() - t0:.0f} s", flush=True)
    configs = standard_configs(art, WINDOW) + artifact_configs(study, label="artifact {name} ({method})")
    rows = result_rows(configs, evaluate(study, configs))
    (study.out / "default.json").write_text(json.dumps({"method": art.method, "clip_k": art.clip_k.tolist(),
                                                        "clip_v": art.clip_v.tolist(), "results": rows,
                                                        "seconds": time.time() - t0}, indent=1))
    print(table(rows))
    print(f"done in {time.time() - t0:.0f} s, {len(rows[0]['chunk_kl'])} chunks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The calibration state machine, shared by both capture backends.

Passes over the text, in order:
  1. "queries": Σ Q_hᵀQ_h per layer and KV head  -> C_h, Σ_K
  2. "values":  Σ w_t v_tᵀv_t and Σ w_t with w_t = k_t C_h k_tᵀ -> Σ_V; then the rotations
  3. "clips":   (clip="search" only) grid errors on held-out chunks -> per-layer clips
Backends call ``observe(layer, q, k, v, ...)`` once per layer and sequence and
``end_pass()`` after each pass. ``Calibrator`` wraps this as a context manager around
any forward passes of a transformers model.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field

import numpy as np
import torch

from ..format.gguf_keys import DEFAULT_WINDOW
from ..format.oscar2 import group_size
from .artifact import RotationArtifact
from .clip import ClipSearch, clip_grid, fixed_clips
from .plan import DEFAULT_BUDGET, DEFAULT_THRESHOLD, plan_f16_keys
from .rotations import RECIPES, SampleStore, fit_layer
from .stats import AttentionShape, LayerStats

PASSES = ("queries", "values", "clips")
CLIP_MODES = ("fixed", "search")


@dataclass
class ArtifactSource:
    """The model a calibration runs on, as its artifact records it."""
    architecture: str          # GGUF architecture name
    n_layers: int
    rope_layout: str           # "hf" or "llama.cpp": the head-dim order of the captured Q/K
    model: str = ""
    model_sha256: str = ""
    extra: dict = field(default_factory=dict)


# the best recipe whose fit costs seconds (rotations.py says what each measured)
DEFAULT_RECIPE = "key-eigen-dc"
METHODS = {"oscar": "oscar-qqt-sst", "hadamard": "hadamard", "key-eigen-dc": "key-eigen-dc/sst-dc",
           "learned": "learned-hadamard-ste/qqt-sst-weighted"}


class CalibrationState:
    def __init__(self, clip: str = "search", window: tuple[int, int] = DEFAULT_WINDOW,
                 clip_grid: list[float] | None = None, max_clip_queries: int = 128,
                 rotation: str = DEFAULT_RECIPE, learn_tokens: int = 4096, learn_steps: int = 200,
                 f16_k_budget: float = DEFAULT_BUDGET, f16_k_threshold: float = DEFAULT_THRESHOLD):
        if clip not in CLIP_MODES:
            raise ValueError(f"clip must be one of {CLIP_MODES}, got {clip!r}")
        if rotation not in RECIPES:
            raise ValueError(f"rotation must be one of {', '.join(RECIPES)}, got {rotation!r}")
        self.rotation = rotation
        self.learn_steps = learn_steps
        self.f16_k_budget = f16_k_budget        # the precision plan (plan.py); needs clip="search"
        self.f16_k_threshold = f16_k_threshold
        self.samples = SampleStore(learn_tokens, window[0]) if rotation == "learned" else None
        self.clip = clip
        self.window = window
        self.clip_grid = clip_grid
        self.max_clip_queries = max_clip_queries
        self.layers: dict[int, LayerStats] = {}
        self.pass_index = 0
        self.seen_in_pass = 0
        self.rotations: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.search: ClipSearch | None = None
        self.tokens = 0

    @property
    def pass_name(self) -> str | None:
        """The pass the next observations feed, or None when calibration is complete."""
        return PASSES[self.pass_index] if self.pass_index < len(PASSES) else None

    @property
    def shape(self) -> AttentionShape:
        shapes = {s.shape for s in self.layers.values()}
        if len(shapes) != 1:
            raise ValueError(f"layers differ in attention shape ({shapes}); the artifact needs one head_dim "
                             f"and head counts")
        return shapes.pop()

    @property
    def group(self) -> int:
        return group_size(self.shape.head_dim)

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scaling: float = 1.0, allowed: torch.Tensor | None = None) -> None:
        """One sequence of one layer: q [T, H_q, d], k and v [T, H_kv, d] (post-RoPE Q/K);
        allowed [T, T] bool (query, key), None for causal, used by the clip search only."""
        name = self.pass_name
        if name is None:
            raise RuntimeError("calibration is complete; call result()")
        self.seen_in_pass += 1
        if name == "queries":
            if layer not in self.layers:
                self.layers[layer] = LayerStats(AttentionShape(q.shape[1], k.shape[1], q.shape[2]))
            self.layers[layer].add_queries(q)
            if layer == min(self.layers):
                self.tokens += q.shape[0]
        elif name == "values":
            if layer not in self.layers:
                raise RuntimeError(f"layer {layer} was not seen in the query pass")
            self.layers[layer].add_values(k, v)
            if self.samples is not None:
                self.samples.add(layer, k, v)
        else:
            self.search.observe(layer, q, k, v, scaling, allowed)

    def end_pass(self) -> None:
        name = self.pass_name
        if name is None:
            return
        if self.seen_in_pass == 0:
            raise RuntimeError(f"no attention was observed during the {name!r} pass")
        self.seen_in_pass = 0
        self.pass_index += 1
        if name == "values":
            self._fit()
            if self.clip != "search":
                self.pass_index = len(PASSES)

    def _fit(self) -> None:
        grid = self.clip_grid or clip_grid(self.group)
        for i, st in sorted(self.layers.items()):
            self.rotations[i] = fit_layer(self.rotation, st, self.group, self.samples, i, grid, self.learn_steps)
        self.samples = None                      # free the sample
        if self.clip == "search":
            self.search = ClipSearch({i: (r[0], r[2]) for i, r in self.rotations.items()},
                                     {i: st.query_covariances() for i, st in self.layers.items()},
                                     self.group, self.clip_grid, self.window, self.max_clip_queries)

    def covariances(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """(Σ_K, Σ_V) per layer, float64, in the captured head-dim order."""
        return {i: (st.k_covariance(), st.v_covariance()) for i, st in sorted(self.layers.items())}

    def result(self, source: ArtifactSource, corpus: str = "") -> RotationArtifact:
        from .. import __version__

        if self.pass_name is not None:
            raise RuntimeError(f"calibration needs the {self.pass_name!r} pass before result()")
        s = self.shape
        if self.clip == "search":
            ck, cv = self.search.best(source.n_layers)
        else:
            ck, cv = fixed_clips(source.n_layers)
        extra = {"group_size": str(self.group), "clip_mode": self.clip, "rotation": self.rotation,
                 "window": f"{self.window[0]},{self.window[1]}", **{k: str(v) for k, v in source.extra.items()}}
        plan: tuple[int, ...] = ()
        if self.search is not None:
            extra["clip_search_sequences"] = str(self.search.sequences)
            # the runtime's oscar2 layers: not the sliding-window ones (their cache stays f16)
            errors = {i: self.search.k_output_error(i, float(ck[i])) for i in sorted(self.search.out_err_k)
                      if i not in self.search.sliding}
            extra["k_output_error"] = " ".join(f"{i}:{e:.4f}" for i, e in errors.items())
            plan = plan_f16_keys(errors, self.group, self.f16_k_threshold, self.f16_k_budget)
        art = RotationArtifact(
            architecture=source.architecture, n_layers=source.n_layers, head_dim=s.head_dim, n_head=s.n_head,
            n_head_kv=s.n_head_kv, rope_layout=source.rope_layout,
            k_rot={i: r[0].astype(np.float32) for i, r in self.rotations.items()},
            v_rot={i: r[2].astype(np.float32) for i, r in self.rotations.items()},
            k_eigenvalues={i: r[1].astype(np.float32) for i, r in self.rotations.items()},
            v_eigenvalues={i: r[3].astype(np.float32) for i, r in self.rotations.items()},
            clip_k=ck, clip_v=cv, model=source.model, model_sha256=source.model_sha256, corpus=corpus,
            tokens=self.tokens, method=f"{METHODS[self.rotation]}/clip-{self.clip}",
            date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            tool=f"oscar-gguf {__version__}", extra=extra, f16_k_layers=plan)
        return art.validate()


class Calibrator:
    """Calibrate a transformers model by observing its forward passes.

        cal = Calibrator(model, clip="search")
        while cal.pass_name:                 # "queries", "values", then "clips"
            with cal:
                for ids in chunks(cal.pass_name):   # held-out chunks for "clips"
                    model(ids)
        artifact = cal.result()

    Each ``with`` block is one pass over the text; the V statistics need the finished query
    covariances, hence the second pass (docs/design.md §1). Activations are reduced to
    float64 sums inside the attention call and never stored.
    """

    def __init__(self, model: torch.nn.Module, *, clip: str = "search", rotation: str = DEFAULT_RECIPE,
                 window: tuple[int, int] = DEFAULT_WINDOW, source: ArtifactSource | None = None,
                 learn_tokens: int = 4096, learn_steps: int = 200, f16_k_budget: float = DEFAULT_BUDGET,
                 f16_k_threshold: float = DEFAULT_THRESHOLD):
        from .capture_hf import gguf_architecture, text_config

        self.model = model
        self.state = CalibrationState(clip=clip, window=window, rotation=rotation, learn_tokens=learn_tokens,
                                      f16_k_budget=f16_k_budget, f16_k_threshold=f16_k_threshold,
                                      learn_steps=learn_steps)
        cfg = text_config(model.config)
        self.source = source or ArtifactSource(architecture=gguf_architecture(cfg), n_layers=int(cfg.num_hidden_layers),
                                               rope_layout="hf", model=str(getattr(cfg, "_name_or_path", "") or ""))
        self._tap = None

    @property
    def pass_name(self) -> str | None:
        return self.state.pass_name

    def _handle(self, call) -> None:
        from .capture_hf import mask_to_bool

        q = call.query.transpose(1, 2)
        k = call.key.transpose(1, 2)
        v = call.value.transpose(1, 2)
        allowed = None
        if self.state.pass_name == "clips" and call.mask is not None:
            allowed = mask_to_bool(call.mask, q.shape[1], k.shape[1], q.device)
        for b in range(q.shape[0]):
            a = None if allowed is None else allowed[min(b, allowed.shape[0] - 1), 0]
            self.state.observe(call.layer, q[b], k[b], v[b], call.scaling, a)
        return None

    def __enter__(self) -> "Calibrator":
        from .capture_hf import attention_tap

        if self.state.pass_name is None:
            raise RuntimeError("calibration is already complete; call result()")
        self._tap = attention_tap(self.model, self._handle)
        self._tap.__enter__()
        self._grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        torch.set_grad_enabled(self._grad)
        self._tap.__exit__(exc_type, exc, tb)
        self._tap = None
        if exc_type is None:
            self.state.end_pass()

    def result(self, corpus: str = "") -> RotationArtifact:
        return self.state.result(self.source, corpus)

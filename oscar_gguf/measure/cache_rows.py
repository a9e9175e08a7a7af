"""The K and V rows llama.cpp stores in its oscar2 cache, checked layer by layer.

`oscar check-rows MODEL-oscar.gguf` runs the same tokens through llama.cpp (CPU, an oscar2 K and V
cache) and through the transformers model that `oscar simulate` uses, and compares, for every
layer with attention:

- input: the vector llama.cpp writes into its cache (the SET_ROWS source: post-RoPE, post-QK-norm,
  rotated by the layer's R) against the transformers K (or V) rotated by the same R, mapped to the
  HF head-dim order (calibrate/layout.py). A mismatch here means the two sides do not attend over
  the same keys: the rotation, the layout, the norm or RoPE differ for this architecture.
- stored: the bytes in the cache against the bit-exact numpy quantizer (format/oscar2.py) applied to
  llama.cpp's own input with the layer's clip ratio from the GGUF. They must be equal: anything else
  means the quantizer or the clip ratio that reached it differs from what the simulation models.
- window: the f16 rows of the high-precision window against llama.cpp's input rounded to f16.

Together these say whether the simulation's quantized K and V are what the runtime stores.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..calibrate import layout
from ..calibrate.capture_llama import GgmlTensor, LlamaBackendError, _ggml_api, _llama
from ..format import gguf_keys, oscar2
from ..format.gguf_read import read_model_info

_CACHE = re.compile(r"^cache_([kv])_l(\d+)")
_WINDOW = re.compile(r"^oscar_window_([kv])_l(\d+)")
GGML_TYPE_F16 = 1


@dataclass
class StoredRows:
    """What llama.cpp wrote for one layer and kind: its input rows and the stored bytes."""
    inputs: np.ndarray            # f32 [T, n_embd_gqa]
    stored: list[bytes]           # per token, the cache row
    window: list[bytes | None]    # per token, the window row (None: the token went to the trash row)
    ggml_type: int


@dataclass
class LayerCheck:
    layer: int
    kind: str                     # "k" | "v"
    cache: str                    # "oscar2", or "f16" for a cache llama.cpp keeps unquantized
    input_rel_err: float          # ‖llama input − HF·R‖ / ‖HF·R‖ (no R for an f16 cache)
    stored_equal: float           # share of rows whose bytes equal the numpy quantizer's (f16's)
    window_equal: float | None    # share of window rows equal to f16(input); None without a window
    codes_agree: float | None     # share of 2-bit codes equal when the HF values are quantized instead


@dataclass
class RowReport:
    architecture: str
    tokens: int
    layers: list[LayerCheck] = field(default_factory=list)

    def worst_input_error(self) -> float:
        return max((c.input_rel_err for c in self.layers), default=0.0)

    def all_stored_equal(self) -> bool:
        return all(c.stored_equal == 1.0 and c.window_equal in (None, 1.0) for c in self.layers)

    def table(self) -> str:
        lines = [f"{self.architecture}, {self.tokens} tokens",
                 "layer kind  cache   input rel err  stored = twin  window = f16  codes agree (HF input)"]
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
        for c in self.layers:
            lines.append(f"{c.layer:5d} {c.kind:>4}  {c.cache:6s}  {c.input_rel_err:13.2e}  {pct(c.stored_equal):>13}"
                         f"  {pct(c.window_equal):>12}  {pct(c.codes_agree):>10}")
        return "\n".join(lines)


class _RowCapture:
    """llama.cpp with an oscar2 cache; the graph-eval callback keeps every cache write."""

    def __init__(self, gguf: Path, n_tokens: int, window: tuple[int, int], n_threads: int, swa_full: bool):
        self.lc = lc = _llama()
        self.api = _ggml_api(lc)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise LlamaBackendError(f"llama.cpp could not load {gguf}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = max(n_tokens, window[0] + window[1])
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k = cp.type_v = oscar2.OSCAR2_TYPE_ID       # the variant follows from head_dim
        cp.oscar_sink, cp.oscar_recent = window
        cp.swa_full = swa_full    # False, as llama-server and the other tools: a bounded sliding-window cache
        cp.no_perf = True
        self._cb = lc.ggml_backend_sched_eval_callback(self._callback)
        cp.cb_eval = self._cb
        cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise LlamaBackendError(f"llama.cpp could not make an oscar2 context for {gguf}")
        # (store, kind, layer) -> (inputs, row indices, rows written, ggml type, rows of the destination)
        self.writes: dict[tuple[str, str, int], tuple[np.ndarray, np.ndarray, list[bytes], int, int]] = {}
        self.error: BaseException | None = None

    def _t(self, ptr) -> GgmlTensor:
        return GgmlTensor.from_address(ptr)

    def _raw(self, ptr) -> bytes:
        n = int(self.api["ggml_nbytes"](ptr))
        buf = (ctypes.c_uint8 * n)()
        self.api["ggml_backend_tensor_get"](ptr, ctypes.addressof(buf), 0, n)
        return bytes(buf)

    def _dest(self, t: GgmlTensor):
        """(store, kind, layer) when the SET_ROWS node writes a cache or window tensor."""
        for ptr in (ctypes.addressof(t), t.view_src):
            if not ptr:
                continue
            name = self._t(ptr).name.decode(errors="replace")
            for store, pat in (("cache", _CACHE), ("window", _WINDOW)):
                m = pat.match(name)
                if m:
                    return store, m.group(1), int(m.group(2))
        return None

    def _callback(self, ptr, ask, user) -> bool:
        try:
            t = self._t(ptr)
            if self.api["ggml_op_name"](t.op).decode() != "SET_ROWS":
                return False
            dest = self._dest(t)
            if dest is None:
                return False
            if not ask:
                src = self._t(t.src[0])
                if src.type != 0:
                    raise LlamaBackendError(f"{dest}: the cache write's source is type {src.type}, not f32")
                n_embd, n_tok = int(src.ne[0]), int(src.ne[1]) * int(src.ne[2]) * int(src.ne[3])
                x = np.frombuffer(self._raw(t.src[0]), np.float32).reshape(n_tok, n_embd).copy()
                idx = np.frombuffer(self._raw(t.src[1]), np.int64).copy()
                data, row = self._raw(ptr), int(t.nb[1])
                rows = [data[int(i) * row:(int(i) + 1) * row] for i in idx]
                self.writes[dest] = (x, idx, rows, int(t.type), int(t.ne[1]))
            return True
        except BaseException as e:  # an exception must not cross the C boundary
            self.error = self.error or e
            return False

    def run(self, tokens: list[int]) -> None:
        lc = self.lc
        arr = (lc.llama_token * len(tokens))(*tokens)
        rc = lc.llama_decode(self.ctx, lc.llama_batch_get_one(arr, len(tokens)))
        if self.error is not None:
            raise self.error
        if rc != 0:
            raise LlamaBackendError(f"llama_decode failed with {rc}")

    def close(self) -> None:
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def llama_rows(gguf: Path, tokens: list[int], window: tuple[int, int], n_threads: int = 2,
               swa_full: bool = False) -> dict:
    """{(kind, layer): StoredRows} of one prompt decoded in one ubatch."""
    cap = _RowCapture(gguf, len(tokens), window, n_threads, swa_full)
    try:
        cap.run(tokens)
    finally:
        cap.close()
    out = {}
    for (store, kind, layer), (x, idx, rows, ggml_type, _) in cap.writes.items():
        if store == "cache":
            out[(kind, layer)] = StoredRows(x, rows, [None] * len(rows), ggml_type)
    for (store, kind, layer), (x, idx, rows, ggml_type, n_rows) in cap.writes.items():
        if store == "window" and (kind, layer) in out:
            # the window tensor's last row is its trash row: tokens outside the window go there
            out[(kind, layer)].window = [None if int(i) == n_rows - 1 else r for i, r in zip(idx, rows)]
    return out


def hf_kv(model, tokens: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{layer: (K [T, H_kv, d], V [T, H_kv, d])} as the transformers model attends, post-RoPE."""
    import torch

    from ..calibrate.capture_hf import attention_tap

    seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def handler(call):
        k = call.key[0].float().permute(1, 0, 2).numpy()
        v = call.value[0].float().permute(1, 0, 2).numpy()
        seen[call.layer] = (k.copy(), v.copy())
        return None

    with torch.no_grad(), attention_tap(model, handler):
        model(torch.as_tensor([tokens], dtype=torch.long), use_cache=False)
    return seen


@dataclass
class RuntimeSettings:
    """What llama.cpp applies for a GGUF with OSCAR data: rotations in its head-dim order, and the
    clip ratio of every layer (the GGUF's, else the runtime's defaults)."""
    arch: str
    rotations: dict[int, tuple[np.ndarray, np.ndarray]]   # layer -> (R_k, R_v)
    clip_k: np.ndarray
    clip_v: np.ndarray
    f16_k_layers: frozenset[int] = frozenset()   # the precision plan: K caches kept in f16

    def k_rotations_hf(self) -> dict[int, np.ndarray]:
        """R_k per layer for vectors in the transformers head-dim order (calibrate/layout.py)."""
        permuted = layout.needs_qk_permutation(self.arch)
        return {i: layout.rotation_llama_to_hf(k) if permuted else k for i, (k, _) in self.rotations.items()}


def runtime_settings(gguf: Path) -> RuntimeSettings:
    info = read_model_info(gguf)
    n = info.n_layer

    def clips(key: str, default: float) -> np.ndarray:
        v = info.oscar.get(key)
        return np.asarray(v, np.float32) if v is not None else np.full(n, default, np.float32)

    rots = {i: (np.array(info.k_rot[i], np.float32), np.array(info.v_rot[i], np.float32))
            for i in sorted(info.k_rot) if i in info.v_rot}
    keep = info.oscar.get(gguf_keys.KEY_F16_K_LAYERS)
    return RuntimeSettings(info.arch, rots, clips(gguf_keys.KEY_CLIP_K, gguf_keys.DEFAULT_CLIP_K),
                           clips(gguf_keys.KEY_CLIP_V, gguf_keys.DEFAULT_CLIP_V),
                           frozenset(int(i) for i in keep) if isinstance(keep, list) else frozenset())


def _rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _compare(kind: str, layer: int, rows: StoredRows, ref: np.ndarray, clip: float, group: int) -> LayerCheck:
    """An oscar2 layer: stored bytes against the numpy quantizer of llama.cpp's own input."""
    x = rows.inputs
    twin = [oscar2.quantize_row(x[i], group, clip) for i in range(len(x))]
    stored_equal = float(np.mean([a == b for a, b in zip(twin, rows.stored)]))
    win = [(i, w) for i, w in enumerate(rows.window) if w is not None]
    window_equal = None
    if win:
        window_equal = float(np.mean([w == x[i].astype(np.float16).tobytes() for i, w in win]))
    c_hf = oscar2.quantize_groups(ref, group, clip)[0]
    c_ll = oscar2.unpack(b"".join(rows.stored), group)[0].reshape(c_hf.shape)
    return LayerCheck(layer, kind, "oscar2", _rel_err(x, ref), stored_equal, window_equal, float(np.mean(c_hf == c_ll)))


def _compare_f16(kind: str, layer: int, rows: StoredRows, ref: np.ndarray) -> LayerCheck:
    """A layer whose cache llama.cpp keeps in f16 (no rotation, no window): stored rows are f16(input)."""
    x = rows.inputs
    equal = float(np.mean([s == x[i].astype(np.float16).tobytes() for i, s in enumerate(rows.stored)]))
    return LayerCheck(layer, kind, "f16", _rel_err(x, ref), equal, None, None)


def check_rows(gguf: str | Path, tokens: list[int], model=None, n_threads: int = 2,
               swa_full: bool = False) -> RowReport:
    """Compare llama.cpp's cache writes with the transformers model and the numpy quantizer.

    Every token is written to the INT2 cache; the window is made to cover the whole prompt, so that
    attention reads the same f16 keys and values on both sides and a layer's input differs from the
    transformers model only by floating-point rounding, not by the quantization of the layers
    below it (that part is what the end-to-end KL agreement measures). `tokens` should start with
    the model's BOS when it has one. `model` is the transformers model of the same GGUF (loaded here
    when None). `swa_full`: a full-size sliding-window cache, which is oscar2 (else f16).
    """
    gguf = Path(gguf)
    window = (0, len(tokens))
    settings = runtime_settings(gguf)
    if not settings.rotations:
        raise ValueError(f"{gguf} carries no OSCAR rotations: convert it with oscar-convert first")
    if model is None:
        from ..calibrate.models import load_hf, resolve_model
        model = load_hf(resolve_model(str(gguf)), "cpu")[0]
    stored = llama_rows(gguf, tokens, window, n_threads, swa_full)
    hf = hf_kv(model, tokens)
    report = RowReport(settings.arch, len(tokens))
    k_hf = settings.k_rotations_hf()
    for layer in sorted(hf):
        if ("k", layer) not in stored or layer not in settings.rotations:
            continue
        k, v = hf[layer]
        group = oscar2.group_size(k.shape[-1])
        for kind, x, r, clip in (("k", k, k_hf[layer], settings.clip_k[layer]),
                                 ("v", v, settings.rotations[layer][1], settings.clip_v[layer])):
            rows = stored[(kind, layer)]
            if rows.ggml_type == GGML_TYPE_F16:
                report.layers.append(_compare_f16(kind, layer, rows, x.reshape(len(tokens), -1)))
                continue
            ref = (x @ r).reshape(len(tokens), -1).astype(np.float32)
            report.layers.append(_compare(kind, layer, rows, ref, float(clip), group))
    return report

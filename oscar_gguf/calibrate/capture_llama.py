"""llama.cpp backend: capture what llama.cpp writes into its KV cache, from any GGUF.

How. llama.cpp's graph-eval callback (``cb_eval`` in llama_context_params) is asked, node by
node, whether we want to see a tensor, and called again once it is computed. We ask for:

- the SET_ROWS nodes whose destination (the node is a view of it) is ``cache_k_l{il}`` /
  ``cache_v_l{il}``: their src[0] is exactly the K (post-RoPE) or V that goes into the
  cache (src[1] holds the row indices);
- the FLASH_ATTN_EXT nodes: src[0] is the query as attention uses it (post-RoPE, post
  QK-norm, with any pre-scaling of the model), src[1] is a view of the layer's K cache
  (which names the layer), op_params[0] the softmax scale and src[3] the mask.

The context uses an f16 KV cache, so no rotation is inserted before the cache, flash
attention (so V is stored untransposed) and one ubatch per chunk (so every attention call
sees the whole sequence), with a full-size SWA cache. The tensors are read with
ggml_backend_tensor_get, which works for CPU and GPU buffers alike.

Heads are in llama.cpp's head-dim order (rope_layout "llama.cpp").
"""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np
import torch

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64
_CACHE_NAME = re.compile(r"^cache_([kv])_l(\d+)")
_NP_TYPES = {0: np.float32, 1: np.float16}   # GGML_TYPE_F32, GGML_TYPE_F16


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of the pinned ggml.h (vendor/llama.cpp/ggml/include/ggml.h)."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class LlamaBackendError(RuntimeError):
    """llama.cpp is missing or failed; the message says what to do."""


def _llama():
    try:
        import llama_cpp
    except Exception as e:  # FileNotFoundError when the package exists but its library does not
        raise LlamaBackendError(f"the llama.cpp backend needs the patched llama_cpp package ({e}); "
                                f"install oscar-gguf with its build, or use --backend hf") from None
    return llama_cpp


def _ggml_api(llama_cpp):
    """ggml functions, resolved through the libllama handle (libggml-base is its dependency)."""
    lib = llama_cpp.llama_cpp._lib
    api = {}
    for name, res, args in [
        ("ggml_op_name", ctypes.c_char_p, [ctypes.c_int]),
        ("ggml_get_name", ctypes.c_void_p, [ctypes.c_void_p]),
        ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
        ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    ]:
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
        api[name] = f
    return api


class LlamaCppCapture:
    """A GGUF loaded in llama.cpp, run chunk by chunk, reporting Q/K/V per layer."""

    def __init__(self, gguf: str | os.PathLike, seq_len: int, device: str = "cpu", n_threads: int | None = None,
                 verbose: bool = False):
        self.llama_cpp = lc = _llama()
        self.path = Path(gguf)
        self.seq_len = int(seq_len)
        self._log_tail: list[str] = []
        self._keep = []   # ctypes callbacks must outlive the context
        self._own_log = not verbose
        if not verbose:
            def _log(level, text, user):
                self._log_tail = (self._log_tail + [text.decode(errors="replace")])[-20:]
            cb = lc.llama_log_callback(_log)
            self._keep.append(cb)
            lc.llama_log_set(cb, None)
        lc.llama_backend_init()
        self.api = _ggml_api(lc)
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = -1 if device == "cuda" else 0
        self.model = lc.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            tail = "".join(self._log_tail[-3:]).strip().replace("\n", " | ")
            raise LlamaBackendError(f"llama.cpp could not load {self.path} ({tail or 'no log'}); "
                                    f"is it a GGUF model this llama.cpp supports?")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_layers = int(lc.llama_model_n_layer(self.model))
        self.handler = None
        self._pending: dict[int, dict[str, np.ndarray]] = {}
        self._error: BaseException | None = None
        cp = lc.llama_context_default_params()
        cp.n_ctx = self.seq_len
        cp.n_batch = self.seq_len
        cp.n_ubatch = self.seq_len
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads or max(1, os.cpu_count() or 1)
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k = cp.type_v = 1            # GGML_TYPE_F16: nothing rotated before the cache
        cp.swa_full = True                   # SWA layers keep every cell: cell index = position
        cp.no_perf = True
        cb_eval = lc.ggml_backend_sched_eval_callback(self._callback)
        self._keep.append(cb_eval)
        cp.cb_eval = cb_eval
        cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            tail = "".join(self._log_tail[-3:]).strip().replace("\n", " | ")
            raise LlamaBackendError(f"llama.cpp could not create a context for {self.path} ({tail})")
        self._checked_layout = False

    # -- tokenizer -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        lc = self.llama_cpp
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, False, False)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, False, False)
        return list(buf[:n])

    def bos_prefix(self) -> list[int]:
        lc = self.llama_cpp
        return [int(lc.llama_vocab_bos(self.vocab))] if lc.llama_vocab_get_add_bos(self.vocab) else []

    def meta(self, key: str) -> str | None:
        lc = self.llama_cpp
        buf = ctypes.create_string_buffer(512)
        n = lc.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    # -- tensors ---------------------------------------------------------------------------
    def _tensor(self, ptr) -> GgmlTensor:
        return GgmlTensor.from_address(ptr)

    def _read(self, ptr) -> np.ndarray:
        """A (possibly strided view) f32/f16 tensor as numpy [ne3, ne2, ne1, ne0]."""
        t = self._tensor(ptr)
        if t.type not in _NP_TYPES:
            raise LlamaBackendError(f"unexpected ggml type {t.type} for {t.name.decode()}")
        nbytes = int(self.api["ggml_nbytes"](ptr))
        raw = np.empty(nbytes, dtype=np.uint8)
        self.api["ggml_backend_tensor_get"](ptr, raw.ctypes.data, 0, nbytes)
        ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)][::-1]
        nb = [int(t.nb[i]) for i in range(GGML_MAX_DIMS)][::-1]
        out = np.ndarray(shape=ne, dtype=_NP_TYPES[t.type], buffer=raw, offset=0, strides=nb)
        return np.array(out, dtype=np.float32)

    def _cache_of(self, ptr) -> tuple[str, int] | None:
        """('k'|'v', layer) when ptr is (a view of) a KV cache tensor."""
        if not ptr:
            return None
        t = self._tensor(ptr)
        m = _CACHE_NAME.match(t.name.decode(errors="replace"))
        if m is None and t.view_src:
            m = _CACHE_NAME.match(self._tensor(t.view_src).name.decode(errors="replace"))
        return (m.group(1), int(m.group(2))) if m else None

    def _check_struct(self, ptr) -> None:
        """The ctypes struct must match the library's: ggml_get_name points at our name field."""
        if not self._checked_layout:
            if self.api["ggml_get_name"](ptr) != ptr + GgmlTensor.name.offset:
                raise LlamaBackendError("struct ggml_tensor of this libggml differs from the pinned ggml.h")
            self._checked_layout = True

    def _callback(self, ptr, ask, user) -> bool:
        try:
            self._check_struct(ptr)
            t = self._tensor(ptr)
            op = self.api["ggml_op_name"](t.op).decode()
            if op == "SET_ROWS":
                which = self._cache_of(ptr)
                if which is None:
                    return False
                if not ask:
                    kind, layer = which
                    arr = self._read(t.src[0])                 # [1, 1, T, n_embd_gqa]
                    self._pending.setdefault(layer, {})[kind] = arr.reshape(arr.shape[-2], arr.shape[-1])
                return True
            if op == "FLASH_ATTN_EXT":
                if not ask:
                    self._on_attention(t)
                return True
            return False
        except BaseException as e:  # an exception must not cross the C boundary
            self._error = self._error or e
            return False

    def _on_attention(self, t: GgmlTensor) -> None:
        which = self._cache_of(t.src[1])
        if which is None:
            return
        layer = which[1]
        kv = self._pending.pop(layer, {})
        if "k" not in kv or "v" not in kv:
            raise LlamaBackendError(f"layer {layer}: attention ran before its K/V were written")
        q = self._read(t.src[0])[0]                             # [H_q, T, d]
        h_q, n_tok, d = q.shape
        k = kv["k"].reshape(n_tok, -1, d)
        v = kv["v"].reshape(n_tok, -1, kv["v"].shape[-1] // k.shape[1])
        scale = float(np.frombuffer(bytes(t.op_params)[:4], dtype=np.float32)[0])
        allowed = None
        if t.src[3]:
            mask = self._read(t.src[3])[0, 0]                   # [T_pad, n_kv], 0 or -inf
            allowed = torch.from_numpy(np.isfinite(mask[:n_tok, :n_tok]))
        if self.handler is not None:
            self.handler(layer, torch.from_numpy(np.ascontiguousarray(q.transpose(1, 0, 2))),
                         torch.from_numpy(k), torch.from_numpy(v), scale, allowed)

    # -- running ---------------------------------------------------------------------------
    def run(self, tokens: np.ndarray, handler) -> None:
        """Decode one chunk in a fresh cache; handler(layer, q, k, v, scale, allowed) per layer."""
        lc = self.llama_cpp
        toks = np.asarray(tokens, dtype=np.int32)
        if len(toks) > self.seq_len:
            raise ValueError(f"chunk of {len(toks)} tokens exceeds the context of {self.seq_len}")
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        arr = (lc.llama_token * len(toks))(*toks.tolist())
        self.handler, self._error, self._pending = handler, None, {}
        try:
            rc = lc.llama_decode(self.ctx, lc.llama_batch_get_one(arr, len(toks)))
        finally:
            self.handler = None
        if self._error is not None:
            raise self._error
        if rc != 0:
            raise LlamaBackendError(f"llama_decode failed with {rc}")

    def close(self) -> None:
        lc = self.llama_cpp
        # free first, while our quiet callback still swallows the destructors' log lines
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None
        if getattr(self, "_own_log", False):
            self._own_log = False
            # our log callback dies with this object, but libllama keeps calling whatever was set
            # last: hand logging back to llama-cpp-python's own callback, so that a Llama(...)
            # made later in this process does not call freed memory
            try:
                from llama_cpp import _logger
                lc.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

"""A small, explicit wrapper over llama-cpp-python's low-level API (several sequences, cache
operations, state), used by tests and tools that need more than `Llama(...)` offers."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from .runtime import kv_type


class LlamaError(RuntimeError):
    pass


_backend_ready = False


def _llama():
    global _backend_ready
    import llama_cpp
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


class _Handle:
    """A llama.cpp object, freed by close() or at the end of a with block."""
    ptr = None

    @staticmethod
    def _free(ptr):
        raise NotImplementedError

    def close(self):
        if self.ptr:
            self._free(self.ptr)
            self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Model(_Handle):
    def __init__(self, path: str | Path, n_gpu_layers: int = 0):
        lc = _llama()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        self.path = str(path)
        self.ptr = lc.llama_model_load_from_file(self.path.encode(), mp)
        if not self.ptr:
            raise LlamaError(f"cannot load {path}")
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        lc = _llama()
        raw = text.encode()
        buf = (lc.llama_token * (len(raw) + 16))()
        n = lc.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), add_bos, False)
        if n < 0:
            raise LlamaError("tokenization failed")
        return list(buf[:n])

    @staticmethod
    def _free(ptr):
        _llama().llama_model_free(ptr)


class _Tensor(ctypes.Structure):
    """The leading fields of struct ggml_tensor in the pinned ggml.h (enough to read a tensor)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


class _Capture:
    """Copies the named graph tensors (f32/f16) out through the eval callback."""

    def __init__(self, names: set[str]):
        from .paths import library_dir
        self.names = names
        self.got: dict[str, list[np.ndarray]] = {}
        base = ctypes.CDLL(str(library_dir() / "libggml-base.so"))
        self._nbytes = base.ggml_nbytes
        self._nbytes.restype, self._nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
        self._get = base.ggml_backend_tensor_get
        self._get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.cb = _llama().ggml_backend_sched_eval_callback(self._callback)

    def _callback(self, ptr, ask, user):
        try:
            t = _Tensor.from_address(ptr)
            name = t.name.decode(errors="replace")
            if name not in self.names or t.type not in (0, 1):
                return False
            if not ask:
                n = self._nbytes(ptr)
                raw = np.empty(n, np.uint8)
                self._get(ptr, raw.ctypes.data, 0, n)
                ne = [int(t.ne[i]) for i in range(4)][::-1]
                nb = [int(t.nb[i]) for i in range(4)][::-1]
                a = np.ndarray(ne, np.float32 if t.type == 0 else np.float16, raw, strides=nb)
                self.got.setdefault(name, []).append(np.array(a, np.float32))
            return True
        except BaseException:  # never let an exception cross the C boundary
            return False


class Context(_Handle):
    """One llama_context; every keyword not named here is set on llama_context_params.

    capture: graph tensor names (e.g. "kqv_out-0") to copy out at every decode (self.captured).
    """

    def __init__(self, model: Model, n_ctx: int = 512, n_seq_max: int = 1, type_k: str | int = "f16",
                 type_v: str | int = "f16", flash_attn: bool = True, n_threads: int | None = None,
                 n_batch: int = 512, n_ubatch: int = 512, kv_unified: bool = True,
                 capture: list[str] | None = None, **params):
        lc = _llama()
        cp = lc.llama_context_default_params()
        self._capture = _Capture(set(capture)) if capture else None
        if self._capture:
            cp.cb_eval = self._capture.cb
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_ubatch
        cp.n_seq_max = n_seq_max
        cp.type_k = kv_type(type_k)
        cp.type_v = kv_type(type_v)
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.n_threads = cp.n_threads_batch = n_threads or max(1, min(4, os.cpu_count() or 1))
        cp.kv_unified = kv_unified
        for k, v in params.items():
            setattr(cp, k, v)
        self.model = model
        self.ptr = lc.llama_init_from_model(model.ptr, cp)
        if not self.ptr:
            raise LlamaError("llama_init_from_model failed (see the log above)")
        self.mem = lc.llama_get_memory(self.ptr)

    @property
    def captured(self) -> dict[str, list[np.ndarray]]:
        return self._capture.got if self._capture else {}

    def decode(self, tokens: list[int], pos0: int = 0, seq: int = 0, logits: str = "last") -> np.ndarray:
        """Decode tokens of one sequence at positions pos0.. and return logits (last row or all)."""
        return self.decode_multi([(seq, tokens, pos0)], logits=logits)[seq]

    def decode_multi(self, parts: list[tuple[int, list[int], int]], logits: str = "last") -> dict[int, np.ndarray]:
        """One batch with several sequences: parts = [(seq, tokens, pos0)]."""
        lc = _llama()
        n = sum(len(t) for _, t, _ in parts)
        b = lc.llama_batch_init(n, 0, 1)
        try:
            rows = {}
            i = 0
            for seq, toks, pos0 in parts:
                for j, t in enumerate(toks):
                    b.token[i] = t
                    b.pos[i] = pos0 + j
                    b.n_seq_id[i] = 1
                    b.seq_id[i][0] = seq
                    want = logits == "all" or j == len(toks) - 1
                    b.logits[i] = 1 if want else 0
                    if want:
                        rows.setdefault(seq, []).append(i)
                    i += 1
            b.n_tokens = n
            rc = lc.llama_decode(self.ptr, b)
            if rc != 0:
                raise LlamaError(f"llama_decode returned {rc}")
            out = {}
            for seq, idx in rows.items():
                out[seq] = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ptr, k),
                                                           shape=(self.model.n_vocab,)).copy() for k in idx])
                if logits == "last":
                    out[seq] = out[seq][-1]
            return out
        finally:
            lc.llama_batch_free(b)

    def greedy(self, prompt: list[int], n: int, seq: int = 0) -> list[int]:
        lg = self.decode(prompt, 0, seq)
        out, pos = [], len(prompt)
        for _ in range(n):
            t = int(np.argmax(lg))
            out.append(t)
            lg = self.decode([t], pos, seq)
            pos += 1
        return out

    # cache operations
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(_llama().llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1):
        _llama().llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_keep(self, seq: int):
        _llama().llama_memory_seq_keep(self.mem, seq)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int):
        _llama().llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int, d: int):
        _llama().llama_memory_seq_div(self.mem, seq, p0, p1, d)

    def seq_pos_max(self, seq: int) -> int:
        return int(_llama().llama_memory_seq_pos_max(self.mem, seq))

    # state
    def state_get(self) -> bytes:
        lc = _llama()
        n = lc.llama_state_get_size(self.ptr)
        buf = (ctypes.c_uint8 * n)()
        got = lc.llama_state_get_data(self.ptr, buf, n)
        return bytes(buf[:got])

    def state_set(self, data: bytes) -> int:
        lc = _llama()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(lc.llama_state_set_data(self.ptr, buf, len(data)))

    def seq_state_get(self, seq: int) -> bytes:
        """One sequence's state (llama_state_seq_get_data), as a server saves a slot."""
        lc = _llama()
        n = lc.llama_state_seq_get_size(self.ptr, seq)
        buf = (ctypes.c_uint8 * n)()
        got = lc.llama_state_seq_get_data(self.ptr, buf, n, seq)
        return bytes(buf[:got])

    def seq_state_set(self, data: bytes, seq: int) -> int:
        """Restore a sequence's state into sequence seq; the bytes read, 0 when refused."""
        lc = _llama()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(lc.llama_state_seq_set_data(self.ptr, buf, len(data), seq))

    @staticmethod
    def _free(ptr):
        _llama().llama_free(ptr)

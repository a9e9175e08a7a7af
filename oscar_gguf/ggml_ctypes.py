"""ctypes access to the patched ggml: the oscar2 C reference and ggml's type traits.

Used by the bit-exactness tests (numpy reference vs C) and the CPU micro-benchmark.
"""
from __future__ import annotations

import ctypes
import numpy as np

from .paths import library_dir

_c_int64 = ctypes.c_int64
_vp = ctypes.c_void_p

# ggml_to_float_t / ggml_from_float_t / ggml_vec_dot_t
TO_FLOAT = ctypes.CFUNCTYPE(None, _vp, _vp, _c_int64)
FROM_FLOAT = ctypes.CFUNCTYPE(None, _vp, _vp, _c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, _vp, ctypes.c_size_t, _vp, ctypes.c_size_t, _vp,
                           ctypes.c_size_t, ctypes.c_int)


class _TypeTraits(ctypes.Structure):  # struct ggml_type_traits (ggml.h)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", _c_int64),
                ("blck_size_interleave", _c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", TO_FLOAT),
                ("from_float_ref", FROM_FLOAT)]


class _TypeTraitsCPU(ctypes.Structure):  # struct ggml_type_traits_cpu (ggml-cpu.h)
    _fields_ = [("from_float", FROM_FLOAT), ("vec_dot", VEC_DOT), ("vec_dot_type", ctypes.c_int),
                ("nrows", _c_int64)]


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class GGML:
    """The installed libggml-base / libggml-cpu."""

    def __init__(self):
        d = library_dir()
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(str(d / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=mode)
        b = self.base
        b.oscar2_quantize_row_g.argtypes = [_vp, _vp, _c_int64, ctypes.c_int, ctypes.c_float]
        b.oscar2_dequantize_row_g.argtypes = [_vp, _vp, _c_int64, ctypes.c_int]
        b.ggml_get_type_traits.argtypes = [ctypes.c_int]
        b.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        b.ggml_quantize_chunk.argtypes = [ctypes.c_int, _vp, _vp, _c_int64, _c_int64, _c_int64, _vp]
        b.ggml_quantize_chunk.restype = ctypes.c_size_t
        b.ggml_row_size.argtypes = [ctypes.c_int, _c_int64]
        b.ggml_row_size.restype = ctypes.c_size_t
        c = self.cpu
        c.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        c.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCPU)
        # the row loops of the CPU flash attention (ggml-oscar/oscar2-rows.h): reference and fast path
        c.oscar2_rows_dot_scalar.argtypes = [_vp, _vp, _c_int64, ctypes.c_int]
        c.oscar2_rows_dot_scalar.restype = ctypes.c_float
        c.oscar2_rows_mad_scalar.argtypes = [_vp, ctypes.c_float, _vp, _c_int64, ctypes.c_int]
        c.oscar2_cpu_v_mad.argtypes = [_vp, ctypes.c_int, _vp, ctypes.c_float, _c_int64]
        c.oscar2_cpu_window_kq.argtypes = [_vp, ctypes.c_int, _vp, _c_int64]
        c.oscar2_cpu_window_kq.restype = ctypes.c_float
        c.oscar2_cpu_window_v.argtypes = [_vp, ctypes.c_int, _vp, _c_int64]
        c.ggml_cpu_init.argtypes = []
        c.ggml_cpu_init()

    def type_name(self, t: int) -> str:
        return self.base.ggml_get_type_traits(t).contents.type_name.decode()

    def row_size(self, t: int, n: int) -> int:
        return self.base.ggml_row_size(t, n)

    # --- the oscar2 C reference ---------------------------------------------------------
    def oscar2_quantize(self, x: np.ndarray, group: int, clip: float) -> bytes:
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        out = ctypes.create_string_buffer(x.size // group * (4 + group // 4))
        self.base.oscar2_quantize_row_g(_ptr(x), out, x.size, group, clip)
        return out.raw

    def oscar2_dequantize(self, data: bytes, group: int) -> np.ndarray:
        n = len(data) // (4 + group // 4) * group
        y = np.empty(n, dtype=np.float32)
        self.base.oscar2_dequantize_row_g(data, _ptr(y), n, group)
        return y

    def oscar2_vec_dot_ref(self, data: bytes, y: np.ndarray, group: int) -> float:
        """The scalar reference of K.q (the vector path is the type's vec_dot)."""
        y = np.ascontiguousarray(y, dtype=np.float32)
        return self.cpu.oscar2_rows_dot_scalar(data, _ptr(y), y.size, group)

    def oscar2_v_mad(self, t: int, data: bytes, w: float, acc: np.ndarray, reference: bool = False) -> np.ndarray:
        """acc + w * (the oscar2 row of type t), fused per element: the flash attention's P.V step."""
        out = np.array(acc, dtype=np.float32, copy=True)
        if reference:
            group = 128 if self.type_name(t) == "oscar2" else 64
            self.cpu.oscar2_rows_mad_scalar(data, w, _ptr(out), out.size, group)
        else:
            self.cpu.oscar2_cpu_v_mad(data, t, _ptr(out), w, out.size)
        return out

    # --- the CPU flash attention's window rows (F16C where built with it) ------------------
    def window_kq(self, t: int, k_row: np.ndarray, q: np.ndarray) -> float:
        """A window K row of type t (f16: float16 values) dotted with the f32 query."""
        k_row = np.ascontiguousarray(k_row)
        q = np.ascontiguousarray(q, dtype=np.float32)
        return self.cpu.oscar2_cpu_window_kq(_ptr(k_row), t, _ptr(q), q.size)

    def window_v(self, t: int, v_row: np.ndarray, n: int) -> np.ndarray:
        """A window V row of type t as f32."""
        v_row = np.ascontiguousarray(v_row)
        out = np.empty(n, dtype=np.float32)
        self.cpu.oscar2_cpu_window_v(_ptr(v_row), t, _ptr(out), n)
        return out

    # --- ggml's generic entry points ----------------------------------------------------
    def quantize_chunk(self, t: int, x: np.ndarray) -> bytes:
        x = np.ascontiguousarray(x, dtype=np.float32)
        nrows, n = (1, x.size) if x.ndim == 1 else x.shape
        out = ctypes.create_string_buffer(self.row_size(t, n) * nrows)
        self.base.ggml_quantize_chunk(t, _ptr(x), out, 0, nrows, n, None)
        return out.raw

    def to_float(self, t: int, data: bytes, n: int) -> np.ndarray:
        y = np.empty(n, dtype=np.float32)
        self.base.ggml_get_type_traits(t).contents.to_float(data, _ptr(y), n)
        return y

    def cpu_traits(self, t: int) -> _TypeTraitsCPU:
        return self.cpu.ggml_get_type_traits_cpu(t).contents

    def cpu_from_float(self, t: int, x: np.ndarray) -> bytes:
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        out = ctypes.create_string_buffer(self.row_size(t, x.size))
        self.cpu_traits(t).from_float(_ptr(x), ctypes.cast(out, _vp), x.size)
        return out.raw

    def vec_dot(self, t: int, data: bytes, y_data, n: int) -> float:
        """ggml's CPU vec_dot of a row of type t with y already in the type's vec_dot_type."""
        s = ctypes.c_float()
        yp = _ptr(y_data) if isinstance(y_data, np.ndarray) else ctypes.cast(y_data, _vp)
        self.cpu_traits(t).vec_dot(n, ctypes.addressof(s), 0, ctypes.cast(data, _vp), 0, yp, 0, 1)
        return s.value

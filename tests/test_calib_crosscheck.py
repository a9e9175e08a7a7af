"""The two capture backends agree on the bundled model (after the layout mapping).

Both run the same 256 tokens of the bundled SmolLM2 Q4_1 GGUF: transformers dequantizes the
weights to fp32, llama.cpp multiplies Q4_1 weights with q8-quantized activations, so the
activations differ by a few percent (measured: Q/K 0.3-2 %, V 1-4 % relative Frobenius per
layer) and the statistics built from them by less. Tolerances and what was measured (worst
layer of 30, relative Frobenius unless said otherwise):

    Σ_K after mapping        < 5 %     measured 1.2 %
    Σ_V                      < 8 %     measured 2.6 %
    eigenvalues (K and V)    < 5 %     measured 0.9 %
    top-8 eigenvectors |cos| > 0.95    measured >= 0.98
    Σ_K without the mapping  > 50 %    measured >= 120 %   (so skipping the mapping fails)
    score error of the mapped HF rotation vs llama.cpp's own, summed over layers:
                             < 3 %     measured 0.9 %

The rotation itself is compared through its eigenvectors and through how well it quantizes
llama.cpp's keys: R = U·H·P mixes every eigenvector, and the small, nearly equal eigenvalues
have eigenvectors that a 1 % perturbation turns freely, so R entry by entry is not stable
(per-layer score errors then differ by up to ±12 % either way while the sum agrees to 1 %).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar_gguf.calibrate import layout
from oscar_gguf.calibrate.calibrator import CalibrationState
from oscar_gguf.calibrate.fakequant import fake_quantize


pytestmark = pytest.mark.usefixtures("one_torch_thread")

T = 256
TOL_SIGMA_K, TOL_SIGMA_V, TOL_EIG, TOL_COS, TOL_ERR = 0.05, 0.08, 0.05, 0.95, 0.03
llama_cpp = pytest.importorskip("llama_cpp", exc_type=ImportError)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def captures(bundled_model):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from oscar_gguf.calibrate.capture_hf import attention_tap, decoder
    from oscar_gguf.calibrate.capture_llama import LlamaCppCapture
    from oscar_gguf.calibrate.corpus import DEFAULT_CORPUS_DIR

    text = (DEFAULT_CORPUS_DIR / "debian_handbook.txt").read_text()[:6000]
    keys_l = {}

    def feed_llama(i, q, k, v, s, a):
        st_l.observe(i, q, k, v)
        keys_l[i] = k

    with LlamaCppCapture(bundled_model, T, n_threads=1) as cap:
        toks = np.asarray(cap.encode(text)[:T])
        st_l = CalibrationState(clip="fixed", rotation="oscar")
        for _ in range(2):
            cap.run(toks, feed_llama)
            st_l.end_pass()
    hf_logging.set_verbosity_error()
    # transformers parses the GGUF twice and rebuilds gguf's tensor-name map for every tensor
    # (20 s of the load here); caching both changes nothing but the time
    import functools

    import gguf
    originals = gguf.get_tensor_name_map, gguf.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        if (str(path), mode) not in readers:
            readers[str(path), mode] = originals[1](path, mode)
        return readers[str(path), mode]

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(originals[0])
    gguf.GGUFReader = reader
    try:
        model = AutoModelForCausalLM.from_pretrained(str(bundled_model.parent), gguf_file=bundled_model.name,
                                                     dtype=torch.float32).eval()
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = originals
    st_h = CalibrationState(clip="fixed", rotation="oscar")

    def feed(call):
        st_h.observe(call.layer, *(x[0].transpose(0, 1) for x in (call.query, call.key, call.value)))

    with torch.no_grad(), attention_tap(model, feed):
        for _ in range(2):
            decoder(model)(torch.as_tensor(toks)[None], use_cache=False)
            st_h.end_pass()
    return st_h, st_l, keys_l


def test_statistics_agree_after_layout_mapping(captures):
    st_h, st_l, _ = captures
    cov_h, cov_l = st_h.covariances(), st_l.covariances()
    assert sorted(cov_h) == sorted(cov_l) == list(range(30))
    worst = {"k": 0.0, "v": 0.0, "k_unmapped": 1e9}
    for i in cov_h:
        sk_h, sv_h = cov_h[i]
        sk_l, sv_l = cov_l[i]
        worst["k"] = max(worst["k"], _rel(layout.covariance_hf_to_llama(sk_h), sk_l))
        worst["v"] = max(worst["v"], _rel(sv_h, sv_l))                       # V is never permuted
        worst["k_unmapped"] = min(worst["k_unmapped"], _rel(sk_h, sk_l))
    print(f"worst Σ_K {worst['k']:.4f}, Σ_V {worst['v']:.4f}; best unmapped Σ_K {worst['k_unmapped']:.3f}")
    assert worst["k"] < TOL_SIGMA_K
    assert worst["v"] < TOL_SIGMA_V
    assert worst["k_unmapped"] > 0.5            # skipping the mapping is caught


def test_rotations_agree_after_layout_mapping(captures):
    from oscar_gguf.calibrate.oscar_rotation import canonical_eigh

    st_h, st_l, keys_l = captures
    assert st_h.pass_name is None and st_l.pass_name is None      # both fitted after two passes
    worst_eig, worst_cos, err_h, err_l = 0.0, 1.0, 0.0, 0.0
    for i in st_h.rotations:
        rk_h, lk_h, rv_h, lv_h = st_h.rotations[i]
        rk_l, lk_l, rv_l, lv_l = st_l.rotations[i]
        worst_eig = max(worst_eig, _rel(lk_h, lk_l), _rel(lv_h, lv_l))
        for sig_h, sig_l in ((layout.covariance_hf_to_llama(st_h.layers[i].k_covariance()),
                              st_l.layers[i].k_covariance()),
                             (st_h.layers[i].v_covariance(), st_l.layers[i].v_covariance())):
            _, u_h = canonical_eigh(sig_h)
            _, u_l = canonical_eigh(sig_l)
            worst_cos = min(worst_cos, float(np.abs(np.sum(u_h * u_l, axis=0))[-8:].min()))
        # the HF rotation, mapped, must quantize llama.cpp's keys as well as llama.cpp's own
        c = st_l.layers[i].query_covariances().mean(0).numpy()
        k = keys_l[i].reshape(-1, keys_l[i].shape[-1]).numpy()

        def score_err(r):
            kr = torch.from_numpy((k @ r).astype(np.float32))
            e = (fake_quantize(kr, 64, 0.96) - kr).double().numpy() @ r.T
            return float(np.einsum("td,de,te->", e, c, e))

        err_h += score_err(layout.rotation_hf_to_llama(rk_h))
        err_l += score_err(rk_l)
    print(f"worst eigenvalue difference {worst_eig:.4f}, worst top-8 |cos| {worst_cos:.4f}, "
          f"summed score error ratio {err_h / err_l:.4f}")
    assert worst_eig < TOL_EIG
    assert worst_cos > TOL_COS
    assert abs(err_h / err_l - 1) < TOL_ERR

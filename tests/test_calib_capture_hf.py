"""transformers capture on tiny random models of every supported architecture: the tap sees
post-RoPE (post-QK-norm) Q/K and V, the calibration runs end to end, and the simulated
attention reproduces the model when nothing is quantized."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar_gguf.calibrate.artifact import load_artifact, save_artifact
from oscar_gguf.calibrate.calibrator import Calibrator
from oscar_gguf.calibrate.capture_hf import attention_tap, mask_to_bool
from oscar_gguf.calibrate.simulate import KVConfig, run_simulation, simulated_attention, standard_configs


pytestmark = pytest.mark.usefixtures("one_torch_thread")

T = 40


def tiny(arch: str):
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common), tf.Qwen3ForCausalLM
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1,
                                     "head_dim": 256, "num_hidden_layers": 3},
                                  sliding_window=16, layer_types=["sliding_attention", "full_attention",
                                                                  "sliding_attention"])
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    return model


def rope_theta(cfg, layer: int) -> float:
    rp = cfg.rope_parameters
    if "rope_theta" not in rp:                      # gemma3: one entry per layer type
        rp = rp[cfg.layer_types[layer]]
    return float(rp["rope_theta"])


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """rotate_half RoPE of x [B, T, H, d] at positions 0..T-1, written out in float64."""
    d = x.shape[-1]
    pos = torch.arange(x.shape[1], dtype=torch.float64)[:, None]
    ang = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([ang, ang], dim=-1)[None, :, None, :]
    x = x.double()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * ang.cos() + rot * ang.sin()


def as_bthd(x: torch.Tensor, d: int) -> torch.Tensor:
    """Hooked projections are [B, T, H*d] or [B, T, H, d]; gemma3 norms after the transpose, [B, H, T, d]."""
    if x.dim() == 4 and x.shape[1] != T:
        x = x.transpose(1, 2)
    return x.reshape(x.shape[0], T, -1, d)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_is_post_rope_and_post_norm(arch):
    model = tiny(arch)
    cfg = model.config
    ids = torch.randint(0, 128, (2, T))
    pre: dict = {}
    hooks = []
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "q_proj"):
            i = m.layer_idx
            qsrc = getattr(m, "q_norm", None) or m.q_proj      # qwen3/gemma3: RoPE follows QK-norm
            ksrc = getattr(m, "k_norm", None) or m.k_proj
            hooks.append(qsrc.register_forward_hook(lambda mod, a, out, i=i: pre.__setitem__((i, "q"), out)))
            hooks.append(ksrc.register_forward_hook(lambda mod, a, out, i=i: pre.__setitem__((i, "k"), out)))
            hooks.append(m.v_proj.register_forward_hook(lambda mod, a, out, i=i: pre.__setitem__((i, "v"), out)))
    seen = {}

    def handler(call):
        seen[call.layer] = call
        return None

    with torch.no_grad():
        ref = model(ids).logits
        with attention_tap(model, handler):
            out = model(ids).logits
    for h in hooks:
        h.remove()
    assert torch.equal(ref, out)                               # the tap alone changes nothing
    assert cfg._attn_implementation != "oscar_tap"             # restored
    d = cfg.head_dim
    assert sorted(seen) == list(range(cfg.num_hidden_layers))
    for i, call in seen.items():
        assert call.query.shape == (2, cfg.num_attention_heads, T, d)
        assert call.key.shape == (2, cfg.num_key_value_heads, T, d)
        assert call.value.shape == (2, cfg.num_key_value_heads, T, d)
        th = rope_theta(cfg, i)
        q_pre, k_pre, v_pre = (as_bthd(pre[(i, s)], d) for s in "qkv")
        assert torch.allclose(call.query.transpose(1, 2).double(), rope(q_pre, th), atol=1e-5)
        assert torch.allclose(call.key.transpose(1, 2).double(), rope(k_pre, th), atol=1e-5)
        assert torch.equal(call.value.transpose(1, 2), v_pre)
        # and the captured K is not the pre-RoPE one
        assert not torch.allclose(call.key.transpose(1, 2), k_pre, atol=1e-3)
    if arch == "gemma3":
        # sliding layers see a banded mask, the full layer a causal one
        win = cfg.sliding_window
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        band = mask_to_bool(seen[0].mask, T, T, "cpu")[0, 0]
        full = mask_to_bool(seen[1].mask, T, T, "cpu")[0, 0]
        assert torch.equal(full, j <= i)
        assert torch.equal(band, (j <= i) & (i - j < win))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("clip", ["fixed", "search"])
def test_calibrator_end_to_end(arch, clip, tmp_path):
    model = tiny(arch)
    torch.manual_seed(1)
    chunks = torch.randint(0, 128, (3, T))
    cal = Calibrator(model, clip=clip, window=(4, 8), rotation="oscar")
    passes = []
    while cal.pass_name:
        passes.append(cal.pass_name)
        with cal:
            for c in (chunks[:1] if cal.pass_name == "clips" else chunks[1:]):
                model(c[None])
    assert passes == (["queries", "values", "clips"] if clip == "search" else ["queries", "values"])
    art = cal.result(corpus="random ids")
    expect_arch = {"mistral": "llama", "gemma3": "gemma3"}.get(arch, arch)
    assert art.architecture == expect_arch and art.rope_layout == "hf"
    assert art.layers == list(range(model.config.num_hidden_layers))
    assert art.tokens == 2 * T
    assert art.method == f"oscar-qqt-sst/clip-{clip}"
    if clip == "fixed":
        assert np.allclose(art.clip_k, 0.96) and np.allclose(art.clip_v, 0.92)
    else:
        assert np.all((art.clip_k > 0.6) & (art.clip_k <= 1)) and np.all(art.clip_v <= 1)
        # the precision plan's measure covers the layers the runtime stores in oscar2: not gemma3's
        # sliding-window ones (their masks hide causal pairs), whose cache stays f16
        measured = [int(e.split(":")[0]) for e in art.extra["k_output_error"].split()]
        assert measured == ([1] if arch == "gemma3" else [0, 1])
        assert set(art.f16_k_layers) <= set(measured)
    p = save_artifact(tmp_path / "rot.safetensors", art)
    assert load_artifact(p).head_dim == model.config.head_dim
    with pytest.raises(RuntimeError):
        with cal:
            pass


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_simulated_attention_exact_when_not_quantized(arch):
    model = tiny(arch)
    ids = torch.randint(0, 128, (1, T))
    n, d = model.config.num_hidden_layers, model.config.head_dim
    ones = np.ones(n, np.float32)
    group = 64 if d % 128 else 128
    off = KVConfig("off", None, None, ones, ones, group, quantize=False)
    everything_hp = KVConfig("window covers all", None, None, ones * 0.8, ones * 0.8, group, window=(T, T))
    quant = KVConfig("int2", None, None, ones, ones, group)
    with torch.no_grad():
        ref = model(ids).logits
        outs = {}
        for cfg in (off, everything_hp, quant):
            with attention_tap(model, lambda call, cfg=cfg: simulated_attention(call, cfg, None)):
                outs[cfg.name] = model(ids).logits
    assert torch.allclose(outs["off"], ref, atol=1e-4)
    assert torch.allclose(outs["window covers all"], ref, atol=1e-4)
    assert not torch.allclose(outs["int2"], ref, atol=1e-3)


@pytest.mark.parametrize("rotation", ["learned", "key-eigen-dc", "hadamard"])
def test_other_rotation_recipes(rotation):
    from oscar_gguf.calibrate.oscar_rotation import hadamard
    from oscar_gguf.format.rotations import orthogonality_error

    model = tiny("llama")
    torch.manual_seed(2)
    chunks = torch.randint(0, 128, (3, T))
    cal = Calibrator(model, clip="search", window=(4, 8), rotation=rotation, learn_steps=5)
    while cal.pass_name:
        with cal:
            for c in (chunks[:1] if cal.pass_name == "clips" else chunks[1:]):
                model(c[None])
    art = cal.result()
    assert art.extra["rotation"] == rotation and art.method.startswith(rotation.split("-")[0])
    for i in art.layers:
        assert orthogonality_error(art.k_rot[i]) <= 1e-5 and orthogonality_error(art.v_rot[i]) <= 1e-5
    if rotation == "hadamard":
        assert np.allclose(art.k_rot[0], hadamard(64))


def test_run_simulation_orders_configs():
    model = tiny("llama")
    chunks = np.random.default_rng(0).integers(0, 128, (2, T))
    cal = Calibrator(model, clip="fixed", rotation="oscar")
    while cal.pass_name:
        with cal:
            for c in chunks:
                model(torch.as_tensor(c)[None])
    art = cal.result()
    configs = standard_configs(art, window=(4, 8))
    assert len(configs) == 14
    res = run_simulation(model, chunks, configs)
    for c in configs:
        r = res[c.label]
        assert r.positions == 2 * (T - T // 2)
        assert r.mean_kl >= 0 and 0 <= r.same_top1 <= 1
        assert len(r.layer_errors()) == 2
    # the window only removes error
    nowin = {c.name: res[c.label].mean_kl for c in configs if c.window == (0, 0)}
    win = {c.name: res[c.label].mean_kl for c in configs if c.window != (0, 0)}
    assert all(win[k] <= nowin[k] + 1e-9 for k in nowin)

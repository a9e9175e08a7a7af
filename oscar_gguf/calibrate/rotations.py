"""Rotation recipes that fit the runtime: one orthogonal d×d matrix per layer for K and V.

- "oscar": docs/design.md §1 exactly, R = U·H_d·P_br on the qqt / sst covariances (oscar_rotation.py).
- "hadamard": the normalised Sylvester Hadamard matrix.
- "key-eigen-dc" (default): the eigenbasis of the keys' own second moment (and of the sst covariance for
  V), with the top eigen-directions placed on the rows of H that are constant on each
  quantization group (see dc_rotation).
- "learned": Hadamard refined per layer by gradient descent on the quantization
  error through the runtime's quantizer (learn_rotation).

Why the DC slots matter. oscar2 stores a minimum per group and token, so any component
that is constant across a group is stored exactly (it only shifts mn and mx). After
R = U·H, the coefficient of eigenvector i is spread over the group along row i of H; the
rows of the Sylvester H that are constant on every group of G contiguous columns are
0, G, 2G, ... (H = H_{d/G} ⊗ H_G). OSCAR's R = U·H·P_br with eigh's ascending order puts
the *smallest* eigen-direction into row 0, where it is free; putting the *largest* ones
there removes their energy from the quantization range. With one group per head (G = d),
P_br only reorders the columns of a group and changes nothing.

Measured in simulation on SmolLM2-135M (held-out Botchan, window 64/256, per-layer searched
clips): mean next-token KL 0.0468 oscar, 0.0355 hadamard, 0.0269 key-eigen-dc, 0.0195
learned. "learned" fits by gradient descent (200 Adam steps per matrix, about 0.07 s a step on
one CPU core: 10+ minutes for a 30-layer model), so the default is key-eigen-dc, whose fit is
an eigendecomposition; llama.cpp-measured numbers are in the README.
"""
from __future__ import annotations

import numpy as np
import torch

from ..format.oscar2 import clip_index
from .fakequant import GroupQuantizer
from .oscar_rotation import bit_reversal_permutation, canonical_eigh, hadamard, oscar_rotation

RECIPES = ("learned", "key-eigen-dc", "hadamard", "oscar")


def dc_rotation(sigma: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(R, eigenvalues): the top d/G eigen-directions go to the group-constant rows of H."""
    lam, u = canonical_eigh(sigma)
    d = len(lam)
    order = np.argsort(-lam, kind="stable")
    n_dc = d // group
    dc_slots = [j * group for j in range(n_dc)]
    rest = [i for i in range(d) if i not in dc_slots]
    coef = np.empty(d, dtype=np.int64)
    coef[dc_slots] = order[:n_dc]
    # the other directions in bit-reversed order of their eigenvalues, as OSCAR spreads them
    br = bit_reversal_permutation(lam)                 # br[j] = eigen index for position j
    coef[rest] = [i for i in br if i not in set(order[:n_dc].tolist())]
    return u[:, coef] @ hadamard(d), lam


def _ste_fake_quantize(y: torch.Tensor, group: int, clip: float) -> torch.Tensor:
    """oscar2's min/max quantizer with a straight-through round: gradients reach the group's
    range (min, max and the clip threshold), which is what a rotation can change."""
    v = y.reshape(-1, group)
    k = clip_index(clip, group)
    if k is not None:
        tau = torch.kthvalue(v.abs(), k + 1, dim=1, keepdim=True).values
        v = torch.maximum(torch.minimum(v, tau), -tau)
    mn = v.amin(1, keepdim=True)
    d = ((v.amax(1, keepdim=True) - mn) / 3).clamp_min(1e-12)
    t = (v - mn) / d
    q = (t + (torch.round(t) - t).detach()).clamp(0, 3)
    return (mn + q * d).reshape(y.shape)


def learn_rotation(x: torch.Tensor, weight: torch.Tensor | None, group: int, clip: float, init: np.ndarray,
                   steps: int = 200, lr: float = 2e-3, token_weight: torch.Tensor | None = None,
                   batch: int | None = None, seed: int = 0) -> np.ndarray:
    """An orthogonal R = init · exp(A − Aᵀ) minimising the quantization error of x [N, d]
    (weighted by `weight` [d, d] in the original frame, e.g. the query covariance for K, and by
    `token_weight` [N] per row), through the runtime's quantizer with a straight-through round.
    The result is still one orthogonal d×d matrix, so it fits the runtime as it is.

    batch: rows per step (a fixed-seed random subset), None for all rows. The returned R is the
    best iterate on all rows (the initial one included), checked every `check` steps.
    """
    dev = x.device
    r0 = torch.as_tensor(init, dtype=torch.float32, device=dev)
    d = r0.shape[0]
    a = torch.zeros(d, d, device=dev, requires_grad=True)
    opt = torch.optim.Adam([a], lr=lr)
    w = None if weight is None else torch.as_tensor(weight, dtype=torch.float32, device=dev)
    tw = None if token_weight is None else token_weight.to(dev).float()
    x = x.float()
    scale = x.pow(2).mean()
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def loss_of(r, rows=None):
        xs = x if rows is None else x[rows]
        y = xs @ r
        e = (_ste_fake_quantize(y, group, clip) - y) @ r.T          # error in the original frame
        per = (e @ w * e).sum(1) if w is not None else e.pow(2).sum(1)
        if tw is not None:
            per = per * (tw if rows is None else tw[rows])
        return per.mean() / scale

    full = batch is None or batch >= len(x)
    check = 1 if full else 25
    with torch.no_grad():
        best, best_loss = r0.clone(), float(loss_of(r0))
    for step in range(1, steps + 1):
        rows = None if full else torch.randint(len(x), (batch,), generator=gen).to(dev)
        r = r0 @ torch.linalg.matrix_exp(a - a.T)
        loss = loss_of(r, rows)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % check == 0 or step == steps:
            with torch.no_grad():
                cur = r0 @ torch.linalg.matrix_exp(a - a.T)
                val = float(loss_of(cur))
            if val < best_loss:
                best, best_loss = cur.detach().clone(), val
    q, _ = torch.linalg.qr(best.double())                           # re-orthogonalise in float64
    q = q * torch.sign(torch.diagonal(torch.linalg.solve(q, best.double())))[None, :]
    return q.cpu().numpy()


def target_clip(x: torch.Tensor, r: np.ndarray, group: int, grid: list[float], weight: torch.Tensor | None = None,
                token_weight: torch.Tensor | None = None) -> float:
    """The clip of `grid` with the least (weighted) quantization error of x·R: the operating
    point a rotation is learned at (the final clips are searched afterwards on held-out text)."""
    rt = torch.as_tensor(r, dtype=torch.float32, device=x.device)
    y = x.float() @ rt
    gq = GroupQuantizer(y, group)
    best, best_err = grid[0], float("inf")
    for c in grid:
        e = (gq(c) - y) @ rt.T
        per = (e @ weight.to(e.device).float() * e).sum(1) if weight is not None else e.pow(2).sum(1)
        err = float((per * token_weight.to(e.device)).sum() if token_weight is not None else per.sum())
        if err < best_err:
            best, best_err = c, err
    return best


class SampleStore:
    """A bounded sample of each layer's keys and values for the "learned" recipe.

    Keeps the first `max_tokens` tokens per layer at positions >= `skip` (the f16 sink never
    reaches the quantizer, and its huge first-token keys would dominate the loss), together
    with each row's KV head for the per-head sst weights. Memory: max_tokens · H_kv · d · 8
    bytes per layer.
    """

    def __init__(self, max_tokens: int, skip: int):
        self.max_tokens = max_tokens
        self.skip = skip
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}
        self.count: dict[int, int] = {}

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, H_kv, d] of one sequence."""
        have = self.count.get(layer, 0)
        start = self.skip if k.shape[0] > self.skip else 0        # chunks shorter than the sink: keep all
        take = min(self.max_tokens - have, k.shape[0] - start)
        if take <= 0:
            return
        self.k.setdefault(layer, []).append(k[start:start + take].detach().float())
        self.v.setdefault(layer, []).append(v[start:start + take].detach().float())
        self.count[layer] = have + take

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, H_kv, d] keys, [N, H_kv, d] values)."""
        if layer not in self.k:
            raise ValueError(f"no key/value samples were collected for layer {layer}")
        return torch.cat(self.k[layer]), torch.cat(self.v[layer])


def sst_token_weights(k: torch.Tensor, c_h: torch.Tensor) -> torch.Tensor:
    """w[n, h] = k C_h kᵀ normalised to mean 1 per KV head (the sst weights, docs/design.md §1), k [N, H_kv, d]."""
    w = torch.einsum("nhd,hde,nhe->nh", k, c_h.to(k.device, k.dtype), k)
    return w / w.mean(0, keepdim=True).clamp_min(1e-30)


LEARN_BATCH = 2048      # rows per step: 10x cheaper than all ~12k rows on a CPU


def fit_layer(recipe: str, stats, group: int, samples: SampleStore | None, layer: int, grid: list[float],
              steps: int = 200, batch: int | None = LEARN_BATCH) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(R_k, λ_k, R_v, λ_v) of one layer for a recipe. λ are the eigenvalues of the qqt and sst
    covariances (ascending) whatever the recipe, as the statistics' record."""
    sigma_k, sigma_v = stats.k_covariance(), stats.v_covariance()
    rk_oscar, lam_k = oscar_rotation(sigma_k)
    rv_oscar, lam_v = oscar_rotation(sigma_v)
    d = sigma_k.shape[0]
    if recipe == "oscar":
        return rk_oscar, lam_k, rv_oscar, lam_v
    if recipe == "hadamard":
        return hadamard(d), lam_k, hadamard(d), lam_v
    if recipe == "key-eigen-dc":
        return dc_rotation(stats.key_covariance(), group)[0], lam_k, dc_rotation(sigma_v, group)[0], lam_v
    if recipe != "learned":
        raise ValueError(f"unknown rotation recipe {recipe!r}; one of {', '.join(RECIPES)}")
    # learned: start from Hadamard, at the clip that suits Hadamard on the sample, and descend
    k, v = samples.get(layer)
    c_h = stats.query_covariances()
    w = sst_token_weights(k.double(), c_h).float().reshape(-1)
    c_mean = torch.as_tensor(sigma_k, dtype=torch.float32)
    kf, vf = k.reshape(-1, d), v.reshape(-1, d)
    h = hadamard(d)
    ck = target_clip(kf, h, group, grid, weight=c_mean)
    cv = target_clip(vf, h, group, grid, token_weight=w)
    rk = learn_rotation(kf, c_mean, group, ck, h, steps=steps, batch=batch, seed=2 * layer)
    rv = learn_rotation(vf, None, group, cv, h, steps=steps, token_weight=w, batch=batch, seed=2 * layer + 1)
    return rk, lam_k, rv, lam_v

"""Exact fp32 references for primitives the oracle (oracle/dsv41/) does not expose as a standalone function.

Written from dsv41-architecture.md; each says where it should later be deduplicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """DeepSeek-V4's head collapse of the hc stream: ``mixes = (x_f . fn^T) * rsqrt(mean(x_f^2) + eps)``
    (one statistic per token over all copies, product first), ``pre = sigmoid(mixes * scale[0] + base) +
    hc_eps``, ``y = sum_j pre[j] * x[j]`` — the ``hc_mixes`` statistic of §9 with the ``pre`` rule of §6.4.

    V4.1 has no head-hc parameters (it collapses with the last FFN ``pre``, §7 step 6); this is the V4 engine
    kernel's math. Dedup: oracle/dsv41/hyper.py (hc_mixes' statistic + hc_pre) once it grows a head helper.
    x [..., hc, d] fp32, fn [hc, hc*d], scale [1], base [hc] -> [..., d]."""
    xf = x.flatten(-2)
    mixes = (xf @ fn.T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mixes * scale[0] + base) + hc_eps
    return torch.sum(pre.unsqueeze(-1) * x, dim=-2)


def swiglu_clamp(x: torch.Tensor, limit: float) -> torch.Tensor:
    """§13.2 clamped SwiGLU on the concatenated [gate | up] GEMM outputs, fp32:
    ``u = clamp(up, -limit, limit)``, ``g = clamp(gate, max=limit)``, ``silu(g) * u``.

    Dedup: oracle/dsv41/moe.py ``expert`` inlines the same three lines between its GEMMs."""
    g, u = x.float().chunk(2, dim=-1)
    return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)


def rmsnorm_noweight(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weight-free RMSNorm over the last dim (V4's per-head q norm), fp32. Dedup: Numerics.rmsnorm with a
    ones weight (oracle/dsv41/numerics.py) computes the same values."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)

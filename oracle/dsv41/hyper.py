"""Manifold-constrained hyper-connections (§9) and the Sinkhorn split (§6.4). All fp32 (§5.3).

fp32 mode evaluates every step in float64 and rounds it once (row-count and device independent);
reference-bf16 mode spells each step as the reference does, in fp32 torch ops."""

from __future__ import annotations

import torch

from .numerics import Numerics, aligned, in_f64, mm, rstd_f64, sum_f64


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float, num: Numerics | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2+hc)*hc] -> pre [..., hc], post [..., hc], comb [..., hc(j), hc(k)] (§6.4).
    fp32 mode: each step is evaluated in float64 and rounded to fp32, so a row's result does not depend on
    how many rows share the call (see numerics.in_f64). reference-bf16 mode: `_sinkhorn_reference_order`."""
    if num is not None and num.bf16:
        return _sinkhorn_reference_order(mixes, scale, base, hc, iters, eps)
    pre = in_f64(torch.sigmoid, mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * in_f64(torch.sigmoid, mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    c = in_f64(lambda t: torch.softmax(t, dim=-1), c) + eps  # softmax over k (the output copy)
    c = c / (sum_f64(c, -2, keepdim=True) + eps)  # column normalisation
    for _ in range(iters - 1):
        c = c / (sum_f64(c, -1, keepdim=True) + eps)
        c = c / (sum_f64(c, -2, keepdim=True) + eps)  # the last step is a column normalisation
    return pre, post, c


def _sinkhorn_reference_order(mixes, scale, base, hc: int, iters: int, eps: float):
    """The reference kernel's fp32 operations in its order: sigmoid gates, a max-subtracted exp normalised
    by its row sum (not torch.softmax), then the alternating column / row normalisations."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    c = torch.exp(c - c.amax(dim=-1, keepdim=True))
    c = c / c.sum(dim=-1, keepdim=True) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return pre, post, c


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
             hc_eps: float, norm_eps: float, num: Numerics | None = None):
    """One RMS statistic per token over all copies, no weight; product first, then scaled (§9)."""
    xf = x.flatten(-2)
    if num is not None and num.bf16:  # fp32 statistic and an fp32 F.linear over the flattened stream
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
        mixes = torch.nn.functional.linear(aligned(xf), aligned(fn)) * rstd
    else:
        rstd = rstd_f64(xf, norm_eps, keepdim=True)
        mixes = mm(xf, fn) * rstd
    return hc_split_sinkhorn(mixes, scale, base, hc, iters, hc_eps, num)


def hc_pre(x: torch.Tensor, pre: torch.Tensor, num: Numerics) -> torch.Tensor:
    """[b, s, hc, d] x [b, s, hc] -> [b, s, d]; bf16-rounded in reference mode (§5.3)."""
    return num.r(num.f32(lambda p, v: torch.sum(p.unsqueeze(-1) * v, dim=-2), pre, x))


def hc_post(f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, num: Numerics):
    """new[k] = post[k] * f + sum_j comb[j, k] * res[j] (§9); the stream is bf16 in reference mode."""
    mixed = num.f32(lambda c, r: torch.sum(c.unsqueeze(-1) * r.unsqueeze(-2), dim=-3), comb, res)
    return num.r(post.unsqueeze(-1) * f.unsqueeze(-2) + mixed)

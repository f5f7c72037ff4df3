"""Final norm and head (§14): fp32 logits for every position; greedy sampling only."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .hyper import hc_pre
from .numerics import Numerics, aligned, in_f64, mm, rstd_f64
from .weights import need


class Head:
    def __init__(self, cfg: ModelConfig, norm_name: str = "norm.weight"):
        self.cfg, self.norm_name = cfg, norm_name

    def load(self, w: dict) -> "Head":
        self.norm = need(w, self.norm_name)
        self.weight = need(w, "head.weight")
        return self

    def __call__(self, x: torch.Tensor, num: Numerics) -> torch.Tensor:
        # the head is never rounded: fp32 weight, fp32 logits (§5.3)
        return num.fp32_linear(num.rmsnorm(x, self.norm, self.cfg.norm_eps), self.weight)

    def logits(self, h: torch.Tensor, pre: torch.Tensor, num: Numerics) -> torch.Tensor:
        """The residual streams [b, s, hc, d] collapsed with the last FFN's pre (§7 step 6), then the head."""
        return self(hc_pre(h, pre, num), num)


class Embedding:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def load(self, w: dict) -> "Embedding":
        self.weight = need(w, "embed.weight")
        return self

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if int(ids.min()) < 0 or int(ids.max()) >= self.weight.shape[0]:
            raise ValueError(f"embed: token id outside 0..{self.weight.shape[0] - 1}")
        return self.weight[ids]


class HyperHead(Head):
    """DeepSeek-V4's head (dsv4-engine.md §5 "hyper-connections"): the residual streams collapse with their
    own `hc_head_fn/base/scale` (pre = sigmoid(mixes·scale + base) + hc_eps, no Sinkhorn), then the final
    norm and the fp32 vocabulary projection of `Head`. Called on the streams [b, s, hc, d]."""

    def load(self, w: dict) -> "HyperHead":
        super().load(w)
        self.hc_fn, self.hc_base, self.hc_scale = (need(w, f"hc_head_{k}") for k in ("fn", "base", "scale"))
        return self

    def collapse(self, h: torch.Tensor, num: Numerics) -> torch.Tensor:
        cfg = self.cfg
        xf = h.flatten(-2)
        if num.bf16:  # the reference's fp32 statistic, fp32 F.linear, fp32 sigmoid and sum, then bf16
            rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.norm_eps)
            mixes = torch.nn.functional.linear(aligned(xf), aligned(self.hc_fn)) * rstd
            pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + cfg.hc_eps
            return num.r(torch.sum(pre.unsqueeze(-1) * h, dim=-2))
        mixes = mm(xf, self.hc_fn) * rstd_f64(xf, cfg.norm_eps, keepdim=True)
        pre = in_f64(torch.sigmoid, mixes * self.hc_scale + self.hc_base) + cfg.hc_eps
        return in_f64(lambda p, v: torch.sum(p.unsqueeze(-1) * v, dim=-2), pre, h)

    def __call__(self, h: torch.Tensor, num: Numerics) -> torch.Tensor:
        return super().__call__(self.collapse(h, num), num)

    def logits(self, h: torch.Tensor, pre: torch.Tensor, num: Numerics) -> torch.Tensor:
        """`pre` is V4.1's carried collapse; V4 collapses with its own hc_head weights."""
        return self(h, num)

"""Final norm and head (§14): fp32 logits for every position; greedy sampling only."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .numerics import Numerics
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

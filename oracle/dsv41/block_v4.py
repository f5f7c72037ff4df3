"""One DeepSeek-V4 layer: standard mHC around attention and MoE (dsv4-engine.md §5 "hyper-connections").

Each sublayer collapses the residual streams with its **own** pre (V4.1 uses the previous sublayer's, §9),
and hc_post mixes the result back exactly as in V4.1 (hyper.hc_post). The streams leave the last layer
uncollapsed; head.HyperHead collapses them with the hc_head weights. The block has V4.1's call shape
(`(h, pre) -> (h, pre)`, `attention_part` / `ffn_part`), so Model, the layer-streamed runner and their
tests drive both architectures with the same steps; `pre` is passed through untouched.
"""

from __future__ import annotations

import torch

from .attention_v4 import AttentionV4
from .block import StepContext, layer_prefix
from .config import ModelConfig
from .hyper import hc_mixes, hc_post, hc_pre
from .moe_v4 import MoEV4
from .numerics import Numerics
from .weights import need


class BlockV4:
    def __init__(self, cfg: ModelConfig, layer_id: int, index_k: str = "upstream"):
        # index_k: V4.1's index-key switch (§18.1); V4 shares no keys across layers, so it has no effect
        self.cfg, self.layer_id = cfg, layer_id
        self.prefix = layer_prefix(cfg, layer_id)
        self.attn = AttentionV4(cfg, layer_id)
        self.ffn = MoEV4(cfg, layer_id)

    def load(self, w: dict) -> "BlockV4":
        p = self.prefix
        for n in ("attn", "ffn"):
            setattr(self, f"hc_{n}", tuple(need(w, f"{p}hc_{n}_{k}") for k in ("fn", "scale", "base")))
        self.attn_norm = need(w, p + "attn_norm.weight")
        self.ffn_norm = need(w, p + "ffn_norm.weight")
        self.attn.load(w, p)
        self.ffn.load(w, p)
        return self

    def mixes(self, x, params, num: Numerics):
        fn, scale, base = params
        c = self.cfg
        return hc_mixes(x, fn, scale, base, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, num)

    def __call__(self, x: torch.Tensor, pre_in: torch.Tensor, ctx: StepContext):
        ffn_in, pending = self.attention_part(x, pre_in, ctx)
        return self.ffn_part(self.ffn(ffn_in, None, ctx.num, ctx.input_ids), pending, ctx.num)

    def attention_part(self, x: torch.Tensor, pre_in: torch.Tensor, ctx: StepContext):
        """-> (the FFN input [b, s, d], what ffn_part needs)."""
        num, eps = ctx.num, self.cfg.norm_eps
        a_pre, a_post, a_comb = self.mixes(x, self.hc_attn, num)
        y = self.attn(num.rmsnorm(hc_pre(x, a_pre, num), self.attn_norm, eps), ctx.start_pos,
                      ctx.state.cache(self.layer_id), num)
        x = hc_post(y, x, a_post, a_comb, num)
        f_pre, f_post, f_comb = self.mixes(x, self.hc_ffn, num)
        return num.rmsnorm(hc_pre(x, f_pre, num), self.ffn_norm, eps), (x, f_post, f_comb, pre_in)

    @staticmethod
    def ffn_part(y: torch.Tensor, pending, num: Numerics):
        res, f_post, f_comb, pre_in = pending
        return hc_post(y, res, f_post, f_comb, num), pre_in


def block_class(cfg: ModelConfig):
    """The layer class of the config's architecture."""
    if cfg.is_v4:
        return BlockV4
    from .block import Block
    return Block

"""One DeepSeek-V4 layer: standard mHC around attention and MoE (dsv4-engine.md §5 "hyper-connections").

Each sublayer collapses the residual streams with its **own** pre (V4.1 uses the previous sublayer's, §9),
and hc_post mixes the result back exactly as in V4.1 (hyper.hc_post). The streams leave the last layer
uncollapsed; head.HyperHead collapses them with the hc_head weights. The block is a block.Block (the same
mHC weights, load and mixes, the same call shape `(h, pre) -> (h, pre)` and `attention_part` / `ffn_part`),
so Model, the layer-streamed runner and their tests drive both architectures with the same steps; `pre` is
passed through untouched.
"""

from __future__ import annotations

import torch

from .attention_v4 import AttentionV4, LayerCacheV4
from .block import Block, StepContext
from .hyper import hc_post, hc_pre
from .moe_v4 import MoEV4
from .numerics import Numerics


class BlockV4(Block):
    def make_attention(self, index_k: str) -> AttentionV4:
        # index_k is V4.1's index-key switch (§18.1); V4 shares no keys across layers, so it has no effect
        return AttentionV4(self.cfg, self.layer_id)

    def make_moe(self) -> MoEV4:
        return MoEV4(self.cfg, self.layer_id)

    def run_attn(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.attn(x, ctx.start_pos, ctx.state.cache(self.layer_id, LayerCacheV4), ctx.num)

    def moe(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """V4 has no vision path: its router reads the rows' token ids alone (hash-routed layers)."""
        return self.ffn(x, ctx.num, ctx.input_ids)

    def attention_part(self, x: torch.Tensor, pre_in: torch.Tensor, ctx: StepContext):
        """-> (the FFN input [b, s, d], what ffn_part needs)."""
        num, eps = ctx.num, self.cfg.norm_eps
        a_pre, a_post, a_comb = self.mixes(x, self.hc_attn, num)
        y = self.run_attn(num.rmsnorm(hc_pre(x, a_pre, num), self.attn_norm, eps), ctx)
        x = hc_post(y, x, a_post, a_comb, num)
        f_pre, f_post, f_comb = self.mixes(x, self.hc_ffn, num)
        return num.rmsnorm(hc_pre(x, f_pre, num), self.ffn_norm, eps), (x, f_post, f_comb, pre_in)

    @staticmethod
    def ffn_part(y: torch.Tensor, pending, num: Numerics):
        res, f_post, f_comb, pre_in = pending
        return hc_post(y, res, f_post, f_comb, num), pre_in

"""One DeepSeek-V4.1 layer (the mHC block, §9), the per-sequence state it reads and writes (§17), and the
steps of the forward schedule (§7) that the in-memory model, the layer-streamed runner and the DSpark draft
stages share:

    h, pre = embed_step(embed, ids, hc_mult)              # 4 copies of the embedding, pre one-hot on copy 0
    per layer L:  h = engram_step(engram_L, h, ...)       # layers with an Engram only
                  h, pre = Block(L)(h, pre, ctx)          # or attention_part / MoE / ffn_part, for grouped MoE
    logits = head_step(head, h, pre, num)                 # collapses with the last FFN's pre (§7 step 6)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import Attention, LayerCache, SharedRuntime
from .config import ModelConfig
from .engram import Engram
from .head import Embedding, Head
from .hyper import hc_mixes, hc_post, hc_pre
from .moe import MoE
from .numerics import Numerics
from .weights import need


def layer_prefix(cfg: ModelConfig, layer_id: int) -> str:
    return f"layers.{layer_id}." if layer_id < cfg.n_layers else f"mtp.{layer_id - cfg.n_layers}."


@dataclass
class ModelState:
    """Everything a sequence batch carries between calls (§17.2)."""

    num: Numerics
    batch: int
    next_pos: int = 0
    shared: SharedRuntime = field(default_factory=SharedRuntime)
    engram_history: torch.Tensor | None = None

    @property
    def caches(self) -> dict[int, LayerCache]:
        return self.shared.caches

    def cache(self, layer_id: int, kind: type[LayerCache] = LayerCache) -> LayerCache:
        """Layer `layer_id`'s cache, made on first use as `kind` (an architecture's attention may keep more)."""
        cache = self.shared.caches.setdefault(layer_id, kind())
        if not isinstance(cache, kind):
            raise TypeError(f"layer {layer_id}: its cache is a {type(cache).__name__}, not a {kind.__name__}")
        return cache


@dataclass
class StepContext:
    start_pos: int
    state: ModelState
    image_mask: torch.Tensor | None = None
    main_x: torch.Tensor | None = None  # DSpark stages only
    input_ids: torch.Tensor | None = None  # [b, s]: V4's hash-routed layers read them

    @property
    def num(self) -> Numerics:
        return self.state.num


class Block:
    """One layer: attention and MoE between hc_pre/hc_post, with the one-sublayer-late pre (§9).

    The mHC weights, their load and mixes are the same in DeepSeek-V4; block_v4.BlockV4 overrides the parts
    that differ (its attention and MoE, and where each sublayer's pre comes from)."""

    attention_cls = Attention

    def __init__(self, cfg: ModelConfig, layer_id: int, index_k: str = "upstream"):
        self.cfg, self.layer_id = cfg, layer_id
        self.prefix = layer_prefix(cfg, layer_id)
        self.attn = self.make_attention(index_k)
        self.ffn = self.make_moe()

    def make_attention(self, index_k: str):
        return self.attention_cls(self.cfg, self.layer_id, index_k)

    def make_moe(self):
        return MoE(self.cfg, self.layer_id)

    def load(self, w: dict):
        p = self.prefix
        for n in ("attn", "ffn"):
            setattr(self, f"hc_{n}", tuple(need(w, f"{p}hc_{n}_{k}") for k in ("fn", "scale", "base")))
        self.attn_norm = need(w, p + "attn_norm.weight")
        self.ffn_norm = need(w, p + "ffn_norm.weight")
        self.attn.load(w, p)
        self.ffn.load(w, p)
        return self

    def mixes(self, x, params, num: Numerics | None = None):
        fn, scale, base = params
        c = self.cfg
        return hc_mixes(x, fn, scale, base, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, num)

    def run_attn(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.attn(x, ctx.start_pos, ctx.state.cache(self.layer_id), ctx.state.shared, ctx.num)

    def moe(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The MoE over the rows of `x` (one sequence's, or a group's concatenated with `ctx` describing the same
        rows); the V4.1 router reads which rows are image tokens (bias_vl, §13.1)."""
        return self.ffn(x, ctx.num, ctx.image_mask)

    def __call__(self, x: torch.Tensor, pre_in: torch.Tensor, ctx: StepContext):
        ffn_in, pending = self.attention_part(x, pre_in, ctx)
        return self.ffn_part(self.moe(ffn_in, ctx), pending, ctx.num)

    # The block in two parts, so that a runner can send the FFN inputs of several sequences through one
    # MoE call (every op is row-independent, numerics.in_f64): each expert weight is then used once per
    # group of sequences instead of once per sequence.
    def attention_part(self, x: torch.Tensor, pre_in: torch.Tensor, ctx: StepContext):
        """-> (the FFN input [b, s, d], what ffn_part needs)."""
        num, eps = ctx.num, self.cfg.norm_eps
        res = x
        a_pre, a_post, a_comb = self.mixes(x, self.hc_attn, num)
        y = self.run_attn(num.rmsnorm(hc_pre(x, pre_in, num), self.attn_norm, eps), ctx)
        x = hc_post(y, res, a_post, a_comb, num)
        f_pre, f_post, f_comb = self.mixes(x, self.hc_ffn, num)
        # the FFN input collapses with the ATTENTION's pre; f_pre goes to the next block (§9)
        return num.rmsnorm(hc_pre(x, a_pre, num), self.ffn_norm, eps), (x, f_pre, f_post, f_comb)

    @staticmethod
    def ffn_part(y: torch.Tensor, pending, num: Numerics):
        res, f_pre, f_post, f_comb = pending
        return hc_post(y, res, f_post, f_comb, num), f_pre


def embed_step(embed: Embedding, ids: torch.Tensor, hc_mult: int,
               merge_images=None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [b, s] -> (h [b, s, hc, d]: `hc_mult` identical copies of the embedding, pre [b, s, hc]: one-hot
    on copy 0) (§7). `merge_images(h [b, s, d]) -> h` overwrites image spans before the copies (§16)."""
    b, s = ids.shape
    h = embed(ids)
    if merge_images is not None:
        h = merge_images(h)
    h = h.unsqueeze(2).repeat(1, 1, hc_mult, 1)
    pre = torch.zeros(b, s, hc_mult)
    pre[..., 0] = 1.0
    return h, pre


def engram_step(engram: Engram | None, h: torch.Tensor, hashes: torch.Tensor | None,
                engram_mask: torch.Tensor | None, num: Numerics) -> torch.Tensor:
    """The layer's Engram (§8) added to the residual streams before its block; `h` unchanged without one."""
    if engram is None:
        return h
    return engram(h, hashes[:, :, engram.index].to(h.device), engram_mask, num)


def head_step(head: Head, h: torch.Tensor, pre: torch.Tensor, num: Numerics) -> torch.Tensor:
    """The streams collapsed, then the final norm and the vocabulary projection (Head.logits)."""
    return head.logits(h, pre, num)

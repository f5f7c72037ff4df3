"""DeepSeek-V4.1 top-level forward (§7), the mHC block (§9), and the explicit per-sequence state (§17).

Call pattern (§17.1): `state = model.new_state(b)`; `model.forward(ids[b, s], state)` once at position 0,
then `model.forward(ids[b, 1], state)` per decode step. Every module is a plain object with `.load(weights)`
so a layer-streaming runner can build `Block(cfg, L).load(w)` one layer at a time and drive the same
`embed -> engram/tap/block per layer -> head` sequence itself (see `Model.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .attention import Attention, LayerCache, SharedRuntime
from .config import ModelConfig
from .engram import Engram, EngramLayout, NgramHasher
from .head import Embedding, Head
from .hyper import hc_mixes, hc_post, hc_pre
from .moe import MoE
from .numerics import Numerics

INDEX_K_MODES = ("upstream", "intended")


def _need(w: dict, name: str) -> torch.Tensor:
    try:
        return w[name]
    except KeyError:
        raise KeyError(f"missing checkpoint tensor {name!r}") from None


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

    def cache(self, layer_id: int) -> LayerCache:
        return self.shared.caches.setdefault(layer_id, LayerCache())


@dataclass
class StepContext:
    start_pos: int
    state: ModelState
    image_mask: torch.Tensor | None = None
    main_x: torch.Tensor | None = None  # DSpark stages only

    @property
    def num(self) -> Numerics:
        return self.state.num


class Block:
    """One layer: attention and MoE between hc_pre/hc_post, with the one-sublayer-late pre (§9)."""

    attention_cls = Attention

    def __init__(self, cfg: ModelConfig, layer_id: int, index_k: str = "upstream"):
        self.cfg, self.layer_id = cfg, layer_id
        self.prefix = layer_prefix(cfg, layer_id)
        self.attn = self.attention_cls(cfg, layer_id, index_k)
        self.ffn = MoE(cfg, layer_id)

    def load(self, w: dict) -> "Block":
        p = self.prefix
        for n in ("attn", "ffn"):
            setattr(self, f"hc_{n}", tuple(_need(w, f"{p}hc_{n}_{k}") for k in ("fn", "scale", "base")))
        self.attn_norm = _need(w, p + "attn_norm.weight")
        self.ffn_norm = _need(w, p + "ffn_norm.weight")
        self.attn.load(w, p)
        self.ffn.load(w, p)
        return self

    def mixes(self, x, params, num: Numerics | None = None):
        fn, scale, base = params
        c = self.cfg
        return hc_mixes(x, fn, scale, base, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps, num)

    def run_attn(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.attn(x, ctx.start_pos, ctx.state.cache(self.layer_id), ctx.state.shared, ctx.num)

    def __call__(self, x: torch.Tensor, pre_in: torch.Tensor, ctx: StepContext):
        ffn_in, pending = self.attention_part(x, pre_in, ctx)
        return self.ffn_part(self.ffn(ffn_in, ctx.image_mask, ctx.num), pending, ctx.num)

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


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [b, s, V] fp32, every position
    main_hidden: torch.Tensor | None  # [b, s, dim * n_taps] DSpark taps (§7 step 5.2)


class Model:
    """The whole backbone (+ DSpark stages via `oracle.dsv41.mtp`). `weights` maps official tensor
    names (§4) to fp32 tensors, already dequantised.

    precision: "fp32" | "reference-bf16" (§5). index_k: "upstream" (default: reproduces the
    reference's stale index-key pointer in decode, §18.1) | "intended" (decode == prefill)."""

    def __init__(self, cfg: ModelConfig, weights: dict, token_map: np.ndarray | None,
                 precision: str = "fp32", index_k: str = "upstream", with_mtp: bool = True):
        if index_k not in INDEX_K_MODES:
            raise ValueError(f"index_k {index_k!r}: expected one of {INDEX_K_MODES}")
        Numerics(precision)  # validates the mode name
        self.cfg, self.precision, self.index_k = cfg, precision, index_k
        self.embed = Embedding(cfg).load(weights)
        self.blocks = [Block(cfg, L, index_k).load(weights) for L in range(cfg.n_layers)]
        self.engrams = {L: Engram(cfg, L).load(weights) for L in cfg.engram_layer_ids}
        self.head = Head(cfg).load(weights)
        self.hasher = None
        if cfg.engram_layer_ids:
            if token_map is None:
                raise ValueError("Model: the config has Engram layers, so a compressed token map is required "
                                 "(engram.release_token_map() or engram.tiny_token_map())")
            self.hasher = NgramHasher(cfg, EngramLayout.build(cfg), token_map)
        self.mtp = None
        if with_mtp and cfg.n_mtp_layers and cfg.dspark_block_size:
            from .mtp import DSpark

            self.mtp = DSpark(cfg, weights, self.embed, self.head)

    def new_state(self, batch: int) -> ModelState:
        st = ModelState(num=Numerics(self.precision), batch=batch)
        if self.hasher is not None:
            st.engram_history = self.hasher.new_history(batch)
        return st

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, state: ModelState,
                token_types: torch.Tensor | None = None) -> ForwardOutput:
        cfg = self.cfg
        b, s = input_ids.shape
        start_pos = state.next_pos
        if b != state.batch:
            raise ValueError(f"forward: batch {b} but the state was made for {state.batch}")
        if start_pos > 0 and s != 1:
            raise ValueError(f"forward: decode at position {start_pos} takes 1 token, got {s} (no chunked prefill, §17.1)")
        if token_types is not None and start_pos > 0 and bool((token_types >= 0).any()):
            raise ValueError("forward: image tokens must lie inside the prefill (§17.1)")
        image_mask = None if token_types is None else token_types >= 0  # §7 step 1
        engram_mask = None if image_mask is None else ~image_mask
        ctx = StepContext(start_pos, state, image_mask)
        hashes = None
        if self.hasher is not None:
            hashes, state.engram_history = self.hasher(input_ids, state.engram_history, start_pos, engram_mask)
        h = self.embed(input_ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # 4 identical copies
        pre = torch.zeros(b, s, cfg.hc_mult)
        pre[..., 0] = 1.0  # one-hot on copy 0
        taps = []
        for L, block in enumerate(self.blocks):
            if L in self.engrams:
                h = self.engrams[L](h, hashes[:, :, self.engrams[L].index], engram_mask, state.num)
            if L in cfg.dspark_target_layer_ids:  # after Engram, before the block
                taps.append(state.num.r(h.mean(dim=2)))
            h, pre = block(h, pre, ctx)
        logits = self.head(hc_pre(h, pre, state.num), state.num)  # the last FFN's pre (§7 step 6)
        state.next_pos = start_pos + s
        return ForwardOutput(logits, torch.cat(taps, dim=-1) if taps else None)

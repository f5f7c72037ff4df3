"""DeepSeek-V4.1 top-level forward (§7) with every weight in memory.

Call pattern (§17.1): `state = model.new_state(b)`; `model.forward(ids[b, s], state)` once at position 0,
then `model.forward(ids[b, 1], state)` per decode step. The schedule is the steps of oracle/dsv41/block.py
(embed_step -> per layer engram_step + Block -> head_step); the layer-streamed runner drives the same steps
one layer's weights at a time, and the DSpark stages (mtp.py) reuse embed_step and Block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .block import Block, ModelState, StepContext, embed_step, engram_step, head_step, layer_prefix
from .config import ModelConfig
from .engram import Engram, EngramLayout, NgramHasher
from .head import Embedding, Head
from .mtp import DSpark
from .numerics import Numerics

__all__ = ["Block", "ForwardOutput", "Model", "ModelState", "StepContext", "layer_prefix"]

INDEX_K_MODES = ("upstream", "intended")


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
        h, pre = embed_step(self.embed, input_ids, cfg.hc_mult)
        taps = []
        for L, block in enumerate(self.blocks):
            h = engram_step(self.engrams.get(L), h, hashes, engram_mask, state.num)
            if L in cfg.dspark_target_layer_ids:  # after Engram, before the block
                taps.append(state.num.r(h.mean(dim=2)))
            h, pre = block(h, pre, ctx)
        logits = head_step(self.head, h, pre, state.num)
        state.next_pos = start_pos + s
        return ForwardOutput(logits, torch.cat(taps, dim=-1) if taps else None)

"""DeepSeek-V4.1 top-level forward (§7) with every weight in memory; a DeepSeek-V4 config gets its
architecture's blocks and head (arch.arch_of) in the same schedule.

Call pattern (§17.1): `state = model.new_state(b)`; `model.forward(ids[b, s], state)` once at position 0,
then `model.forward(ids[b, 1], state)` per decode step. The schedule is the steps of oracle/dsv41/block.py
(embed_step -> per layer engram_step + Block -> head_step); the layer-streamed runner drives the same steps
one layer's weights at a time, and the DSpark stages (mtp.py) reuse embed_step and Block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .aligner import Aligner
from .arch import arch_of
from .block import Block, ModelState, StepContext, embed_step, engram_step, head_step, layer_prefix
from .config import ModelConfig
from .engram import Engram, EngramLayout, NgramHasher
from .head import Embedding
from .image_processor import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImageInputError, ImageSpan,
                              ProcessedImage)
from .numerics import Numerics
from .vision import VisionTower
from .weights import need

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
    reference's stale index-key pointer in decode, §18.1) | "intended" (decode == prefill).
    With `cfg.vision_n_layers > 0` and `with_vision`, the tower, aligner and image_* vectors are loaded and
    `forward` takes images (§16)."""

    def __init__(self, cfg: ModelConfig, weights: dict, token_map: np.ndarray | None,
                 precision: str = "fp32", index_k: str = "upstream", with_mtp: bool = True,
                 with_vision: bool = True):
        if index_k not in INDEX_K_MODES:
            raise ValueError(f"index_k {index_k!r}: expected one of {INDEX_K_MODES}")
        Numerics(precision)  # validates the mode name
        self.cfg, self.precision, self.index_k = cfg, precision, index_k
        arch = arch_of(cfg)
        self.embed = Embedding(cfg).load(weights)
        self.blocks = [arch.block(cfg, L, index_k).load(weights) for L in range(cfg.n_layers)]
        self.engrams = {L: Engram(cfg, L).load(weights) for L in cfg.engram_layer_ids}
        self.head = arch.head(cfg).load(weights)
        self.hasher = None
        if cfg.engram_layer_ids:
            if token_map is None:
                raise ValueError("Model: the config has Engram layers, so a compressed token map is required "
                                 "(engram.release_token_map() or engram.tiny_token_map())")
            self.hasher = NgramHasher(cfg, EngramLayout.build(cfg), token_map)
        self.mtp = None
        if with_mtp and cfg.n_mtp_layers and cfg.dspark_block_size:
            self.mtp = arch.drafter(cfg, weights, self.embed, self.head)
        self.vision = self.aligner = None
        if with_vision and cfg.vision_n_layers > 0:
            if not 0 <= cfg.image_token_id < cfg.vocab_size:
                raise ValueError(f"Model: image_token_id {cfg.image_token_id} is outside the vocabulary "
                                 f"0..{cfg.vocab_size - 1}; every image position embeds it before the merge "
                                 "(with_vision=False for a text-only run)")
            self.vision = VisionTower(cfg).load(weights)
            self.aligner = Aligner(cfg).load(weights)
            self.image_vectors = {name: need(weights, name) for name in ("image_start", "image_end", "image_newline")}

    def encode_image(self, image: ProcessedImage, num: Numerics) -> torch.Tensor:
        """Aligner rows [n_llm_h * n_llm_w, dim] of one image (tower, then aligner)."""
        if self.vision is None:
            raise ImageInputError("encode_image: this model has no vision tower (vision_n_layers 0 or "
                                  "with_vision=False)")
        feats = self.vision(image.patches, image.n_vit_h, image.n_vit_w, num)
        return self.aligner(feats, image.n_vit_h, image.n_vit_w, num)

    def _image_merger(self, input_ids: torch.Tensor, token_types: torch.Tensor | None,
                      images: Sequence[Sequence[ImageSpan]], num: Numerics):
        """Checks the spans against the laid-out ids and types; returns embed_step's merge function."""
        if self.vision is None:
            raise ImageInputError("forward: images given, but this model has no vision tower (vision_n_layers 0 "
                                  "or with_vision=False)")
        b, s = input_ids.shape
        if len(images) != b:
            raise ImageInputError(f"forward: images has {len(images)} rows for a batch of {b}")
        if token_types is None or tuple(token_types.shape) != (b, s):
            raise ImageInputError("forward: images need token_types [b, s] marking their spans (layout_prompt)")
        for row, spans in enumerate(images):
            covered = torch.zeros(s, dtype=torch.bool)
            for k, span in enumerate(spans):
                where = f"forward: row {row} image {k} (span {span.start}..{span.end})"
                if span.start < 0 or span.end > s:
                    raise ImageInputError(f"{where} lies outside the sequence of {s} positions")
                want = torch.tensor(span.image.span_types(), dtype=token_types.dtype)
                if not torch.equal(token_types[row, span.start:span.end].cpu(), want):
                    raise ImageInputError(f"{where}: token_types there are not the image's span layout")
                if bool((input_ids[row, span.start:span.end] != self.cfg.image_token_id).any()):
                    raise ImageInputError(f"{where}: input ids there must all be image_token_id "
                                          f"{self.cfg.image_token_id}")
                if bool(covered[span.start:span.end].any()):
                    raise ImageInputError(f"{where} overlaps another image")
                covered[span.start:span.end] = True
            typed = (token_types[row] >= 0).cpu()
            if not torch.equal(typed, covered):
                first = int((typed != covered).nonzero()[0])
                raise ImageInputError(f"forward: row {row} position {first} is typed "
                                      f"{'image' if bool(typed[first]) else 'text'} but "
                                      f"{'no' if bool(typed[first]) else 'an'} image span covers it")

        def merge(h: torch.Tensor) -> torch.Tensor:
            h = h.clone()
            fill = {IMAGE_START: "image_start", IMAGE_END: "image_end", IMAGE_NEW_LINE: "image_newline"}
            for row, spans in enumerate(images):
                for span in spans:
                    types = token_types[row, span.start:span.end].to(h.device)
                    part = h[row, span.start:span.end]
                    for t, name in fill.items():
                        part[types == t] = self.image_vectors[name].to(h.dtype)
                    part[types == IMAGE] = num.r(self.encode_image(span.image, num)).to(h.device)
            return h
        return merge

    def new_state(self, batch: int) -> ModelState:
        st = ModelState(num=Numerics(self.precision), batch=batch)
        if self.hasher is not None:
            st.engram_history = self.hasher.new_history(batch)
        return st

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, state: ModelState, token_types: torch.Tensor | None = None,
                images: Sequence[Sequence[ImageSpan]] | None = None) -> ForwardOutput:
        """`images[row]`: the image spans of batch row `row`, laid out in `input_ids` / `token_types` by
        image_processor.layout_prompt; only in the prefill (position 0)."""
        h, pre, taps = self.trunk(input_ids, state, token_types, images)
        return ForwardOutput(head_step(self.head, h, pre, state.num), taps)

    @torch.inference_mode()
    def trunk(self, input_ids: torch.Tensor, state: ModelState, token_types: torch.Tensor | None = None,
              images: Sequence[Sequence[ImageSpan]] | None = None):
        """Every layer, no head: -> (h [b, s, hc, d], pre [b, s, hc], DSpark taps [b, s, dim * n_taps] or None).
        A call continues the state: the prefill at position 0, then decode steps of one token, or the chunks
        of a chunked prefill (s > 1 at a later position; long_context.py), which equal the one-pass prefill."""
        cfg = self.cfg
        b, s = input_ids.shape
        start_pos = state.next_pos
        if b != state.batch:
            raise ValueError(f"forward: batch {b} but the state was made for {state.batch}")
        merge = None
        if images is not None and any(len(row) for row in images):
            if start_pos > 0:
                raise ImageInputError(f"forward: images at position {start_pos}; images must lie in the "
                                      "position-0 prefill (§16)")
            merge = self._image_merger(input_ids, token_types, images, state.num)
        if token_types is not None and start_pos > 0 and bool((token_types >= 0).any()):
            raise ValueError("forward: image tokens must lie inside the prefill (§17.1)")
        image_mask = None if token_types is None else token_types >= 0  # §7 step 1
        engram_mask = None if image_mask is None else ~image_mask
        ctx = StepContext(start_pos, state, image_mask, input_ids=input_ids)
        hashes = None
        if self.hasher is not None:
            hashes, state.engram_history = self.hasher(input_ids, state.engram_history, start_pos, engram_mask)
        h, pre = embed_step(self.embed, input_ids, cfg.hc_mult, merge)
        taps = []
        tap_output = arch_of(cfg).taps_block_output
        for L, block in enumerate(self.blocks):
            h = engram_step(self.engrams.get(L), h, hashes, engram_mask, state.num)
            if L in cfg.dspark_target_layer_ids and not tap_output:  # V4.1: after Engram, before the block
                taps.append(state.num.r(h.mean(dim=2)))
            h, pre = block(h, pre, ctx)
            if L in cfg.dspark_target_layer_ids and tap_output:  # V4: the block's output
                taps.append(state.num.r(h.mean(dim=2)))
        state.next_pos = start_pos + s
        return h, pre, torch.cat(taps, dim=-1) if taps else None

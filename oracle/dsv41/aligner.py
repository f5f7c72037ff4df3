"""The DeepSeek-V4.1 aligner (dsv41-architecture.md §16): ViT patch features -> LLM embedding rows.

The [n_vit_h, n_vit_w, C] grid is zero-padded at the bottom and right to multiples of r
(`vision_downsample_ratio`), cut into non-overlapping r x r cells in row-major order, each cell flattened
channel-major (feature c * r * r + i * r + j for channel c at cell row i, column j), then w2(gelu(w1(.))) with
the exact (erf) GELU. Precision as in vision.py: float64 rounded once in fp32 mode; in reference-bf16 mode
vision.py's own calls on bf16 tensors, the cells included: `F.unfold` and its transposed (strided) view go
into w1's `F.linear` as vision.py hands them over (torch's CPU bf16 GEMM rounds a strided operand differently
from a contiguous copy: 167 of 563,200 w1 outputs at release sizes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .numerics import Numerics
from .weights import need


def unfold_cells(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """[n_h * n_w, C] -> [ceil(n_h / r) * ceil(n_w / r), C * r * r], channel-major per cell."""
    c = x.shape[-1]
    grid = x.reshape(n_h, n_w, c)
    ph, pw = -n_h % r, -n_w % r
    grid = F.pad(grid, (0, 0, 0, pw, 0, ph))
    gh, gw = (n_h + ph) // r, (n_w + pw) // r
    cells = grid.reshape(gh, r, gw, r, c).permute(0, 2, 4, 1, 3)  # [gh, gw, C, r, r]
    return cells.reshape(gh * gw, c * r * r)


def unfold_cells_reference(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """vision.py's Aligner unfold, call for call: [n_h * n_w, C] -> view [C, n_h, n_w], zero-pad bottom and
    right, `F.unfold(r, stride=r)`, the transposed view [cells, C * r * r] (not copied). Same values as
    `unfold_cells`."""
    t = x.view(n_h, n_w, -1).permute(2, 0, 1)
    t = F.pad(t, (0, -n_w % r, 0, -n_h % r))
    return F.unfold(t.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)


class Aligner:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def load(self, w) -> "Aligner":
        self.w1, self.b1 = need(w, "aligner.w1.weight"), need(w, "aligner.w1.bias")
        self.w2, self.b2 = need(w, "aligner.w2.weight"), need(w, "aligner.w2.bias")
        return self

    def __call__(self, feats: torch.Tensor, n_vit_h: int, n_vit_w: int, num: Numerics) -> torch.Tensor:
        """feats [n_vit_h * n_vit_w, vision_dim] -> [n_llm_h * n_llm_w, dim]."""
        r = self.cfg.vision_downsample_ratio
        if num.bf16:  # the bf16 cells as vision.py builds them; num.linear passes a bf16 view on as it is
            cells = unfold_cells_reference(feats.to(torch.bfloat16).contiguous(), n_vit_h, n_vit_w, r)
        else:
            cells = unfold_cells(feats, n_vit_h, n_vit_w, r)
        hidden = num.on_bf16(lambda t: F.gelu(t, approximate="none"), num.linear(cells, self.w1, self.b1))
        return num.linear(hidden, self.w2, self.b2)

"""The DeepSeek-V4.1 vision tower (ViT, dsv41-architecture.md §16) in the oracle's two precision modes.

    tower = VisionTower(cfg).load(weights)                    # official names: vision.*
    feats = tower(image.patches, image.n_vit_h, image.n_vit_w, Numerics(mode))   # [n_vit_h * n_vit_w, vision_dim]

patch_embed (Linear over the flattened 3 x p x p patch, with bias) -> `vision_n_layers` pre-norm blocks
(RMSNorm eps 1e-6 -> wqkv -> 2-D RoPE on q, k -> non-causal attention, scale head_dim^-0.5 -> wo -> residual;
RMSNorm -> w1 -> silu(gate half) * up half -> w2 -> residual) -> final RMSNorm.

fp32 mode: every product, softmax and transcendental in float64, rounded once to fp32 (the contract of
numerics.py: results independent of how many patches share a call). reference-bf16 mode: DeepSeek's
vision.py call for call, in its dtypes, shapes and order: bf16 patches, weights, biases and activations (every
Linear a bf16 F.linear, the residual adds bf16), RMSNorm in fp32 with the fp32 weight and cast back to bf16;
q, k, v as vision.py slices them (`wqkv(x).chunk(3)`, each viewed [N, H, D] on the bf16 output); RoPE with
vision.py's tables (torch's fp32 cos / sin of the [N, D/2] fp32 angle table, the shape vision.py evaluates
them on) applied as its `apply_rotary` (fp32 halves x1 cos - x2 sin, x2 cos + x1 sin, cast to bf16);
torch's scaled_dot_product_attention on the 3-D [H, N, D] bf16 views (torch's CPU SDPA rounds 4-D and 3-D
calls differently); silu and the product in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .numerics import Numerics, in_f64
from .weights import need

VISION_NORM_EPS = 1e-6


def vision_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """theta^(-arange(0, r, 2) / r) in fp32 with r = head_dim / 2: one frequency per rotated pair of each axis."""
    r = cfg.vision_head_dim // 2
    return 1.0 / (cfg.vision_rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))


def vision_rope_angles(cfg: ModelConfig, n_h: int, n_w: int) -> torch.Tensor:
    """[n_h * n_w, head_dim / 2] fp32: per patch (row-major), its row times every frequency, then its column
    times every frequency."""
    inv = vision_inv_freq(cfg)
    rows = torch.arange(n_h, dtype=torch.float32).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.float32).repeat(n_h)
    return torch.cat([rows[:, None] * inv[None, :], cols[:, None] * inv[None, :]], dim=1)


def rope_tables(angles: torch.Tensor, num: Numerics | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim] for rotate-half RoPE (the angles repeated over both halves).

    fp32 mode (and `num` None): correctly rounded fp32 of the fp32 angles. reference-bf16 mode: vision.py's
    `get_vision_cos_sin`, torch's fp32 `cos` / `sin` evaluated on the contiguous [N, head_dim / 2] angle
    table (the same values and shape as vision.py's `freqs`, so the same kernel path), then repeated (a copy)."""
    if num is not None and num.bf16:
        half = angles.float().contiguous()
        c, s = half.cos(), half.sin()
        return torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
    full = torch.cat([angles, angles], dim=-1)
    return in_f64(torch.cos, full), in_f64(torch.sin, full)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _rotary_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """vision.py's `apply_rotary` on a bf16 x [N, H, D]: fp32 halves, x1 cos - x2 sin | x2 cos + x1 sin with
    the first half of the (repeated) tables, cast to bf16. Returns bf16."""
    h = x.shape[-1] // 2
    c, s = cos[:, None, :h], sin[:, None, :h]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(torch.bfloat16)


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num: Numerics) -> torch.Tensor:
    """x [N, H, D] rotated per head: x cos + rotate_half(x) sin. reference-bf16 mode: vision.py's
    `apply_rotary` on the bf16 input (fp32 arithmetic, rounded once to bf16; pass that mode's tables)."""
    if num.bf16:
        return _rotary_bf16(x.to(torch.bfloat16), cos, sin).float()
    c, s = cos[:, None, :], sin[:, None, :]
    return in_f64(lambda x_, c_, s_: x_ * c_ + rotate_half(x_) * s_, x, c, s)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num: Numerics) -> torch.Tensor:
    """Non-causal attention over all patches, q, k, v [N, H, D] -> [N, H, D], scale D^-0.5.

    reference-bf16 mode: vision.py's call, `F.scaled_dot_product_attention` on the 3-D [H, N, D] transposed
    bf16 views (bf16 inputs are used as they are, so their strides are the caller's)."""
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, D]
    if num.bf16:
        out = F.scaled_dot_product_attention(*(t.to(torch.bfloat16) for t in (qh, kh, vh))).float()
    else:
        scale = q.shape[-1] ** -0.5

        def attend(q_, k_, v_):
            return torch.softmax(q_ @ k_.transpose(-1, -2) * scale, dim=-1) @ v_
        out = in_f64(attend, qh, kh, vh)
    return out.transpose(0, 1)


class VisionBlock:
    def __init__(self, cfg: ModelConfig, index: int):
        self.cfg, self.prefix = cfg, f"vision.blocks.{index}."

    def load(self, w) -> "VisionBlock":
        p = self.prefix
        self.norm1, self.norm2 = need(w, p + "norm1.weight"), need(w, p + "norm2.weight")
        self.wqkv, self.wqkv_b = need(w, p + "attn.wqkv.weight"), need(w, p + "attn.wqkv.bias")
        self.wo, self.wo_b = need(w, p + "attn.wo.weight"), need(w, p + "attn.wo.bias")
        self.w1, self.w2 = need(w, p + "mlp.w1.weight"), need(w, p + "mlp.w2.weight")
        return self

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num: Numerics) -> torch.Tensor:
        n, hd, heads = x.shape[0], self.cfg.vision_head_dim, self.cfg.vision_n_heads
        qkv = num.linear(x, self.wqkv, self.wqkv_b)
        if num.bf16:  # vision.py: q, k, v = (t.view(n, H, D) for t in wqkv(x).chunk(3)), all bf16
            q, k, v = (t.view(n, heads, hd) for t in qkv.to(torch.bfloat16).chunk(3, dim=-1))
            q, k = _rotary_bf16(q, cos, sin), _rotary_bf16(k, cos, sin)
        else:
            q, k, v = qkv.view(n, 3, heads, hd).unbind(1)
            q, k = apply_vision_rope(q, cos, sin, num), apply_vision_rope(k, cos, sin, num)
        out = vision_attention(q, k, v, num).reshape(n, -1)
        return num.linear(out, self.wo, self.wo_b)

    def mlp(self, x: torch.Tensor, num: Numerics) -> torch.Tensor:
        gate, up = num.linear(x, self.w1).chunk(2, dim=-1)
        return num.linear(num.on_bf16(lambda g, u: F.silu(g) * u, gate, up), self.w2)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num: Numerics) -> torch.Tensor:
        x = num.r(x + self.attention(num.rmsnorm(x, self.norm1, VISION_NORM_EPS), cos, sin, num))
        return num.r(x + self.mlp(num.rmsnorm(x, self.norm2, VISION_NORM_EPS), num))


class VisionTower:
    def __init__(self, cfg: ModelConfig):
        if cfg.vision_n_layers <= 0:
            raise ValueError("VisionTower: vision_n_layers is 0 (the vision path is off in this config)")
        self.cfg = cfg

    def load(self, w) -> "VisionTower":
        self.patch_w = need(w, "vision.patch_embed.proj.weight")
        self.patch_b = need(w, "vision.patch_embed.proj.bias")
        self.blocks = [VisionBlock(self.cfg, i).load(w) for i in range(self.cfg.vision_n_layers)]
        self.norm = need(w, "vision.norm.weight")
        return self

    def embed(self, patches: torch.Tensor, num: Numerics) -> torch.Tensor:
        p = self.cfg.vision_patch_size
        if patches.dim() != 4 or tuple(patches.shape[1:]) != (3, p, p):
            raise ValueError(f"vision tower: patches must be [N, 3, {p}, {p}], got {list(patches.shape)}")
        return num.linear(num.r(patches.float().reshape(patches.shape[0], -1)), self.patch_w, self.patch_b)

    def __call__(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int, num: Numerics) -> torch.Tensor:
        if patches.shape[0] != n_vit_h * n_vit_w:
            raise ValueError(f"vision tower: {patches.shape[0]} patches for a {n_vit_h} x {n_vit_w} grid")
        cos, sin = rope_tables(vision_rope_angles(self.cfg, n_vit_h, n_vit_w), num)
        x = self.embed(patches, num)
        for block in self.blocks:
            x = block(x, cos, sin, num)
        return num.rmsnorm(x, self.norm, VISION_NORM_EPS)

"""MoE (§13): sqrt-softplus router with selection-only bias, clamped SwiGLU experts, one shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .numerics import Numerics
from .weights import need


def router_scores(logits: torch.Tensor, score_func: str, num: Numerics) -> torch.Tensor:
    """Router logits [n, E] -> scores (fp32, no bf16 rounding); both architectures' score functions."""
    if score_func == "sqrtsoftplus":
        return num.f32(lambda t: F.softplus(t).sqrt(), logits)
    if score_func == "sigmoid":
        return num.f32(torch.sigmoid, logits)
    if score_func == "softmax":
        return num.f32(lambda t: t.softmax(dim=-1), logits)
    raise ValueError(f"router: unknown score_func {score_func!r}")


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, cfg: ModelConfig, num: Numerics,
          site: str = "router"):
    """x [n, d] -> (weights [n, k], indices [n, k]); fp32, no act QDQ, no bf16 rounding (§13.1)."""
    s = router_scores(num.fp32_linear(x, weight) / cfg.gate_temp, cfg.score_func, num)
    # the bias picks experts but does not weight them
    _, idx = num.topk(s + bias, k, site)
    wts = s.gather(1, idx)
    if cfg.norm_topk_prob and k > 1:
        wts = wts / (num.sum(wts, -1, keepdim=True) + 1e-20)  # literally 1e-20, not norm_eps
    return wts * cfg.route_scale, idx


def expert(x: torch.Tensor, w1, w2, w3, limit: float, num: Numerics, wts: torch.Tensor | None = None,
           **qlinear_kw):
    """Clamped SwiGLU (§13.2): up clamped both sides, gate from above; routing weight before w2.
    `qlinear_kw`: the activation / GEMM blocks of the architecture (V4: numerics.qlinear's block 128)."""
    g, u = num.qlinear(x, w1, **qlinear_kw), num.qlinear(x, w3, **qlinear_kw)
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = num.f32(F.silu, g) * u
    if wts is not None:
        h = wts * h
    return num.qlinear(num.r(h), w2, **qlinear_kw)


class MoE:
    """The DeepSeek-V4.1 MoE, and the shape both architectures' MoEs share: the gate's weight, the routed experts
    (read on use) and the shared expert are loaded here once; a subclass loads its router's own tensors
    (``load_router``) and routes (``__call__``); ``run_experts`` sums the experts the router picked plus the
    shared one. moe_v4.MoEV4 is DeepSeek-V4's."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        self.cfg, self.layer_id = cfg, layer_id
        self.n_experts, self.k = cfg.moe_experts(layer_id)

    def load(self, w: dict, prefix: str) -> "MoE":
        p = prefix + "ffn."
        self.gate = need(w, p + "gate.weight")
        if self.gate.shape[0] != self.n_experts:
            raise ValueError(f"{p}gate.weight has {self.gate.shape[0]} rows, config says {self.n_experts} experts")
        self.load_router(w, p)
        # experts: a dict name -> tensor, or a lazy mapping that dequantizes on access (§19 memory plan)
        self.w = w
        self.prefix = p
        self.shared = tuple(need(w, f"{p}shared_experts.{n}.weight") for n in ("w1", "w2", "w3"))
        return self

    def load_router(self, w: dict, p: str) -> None:
        """V4.1: the selection bias, and the image tokens' own bias when the vision path is on."""
        self.bias = need(w, p + "gate.bias")
        self.bias_vl = w.get(p + "gate.bias_vl")

    def expert_weights(self, e: int):
        return tuple(need(self.w, f"{self.prefix}experts.{e}.{n}.weight") for n in ("w1", "w2", "w3"))

    def run_experts(self, x: torch.Tensor, wts: torch.Tensor, idx: torch.Tensor, num: Numerics,
                    routed_kw: dict, shared_kw: dict) -> torch.Tensor:
        """x [n, d] through each row's picked experts (weighted) plus the shared expert; `routed_kw` /
        `shared_kw`: the architecture's activation / GEMM blocks for numerics.qlinear."""
        y = torch.zeros_like(x)
        lim = self.cfg.swiglu_limit
        for e in torch.unique(idx).tolist():  # ascending expert order, like the reference loop
            rows, slot = torch.where(idx == e)
            # no local keeps expert e's weights past this call: a streamed layer reuses their arrays for e + 1
            y[rows] += expert(x[rows], *self.expert_weights(e), lim, num, wts[rows, slot, None], **routed_kw)
        return y + expert(x, *self.shared, lim, num, **shared_kw)

    def __call__(self, x: torch.Tensor, num: Numerics, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`image_mask` beside x's rows: image tokens select with bias_vl (§13.1)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        bias = self.bias
        # without a vision path the reference's gate has no bias_vl and routes image tokens with gate.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.reshape(-1, 1), self.bias_vl, self.bias)
        wts, idx = route(x, self.gate, bias, self.k, self.cfg, num, f"router.{self.layer_id}")
        return num.r(self.run_experts(x, wts, idx, num, {}, {})).reshape(shape)

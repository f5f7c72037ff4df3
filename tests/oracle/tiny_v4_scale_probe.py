"""An activation-scale probe for the tiny DeepSeek-V4 checkpoint: a short plain fp32 forward written for the
test (from dsv4-engine.md §5 and the mHC description) that reports the RMS of every sublayer's output and of
the residual streams, and the logits. NOT a reference: a few tokens (< 4, so no compressed group completes:
no compressor / indexer), no RoPE (it rotates pairs, the scale is unchanged), no fp8-KV or activation QDQ.
The oracle's V4 mode is the reference; this only checks that the init keeps activations O(1)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as Fn

from oracle.dsv41 import formats as F

EPS = 1e-6


def weight(t: dict, p: str) -> torch.Tensor:
    w = t[p + ".weight"]
    if w.dtype == torch.float8_e4m3fn:
        return F.fp8_dequant(w, t[p + ".scale"], (128, 128))
    if w.dtype == torch.int8:
        return F.mxfp4_dequant(w, t[p + ".scale"])
    return w.float()


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * x.pow(2).mean(-1, keepdim=True).add(EPS).rsqrt()


def norm(t: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x) * t[name].float()


def hc_pre(t: dict, pfx: str, streams: torch.Tensor, iters: int):
    """mHC: pre / post weights and the Sinkhorn comb from the RMS-normalised flat streams."""
    s, hc, d = streams.shape
    mix = rms_norm(streams.reshape(s, hc * d)) @ t[pfx + "_fn"].T
    b, sc = t[pfx + "_base"], t[pfx + "_scale"]
    pre = torch.sigmoid(mix[:, :hc] * sc[0] + b[:hc]) + EPS
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * sc[1] + b[hc:2 * hc])
    comb = torch.softmax((mix[:, 2 * hc:] * sc[2] + b[2 * hc:]).view(s, hc, hc), -1) + EPS
    comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + EPS)
    return (pre[..., None] * streams).sum(1), post, comb


def attention(t: dict, L: int, x: torch.Tensor, c: dict) -> torch.Tensor:
    a, H, hd, G = f"layers.{L}.attn", c["num_attention_heads"], c["head_dim"], c["o_groups"]
    s = x.shape[0]
    q = (norm(t, a + ".q_norm.weight", x @ weight(t, a + ".wq_a").T) @ weight(t, a + ".wq_b").T).view(s, H, hd)
    q = rms_norm(q)  # V4's per-head weight-free RMSNorm
    kv = norm(t, a + ".kv_norm.weight", x @ weight(t, a + ".wkv").T)  # one shared K = V
    scores = torch.einsum("shd,td->hst", q, kv) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    sink = t[a + ".attn_sink"].view(H, 1, 1).expand(H, s, 1)
    p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :s]
    o = torch.einsum("hst,td->shd", p, kv).reshape(s, G, H // G * hd)
    wa = weight(t, a + ".wo_a").view(G, c["o_lora_rank"], H // G * hd)
    return torch.einsum("sgk,grk->sgr", o, wa).reshape(s, -1) @ weight(t, a + ".wo_b").T


def swiglu(t: dict, p: str, x: torch.Tensor, limit: float) -> torch.Tensor:
    g = (x @ weight(t, p + ".w1").T).clamp(max=limit)
    u = (x @ weight(t, p + ".w3").T).clamp(-limit, limit)
    return (Fn.silu(g) * u) @ weight(t, p + ".w2").T


def moe(t: dict, L: int, x: torch.Tensor, ids: torch.Tensor, c: dict) -> torch.Tensor:
    f = f"layers.{L}.ffn"
    scores = Fn.softplus(x @ t[f + ".gate.weight"].float().T).sqrt()
    if f + ".gate.tid2eid" in t:
        idx = t[f + ".gate.tid2eid"][ids].long()
    else:
        idx = (scores + t[f + ".gate.bias"]).topk(c["num_experts_per_tok"], -1).indices
    w = scores.gather(-1, idx)
    w = w / w.sum(-1, keepdim=True) * c["routed_scaling_factor"]
    out = swiglu(t, f + ".shared_experts", x, c["swiglu_limit"])
    for i in range(x.shape[0]):
        for j in range(idx.shape[1]):
            out[i] += w[i, j] * swiglu(t, f"{f}.experts.{int(idx[i, j])}", x[i:i + 1], c["swiglu_limit"])[0]
    return out


def forward(t: dict, c: dict, ids: torch.Tensor):
    """-> (logits [s, V], [(sublayer, block-output RMS, stream RMS after it)])."""
    streams = t["embed.weight"][ids].float()[:, None, :].repeat(1, c["hc_mult"], 1)
    stats = []
    for L in range(c["num_hidden_layers"]):
        for kind in ("attn", "ffn"):
            x, post, comb = hc_pre(t, f"layers.{L}.hc_{kind}", streams, c["hc_sinkhorn_iters"])
            x = norm(t, f"layers.{L}.{kind}_norm.weight", x)
            y = attention(t, L, x, c) if kind == "attn" else moe(t, L, x, ids, c)
            streams = post[..., None] * y[:, None, :] + torch.einsum("sji,sjd->sid", comb, streams)
            stats.append((f"{L}.{kind}", float(y.pow(2).mean().sqrt()), float(streams.pow(2).mean().sqrt())))
    s, hc, d = streams.shape
    mix = rms_norm(streams.reshape(s, hc * d)) @ t["hc_head_fn"].T
    pre = torch.sigmoid(mix * t["hc_head_scale"] + t["hc_head_base"]) + EPS
    h = norm(t, "norm.weight", (pre[..., None] * streams).sum(1))
    return h @ t["head.weight"].float().T, stats

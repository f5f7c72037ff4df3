"""Harness-side kernel cases: seeded random inputs at tiny and production shapes (dsv41-architecture.md §2,
§20), and the oracle's exact fp32 outputs for them. Pure functions of (primitive, shape, seed).

Engine kernels take what the engine feeds them (bf16 activations, fp32 mixing parameters), so inputs are
generated in those dtypes and the oracle computes in fp32 on exactly the same values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from oracle.dsv41.attention import sparse_attn
from oracle.dsv41.hyper import hc_mixes, hc_post, hc_pre, hc_split_sinkhorn
from oracle.dsv41.numerics import Numerics
from oracle.dsv41.quant import act_quant_dequant
from oracle.dsv41.rope import apply_rope, rope_frequencies

from . import reference

FP32 = Numerics("fp32")

# Release values (§2.1): dim 5120, hc 4, 20 Sinkhorn iterations, hc_eps 1e-6, norm_eps 1e-20,
# n_heads 64, head_dim 512 (448 + 64 RoPE), window 128, index_topk 512, moe_inter_dim 2304, swiglu_limit 10.
PROD = dict(dim=5120, tokens=16, heads=64, window=128, topk=512, inter=2304, attn_tokens=4)
# Tiny (§20.1): dim 256, 8 heads, inter 128. The V4 paged-cache kernels hard-code a 512-wide head
# (448 FP8 + 64 bf16 RoPE), so the attention cases keep head_dim 512 at the tiny shape too.
TINY = dict(dim=256, tokens=5, heads=8, window=16, topk=12, inter=128, attn_tokens=3)
HC, ITERS, HC_EPS, NORM_EPS, HEAD_DIM, ROPE_DIM = 4, 20, 1e-6, 1e-20, 512, 64


@dataclass
class Case:
    case_id: str
    primitive: str
    shape: str
    seed: int
    inputs: dict[str, torch.Tensor]
    params: dict
    oracle: dict[str, torch.Tensor] = field(default_factory=dict)


def _dims(shape: str) -> dict:
    if shape == "production":
        return PROD
    if shape == "tiny":
        return TINY
    raise ValueError(f"kernel case: unknown shape {shape!r} (tiny, production)")


def _hc_params(g: torch.Generator, dim: int, n_mix: int):
    fn = torch.randn(n_mix, HC * dim, generator=g) * (HC * dim) ** -0.5
    scale = torch.rand(3, generator=g) * 0.5 + 0.25
    base = torch.randn(n_mix, generator=g) * 0.5
    return fn, scale, base


def _stream(g: torch.Generator, t: int, dim: int) -> torch.Tensor:
    # per-token magnitudes over four decades, as a residual stream has
    mag = torch.logspace(-1, 1.5, t).view(t, 1, 1)
    return (torch.randn(t, HC, dim, generator=g) * mag).to(torch.bfloat16)


# -- hyper-connections (§6.4, §9) -------------------------------------------------------------------------

def make_hc_pre(shape, g):
    d = _dims(shape)
    fn, scale, base = _hc_params(g, d["dim"], (2 + HC) * HC)
    x = _stream(g, d["tokens"], d["dim"])
    return dict(x=x, fn=fn, scale=scale, base=base), dict(hc=HC, iters=ITERS, norm_eps=NORM_EPS, hc_eps=HC_EPS)


def oracle_hc_pre(i, p):
    x = i["x"].float()
    pre, post, comb = hc_mixes(x, i["fn"], i["scale"], i["base"], p["hc"], p["iters"], p["hc_eps"], p["norm_eps"])
    return dict(y=hc_pre(x, pre, FP32), post=post, comb=comb)


def make_hc_post(shape, g):
    d = _dims(shape)
    t = d["tokens"]
    mixes = torch.randn(t, (2 + HC) * HC, generator=g)
    _, post, comb = hc_split_sinkhorn(mixes, torch.ones(3), torch.zeros((2 + HC) * HC), HC, ITERS, HC_EPS)
    f = (torch.randn(t, d["dim"], generator=g) * 3).to(torch.bfloat16)
    return dict(f=f, res=_stream(g, t, d["dim"]), post=post.contiguous(), comb=comb.contiguous()), dict(hc=HC)


def oracle_hc_post(i, p):
    return dict(out=hc_post(i["f"].float(), i["res"].float(), i["post"], i["comb"], FP32))


def make_hc_head(shape, g):
    d = _dims(shape)
    fn, scale, base = _hc_params(g, d["dim"], HC)
    return dict(x=_stream(g, d["tokens"], d["dim"]), fn=fn, scale=scale[:1].contiguous(), base=base), \
        dict(norm_eps=NORM_EPS, hc_eps=HC_EPS)


def oracle_hc_head(i, p):
    return dict(y=reference.hc_head(i["x"].float(), i["fn"], i["scale"], i["base"], p["norm_eps"], p["hc_eps"]))


# -- RMSNorm (§5.1), clamped SwiGLU (§13.2) ------------------------------------------------------------------

def make_rmsnorm(shape, g):
    d = _dims(shape)
    x = (torch.randn(d["tokens"], d["dim"], generator=g) * torch.logspace(-2, 2, d["tokens"]).view(-1, 1))
    w = 1 + 0.2 * torch.randn(d["dim"], generator=g)
    return dict(x=x.to(torch.bfloat16), weight=w.to(torch.bfloat16)), dict(eps=NORM_EPS)


def oracle_rmsnorm(i, p):
    return dict(out=FP32.rmsnorm(i["x"].float(), i["weight"].float(), p["eps"]))


def make_swiglu(shape, g):
    d = _dims(shape)
    # scale 6: a good share of both branches beyond +-10, so both clamps are exercised
    return dict(x=(torch.randn(d["tokens"], 2 * d["inter"], generator=g) * 6).to(torch.bfloat16)), dict(limit=10.0)


def oracle_swiglu(i, p):
    return dict(out=reference.swiglu_clamp(i["x"], p["limit"]))


# -- FP8 KV cache rows, RoPE tables ---------------------------------------------------------------------------

def _fp8_ds_mla_rows(g: torch.Generator, n: int) -> torch.Tensor:
    """KV rows exactly representable in the V4 fp8_ds_mla cache: 7 blocks of 64 e4m3 values times a
    power-of-two scale (448 NoPE channels) + 64 bf16 RoPE channels. fp32 [n, 512]."""
    raw = torch.randn(n, 448, generator=g) * torch.logspace(-2, 1, n).view(-1, 1)
    nope = act_quant_dequant(raw, 64)  # exact e4m3 * 2^k per 64-block
    rope = (torch.randn(n, ROPE_DIM, generator=g)).to(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1)


def _cos_sin(max_pos: int) -> torch.Tensor:
    """GPT-J cos/sin table [max_pos, 64] = [cos | sin] from the oracle's fp32 frequencies and angles (§10)."""
    freqs = rope_frequencies(ROPE_DIM, 10000.0)
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float32), freqs)
    return torch.cat([ang.cos(), ang.sin()], dim=-1).contiguous()


def _cis(cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cs = cos_sin[positions]
    return torch.complex(cs[:, :ROPE_DIM // 2], cs[:, ROPE_DIM // 2:])


# -- sparse attention with sink (§6.3) -----------------------------------------------------------------------

def make_sparse_attn(shape, g):
    d = _dims(shape)
    t, h, nw, nc = d["attn_tokens"], d["heads"], d["window"] + d["attn_tokens"], 2 * d["topk"]
    q = (torch.randn(t, h, HEAD_DIM, generator=g) * 0.5).to(torch.bfloat16)
    kv_win, kv_comp = _fp8_ds_mla_rows(g, nw), _fp8_ds_mla_rows(g, nc)
    kw, kc = d["window"], d["topk"]
    idx_win = torch.stack([torch.randperm(nw, generator=g)[:kw] for _ in range(t)])
    idx_comp = torch.stack([torch.randperm(nc, generator=g)[:kc] for _ in range(t)])
    idx_win[0, kw // 2:] = -1  # a partly filled window
    idx_comp[0, kc // 3:] = -1
    if t > 2:
        idx_win[-1, :] = -1  # a row with no key at all: output 0
        idx_comp[-1, :] = -1
    sink = torch.randn(h, generator=g)
    return dict(q=q, kv_win=kv_win, kv_comp=kv_comp, idx_win=idx_win, idx_comp=idx_comp, sink=sink), \
        dict(scale=HEAD_DIM ** -0.5, win_block=16, comp_block=8)


def oracle_sparse_attn(i, p):
    nw = i["kv_win"].shape[0]
    kv = torch.cat([i["kv_win"], i["kv_comp"]], 0).unsqueeze(0)
    comp = torch.where(i["idx_comp"] >= 0, i["idx_comp"] + nw, -1)
    idx = torch.cat([i["idx_win"], comp], -1).unsqueeze(0)
    return dict(out=sparse_attn(i["q"].float().unsqueeze(0), kv, i["sink"], idx, p["scale"], FP32)[0])


# -- KV insert: FP8 act_quant (V4 layout, B = 64 over the 448 NoPE channels), RoPE, per-head q norm ---------

def make_kv_insert(shape, g):
    d = _dims(shape)
    t, h = d["tokens"], d["heads"]
    q = torch.randn(t, h, HEAD_DIM, generator=g).to(torch.bfloat16)
    kv = torch.randn(t, HEAD_DIM, generator=g) * torch.logspace(-4, 3, t).view(-1, 1)
    kv[0, :64] = 0  # all-zero block: amax floors to 1e-4
    kv[1, :64] = 448.0 * 2.0**-3  # amax * (1/448) is exactly a power of two: no bump
    kv[1, 64:128] = 448.0 * 2.0**-3 * (1 + 2**-7)  # one bf16 ulp above: the scale doubles
    positions = torch.randint(0, 4096, (t,), generator=g)
    positions[0] = 0
    return dict(q=q, kv=kv.to(torch.bfloat16), positions=positions, cos_sin=_cos_sin(4096)), \
        dict(q_eps=1e-6, block=16)


def oracle_kv_insert(i, p):
    kv, cis = i["kv"].float(), _cis(i["cos_sin"], i["positions"])
    nope = act_quant_dequant(kv[:, :448], 64, "ue8m0")
    rope = apply_rope(kv.unsqueeze(0), cis)[0, :, -ROPE_DIM:]
    q = reference.rmsnorm_noweight(i["q"].float(), p["q_eps"])
    q = apply_rope(q.unsqueeze(0), cis)[0]
    return dict(q_out=q, kv_nope=nope, kv_rope=rope)


PRIMITIVES: dict[str, tuple[Callable, Callable]] = {
    "hc_pre": (make_hc_pre, oracle_hc_pre),
    "hc_post": (make_hc_post, oracle_hc_post),
    "hc_head": (make_hc_head, oracle_hc_head),
    "rmsnorm": (make_rmsnorm, oracle_rmsnorm),
    "swiglu_clamp": (make_swiglu, oracle_swiglu),
    "sparse_attn": (make_sparse_attn, oracle_sparse_attn),
    "kv_insert_act_quant": (make_kv_insert, oracle_kv_insert),
}


def build_case(primitive: str, shape: str, seed: int = 0, case_id: str | None = None) -> Case:
    if primitive not in PRIMITIVES:
        raise KeyError(f"kernel case: no oracle primitive {primitive!r} (known: {sorted(PRIMITIVES)})")
    make, oracle = PRIMITIVES[primitive]
    g = torch.Generator().manual_seed(seed)
    inputs, params = make(shape, g)
    inputs = {k: v.contiguous() for k, v in inputs.items()}
    case = Case(case_id or f"{primitive}.{shape}.{seed}", primitive, shape, seed, inputs, params)
    with torch.no_grad():
        case.oracle = {k: v.contiguous() for k, v in oracle(inputs, params).items()}
    return case

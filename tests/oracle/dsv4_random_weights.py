"""A small DeepSeek-V4 config and random fp32 weights for it, keyed by the V4 checkpoint names
(inventory.inventory_v4), for the module and model tests of the V4 mode.

Scales are trained-like rather than tiny-random (dsv4-engine.md §4: tiny random weights make mHC's comb
uniform and hide bugs): linears gain ~1 (std fan_in^-1/2), norm weights 1 ± 20 %, mHC fn/base/scale so that
pre/post/comb are far from uniform, attention sinks ~N(0, 1), ape ~N(0, 0.5²) (it must matter), biases
~N(0, 0.1²); every value is representable in bf16, as the checkpoint stores it."""

from __future__ import annotations

import torch

from oracle.dsv41.inventory import inventory_v4
from oracle.dsv41.config import ModelConfig


def small_v4_config(**overrides) -> ModelConfig:
    """Every V4 feature at test size: window-only, CSA (ratio 4, indexer) and a plainly pooled layer
    (ratio 8 standing in for 128, so that groups complete within a short test), one hash layer, top-k
    selection that prunes (index_topk 3 < compressed entries), a window of 8 that a 30-token run leaves."""
    v = dict(arch="v4", vocab_size=96, dim=128, moe_inter_dim=128, n_layers=4, n_mtp_layers=1,
             n_heads=4, head_dim=80, rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=64,
             window_size=8, norm_eps=1e-6, n_routed_experts=8, n_activated_experts=2, n_hash_layers=1,
             compress_ratios=(4, 8, 0, 4, 0), kv_source_layers=(), index_source_layers=(),
             candidate_source_layer=-1, index_n_heads=4, index_head_dim=32, index_topk=3,
             original_seq_len=64, rope_factor=4.0, engram_layer_ids=(), engram_num_embeddings=(),
             dspark_block_size=0, dspark_target_layer_ids=(), vision_n_layers=0, max_seq_len=256)
    v.update(overrides)
    return ModelConfig(**v)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def random_weights_v4(cfg: ModelConfig, seed: int = 0, with_mtp: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inv = inventory_v4(cfg)
    w: dict[str, torch.Tensor] = {}

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    for p, spec in inv.linears.items():
        if not with_mtp and p.startswith("mtp."):
            continue
        w[p + ".weight"] = _bf16(randn(spec.out, spec.in_, std=spec.in_ ** -0.5))
    for name, spec in inv.tensors.items():
        if not with_mtp and name.startswith("mtp."):
            continue
        shape = spec.shape
        if name.endswith("tid2eid"):
            w[name] = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:shape[1]]
                                   for _ in range(shape[0])]).float()
        elif name.endswith("norm.weight"):
            w[name] = _bf16(1 + 0.2 * (2 * torch.rand(*shape, generator=g) - 1))
        elif name.endswith("_fn"):
            w[name] = randn(*shape, std=0.5 * shape[-1] ** -0.5)
        elif name.endswith("_scale"):
            w[name] = 1 + 0.5 * torch.rand(*shape, generator=g)
        elif name.endswith("_base"):
            w[name] = randn(*shape, std=1.0)
        elif name.endswith("attn_sink"):
            w[name] = randn(*shape)
        elif name.endswith(".ape"):
            w[name] = randn(*shape, std=0.5)
        elif name.endswith("gate.bias"):
            w[name] = randn(*shape, std=0.1)
        elif name == "embed.weight":
            w[name] = _bf16(randn(*shape))
        else:
            raise AssertionError(f"no rule for {name}")
    return w

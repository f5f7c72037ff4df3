"""Random DeepSeek-V4.1 checkpoints in the real tensor names and formats (dsv41-architecture.md §20).

``write_tiny_checkpoint(out_dir, seed=0, config_overrides=None)`` writes the §20.1 tiny model (or a larger one
through overrides): FP8 e4m3 dense linears with E8M0 32x32 power-of-two block scales, MXFP4 routed experts,
BF16 / F32 tensors, FP8 Engram tables with 1x32 row scales, ``config.json`` and the shard index.
``write_tiny_exl3_pack(ckpt_dir, out_dir, seed=0)`` writes an EXL3 pack over it: routed experts with mixed K
and codebooks per expert, and its ``exl3_moe_plan.json``. Weight statistics follow §20.5.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.atomic import atomic_path, atomic_write_text

from . import formats as F
from .checkpoint import PLAN_NAME, Checkpoint
from .engram import engram_prime_rows
from .arch import expected_inventory
from .shard_io import INDEX_NAME
from .config import V4_ONLY_FIELDS, ModelConfig
from .quant import e4m3_rne, pow2ceil

FP8_BLOCK = (32, 32)
# beside config.json, not inside it: the reference refuses config keys it does not define
TINY_MARKER = "ds41_tiny.json"
# §20.5 (from the released checkpoint's statistics): projection gains, norm-weight means, embedding RMS
_GAINS = {"attn.wq_a": 1.6, "attn.wq_b": 0.95, "attn.wkv": 1.8, "attn.wo_a": 1.6, "attn.wo_b": 1.9,
          "ffn.gate": 2.9, "w1": 1.5, "w3": 1.5, "w2": 1.05}
_NORM_MEANS = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
               "k_norm": 0.5}
EMBED_RMS = 0.12
# vision tower / aligner biases: no released statistic in §20.5; small against the unit-scale activations
# the tower's pre-norm blocks see (own choice)
VISION_BIAS_STD = 0.02
# §20.6's tiny ViT, plus the sizes a tiny vocabulary needs: image_token_id inside it (510; 511 is the DSpark
# noise token), no minimum pixel count (small test images keep their size), a span budget of 64 positions
TINY_VISION_OVERRIDES = {"vision_n_layers": 2, "vision_dim": 64, "vision_n_heads": 4, "vision_inter_dim": 128,
                         "vision_patch_size": 14, "vision_downsample_ratio": 3, "image_token_id": 510,
                         "vision_min_pixels": 0, "vision_max_n_token": 64}
FP4_RMS = 3.2
ENGRAM_RMS = 0.12  # not given by §20.5; an embedding-like table, so the embedding RMS (own choice)


def _gain(prefix: str) -> float:
    if prefix.startswith(("vision.", "aligner.")):  # §20.5's gains are the LLM's; the tower's linears gain 1
        return 1.0
    for key, g in _GAINS.items():
        if prefix.endswith("." + key) and not (key == "attn.wq_b" and ".indexer." in prefix):
            return g
    return 1.0


def _gen(seed: int, name: str) -> torch.Generator:
    """One independent stream per tensor, so a tensor's values depend only on (seed, name)."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.Generator().manual_seed(h)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] -> (e4m3 bytes [R, C], e8m0 bytes [ceil(R/br), ceil(C/bc)]) with power-of-two scales."""
    (R, C), (br, bc) = w.shape, block
    sr, sc = math.ceil(R / br), math.ceil(C / bc)
    padded = torch.zeros(sr * br, sc * bc)
    padded[:R, :C] = w
    amax = padded.view(sr, br, sc, bc).abs().amax(dim=(1, 3)).clamp(min=1e-30)
    s = pow2ceil(amax * torch.tensor(1 / 448, dtype=torch.float32))  # largest |q| <= 448
    q = e4m3_rne(padded.view(sr, br, sc, bc) / s[:, None, :, None]).view(sr * br, sc * bc)[:R, :C]
    s_bytes = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # 2^k -> e8m0 byte k + 127
    return q.to(torch.float8_e4m3fn).view(torch.uint8), s_bytes


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


def _atomic_json(obj, path: Path) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


class _ShardWriter:
    def __init__(self, out_dir: Path, shard_bytes: int):
        self.dir, self.limit = out_dir, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.n = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.pending[name] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.n += 1
        fn = f"model-{self.n:05d}.safetensors"
        _atomic_save(self.pending, self.dir / fn)
        self.weight_map.update({k: fn for k in self.pending})
        self.total += self.size
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        _atomic_json({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))},
                     self.dir / INDEX_NAME)


def _prepare_out(out_dir) -> Path:
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; refusing to write a checkpoint into it")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _draw_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A non-linear tensor's fp32 values by §20.5 (before its storage rounding)."""
    g = _gen(seed, name)
    if name == "embed.weight":
        return torch.randn(shape, generator=g) * EMBED_RMS
    if len(shape) == 2:  # hc_*_fn, Engram q/k weights: "other matrices gain 1"
        return torch.randn(shape, generator=g) * shape[1] ** -0.5
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        key = next((k for k in _NORM_MEANS if name.endswith(f".{k}.weight")), None)
        return _NORM_MEANS.get(key, 1.0) * (1 + 0.1 * torch.randn(shape, generator=g))
    if name.startswith(("vision.", "aligner.")):  # Linear biases
        return VISION_BIAS_STD * torch.randn(shape, generator=g)
    if name.startswith("image_"):  # learned span markers, rows of the embedding space
        return torch.randn(shape, generator=g) * EMBED_RMS
    return 0.5 * torch.randn(shape, generator=g)  # hc bases / scales, attn_sink, gate biases


def _draw_bf16_linear(prefix: str, out: int, in_: int, seed: int) -> torch.Tensor:
    std = _gain(prefix) * in_ ** -0.5
    return (torch.randn(out, in_, generator=_gen(seed, prefix)) * std).to(torch.bfloat16)


def random_vision_weights(cfg: ModelConfig, seed: int, prefix: str) -> dict[str, torch.Tensor]:
    """fp32 values of the vision / aligner tensors under `prefix` (e.g. "vision.blocks.7."), exactly as
    `write_tiny_checkpoint` stores them (bf16 weights, fp32 of bf16 norm weights) - without writing a
    checkpoint, so a release-size tower can be drawn one block at a time."""
    inv = expected_inventory(cfg)
    out = {f"{p}.weight": _draw_bf16_linear(p, s.out, s.in_, seed).float()
           for p, s in inv.linears.items() if (p + ".").startswith(prefix)}
    out.update({n: _draw_tensor(n, s.shape, seed).to(torch.bfloat16).float()
                for n, s in inv.tensors.items() if n.startswith(prefix)})
    if not out:
        raise KeyError(f"random_vision_weights: no tensor under {prefix!r} (vision_n_layers {cfg.vision_n_layers})")
    return out


def tiny_config(config_overrides: dict | None = None) -> ModelConfig:
    """§20.1 values with overrides; Engram table rows follow the primes unless given explicitly (§8.2)."""
    overrides = dict(config_overrides or {})
    cfg = ModelConfig.tiny(**{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})
    if "engram_num_embeddings" not in overrides:
        cfg = cfg.replace(engram_num_embeddings=tuple(engram_prime_rows(cfg)))
    return cfg


def write_tiny_checkpoint(out_dir, seed: int = 0, config_overrides: dict | None = None,
                          shard_bytes: int = 4 << 20) -> Path:
    """Write a seeded random DeepSeek-V4.1 checkpoint in the real format; returns ``out_dir``."""
    cfg = tiny_config(config_overrides)
    inv = expected_inventory(cfg)
    problems = [f"{p}: input dim {s.in_} is not a multiple of 32 (§20.4)"
                for p, s in inv.linears.items() if s.storage != "bf16" and s.in_ % 32]
    problems += [f"{p}: width {t.width} is not a multiple of 32" for p, t in inv.tables.items() if t.width % 32]
    if problems:
        raise ValueError("tiny config violates format constraints: " + "; ".join(problems))
    out = _prepare_out(out_dir)
    shards = _ShardWriter(out, shard_bytes)
    for p, spec in sorted(inv.linears.items()):
        g = _gen(seed, p)
        std = _gain(p) * spec.in_ ** -0.5
        if spec.storage == "fp8":
            w, s = quantize_fp8_blocks(torch.randn(spec.out, spec.in_, generator=g) * std, FP8_BLOCK)
            shards.add(f"{p}.weight", w.view(torch.float8_e4m3fn))
            shards.add(f"{p}.scale", s.view(torch.float8_e8m0fnu))
        elif spec.storage == "fp4":
            # codes uniform, per-32 scale exponent round(log2(std / 3.2)) jittered by -1/0/+1 (§20.5)
            codes = torch.randint(0, 16, (spec.out, spec.in_), generator=g, dtype=torch.uint8)
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # low nibble first (§5.1)
            e = round(math.log2(std / FP4_RMS)) + torch.randint(-1, 2, (spec.out, spec.in_ // 32), generator=g)
            shards.add(f"{p}.weight", packed.view(torch.int8))
            shards.add(f"{p}.scale", (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu))
        else:
            shards.add(f"{p}.weight", _draw_bf16_linear(p, spec.out, spec.in_, seed))
    for name, spec in sorted(inv.tensors.items()):
        shards.add(name, _draw_tensor(name, spec.shape, seed).to(
            torch.bfloat16 if spec.dtype == "BF16" else torch.float32))
    for p, spec in sorted(inv.tables.items()):
        rows = torch.randn(spec.rows, spec.width, generator=_gen(seed, p)) * ENGRAM_RMS
        w, s = quantize_fp8_blocks(rows, (1, 32))  # per-row 1x32 scales (weight-formats.md §6)
        shards.add(f"{p}.weight", w.view(torch.float8_e4m3fn))
        shards.add(f"{p}.scale", s.view(torch.float8_e8m0fnu))
    shards.finish()
    # config.json in the inference form the reference reads as ModelArgs(**config): only its keys (an unknown
    # key is a TypeError there); the FP8 block is its module constant 32. Greedy (temperature 0), because
    # the reference samples from its logits at any other temperature.
    # (the V4 fields of ModelConfig are not ModelArgs keys of V4.1: left out)
    config = {k: v for k, v in dataclasses.asdict(cfg.replace(temperature=0.0)).items()
              if k != "extra" and k not in V4_ONLY_FIELDS}
    _atomic_json(config, out / "config.json")
    _atomic_json({"seed": seed, "overrides": config_overrides or {}}, out / TINY_MARKER)
    return out


def is_tiny_checkpoint(ckpt_dir) -> bool:
    """A checkpoint written by ``write_tiny_checkpoint`` (its Engram hash uses the stub token map, §20.1)."""
    return (Path(ckpt_dir) / TINY_MARKER).is_file()


def _codebook_rms(cb: int) -> float:
    return float(F.codebook_table(cb).float().pow(2).mean().sqrt())


def write_tiny_exl3_pack(ckpt_dir, out_dir, seed: int = 0, layers=None,
                         k_choices=(2, 3, 4, 5, 6, 7, 8), codebooks=(0, 1, 2)) -> Path:
    """An EXL3 pack over a tiny checkpoint: every routed expert of ``layers`` (default all backbone layers)
    as random EXL3 trellises with K and codebook varying per expert (mixed K, §7.10), plus
    ``exl3_moe_plan.json`` and a ``config.json`` declaring the non-routed weights as source FP8."""
    ck = Checkpoint(ckpt_dir)
    cfg = ck.model_config
    layers = list(range(cfg.n_layers)) if layers is None else list(layers)
    for k in k_choices:
        if k != int(k) or not 1 <= k <= 8:
            raise ValueError(f"k_choices: {k} is not an integer K in 1..8 (a plan digit)")
    out = _prepare_out(out_dir)
    shards = _ShardWriter(out, 4 << 20)
    plan = {}
    for L in layers:
        n_exp, _ = cfg.moe_experts(L)
        digits = ""
        for e in range(n_exp):
            K = int(k_choices[(e + L) % len(k_choices)])
            cb = codebooks[(e + 2 * L) % len(codebooks)]
            digits += str(K)
            for w in ("w1", "w2", "w3"):
                p = f"layers.{L}.ffn.experts.{e}.{w}"
                spec = ck.inventory.linears[p]
                if spec.in_ % 128 or spec.out % 128:
                    raise ValueError(f"{p}: EXL3 needs dimensions that are multiples of 128, got "
                                     f"{[spec.out, spec.in_]} (§20.4)")
                g = _gen(seed, "exl3:" + p)
                shards.add(f"{p}.trellis", torch.randint(-2**15, 2**15, (spec.in_ // 16, spec.out // 16, 16 * K),
                                                         generator=g, dtype=torch.int16))
                # W rms ~ rms(W_hat) * rms(suh) * rms(svh); E[exp(0.6 N)] = exp(0.18)
                std = _gain(p) * spec.in_ ** -0.5 / (_codebook_rms(cb) * math.exp(0.18))
                sign = lambda n: torch.randint(0, 2, (n,), generator=g) * 2 - 1  # noqa: E731
                shards.add(f"{p}.suh", (sign(spec.in_) * torch.exp(0.3 * torch.randn(spec.in_, generator=g)))
                           .to(torch.float16))
                shards.add(f"{p}.svh", (sign(spec.out) * std * torch.exp(0.3 * torch.randn(spec.out, generator=g)))
                           .to(torch.float16))
                if cb == 1:
                    shards.add(f"{p}.mcg", torch.tensor(F.MCG_MARKER, dtype=torch.int32))
                elif cb == 2:
                    shards.add(f"{p}.mul1", torch.tensor(F.MUL1_MARKER, dtype=torch.int32))
        plan[str(L)] = digits
    shards.finish()
    _atomic_json({"format": "exl3_moe_plan (ds41-gates tiny)", "layers": plan}, out / PLAN_NAME)
    config = dict(ck.config)
    config["quantization_config"] = {
        "quant_method": "exl3", "routed_experts": "exl3", "mtp_experts": "source",
        "non_routed_quantization": {"quant_method": "deepseek_v4_fp8", "weight_block_size": list(ck.fp8_block)}}
    _atomic_json(config, out / "config.json")
    return out

"""The tensor inventory of an official DeepSeek checkpoint, derived from its configuration alone
(dsv41-architecture.md §4.2, §4.3 for V4.1; dsv4-engine.md §2, §5 for V4): every linear with its logical shape
and storage, every other tensor with its shape and dtype, and the Engram tables. Pure functions of the config:
the loader (checkpoint.py) validates a folder against them, the tiny writers (tiny.py) write them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import ModelConfig


@dataclass(frozen=True)
class LinearSpec:
    out: int
    in_: int
    storage: str  # official storage: "fp8" (e4m3 + 32x32 e8m0), "fp4" (MXFP4), "bf16"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TableSpec:  # Engram table: {p}.weight F8_E4M3 [rows, width] + {p}.scale F8_E8M0 [rows, width/32]
    rows: int
    width: int


@dataclass
class Inventory:
    linears: dict[str, LinearSpec]
    tensors: dict[str, TensorSpec]
    tables: dict[str, TableSpec]
    # accepted and loaded when present, not required: gate.bias_vl of a vision-off configuration (the release
    # ships it; a checkpoint written for the reference's vision-off model has none)
    optional: dict[str, TensorSpec] = field(default_factory=dict)

    def official_tensors(self, block: tuple[int, int]) -> dict[str, TensorSpec]:
        """Tensor name -> spec of the official storage of every tensor (§4.2, §4.3)."""
        br, bc = block
        out = dict(self.tensors)
        for p, s in self.linears.items():
            if s.storage == "fp8":
                out[f"{p}.weight"] = TensorSpec((s.out, s.in_), "F8_E4M3")
                out[f"{p}.scale"] = TensorSpec((math.ceil(s.out / br), math.ceil(s.in_ / bc)), "F8_E8M0")
            elif s.storage == "fp4":
                out[f"{p}.weight"] = TensorSpec((s.out, s.in_ // 2), "I8")
                out[f"{p}.scale"] = TensorSpec((s.out, s.in_ // 32), "F8_E8M0")
            else:
                out[f"{p}.weight"] = TensorSpec((s.out, s.in_), "BF16")
        for p, t in self.tables.items():
            out[f"{p}.weight"] = TensorSpec((t.rows, t.width), "F8_E4M3")
            out[f"{p}.scale"] = TensorSpec((t.rows, t.width // 32), "F8_E8M0")
        return out


def block_core_specs(cfg: ModelConfig, p: str, lin: dict[str, LinearSpec], ten: dict[str, TensorSpec]) -> str:
    """The tensors every V4 and V4.1 block has (hyper-connection mixes, the two norms, the MLA projections);
    returns the block's attention prefix for the version-specific rest."""
    d, hc = cfg.dim, cfg.hc_mult
    for hc_name in ("attn", "ffn"):
        ten[f"{p}.hc_{hc_name}_fn"] = TensorSpec((cfg.mix_hc, hc * d), "F32")
        ten[f"{p}.hc_{hc_name}_base"] = TensorSpec((cfg.mix_hc,), "F32")
        ten[f"{p}.hc_{hc_name}_scale"] = TensorSpec((3,), "F32")
    ten[f"{p}.attn_norm.weight"] = TensorSpec((d,), "BF16")
    ten[f"{p}.ffn_norm.weight"] = TensorSpec((d,), "BF16")
    a = f"{p}.attn"
    ten[f"{a}.attn_sink"] = TensorSpec((cfg.n_heads,), "F32")
    hd_all = cfg.n_heads * cfg.head_dim
    lin[f"{a}.wq_a"] = LinearSpec(cfg.q_lora_rank, d, "fp8")
    ten[f"{a}.q_norm.weight"] = TensorSpec((cfg.q_lora_rank,), "BF16")
    lin[f"{a}.wq_b"] = LinearSpec(hd_all, cfg.q_lora_rank, "fp8")
    lin[f"{a}.wkv"] = LinearSpec(cfg.head_dim, d, "fp8")
    ten[f"{a}.kv_norm.weight"] = TensorSpec((cfg.head_dim,), "BF16")
    lin[f"{a}.wo_a"] = LinearSpec(cfg.o_groups * cfg.o_lora_rank, hd_all // cfg.o_groups, "fp8")
    lin[f"{a}.wo_b"] = LinearSpec(d, cfg.o_groups * cfg.o_lora_rank, "fp8")
    return a


def inventory_v41(cfg: ModelConfig) -> Inventory:
    """Every tensor of the official DeepSeek-V4.1 checkpoint for ``cfg`` (dsv41-architecture.md §4.2, §4.3)."""
    d, hc = cfg.dim, cfg.hc_mult
    lin: dict[str, LinearSpec] = {}
    ten: dict[str, TensorSpec] = {}
    opt: dict[str, TensorSpec] = {}
    tab: dict[str, TableSpec] = {}

    def block(p: str, L: int, backbone: bool):
        a = block_core_specs(cfg, p, lin, ten)
        if backbone and cfg.is_kv_source(L):
            lin[f"{a}.compressor.wkv"] = LinearSpec(cfg.head_dim, d, "bf16")
            if cfg.ratio(L) == 2:
                lin[f"{a}.compressor.wgate"] = LinearSpec(cfg.head_dim, d, "bf16")
            ten[f"{a}.compressor.norm.weight"] = TensorSpec((cfg.head_dim,), "BF16")
            lin[f"{a}.indexer.wk"] = LinearSpec(cfg.index_head_dim, cfg.head_dim, "bf16")
            ten[f"{a}.indexer.k_norm.weight"] = TensorSpec((cfg.index_head_dim,), "BF16")
        if backbone and cfg.is_index_source(L):
            lin[f"{a}.indexer.wq_b"] = LinearSpec(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, "fp8")
            lin[f"{a}.indexer.weights_proj"] = LinearSpec(cfg.index_n_heads, d, "bf16")
        f = f"{p}.ffn"
        n_exp, _ = cfg.moe_experts(L)
        lin[f"{f}.gate"] = LinearSpec(n_exp, d, "bf16")
        ten[f"{f}.gate.bias"] = TensorSpec((n_exp,), "F32")
        if cfg.vision_n_layers > 0:  # the reference defines gate.bias_vl only with the vision path on
            ten[f"{f}.gate.bias_vl"] = TensorSpec((n_exp,), "F32")
        else:
            opt[f"{f}.gate.bias_vl"] = TensorSpec((n_exp,), "F32")
        inter = cfg.moe_inter_dim
        for e in range(n_exp):
            lin[f"{f}.experts.{e}.w1"] = LinearSpec(inter, d, "fp4")
            lin[f"{f}.experts.{e}.w3"] = LinearSpec(inter, d, "fp4")
            lin[f"{f}.experts.{e}.w2"] = LinearSpec(d, inter, "fp4")
        sh = inter * cfg.n_shared_experts
        lin[f"{f}.shared_experts.w1"] = LinearSpec(sh, d, "fp8")
        lin[f"{f}.shared_experts.w3"] = LinearSpec(sh, d, "fp8")
        lin[f"{f}.shared_experts.w2"] = LinearSpec(d, sh, "fp8")
        if backbone and L in cfg.engram_layer_ids:
            e_ = f"{p}.engram"
            rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(L)]
            tab[f"{e_}.embed"] = TableSpec(rows, cfg.engram_head_dim)
            n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            lin[f"{e_}.wkv"] = LinearSpec(d * (hc + 1), n_cols * cfg.engram_head_dim, "fp8")
            ten[f"{e_}.q_weight"] = TensorSpec((hc, d), "BF16")
            ten[f"{e_}.k_weight"] = TensorSpec((hc, d), "BF16")

    for L in range(cfg.n_layers):
        block(f"layers.{L}", L, True)
    for S in range(cfg.n_mtp_layers):
        block(f"mtp.{S}", cfg.n_layers + S, False)
    if cfg.n_mtp_layers:  # DSpark extras (§4.3, §15)
        lin["mtp.0.main_proj"] = LinearSpec(d, d * len(cfg.dspark_target_layer_ids), "fp8")
        ten["mtp.0.main_norm.weight"] = TensorSpec((d,), "BF16")
        last, r = f"mtp.{cfg.n_mtp_layers - 1}", cfg.dspark_markov_rank
        ten[f"{last}.norm.weight"] = TensorSpec((d,), "BF16")
        lin[f"{last}.markov_head.embed"] = LinearSpec(cfg.vocab_size, r, "bf16")
        lin[f"{last}.markov_head.head"] = LinearSpec(cfg.vocab_size, r, "bf16")
        lin[f"{last}.confidence_head.proj"] = LinearSpec(1, d + r, "bf16")
    ten["embed.weight"] = TensorSpec((cfg.vocab_size, d), "BF16")
    lin["head"] = LinearSpec(cfg.vocab_size, d, "bf16")
    ten["norm.weight"] = TensorSpec((d,), "BF16")
    if cfg.vision_n_layers:
        vd, vi, ps, ds = cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size, cfg.vision_downsample_ratio
        lin["vision.patch_embed.proj"] = LinearSpec(vd, 3 * ps * ps, "bf16")
        ten["vision.patch_embed.proj.bias"] = TensorSpec((vd,), "BF16")
        for n in range(cfg.vision_n_layers):
            b = f"vision.blocks.{n}"
            ten[f"{b}.norm1.weight"] = TensorSpec((vd,), "BF16")
            ten[f"{b}.norm2.weight"] = TensorSpec((vd,), "BF16")
            lin[f"{b}.attn.wqkv"] = LinearSpec(3 * vd, vd, "bf16")
            ten[f"{b}.attn.wqkv.bias"] = TensorSpec((3 * vd,), "BF16")
            lin[f"{b}.attn.wo"] = LinearSpec(vd, vd, "bf16")
            ten[f"{b}.attn.wo.bias"] = TensorSpec((vd,), "BF16")
            lin[f"{b}.mlp.w1"] = LinearSpec(2 * vi, vd, "bf16")
            lin[f"{b}.mlp.w2"] = LinearSpec(vd, vi, "bf16")
        ten["vision.norm.weight"] = TensorSpec((vd,), "BF16")
        lin["aligner.w1"] = LinearSpec(d, vd * ds * ds, "bf16")
        ten["aligner.w1.bias"] = TensorSpec((d,), "BF16")
        lin["aligner.w2"] = LinearSpec(d, d, "bf16")
        ten["aligner.w2.bias"] = TensorSpec((d,), "BF16")
        for n in ("image_start", "image_end", "image_newline"):
            ten[n] = TensorSpec((d,), "BF16")
    return Inventory(lin, ten, tab, opt)


def inventory_v4(cfg: ModelConfig) -> Inventory:
    """Every tensor of a DeepSeek-V4 (Flash) checkpoint for ``cfg``: the names of the V4 reference's modules
    (dsv4-engine.md §2, §5), which the release's index uses. Per layer: mHC (hc_attn_*, hc_ffn_*), attention
    (FP8 wq_a/wq_b/wkv/wo_a/wo_b, norms, attn_sink), a compressor with ``ape`` on every compressed layer, an
    indexer with its own compressor on ratio-4 layers, the MoE gate (``tid2eid`` on hash layers, ``bias``
    elsewhere), routed experts (``expert_dtype``: fp4 or fp8) and the FP8 shared expert; at the top the
    embedding, final norm, head and ``hc_head_*``; per MTP layer a block plus e_proj/h_proj, enorm/hnorm,
    norm and its own ``hc_head_*`` — or, with ``dspark_block_size``, V4-Flash's DSpark drafter: compressor-less
    blocks ``mtp.S``, ``mtp.0.main_proj/main_norm``, and on the last stage ``hc_head_*``, ``norm``, the markov
    head (``markov_w1``, ``markov_w2``) and ``confidence_head.proj``."""
    d, hc = cfg.dim, cfg.hc_mult
    lin: dict[str, LinearSpec] = {}
    ten: dict[str, TensorSpec] = {}
    expert_storage = "fp4" if cfg.expert_dtype == "fp4" else "fp8"

    def compressor(p: str, ratio: int, head_dim: int):
        coff = 2 if ratio == 4 else 1
        ten[f"{p}.ape"] = TensorSpec((ratio, coff * head_dim), "F32")
        lin[f"{p}.wkv"] = LinearSpec(coff * head_dim, d, "bf16")
        lin[f"{p}.wgate"] = LinearSpec(coff * head_dim, d, "bf16")
        ten[f"{p}.norm.weight"] = TensorSpec((head_dim,), "BF16")

    def hc_head(p: str):
        ten[f"{p}hc_head_fn"] = TensorSpec((hc, hc * d), "F32")
        ten[f"{p}hc_head_base"] = TensorSpec((hc,), "F32")
        ten[f"{p}hc_head_scale"] = TensorSpec((1,), "F32")

    def block(p: str, L: int):
        a = block_core_specs(cfg, p, lin, ten)
        r = cfg.ratio(L)
        if r:
            compressor(f"{a}.compressor", r, cfg.head_dim)
        if r == 4:
            lin[f"{a}.indexer.wq_b"] = LinearSpec(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, "fp8")
            lin[f"{a}.indexer.weights_proj"] = LinearSpec(cfg.index_n_heads, d, "bf16")
            compressor(f"{a}.indexer.compressor", r, cfg.index_head_dim)
        f = f"{p}.ffn"
        lin[f"{f}.gate"] = LinearSpec(cfg.n_routed_experts, d, "bf16")
        if cfg.is_hash_layer(L):
            ten[f"{f}.gate.tid2eid"] = TensorSpec((cfg.vocab_size, cfg.n_activated_experts), "I32|I64")
        else:
            ten[f"{f}.gate.bias"] = TensorSpec((cfg.n_routed_experts,), "F32")
        inter = cfg.moe_inter_dim
        for e in range(cfg.n_routed_experts):
            lin[f"{f}.experts.{e}.w1"] = LinearSpec(inter, d, expert_storage)
            lin[f"{f}.experts.{e}.w3"] = LinearSpec(inter, d, expert_storage)
            lin[f"{f}.experts.{e}.w2"] = LinearSpec(d, inter, expert_storage)
        lin[f"{f}.shared_experts.w1"] = LinearSpec(inter, d, "fp8")
        lin[f"{f}.shared_experts.w3"] = LinearSpec(inter, d, "fp8")
        lin[f"{f}.shared_experts.w2"] = LinearSpec(d, inter, "fp8")

    for L in range(cfg.n_layers):
        block(f"layers.{L}", L)
    if cfg.dspark_block_size:  # V4-Flash's DSpark drafter, as exllamav3 reads it (dspark_v4.py)
        for S in range(cfg.n_mtp_layers):
            block(f"mtp.{S}", cfg.n_layers + S)
        lin["mtp.0.main_proj"] = LinearSpec(d, d * len(cfg.dspark_target_layer_ids), "fp8")
        ten["mtp.0.main_norm.weight"] = TensorSpec((d,), "BF16")
        last, r = f"mtp.{cfg.n_mtp_layers - 1}", cfg.dspark_markov_rank
        hc_head(f"{last}.")
        ten[f"{last}.norm.weight"] = TensorSpec((d,), "BF16")
        lin[f"{last}.markov_head.markov_w1"] = LinearSpec(cfg.vocab_size, r, "bf16")
        lin[f"{last}.markov_head.markov_w2"] = LinearSpec(cfg.vocab_size, r, "bf16")
        lin[f"{last}.confidence_head.proj"] = LinearSpec(1, d + r, "bf16")
    for S in range(0 if cfg.dspark_block_size else cfg.n_mtp_layers):
        m = f"mtp.{S}"
        block(m, cfg.n_layers + S)
        lin[f"{m}.e_proj"] = LinearSpec(d, d, "fp8")
        lin[f"{m}.h_proj"] = LinearSpec(d, d, "fp8")
        for n in ("enorm", "hnorm", "norm"):
            ten[f"{m}.{n}.weight"] = TensorSpec((d,), "BF16")
        hc_head(f"{m}.")
    ten["embed.weight"] = TensorSpec((cfg.vocab_size, d), "BF16")
    lin["head"] = LinearSpec(cfg.vocab_size, d, "bf16")
    ten["norm.weight"] = TensorSpec((d,), "BF16")
    hc_head("")
    return Inventory(lin, ten, {})

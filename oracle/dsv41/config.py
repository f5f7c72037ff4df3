"""ModelConfig for DeepSeek-V4.1-Flash (§2), read from either key spelling, plus the §20 tiny config.

The same dataclass describes a DeepSeek-V4 (Flash) checkpoint: `arch == "v4"` (dsv4-engine.md §5), decided by
the config itself (`model_type: deepseek_v4`, a `DeepseekV4*` architecture, or a V4-only key such as
`num_hash_layers`). A V4 config starts from the V4 defaults (`V4_DEFAULTS`: eps 1e-6, no Engram, one classic
MTP layer, no DSpark, no vision, no cross-layer sharing) before its own keys are applied."""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import UserError


class ConfigError(UserError, ValueError):
    """A config.json key that is unknown, of the wrong type or inconsistent; the message names it."""


@dataclass(frozen=True)
class ModelConfig:
    # sizes
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    # attention
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    norm_eps: float = 1e-20
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    # compression / indexer
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    # RoPE
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_vocab_size: int = 16000000
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # storage / runtime
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    max_seq_len: int = 4096
    max_batch_size: int = 4
    temperature: float = 1.0
    # vision (§2.1, §16): tower, aligner and image processor sizes; vision_n_layers 0 turns the path off
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: int | None = None
    image_token_id: int = 129264
    # DeepSeek-V4 (dsv4-engine.md §5): the architecture, its hash-routed first layers, the activation scale format
    arch: str = "v4.1"
    n_hash_layers: int = 0
    scale_fmt: str | None = "ue8m0"
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"config: arch {self.arch!r}: expected one of {ARCHITECTURES}")
        n_all = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n_all:
            raise ConfigError(
                f"config: compress_ratios has {len(self.compress_ratios)} entries, expected n_layers + "
                f"n_mtp_layers = {n_all}")
        if self.n_heads % self.o_groups:
            raise ConfigError(f"config: n_heads {self.n_heads} not divisible by o_groups {self.o_groups}")
        if self.rope_head_dim % 2 or self.rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ConfigError(f"config: rope_head_dim {self.rope_head_dim} must be even and <= head dims")
        if self.n_shared_experts != 1:
            raise ConfigError(f"config: n_shared_experts must be 1 (got {self.n_shared_experts})")
        if self.arch == "v4":  # each architecture's own assumptions; arch.py holds what differs in the code
            self._check_v4()
            return
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise ConfigError("config: engram_layer_ids and engram_num_embeddings differ in length")
        for L in range(self.n_layers):
            r = self.compress_ratios[L]
            if r > 0 and self.kv_source_for(L) is None:
                raise ConfigError(f"config: layer {L} (ratio {r}) has no preceding KV source of ratio {r}")
            if r > 0 and self.index_source_for(L) is None:
                raise ConfigError(f"config: layer {L} (ratio {r}) has no preceding index source")
        if self.candidate_source_layer >= 0 and self.candidate_source_layer not in self.index_source_layers:
            raise ConfigError(f"config: candidate source {self.candidate_source_layer} is not an index source")
        if self.vision_n_layers > 0:
            if self.vision_dim % self.vision_n_heads or (self.vision_dim // self.vision_n_heads) % 4:
                raise ConfigError(f"config: vision_dim {self.vision_dim} / vision_n_heads {self.vision_n_heads} "
                                  "must be a head size divisible by 4 (2-D RoPE rotates half of it, §16)")

    def _check_v4(self) -> None:
        """The V4 reference's own assumptions (dsv4-engine.md §5), named rather than computed wrongly."""
        # the reference overlaps ratio-4 windows and pools any other ratio plainly; the releases use {0, 4, 128}
        if any(r < 0 for r in self.compress_ratios):
            raise ConfigError(f"config: compress_ratios {list(self.compress_ratios)} has a negative ratio")
        if not 0 <= self.n_hash_layers <= self.n_layers:
            raise ConfigError(f"config: num_hash_layers {self.n_hash_layers} outside 0..{self.n_layers}")
        if not self.norm_topk_prob and self.score_func != "softmax":
            raise ConfigError("config: norm_topk_prob false: the DeepSeek-V4 reference always divides the routing "
                              "weights by their sum (score_func != softmax) and has no switch for it")
        if self.engram_layer_ids or self.vision_n_layers:
            raise ConfigError("config: DeepSeek-V4 has no Engram or vision path in this oracle (engram_layer_ids, "
                              "vision_n_layers must be empty / 0)")
        if self.dspark_block_size:
            self._check_v4_dspark()
        if self.gate_temp != 1.0:
            raise ConfigError("config: gate_temp is a V4.1 router setting; the DeepSeek-V4 router has none")
        if self.scale_fmt not in ("ue8m0", None):
            raise ConfigError(f"config: scale_fmt {self.scale_fmt!r}: expected 'ue8m0' or null")
        if (self.head_dim - self.rope_head_dim) % 64:
            raise ConfigError(f"config: head_dim {self.head_dim} - rope {self.rope_head_dim} is not a multiple of 64 "
                              "(the fp8 KV blocks of dsv4-engine.md §5)")
        for what, d in (("dim", self.dim), ("q_lora_rank", self.q_lora_rank), ("moe_inter_dim", self.moe_inter_dim),
                        ("o_groups * o_lora_rank", self.o_groups * self.o_lora_rank)):
            if d % 128:
                raise ConfigError(f"config: {what} = {d} is not a multiple of 128 (V4 QDQs GEMM inputs per 128)")
        if self.index_head_dim & (self.index_head_dim - 1):
            raise ConfigError(f"config: index_head_dim {self.index_head_dim} must be a power of two (Hadamard)")

    def _check_v4_dspark(self) -> None:
        """V4-Flash's DSpark drafter as exllamav3 reads it (oracle/dsv41/dspark_v4.py): compressor-less stages
        past the trunk, taps at trunk layer outputs, the trunk's expert count."""
        mtp_ratios = self.compress_ratios[self.n_layers:]
        if not self.n_mtp_layers or any(mtp_ratios):
            raise ConfigError(f"config: dspark_block_size {self.dspark_block_size} needs >= 1 MTP stage with "
                              f"compress ratio 0 past the trunk (compress_ratios tail {list(mtp_ratios)})")
        if not self.dspark_target_layer_ids or any(not 0 <= L < self.n_layers for L in self.dspark_target_layer_ids):
            raise ConfigError(f"config: dspark_target_layer_ids {list(self.dspark_target_layer_ids)} must be trunk "
                              f"layers 0..{self.n_layers - 1} (at least one)")
        if self.dspark_n_routed_experts or self.dspark_n_activated_experts:
            raise ConfigError("config: the DeepSeek-V4 drafter's MoE has the trunk's experts; "
                              "dspark_n_routed_experts / dspark_num_experts_per_tok are V4.1 keys")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size or self.dspark_markov_rank < 1:
            raise ConfigError(f"config: dspark_noise_token_id {self.dspark_noise_token_id} must be a token id below "
                              f"{self.vocab_size} and dspark_markov_rank {self.dspark_markov_rank} >= 1")

    # ---- derived (§2.3, §3) -----------------------------------------------------------------
    def is_hash_layer(self, layer_id: int) -> bool:
        """V4: the first num_hash_layers layers route by tid2eid[token id] (dsv4-engine.md §5)."""
        return self.arch == "v4" and layer_id < self.n_hash_layers

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.dim

    @property
    def vision_head_dim(self) -> int:
        return self.vision_dim // self.vision_n_heads

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def ratio(self, layer_id: int) -> int:
        return self.compress_ratios[layer_id]

    def is_kv_source(self, L: int) -> bool:
        return L < self.n_layers and L in self.kv_source_layers

    def is_index_source(self, L: int) -> bool:
        return L < self.n_layers and L in self.index_source_layers

    def owns_index_keys(self, L: int) -> bool:
        return self.is_index_source(L) and self.is_kv_source(L)

    def is_candidate_source(self, L: int) -> bool:
        return L < self.n_layers and L == self.candidate_source_layer

    def uses_candidates(self, L: int) -> bool:
        return self.is_index_source(L) and 0 <= self.candidate_source_layer < L

    def kv_source_for(self, L: int) -> int | None:
        """The KV source whose compressed cache layer L reads: the latest source at or before L (§3.1).
        The schedule requires it to have L's ratio."""
        srcs = [s for s in self.kv_source_layers if s <= L]
        if not srcs or self.compress_ratios[srcs[-1]] != self.compress_ratios[L]:
            return None
        return srcs[-1]

    def index_source_for(self, L: int) -> int | None:
        srcs = [s for s in self.index_source_layers if s <= L]
        return srcs[-1] if srcs else None

    def key_owner_for(self, L: int) -> int | None:
        """§18.1 'intended': the most recent key owner of L's own ratio."""
        owners = [s for s in self.kv_source_layers
                  if s <= L and s in self.index_source_layers and self.compress_ratios[s] == self.compress_ratios[L]]
        return owners[-1] if owners else None

    def moe_experts(self, layer_id: int) -> tuple[int, int]:
        """get_moe_config (§2.1): (n_routed, n_activated)."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Accept the inference `config.json` (§2.1) or the HF `config.json` (§2.2, keys possibly under
        `text_config`). Unknown keys are kept in `extra`; a key given in both spellings with different
        values is an error."""
        d = dict(d)
        if "text_config" in d and isinstance(d["text_config"], dict):
            top = {k: v for k, v in d.items() if k != "text_config"}
            d = {**top, **d["text_config"]}
        out: dict[str, Any] = {}
        arch = detect_arch(d)

        def put(key, value, src):
            if key in out and out[key] != value:
                raise ConfigError(f"config: {src} gives {key}={value!r} but another key gave {out[key]!r}")
            out[key] = value

        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        extra = {}
        for k, v in d.items():
            if k in _HF_KEYS:
                put(_HF_KEYS[k], v, k)
            elif k in ("rope_scaling", "rope_parameters") and isinstance(v, dict):
                if v.get("rope_type", v.get("type")) not in ("yarn", None):
                    raise ConfigError(f"config: {k} type {v.get('rope_type')!r} is not yarn")
                if k == "rope_parameters" and "rope_theta" in v:  # transformers >= 5 spelling
                    put("rope_theta", v["rope_theta"], "rope_parameters.rope_theta")
                for hk, ik in (("factor", "rope_factor"), ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"),
                               ("original_max_position_embeddings", "original_seq_len")):
                    if hk in v:
                        put(ik, v[hk], f"rope_scaling.{hk}")
            elif k == "vision_config" and isinstance(v, dict):
                for hk, hv in v.items():
                    if hk in _HF_VISION_KEYS:
                        put(_HF_VISION_KEYS[hk], hv, f"vision_config.{hk}")
                extra[k] = v
            elif k == "quantization_config" and isinstance(v, dict):
                if "expert_dtype" in v:
                    put("expert_dtype", v["expert_dtype"], "quantization_config.expert_dtype")
                if arch == "v4" and "scale_fmt" in v:
                    put("scale_fmt", v["scale_fmt"], "quantization_config.scale_fmt")
                extra[k] = v
            elif arch == "v4" and k in _V4_KEYS:
                put(_V4_KEYS[k], v, k)
            elif k in names:
                put(k, v, k)
            elif k in _METADATA_KEYS or k.startswith("ds41_"):   # the harness's own marks (tiny builds)
                extra[k] = v
            else:
                hint = difflib.get_close_matches(k, sorted(names | set(_HF_KEYS)), n=1)
                raise ConfigError(f"config: unknown key {k!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                  + "; allowed: the model keys of dsv41-architecture.md §2.1/§2.2 and HF metadata "
                                    f"keys {sorted(_METADATA_KEYS)}")
        if "n_layers" not in out:
            raise ConfigError("config: n_layers (HF: num_hidden_layers) is missing; every other size depends on it")
        if arch == "v4":
            if out.get("arch", "v4") != "v4":
                raise ConfigError(f"config: arch {out['arch']!r} contradicts the DeepSeek-V4 markers of this config")
            out["arch"] = "v4"
            for k, v in V4_DEFAULTS.items():
                out.setdefault(k, v)
            if "compress_ratios" not in out:
                raise ConfigError("config: a DeepSeek-V4 config needs compress_ratios (one per layer + MTP layer)")
        if out.get("dtype") in ("bfloat16",):  # the HF top-level dtype is the storage default, not the scheme
            extra["hf_dtype"] = out.pop("dtype")
        for k, v in list(out.items()):
            if isinstance(v, list):
                out[k] = tuple(v)
            _check_type(k, out[k], getattr(_DEFAULTS, k))
        if arch == "v4":
            n_all = out["n_layers"] + out["n_mtp_layers"]
            if len(out["compress_ratios"]) == out["n_layers"] and out["n_mtp_layers"]:
                raise ConfigError(f"config: compress_ratios has {out['n_layers']} entries; DeepSeek-V4 lists one "
                                  f"more per MTP layer ({n_all} for {out['n_mtp_layers']} MTP layer(s))")
        return cls(**out, extra=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"config: cannot read {path}: {e}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"config: {path} must hold a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def release(cls) -> "ModelConfig":
        return cls()

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """§20.1 values."""
        v = dict(
            vocab_size=512, dim=256, moe_inter_dim=128, n_layers=8, n_mtp_layers=3,
            n_heads=8, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64,
            window_size=64, norm_eps=1e-20,
            n_routed_experts=8, n_shared_experts=1, n_activated_experts=3, score_func="sqrtsoftplus",
            route_scale=1.5, swiglu_limit=10.0, gate_temp=1.0, norm_topk_prob=True,
            compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0), kv_source_layers=(2, 4),
            index_source_layers=(2, 4, 6), candidate_source_layer=4, candidate_topk_blocks=6,
            candidate_block_size=4, index_n_heads=4, index_head_dim=32, index_topk=16,
            rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=1024, rope_factor=4.0,
            beta_fast=32, beta_slow=1, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
            engram_layer_ids=(1, 2), engram_num_embeddings=(660, 864), engram_vocab_size=100,
            engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=64, engram_pad_id=2,
            engram_compressed_vocab_size=256,
            dspark_block_size=3, dspark_noise_token_id=511, dspark_target_layer_ids=(5, 6, 7),
            dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=2,
            dtype="fp8", expert_dtype="fp4", vision_n_layers=0, max_seq_len=256, max_batch_size=2,
        )
        v.update(overrides)
        return cls(**v)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


ARCHITECTURES = ("v4.1", "v4")

# ModelConfig fields that only a DeepSeek-V4 config sets (a V4.1 inference config.json has none of them)
V4_ONLY_FIELDS = ("arch", "n_hash_layers", "scale_fmt")

# DeepSeek-V4 (Flash) values where they differ from the V4.1 defaults of ModelConfig (dsv4-engine.md §5);
# a V4 config.json's own keys override them.
V4_DEFAULTS: dict[str, Any] = dict(
    dim=4096, n_layers=43, n_mtp_layers=1, q_lora_rank=1024, moe_inter_dim=2048, n_routed_experts=256,
    n_activated_experts=6, index_n_heads=64, norm_eps=1e-6, n_hash_layers=3,
    kv_source_layers=(), index_source_layers=(), candidate_source_layer=-1,
    engram_layer_ids=(), engram_num_embeddings=(), dspark_block_size=0, dspark_target_layer_ids=(),
    dspark_n_routed_experts=0, dspark_n_activated_experts=0, vision_n_layers=0, dtype="fp8",
)

# keys only a V4 config has, or spells its own way -> field
_V4_KEYS = {"num_hash_layers": "n_hash_layers", "n_hash_layers": "n_hash_layers", "scoring_func": "score_func",
            "scale_fmt": "scale_fmt"}


def detect_arch(d: dict[str, Any]) -> str:
    """'v4' for a DeepSeek-V4 config (model_type deepseek_v4, a DeepseekV4* architecture, or a V4-only key),
    else 'v4.1'. An explicit `arch` key wins; contradictions are errors."""
    markers = []
    if str(d.get("model_type", "")).lower() in ("deepseek_v4", "deepseek-v4"):
        markers.append("model_type")
    if any(str(a).startswith("DeepseekV4") and not str(a).startswith("DeepseekV41") for a in d.get("architectures") or ()):
        markers.append("architectures")
    if d.get("num_hash_layers") or d.get("n_hash_layers"):     # V4.1 has none: 0 is no marker
        markers.append("num_hash_layers")
    if "arch" in d:
        if d["arch"] not in ARCHITECTURES:
            raise ConfigError(f"config: arch {d['arch']!r}: expected one of {ARCHITECTURES}")
        if d["arch"] == "v4.1" and markers:
            raise ConfigError(f"config: arch 'v4.1' but {markers[0]} marks a DeepSeek-V4 config")
        return d["arch"]
    return "v4" if markers else "v4.1"


# HF text_config key -> inference key (§2.2)
_HF_KEYS = {
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "num_experts_per_tok": "n_activated_experts",
    "routed_scaling_factor": "route_scale",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "n_routed_experts": "n_routed_experts",
}


# HF vision_config key -> inference key (§2.2)
_HF_VISION_KEYS = {
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim", "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim", "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}


# Keys of a real config.json that describe the file or other parts of the model, not the text model the
# oracle computes (dsv41-architecture.md §2.2); kept in `extra`. Anything else unknown is a typo.
_METADATA_KEYS = {
    "architectures", "model_type", "torch_dtype", "transformers_version", "auto_map", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "vision_config", "num_key_value_heads",
    "max_position_embeddings", "topk_method", "hidden_act", "tie_word_embeddings", "use_cache",
    "initializer_range", "attention_bias", "attention_dropout", "hf_dtype",
    # DeepSeek-V4 HF metadata (dsv4-engine.md §2); the oracle's choices for them are fixed by the reference
    "rope_interleave", "qk_nope_head_dim", "layer_types", "mlp_layer_types", "first_k_dense_replace", "n_group",
    "topk_group", "ep_size", "moe_layer_freq", "kv_lora_rank", "v_head_dim", "num_experts",
}

_DEFAULTS = ModelConfig()


def _check_type(key: str, value: Any, default: Any) -> None:
    """A value must have its field's type: a string where a number belongs is named here, not deep in torch."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if value is None and key in ("expert_dtype", "vision_max_wh_ratio", "scale_fmt"):
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
        want = "true or false"
    elif isinstance(default, int):
        ok = is_int(value)
        want = "an integer"
    elif isinstance(default, float):
        ok = (is_int(value) or isinstance(value, float)) and value == value
        want = "a number"
    elif isinstance(default, str):
        ok = isinstance(value, str)
        want = "a string"
    elif isinstance(default, tuple):
        ok = isinstance(value, tuple) and all(is_int(v) for v in value)
        want = "a list of integers"
    else:
        return
    if not ok:
        raise ConfigError(f"config: {key} = {value!r:.60} must be {want}")

"""An official-layout DeepSeek-V4 checkpoint folder in transformers' ``DeepseekV4ForCausalLM``, fp32 on CPU.

The DeepSeek release layout (dsv4-engine.md §2; what vLLM's DeepSeek-V4 weight mapper reads) is not what
``DeepseekV4ForCausalLM`` holds: the config names its layer schedule ``compress_ratios`` / ``num_hash_layers``
where transformers has ``layer_types`` / ``mlp_layer_types``, the tensors are named ``layers.L.attn.wq_a``
rather than ``model.layers.L.self_attn.q_a_proj``, dense linears are FP8 e4m3 with 128x128 UE8M0 block scales,
routed experts MXFP4 (or FP8), one tensor per expert where transformers stacks ``gate_up_proj`` [E, 2I, D].
This module maps all three explicitly, so nothing depends on transformers' own conversion or quantiser code:

* :func:`hf_config_from_official` — every ``config.json`` field is mapped to a ``DeepseekV4Config`` field,
  checked against the one behaviour transformers implements (a field it cannot honour is refused), consumed
  by this loader (formats), or named as not built (MTP); an unknown field is a :class:`V4MappingError`.
* :func:`hf_tensor_name` — official tensor name -> (transformers state-dict key, expert slot).
* :func:`load_official_v4` — decodes every linear with ``oracle.dsv41.formats`` (exact FP8 / MXFP4 / BF16 ->
  fp32), builds the model in fp32 and fills every state-dict entry exactly once; it counts what it loaded
  against what the model expects and refuses a missing, duplicated, unmapped or mis-shaped tensor. ``mtp.*``
  (transformers builds no MTP layer) is the one thing skipped, counted in the :class:`LoadReport`.

What transformers' implementation does and does not reproduce of DeepSeek's reference is in docs/ORACLE.md,
"transformers' DeepSeek-V4 as a second opinion".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oracle.scoring import OracleError

__all__ = ["LoadReport", "V4MappingError", "hf_config_from_official", "hf_tensor_name", "is_official_v4",
           "layer_types_from_ratios", "load_official_v4", "mlp_layer_types_from_hash_layers"]


class V4MappingError(OracleError):
    """An official DeepSeek-V4 config field or tensor that this mapping cannot place in transformers'
    DeepseekV4ForCausalLM; the message names the field / tensor and the folder."""


# ---------------------------------------------------------------------------------------------- config
RATIO_TO_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
LAYER_TYPE_TO_RATIO = {v: k for k, v in RATIO_TO_LAYER_TYPE.items()}

# same name, same meaning in both configs
SAME_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
    "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor", "scoring_func",
    "swiglu_limit", "hidden_act", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta",
    "compress_rope_theta", "max_position_embeddings", "bos_token_id", "eos_token_id", "num_nextn_predict_layers",
)
# mapped onto differently named transformers fields (see hf_config_from_official)
RENAMED_FIELDS = ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling")
# fields for which transformers has exactly one behaviour: accepted only with that value
FIXED_FIELDS: dict[str, tuple[Any, ...]] = {
    "num_key_value_heads": (1,),          # shared-KV MQA, one KV head
    "n_shared_experts": (1,),             # DeepseekV4MLP is one shared expert of moe_intermediate_size
    "norm_topk_prob": (True,),            # both routers divide by the sum of the picked weights
    "topk_method": ("noaux_tc",),         # the top-k router always adds e_score_correction_bias (gate.bias)
    "tie_word_embeddings": (False,),      # V4 has its own head
    "model_type": ("deepseek_v4",),
    "architectures": (["DeepseekV4ForCausalLM"],),
    "attention_bias": (False,),
}
# read by this loader (weight formats) or provenance only; they do not change the math transformers runs
LOADER_FIELDS = ("quantization_config", "expert_dtype", "torch_dtype", "dtype", "transformers_version",
                 "use_cache", "initializer_range")
YARN_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim"}


def layer_types_from_ratios(ratios: list[int], n_layers: int, where: str = "config") -> list[str]:
    """compress_ratios (one per layer, optionally followed by the MTP layers' entries) -> layer_types."""
    if len(ratios) < n_layers:
        raise V4MappingError(f"{where}: compress_ratios has {len(ratios)} entries for {n_layers} layers")
    out = []
    for i, r in enumerate(ratios[:n_layers]):
        if r not in RATIO_TO_LAYER_TYPE:
            raise V4MappingError(f"{where}: compress_ratios[{i}] = {r}: transformers' DeepSeek-V4 has layer "
                                 f"types for ratios {sorted(RATIO_TO_LAYER_TYPE)} only")
        out.append(RATIO_TO_LAYER_TYPE[r])
    return out


def mlp_layer_types_from_hash_layers(num_hash_layers: int, n_layers: int, where: str = "config") -> list[str]:
    if not 0 <= num_hash_layers <= n_layers:
        raise V4MappingError(f"{where}: num_hash_layers {num_hash_layers} outside 0..{n_layers}")
    return ["hash_moe"] * num_hash_layers + ["moe"] * (n_layers - num_hash_layers)


def _rope_parameters(off: dict, partial: float, where: str) -> dict:
    """main (window-only layers): default RoPE at rope_theta; compress (CSA / HCA layers): YaRN at
    compress_rope_theta without YaRN's mscale (dsv4-engine.md §5 RoPE row), exactly as the reference."""
    main = {"rope_type": "default", "rope_theta": float(off.get("rope_theta", 10000.0)),
            "partial_rotary_factor": partial}
    compress = {"rope_type": "default", "rope_theta": float(off.get("compress_rope_theta", 160000.0)),
                "partial_rotary_factor": partial}
    rs = off.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict):
            raise V4MappingError(f"{where}: rope_scaling must be an object, got {rs!r}")
        unknown = sorted(set(rs) - YARN_KEYS)
        kind = rs.get("rope_type", rs.get("type"))
        if unknown or kind != "yarn":
            raise V4MappingError(f"{where}: rope_scaling {rs}: only YaRN ({sorted(YARN_KEYS)}) is mapped")
        if rs.get("mscale") not in (None, 0, 1.0) or rs.get("mscale_all_dim") not in (None, 0, 1.0):
            raise V4MappingError(f"{where}: rope_scaling mscale / mscale_all_dim {rs}: the V4 reference applies no "
                                 "YaRN attention scale, transformers' mapping has none either")
        compress.update({"rope_type": "yarn", "factor": float(rs["factor"]),
                         "original_max_position_embeddings": int(rs["original_max_position_embeddings"]),
                         "beta_fast": float(rs.get("beta_fast", 32)), "beta_slow": float(rs.get("beta_slow", 1)),
                         "attention_factor": 1.0})
    return {"main": main, "compress": compress}


def hf_config_kwargs(off: dict, where: str = "config.json") -> dict:
    """The official config.json object -> keyword arguments of transformers' DeepseekV4Config, every field
    accounted for (mapped, checked, consumed by the loader) or a V4MappingError naming it."""
    if not isinstance(off, dict):
        raise V4MappingError(f"{where}: the model config must be a JSON object")
    known = set(SAME_FIELDS) | set(RENAMED_FIELDS) | set(FIXED_FIELDS) | set(LOADER_FIELDS)
    unknown = sorted(set(off) - known)
    if unknown:
        raise V4MappingError(f"{where}: field(s) {unknown} have no mapping onto transformers' DeepseekV4Config "
                             "(an unmapped field could change the model: refused rather than dropped)")
    for k, allowed in FIXED_FIELDS.items():
        if k in off and off[k] not in allowed:
            raise V4MappingError(f"{where}: {k} = {off[k]!r}: transformers' DeepSeek-V4 implements only "
                                 f"{' or '.join(repr(a) for a in allowed)}")
    for k in ("num_hidden_layers", "head_dim", "compress_ratios"):
        if k not in off:
            raise V4MappingError(f"{where}: required field {k!r} missing")
    n = int(off["num_hidden_layers"])
    kw = {k: off[k] for k in SAME_FIELDS if k in off}
    kw["num_key_value_heads"] = 1
    kw["n_shared_experts"] = 1
    kw["norm_topk_prob"] = True
    kw["tie_word_embeddings"] = False
    kw["layer_types"] = layer_types_from_ratios([int(r) for r in off["compress_ratios"]], n, where)
    kw["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    kw["mlp_layer_types"] = mlp_layer_types_from_hash_layers(int(off.get("num_hash_layers", 0)), n, where)
    rope_dim = int(off.get("qk_rope_head_dim", 64))
    partial = rope_dim / int(off["head_dim"])
    kw["partial_rotary_factor"] = partial
    kw["rope_parameters"] = _rope_parameters(off, partial, where)
    qc = off.get("quantization_config")
    if qc is not None:
        bad = {k: qc.get(k) for k, ok in (("quant_method", ("fp8",)), ("fmt", ("e4m3", None)),
                                           ("scale_fmt", ("ue8m0", None))) if qc.get(k) not in ok}
        if bad:
            raise V4MappingError(f"{where}: quantization_config {bad}: this loader decodes FP8 e4m3 with UE8M0 "
                                 "block scales (plus MXFP4 / BF16 tensors) only")
    if off.get("expert_dtype") not in (None, "fp4", "fp8"):
        raise V4MappingError(f"{where}: expert_dtype {off['expert_dtype']!r}: expected fp4 or fp8")
    return kw


def hf_config_from_official(off: dict, where: str = "config.json"):
    """The official config -> a DeepseekV4Config; its derived layer schedule is checked against the input."""
    from transformers import DeepseekV4Config

    kw = hf_config_kwargs(off, where)
    cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    # transformers' __post_init__ rewrites several of these: hold the result to what was asked
    got = {"layer_types": list(cfg.layer_types), "mlp_layer_types": list(cfg.mlp_layer_types),
           "qk_rope_head_dim": int(cfg.qk_rope_head_dim)}
    want = {"layer_types": kw["layer_types"], "mlp_layer_types": kw["mlp_layer_types"],
            "qk_rope_head_dim": int(off.get("qk_rope_head_dim", 64))}
    for k in SAME_FIELDS:
        if k in kw:
            got[k], want[k] = getattr(cfg, k), kw[k]
    wrong = {k: (want[k], got[k]) for k in want if got[k] != want[k]}
    if wrong:
        raise V4MappingError(f"{where}: DeepseekV4Config changed mapped fields (asked, got): {wrong}")
    return cfg


def official_schedule(cfg) -> dict:
    """The inverse mapping, for tests and provenance: DeepseekV4Config -> compress_ratios / num_hash_layers."""
    hashes = list(cfg.mlp_layer_types)
    n_hash = hashes.count("hash_moe")
    if hashes != ["hash_moe"] * n_hash + ["moe"] * (len(hashes) - n_hash):
        raise V4MappingError(f"mlp_layer_types {hashes}: hash layers must come first (num_hash_layers)")
    return {"compress_ratios": [LAYER_TYPE_TO_RATIO[t] for t in cfg.layer_types], "num_hash_layers": n_hash}


# ---------------------------------------------------------------------------------------------- tensor names
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])$")
# per-layer official name (without "layers.L.") -> transformers name (without "model.layers.L.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b": "self_attn.q_b_proj.weight",
    "attn.wkv": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a": "self_attn.o_a_proj.weight",
    "attn.wo_b": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj.weight",
}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "norm.weight": "model.norm.weight",
              "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
              "hc_head_scale": "model.hc_head.hc_scale"}


@dataclass(frozen=True)
class Slot:
    """Where one official tensor lands: a whole transformers tensor, or (expert, row range) of a stacked one."""
    key: str
    expert: int | None = None
    part: str | None = None  # "gate" (w1: rows 0..I-1 of gate_up_proj), "up" (w3: rows I..2I-1), "down" (w2)


def hf_tensor_name(official: str) -> Slot | None:
    """An official name (a linear prefix such as ``layers.0.attn.wq_a`` or a plain tensor name such as
    ``layers.0.attn.attn_sink``) -> its transformers Slot; None for ``mtp.*`` (not built); else an error."""
    if official.startswith("mtp."):
        return None
    if official in _TOP_NAMES:
        return Slot(_TOP_NAMES[official])
    m = _LAYER.match(official)
    if m:
        L, rest = m.group(1), m.group(2)
        e = _EXPERT.match(rest)
        if e:
            part = {"w1": "gate", "w3": "up", "w2": "down"}[e.group(2)]
            stacked = "gate_up_proj" if part != "down" else "down_proj"
            return Slot(f"model.layers.{L}.mlp.experts.{stacked}", int(e.group(1)), part)
        if rest in _LAYER_NAMES:
            return Slot(f"model.layers.{L}.{_LAYER_NAMES[rest]}")
    raise V4MappingError(f"tensor {official!r}: no place for it in transformers' DeepseekV4ForCausalLM")


# ---------------------------------------------------------------------------------------------- loading
@dataclass
class LoadReport:
    """What the load did, for the record's provenance: every model entry filled once, every checkpoint
    tensor consumed or skipped by name."""
    expected_entries: int = 0          # persistent state-dict entries of the transformers model
    loaded_entries: int = 0            # entries filled (stacked expert tensors count once, when complete)
    checkpoint_tensors: int = 0        # tensors in the folder's shards
    consumed_tensors: int = 0          # of those, decoded into the model (a linear's .weight + .scale = 2)
    skipped_not_built: list[str] = field(default_factory=list)  # mtp.*: transformers builds no MTP layer
    formats: dict[str, int] = field(default_factory=dict)       # linears per storage format

    def as_dict(self) -> dict:
        return {"expected_entries": self.expected_entries, "loaded_entries": self.loaded_entries,
                "checkpoint_tensors": self.checkpoint_tensors, "consumed_tensors": self.consumed_tensors,
                "skipped_not_built": len(self.skipped_not_built), "formats": dict(self.formats)}


def is_official_v4(model_dir: str | Path) -> bool:
    """A DeepSeek-V4 folder in the release layout: model_type deepseek_v4 and an ``embed.weight`` tensor
    (transformers' own save layout has ``model.embed_tokens.weight``)."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict) or cfg.get("model_type") != "deepseek_v4":
        return False
    return "embed.weight" in _headers(d, strict=False)


def _headers(d: Path, strict: bool = True) -> dict:
    from oracle.dsv41.shard_io import read_header

    infos: dict = {}
    problems: list[str] = []
    for path in sorted(d.glob("*.safetensors")):
        got, _, probs = read_header(path)
        problems += probs
        for name, info in got.items():
            if name in infos:
                problems.append(f"{name}: in both {infos[name].file.name} and {path.name}")
            infos[name] = info
    if strict and problems:
        raise V4MappingError(f"{d}: unreadable shards: " + "; ".join(problems[:5]))
    return infos


def _group(infos: dict) -> tuple[dict[str, dict], dict[str, Any]]:
    """Split tensor names into linears (prefix -> {name: header}: a rank-2 ``.weight`` and its ``.scale``)
    and plain tensors (name -> info): 1-D norm weights, sinks, ape, mHC parameters, gate bias, tid2eid."""
    linears: dict[str, dict] = {}
    plain: dict[str, Any] = {}
    for name, info in infos.items():
        if name.endswith(".weight") and len(info.shape) == 2:
            linears.setdefault(name[: -len(".weight")], {})[name] = info.header
        elif name.endswith((".scale", ".weight_scale_inv")) and len(info.shape) == 2:
            linears.setdefault(name.rsplit(".", 1)[0], {})[name] = info.header
        else:
            plain[name] = info
    return linears, plain


def load_official_v4(model_dir: str | Path, threads: int = 2):
    """Build DeepseekV4ForCausalLM in fp32 from an official-layout folder -> (model, config, LoadReport)."""
    from safetensors import safe_open
    from transformers import DeepseekV4ForCausalLM

    from oracle.dsv41 import formats as F

    d = Path(model_dir)
    off = json.loads((d / "config.json").read_text(encoding="utf-8"))
    cfg = hf_config_from_official(off, f"{d / 'config.json'}")
    block = (off.get("quantization_config") or {}).get("weight_block_size")
    infos = _headers(d)
    report = LoadReport(checkpoint_tensors=len(infos))
    prev = torch.get_default_dtype()
    torch.set_num_threads(threads)
    try:
        torch.set_default_dtype(torch.float32)
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    expected = {k: v for k, v in model.state_dict().items()}
    report.expected_entries = len(expected)
    values: dict[str, torch.Tensor] = {}
    expert_fill: dict[str, set] = {}
    handles: dict[Path, Any] = {}

    def read(info) -> torch.Tensor:
        h = handles.get(info.file)
        if h is None:
            h = handles[info.file] = safe_open(str(info.file), framework="pt")
        t = h.get_tensor(info.name)
        return t.view(torch.uint8) if info.dtype.startswith("F8_") else t

    def put(name: str, slot: Slot, t: torch.Tensor) -> None:
        want = expected.get(slot.key)
        if want is None:
            raise V4MappingError(f"{d}: tensor {name!r} maps to {slot.key!r}, which this configuration does not "
                                 "build (a layer type or router kind that does not match the config)")
        if slot.expert is None:
            if slot.key in values:
                raise V4MappingError(f"{d}: {slot.key!r} filled twice (second time from {name!r})")
            if tuple(t.shape) != tuple(want.shape):
                raise V4MappingError(f"{d}: tensor {name!r} has shape {list(t.shape)}, {slot.key!r} needs "
                                     f"{list(want.shape)}")
            values[slot.key] = t.to(want.dtype) if want.dtype != torch.float32 else t.to(torch.float32)
            return
        full = values.get(slot.key)
        if full is None:
            full = values[slot.key] = torch.empty(want.shape, dtype=torch.float32)
        rows = full.shape[1] // 2 if slot.part != "down" else full.shape[1]
        off_rows = rows if slot.part == "up" else 0
        if not 0 <= slot.expert < full.shape[0] or tuple(t.shape) != (rows, full.shape[2]):
            raise V4MappingError(f"{d}: expert tensor {name!r} {list(t.shape)} does not fit {slot.key!r} "
                                 f"{list(full.shape)} (expert {slot.expert}, {slot.part})")
        cell = (slot.expert, slot.part)
        if cell in expert_fill.setdefault(slot.key, set()):
            raise V4MappingError(f"{d}: {name!r} filled twice")
        expert_fill[slot.key].add(cell)
        full[slot.expert, off_rows:off_rows + rows] = t

    linears, plain = _group(infos)
    for prefix, headers in sorted(linears.items()):
        slot = hf_tensor_name(prefix)
        if slot is None:
            report.skipped_not_built += sorted(headers)
            continue
        try:
            fmt = F.detect_linear_format(prefix, headers, block)
            t = F.decode_linear(fmt, {role: read(infos[n]) for role, n in fmt.tensors.items()})
        except F.FormatError as exc:  # a .scale without its .weight, a wrong scale grid, an unknown dtype
            raise V4MappingError(f"{d}: {exc}") from exc
        report.formats[fmt.kind] = report.formats.get(fmt.kind, 0) + 1
        report.consumed_tensors += len(fmt.tensors)
        put(prefix, slot, t)
    for name, info in sorted(plain.items()):
        slot = hf_tensor_name(name)
        if slot is None:
            report.skipped_not_built.append(name)
            continue
        t = read(info)
        if info.dtype.startswith("F8_") or info.dtype in ("I8", "U8"):
            raise V4MappingError(f"{d}: {name!r} is {info.dtype} without a linear's .weight/.scale pair")
        report.consumed_tensors += 1
        put(name, slot, t if not t.is_floating_point() else t.to(torch.float32))
    for key, cells in expert_fill.items():
        n_exp = expected[key].shape[0]
        parts = ("gate", "up") if key.endswith("gate_up_proj") else ("down",)
        missing = sorted({(e, p) for e in range(n_exp) for p in parts} - cells)
        if missing:
            raise V4MappingError(f"{d}: {key!r}: expert tensors missing for (expert, part) {missing[:6]}"
                                 f"{' ...' if len(missing) > 6 else ''}")
    missing = sorted(set(expected) - set(values))
    if missing:
        raise V4MappingError(f"{d}: {len(missing)} of {len(expected)} model entries have no checkpoint tensor: "
                             f"{missing[:6]}{' ...' if len(missing) > 6 else ''}")
    unaccounted = report.checkpoint_tensors - report.consumed_tensors - len(report.skipped_not_built)
    if unaccounted:  # pragma: no cover - every tensor above is consumed, skipped or raised on
        raise V4MappingError(f"{d}: {unaccounted} checkpoint tensors neither loaded nor skipped")
    model.load_state_dict(values, strict=True, assign=True)
    report.loaded_entries = len(values)
    # non-persistent buffers (RoPE inverse frequencies) were built on the meta device: rebuild them for real
    _materialise_rotary(model, cfg)
    model.eval()
    model.requires_grad_(False)  # an oracle: no autograd state on the weights
    bad = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
           if p.is_meta or (p.is_floating_point() and p.dtype != torch.float32)]
    if bad:
        raise V4MappingError(f"{d}: entries not fp32 / not materialised after loading: {bad[:4]}")
    return model, cfg, report


def _materialise_rotary(model, cfg) -> None:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    for mod_name, mod in list(model.named_modules()):
        if isinstance(mod, DeepseekV4RotaryEmbedding):
            fresh = DeepseekV4RotaryEmbedding(cfg, device="cpu")
            for label in fresh.layer_types:
                for kind in ("inv_freq", "original_inv_freq"):
                    setattr(mod, f"{label}_{kind}", getattr(fresh, f"{label}_{kind}"))


def to_transformers_bf16(model) -> None:
    """Cast a loaded DeepseekV4ForCausalLM to bf16 as transformers' own bf16 load leaves it: every parameter
    and buffer bf16 except those under a module transformers keeps in fp32 for V4
    (``_keep_in_fp32_modules_strict``: mHC, hc_head, norms, sinks, compressor position biases, router bias).
    The bf16 noise floor of this opinion (benchmarks/dsv4_noise_floor.py)."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", ()) or ())
    model.to(torch.bfloat16)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if keep & set(name.split(".")) and t.is_floating_point():
            t.data = t.data.float()

"""exllamav3's EXL3 output folder as a pack the DeepSeek oracle loads (weight-formats.md §2.4, §7).

exllamav3's converter (``python -m exllamav3.conversion.convert_model``) writes a whole model: every quantized
linear as ``{prefix}.trellis`` / ``.suh`` / ``.svh`` / ``.mul1`` (or ``.mcg``, or neither for the 3INST codebook),
unquantized tensors in fp16/bf16/fp32 under the release's names, and ``config.json`` with a
``quantization_config`` ``{quant_method: "exl3", version, bits, head_bits, calibration, out_scales, codebook,
tensor_storage}``. The oracle's pack reader (``Checkpoint(official, pack_dir)``, "each build's own tensors,
everything else official") already reads those suffixes per linear; what exllamav3 adds is

* **names**: DeepSeek-V4's grouped output projection ``layers.L.attn.wo_a`` ``[o_groups * o_lora_rank, in/g]``
  is stored as ``o_groups`` separate linears ``layers.L.attn.wo_a.slice.G`` (exllamav3's ``frange`` rows
  ``[G * o_lora_rank, (G + 1) * o_lora_rank)`` of ``wo_a``, modules/dsv4.py). Each slice is decoded exactly
  (``formats.exl3_dequant``, the canonical fp32 weight) and the slices are stacked in order into one fp32
  ``wo_a.weight`` — the very values the oracle computes per slice, so nothing is rounded;
* **the config**: ``quant_method`` must be ``exl3`` and ``codebook`` one of 3inst / mcg / mul1, and every
  trellis's codebook marker must agree with it.

Everything else is passed through under its own name. What cannot be decoded is refused with
:class:`Exl3PackError` naming every tensor or key: another ``quant_method``, an unknown codebook, a marker that
disagrees with the config, a ``.slice.`` split other than ``wo_a``'s, slices that do not tile ``wo_a``, tensors
of a linear with an unknown suffix, and anything ``formats.detect_linear_format`` refuses (half-integer K
without mul1, widths that are not 16·K, sizes not multiples of 128, missing sign vectors, …).

    translate_pack("/models/dsv4-exl3-4bpw", "/tmp/dsv4-exl3-4bpw.pack")   # → a pack folder
    ck = Checkpoint("/models/dsv4-tiny", pack_dir="/tmp/dsv4-exl3-4bpw.pack")
    python -m oracle.dsv41.exllamav3_pack EXL3_DIR PACK_DIR
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.errors import UserError

from . import formats as F

CODEBOOK_MARKERS = {"3inst": None, "mcg": "mcg", "mul1": "mul1"}
_SLICE = re.compile(r"^(?P<base>.+)\.slice\.(?P<g>\d+)\.(?P<suffix>[A-Za-z0-9_]+)$")
_WO_A = re.compile(r"^(layers|mtp)\.\d+\.attn\.wo_a$")
PACK_MARKER = "ds41_exllamav3_pack.json"


class Exl3PackError(UserError, ValueError):
    """An exllamav3 folder the oracle cannot decode exactly; the message names every offending tensor/key."""

    def __init__(self, where: str, problems: list[str]):
        self.where, self.problems = where, list(problems)
        super().__init__(f"{where}: cannot load as an EXL3 pack: " + "; ".join(self.problems))


@dataclass
class PackPlan:
    """How an exllamav3 folder maps onto oracle names."""

    quant: dict
    codebook: str
    passthrough: dict[str, str] = field(default_factory=dict)          # oracle name -> source tensor name
    stacked: dict[str, list[str]] = field(default_factory=dict)        # oracle linear prefix -> slice prefixes
    linears: dict[str, F.LinearFormat] = field(default_factory=dict)   # source linear prefix -> format

    def describe(self) -> dict:
        ks = sorted({f.k2 / 2 for f in self.linears.values() if f.kind == "exl3"})
        return {"quantization_config": self.quant, "codebook": self.codebook, "exl3_linears":
                sum(f.kind == "exl3" for f in self.linears.values()), "K": ks,
                "stacked": {p: len(s) for p, s in sorted(self.stacked.items())},
                "passthrough_tensors": len(self.passthrough)}


def check_quant_config(cfg: dict) -> tuple[dict, str, list[str]]:
    """(quantization_config, codebook, problems) for an exllamav3 config.json."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        return {}, "", ["config.json has no quantization_config (not an exllamav3 EXL3 folder)"]
    problems = []
    method = qc.get("quant_method")
    if method != "exl3":
        problems.append(f"quantization_config.quant_method {method!r}: only 'exl3' is decoded here")
    cb = qc.get("codebook", "3inst")
    if cb not in CODEBOOK_MARKERS:
        problems.append(f"quantization_config.codebook {cb!r}: not one of {sorted(CODEBOOK_MARKERS)}")
    for key in ("bits", "head_bits"):
        v = qc.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 1 <= v <= 16):
            problems.append(f"quantization_config.{key} {v!r}: not a bit width in 1..16")
    return qc, cb, problems


def plan_pack(headers: dict[str, F.Header], cfg: dict) -> PackPlan:
    """Map exllamav3 tensor headers (name -> Header) and its config onto oracle names; Exl3PackError on anything
    that cannot be decoded exactly."""
    qc, cb, problems = check_quant_config(cfg)
    plan = PackPlan(qc, cb)
    groups: dict[str, dict[str, F.Header]] = {}
    slices: dict[str, dict[int, str]] = {}
    for name, h in headers.items():
        m = _SLICE.match(name)
        if m:
            base = m["base"]
            if not _WO_A.match(base):
                problems.append(f"{name}: a .slice. split of {base}, which the oracle does not stack (only wo_a)")
                continue
            sp = f"{base}.slice.{m['g']}"
            slices.setdefault(base, {})[int(m["g"])] = sp
            groups.setdefault(sp, {})[name] = h
            continue
        prefix, _, suffix = name.rpartition(".")
        if suffix in F.EXL3_SUFFIXES and suffix != "bias" or (suffix == "weight" and h.dtype in ("F16", "BF16", "F32")
                                                              and len(h.shape) == 2):
            groups.setdefault(prefix, {})[name] = h
        else:
            plan.passthrough[name] = name
    for prefix, hdrs in sorted(groups.items()):
        if not any(n.endswith(".trellis") for n in hdrs):
            for n in hdrs:  # plain 2-D weights and stray EXL3 parts go through the oracle's own checks
                plan.passthrough[n] = n
            if any(not n.endswith(".weight") for n in hdrs):
                problems.append(f"{prefix}: EXL3 tensors {sorted(n.rpartition('.')[2] for n in hdrs)} without .trellis")
            continue
        try:
            fmt = F.detect_linear_format(prefix, hdrs)
        except F.FormatError as e:
            problems.append(str(e))
            continue
        want = CODEBOOK_MARKERS.get(cb)
        got = F.CODEBOOKS[fmt.codebook]
        if cb in CODEBOOK_MARKERS and got != cb:
            problems.append(f"{prefix}: trellis codebook {got} (marker {'.' + got if got != '3inst' else 'none'}) "
                            f"!= quantization_config.codebook {cb!r}" + ("" if want else " (3inst has no marker)"))
        plan.linears[prefix] = fmt
        if ".slice." not in prefix:
            for n in hdrs:
                plan.passthrough[n] = n
    for base, by_g in sorted(slices.items()):
        gs = sorted(by_g)
        if gs != list(range(len(gs))):
            problems.append(f"{base}: slices {gs} do not run 0..{len(gs) - 1}")
            continue
        fmts = [plan.linears.get(by_g[g]) for g in gs]
        if any(f is None for f in fmts):
            continue  # already reported
        if len({f.in_ for f in fmts}) != 1:
            problems.append(f"{base}: slices have different input widths {[f.in_ for f in fmts]}")
            continue
        plan.stacked[base] = [by_g[g] for g in gs]
    if problems:
        raise Exl3PackError("exllamav3 folder", problems)
    return plan


def read_folder_headers(folder: Path) -> dict[str, tuple[F.Header, Path]]:
    from .shard_io import read_header

    out: dict[str, tuple[F.Header, Path]] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        infos, _, probs = read_header(shard)
        if probs:
            raise Exl3PackError(str(folder), probs)
        for name, info in infos.items():
            out[name] = (info.header, shard)
    if not out:
        raise Exl3PackError(str(folder), ["no safetensors shards"])
    return out


def translate_pack(src_dir, dst_dir) -> dict:
    """Write an oracle pack folder for the exllamav3 folder ``src_dir``: one ``model.safetensors`` (passthrough
    tensors byte-identical, ``wo_a`` stacked from its exactly decoded slices in fp32), config.json copied, and a
    ``ds41_exllamav3_pack.json`` marker describing the mapping. Returns that description."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src_dir), Path(dst_dir)
    try:
        cfg = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise Exl3PackError(str(src), [f"config.json: {e}"]) from None
    found = read_folder_headers(src)
    plan = plan_pack({n: h for n, (h, _) in found.items()}, cfg)
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        path = found[name][1]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(name)

    tensors: dict[str, torch.Tensor] = {}
    for out_name, name in plan.passthrough.items():
        tensors[out_name] = get(name).contiguous()
    for base, slice_prefixes in plan.stacked.items():
        parts = []
        for sp in slice_prefixes:
            fmt = plan.linears[sp]
            parts.append(F.decode_linear(fmt, {role: get(n) for role, n in fmt.tensors.items()}))
        tensors[f"{base}.weight"] = torch.cat(parts, 0).contiguous()
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt", "source": "exllamav3"})
    shutil.copy(src / "config.json", dst / "config.json")
    desc = plan.describe() | {"source": str(src)}
    (dst / PACK_MARKER).write_text(json.dumps(desc, indent=1))
    return desc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m oracle.dsv41.exllamav3_pack", description=__doc__.split("\n")[0])
    ap.add_argument("exl3_dir")
    ap.add_argument("pack_dir")
    a = ap.parse_args(argv)
    try:
        print(json.dumps(translate_pack(a.exl3_dir, a.pack_dir), indent=1))
    except Exl3PackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint and build loading for the DeepSeek-V4.1 oracle (dsv41-architecture.md §4, §19; weight-formats.md §2).

A ``Checkpoint`` opens the official checkpoint folder, optionally layered with a pack folder ("each build's own
tensors, everything else official", weight-formats.md §2.4), validates every header against the configuration
before any compute (one ``CheckpointError`` listing every problem), and then reads tensors lazily, one at a
time, returning exact fp32 weights::

    ck = Checkpoint("/ckpt", pack_dir="/pack")
    w = ck.load_layer(3)                # {"attn.wq_a.weight": fp32 [out, in], "ffn.experts.0.w1.weight": ..., ...}
    top = ck.load_top()                 # embed / head / norm
    lazy = ck.lazy("layers.3")          # a Mapping that dequantizes on access (real-size experts / tables)
    rows = ck.engram_rows(1, ids)       # only the looked-up Engram rows
    ck.provenance(); ck.provenance_hash()

The other two jobs of loading live beside it: inventory.py derives the expected tensors from the config,
shard_io.py reads the safetensors shards of one folder.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from core.errors import UserError

from . import formats as F
from .config import ModelConfig
from .engram import engram_prime_rows
from .arch import expected_inventory
from .inventory import TensorSpec
from .shard_io import INDEX_NAME, RandomReads, ShardFolder, ShortRead, TensorInfo, sha256_file

# INDEX_NAME is shard_io's; re-exported because callers that write a checkpoint's index read it here
__all__ = ["INDEX_NAME", "PLAN_NAME", "Checkpoint", "CheckpointError", "LazyWeights", "OutputBuffers",
           "parse_moe_plan"]

PLAN_NAME = "exl3_moe_plan.json"
PROVENANCE_FORMAT = "ds41-provenance/1"
_FLOAT_DTYPES = ("F32", "F16", "BF16")


class CheckpointError(UserError, ValueError):
    """Every problem found while validating or reading a checkpoint/build, in one message."""

    def __init__(self, where: str, problems: list[str]):
        self.where, self.problems = where, list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{where}: {len(self.problems)} problem(s):\n{lines}")


# ----------------------------------------------------------------------------------------------------------
# exl3_moe_plan.json (weight-formats.md §2.5: layout unspecified, parse tolerantly, validate against shapes)


def parse_moe_plan(obj) -> dict[int, list[int]]:
    """Layer -> per-expert K digits. Accepts {"layers": {...}} or a flat mapping; layer keys like "3",
    "layers.3" or "model.layers.3"; values a digit string or a list of ints. Non-layer metadata keys
    (with non-string/list values or non-layer names) are ignored."""
    body = obj.get("layers", obj) if isinstance(obj, dict) else obj
    if isinstance(body, list):
        body = dict(enumerate(body))
    if not isinstance(body, dict):
        raise ValueError("plan is neither a mapping nor a list of per-layer digit strings")
    plan: dict[int, list[int]] = {}
    for key, val in body.items():
        m = re.fullmatch(r"(?:(?:model\.)?layers\.)?(\d+)", str(key))
        if m is None:
            if isinstance(val, (str, list)):
                raise ValueError(f"plan key {key!r} is not a layer id")
            continue  # metadata such as {"version": 1}
        if isinstance(val, str) and val.isdigit():
            digits = [int(c) for c in val]
        elif isinstance(val, list) and all(isinstance(v, int) for v in val):
            digits = list(val)
        else:
            raise ValueError(f"plan entry {key!r} is not a digit string or a list of ints")
        plan[int(m.group(1))] = digits
    return plan


# ----------------------------------------------------------------------------------------------------------
# The composed build


class OutputBuffers:
    """fp32 arrays that one stage's decoded weights lived in, handed to the next stage's decoders.

    Touching fresh memory costs page faults and zeroing (measured here: 0.6 s per 1.25 GB layer, a tenth
    of that when the memory is reused), and a layer-streamed run allocates every layer anew. `take(shape)`
    returns a free array of that shape or a new one; `reclaim()` (between stages, after the stage's
    tensors were dropped) makes an array free again only when nothing but this pool references it, so a
    tensor still alive is never overwritten, and drops free arrays the last stage did not take (memory
    stays at one stage's worth)."""

    def __init__(self):
        self._lent: list[np.ndarray] = []
        self._free: dict[tuple[int, ...], list[np.ndarray]] = {}
        self.allocated = 0  # arrays created (not reused) so far

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        shape = tuple(int(d) for d in shape)
        free = self._free.get(shape)
        if free:
            arr = free.pop()
        else:
            arr = np.empty(shape, dtype=np.float32)
            self.allocated += 1
        self._lent.append(arr)
        return arr

    def _idle(self) -> list[np.ndarray]:
        # references: self._lent's slot, the comprehension variable and getrefcount's argument; any more
        # is a live user (a tensor, a view, a cycle)
        return [arr for arr in self._lent if sys.getrefcount(arr) <= 3]

    def in_use(self) -> int:
        """Lent arrays that something besides this pool still references (a live tensor, a view, a cycle)."""
        return len(self._lent) - len(self._idle())

    def reclaim(self) -> int:
        """-> the number of arrays made free again. An array something else still references is forgotten,
        not kept: it is freed whenever its last user lets go, exactly as without the pool."""
        self._free = {}
        idle = self._idle()
        for arr in idle:
            self._free.setdefault(arr.shape, []).append(arr)
        self._lent = []
        return len(idle)


class Checkpoint:
    """The official checkpoint, optionally with a pack layered over it (weight-formats.md §2.4)."""

    def __init__(self, checkpoint_dir, pack_dir=None, *, fp8_block: tuple[int, int] | None = None):
        self.dir = Path(checkpoint_dir)
        self.pack_dir = Path(pack_dir) if pack_dir is not None else None
        where = f"checkpoint {self.dir}" + (f" + pack {self.pack_dir}" if self.pack_dir else "")
        cfg_path = self.dir / "config.json"
        try:
            self.config: dict = json.loads(cfg_path.read_text())
            self.model_config = ModelConfig.from_dict(self.config)
        except (OSError, json.JSONDecodeError, ValueError, TypeError) as e:
            raise CheckpointError(where, [f"{cfg_path}: {e}"]) from e
        self._config_sha256 = sha256_file(cfg_path)
        qc = self.config.get("quantization_config") or {}
        block = fp8_block or qc.get("weight_block_size")
        if block is None and "quantization_config" not in self.config and self.config.get("dtype") == "fp8":
            # the inference config.json form (what the reference's ModelArgs reads): no quantization_config,
            # the FP8 block is the reference's module constant fp8_block_size = 32 (§4.5)
            block = (32, 32)
        problems: list[str] = []
        if block is None:
            problems.append("config.json has no quantization_config.weight_block_size (and no fp8_block given)")
            block = (32, 32)
        self.fp8_block = tuple(int(b) for b in block)
        self.inventory = expected_inventory(self.model_config)
        self._official = ShardFolder(self.dir, "official")
        problems += self._official.problems
        self._pack = ShardFolder(self.pack_dir, "pack") if self.pack_dir else None
        self.pack_config: dict | None = None
        self._pack_config_sha256 = self._plan_sha256 = None
        # resolution: linear prefix -> (folder, format); tensor name -> folder
        self._linears: dict[str, tuple[ShardFolder, F.LinearFormat]] = {}
        self._tensors: dict[str, ShardFolder] = {}
        if not self._official.problems:
            problems += self._validate_official()
        if self._pack is not None:
            problems += self._pack.problems
            if not self._pack.problems and not self._official.problems:
                problems += self._compose_pack()
        if problems:
            raise CheckpointError(where, problems)
        self._loaded: dict[str, str] = {}  # tensor name -> sha256 of the bytes read
        self._rows_read: dict[str, dict[int, str]] = {}  # table -> row -> sha256

    # ---- validation ----------------------------------------------------------------------------------

    def _validate_official(self) -> list[str]:
        inv, infos, problems = self.inventory, self._official.infos, []
        claimed: set[str] = set()
        for p, spec in inv.linears.items():
            # gate.bias / vision biases are tensors of their own (rule 3), not a linear's bias
            hdrs = {n: infos[n].header for n in F.linear_tensor_names(p) if n in infos and n not in inv.tensors}
            claimed |= hdrs.keys()
            want = {"fp8": "fp8", "fp4": "mxfp4", "bf16": "plain"}[spec.storage]
            if not hdrs:
                problems.append(f"missing: {p}.weight" + ("" if spec.storage == "bf16" else f", {p}.scale"))
                continue
            try:
                fmt = F.detect_linear_format(p, hdrs, self.fp8_block)
            except F.FormatError as e:
                problems.append(str(e))
                continue
            shape_ok = (fmt.out, fmt.in_) == (spec.out, spec.in_)
            if fmt.kind != want or (want == "plain" and fmt.extra["dtype"] != "BF16"):
                got = fmt.describe()
                problems.append(f"{p}: stored as {got.get('dtype', got['format'])}, the release stores it as "
                                f"{spec.storage} (wrong dtype)")
            elif not shape_ok:
                problems.append(f"{p}.weight: logical shape {[fmt.out, fmt.in_]}, config expects {[spec.out, spec.in_]}")
            elif fmt.kind == "fp8" and (fmt.block.rule != "config" or (fmt.block.rows, fmt.block.cols) != self.fp8_block):
                problems.append(f"{p}.scale: grid {list(infos[fmt.tensors['scale']].shape)} implies "
                                f"{fmt.block.rows}x{fmt.block.cols} blocks, config weight_block_size is "
                                f"{list(self.fp8_block)} (§4.3)")
            else:
                self._linears[p] = (self._official, fmt)
        for name, spec in inv.tensors.items():
            claimed.add(name)
            problems += _check_tensor(name, infos.get(name), spec)
            self._tensors[name] = self._official
        prime_rows = engram_prime_rows(self.model_config) if inv.tables else []
        for (p, spec), rows in zip(inv.tables.items(), prime_rows):
            if spec.rows != rows:
                problems.append(f"{p}: config engram_num_embeddings {spec.rows} != sum of primes {rows} (§8.2)")
            for n, ts in ((f"{p}.weight", TensorSpec((spec.rows, spec.width), "F8_E4M3")),
                          (f"{p}.scale", TensorSpec((spec.rows, spec.width // 32), "F8_E8M0"))):
                claimed.add(n)
                problems += _check_tensor(n, infos.get(n), ts)
                self._tensors[n] = self._official
        for name, spec in inv.optional.items():
            if name in infos:
                claimed.add(name)
                problems += _check_tensor(name, infos[name], spec)
                self._tensors[name] = self._official
        ignorable = re.compile(r"mtp\.\d+\.(embed|head)\.weight")  # tied to the backbone (§19)
        for name in sorted(set(infos) - claimed):
            if not ignorable.fullmatch(name):
                problems.append(f"extra: {name} ({infos[name].dtype} {list(infos[name].shape)}) is not in the "
                                f"inventory of the configuration")
        return problems

    def _compose_pack(self) -> list[str]:
        """Apply 'each build's own tensors, everything else official' (weight-formats.md §2.4)."""
        pack, inv, problems = self._pack, self.inventory, []
        cfg_path = self.pack_dir / "config.json"
        if cfg_path.exists():
            try:
                self.pack_config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                problems.append(f"{cfg_path}: {e}")
            self._pack_config_sha256 = sha256_file(cfg_path)
        pqc = (self.pack_config or {}).get("quantization_config") or {}
        pack_block = (pqc.get("non_routed_quantization") or {}).get("weight_block_size") or self.fp8_block
        pack_block = tuple(int(b) for b in pack_block)
        groups: dict[str, dict[str, F.Header]] = {}
        table_names = {f"{p}.{s}" for p in inv.tables for s in ("weight", "scale")}
        for name, info in pack.infos.items():
            if name.endswith(F.BLOCK_SUFFIXES):
                p = name[:-len("_blocks")]
            else:
                p, _, suffix = name.rpartition(".")
                p = p if suffix in F.LINEAR_SUFFIXES else ""
            if p in inv.linears and name not in inv.tensors:
                groups.setdefault(p, {})[name] = info.header
            elif name in inv.tensors or name in table_names:
                off = self._official.infos[name]
                if info.shape != off.shape:
                    problems.append(f"pack {name}: shape {list(info.shape)} != official {list(off.shape)}")
                elif info.dtype != off.dtype and not (info.dtype in _FLOAT_DTYPES and off.dtype in _FLOAT_DTYPES):
                    problems.append(f"pack {name}: dtype {info.dtype} cannot replace official {off.dtype}")
                else:
                    self._tensors[name] = pack
            else:
                problems.append(f"pack {name}: has no official counterpart")
        for p, hdrs in sorted(groups.items()):
            spec = inv.linears[p]
            try:
                fmt = F.detect_linear_format(p, hdrs, pack_block)
            except F.FormatError as e:
                problems.append(f"pack {e}")
                continue
            if (fmt.out, fmt.in_) != (spec.out, spec.in_):
                problems.append(f"pack {p}: logical shape {[fmt.out, fmt.in_]} != official {[spec.out, spec.in_]}")
                continue
            if fmt.kind == "fp8" and fmt.block.rule != "config":
                problems.append(f"pack {p}: FP8 scale grid implies {fmt.block.rows}x{fmt.block.cols} blocks, "
                                f"pack block size is {list(pack_block)}")
                continue
            if fmt.kind == "exl3":
                for m, value in (("mcg", F.MCG_MARKER), ("mul1", F.MUL1_MARKER)):
                    if m in fmt.tensors:
                        got = int(pack.read(pack.infos[fmt.tensors[m]]).reshape(-1)[0])
                        if got != value:
                            problems.append(f"pack {p}.{m}: marker value {got} != {value} (§7.1)")
            self._linears[p] = (pack, fmt)
        problems += self._check_plan()
        return problems

    def _check_plan(self) -> list[str]:
        plan_path = self.pack_dir / PLAN_NAME
        exl3_experts = {p: fmt for p, (src, fmt) in self._linears.items()
                        if src is self._pack and fmt.kind == "exl3" and ".ffn.experts." in p and p.startswith("layers.")}
        if not plan_path.exists():
            return []
        self._plan_sha256 = sha256_file(plan_path)
        try:
            plan = parse_moe_plan(json.loads(plan_path.read_text()))
        except (json.JSONDecodeError, ValueError) as e:
            return [f"{plan_path}: {e}"]
        problems = []
        covered = set()
        for L, digits in sorted(plan.items()):
            n_exp = self.model_config.moe_experts(L)[0] if L < self.model_config.n_layers else None
            if n_exp is None:
                problems.append(f"{PLAN_NAME}: layer {L} is not a routed-MoE backbone layer")
                continue
            if len(digits) != n_exp:
                problems.append(f"{PLAN_NAME}: layer {L} has {len(digits)} digits, the layer has {n_exp} experts")
            for e, k in enumerate(digits[:n_exp]):
                prefixes = [f"layers.{L}.ffn.experts.{e}.{w}" for w in ("w1", "w2", "w3")]
                found = [p for p in prefixes if p in exl3_experts]
                covered |= set(found)
                if not found:
                    problems.append(f"{PLAN_NAME}: layer {L} expert {e} planned at K={k}, but the pack has no "
                                    f"EXL3 tensors for it")
                for p in found:
                    if exl3_experts[p].k2 != 2 * k:
                        problems.append(f"{PLAN_NAME}: layer {L} expert {e} planned at K={k}, {p}.trellis has "
                                        f"K={exl3_experts[p].k2 / 2} (width {16 * exl3_experts[p].k2 // 2})")
        for p in sorted(set(exl3_experts) - covered):
            problems.append(f"{PLAN_NAME}: EXL3 expert {p} is not covered by the plan")
        return problems

    # ---- inventory --------------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Every tensor of the composed build (pack tensors replace their official counterparts)."""
        names = set(self._tensors)
        for p, (_, fmt) in self._linears.items():
            names |= set(fmt.tensors.values())
        return sorted(names)

    def source_of(self, prefix_or_name: str) -> str:
        src = self._linears[prefix_or_name][0] if prefix_or_name in self._linears else self._tensors[prefix_or_name]
        return src.role

    def manifest(self) -> dict:
        """Per linear prefix: source, file, format (and K / codebook for EXL3); per other tensor: source
        (weight-formats.md §2.4 rule 6)."""
        lin = {}
        for p, (src, fmt) in sorted(self._linears.items()):
            first = src.infos[next(iter(fmt.tensors.values()))]
            lin[p] = {"source": src.role, "file": first.file.name, **fmt.describe()}
        ten = {n: {"source": src.role, "file": src.infos[n].file.name} for n, src in sorted(self._tensors.items())}
        return {"linears": lin, "tensors": ten}

    # ---- reading ----------------------------------------------------------------------------------------

    def release_file_handles(self) -> None:
        """Drop the open shard files (each an mmap of a whole shard, whose mapped pages count toward RSS); the
        next read opens them again. A layer-streamed runner calls it after each stage."""
        for folder in (self._official, self._pack):
            if folder is not None:
                folder.release_handles()

    def byte_ranges(self, prefix: str) -> list[tuple[Path, int, int]]:
        """(file, begin, end) of the stored bytes a load of ``prefix`` reads (a layer ``"layers.3"``, or one
        exact tensor name), in file order: for readahead. Engram tables are left out (read by rows)."""
        pre = prefix + "."
        ranges = []
        for p, (src, fmt) in self._linears.items():
            if p == prefix or p.startswith(pre):
                ranges += [(i.file, i.begin, i.end) for i in (src.infos[n] for n in fmt.tensors.values())]
        for n, src in self._tensors.items():
            if (n == prefix or n.startswith(pre)) and n.rsplit(".", 1)[0] not in self.inventory.tables:
                i = src.infos[n]
                ranges.append((i.file, i.begin, i.end))
        return sorted(ranges)

    def _read(self, src: ShardFolder, name: str) -> torch.Tensor:
        t = src.read(src.infos[name])
        self._loaded[name] = hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        return t

    def load_linear(self, prefix: str, buffers: "OutputBuffers | None" = None) -> torch.Tensor:
        """Exact fp32 ``[out, in]`` of one linear, whatever its format; decoded into an array from
        `buffers` when given (a runner's pool of the previous layer's arrays)."""
        try:
            src, fmt = self._linears[prefix]
        except KeyError:
            raise KeyError(f"{prefix!r} is not a linear of this build") from None
        raw = {role: self._read(src, name) for role, name in fmt.tensors.items()}
        try:
            w = F.decode_linear(fmt, raw, None if buffers is None else buffers.take((fmt.out, fmt.in_)))
        except F.FormatError as e:
            raise CheckpointError(f"{src.role} {prefix}", [str(e)]) from e
        _check_finite(prefix, w, src)
        return w

    def load_tensor(self, name: str) -> torch.Tensor:
        """Exact fp32 copy of one non-linear tensor (norms, hc parameters, embed, ...)."""
        if name.endswith(".weight") and name[:-7] in self.inventory.tables:
            return self.load_table(name[:-7])
        try:
            src = self._tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a non-linear tensor of this build") from None
        t = self._read(src, name).to(torch.float32)
        _check_finite(name, t, src)
        return t

    def load_table(self, prefix: str) -> torch.Tensor:
        """A whole Engram table in fp32 (tiny checkpoints; use ``engram_rows`` for real ones)."""
        w, s = (self._read(self._tensors[f"{prefix}.{n}"], f"{prefix}.{n}") for n in ("weight", "scale"))
        t = F.engram_rows_dequant(w, s)
        _check_finite(prefix, t, self._tensors[f"{prefix}.weight"])
        return t

    def engram_rows(self, layer: int | str, rows) -> torch.Tensor:
        """fp32 rows ``[n, width]`` of an Engram table, reading only those rows (§6: ~98 GB tables)."""
        prefix = f"layers.{layer}.engram.embed" if isinstance(layer, int) else layer
        if prefix not in self.inventory.tables:
            raise KeyError(f"{prefix!r} is not an Engram table")
        rows = torch.as_tensor(rows, dtype=torch.int64)
        n_rows = self.inventory.tables[prefix].rows
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n_rows):
            raise IndexError(f"{prefix}: row ids must lie in [0, {n_rows}), got [{int(rows.min())}, {int(rows.max())}]")
        uniq = torch.unique(rows)
        ws = self._tensors[f"{prefix}.weight"]
        wi, si = ws.infos[f"{prefix}.weight"], self._tensors[f"{prefix}.scale"].infos[f"{prefix}.scale"]
        if not uniq.numel():
            return torch.empty(0, self.inventory.tables[prefix].width)
        # pread of exactly each row's bytes (1-byte formats: a row of the weight, a row of the scale), on
        # descriptors with readahead off: a page fault on a mapped table would read ~128 KiB around each
        # 256-byte row (the kernel's read-around), ~500x the bytes needed from a 189 GB table
        got_w = np.empty((uniq.numel(), wi.shape[1]), dtype=np.uint8)
        got_s = np.empty((uniq.numel(), si.shape[1]), dtype=np.uint8)
        seen = self._rows_read.setdefault(prefix, {})
        try:
            with RandomReads() as fds:
                for i, r in enumerate(uniq.tolist()):
                    got_w[i] = fds.pread(wi.file, wi.begin + r * wi.shape[1], wi.shape[1])
                    got_s[i] = fds.pread(si.file, si.begin + r * si.shape[1], si.shape[1])
                    seen[r] = hashlib.sha256(got_w[i].tobytes() + got_s[i].tobytes()).hexdigest()
        except ShortRead as e:
            raise CheckpointError(str(e.path), [e.detail]) from e
        table = F.engram_rows_dequant(torch.from_numpy(got_w), torch.from_numpy(got_s))
        _check_finite(prefix, table, ws)
        return table[torch.searchsorted(uniq, rows.reshape(-1))].reshape(*rows.shape, -1)

    def _entries(self, prefix: str, experts: bool, tables: bool) -> dict[str, tuple[str, str]]:
        """Relative name -> (kind, full name) of everything under ``prefix``."""
        pre = prefix + "." if prefix else ""
        out = {}
        for p in self._linears:
            if p.startswith(pre) and (experts or ".ffn.experts." not in "." + p):
                out[p[len(pre):] + ".weight"] = ("linear", p)
        for n in self._tensors:
            if n.startswith(pre):
                tab = n.rsplit(".", 1)[0]
                if tab in self.inventory.tables:
                    if tables and n.endswith(".weight"):
                        out[n[len(pre):]] = ("table", tab)
                else:
                    out[n[len(pre):]] = ("tensor", n)
        return out

    def _load_entry(self, kind: str, name: str, buffers: "OutputBuffers | None" = None) -> torch.Tensor:
        if kind == "linear":
            return self.load_linear(name, buffers)
        return {"table": self.load_table, "tensor": self.load_tensor}[kind](name)

    def load_fp32(self, prefix: str, *, experts: bool = True, tables: bool = True,
                  buffers: "OutputBuffers | None" = None) -> dict[str, torch.Tensor]:
        """Exact fp32 weights of everything under ``prefix`` (a layer, ``mtp.S``, or a module), with names
        relative to ``prefix.``; linears appear as ``<rel>.weight`` in ``[out, in]`` whatever their format.
        ``experts=False`` skips routed experts and ``tables=False`` the Engram tables (real-size loads:
        use ``load_expert`` / ``engram_rows`` / ``lazy``)."""
        entries = self._entries(prefix, experts, tables)
        if not entries:
            raise KeyError(f"no tensors under {prefix!r}")
        return {rel: self._load_entry(kind, name, buffers) for rel, (kind, name) in sorted(entries.items())}

    def load_layer(self, layer: int, **kw) -> dict[str, torch.Tensor]:
        """``load_fp32("layers.{layer}")``: names relative to ``layers.{layer}.``."""
        return self.load_fp32(f"layers.{layer}", **kw)

    def load_mtp(self, stage: int, **kw) -> dict[str, torch.Tensor]:
        return self.load_fp32(f"mtp.{stage}", **kw)

    def load_top(self, *, vision: bool = False) -> dict[str, torch.Tensor]:
        """Top-level tensors (``embed.weight``, ``head.weight``, ``norm.weight``; vision/aligner on request)."""
        skip = ("layers.", "mtp.") + (() if vision else ("vision.", "aligner.", "image_"))
        return {rel: self._load_entry(kind, name) for rel, (kind, name) in sorted(self._entries("", True, True).items())
                if not rel.startswith(skip)}

    def load_expert(self, layer: int | str, expert: int, buffers: "OutputBuffers | None" = None) -> dict[str, torch.Tensor]:
        """``{"w1": .., "w2": .., "w3": ..}`` fp32 of one routed expert (``layer`` an int or ``"mtp.S"``)."""
        base = f"layers.{layer}" if isinstance(layer, int) else layer
        return {w: self.load_linear(f"{base}.ffn.experts.{expert}.{w}", buffers) for w in ("w1", "w2", "w3")}

    def lazy(self, prefix: str) -> "LazyWeights":
        """A read-only Mapping of the same names as ``load_fp32(prefix)`` that decodes on first access."""
        return LazyWeights(self, prefix)

    def check_values(self) -> None:
        """Read every tensor of the build and raise one CheckpointError listing every non-finite one."""
        problems = []
        for rel, (kind, name) in sorted(self._entries("", True, True).items()):
            try:
                self._load_entry(kind, name)
            except CheckpointError as e:
                problems += e.problems
        if problems:
            raise CheckpointError(f"checkpoint {self.dir}", problems)

    # ---- provenance ---------------------------------------------------------------------------------------

    def provenance(self) -> dict:
        """What this build is and exactly what has been read from it so far (weight-formats.md §2.4 rule 6)."""
        def folder(f: ShardFolder | None):
            if f is None:
                return None
            files = sorted({i.file for i in f.infos.values()})
            return {"dir": str(f.dir), "index_sha256": f.index_sha256,
                    "shards": {p.name: p.stat().st_size for p in files}}

        inventory = hashlib.sha256()
        for name in self.tensor_names():
            src = self._linears_src_of(name)
            i = src.infos[name]
            inventory.update(f"{name}|{src.role}|{i.file.name}|{i.dtype}|{list(i.shape)}|{i.begin}|{i.end}\n".encode())
        manifest = self.manifest()
        return {
            "format": PROVENANCE_FORMAT,
            "official": folder(self._official) | {"config_sha256": self._config_sha256},
            "pack": None if self._pack is None else folder(self._pack) | {
                "config_sha256": self._pack_config_sha256, "plan_sha256": self._plan_sha256},
            "fp8_block": list(self.fp8_block),
            "inventory_sha256": inventory.hexdigest(),
            "manifest_sha256": hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest(),
            "pack_prefixes": sorted(p for p, v in manifest["linears"].items() if v["source"] == "pack")
            + sorted(n for n, v in manifest["tensors"].items() if v["source"] == "pack"),
            "loaded": dict(sorted(self._loaded.items())),
            "engram_rows": {t: hashlib.sha256(json.dumps(sorted(r.items())).encode()).hexdigest()
                            for t, r in sorted(self._rows_read.items())},
        }

    def _linears_src_of(self, name: str) -> ShardFolder:
        if name in self._tensors:
            return self._tensors[name]
        p = name[:-len("_blocks")] if name.endswith(F.BLOCK_SUFFIXES) else name.rpartition(".")[0]
        return self._linears[p][0]

    def loaded_digests(self) -> dict[str, str]:
        """``provenance()["loaded"]`` alone (tensor name -> SHA-256 of its stored bytes, for every tensor read
        so far), without rebuilding the inventory and manifest digests (a runner asks after every stage)."""
        return dict(sorted(self._loaded.items()))

    def provenance_hash(self) -> str:
        """SHA-256 of ``provenance()`` without folder paths: the build's identity (config, index, plan, every
        header) plus the digest of every tensor read so far, independent of where the folders live."""
        prov = self.provenance()
        for side in ("official", "pack"):
            if prov[side] is not None:
                prov[side] = {k: v for k, v in prov[side].items() if k != "dir"}
        return hashlib.sha256(json.dumps(prov, sort_keys=True).encode()).hexdigest()


class LazyWeights(Mapping):
    """Names as in ``Checkpoint.load_fp32(prefix)``; each value decoded on first access and cached."""

    def __init__(self, ckpt: Checkpoint, prefix: str):
        self._ck, self._entries = ckpt, ckpt._entries(prefix, True, True)
        self._cache: dict[str, torch.Tensor] = {}

    def __getitem__(self, rel: str) -> torch.Tensor:
        if rel not in self._cache:
            kind, name = self._entries[rel]  # KeyError for unknown names, as a dict would
            self._cache[rel] = self._ck._load_entry(kind, name)
        return self._cache[rel]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def evict(self, names: Iterable[str] | None = None) -> None:
        for n in list(self._cache) if names is None else names:
            self._cache.pop(n, None)


def _check_tensor(name: str, info: TensorInfo | None, spec: TensorSpec) -> list[str]:
    if info is None:
        return [f"missing: {name} ({spec.dtype} {list(spec.shape)})"]
    out = []
    if info.dtype not in spec.dtype.split("|"):  # "I32|I64": either integer width is accepted
        out.append(f"{name}: dtype {info.dtype}, expected {spec.dtype} (wrong dtype)")
    if info.shape != spec.shape:
        out.append(f"{name}: shape {list(info.shape)}, expected {list(spec.shape)} (wrong shape)")
    return out


def _check_finite(name: str, t: torch.Tensor, src: ShardFolder) -> None:
    # min and max propagate NaN and show ±inf, so both finite <=> every value finite; ~25x cheaper than
    # isfinite().all() (no bool tensor), and this runs on every decoded weight
    if t.numel() == 0 or all(bool(torch.isfinite(v)) for v in torch.aminmax(t)):
        return
    bad = ~torch.isfinite(t)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise CheckpointError(f"{src.role} {src.dir}", [f"{name}: {int(bad.sum())} non-finite value(s) after exact "
                                                         f"decode (first at {idx})"])

"""The oracle kinds, each registered once: what a reference is built by, named by, computed in, and captured with.

    kind = oracle_kind("deepseek")                  # or oracle_kind_of(model_dir) for a model folder
    ident = kind.identity(model_dir)                 # what names its reference (weights hash / checkpoint hash)
    record = kind.oracle(ident, work, precision="fp32", top_k=256).score(encoded_panel)   # the Oracle seam
    floor = kind.capturer(model_dir, kind.floor_precision("bfloat16"))   # the localizer's noise-floor run

Two kinds: ``transformers`` (oracle/hf.py, any fp32 transformers model folder) and ``deepseek`` (oracle/dsv41,
the layer-streamed DeepSeek-V4 / V4.1 oracle; the architecture inside is chosen by ``dsv41.arch``). Everything
that would otherwise branch on the kind's name — the gate pipeline, ``ds41gate oracle``, the profile's
``[gate] oracle`` key, the localizer — asks the kind instead. Importing this module is cheap (no torch): the
profile parser validates against it.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from core.errors import UserError


class OracleKindError(UserError, ValueError):
    """An oracle kind or precision that is not registered, or a model folder no kind can load."""


@dataclass(frozen=True)
class OracleIdentity:
    """What names a reference of this kind (``value``, a hash of what the oracle loads) and the handle its run
    reuses (``loaded``: the opened DeepSeek checkpoint; None for transformers, which loads at score time)."""

    kind: str
    value: str
    loaded: Any = None


class Capturer(Protocol):
    """The localizer's oracle side at one precision: per-site activations of one prompt (oracle/capture.py)."""

    load_s: float
    forward_s: float
    info: dict

    def capture(self, ids: Sequence[int], layers: Sequence[int] | None = None,
                spill: Path | None = None) -> Mapping: ...


@dataclass(frozen=True)
class OracleKind(ABC):
    """One registered oracle. ``gate_precisions``: the precisions a gate reference is built in (the KL panel gate
    compares against the fp32 oracle only; another precision is a floor, not a reference). ``run_precisions``:
    what ``ds41gate oracle run --precision`` may ask of it. ``capture_precisions``: what the localizer's capture
    computes in. ``identity_field``: the provenance key that carries ``identity(...).value``."""

    name: str
    summary: str
    identity_field: str
    gate_precisions: tuple[str, ...]
    run_precisions: tuple[str, ...]
    capture_precisions: tuple[str, ...]
    long_context: bool = field(default=False)   # has a chunked long-context reference (ensure_long_reference)
    # scores a panel layer by layer over a checkpoint, so it can be sharded, clustered, spilled and packed
    # (`ds41gate oracle run`'s --shard/--cluster/--spill/--pack/...); otherwise it scores whole panels in memory
    layer_streamed: bool = field(default=False)

    def check_gate_precision(self, precision: str, where: str = "precision") -> str:
        if precision not in self.gate_precisions:
            raise OracleKindError(f"{where} {precision!r}: the {self.name} oracle's gate reference is built in "
                                  f"{self.gate_precisions}")
        return precision

    @abstractmethod
    def claims(self, config: Mapping[str, Any]) -> bool:
        """Whether a model folder with this config.json belongs to this kind (``oracle_kind_of``)."""

    @abstractmethod
    def floor_precision(self, engine_dtype: str) -> str:
        """The precision of the oracle's own run that an honest engine computing in ``engine_dtype`` may differ
        from the fp32 oracle like (the localizer's per-layer noise floor)."""

    @abstractmethod
    def identity(self, model_dir: Path) -> OracleIdentity:
        """Read what the oracle loads from ``model_dir`` far enough to name it."""

    @abstractmethod
    def oracle(self, identity: OracleIdentity | None, model_dir: Path, work: Path, *, precision: str = "fp32",
               top_k: int = 256, threads: int = 1, progress: bool = False, full_logprobs: bool = False):
        """The ``oracle.seam.Oracle`` over ``model_dir``: ``.score(encoded_panel) -> Record``, resumable through
        ``work`` (per-sequence scores or per-layer activations; the caller removes it once the record is saved).
        ``identity``: what ``identity(model_dir)`` returned, so what it opened is reused (None: opened here)."""

    @abstractmethod
    def capturer(self, model_dir: Path, precision: str, base: Capturer | None = None) -> Capturer:
        """The localizer's capture at ``precision``; ``base``: a capturer of the same folder whose load may be
        copied instead of loading (and hashing) the weights again."""

    def check_long_context(self) -> "OracleKind":
        if not self.long_context:
            raise OracleKindError(f"the long-context reference needs an oracle that has one "
                                  f"({long_context_kinds()}); this target uses {self.name!r}")
        return self

    def long_reference(self, identity: OracleIdentity, panel, out: Path, work: Path, *, precision: str = "fp32",
                       top_k: int = 256, threads: int = 1):
        """The long-context reference of ``panel`` written to ``out`` (chunked prefill, logits only at scored
        positions, per-position mechanism masks), resumable through ``work``; only a kind with ``long_context``."""
        self.check_long_context()
        raise NotImplementedError(self.name)


# ------------------------------------------------------------------------------------------ transformers

class _HFCapturer:
    """Captures through one transformers load at one precision, loaded on the first capture (a copy of
    ``base``'s load when given)."""

    def __init__(self, model_dir: Path, precision: str, base: "_HFCapturer | None"):
        self.model_dir, self.precision, self.base = model_dir, precision, base
        self._loaded = None
        self.load_s = self.forward_s = 0.0
        self.info: dict = {}

    def capture(self, ids, layers=None, spill=None) -> Mapping:
        from oracle.capture import capture_hf, load_hf

        if self._loaded is None:
            t = time.perf_counter()
            base = self.base._loaded if isinstance(self.base, _HFCapturer) else None
            self._loaded = load_hf(self.model_dir, self.precision, base=base)
            self.load_s += time.perf_counter() - t
        acts, self.info = capture_hf(self.model_dir, ids, self.precision, layers=layers, oracle=self._loaded,
                                     spill=spill)
        self.forward_s += self.info["forward_s"]
        return acts


@dataclass(frozen=True)
class TransformersKind(OracleKind):
    def claims(self, config: Mapping[str, Any]) -> bool:
        return not DEEPSEEK.claims(config)

    def floor_precision(self, engine_dtype: str) -> str:
        # an fp32 engine may differ like the fp32 oracle's own rounding (seen against fp64); any other like bf16
        return "fp64" if engine_dtype in ("float32", "float", "fp32") else "bf16"

    def identity(self, model_dir: Path) -> OracleIdentity:
        from oracle.hf import model_hash

        return OracleIdentity(self.name, model_hash(model_dir))

    def oracle(self, identity, model_dir, work, *, precision="fp32", top_k=256, threads=1, progress=False,
               full_logprobs=False):
        from oracle.hf import HFPanelOracle

        _check(self, precision, self.run_precisions, "precision")
        return HFPanelOracle(Path(model_dir), top_k=top_k, full_vocab=full_logprobs, threads=threads,
                             checkpoint_dir=Path(work), progress=progress)

    def capturer(self, model_dir, precision, base=None) -> Capturer:
        _check(self, precision, self.capture_precisions, "capture precision")
        return _HFCapturer(Path(model_dir), precision, base)


# ------------------------------------------------------------------------------------------ DeepSeek

class _DeepSeekCapturer:
    """Captures through the DeepSeek oracle's in-memory model; the checkpoint is read on each capture (the
    localizer runs one prompt per precision)."""

    def __init__(self, model_dir: Path, precision: str):
        self.model_dir, self.precision = model_dir, precision
        self.load_s = self.forward_s = 0.0
        self.info: dict = {}

    def capture(self, ids, layers=None, spill=None) -> Mapping:
        from oracle.capture import capture_dsv41

        acts, self.info = capture_dsv41(self.model_dir, ids, self.precision, layers=layers, spill=spill)
        self.load_s += self.info["load_s"]
        self.forward_s += self.info["forward_s"]
        return acts


@dataclass(frozen=True)
class DeepSeekKind(OracleKind):
    def claims(self, config: Mapping[str, Any]) -> bool:
        # DeepSeek's inference config has no model_type; a transformers-style one names a deepseek* type
        model_type = config.get("model_type")
        return model_type is None or str(model_type).lower().startswith("deepseek")

    def floor_precision(self, engine_dtype: str) -> str:
        # the reference implementation's own dtypes and order (docs/ORACLE.md), whatever the engine computes in
        return "reference-bf16"

    def identity(self, model_dir: Path) -> OracleIdentity:
        from oracle.dsv41.checkpoint import Checkpoint
        from oracle.dsv41.runner import checkpoint_identity

        ck = Checkpoint(Path(model_dir))
        return OracleIdentity(self.name, checkpoint_identity(ck), ck)

    def oracle(self, identity, model_dir, work, *, precision="fp32", top_k=256, threads=1, progress=False,
               full_logprobs=False):
        from oracle.dsv41.checkpoint import Checkpoint
        from oracle.dsv41.runner import DSV41Oracle, RunOptions

        _check(self, precision, self.run_precisions, "precision")
        ck = identity.loaded if identity is not None else Checkpoint(Path(model_dir))
        return DSV41Oracle(ck, Path(work), RunOptions(precision=precision, threads=threads, top_k=top_k,
                                                      progress=progress, full_logprobs=full_logprobs))

    def capturer(self, model_dir, precision, base=None) -> Capturer:
        _check(self, precision, self.capture_precisions, "capture precision")
        return _DeepSeekCapturer(Path(model_dir), precision)

    def long_reference(self, identity, panel, out, work, *, precision="fp32", top_k=256, threads=1):
        from oracle.dsv41.long_context import LongOptions, run_long_to_file

        _check(self, precision, self.run_precisions, "precision")
        return run_long_to_file(identity.loaded, panel, Path(out), Path(work),
                                LongOptions(precision=precision, threads=threads, top_k=top_k))


def _check(kind: OracleKind, precision: str, allowed: tuple[str, ...], what: str) -> None:
    if precision not in allowed:
        raise OracleKindError(f"{what} {precision!r}: the {kind.name} oracle computes in {allowed}")


# ------------------------------------------------------------------------------------------ the registry

TRANSFORMERS = TransformersKind(
    name="transformers", summary="generic fp32 transformers oracle (oracle/hf.py)", identity_field="model_hash",
    gate_precisions=("fp32",), run_precisions=("fp32",), capture_precisions=("fp32", "bf16", "fp64"))
DEEPSEEK = DeepSeekKind(
    name="deepseek", summary="layer-streamed DeepSeek-V4 / V4.1 oracle (oracle/dsv41)",
    identity_field="checkpoint_hash", gate_precisions=("fp32",), run_precisions=("fp32", "reference-bf16"),
    capture_precisions=("fp32", "reference-bf16"), long_context=True, layer_streamed=True)

ORACLE_KINDS: Mapping[str, OracleKind] = {k.name: k for k in (TRANSFORMERS, DEEPSEEK)}


def oracle_kind(name: str, where: str = "oracle") -> OracleKind:
    """The registered kind ``name``; anything else is a one-line error naming ``where`` and the kinds."""
    try:
        return ORACLE_KINDS[name]
    except (KeyError, TypeError):
        raise OracleKindError(f"{where} {name!r}: expected one of {sorted(ORACLE_KINDS)}") from None


def long_context_kinds() -> list[str]:
    return [k.name for k in ORACLE_KINDS.values() if k.long_context]


def oracle_kind_of(model_dir: Path) -> OracleKind:
    """The kind a model folder belongs to, by its config.json (a DeepSeek checkpoint, else transformers); a
    folder without a readable JSON-object config.json is a named error."""
    cfg_path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OracleKindError(f"{cfg_path}: no config.json: --checkpoint must be a model folder (a DeepSeek "
                              "checkpoint or a transformers model directory)") from None
    except (OSError, ValueError) as exc:
        raise OracleKindError(f"{cfg_path}: cannot read the model config ({exc})") from None
    if not isinstance(cfg, dict):
        raise OracleKindError(f"{cfg_path}: the model config must be a JSON object")
    return next(k for k in ORACLE_KINDS.values() if k.claims(cfg))

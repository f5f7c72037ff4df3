"""The kernel registry (``registry.toml``): which engine function implements which oracle primitive, how to
call it, which VLLM_DS41_* flag switches it, and per-output tolerances (the gate's verdict applies them: gates/lib/kernels.py). Parsing is strict: every problem
raises ``RegistryError`` naming the file, the entry and the field."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError
from core.tomlfile import read_toml

FORMAT = "ds41-kernel-registry/1"
DEVICES = ("cpu", "gpu-only")
STATUSES = ("active", "unbound")
SHAPES = ("tiny", "production")
PERTURBATIONS = ("ulp+1", "ulp+2", "ulp+3")
DEFAULT_PATH = Path(__file__).with_name("registry.toml")


class RegistryError(UserError, ValueError):
    """The kernel registry file is malformed, or names a kernel / case / tolerance that does not exist."""


@dataclass(frozen=True)
class Tolerance:
    """Per-output tolerance. ``exact``: every element bit-identical to the oracle rounded to the output
    dtype. Otherwise an element passes when its ULP distance (in the output dtype) is <= ``max_ulp`` or its
    absolute error is <= ``atol`` or <= ``row_rtol`` times the largest |oracle| value of its row (the last
    two for values near zero after cancellation, where a ULP count says nothing)."""

    exact: bool = False
    max_ulp: int = 0
    atol: float = 0.0
    row_rtol: float = 0.0  # |error| <= row_rtol * max|oracle| over the element's row (last dim)

    def __post_init__(self):
        if self.max_ulp < 0 or self.atol < 0 or self.row_rtol < 0:
            raise ValueError(f"tolerance: max_ulp ({self.max_ulp}), atol ({self.atol}) and row_rtol "
                             f"({self.row_rtol}) must be >= 0")


@dataclass(frozen=True)
class EngineEnv:
    name: str
    python: str  # interpreter of the engine's environment ({cache} expands to the ds41 cache dir)
    notes: str = ""

    def resolved_python(self, cache: Path) -> Path:
        return Path(os.path.expanduser(self.python.replace("{cache}", str(cache))))


@dataclass(frozen=True)
class KernelEntry:
    name: str
    primitive: str  # the oracle primitive (a case in engine.kernels.cases)
    engine: str
    target: str  # "module.path:attribute"; "" when unbound
    adapter: str  # call adapter in engine.kernels.runner
    flag: str  # the VLLM_DS41_* flag that switches this kernel in the target engine
    device: str = "cpu"
    status: str = "active"
    shapes: tuple[str, ...] = SHAPES
    tolerance: dict[str, Tolerance] = field(default_factory=dict)
    test_only: bool = False
    perturb: dict[str, str] = field(default_factory=dict)  # output -> perturbation (test-only entries)
    expect_violation: bool = False
    known_issue: dict[str, str] = field(default_factory=dict)  # output -> a measured, understood violation
    notes: str = ""

    @property
    def runnable_on_cpu(self) -> bool:
        return self.status == "active" and self.device == "cpu"


@dataclass(frozen=True)
class Registry:
    path: str
    engines: dict[str, EngineEnv]
    kernels: tuple[KernelEntry, ...]

    def for_engine(self, engine: str, include_test_only: bool = True) -> list[KernelEntry]:
        return [k for k in self.kernels if k.engine == engine and (include_test_only or not k.test_only)]

    def get(self, name: str) -> KernelEntry:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(f"kernel registry {self.path}: no entry named {name!r}")


def _req(d: dict, key: str, typ, where: str):
    if key not in d:
        raise RegistryError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise RegistryError(f"{where}: field {key!r} must be {typ.__name__}, got {type(v).__name__} {v!r}")
    return v


def _opt(d: dict, key: str, typ, default, where: str):
    return _req(d, key, typ, where) if key in d else default


def _tolerance(d: dict, where: str) -> Tolerance:
    unknown = set(d) - {"exact", "max_ulp", "atol", "row_rtol"}
    if unknown:
        raise RegistryError(f"{where}: unknown tolerance field(s) {sorted(unknown)}")
    exact = _opt(d, "exact", bool, False, where)
    if exact and set(d) - {"exact"}:
        raise RegistryError(f"{where}: an exact tolerance takes no max_ulp/atol/row_rtol")
    if not exact and not set(d) & {"max_ulp", "atol", "row_rtol"}:
        raise RegistryError(f"{where}: a non-exact tolerance needs max_ulp, atol and/or row_rtol")
    num = {}
    for key in ("atol", "row_rtol"):
        v = d.get(key, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RegistryError(f"{where}: field {key!r} must be a number, got {v!r}")
        num[key] = float(v)
    try:
        return Tolerance(exact=exact, max_ulp=_opt(d, "max_ulp", int, 0, where), **num)
    except ValueError as e:
        raise RegistryError(f"{where}: {e}") from None


_KERNEL_FIELDS = {"name", "primitive", "engine", "target", "adapter", "flag", "device", "status", "shapes",
                  "tolerance", "test_only", "perturb", "expect_violation", "known_issue", "notes"}


def parse_registry(doc: dict, path: str = "<registry>") -> Registry:
    fmt = doc.get("format")
    if fmt != FORMAT:
        raise RegistryError(f"{path}: format {fmt!r}, expected {FORMAT!r}")
    engines = {}
    for name, e in (doc.get("engines") or {}).items():
        where = f"{path}: engines.{name}"
        engines[name] = EngineEnv(name, _req(e, "python", str, where), _opt(e, "notes", str, "", where))
    kernels, seen = [], set()
    for i, k in enumerate(doc.get("kernel") or []):
        where = f"{path}: kernel[{i}] ({k.get('name', '?')})"
        unknown = set(k) - _KERNEL_FIELDS
        if unknown:
            raise RegistryError(f"{where}: unknown field(s) {sorted(unknown)}")
        name = _req(k, "name", str, where)
        if name in seen:
            raise RegistryError(f"{where}: duplicate kernel name {name!r}")
        seen.add(name)
        engine = _req(k, "engine", str, where)
        device = _opt(k, "device", str, "cpu", where)
        status = _opt(k, "status", str, "active", where)
        flag = _req(k, "flag", str, where)
        target = _opt(k, "target", str, "", where)
        if device not in DEVICES:
            raise RegistryError(f"{where}: device {device!r} not in {DEVICES}")
        if status not in STATUSES:
            raise RegistryError(f"{where}: status {status!r} not in {STATUSES}")
        if not flag.startswith("VLLM_DS41_"):
            raise RegistryError(f"{where}: flag {flag!r} is not a VLLM_DS41_* name")
        if status == "active" and (":" not in target or target.startswith(":") or target.endswith(":")):
            raise RegistryError(f"{where}: target {target!r} must be 'module.path:attribute'")
        if engine not in engines and device == "cpu" and status == "active":
            raise RegistryError(f"{where}: engine {engine!r} has no [engines.{engine}] environment")
        shapes = tuple(_opt(k, "shapes", list, list(SHAPES), where))
        bad = [s for s in shapes if s not in SHAPES]
        if bad or not shapes:
            raise RegistryError(f"{where}: shapes {list(shapes)} must be a non-empty subset of {SHAPES}")
        tols = {out: _tolerance(t, f"{where}: tolerance.{out}")
                for out, t in _opt(k, "tolerance", dict, {}, where).items()}
        if status == "active" and not tols:
            raise RegistryError(f"{where}: an active kernel needs at least one [tolerance.<output>]")
        test_only = _opt(k, "test_only", bool, False, where)
        perturb = dict(_opt(k, "perturb", dict, {}, where))
        for out, p in perturb.items():
            if p not in PERTURBATIONS:
                raise RegistryError(f"{where}: perturb.{out} = {p!r} not in {PERTURBATIONS}")
            if out not in tols:
                raise RegistryError(f"{where}: perturb.{out} names an output without a tolerance")
        known = dict(_opt(k, "known_issue", dict, {}, where))
        for out, text in known.items():
            if out not in tols or not isinstance(text, str) or not text:
                raise RegistryError(f"{where}: known_issue.{out} must name a toleranced output and explain it")
        if perturb and not test_only:
            raise RegistryError(f"{where}: perturb is only allowed on test_only entries")
        kernels.append(KernelEntry(
            name=name, primitive=_req(k, "primitive", str, where), engine=engine, target=target,
            adapter=_req(k, "adapter", str, where), flag=flag, device=device, status=status, shapes=shapes,
            tolerance=tols, test_only=test_only, perturb=perturb,
            expect_violation=_opt(k, "expect_violation", bool, False, where),
            known_issue=known, notes=_opt(k, "notes", str, "", where)))
    return Registry(path=path, engines=engines, kernels=tuple(kernels))


def load_registry(path: str | Path = DEFAULT_PATH) -> Registry:
    return parse_registry(read_toml(path, "kernel registry", RegistryError), str(path))

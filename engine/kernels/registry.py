"""The kernel registry (``registry.toml``): which engine function implements which oracle primitive, how to
call it, which VLLM_DS41_* flag switches it, and per-output tolerances (the gate's verdict applies them:
gates/lib/kernels.py). Parsing is strict (the schema `RegistryFile`, core/schema.py): every problem raises
``RegistryError`` naming the file, the entry and the field."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from core.errors import UserError
from core.schema import STRICT, Problem, Seq, StrictModel, parse_model, value_at
from core.tomlfile import read_toml

FORMAT = "ds41-kernel-registry/1"
DEVICES = ("cpu", "gpu-only")
STATUSES = ("active", "unbound")
SHAPES = ("tiny", "production")
PERTURBATIONS = ("ulp+1", "ulp+2", "ulp+3")
DEFAULT_PATH = Path(__file__).with_name("registry.toml")
_BOUNDS = ("max_ulp", "atol", "row_rtol")


class RegistryError(UserError, ValueError):
    """The kernel registry file is malformed, or names a kernel / case / tolerance that does not exist."""


@pydantic.dataclasses.dataclass(frozen=True, config=STRICT)
class Tolerance:
    """Per-output tolerance. ``exact``: every element bit-identical to the oracle rounded to the output
    dtype. Otherwise an element passes when its ULP distance (in the output dtype) is <= ``max_ulp`` or its
    absolute error is <= ``atol`` or <= ``row_rtol`` times the largest |oracle| value of its row (the last
    two for values near zero after cancellation, where a ULP count says nothing)."""

    exact: StrictBool = False
    max_ulp: Annotated[StrictInt, Field(ge=0)] = 0
    atol: Annotated[StrictFloat, Field(ge=0)] = 0.0
    row_rtol: Annotated[StrictFloat, Field(ge=0)] = 0.0  # |error| <= row_rtol * max|oracle| over the row (last dim)

    @model_validator(mode="before")
    @classmethod
    def _exact_or_bounded(cls, data: Any) -> Any:
        # a table (the file) says which bounds it sets: exact sets none, a non-exact one at least one
        if isinstance(data, dict):
            bounds = set(data) & set(_BOUNDS)
            if data.get("exact") is True and bounds:
                raise ValueError("an exact tolerance takes no max_ulp/atol/row_rtol")
            if data.get("exact") is not True and not bounds:
                raise ValueError("a non-exact tolerance needs max_ulp, atol and/or row_rtol")
        return data


@dataclass(frozen=True)
class EngineEnv:
    name: str
    python: str  # interpreter of the engine's environment ({cache} expands to the ds41 cache dir)
    notes: str = ""

    def resolved_python(self, cache: Path) -> Path:
        return Path(os.path.expanduser(self.python.replace("{cache}", str(cache))))


@pydantic.dataclasses.dataclass(frozen=True, config=STRICT)
class KernelEntry:
    name: StrictStr
    primitive: StrictStr  # the oracle primitive (a case in engine.kernels.cases)
    engine: StrictStr
    adapter: StrictStr  # call adapter in engine.kernels.runner
    flag: Annotated[StrictStr, Field(pattern=r"^VLLM_DS41_")]  # the flag that switches this kernel in the engine
    target: StrictStr = ""  # "module.path:attribute"; "" when unbound
    device: Literal["cpu", "gpu-only"] = "cpu"
    status: Literal["active", "unbound"] = "active"
    shapes: Annotated[tuple[Literal["tiny", "production"], ...], Field(strict=False, min_length=1)] = SHAPES
    tolerance: dict[StrictStr, Tolerance] = field(default_factory=dict)
    test_only: StrictBool = False
    # output -> perturbation (test-only entries)
    perturb: dict[StrictStr, Literal["ulp+1", "ulp+2", "ulp+3"]] = field(default_factory=dict)
    expect_violation: StrictBool = False
    # output -> a measured, understood violation
    known_issue: dict[StrictStr, Annotated[StrictStr, Field(min_length=1)]] = field(default_factory=dict)
    notes: StrictStr = ""

    @model_validator(mode="after")
    def _consistent(self) -> KernelEntry:
        # the rules between fields: what an active kernel needs, what perturb / known_issue may name
        if self.status == "active" and not _module_attribute(self.target):
            raise ValueError(f"target {self.target!r} must be 'module.path:attribute'")
        if self.status == "active" and not self.tolerance:
            raise ValueError("an active kernel needs at least one [tolerance.<output>]")
        for out in self.perturb:
            if out not in self.tolerance:
                raise ValueError(f"perturb.{out} names an output without a tolerance")
        for out in self.known_issue:
            if out not in self.tolerance:
                raise ValueError(f"known_issue.{out} must name a toleranced output and explain it")
        if self.perturb and not self.test_only:
            raise ValueError("perturb is only allowed on test_only entries")
        return self

    @property
    def runnable_on_cpu(self) -> bool:
        return self.status == "active" and self.device == "cpu"


def _module_attribute(target: str) -> bool:
    module, colon, attribute = target.partition(":")
    return bool(colon and module and attribute)


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


class _EngineTable(StrictModel):
    python: StrictStr
    notes: StrictStr = ""


# pydantic's type errors as the registry's messages name the type
_TYPE_NAMES = {"string_type": "str", "int_type": "int", "bool_type": "bool", "float_type": "a number",
               "dict_type": "dict", "tuple_type": "list", "list_type": "list", "dataclass_type": "a table",
               "model_type": "a table"}


def _entry_text(problem: Problem, data: Any) -> str:
    """A problem inside ``kernel[i]``, in the registry's words (after the entry's name)."""
    rest, kind = problem.loc[2:], problem.kind
    value = value_at(data, problem.loc)
    if not rest:
        if kind == "extra_forbidden":
            return f"unknown field(s) {list(problem.unknown)}"
        return problem.text
    key = str(rest[0])
    if key == "tolerance" and len(rest) >= 2:
        where = f"tolerance.{rest[1]}"
        if kind == "extra_forbidden":
            return f"{where}: unknown tolerance field(s) {list(problem.unknown)}"
        if len(rest) == 3 and kind == "greater_than_equal":
            return f"{where}: {rest[2]} ({value}) must be >= 0"
        if len(rest) == 3 and kind in _TYPE_NAMES:
            return f"{where}: field {rest[2]!r} must be {_TYPE_NAMES[kind]}, got {type(value).__name__} {value!r}"
        return f"{where}: {problem.text}"
    if kind == "missing":
        return f"missing field {key!r}"
    if key == "device":
        return f"device {value!r} not in {DEVICES}"
    if key == "status":
        return f"status {value!r} not in {STATUSES}"
    if key == "flag" and kind == "string_pattern_mismatch":
        return f"flag {value!r} is not a VLLM_DS41_* name"
    if key == "shapes":
        return f"shapes {value_at(data, problem.loc[:3])!r} must be a non-empty subset of {SHAPES}"
    if key == "perturb" and len(rest) == 2:
        return f"perturb.{rest[1]} = {value!r} not in {PERTURBATIONS}"
    if key == "known_issue" and len(rest) == 2:
        return f"known_issue.{rest[1]} must name a toleranced output and explain it"
    if len(rest) == 1 and kind in _TYPE_NAMES:
        return f"field {key!r} must be {_TYPE_NAMES[kind]}, got {type(value).__name__} {value!r}"
    return f"{'.'.join(map(str, rest))}: {problem.text}"


class RegistryFile(StrictModel):
    """The registry file: its format tag, the engines' environments, the kernel entries."""

    format: Literal["ds41-kernel-registry/1"]
    engines: dict[StrictStr, _EngineTable] = {}
    kernel: Seq[KernelEntry] = ()

    @model_validator(mode="after")
    def _across_entries(self) -> RegistryFile:
        seen: set[str] = set()
        for i, k in enumerate(self.kernel):
            where = f"kernel[{i}] ({k.name})"
            if k.name in seen:
                raise ValueError(f"{where}: duplicate kernel name {k.name!r}")
            seen.add(k.name)
            if k.engine not in self.engines and k.device == "cpu" and k.status == "active":
                raise ValueError(f"{where}: engine {k.engine!r} has no [engines.{k.engine}] environment")
        return self

    @classmethod
    def explain(cls, problem: Problem, data: Any) -> str | None:
        loc = problem.loc
        if loc[:1] == ("format",):
            return f"format {value_at(data, loc)!r}, expected {FORMAT!r}"
        if loc[:1] == ("kernel",) and len(loc) >= 2 and isinstance(loc[1], int):
            name = value_at(data, (*loc[:2], "name"))
            return f"kernel[{loc[1]}] ({name if name is not None else '?'}): {_entry_text(problem, data)}"
        if loc[:1] == ("engines",) and len(loc) >= 2:
            if problem.kind == "missing":
                return f"engines.{loc[1]}: missing field {loc[-1]!r}"
            return f"engines.{'.'.join(map(str, loc[1:]))}: {problem.text}"
        return None


def parse_registry(doc: dict, path: str = "<registry>") -> Registry:
    reg = parse_model(RegistryFile, doc, path, RegistryError)
    engines = {name: EngineEnv(name, e.python, e.notes) for name, e in reg.engines.items()}
    return Registry(path=path, engines=engines, kernels=tuple(reg.kernel))


def load_registry(path: str | Path = DEFAULT_PATH) -> Registry:
    return parse_registry(read_toml(path, "kernel registry", RegistryError), str(path))

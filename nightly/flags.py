"""The flag registry (gates.md §10.7): every engine flag, its class, the gates that guard it, thresholds.

A registry is TOML, one ``[flags.NAME]`` table per flag::

    [flags.VLLM_DS41_HC_FUSED]
    description = "fused Triton hyper-connection step instead of the torch sequence"
    class = "numerics"              # exact | numerics | perf   (gates.md §10.5)
    kind = ""                       # optional sub-kind: debug | draft-only | test-only | configuration | reference
    component = "hc"                # moe | attn | hc | engram | graphs | spec | sched | io | core | ...
    values = { type = "bool" }      # bool | int (min/max) | str (choices) | path
    default = "1"                   # in the engine
    production = "1"                # as the target's launcher sets it
    gates = []                      # override the class's default gate list
    evidence = []                   # reports that established the class
    mechanisms = []                 # DeepSeek mechanisms the flag's code runs in (core.coverage.Mechanism): a gate
                                    # run none of whose scored positions reached one of them leaves the flag
                                    # NOT EXERCISED, never PASS (ds41gates/coverage.py)
    notes = ""
    [flags.VLLM_DS41_HC_FUSED.thresholds]
    kl_margin_rel = 0.05            # numerics: allowed worsening vs flag off, relative to off's mean KL
    kl_floor_abs = 0.0              # numerics: F_run, the absolute allowance floor
    alpha = 0.05                    # numerics: Wilcoxon significance level for "worse"
    band_profile = ""               # numerics: bands.toml profile for the on-run (default: the engine's)
    speed_tolerance = 0.10          # perf: on may be at most this much slower (median tokens/s)
    require_speedup = false         # perf: on must be faster than off by more than the tolerance

The shipped registry is ``nightly/flags.toml``. Users extend it with their own files (``--flag-registry
PATH``, repeatable, or ``DS41_FLAG_REGISTRY=PATH[:PATH...]``): a later file adds flags, and a table for a
flag already known replaces the keys it sets (thresholds merge key by key).

Everything here except :func:`load_registry` / :func:`load_registry_file` is pure.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Mapping, Sequence

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from core.coverage import DEPTH_MECHANISMS, MECHANISM_NAMES
from core.errors import UserError
from core.schema import Problem, Seq, StrictModel, key_path, parse_model, value_at
from core.tomlfile import read_toml

DEFAULT_REGISTRY = Path(__file__).resolve().parent / "flags.toml"
ENV_REGISTRY = "DS41_FLAG_REGISTRY"

CLASSES = ("exact", "numerics", "perf")
KINDS = ("", "debug", "draft-only", "test-only", "configuration", "reference", "decode-only", "safety")
VALUE_TYPES = ("bool", "int", "str", "path")
PREFIX = "VLLM_DS41_"
PUBLIC_LANES = ("CORE", "ATTN", "MOE", "ENGRAM", "HC", "DUMP")

# The gates each class runs in the A/B (gates/test_flag_ab.py), in order.
CLASS_GATES: dict[str, tuple[str, ...]] = {
    "exact": ("bitwise_panel", "bitwise_greedy"),
    "numerics": ("kl_band", "paired_not_worse"),
    "perf": ("bitwise_panel", "bitwise_greedy", "speed"),
}
# ... and, for a flag whose mechanisms only a long prompt reaches (core.coverage.DEPTH_MECHANISMS), the same
# comparison on long@1 at depth (issue 39): without it the flag's on-arm never runs its code and reads NOT EXERCISED
DEPTH_GATES: dict[str, tuple[str, ...]] = {"exact": ("bitwise_depth",), "numerics": ("kl_depth",),
                                           "perf": ("bitwise_depth",)}
KNOWN_GATES = frozenset(g for gates in (*CLASS_GATES.values(), *DEPTH_GATES.values()) for g in gates)

_ENTRY_KEYS = {"description", "class", "kind", "component", "values", "default", "production", "gates",
               "evidence", "notes", "thresholds", "mechanisms"}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

ClassName = Literal["exact", "numerics", "perf"]
KindName = Literal["", "debug", "draft-only", "test-only", "configuration", "reference", "decode-only", "safety"]
GateName = Literal[tuple(sorted(KNOWN_GATES))]  # type: ignore[valid-type]
# a flag's engine value: TOML may write it as a string, a number or a boolean; the registry keeps the engine's text
EnvValue = Annotated[str | int | float | bool, AfterValidator(lambda v: ("1" if v else "0") if isinstance(v, bool)
                                                             else str(v))]


class FlagRegistryError(UserError, ValueError):
    """A registry file is malformed, or a flag / value is unknown or not allowed."""


class Thresholds(StrictModel):
    """A flag's ``[flags.NAME.thresholds]``: what its A/B gates allow (a later registry file merges key by key)."""

    kl_margin_rel: float = Field(0.05, ge=0, allow_inf_nan=False)
    kl_floor_abs: float = Field(0.0, ge=0, allow_inf_nan=False)
    alpha: float = Field(0.05, gt=0, lt=1)
    band_profile: str = ""
    # below 1: a tolerance of 1 or more lets a flag make the engine arbitrarily slow and still pass
    speed_tolerance: float = Field(0.10, ge=0, lt=1)
    require_speedup: bool = False
    # the vision tower gate (core.metrics.tower): limit = max(factor x the reference-bf16 floor, abs floor)
    tower_floor_factor: float = Field(1.0, ge=0, allow_inf_nan=False)
    tower_abs_floor: float = Field(0.0, ge=0, allow_inf_nan=False)

    def merged(self, over: Thresholds | None) -> Thresholds:
        """These thresholds with the keys ``over`` set replacing ours (a later registry file's table)."""
        return self if over is None else self.model_copy(update={k: getattr(over, k) for k in over.model_fields_set})


class ValueSpec(StrictModel):
    """Allowed values of a flag and their parse type (gates.md §10.1: strict, never a silent fallback)."""

    type: Literal["bool", "int", "str", "path"] = "bool"
    min: int | None = None
    max: int | None = None
    choices: Seq[str] = ()

    @model_validator(mode="after")
    def _consistent(self) -> ValueSpec:
        for name in ("min", "max"):
            if getattr(self, name) is not None and self.type != "int":
                raise ValueError(f"values.{name} is for integer flags only, got {getattr(self, name)!r}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"values.min {self.min} > values.max {self.max}")
        if self.choices and self.type != "str":
            raise ValueError("values.choices is for string flags only")
        return self

    def parse(self, name: str, raw: str) -> bool | int | str:
        """Parse an environment value; a malformed one raises FlagRegistryError naming the variable."""
        text = str(raw).strip()
        if self.type == "bool":
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise FlagRegistryError(f"{name}={raw!r}: not a boolean (1/true/yes/on or 0/false/no/off)")
        if self.type == "int":
            if not text or not (text.isdigit() or (text[0] in "+-" and text[1:].isdigit())):
                raise FlagRegistryError(f"{name}={raw!r}: not a base-10 integer")
            value = int(text, 10)
            if self.min is not None and value < self.min or self.max is not None and value > self.max:
                raise FlagRegistryError(f"{name}={raw!r}: outside [{self.min}, {self.max}]")
            return value
        if self.choices and text not in self.choices:
            raise FlagRegistryError(f"{name}={raw!r}: not one of {list(self.choices)}")
        return text


def _mechanisms(names: tuple[str, ...]) -> tuple[str, ...]:
    if any(m not in MECHANISM_NAMES for m in names) or len(set(names)) != len(names):
        raise ValueError(f"'mechanisms' must name each of {list(MECHANISM_NAMES)} at most once, got {list(names)}")
    return names


Mechanisms = Annotated[Seq[str], AfterValidator(_mechanisms)]


class FlagTable(StrictModel):
    """One ``[flags.NAME]`` table as a file writes it: every key optional, since a later registry file sets only
    the keys it changes (:meth:`FlagEntry.merged`)."""

    model_config = ConfigDict(populate_by_name=True)

    description: str | None = None
    cls: ClassName | None = Field(None, alias="class")
    kind: KindName | None = None
    component: str | None = None
    values: ValueSpec | None = None
    default: EnvValue | None = None
    production: EnvValue | None = None
    gates: Seq[GateName] | None = None
    evidence: Seq[str] | None = None
    mechanisms: Mechanisms | None = None
    notes: str | None = None
    thresholds: Thresholds | None = None


class FlagEntry(StrictModel):
    """A flag as the registry knows it, its files merged (:func:`parse_registry`)."""

    name: str
    description: str = Field(min_length=1)
    cls: ClassName
    kind: KindName = ""
    component: str = ""
    values: ValueSpec = ValueSpec()
    default: str | None = None
    production: str | None = None
    gates: Seq[GateName] = ()
    evidence: Seq[str] = ()
    mechanisms: Seq[str] = ()
    notes: str = ""
    thresholds: Thresholds = Thresholds()
    source: str = ""

    @model_validator(mode="after")
    def _values_parse(self) -> FlagEntry:
        for key in ("default", "production"):
            raw = getattr(self, key)
            if raw and self.values.type != "path":
                try:
                    self.values.parse(self.name, raw)
                except FlagRegistryError as exc:
                    raise ValueError(f"{key} {exc}") from None
        return self

    @classmethod
    def explain(cls, problem: Problem, data: Any) -> str | None:
        if problem.kind == "missing":
            return f"'{'class' if problem.loc == ('cls',) else key_path(problem.loc)}' is required"
        if problem.kind == "string_too_short":
            return f"'{key_path(problem.loc)}' is required"
        return problem.text if problem.kind == "value_error" else None

    @property
    def test_only(self) -> bool:
        return self.kind == "test-only"

    def effective_gates(self) -> tuple[str, ...]:
        if self.gates:
            return self.gates
        deep = DEPTH_GATES[self.cls] if DEPTH_MECHANISMS.intersection(self.mechanisms) else ()
        return CLASS_GATES[self.cls] + deep

    def as_dict(self) -> dict[str, Any]:
        d = self.model_dump()
        d["class"] = d.pop("cls")
        d["gates"] = list(self.effective_gates())
        return d


def merged_entry(name: str, table: FlagTable, source: str = "", base: FlagEntry | None = None) -> FlagEntry:
    """A flag's entry from its table in ``source``, over ``base`` (its entry in the files before): the keys the
    table sets replace base's, its thresholds merge key by key (pure)."""
    where = f"{source or 'registry'} [flags.{name}]"
    check_name(name, where)
    fields = base.model_dump(exclude={"values", "thresholds"}) if base is not None else {}
    fields.update(table.model_dump(exclude={"values", "thresholds"}, exclude_unset=True))
    fields.update(name=name, source=source if base is None else f"{base.source}+{source}",
                  values=table.values or (base.values if base is not None else ValueSpec()),
                  thresholds=(base.thresholds if base is not None else Thresholds()).merged(table.thresholds))
    return parse_model(FlagEntry, fields, where, FlagRegistryError)


class RegistryFile(StrictModel):
    """A flag registry file: ``[registry]`` (its version and references, free form) and ``[flags.NAME]`` tables."""

    registry: dict[str, Any] = {}
    flags: dict[str, FlagTable] = {}

    @classmethod
    def explain(cls, problem: Problem, data: Any) -> str | None:
        """This file's established wording: ``<file> [flags.NAME]: what is wrong``."""
        loc, value = problem.loc, problem.value
        if loc == () and problem.kind == "extra_forbidden":
            return (f"unknown top-level key(s) {sorted(problem.unknown)}; "
                    "a registry holds [registry] and [flags.NAME] tables")
        if loc == ("flags",):
            return "'flags' must be a table of tables"
        if len(loc) < 2 or loc[0] != "flags":
            return None
        entry, rest = f" [flags.{loc[1]}]: ", loc[2:]
        key = rest[0] if rest else ""
        if not rest:
            return entry + (f"unknown key(s) {sorted(problem.unknown)}; known: {sorted(_ENTRY_KEYS)}"
                            if problem.kind == "extra_forbidden" else "must be a table")
        if key in ("class", "kind") and problem.kind == "literal_error":
            allowed = CLASSES if key == "class" else KINDS
            return entry + f"{key!r} must be one of {allowed}, got {value!r}"
        if key == "gates" and problem.kind == "literal_error":
            bad = [g for g in value_at(data, loc[:3]) if g not in KNOWN_GATES]
            return entry + f"unknown gate(s) {bad}; known: {sorted(KNOWN_GATES)}"
        if key == "values" and problem.kind == "extra_forbidden":
            return entry + f"unknown key(s) in 'values': {sorted(problem.unknown)}"
        if key == "values" and len(rest) == 2 and rest[1] == "type":
            return entry + f"values.type must be one of {VALUE_TYPES}, got {value!r}"
        if key == "thresholds" and problem.kind == "extra_forbidden":
            return entry + f"unknown threshold(s) {sorted(problem.unknown)}; known: {sorted(Thresholds.model_fields)}"
        if key == "thresholds" and len(rest) == 2:
            return entry + f"threshold {rest[1]!r} {_threshold_rule(str(rest[1]), problem.kind)}, got {value!r}"
        if problem.kind == "value_error":
            return entry + problem.text
        if key in ("default", "production"):
            return entry + f"{key!r} must be a string or number, got {value_at(data, loc[:3])!r}"
        if len(rest) == 1 and problem.kind in ("model_type", "dict_type"):
            return entry + f"{key!r} must be a table"
        if key == "values" and len(rest) >= 2:   # values.choices, the one array of the values table
            return entry + f"values.{rest[1]} must be a list of strings, got {value_at(data, loc[:4])!r}"
        if key in ("gates", "evidence", "mechanisms"):
            return entry + f"{key!r} must be a list of strings, got {value_at(data, loc[:3])!r}"
        return entry + (f"{key!r} must be a string" if problem.kind == "string_type" else problem.text)


def _threshold_rule(key: str, kind: str) -> str:
    """What a threshold must be, in the words its messages have always used."""
    kind_of = Thresholds.model_fields[key].annotation if key in Thresholds.model_fields else float
    if kind_of is bool:
        return "must be bool"
    if kind_of is str:
        return "must be str"
    if key == "alpha" and kind != "float_type":
        return "must lie in (0, 1)"
    if key == "speed_tolerance" and kind != "float_type":
        return "must lie in [0, 1)"
    return "must be a finite number >= 0"


def check_name(name: str, where: str = "registry") -> None:
    """Flag names: identifiers; a VLLM_DS41_ name needs at least one part after the prefix."""
    if not name or not all(c.isalnum() or c == "_" for c in name) or name[0].isdigit():
        raise FlagRegistryError(f"{where}: flag name {name!r} must be an identifier (letters, digits, _)")
    if name.startswith(PREFIX) and (len(name) == len(PREFIX) or name != name.upper()):
        raise FlagRegistryError(f"{where}: {name!r}: VLLM_DS41_ names are upper case with a part after the prefix")


@dataclass(frozen=True)
class Registry:
    entries: Mapping[str, FlagEntry]
    sources: tuple[str, ...] = ()
    content_hash: str = ""

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __iter__(self):
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, name: str) -> FlagEntry:
        try:
            return self.entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self.entries), n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise FlagRegistryError(
                f"flag {name!r} is not in the flag registry ({', '.join(self.sources) or 'empty'}){hint}; "
                f"add a [flags.{name}] table to a registry file and pass it with --flag-registry or "
                f"{ENV_REGISTRY}") from None


def parse_registry(data: Mapping[str, Any], source: str = "", base: Registry | None = None) -> Registry:
    """A registry from parsed TOML, merged over ``base`` (pure)."""
    doc = parse_model(RegistryFile, data, source or "registry", FlagRegistryError)
    entries = dict(base.entries) if base else {}
    for name, table in doc.flags.items():
        entries[name] = merged_entry(name, table, source, entries.get(name))
    digest = hashlib.sha256(((base.content_hash if base else "") + json.dumps(
        {k: v.model_dump() for k, v in sorted(entries.items())}, sort_keys=True, default=str)).encode()).hexdigest()
    return Registry(entries, (base.sources if base else ()) + ((source,) if source else ()), "sha256:" + digest)


def load_registry_file(path: str | os.PathLike, base: Registry | None = None) -> Registry:
    return parse_registry(read_toml(path, "flag registry", FlagRegistryError), str(path), base)


def registry_paths(extra: Iterable[str | os.PathLike] = (), env: Mapping[str, str] | None = None,
                   include_default: bool = True) -> list[Path]:
    """The files merged, in order: the shipped registry, then $DS41_FLAG_REGISTRY, then ``extra``."""
    env = os.environ if env is None else env
    paths = [DEFAULT_REGISTRY] if include_default else []
    paths += [Path(p) for p in env.get(ENV_REGISTRY, "").split(os.pathsep) if p.strip()]
    paths += [Path(p) for p in extra]
    out: list[Path] = []
    for p in paths:
        if p.resolve() not in [q.resolve() for q in out]:
            out.append(p)
    return out


def load_registry(extra: Iterable[str | os.PathLike] = (), env: Mapping[str, str] | None = None,
                  include_default: bool = True) -> Registry:
    reg: Registry | None = None
    for path in registry_paths(extra, env, include_default):
        reg = load_registry_file(path, reg)
    return reg or Registry({})


# ------------------------------------------------------------------------------------------- profiles

@dataclass(frozen=True)
class ProfileCheck:
    profile: str
    problems: tuple[str, ...]
    ds41_env: Mapping[str, str]       # every VLLM_DS41_* the profile sets (base env)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_env(env: Mapping[str, str], registry: Registry, where: str, gated: bool = True) -> list[str]:
    """Problems with the VLLM_DS41_* entries of an environment: unknown names, bad values, test-only."""
    problems = []
    for var, raw in env.items():
        if not var.startswith(PREFIX):
            continue
        if var not in registry:
            problems.append(f"{where}: {var} is not in the flag registry (gates.md §10.1: unknown flags are refused)")
            continue
        entry = registry.get(var)
        if entry.test_only and gated:
            problems.append(f"{where}: {var} is a test-only flag and is refused in a gated profile")
        if entry.values.type != "path":
            try:
                entry.values.parse(var, raw)
            except FlagRegistryError as exc:
                problems.append(f"{where}: {exc}")
    return problems


def check_profile(profile, registry: Registry, flags: Sequence[str] = (), gated: bool = True) -> ProfileCheck:
    """Check an engine.launcher.Profile (duck-typed: name, env, flags) and the flags to turn on."""
    problems = check_env(profile.env, registry, f"profile {profile.name} [env]", gated)
    for name in flags:
        if name not in profile.flags:
            problems.append(f"profile {profile.name} has no [flags.{name}] table (known: {sorted(profile.flags)})")
        else:
            problems += check_env(profile.flags[name].env, registry, f"profile {profile.name} [flags.{name}]", gated)
        if name not in registry:
            problems.append(registry_miss(registry, name))
        elif registry.get(name).test_only and gated:
            problems.append(f"flag {name} is test-only and is refused in a gated A/B")
    ds41 = {k: v for k, v in profile.env.items() if k.startswith(PREFIX)}
    return ProfileCheck(profile.name, tuple(problems), ds41)


def registry_miss(registry: Registry, name: str) -> str:
    try:
        registry.get(name)
    except FlagRegistryError as exc:
        return str(exc)
    return ""


def lane_of(name: str) -> str | None:
    """The lane of a VLLM_DS41_<LANE>_<FLAG> name, or None for names outside the public lanes."""
    if not name.startswith(PREFIX):
        return None
    part = name[len(PREFIX):].split("_", 1)[0]
    return part if part in PUBLIC_LANES else None

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

import dataclasses
import difflib
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from core.coverage import DEPTH_MECHANISMS, MECHANISM_NAMES
from core.errors import UserError
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


class FlagRegistryError(UserError, ValueError):
    """A registry file is malformed, or a flag / value is unknown or not allowed."""


@dataclass(frozen=True)
class Thresholds:
    kl_margin_rel: float = 0.05
    kl_floor_abs: float = 0.0
    alpha: float = 0.05
    band_profile: str = ""
    speed_tolerance: float = 0.10
    require_speedup: bool = False
    # the vision tower gate (core.metrics.tower): limit = max(factor x the reference-bf16 floor, abs floor)
    tower_floor_factor: float = 1.0
    tower_abs_floor: float = 0.0

    @classmethod
    def from_table(cls, data: Mapping[str, Any], where: str, base: "Thresholds | None" = None) -> "Thresholds":
        base = base or cls()
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise FlagRegistryError(f"{where}: unknown threshold(s) {unknown}; known: {sorted(known)}")
        changes: dict[str, Any] = {}
        for key, value in data.items():
            want = type(getattr(base, key))
            if want is float:
                if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                        or value < 0):
                    raise FlagRegistryError(f"{where}: threshold {key!r} must be a finite number >= 0, got {value!r}")
                value = float(value)
            elif not isinstance(value, want):
                raise FlagRegistryError(f"{where}: threshold {key!r} must be {want.__name__}, got {value!r}")
            changes[key] = value
        if "alpha" in changes and not 0 < changes["alpha"] < 1:
            raise FlagRegistryError(f"{where}: threshold 'alpha' must lie in (0, 1), got {changes['alpha']!r}")
        if "speed_tolerance" in changes and not changes["speed_tolerance"] < 1:
            # a tolerance of 1 or more lets a flag make the engine arbitrarily slow and still pass
            raise FlagRegistryError(f"{where}: threshold 'speed_tolerance' must lie in [0, 1), "
                                    f"got {changes['speed_tolerance']!r}")
        return dataclasses.replace(base, **changes)


@dataclass(frozen=True)
class ValueSpec:
    """Allowed values of a flag and their parse type (gates.md §10.1: strict, never a silent fallback)."""

    type: str = "bool"
    min: int | None = None
    max: int | None = None
    choices: tuple[str, ...] = ()

    @classmethod
    def from_table(cls, data: Mapping[str, Any], where: str) -> "ValueSpec":
        unknown = sorted(set(data) - {"type", "min", "max", "choices"})
        if unknown:
            raise FlagRegistryError(f"{where}: unknown key(s) in 'values': {unknown}")
        vtype = data.get("type", "bool")
        if vtype not in VALUE_TYPES:
            raise FlagRegistryError(f"{where}: values.type must be one of {VALUE_TYPES}, got {vtype!r}")
        lo, hi = data.get("min"), data.get("max")
        for name, v in (("min", lo), ("max", hi)):
            if v is not None and (vtype != "int" or isinstance(v, bool) or not isinstance(v, int)):
                raise FlagRegistryError(f"{where}: values.{name} is for integer flags only, got {v!r}")
        if lo is not None and hi is not None and lo > hi:
            raise FlagRegistryError(f"{where}: values.min {lo} > values.max {hi}")
        choices = data.get("choices", [])
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise FlagRegistryError(f"{where}: values.choices must be a list of strings, got {choices!r}")
        if choices and vtype != "str":
            raise FlagRegistryError(f"{where}: values.choices is for string flags only")
        return cls(vtype, lo, hi, tuple(choices))

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


@dataclass(frozen=True)
class FlagEntry:
    name: str
    description: str
    cls: str
    kind: str = ""
    component: str = ""
    values: ValueSpec = field(default_factory=ValueSpec)
    default: str | None = None
    production: str | None = None
    gates: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()
    mechanisms: tuple[str, ...] = ()
    notes: str = ""
    thresholds: Thresholds = field(default_factory=Thresholds)
    source: str = ""

    @property
    def test_only(self) -> bool:
        return self.kind == "test-only"

    def effective_gates(self) -> tuple[str, ...]:
        if self.gates:
            return self.gates
        deep = DEPTH_GATES[self.cls] if DEPTH_MECHANISMS.intersection(self.mechanisms) else ()
        return CLASS_GATES[self.cls] + deep

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["class"] = d.pop("cls")
        d["gates"] = list(self.effective_gates())
        return d


def _str_or_none(value: Any, key: str, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    if not isinstance(value, (str, int, float)):
        raise FlagRegistryError(f"{where}: {key!r} must be a string or number, got {value!r}")
    return str(value)


def _str_tuple(value: Any, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FlagRegistryError(f"{where}: {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def parse_entry(name: str, data: Mapping[str, Any], source: str = "", base: FlagEntry | None = None) -> FlagEntry:
    """One ``[flags.NAME]`` table as a FlagEntry; with ``base``, the table's keys replace base's (pure)."""
    where = f"{source or 'registry'} [flags.{name}]"
    if not isinstance(data, Mapping):
        raise FlagRegistryError(f"{where}: must be a table")
    unknown = sorted(set(data) - _ENTRY_KEYS)
    if unknown:
        raise FlagRegistryError(f"{where}: unknown key(s) {unknown}; known: {sorted(_ENTRY_KEYS)}")
    check_name(name, where)
    cur: dict[str, Any] = dataclasses.asdict(base) if base else {}
    if base:
        cur["values"], cur["thresholds"] = base.values, base.thresholds
    if "description" in data:
        if not isinstance(data["description"], str):
            raise FlagRegistryError(f"{where}: 'description' must be a string")
        cur["description"] = data["description"]
    if not cur.get("description"):
        raise FlagRegistryError(f"{where}: 'description' is required")
    if "class" in data:
        cur["cls"] = data["class"]
    if cur.get("cls") not in CLASSES:
        raise FlagRegistryError(f"{where}: 'class' must be one of {CLASSES}, got {cur.get('cls')!r}")
    for key in ("kind", "component", "notes"):
        if key in data:
            if not isinstance(data[key], str):
                raise FlagRegistryError(f"{where}: {key!r} must be a string")
            cur[key] = data[key]
    if cur.get("kind", "") not in KINDS:
        raise FlagRegistryError(f"{where}: 'kind' must be one of {KINDS}, got {cur.get('kind')!r}")
    if "values" in data:
        if not isinstance(data["values"], Mapping):
            raise FlagRegistryError(f"{where}: 'values' must be a table")
        cur["values"] = ValueSpec.from_table(data["values"], where)
    for key in ("default", "production"):
        if key in data:
            cur[key] = _str_or_none(data[key], key, where)
    for key in ("gates", "evidence"):
        if key in data:
            cur[key] = _str_tuple(data[key], key, where)
    if "mechanisms" in data:
        cur["mechanisms"] = _str_tuple(data["mechanisms"], "mechanisms", where)
        unknown_mech = [m for m in cur["mechanisms"] if m not in MECHANISM_NAMES]
        if unknown_mech or len(set(cur["mechanisms"])) != len(cur["mechanisms"]):
            raise FlagRegistryError(f"{where}: 'mechanisms' must name each of {list(MECHANISM_NAMES)} at most once, "
                                    f"got {list(cur['mechanisms'])}")
    bad = sorted(set(cur.get("gates", ())) - KNOWN_GATES)
    if bad:
        raise FlagRegistryError(f"{where}: unknown gate(s) {bad}; known: {sorted(KNOWN_GATES)}")
    if "thresholds" in data:
        if not isinstance(data["thresholds"], Mapping):
            raise FlagRegistryError(f"{where}: 'thresholds' must be a table")
        cur["thresholds"] = Thresholds.from_table(data["thresholds"], where, cur.get("thresholds"))
    cur["source"] = source if not base else f"{base.source}+{source}"
    cur["name"] = name
    entry = FlagEntry(**cur)
    values = entry.values
    for key in ("default", "production"):
        raw = getattr(entry, key)
        if raw is not None and raw != "" and values.type != "path":
            try:
                values.parse(name, raw)
            except FlagRegistryError as exc:
                raise FlagRegistryError(f"{where}: {key} {exc}") from None
    return entry


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
    unknown = sorted(set(data) - {"flags", "registry"})
    if unknown:
        raise FlagRegistryError(f"{source or 'registry'}: unknown top-level key(s) {unknown}; "
                                "a registry holds [registry] and [flags.NAME] tables")
    flags = data.get("flags", {})
    if not isinstance(flags, Mapping):
        raise FlagRegistryError(f"{source or 'registry'}: 'flags' must be a table of tables")
    entries = dict(base.entries) if base else {}
    for name, table in flags.items():
        entries[name] = parse_entry(name, table, source, entries.get(name))
    digest = hashlib.sha256(((base.content_hash if base else "") + repr(sorted(
        (k, repr(v)) for k, v in entries.items()))).encode()).hexdigest()
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

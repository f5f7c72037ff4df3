"""Pass bands and the per-domain verdict of the KL panel gate (gates.md §3, "Pass rule").

The bands file belongs to whoever gates (the gate suite ships gates/bands.toml); callers pass its path. Its schema
is `BandsFile` (core/schema.py): ``[profiles.PROFILE.DOMAIN]`` and ``[depth.PROFILE.BUCKET]`` tables of the four
band keys, a ``default`` band in each profile; the whole file is checked whichever profile is asked for."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import pydantic
from pydantic import Field, StrictFloat

from core.depth import BUCKET_LABELS
from core.domains import DOMAINS
from core.errors import UserError
from core.metrics import GroupReport, PanelMetrics
from core.schema import STRICT, Problem, StrictModel, parse_model, value_at
from core.tomlfile import read_toml


class BandsError(UserError, ValueError):
    pass


Amount = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[StrictFloat, Field(ge=0, le=1)]


@pydantic.dataclasses.dataclass(frozen=True, config=STRICT)
class Band:
    kl_mean: Amount
    kl_p99: Amount
    top1_decided: Fraction
    ln_ppl: Amount


@dataclass
class DomainVerdict:
    domain: str
    passed: bool
    failures: list[str] = field(default_factory=list)


@dataclass
class PanelVerdict:
    profile: str
    passed: bool
    domains: list[DomainVerdict]

    def failures(self) -> list[str]:
        return [f"{d.domain}: {f}" for d in self.domains for f in d.failures]

    def as_rows(self) -> list[dict]:
        return [{"domain": d.domain, "verdict": "pass" if d.passed else "FAIL", "why": "; ".join(d.failures)}
                for d in self.domains]


BAND_KEYS = {"kl_mean": "a number >= 0", "kl_p99": "a number >= 0", "top1_decided": "a number in [0, 1]",
             "ln_ppl": "a number >= 0"}


def _bands_table(name: str, keys: tuple[str, ...]) -> type[StrictModel]:
    """One profile's table of bands: a required ``default`` band and an optional band for each key of ``keys``
    (a domain, a depth bucket): a misspelled key is an unknown key, a missing default a missing one."""
    fields: dict[str, Any] = {key: (Optional[Band], None) for key in keys}
    return pydantic.create_model(name, __base__=StrictModel, default=(Band, ...), **fields)


DomainBands = _bands_table("DomainBands", DOMAINS)
DepthBands = _bands_table("DepthBands", BUCKET_LABELS)
_SECTIONS = {"profiles": ("domain", ("default",) + DOMAINS), "depth": ("depth bucket", ("default",) + BUCKET_LABELS)}


class BandsFile(StrictModel):
    """A bands file: per profile, the KL panel's bands by domain and the long-context gate's by depth bucket."""

    profiles: dict[str, DomainBands] = {}   # type: ignore[valid-type]
    depth: dict[str, DepthBands] = {}       # type: ignore[valid-type]

    def bands(self, section: str) -> dict[str, dict[str, Band]]:
        """``{profile: {domain or bucket: Band}}`` of one section, the bands a profile leaves out absent."""
        return {name: {key: band for key, band in table if band is not None}
                for name, table in getattr(self, section).items()}

    @classmethod
    def explain(cls, problem: Problem, data: Any) -> str | None:
        # the bands file's established wording: `profiles.P.D.key = value; must be ...`
        loc, kind = problem.loc, problem.kind
        if kind == "extra_forbidden":
            keys = list(problem.unknown)
            if not loc:
                return f"unknown top-level key(s) {keys}; allowed: ['depth', 'profiles']"
            if len(loc) == 2:
                what, allowed = _SECTIONS[str(loc[0])]
                return f"{loc[0]}.{loc[1]}.{keys[0]}: unknown {what}; allowed: {list(allowed)}"
            return f"{'.'.join(map(str, loc))}: unknown key(s) {keys}; allowed: {sorted(BAND_KEYS)}"
        where = ".".join(map(str, loc))
        value = value_at(data, loc)
        if len(loc) == 1:
            return f"'{loc[0]}' must be a table of profile tables"
        if len(loc) == 2:
            return f"{where} must be a table of {_SECTIONS[str(loc[0])][0]} bands, got {value!r:.60}"
        if len(loc) == 3:
            if kind == "missing":
                return f"{loc[0]}.{loc[1]} has no 'default' band"
            return f"{where} must be a table of {sorted(BAND_KEYS)}, got {value!r:.60}"
        if len(loc) == 4 and kind == "missing":
            return f"{'.'.join(map(str, loc[:3]))}: missing key(s) {[loc[3]]}"
        if len(loc) == 4:
            return f"{where} = {value!r}; must be {BAND_KEYS[str(loc[3])]}"
        return None


def parse_bands(data: dict, path: Path) -> dict[str, dict[str, Band]]:
    """Every profile's bands, every key and value checked (the whole file, not just the profile asked for)."""
    return parse_model(BandsFile, data, str(path), BandsError).bands("profiles")


def load_bands(profile: str, path: str | os.PathLike) -> dict[str, Band]:
    path = Path(path)
    profiles = parse_bands(read_toml(path, "bands file", BandsError), path)
    bands = profiles.get(profile) or profiles.get("default")
    if bands is None:
        raise BandsError(f"{path}: no bands for profile {profile!r} and no [profiles.default]")
    return bands


def parse_depth_bands(data: dict, path: Path) -> dict[str, dict[str, Band]]:
    """The per-depth-bucket bands (issue 39): ``[depth.PROFILE.BUCKET]`` tables (BUCKET a core.depth label or
    ``default``), the same four keys as a domain band, every one checked (the whole file is)."""
    return parse_model(BandsFile, data, str(path), BandsError).bands("depth")


def load_depth_bands(profile: str, path: str | os.PathLike) -> dict[str, Band]:
    """The profile's per-bucket bands; a profile without a [depth.PROFILE] table is refused (no silent band)."""
    path = Path(path)
    bands = parse_depth_bands(read_toml(path, "bands file", BandsError), path).get(profile)
    if bands is None:
        raise BandsError(f"{path}: no per-depth-bucket bands for profile {profile!r} (add [depth.{profile}.default])")
    return bands


def judge_depth(reports: dict[str, GroupReport], bands: dict[str, Band], profile: str) -> PanelVerdict:
    """Each depth bucket against its band (the domain rule of judge_domain); passes when every bucket does."""
    if not reports:
        return PanelVerdict(profile, False, [DomainVerdict("(no bucket)", False, ["no scored positions"])])
    verdicts = [judge_domain(g, bands.get(b, bands["default"])) for b, g in reports.items()]
    return PanelVerdict(profile, all(v.passed for v in verdicts), verdicts)


def judge_domain(group: GroupReport, band: Band) -> DomainVerdict:
    failures = []
    if group.hard_fails:
        failures.append(f"{group.hard_fails} position(s) with infinite KL (engine gave probability 0)")
    if not group.kl_part.mean <= band.kl_mean:
        failures.append(f"mean KL_part {group.kl_part.mean:.3g} > {band.kl_mean:.3g}")
    if group.kl_part.p99 is not None and not group.kl_part.p99 <= band.kl_p99:
        failures.append(f"p99 KL_part {group.kl_part.p99:.3g} > {band.kl_p99:.3g}")
    if group.n_decided and not group.top1_decided >= band.top1_decided:
        failures.append(f"top-1 (decided) {group.top1_decided:.4f} < {band.top1_decided:.4f}")
    ln_ratio = group.perplexity.get("ln_ratio", math.nan)
    if not abs(ln_ratio) <= band.ln_ppl:
        failures.append(f"|ln PPL ratio| {abs(ln_ratio):.3g} > {band.ln_ppl:.3g}")
    return DomainVerdict(group.name, not failures, failures)


def judge_panel(result: PanelMetrics, bands: dict[str, Band], profile: str) -> PanelVerdict:
    verdicts = [judge_domain(g, bands.get(name, bands["default"])) for name, g in result.domains.items()]
    return PanelVerdict(profile, all(v.passed for v in verdicts), verdicts)

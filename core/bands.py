"""Pass bands and the per-domain verdict of the KL panel gate (gates.md §3, "Pass rule").

The bands file belongs to whoever gates (the gate suite ships gates/bands.toml); callers pass its path."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from core.depth import BUCKET_LABELS
from core.domains import DOMAINS
from core.errors import UserError
from core.metrics import GroupReport, PanelMetrics
from core.tomlfile import read_toml


class BandsError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Band:
    kl_mean: float
    kl_p99: float
    top1_decided: float
    ln_ppl: float


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


def _band(path: Path, where: str, values: object) -> Band:
    if not isinstance(values, dict):
        raise BandsError(f"{path}: {where} must be a table of {sorted(BAND_KEYS)}, got {values!r:.60}")
    unknown = sorted(set(values) - set(BAND_KEYS))
    if unknown:
        raise BandsError(f"{path}: {where}: unknown key(s) {unknown}; allowed: {sorted(BAND_KEYS)}")
    missing = sorted(set(BAND_KEYS) - set(values))
    if missing:
        raise BandsError(f"{path}: {where}: missing key(s) {missing}")
    out = {}
    for key, allowed in BAND_KEYS.items():
        v = values[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        if ok and key == "top1_decided":
            ok = v <= 1
        if not ok:
            raise BandsError(f"{path}: {where}.{key} = {v!r}; must be {allowed}")
        out[key] = float(v)
    return Band(**out)


def parse_bands(data: dict, path: Path) -> dict[str, dict[str, Band]]:
    """Every profile's bands, every key and value checked (the whole file, not just the profile asked for)."""
    unknown = sorted(set(data) - {"profiles", "depth"})
    if unknown:
        raise BandsError(f"{path}: unknown top-level key(s) {unknown}; allowed: ['depth', 'profiles']")
    parse_depth_bands(data, path)
    return _band_tables(data, path, "profiles", ("default",) + DOMAINS, "domain")


def _band_tables(data: dict, path: Path, section: str, allowed: tuple[str, ...], kind: str) -> dict[str, dict[str, Band]]:
    """``[SECTION.PROFILE.KEY]`` band tables: every profile a table, every KEY in `allowed`, a 'default' band each."""
    tables = data.get(section, {})
    if not isinstance(tables, dict):
        raise BandsError(f"{path}: '{section}' must be a table of profile tables")
    out: dict[str, dict[str, Band]] = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise BandsError(f"{path}: {section}.{name} must be a table of {kind} bands, got {table!r:.60}")
        bands = {}
        for key, values in table.items():
            if key not in allowed:
                raise BandsError(f"{path}: {section}.{name}.{key}: unknown {kind}; allowed: {list(allowed)}")
            bands[key] = _band(path, f"{section}.{name}.{key}", values)
        if "default" not in bands:
            raise BandsError(f"{path}: {section}.{name} has no 'default' band")
        out[name] = bands
    return out


def load_bands(profile: str, path: str | os.PathLike) -> dict[str, Band]:
    path = Path(path)
    data = read_toml(path, "bands file", BandsError)
    profiles = parse_bands(data, path)
    bands = profiles.get(profile) or profiles.get("default")
    if bands is None:
        raise BandsError(f"{path}: no bands for profile {profile!r} and no [profiles.default]")
    return bands


def parse_depth_bands(data: dict, path: Path) -> dict[str, dict[str, Band]]:
    """The per-depth-bucket bands (issue 39): ``[depth.PROFILE.BUCKET]`` tables (BUCKET a core.depth label or
    ``default``), the same four keys as a domain band, every one checked."""
    return _band_tables(data, path, "depth", ("default",) + BUCKET_LABELS, "depth bucket")


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

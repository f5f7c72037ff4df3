"""Pass bands and the per-domain verdict of the KL panel gate (gates.md §3, "Pass rule")."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError
from core.metrics import GroupReport, PanelMetrics
from core.paths import repo_root

DEFAULT_BANDS_FILE = repo_root() / "gates" / "bands.toml"


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


def load_bands(profile: str, path: Path | None = None) -> dict[str, Band]:
    path = Path(path or DEFAULT_BANDS_FILE)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BandsError(f"{path}: cannot read bands ({exc})") from exc
    profiles = data.get("profiles", {})
    table = profiles.get(profile) or profiles.get("default")
    if table is None:
        raise BandsError(f"{path}: no bands for profile {profile!r} and no [profiles.default]")
    bands = {}
    for domain, values in table.items():
        try:
            bands[domain] = Band(**{k: float(v) for k, v in values.items()})
        except TypeError as exc:
            raise BandsError(f"{path}: profiles.{profile}.{domain}: {exc}") from exc
    if "default" not in bands:
        raise BandsError(f"{path}: profiles.{profile} has no 'default' band")
    return bands


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

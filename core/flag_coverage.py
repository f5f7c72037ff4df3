"""The coverage rule (issue 39): a flag is vouched for only where a gate run reached the mechanisms its code runs in.

The flags registry (nightly/flags.toml) says which DeepSeek mechanisms each flag touches (core.coverage.Mechanism);
the oracle's reference says, per scored position, which mechanisms were live there (the record's `mechanisms`).
A run whose scored positions never reached one of a flag's mechanisms has not exercised that flag: its verdict
is NOT EXERCISED, never PASS, whatever the flag's gates measured (the 29-51-token dsv4-ci panel never fills the
128-token window, never emits a ratio-128 entry, never makes the indexer prune). A reference that does not say
which mechanisms were live counts as reaching none of them: when in doubt, not exercised.

Pure functions over core.coverage.Coverage; the pytest plugin calls them once per session (ds41gates/coverage.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from core.coverage import MECHANISM_NAMES, Coverage
from core.depth import BUCKET_LABELS
from core.results import FlagCoverage


def merge(coverages: Iterable[Coverage]) -> Coverage | None:
    """The coverage of several references' scored positions together (counts add up); None for none."""
    items = list(coverages)
    if not items:
        return None
    scored = {b: sum(c.scored.get(b, 0) for c in items) for b in BUCKET_LABELS}
    live = {m: {b: sum(c.live.get(m, {}).get(b, 0) for c in items) for b in BUCKET_LABELS} for m in MECHANISM_NAMES}
    total_live = {m: sum(c.total_live.get(m, 0) for c in items) for m in MECHANISM_NAMES}
    return Coverage(scored=scored, live=live, total_scored=sum(c.total_scored for c in items), total_live=total_live)


def judge_flag(flag: str, mechanisms: Sequence[str], coverage: Coverage | None,
               sources: Sequence[str] = (), unstated: Sequence[str] = ()) -> FlagCoverage:
    """The coverage verdict of one flag: ``coverage`` is what the run's references with mechanism masks reached
    (None when none had them); ``unstated`` names the references the run scored that carry no masks."""
    mechanisms = tuple(mechanisms)
    if not mechanisms:
        return FlagCoverage(flag, "not declared", sources=tuple(sources),
                            why="the flags registry names no mechanism for this flag: coverage does not apply")
    if coverage is None:
        said = f" ({', '.join(unstated)})" if unstated else ""
        return FlagCoverage(flag, "not exercised", mechanisms, (), mechanisms, tuple(sources),
                            f"NOT EXERCISED: no reference of this run states which mechanisms were live{said}, so "
                            f"none of {list(mechanisms)} counts as reached")
    missing = tuple(coverage.not_exercised(mechanisms))
    reached = tuple(m for m in mechanisms if m not in missing)
    counted = f"{coverage.total_scored} scored positions of {', '.join(sources) or 'the run'}"
    if missing:
        return FlagCoverage(flag, "not exercised", mechanisms, reached, missing, tuple(sources),
                            f"NOT EXERCISED: no scored position reached {list(missing)} ({counted}; the flag's "
                            f"code runs in {list(mechanisms)})")
    lives = ", ".join(f"{m} at {coverage.total_live[m]}" for m in mechanisms)
    return FlagCoverage(flag, "exercised", mechanisms, reached, (), tuple(sources),
                        f"every declared mechanism was live: {lives} of {counted}")


def coverage_rows(coverage: Coverage) -> list[dict]:
    """The coverage table: one row per mechanism, one column per bucket that has scored positions, each cell
    'live/scored' (how many scored positions of the bucket had the mechanism live)."""
    buckets = [b for b in BUCKET_LABELS if coverage.scored.get(b, 0)]
    rows = [{"mechanism": "(scored positions)", **{b: str(coverage.scored[b]) for b in buckets},
             "total": str(coverage.total_scored)}]
    for m in MECHANISM_NAMES:
        rows.append({"mechanism": m, **{b: f"{coverage.live[m][b]}/{coverage.scored[b]}" for b in buckets},
                     "total": f"{coverage.total_live[m]}/{coverage.total_scored}"})
    return rows


def verdict_rows(verdicts: Iterable[FlagCoverage]) -> list[dict]:
    """The flag coverage table beside the verdicts: one row per flag."""
    return [{"flag": v.flag, "coverage": v.verdict.upper(), "mechanisms": ", ".join(v.mechanisms) or "-",
             "missing": ", ".join(v.missing) or "-", "why": v.why} for v in verdicts]

"""The coverage rule in a gate session (issue 39): which mechanisms the run's scored positions reached, and the
verdict of every flag the session is about (``--flag`` A/Bs and ``--engine-flag`` flags).

Gates that score an oracle reference add it with `add_reference` (the KL panel's engine record does so for the
panel reference; the long-context gate for its own); at the end of the session `judge_session` merges what they
reached, writes the typed `FlagCoverage` of each flag into results.json, a ``flag_coverage`` gate entry for each
flag that declares mechanisms (a NOT EXERCISED flag is a failed entry: never PASS; its A/B's aggregate,
`GateResults.flag_aggregate`, reads the same verdict and says NOT EXERCISED where its gates passed), and the two
report tables (mechanism x depth bucket, and flag by flag).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.coverage import coverage_of_record
from core.flag_coverage import coverage_rows, judge_flag, merge, verdict_rows
from core.results import GateEntry

COVERAGE_TITLE = "Mechanism coverage: scored positions where each DeepSeek mechanism was live, per depth bucket"
FLAGS_TITLE = "Flag coverage: a flag whose mechanisms no scored position reached is NOT EXERCISED, never PASS"


def add_reference(run: Any, source: str, reference: Any) -> None:
    """Count the scored positions of an oracle ``reference`` the session scored (``source`` names it; a second
    add of the same source replaces the first). A reference without mechanism masks is kept as one that says
    nothing: it reaches no mechanism."""
    kept = [(s, c) for s, c in run.coverages if s != source]
    run.coverages[:] = [*kept, (source, coverage_of_record(reference))]


def judge_session(run: Any, registry: Any, flags: Sequence[str], profile: str = "") -> list:
    """Write the coverage verdicts of ``flags`` (and the tables) into ``run`` (a pytest plugin GateRun); returns
    the verdicts. Nothing is written when the session scored no reference and is about no flag."""
    stated = [(s, c) for s, c in run.coverages if c is not None]
    unstated = [s for s, c in run.coverages if c is None]
    merged = merge(c for _, c in stated)
    sources = [s for s, _ in stated]
    if merged is not None:
        run.add_section(COVERAGE_TITLE, coverage_rows(merged),
                        f"cells: positions with the mechanism live / scored positions of the bucket, over "
                        f"{', '.join(sources)} (the oracle's mechanism masks)"
                        + (f"; {', '.join(unstated)} state no mechanisms" if unstated else ""))
    verdicts = []
    for flag in dict.fromkeys(flags):
        mechanisms = registry.get(flag).mechanisms if flag in registry else ()
        verdict = judge_flag(flag, mechanisms, merged, sources, unstated)
        if flag not in registry:
            verdict = type(verdict)(flag, "not declared", sources=tuple(sources),
                                    why="not in the flags registry: no mechanisms declared, coverage does not apply")
        verdicts.append(verdict)
        run._save(run.results.with_coverage(verdict))
        if verdict.verdict == "not declared":
            continue
        ok = verdict.verdict == "exercised"
        run.add(GateEntry("flag_coverage", ok, profile=profile, flag=flag, failures=() if ok else (verdict.why,),
                          metrics={"mechanisms_missing": float(len(verdict.missing))},
                          evidence={"mechanisms": list(verdict.mechanisms), "reached": list(verdict.reached),
                                    "missing": list(verdict.missing), "sources": list(verdict.sources)}))
    if verdicts:
        run.add_section(FLAGS_TITLE, verdict_rows(verdicts),
                        "mechanisms: the flags registry's (nightly/flags.toml); reached over the run's scored "
                        "positions (core/flag_coverage.py)")
    return verdicts

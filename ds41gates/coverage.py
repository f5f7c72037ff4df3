"""The coverage rule in a gate session (issue 39): which mechanisms the run's scored positions reached, and the
verdict of every flag the session is about (``--flag`` A/Bs and ``--engine-flag`` flags).

Gates that score an oracle reference add it with `add_reference` (the KL panel's engine record does so for the
panel reference; the long-context gate for its own; the flag A/B's depth gates for each arm), naming the ARM that
was scored: None for the session's engine (its ``--engine-flag`` flags on), a flag's name for that flag's A/B
on-arm. A flag is judged only over positions where its code ran: an ``--engine-flag`` flag over the session
engine's references, an A/B flag over its own on-arm's — a long-context gate on the session's engine (flag off)
never vouches for an A/B flag whose on-arm saw only the short panel. At the end of the session `judge_session`
merges what each flag's arm reached, writes the typed `FlagCoverage` of each flag into results.json, a
``flag_coverage`` gate entry for each flag that declares mechanisms (a NOT EXERCISED flag is a failed entry: never
PASS; its A/B's aggregate, `GateResults.flag_aggregate`, reads the same verdict and says NOT EXERCISED where its
gates passed), and the two report tables (mechanism x depth bucket, and flag by flag).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from core.coverage import coverage_of_record
from core.flag_coverage import coverage_rows, judge_flag, merge, verdict_rows
from core.results import GateEntry

COVERAGE_TITLE = "Mechanism coverage: scored positions where each DeepSeek mechanism was live, per depth bucket"
FLAGS_TITLE = "Flag coverage: a flag whose mechanisms no scored position reached is NOT EXERCISED, never PASS"


def coverage_title(arm: str | None = None) -> str:
    """The mechanism table's report title: the session's engine, or one flag's A/B on-arm."""
    return COVERAGE_TITLE if arm is None else f"{COVERAGE_TITLE} (flag {arm} on)"


@dataclass(frozen=True)
class ScoredReference:
    """An oracle reference whose positions a gate scored on one arm: ``arm`` None is the session's engine, a flag
    name that flag's A/B on-arm; ``coverage`` None when the reference does not state its mechanisms."""

    source: str
    arm: str | None
    coverage: Any

    @property
    def label(self) -> str:
        return self.source if self.arm is None else f"{self.source} (flag {self.arm} on)"


def add_reference(run: Any, source: str, reference: Any, arm: str | None = None) -> None:
    """Count the scored positions of an oracle ``reference`` the session scored on ``arm`` (None: the session's
    engine; a flag's name: its A/B on-arm). ``source`` names it; a second add of the same source on the same arm
    replaces the first. A reference without mechanism masks is kept as one that says nothing: it reaches no
    mechanism."""
    kept = [r for r in run.coverages if (r.source, r.arm) != (source, arm)]
    run.coverages[:] = [*kept, ScoredReference(source, arm, coverage_of_record(reference))]


def _reached(refs: Sequence[ScoredReference]):
    """(merged coverage or None, labels of the references that state mechanisms, labels of those that do not)."""
    stated = [r for r in refs if r.coverage is not None]
    return (merge(r.coverage for r in stated), [r.label for r in stated],
            [r.label for r in refs if r.coverage is None])


def judge_session(run: Any, registry: Any, engine_flags: Sequence[str] = (), ab_flags: Sequence[str] = (),
                  profile: str = "") -> list:
    """Write the coverage verdicts of the session's ``engine_flags`` (on in the session's engine: judged over its
    references) and ``ab_flags`` (A/B'd: each judged over its own on-arm's references only) and the tables into
    ``run`` (a pytest plugin GateRun); returns the verdicts. Nothing is written when the session scored no
    reference and is about no flag."""
    arms = [None, *dict.fromkeys(r.arm for r in run.coverages if r.arm is not None)]
    reached = {arm: _reached([r for r in run.coverages if r.arm == arm]) for arm in arms}
    for arm, (merged, sources, unstated) in reached.items():
        if merged is not None:   # one table per arm: an A/B's two arms score the same positions twice
            run.add_section(coverage_title(arm), coverage_rows(merged),
                            f"cells: positions with the mechanism live / scored positions of the bucket, over "
                            f"{', '.join(sources)} (the oracle's mechanism masks)"
                            + (f"; {', '.join(unstated)} state no mechanisms" if unstated else ""))
    ab = set(ab_flags)
    verdicts = []
    for flag in dict.fromkeys([*engine_flags, *ab_flags]):
        mechanisms = registry.get(flag).mechanisms if flag in registry else ()
        arm = flag if flag in ab else None
        verdict = judge_flag(flag, mechanisms, *reached.get(arm, (None, [], [])))
        if arm is not None and verdict.verdict == "not exercised":
            verdict = replace(verdict, why=f"{verdict.why}; an A/B flag counts only the positions its flag-on arm "
                                           f"scored")
        if flag not in registry:
            verdict = type(verdict)(flag, "not declared", sources=verdict.sources,
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

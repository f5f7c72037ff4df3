"""Verdict of the task-eval gate: the candidate fails a suite when a headline metric is lower than the
baseline's and the exact McNemar p-value on the paired problems is below alpha (pure; no IO). Without a baseline
nothing is judged: the verdict is None ("no baseline: not judged"), never a pass, whatever the scores (issue 35:
every HumanEval score 0 was recorded as passed=true)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from evals.compare import HEADLINE, SuiteComparison

NOT_JUDGED = (("no baseline: not judged (scores measured and reported; --eval-baseline DIR pairs them against "
               "a known-good run)"),)


@dataclass(frozen=True)
class EvalGate:
    passed: bool | None      # None: nothing to compare against, so no verdict (failures say why)
    failures: tuple[str, ...]


def eval_gate(comparisons: Sequence[SuiteComparison], alpha: float) -> EvalGate:
    if not comparisons:
        return EvalGate(None, NOT_JUDGED)
    failures = []
    for c in comparisons:
        for m in c.metrics:
            if m.metric not in HEADLINE[c.suite]:
                continue
            t = m.test
            if t.score_b < t.score_a and t.p_value < alpha:
                failures.append(f"{c.title} {m.metric}: {100 * t.score_b:.1f} vs baseline {100 * t.score_a:.1f} "
                                f"({t.a_only} problems lost, {t.b_only} gained; exact McNemar p {t.p_value:.3g} "
                                f"< {alpha})")
    return EvalGate(not failures, tuple(failures))

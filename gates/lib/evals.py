"""Verdict of the task-eval gate: the candidate fails a suite when a headline metric is lower than the
baseline's and the exact McNemar p-value on the paired problems is below alpha (pure; no IO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from evals.compare import HEADLINE, SuiteComparison



@dataclass(frozen=True)
class EvalGate:
    passed: bool
    failures: tuple[str, ...]


def eval_gate(comparisons: Sequence[SuiteComparison], alpha: float) -> EvalGate:
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

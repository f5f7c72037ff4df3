"""Batch invariance (gates.md §5): a request's greedy output must not depend on what else is served.

Every scenario's run of a subject is compared with the subject's solo run. **Verdict: token-id
equality** (a missing or truncated output is a mismatch, never equal). The first diverging position
is reported with the solo run's margin there (a near-tie divergence is labelled, not forgiven), and,
up to the divergence, whether every logprob was bitwise equal and the largest |Δℓ|.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from gates.lib.common import NEAR_TIE_DELTA, StepLike, first_divergence, margin, non_finite


@dataclass(frozen=True)
class Output:
    ids: tuple[int, ...]
    steps: tuple[StepLike, ...] = ()


@dataclass(frozen=True)
class Comparison:
    scenario: str
    subject: str
    equal_ids: bool
    first_divergence: int | None
    solo_margin_at_divergence: float | None
    near_tie: bool | None
    bitwise_logprobs: bool          # every compared logprob identical up to the divergence (or the end)
    max_abs_dlogprob: float         # over steps before the divergence
    solo_tokens: int
    test_tokens: int
    non_finite: bool

    def as_row(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "subject": self.subject, "ids_equal": self.equal_ids,
                "first_divergence": self.first_divergence,
                "solo_margin_at_divergence": self.solo_margin_at_divergence, "near_tie": self.near_tie,
                "logprobs_bitwise": self.bitwise_logprobs, "max_abs_dlogprob": self.max_abs_dlogprob,
                "tokens": f"{self.test_tokens}/{self.solo_tokens}"}


def compare(scenario: str, subject: str, solo: Output, test: Output) -> Comparison:
    div = first_divergence(solo.ids, test.ids)
    upto = len(solo.ids) if div is None else div
    bitwise = True
    max_d = 0.0
    for a, b in zip(solo.steps[:upto], test.steps[:upto]):
        if (tuple(a.top_ids) != tuple(b.top_ids) or tuple(a.top_logprobs) != tuple(b.top_logprobs)
                or a.actual_logprob != b.actual_logprob):
            bitwise = False
        d = abs(a.actual_logprob - b.actual_logprob)
        if not math.isnan(d):
            max_d = max(max_d, d)
    if len(solo.steps) < upto or len(test.steps) < upto:
        bitwise = False
    m = None
    if div is not None and div < len(solo.steps):
        m = margin(solo.steps[div])
    return Comparison(scenario, subject, div is None, div, m, None if m is None else m < NEAR_TIE_DELTA, bitwise,
                      max_d, len(solo.ids), len(test.ids), bool(non_finite(test.steps) or non_finite(solo.steps)))


@dataclass
class BatchResult:
    passed: bool
    failures: list[str]
    rows: list[dict[str, Any]]               # one per comparison
    scenarios: list[dict[str, Any]]          # "k/N failures" per scenario
    summary: dict[str, Any] = field(default_factory=dict)


def judge(comparisons: Sequence[Comparison]) -> BatchResult:
    failures: list[str] = []
    by: dict[str, list[Comparison]] = {}
    for c in comparisons:
        by.setdefault(c.scenario, []).append(c)
        if c.non_finite:
            failures.append(f"{c.scenario} / {c.subject}: non-finite logprob")
        if not c.equal_ids:
            tie = "" if c.near_tie is None else (" (near-tie of the solo run)" if c.near_tie else " (decided position)")
            m = "" if c.solo_margin_at_divergence is None else f", solo margin {c.solo_margin_at_divergence:.3g}"
            failures.append(f"{c.scenario} / {c.subject}: ids diverge at generated position {c.first_divergence}"
                            f"{tie}{m}; {c.test_tokens}/{c.solo_tokens} tokens")
    scenarios = []
    for name, cs in by.items():
        bad = sum(not c.equal_ids for c in cs)
        scenarios.append({"scenario": name, "failures": f"{bad}/{len(cs)}",
                          "logprobs_bitwise": f"{sum(c.bitwise_logprobs for c in cs)}/{len(cs)}",
                          "max_abs_dlogprob": max(c.max_abs_dlogprob for c in cs),
                          "first_divergences": [c.first_divergence for c in cs if c.first_divergence is not None]})
    if not comparisons:
        failures.append("no comparisons were made")
    summary = {"comparisons": len(comparisons), "mismatches": sum(not c.equal_ids for c in comparisons),
               "bitwise_equal": sum(c.bitwise_logprobs for c in comparisons),
               "max_abs_dlogprob": max((c.max_abs_dlogprob for c in comparisons), default=None)}
    return BatchResult(not failures, failures, [c.as_row() for c in comparisons], scenarios, summary)

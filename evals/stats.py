"""Scores and paired significance of eval outcomes (pure functions, no IO).

Both engines answer the same problems, so outcomes are paired binary data. The exact McNemar test
conditions on the discordant problems (solved by one engine only): under "no difference" each
discordant problem is a fair coin, so the two-sided p-value is a binomial test of b = #(A only)
among n = b + c (``scipy.stats.binomtest``). It is exact at any size (CI subsets of 10-20 problems;
a bootstrap interval is unreliable there) and needs no resampling seed. For instruction-level IFEval the
unit is one instruction of one prompt; instructions of one prompt are not independent, so that p-value
is somewhat optimistic, and the prompt-level one is the test of record (docs/EVALS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scipy import stats


@dataclass(frozen=True)
class McNemar:
    n: int                  # paired items
    both: int               # passed on both sides
    a_only: int             # passed on A only
    b_only: int             # passed on B only
    p_value: float          # exact two-sided; 1.0 without discordant items

    @property
    def score_a(self) -> float:
        return (self.both + self.a_only) / self.n if self.n else float("nan")

    @property
    def score_b(self) -> float:
        return (self.both + self.b_only) / self.n if self.n else float("nan")

    def as_dict(self) -> dict:
        return {"n": self.n, "both": self.both, "a_only": self.a_only, "b_only": self.b_only,
                "p_value": self.p_value, "score_a": self.score_a, "score_b": self.score_b}


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> McNemar:
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need one length, got {len(a)} and {len(b)}")
    both = sum(1 for x, y in zip(a, b) if x and y)
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    disc = a_only + b_only
    p = 1.0 if disc == 0 else float(stats.binomtest(a_only, disc, 0.5, alternative="two-sided").pvalue)
    return McNemar(len(a), both, a_only, b_only, min(1.0, p))


def rate(outcomes: Sequence[bool]) -> float:
    return sum(bool(x) for x in outcomes) / len(outcomes) if outcomes else float("nan")

"""Shared pieces of the gate logic: per-step records, first divergence, margins and step-wise KL_part.

A *step* is one scored position as an engine reported it: the actual (generated or prompt) id, its
logprob and the engine's top-k in rank order. ``engine.adapters.base.PositionLogprobs`` is one; any
object with the same four attributes works.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from core.metrics import NEAR_TIE_DELTA  # gates.md §1: a near-tie when ln p(1) - ln p(2) < δ


class StepLike(Protocol):
    actual_id: int
    actual_logprob: float
    top_ids: Sequence[int]
    top_logprobs: Sequence[float]


@dataclass(frozen=True)
class Step:
    actual_id: int
    actual_logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def step(actual_id: int, actual_logprob: float, top: Sequence[tuple[int, float]]) -> Step:
    """A step from (id, logprob) pairs in rank order (tests and synthetic inputs)."""
    return Step(int(actual_id), float(actual_logprob), tuple(int(i) for i, _ in top), tuple(float(v) for _, v in top))


def first_divergence(ref: Sequence[int], test: Sequence[int]) -> int | None:
    """Index of the first differing id; a missing or extra id counts as a difference. None when equal."""
    n = min(len(ref), len(test))
    for i in range(n):
        if int(ref[i]) != int(test[i]):
            return i
    return None if len(ref) == len(test) else n


def margin(s: StepLike) -> float:
    """ln p(1) - ln p(2) of a step's top-k (inf when only one entry is known)."""
    lps = [v for v in s.top_logprobs if math.isfinite(v)]
    if len(lps) < 2:
        return math.inf
    return float(lps[0] - lps[1])


def top1_prob(s: StepLike) -> float:
    return math.exp(s.top_logprobs[0]) if s.top_logprobs else float("nan")


def non_finite(steps: Sequence[StepLike]) -> list[int]:
    """Indices of steps holding a NaN or +inf logprob (-inf is a legal 'probability 0')."""
    bad = []
    for i, s in enumerate(steps):
        vals = [s.actual_logprob, *s.top_logprobs]
        if any(math.isnan(v) or v == math.inf for v in vals):
            bad.append(i)
    return bad


def _scores(seq_id: str, steps: Sequence[StepLike], k: int):
    from core.records import SequenceScores

    n = len(steps)
    ids = np.full((n, k), -1, dtype=np.int64)
    lps = np.full((n, k), -np.inf, dtype=np.float64)
    for r, s in enumerate(steps):
        m = min(k, len(s.top_ids))
        ids[r, :m] = s.top_ids[:m]
        lps[r, :m] = s.top_logprobs[:m]
    actual = np.asarray([s.actual_logprob for s in steps], dtype=np.float64)
    tokens = np.asarray([0] + [int(s.actual_id) for s in steps], dtype=np.int64)
    scored = np.asarray([False] + [True] * n)
    return SequenceScores(seq_id, "gate", tokens, scored, ids, lps, actual, np.zeros(n, dtype=np.int64))


@dataclass(frozen=True)
class StepMetrics:
    """Per-step comparison of a test run against a reference run over the same ids (arrays, one per step)."""

    kl_part: np.ndarray      # KL_part(ref ‖ test), S = (top-k_ref ∩ top-k_test) ∪ {a} (gates.md §2.2)
    top1_agree: np.ndarray
    margin: np.ndarray       # of the reference
    abs_dlogprob: np.ndarray  # |ℓ_test(a) − ℓ_ref(a)|
    ref_top1_prob: np.ndarray

    @property
    def decided(self) -> np.ndarray:
        return self.margin >= NEAR_TIE_DELTA


def step_metrics(ref: Sequence[Sequence[StepLike]], test: Sequence[Sequence[StepLike]]) -> StepMetrics:
    """KL_part and friends per step, through ``core.metrics.position_metrics`` (one sequence per run pair).

    ``ref[i]`` and ``test[i]`` must name the same actual ids step by step (compare up to a divergence first).
    """
    from core import metrics
    from core.records import Provenance, Record

    if len(ref) != len(test):
        raise ValueError(f"{len(ref)} reference sequences but {len(test)} test sequences")
    pairs = [(r, t) for r, t in zip(ref, test) if len(r)]
    for i, (r, t) in enumerate(pairs):
        if [s.actual_id for s in r] != [s.actual_id for s in t]:
            raise ValueError(f"sequence {i}: reference and test steps name different ids")
    if not pairs:
        e = np.zeros(0)
        return StepMetrics(e, e.astype(bool), e, e, e)
    k = max(max(len(s.top_ids) for s in seq) for pair in pairs for seq in pair)
    prov = Provenance("engine", "gate-steps", "1", "sha256:gate-steps", "sha256:gate-steps")
    rec_ref = Record.from_sequences(prov, [_scores(f"s{i}", r, k) for i, (r, _) in enumerate(pairs)], k=k)
    rec_test = Record.from_sequences(prov, [_scores(f"s{i}", t, k) for i, (_, t) in enumerate(pairs)], k=k)
    pm = metrics.position_metrics(rec_ref, rec_test)
    return StepMetrics(kl_part=np.asarray(pm.kl_part, dtype=np.float64), top1_agree=np.asarray(pm.top1_agree),
                       margin=np.asarray(pm.margin, dtype=np.float64),
                       abs_dlogprob=np.abs(rec_test.actual_logprob - rec_ref.actual_logprob),
                       ref_top1_prob=np.asarray(pm.ref_top1_prob, dtype=np.float64))

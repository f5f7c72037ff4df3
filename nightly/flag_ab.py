"""Statistics of the per-flag A/B and the nightly (gates.md §10.5, §10.6, §2.7): pure functions over what two
runs returned.

* exact / perf: **bitwise** — panel prompt logprobs (ids and parsed float values) and greedy generations
  (ids and per-step top-k logprobs) of flag on must equal flag off, bit for bit.
* numerics: the on-run's KL panel within its band (core.bands), and **paired not-worse** against
  the off-run (gates.md §2.7 regression rule on per-prompt paired differences of KL_part, counted as a
  regression only when the Wilcoxon signed-rank test also calls on worse than off at level alpha).
* perf: the speed compare (median tokens/s, on vs off) with numerics unchanged (bitwise).

The nightly's run-vs-baseline comparison applies the same §2.7 rule to per-prompt series stored in its history
(:func:`paired_series`); both sides use core.metrics' prompt bootstrap.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from core.metrics import PairedComparison, paired_prompt_comparison
from nightly.flags import Thresholds

MAX_LISTED = 8


@dataclass(frozen=True)
class BitwiseResult:
    what: str
    identical: bool
    compared: int                       # positions / generated tokens compared
    mismatches: tuple[str, ...] = ()    # the first few, human-readable
    n_mismatches: int = 0
    max_abs_diff: float = 0.0           # over logprob values at positions whose ids agree
    ids_identical: bool = True          # every id (actual / greedy / top-k) agrees; only values may differ

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "identical": self.identical, "compared": self.compared,
                "n_mismatches": self.n_mismatches, "max_abs_diff": self.max_abs_diff,
                "ids_identical": self.ids_identical,
                "mismatches": list(self.mismatches)}


def _same_floats(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise bit-for-bit equality of float arrays (-inf == -inf, NaN == NaN of the same payload)."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    b = np.ascontiguousarray(b, dtype=np.float64)
    return a.view(np.int64) == b.view(np.int64)


def _finite_diff(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    both = np.isfinite(a) & np.isfinite(b)
    return float(np.max(np.abs(a[both] - b[both]))) if both.any() else 0.0


def compare_records_bitwise(off, on) -> BitwiseResult:
    """Two engine records of the same panel: every id and every logprob value identical."""
    if list(off.seq_ids) != list(on.seq_ids) or not np.array_equal(off.token_ids, on.token_ids) \
            or not np.array_equal(off.scored, on.scored):
        return BitwiseResult("panel", False, 0, ("the records score different sequences / tokens",), 1, math.inf,
                             False)
    problems: list[str] = []
    n_bad = 0
    k = min(off.topk_ids.shape[1], on.topk_ids.shape[1])
    ids_ok = np.all(off.topk_ids[:, :k] == on.topk_ids[:, :k], axis=1)
    lp_ok = np.all(_same_floats(off.topk_logprobs[:, :k], on.topk_logprobs[:, :k]), axis=1)
    act_ok = _same_floats(off.actual_logprob, on.actual_logprob)
    rank_ok = off.actual_rank == on.actual_rank
    bad = ~(ids_ok & lp_ok & act_ok & rank_ok)
    n_bad = int(bad.sum())
    for p in np.flatnonzero(bad)[:MAX_LISTED]:
        seq = off.seq_ids[int(off.pos_seq[p])]
        pos = int(off.pos_index[p])
        what = "top-k ids" if not ids_ok[p] else "logprob values"
        detail = f"{seq}@{pos}: {what} differ"
        if ids_ok[p]:
            d = _finite_diff(off.topk_logprobs[p, :k], on.topk_logprobs[p, :k])
            detail += f" (max |Δ| {d:.3g})"
        problems.append(detail)
    agree = ids_ok
    max_diff = _finite_diff(off.topk_logprobs[agree, :k], on.topk_logprobs[agree, :k]) if agree.any() else 0.0
    max_diff = max(max_diff, _finite_diff(off.actual_logprob, on.actual_logprob))
    ids_same = bool(ids_ok.all() and np.array_equal(off.actual_rank, on.actual_rank))
    return BitwiseResult("panel", n_bad == 0, int(off.n_positions), tuple(problems), n_bad, max_diff, ids_same)


def compare_generations(off: Sequence, on: Sequence) -> BitwiseResult:
    """Greedy generations (engine.adapters.base.Generation) of the same prompts: ids and top-k identical."""
    if len(off) != len(on):
        return BitwiseResult("greedy", False, 0, (f"{len(off)} generations off vs {len(on)} on",), 1, math.inf, False)
    problems: list[str] = []
    n_bad = 0
    compared = 0
    max_diff = 0.0
    ids_same = True
    for a, b in zip(off, on):
        if a.seq_id != b.seq_id or tuple(a.prompt_ids) != tuple(b.prompt_ids):
            raise ValueError(f"generation pairs out of order: {a.seq_id!r} vs {b.seq_id!r}")
        n = min(len(a.token_ids), len(b.token_ids))
        compared += max(len(a.token_ids), len(b.token_ids))
        first = next((j for j in range(n) if a.token_ids[j] != b.token_ids[j]), None)
        if first is None and len(a.token_ids) != len(b.token_ids):
            first = n
        upto = n if first is None else first
        for j in range(upto):
            pa, pb = a.positions[j], b.positions[j]
            same = (pa.top_ids == pb.top_ids and
                    bool(np.all(_same_floats(np.array(pa.top_logprobs), np.array(pb.top_logprobs)))) and
                    bool(_same_floats(np.array([pa.actual_logprob]), np.array([pb.actual_logprob]))[0]))
            if pa.top_ids == pb.top_ids:
                max_diff = max(max_diff, _finite_diff(np.array(pa.top_logprobs), np.array(pb.top_logprobs)))
            ids_same = ids_same and pa.top_ids == pb.top_ids
            if not same:
                n_bad += 1
                if len(problems) < MAX_LISTED:
                    what = "top-k ids" if pa.top_ids != pb.top_ids else "logprob values"
                    problems.append(f"{a.seq_id} step {j}: {what} differ")
        if first is not None:
            ids_same = False
            n_bad += 1
            if len(problems) < MAX_LISTED:
                problems.append(f"{a.seq_id}: greedy ids diverge at step {first} "
                                f"({a.token_ids[first] if first < len(a.token_ids) else 'end'} off vs "
                                f"{b.token_ids[first] if first < len(b.token_ids) else 'end'} on)")
    return BitwiseResult("greedy", n_bad == 0, compared, tuple(problems), n_bad, max_diff, ids_same)


@dataclass(frozen=True)
class PairedVerdict:
    passed: bool
    off_mean: float
    on_mean: float
    diff_mean: float
    ci_low: float
    ci_high: float
    wilcoxon_p: float
    allowance: float
    n_prompts: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def regression_rule(diff_ci_high: float, diff_mean: float, p_value: float, baseline_mean: float,
                    floor_abs: float, margin_rel: float, alpha: float) -> tuple[bool, float, str]:
    """gates.md §2.7: worse when the upper 95% paired bound on (candidate − baseline) exceeds
    max(F_run, margin · baseline); counted only when the difference is significant (Wilcoxon p < alpha)
    and positive. Returns (regressed, allowance, why)."""
    allowance = max(floor_abs, margin_rel * abs(baseline_mean)) if math.isfinite(baseline_mean) else floor_abs
    if not math.isfinite(diff_ci_high):
        return False, allowance, "no paired prompts"
    beyond = diff_ci_high > allowance
    significant = math.isfinite(p_value) and p_value < alpha and diff_mean > 0
    why = (f"upper 95% bound of Δ {diff_ci_high:.3g} {'>' if beyond else '<='} allowance {allowance:.3g}; "
           f"Wilcoxon p {p_value:.3g} ({'significant' if significant else 'not significant'} at {alpha})")
    return beyond and significant, allowance, why


def paired_series(base: Sequence[float | None], cur: Sequence[float | None], metric: str = "kl_part",
                  n_boot: int = 2000, seed: int = 0) -> PairedComparison:
    """Per-prompt paired differences cur − base of two stored series (a prompt missing on either side is
    dropped), compared by core's paired statistics: the mean, the paired-bootstrap 95% interval and the
    Wilcoxon p."""
    if len(base) != len(cur):
        raise ValueError(f"per-prompt series differ in length ({len(base)} vs {len(cur)}): the panel changed")
    return paired_prompt_comparison(_nan_for_none(base), _nan_for_none(cur), metric, n_boot, seed)


def _nan_for_none(series: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if x is None else x for x in series], dtype=np.float64)


def paired_not_worse(paired: PairedComparison, thresholds: Thresholds) -> PairedVerdict:
    """``paired`` = metrics.paired_comparison(off_pm, on_pm, 'kl_part'): differences are on − off."""
    regressed, allowance, why = regression_rule(paired.ci_high, paired.mean_diff, paired.wilcoxon_p,
                                                paired.mean_a, thresholds.kl_floor_abs, thresholds.kl_margin_rel,
                                                thresholds.alpha)
    return PairedVerdict(not regressed, paired.mean_a, paired.mean_b, paired.mean_diff, paired.ci_low,
                         paired.ci_high, paired.wilcoxon_p, allowance, paired.n_prompts, why)


@dataclass(frozen=True)
class SpeedVerdict:
    passed: bool
    off_tok_s: float
    on_tok_s: float
    ratio: float
    tolerance: float
    samples: int
    reason: str
    off_samples: tuple[float, ...] = field(default=(), repr=False)
    on_samples: tuple[float, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def speed_verdict(off_tok_s: Sequence[float], on_tok_s: Sequence[float], thresholds: Thresholds) -> SpeedVerdict:
    """Median tokens/s on vs off: not slower than (1 − tolerance); with require_speedup, faster than (1 + tol)."""
    if not off_tok_s or not on_tok_s:
        raise ValueError("speed verdict needs at least one timing on each side")
    if any(not (math.isfinite(x) and x > 0) for x in [*off_tok_s, *on_tok_s]):
        raise ValueError(f"speeds must be finite and positive, got off={list(off_tok_s)} on={list(on_tok_s)}")
    off_m, on_m = statistics.median(off_tok_s), statistics.median(on_tok_s)
    ratio = on_m / off_m
    tol = thresholds.speed_tolerance
    if thresholds.require_speedup:
        passed = ratio > 1 + tol
        why = f"on/off median tokens/s {ratio:.3f} {'>' if passed else '<='} {1 + tol:.3f} (speed-up required)"
    else:
        passed = ratio >= 1 - tol
        why = f"on/off median tokens/s {ratio:.3f} {'>=' if passed else '<'} {1 - tol:.3f}"
    return SpeedVerdict(passed, off_m, on_m, ratio, tol, min(len(off_tok_s), len(on_tok_s)), why,
                        tuple(off_tok_s), tuple(on_tok_s))

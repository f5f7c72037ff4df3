"""Paired comparison of two engine records on the same positions (gates.md §2.6, §2.7 regression bands).

Per-prompt means of a per-position metric, candidate B minus baseline A: the mean difference with a
paired prompt-bootstrap percentile interval and a Wilcoxon signed-rank p-value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from core.metrics.definition import PositionMetrics
from core.records import RecordError


@dataclass(frozen=True)
class PairedComparison:
    """Candidate B minus baseline A on per-prompt means of one metric (gates.md §2.6)."""

    metric: str
    n_prompts: int
    mean_a: float
    mean_b: float
    mean_diff: float
    ci_low: float
    ci_high: float
    wilcoxon_p: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def per_prompt_means(values: np.ndarray, seq: np.ndarray, n_sequences: int) -> np.ndarray:
    """Mean of `values` per sequence index 0..n_sequences-1; NaN for a sequence without values."""
    sums = np.bincount(seq, weights=values, minlength=n_sequences)
    counts = np.bincount(seq, minlength=n_sequences)
    with np.errstate(invalid="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def paired_prompt_comparison(mean_a: np.ndarray, mean_b: np.ndarray, metric: str = "kl_part", n_boot: int = 2000,
                             seed: int = 0) -> PairedComparison:
    """B minus A from per-prompt means aligned by prompt (NaN where a prompt has no value on a side:
    that prompt is left out): the mean difference, its 95% paired-bootstrap percentile interval
    (prompts resampled with replacement, `n_boot` resamples) and the Wilcoxon signed-rank p-value
    (1.0 when every difference is 0)."""
    mean_a = np.asarray(mean_a, dtype=np.float64)
    mean_b = np.asarray(mean_b, dtype=np.float64)
    if mean_a.shape != mean_b.shape or mean_a.ndim != 1:
        raise ValueError(f"paired per-prompt means must be two 1-d arrays of one length, got {mean_a.shape} "
                         f"and {mean_b.shape}")
    ok = ~np.isnan(mean_a) & ~np.isnan(mean_b)
    d = mean_b[ok] - mean_a[ok]
    if d.size == 0:
        nan = float("nan")
        return PairedComparison(metric, 0, nan, nan, nan, nan, nan, nan)
    rng = np.random.default_rng(seed)
    boots = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    p = float(stats.wilcoxon(d).pvalue) if np.any(d != 0) else 1.0
    return PairedComparison(metric, int(d.size), float(mean_a[ok].mean()), float(mean_b[ok].mean()), float(d.mean()),
                            float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975)), p)


def paired_comparison(a: PositionMetrics, b: PositionMetrics, metric: str = "kl_part", n_boot: int = 2000,
                      seed: int = 0) -> PairedComparison:
    """B minus A on per-prompt means of `metric` over positions finite and unambiguous on both sides."""
    if not np.array_equal(a.seq, b.seq):
        raise RecordError("paired comparison needs both engine records scored on the same positions")
    va, vb = getattr(a, metric), getattr(b, metric)
    keep = np.isfinite(va) & np.isfinite(vb) & ~a.ambiguous & ~b.ambiguous
    n_seq = int(a.seq.max()) + 1 if a.seq.size else 0
    ma = per_prompt_means(va[keep], a.seq[keep], n_seq)
    mb = per_prompt_means(vb[keep], b.seq[keep], n_seq)
    return paired_prompt_comparison(ma, mb, metric, n_boot, seed)

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
    """Candidate B minus baseline A on per-prompt mean KL_part (gates.md §2.6)."""

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
    sums = np.bincount(seq, weights=values, minlength=n_sequences)
    counts = np.bincount(seq, minlength=n_sequences)
    with np.errstate(invalid="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def paired_comparison(a: PositionMetrics, b: PositionMetrics, metric: str = "kl_part", n_boot: int = 2000,
                      seed: int = 0) -> PairedComparison:
    if not np.array_equal(a.seq, b.seq):
        raise RecordError("paired comparison needs both engine records scored on the same positions")
    va, vb = getattr(a, metric), getattr(b, metric)
    keep = np.isfinite(va) & np.isfinite(vb) & ~a.ambiguous & ~b.ambiguous
    n_seq = int(a.seq.max()) + 1 if a.seq.size else 0
    ma = per_prompt_means(va[keep], a.seq[keep], n_seq)
    mb = per_prompt_means(vb[keep], b.seq[keep], n_seq)
    ok = ~np.isnan(ma) & ~np.isnan(mb)
    d = mb[ok] - ma[ok]
    if d.size == 0:
        nan = float("nan")
        return PairedComparison(metric, 0, nan, nan, nan, nan, nan, nan)
    rng = np.random.default_rng(seed)
    boots = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    p = float(stats.wilcoxon(d).pvalue) if np.any(d != 0) else 1.0
    return PairedComparison(metric, int(d.size), float(ma[ok].mean()), float(mb[ok].mean()), float(d.mean()),
                            float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975)), p)

"""Summary statistics of per-position metrics (gates.md §2.5, §2.6).

Percentiles with their sample-size rule, the prompt-level bootstrap of a position-weighted mean, the
domain-macro bootstrap, llama-perplexity style Δp statistics and perplexity from paired differences.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Summary:
    """Summary statistics of one per-position metric over one group (gates.md §2.6)."""

    n_positions: int
    n_prompts: int
    mean: float
    ci_low: float
    ci_high: float
    naive_se: float
    median: float | None
    p90: float | None
    p99: float | None
    p999: float | None
    max: float | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _group_sums(values: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-group sum of `values` and position count, groups in sorted label order (as np.unique)."""
    labels = np.asarray(labels)
    if labels.dtype.kind in "iu" and labels.size and labels.min() >= 0 and labels.max() <= 4 * labels.size + 4096:
        counts = np.bincount(labels)
        present = np.flatnonzero(counts)
        return np.bincount(labels, weights=values, minlength=counts.size)[present], counts[present].astype(np.float64)
    _, inv = np.unique(labels, return_inverse=True)
    return np.bincount(inv, weights=values), np.bincount(inv).astype(np.float64)


def count_groups(labels: np.ndarray) -> int:
    labels = np.asarray(labels)
    if labels.dtype.kind in "iu" and labels.size and labels.min() >= 0 and labels.max() <= 4 * labels.size + 4096:
        return int(np.count_nonzero(np.bincount(labels)))
    return int(np.unique(labels).size)


_MULTIPLICITY_CELLS = 16_000_000  # cache n_boot × n_prompts multiplicity matrices up to 128 MB


@functools.lru_cache(maxsize=4)
def _multiplicities(n_groups: int, n_boot: int, seed: int) -> np.ndarray:
    """W[b, g] = how often resample b drew prompt g; the draws are `prompt_bootstrap`'s exactly."""
    pick = np.random.default_rng(seed).integers(0, n_groups, size=(n_boot, n_groups))
    pick += (np.arange(n_boot, dtype=np.int64) * n_groups)[:, None]
    w = np.bincount(pick.ravel(), minlength=n_boot * n_groups).astype(np.float64).reshape(n_boot, n_groups)
    w.flags.writeable = False
    return w


def _boot_means(sums: np.ndarray, counts: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    g = sums.size
    if n_boot * g <= _MULTIPLICITY_CELLS:  # one matrix product; the matrix is shared by every group of g prompts
        both = _multiplicities(g, n_boot, seed) @ np.stack([sums, counts], axis=1)
        return both[:, 0] / both[:, 1]
    pick = np.random.default_rng(seed).integers(0, g, size=(n_boot, g))
    return sums[pick].sum(axis=1) / counts[pick].sum(axis=1)


def prompt_bootstrap(values: np.ndarray, prompt: np.ndarray, n_boot: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the position-weighted mean, resampling prompts (not positions)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return (float("nan"), float("nan"))
    sums, counts = _group_sums(values, prompt)
    means = _boot_means(sums, counts, n_boot, seed)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


_SUMMARY_QUANTILES = (0.5, 0.90, 0.99, 0.999)


def summarize(values: np.ndarray, prompt: np.ndarray, n_boot: int = 2000, seed: int = 0) -> Summary:
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    if n == 0:
        nan = float("nan")
        return Summary(0, 0, nan, nan, nan, nan, None, None, None, None, None)
    n_prompts = count_groups(prompt)
    lo, hi = prompt_bootstrap(values, prompt, n_boot, seed)
    mean = float(values.mean())
    naive = float(np.sqrt(values.var() / (n - 1))) if n > 1 else float("nan")
    stats_ = dict.fromkeys(("median", "p90", "p99", "p999", "max"))
    if n >= 100:  # no distribution statistics below 100 positions (gates.md §2.6)
        # A percentile q is printed only if n >= 10/(1-q) (gates.md §2.6); one partition for all of them.
        qs = [q for q in _SUMMARY_QUANTILES if q == 0.5 or n >= 10 / (1 - q) - 1e-9]
        got = dict(zip(qs, np.quantile(values, qs).tolist()))
        stats_.update(median=got[0.5], p90=got.get(0.90), p99=got.get(0.99), p999=got.get(0.999),
                      max=float(values.max()))
    return Summary(n_positions=n, n_prompts=n_prompts, mean=mean, ci_low=lo, ci_high=hi, naive_se=naive, **stats_)


DP_QUANTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.5, 0.25, 0.10, 0.05, 0.01, 0.001)


def delta_p_stats(delta_p: np.ndarray) -> dict:
    """llama-perplexity style Δp statistics (gates.md §2.5), in probabilities.

    Non-finite values (not produced by `position_metrics`, whose Δp is a difference of probabilities)
    are counted in `n_nonfinite` and left out of every statistic. `n` counts the values used.
    """
    d = np.asarray(delta_p, dtype=np.float64)
    finite = np.isfinite(d)
    n_bad = int(d.size - np.count_nonzero(finite))
    if n_bad:
        d = d[finite]
    if d.size == 0:
        return {"n": 0, "n_nonfinite": n_bad} if n_bad else {}
    mean = float(d.mean())
    out = {"n": int(d.size), "n_nonfinite": n_bad, "mean": mean,
           "se": float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan"),
           "rms": float(np.sqrt(np.mean(d * d))), "max": float(d.max()), "min": float(d.min())}
    for q, v in zip(DP_QUANTILES, np.quantile(d, DP_QUANTILES).tolist()):
        out[f"p{q * 100:g}"] = float(v)
    return out


def perplexity_stats(nll_ref: np.ndarray, nll_eng: np.ndarray) -> dict:
    """PPL of each side and their ratio from paired differences (llama.cpp's form, gates.md §2.5).

    An infinite NLL (a side gave probability 0 to the actual token) makes that side's perplexity
    infinite and the ln ratio ±inf (NaN if both sides are infinite at different positions with
    opposite signs); such positions are counted in `n_infinite`. `ln_ratio_se` and
    `ln_ratio_finite` are computed over the positions where both NLLs are finite (`n_finite`).
    """
    nll_ref = np.asarray(nll_ref, dtype=np.float64)
    nll_eng = np.asarray(nll_eng, dtype=np.float64)
    if nll_ref.size == 0:
        return {}
    finite = np.isfinite(nll_ref) & np.isfinite(nll_eng)
    n_fin = int(np.count_nonzero(finite))
    n_inf = int(nll_ref.size - n_fin)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = nll_eng - nll_ref  # inf - inf where both sides gave 0: NaN, handled below
        if n_inf:
            inf_diff = diff[~finite]
            up, down = bool(np.any(inf_diff > 0)), bool(np.any(inf_diff < 0))
            ln_ratio = math.inf if up and not down else -math.inf if down and not up else math.nan
            d_fin = diff[finite]
        else:
            d_fin = diff
            ln_ratio = float(d_fin.mean())
        ln_fin = float(d_fin.mean()) if n_fin else math.nan
        ppl_ref = float(np.exp(nll_ref.mean()))
        ppl_eng = float(np.exp(nll_eng.mean()))
    out = {
        "ppl_ref": ppl_ref,
        "ppl_eng": ppl_eng,
        "ln_ratio": ln_ratio,
        "ln_ratio_se": float(d_fin.std(ddof=1) / np.sqrt(n_fin)) if n_fin > 1 else math.nan,
        "ln_ratio_finite": ln_fin,
        "n": int(nll_ref.size),
        "n_finite": n_fin,
        "n_infinite": n_inf,
    }
    out["ratio"] = float(math.exp(ln_ratio)) if not math.isnan(ln_ratio) else math.nan
    both_inf = math.isinf(ppl_eng) and math.isinf(ppl_ref)
    out["diff"] = math.nan if both_inf else ppl_eng - ppl_ref
    return out


def binomial_rate(hits: np.ndarray) -> tuple[float, float]:
    """Rate and its binomial standard error sqrt(p(1-p)/n); NaN, NaN for no trials."""
    n = hits.size
    if n == 0:
        return math.nan, math.nan
    p = float(np.count_nonzero(hits)) / n
    return p, math.sqrt(p * (1 - p) / n)


def macro_bootstrap(values: np.ndarray, prompt: np.ndarray, domain: np.ndarray, n_boot: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """Interval of the domain-macro mean: prompts resampled within each domain, domains weighted equally."""
    values = np.asarray(values, dtype=np.float64)
    prompt = np.asarray(prompt)
    domain = np.asarray(domain)
    rng = np.random.default_rng(seed)
    per_domain = []
    if domain.dtype == object and domain.size:  # compare small integer codes, not strings, per domain
        names, domain = np.unique(domain.astype(str), return_inverse=True)
    for d in np.unique(domain):
        m = domain == d
        sums, counts = _group_sums(values[m], prompt[m])
        pick = rng.integers(0, sums.size, size=(n_boot, sums.size))
        per_domain.append(sums[pick].sum(axis=1) / counts[pick].sum(axis=1))
    if not per_domain:
        return (float("nan"), float("nan"))
    macro = np.mean(per_domain, axis=0)
    lo, hi = np.quantile(macro, [0.025, 0.975])
    return float(lo), float(hi)

"""Fidelity metrics between a reference record and an engine record (gates.md §2).

Pure, vectorised functions over `Record` arrays. Every per-position metric is computed once by
`position_metrics`; summaries, domain aggregation and paired comparisons work on its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy import stats
from scipy.special import logsumexp

from ds41gates.records import Record, RecordError

REST_FLOOR = 1e-12
NEAR_TIE_DELTA = 0.05
CONFIDENCE_EDGES = (0.0, 0.25, 0.5, 0.75, 0.95, 1.0)
CONFIDENCE_LABELS = ("[0,.25)", "[.25,.5)", "[.5,.75)", "[.75,.95)", "[.95,1]")
R20_SUPPORT = 20


@dataclass
class PositionMetrics:
    """One row per scored position, aligned with the reference record's position arrays."""

    seq: np.ndarray            # sequence index of the position
    domain: np.ndarray         # domain name (object array)
    kl_part: np.ndarray        # partition KL (§2.2); +inf where the engine gave q=0 to p>0
    kl_r20: np.ndarray         # renormalised top-20 KL (§2.3)
    r20_imputed: np.ndarray    # how many of the reference's top-20 ids the engine lacked (imputed q_min)
    support_size: np.ndarray   # |S|
    p_rest: np.ndarray
    q_rest: np.ndarray
    rest_floored: np.ndarray   # Q_rest was floored to 1e-12
    engine_outside_oracle: np.ndarray  # engine top-k ids the oracle has no value for
    engine_topk_count: np.ndarray
    top1_agree: np.ndarray
    margin: np.ndarray         # ln p(1) - ln p(2) of the reference
    ref_top1_prob: np.ndarray
    nll_ref: np.ndarray
    nll_eng: np.ndarray
    delta_p: np.ndarray        # q_a - p_a
    ambiguous: np.ndarray      # excluded from divergence summaries (engines.md §10 rule 2)

    @property
    def hard_fail(self) -> np.ndarray:
        return ~np.isfinite(self.kl_part)

    @property
    def decided(self) -> np.ndarray:
        return self.margin >= NEAR_TIE_DELTA

    @property
    def confidence_bucket(self) -> np.ndarray:
        return np.clip(np.searchsorted(CONFIDENCE_EDGES, self.ref_top1_prob, side="right") - 1, 0, 4)


def _check_values(rec: Record, role: str) -> None:
    for name in ("topk_logprobs", "actual_logprob"):
        arr = getattr(rec, name)
        bad = np.isnan(arr) | (arr == np.inf)
        if bad.any():
            flat = int(np.argwhere(bad)[0][0])
            s = int(rec.pos_seq[flat])
            raise RecordError(f"{role} record: sequence {rec.seq_ids[s]!r} position {int(rec.pos_index[flat])}: "
                              f"{name} holds {arr.reshape(len(arr), -1)[flat].tolist()} (NaN or +inf)")


def _lookup(keys_sorted_rows: np.ndarray, values_rows: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Row-wise dictionary lookup: values of `queries[i, j]` in row i of (keys, values); NaN when absent.

    Rows are made globally sortable by offsetting each row's ids, so one searchsorted serves all rows.
    """
    n, width = keys_sorted_rows.shape
    if n == 0:
        return np.full(queries.shape, np.nan)
    span = int(max(keys_sorted_rows.max(initial=0), queries.max(initial=0))) + 2
    offset = (np.arange(n, dtype=np.int64) * span)[:, None]
    flat_keys = (np.where(keys_sorted_rows < 0, span - 1, keys_sorted_rows) + offset).ravel()
    flat_q = (np.where(queries < 0, span - 1, queries) + offset).ravel()
    idx = np.searchsorted(flat_keys, flat_q)
    idx = np.minimum(idx, flat_keys.size - 1)
    hit = (flat_keys[idx] == flat_q) & (queries.ravel() >= 0)
    out = np.where(hit, values_rows.ravel()[idx], np.nan)
    return out.reshape(queries.shape)


def _ref_lookup(ref: Record, ids: np.ndarray, rows: slice) -> np.ndarray:
    """Reference logprobs of `ids` (shape [n, m]) at positions `rows`; NaN where the oracle has no value."""
    if ref.full_logprobs is not None:
        full = ref.full_logprobs[rows].astype(np.float64)
        safe = np.clip(ids, 0, full.shape[1] - 1)
        return np.where(ids >= 0, np.take_along_axis(full, safe, axis=1), np.nan)
    keys = ref.topk_ids[rows]
    vals = ref.topk_logprobs[rows]
    actual = ref.actual_ids()[rows][:, None]
    keys = np.concatenate([keys, actual], axis=1)
    vals = np.concatenate([vals, ref.actual_logprob[rows][:, None]], axis=1)
    order = np.argsort(keys, axis=1, kind="stable")
    return _lookup(np.take_along_axis(keys, order, 1), np.take_along_axis(vals, order, 1), ids)


def _eng_lookup(eng: Record, ids: np.ndarray, rows: slice) -> np.ndarray:
    keys = np.concatenate([eng.topk_ids[rows], eng.actual_ids()[rows][:, None]], axis=1)
    vals = np.concatenate([eng.topk_logprobs[rows], eng.actual_logprob[rows][:, None]], axis=1)
    order = np.argsort(keys, axis=1, kind="stable")
    return _lookup(np.take_along_axis(keys, order, 1), np.take_along_axis(vals, order, 1), ids)


def _kl_partition_rows(ref: Record, eng: Record, rows: slice):
    e_ids = eng.topk_ids[rows]
    actual = eng.actual_ids()[rows]
    # E = engine top-k ∪ {a}; the actual column is dropped where it already sits in the top-k.
    in_topk = (e_ids == actual[:, None]).any(axis=1)
    cand = np.concatenate([e_ids, np.where(in_topk, -1, actual)[:, None]], axis=1)
    q_lp = np.concatenate([eng.topk_logprobs[rows], eng.actual_logprob[rows][:, None]], axis=1)
    p_lp = _ref_lookup(ref, cand, rows)
    valid = cand >= 0
    in_s = valid & ~np.isnan(p_lp)
    outside = (valid[:, :-1] & np.isnan(p_lp[:, :-1])).sum(axis=1)
    p_s = np.where(in_s, p_lp, -np.inf)
    q_s = np.where(in_s, q_lp, -np.inf)
    p = np.exp(p_s)
    with np.errstate(invalid="ignore", divide="ignore"):
        terms = np.where(p > 0, p * (p_s - q_s), 0.0)
        p_rest = -np.expm1(logsumexp(p_s, axis=1))
        q_rest = -np.expm1(logsumexp(q_s, axis=1))
        no_p_rest = p_rest < REST_FLOOR
        floored = ~no_p_rest & (q_rest < REST_FLOOR)
        q_rest_used = np.where(floored, REST_FLOOR, q_rest)
        rest = np.where(no_p_rest, 0.0, p_rest * (np.log(np.where(no_p_rest, 1.0, p_rest)) - np.log(q_rest_used)))
    kl = terms.sum(axis=1) + rest
    return kl, in_s.sum(axis=1), np.maximum(p_rest, 0.0), np.maximum(q_rest, 0.0), floored, outside, valid[:, :-1].sum(axis=1)


def _kl_r20_rows(ref: Record, eng: Record, rows: slice):
    width = min(R20_SUPPORT, ref.k)
    t_ids = ref.topk_ids[rows, :width]
    p_lp = ref.topk_logprobs[rows, :width]
    present = t_ids >= 0
    q_lp = _eng_lookup(eng, t_ids, rows)
    eng_lp = eng.topk_logprobs[rows]
    q_min = np.where(np.isfinite(eng_lp), eng_lp, np.inf).min(axis=1)
    missing = present & np.isnan(q_lp)
    q_lp = np.where(missing, q_min[:, None], q_lp)
    p_lp = np.where(present, p_lp, -np.inf)
    q_lp = np.where(present, q_lp, -np.inf)
    p_hat = p_lp - logsumexp(p_lp, axis=1, keepdims=True)
    q_hat = q_lp - logsumexp(q_lp, axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        kl = np.where(present, np.exp(p_hat) * (p_hat - q_hat), 0.0).sum(axis=1)
    return kl, missing.sum(axis=1)


def position_metrics(ref: Record, eng: Record, chunk: int = 131072) -> PositionMetrics:
    """All per-position metrics of engine record `eng` against reference `ref` (gates.md §2)."""
    ref.check_compatible(eng)
    _check_values(ref, "reference")
    _check_values(eng, "engine")
    n = ref.n_positions
    out: dict[str, list[np.ndarray]] = {k: [] for k in (
        "kl_part", "support_size", "p_rest", "q_rest", "rest_floored", "outside", "eng_k", "kl_r20", "r20_imputed")}
    for start in range(0, n, chunk):
        rows = slice(start, min(n, start + chunk))
        kl, size, pr, qr, fl, outside, ek = _kl_partition_rows(ref, eng, rows)
        r20, imputed = _kl_r20_rows(ref, eng, rows)
        for key, val in zip(out, (kl, size, pr, qr, fl, outside, ek, r20, imputed)):
            out[key].append(val)
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in out.items()}
    ref_lp1 = ref.topk_logprobs[:, 0]
    ref_lp2 = ref.topk_logprobs[:, 1] if ref.k > 1 else np.full(n, -np.inf)
    return PositionMetrics(
        seq=ref.pos_seq.copy(),
        domain=ref.position_domains(),
        kl_part=cat["kl_part"],
        kl_r20=cat["kl_r20"],
        r20_imputed=cat["r20_imputed"].astype(np.int64),
        support_size=cat["support_size"].astype(np.int64),
        p_rest=cat["p_rest"],
        q_rest=cat["q_rest"],
        rest_floored=cat["rest_floored"].astype(bool),
        engine_outside_oracle=cat["outside"].astype(np.int64),
        engine_topk_count=cat["eng_k"].astype(np.int64),
        top1_agree=eng.topk_ids[:, 0] == ref.topk_ids[:, 0],
        margin=ref_lp1 - ref_lp2,
        ref_top1_prob=np.exp(ref_lp1),
        nll_ref=-ref.actual_logprob,
        nll_eng=-eng.actual_logprob,
        delta_p=np.exp(eng.actual_logprob) - np.exp(ref.actual_logprob),
        ambiguous=(eng.ambiguous.copy() if eng.ambiguous is not None else np.zeros(n, dtype=bool)),
    )


# ---------------------------------------------------------------------------- summaries

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


def _percentile_if(values: np.ndarray, q: float) -> float | None:
    # A percentile q is printed only if n >= 10/(1-q) (gates.md §2.6).
    if values.size < 10 / (1 - q) - 1e-9:
        return None
    return float(np.quantile(values, q))


def prompt_bootstrap(values: np.ndarray, prompt: np.ndarray, n_boot: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the position-weighted mean, resampling prompts (not positions)."""
    if values.size == 0:
        return (float("nan"), float("nan"))
    uniq, inv = np.unique(prompt, return_inverse=True)
    sums = np.bincount(inv, weights=values)
    counts = np.bincount(inv).astype(np.float64)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, uniq.size, size=(n_boot, uniq.size))
    means = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def summarize(values: np.ndarray, prompt: np.ndarray, n_boot: int = 2000, seed: int = 0) -> Summary:
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    n_prompts = int(np.unique(prompt).size)
    if n == 0:
        nan = float("nan")
        return Summary(0, 0, nan, nan, nan, nan, None, None, None, None, None)
    lo, hi = prompt_bootstrap(values, prompt, n_boot, seed)
    naive = float(np.sqrt(values.var() / (n - 1))) if n > 1 else float("nan")
    enough = n >= 100  # no distribution statistics below 100 positions (gates.md §2.6)
    return Summary(
        n_positions=n, n_prompts=n_prompts, mean=float(values.mean()), ci_low=lo, ci_high=hi, naive_se=naive,
        median=float(np.median(values)) if enough else None,
        p90=_percentile_if(values, 0.90) if enough else None,
        p99=_percentile_if(values, 0.99) if enough else None,
        p999=_percentile_if(values, 0.999) if enough else None,
        max=float(values.max()) if enough else None,
    )


DP_QUANTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.5, 0.25, 0.10, 0.05, 0.01, 0.001)


def delta_p_stats(delta_p: np.ndarray) -> dict:
    """llama-perplexity style Δp statistics (gates.md §2.5), in probabilities."""
    d = np.asarray(delta_p, dtype=np.float64)
    if d.size == 0:
        return {}
    out = {"mean": float(d.mean()), "se": float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan"),
           "rms": float(np.sqrt(np.mean(d * d))), "max": float(d.max()), "min": float(d.min())}
    for q in DP_QUANTILES:
        out[f"p{q * 100:g}"] = float(np.quantile(d, q))
    return out


def perplexity_stats(nll_ref: np.ndarray, nll_eng: np.ndarray) -> dict:
    """PPL of each side and their ratio from paired differences (llama.cpp's form, gates.md §2.5)."""
    if nll_ref.size == 0:
        return {}
    diff = nll_eng - nll_ref
    out = {
        "ppl_ref": float(np.exp(nll_ref.mean())),
        "ppl_eng": float(np.exp(nll_eng.mean())),
        "ln_ratio": float(diff.mean()),
        "ln_ratio_se": float(diff.std(ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else float("nan"),
    }
    out["ratio"] = float(np.exp(out["ln_ratio"]))
    out["diff"] = out["ppl_eng"] - out["ppl_ref"]
    return out


@dataclass
class GroupReport:
    """Every summary for one group of positions (a domain, or the whole panel)."""

    name: str
    n_positions: int
    n_prompts: int
    kl_part: Summary
    kl_r20: Summary
    top1: float
    top1_decided: float
    n_decided: int
    perplexity: dict
    delta_p: dict
    hard_fails: int
    rest_floored: int
    ambiguous: int
    r20_imputation_rate: float
    mean_support: float
    mean_p_rest: float
    mean_q_rest: float
    oracle_coverage: float
    buckets: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["kl_part"] = self.kl_part.as_dict()
        d["kl_r20"] = self.kl_r20.as_dict()
        return d


def group_report(pm: PositionMetrics, mask: np.ndarray, name: str, n_boot: int = 2000, seed: int = 0) -> GroupReport:
    usable = mask & ~pm.ambiguous
    finite = usable & ~pm.hard_fail
    seq = pm.seq
    decided = usable & pm.decided
    buckets = []
    for b, label in enumerate(CONFIDENCE_LABELS):
        m = finite & (pm.confidence_bucket == b)
        buckets.append({
            "bucket": label, "n": int(m.sum()),
            "kl_mean": float(pm.kl_part[m].mean()) if m.any() else None,
            "kl_median": float(np.median(pm.kl_part[m])) if m.any() else None,
            "top1": float(pm.top1_agree[m].mean()) if m.any() else None,
        })
    n_r20 = int(usable.sum()) * R20_SUPPORT
    eng_k = pm.engine_topk_count[usable].sum()
    return GroupReport(
        name=name,
        n_positions=int(mask.sum()),
        n_prompts=int(np.unique(seq[mask]).size),
        kl_part=summarize(pm.kl_part[finite], seq[finite], n_boot, seed),
        kl_r20=summarize(pm.kl_r20[usable], seq[usable], n_boot, seed),
        top1=float(pm.top1_agree[usable].mean()) if usable.any() else float("nan"),
        top1_decided=float(pm.top1_agree[decided].mean()) if decided.any() else float("nan"),
        n_decided=int(decided.sum()),
        perplexity=perplexity_stats(pm.nll_ref[mask], pm.nll_eng[mask]),
        delta_p=delta_p_stats(pm.delta_p[mask]),
        hard_fails=int((usable & pm.hard_fail).sum()),
        rest_floored=int((usable & pm.rest_floored).sum()),
        ambiguous=int((mask & pm.ambiguous).sum()),
        r20_imputation_rate=float(pm.r20_imputed[usable].sum() / n_r20) if n_r20 else float("nan"),
        mean_support=float(pm.support_size[usable].mean()) if usable.any() else float("nan"),
        mean_p_rest=float(pm.p_rest[usable].mean()) if usable.any() else float("nan"),
        mean_q_rest=float(pm.q_rest[usable].mean()) if usable.any() else float("nan"),
        oracle_coverage=float(1 - pm.engine_outside_oracle[usable].sum() / eng_k) if eng_k else float("nan"),
        buckets=buckets,
    )


@dataclass
class PanelMetrics:
    """Per-domain and overall results of one engine record against the reference."""

    overall: GroupReport
    domains: dict[str, GroupReport]
    macro_kl: float                 # mean of per-domain mean KL_part, domains weighted equally
    macro_kl_ci: tuple[float, float]
    macro_top1: float
    positions: PositionMetrics

    def as_dict(self) -> dict:
        return {
            "overall": self.overall.as_dict(),
            "domains": {k: v.as_dict() for k, v in self.domains.items()},
            "macro": {"kl_part": self.macro_kl, "kl_part_ci": list(self.macro_kl_ci), "top1": self.macro_top1},
        }


def macro_bootstrap(values: np.ndarray, prompt: np.ndarray, domain: np.ndarray, n_boot: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """Interval of the domain-macro mean: prompts resampled within each domain, domains weighted equally."""
    rng = np.random.default_rng(seed)
    per_domain = []
    for d in np.unique(domain):
        m = domain == d
        uniq, inv = np.unique(prompt[m], return_inverse=True)
        sums = np.bincount(inv, weights=values[m])
        counts = np.bincount(inv).astype(np.float64)
        pick = rng.integers(0, uniq.size, size=(n_boot, uniq.size))
        per_domain.append(sums[pick].sum(axis=1) / counts[pick].sum(axis=1))
    if not per_domain:
        return (float("nan"), float("nan"))
    macro = np.mean(per_domain, axis=0)
    return float(np.quantile(macro, 0.025)), float(np.quantile(macro, 0.975))


def panel_metrics(ref: Record, eng: Record, n_boot: int = 2000, seed: int = 0) -> PanelMetrics:
    pm = position_metrics(ref, eng)
    everything = np.ones(pm.kl_part.size, dtype=bool)
    domains = {}
    for d in dict.fromkeys(ref.domains):  # panel order
        domains[d] = group_report(pm, pm.domain == d, d, n_boot, seed)
    finite = ~pm.hard_fail & ~pm.ambiguous
    kl_means = [g.kl_part.mean for g in domains.values() if g.kl_part.n_positions]
    return PanelMetrics(
        overall=group_report(pm, everything, "overall", n_boot, seed),
        domains=domains,
        macro_kl=float(np.mean(kl_means)) if kl_means else float("nan"),
        macro_kl_ci=macro_bootstrap(pm.kl_part[finite], pm.seq[finite], pm.domain[finite], n_boot, seed),
        macro_top1=float(np.mean([g.top1 for g in domains.values()])) if domains else float("nan"),
        positions=pm,
    )


# ---------------------------------------------------------------------------- paired comparison

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

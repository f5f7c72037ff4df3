"""Per-group and per-panel reports: position-weighted and domain-macro summaries, confidence buckets.

`panel_metrics` scores an engine record against the reference (`position_metrics`) and reports each
domain and the whole panel (gates.md §2.4–§2.6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from core.metrics.definition import CONFIDENCE_EDGES, CONFIDENCE_LABELS, R20_SUPPORT, PositionMetrics
from core.metrics.positions import position_metrics
from core.metrics.summaries import (Summary, binomial_rate, count_groups, delta_p_stats, macro_bootstrap,
                                    perplexity_stats, summarize)
from core.records import Record


@dataclass
class GroupReport:
    """Every summary for one group of positions (a domain, or the whole panel).

    Ambiguous positions (string-keyed surface collisions) are excluded from every statistic, KL, top-1,
    perplexity and Δp alike, and counted in `ambiguous`; `n_positions` counts the group with them and
    `n_usable` without. `kl_part` leaves out its hard fails (counted in `hard_fails`), `kl_r20` its
    non-finite positions (counted in `r20_hard_fails`: no finite engine value to impute from, or an
    engine probability 0 inside the support). `top1_se` / `top1_decided_se` are binomial standard
    errors. `regions` holds perplexity and Δp per region ("prompt", "continuation") when a region mask
    was given, else it is empty.
    """

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
    n_usable: int = 0
    top1_se: float = math.nan
    top1_decided_se: float = math.nan
    r20_hard_fails: int = 0
    regions: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["kl_part"] = self.kl_part.as_dict()
        d["kl_r20"] = self.kl_r20.as_dict()
        return d


def _mean_or_nan(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else math.nan


def group_report(pm: PositionMetrics, mask: np.ndarray, name: str, n_boot: int = 2000, seed: int = 0,
                 continuation: np.ndarray | None = None) -> GroupReport:
    """Summaries of the positions in `mask`. `continuation` (optional bool [P]) marks the continuation
    region (oracle-greedy tokens); when given, perplexity and Δp are also reported per region."""
    mask = np.asarray(mask, dtype=bool)
    usable = mask & ~pm.ambiguous
    kl_finite = np.isfinite(pm.kl_part)
    finite = usable & kl_finite
    r20_ok = usable & np.isfinite(pm.kl_r20)
    seq = pm.seq
    decided = usable & pm.decided
    n_usable = int(np.count_nonzero(usable))
    idx = np.flatnonzero(finite)
    kl_f = pm.kl_part[idx]
    bucket = np.clip(np.searchsorted(CONFIDENCE_EDGES, pm.ref_top1_prob[idx], side="right") - 1, 0, 4)
    agree_f = pm.top1_agree[idx]
    buckets = []
    for b, label in enumerate(CONFIDENCE_LABELS):
        m = bucket == b
        nb = int(np.count_nonzero(m))
        kb = kl_f[m] if nb else kl_f[:0]
        buckets.append({
            "bucket": label, "n": nb,
            "kl_mean": float(kb.mean()) if nb else None,
            "kl_median": float(np.median(kb)) if nb else None,
            "top1": float(agree_f[m].mean()) if nb else None,
        })
    n_r20 = n_usable * R20_SUPPORT
    u_idx = np.flatnonzero(usable)
    eng_k = int(pm.engine_topk_count[u_idx].sum())
    top1, top1_se = binomial_rate(pm.top1_agree[u_idx])
    top1_d, top1_d_se = binomial_rate(pm.top1_agree[decided])
    nll_ref, nll_eng, dp = pm.nll_ref[u_idx], pm.nll_eng[u_idx], pm.delta_p[u_idx]
    regions = {}
    if continuation is not None:
        cont = np.asarray(continuation, dtype=bool)[u_idx]
        for region, sel in (("prompt", ~cont), ("continuation", cont)):
            regions[region] = {"n": int(np.count_nonzero(sel)), "perplexity": perplexity_stats(nll_ref[sel], nll_eng[sel]),
                               "delta_p": delta_p_stats(dp[sel])}
    return GroupReport(
        name=name,
        n_positions=int(np.count_nonzero(mask)),
        n_prompts=count_groups(seq[mask]),
        kl_part=summarize(kl_f, seq[idx], n_boot, seed),
        kl_r20=summarize(pm.kl_r20[r20_ok], seq[r20_ok], n_boot, seed),
        top1=top1,
        top1_decided=top1_d,
        n_decided=int(np.count_nonzero(decided)),
        perplexity=perplexity_stats(nll_ref, nll_eng),
        delta_p=delta_p_stats(dp),
        hard_fails=int(np.count_nonzero(usable & ~kl_finite)),
        rest_floored=int(np.count_nonzero(usable & pm.rest_floored)),
        ambiguous=int(np.count_nonzero(mask & pm.ambiguous)),
        r20_imputation_rate=float(pm.r20_imputed[u_idx].sum() / n_r20) if n_r20 else math.nan,
        mean_support=_mean_or_nan(pm.support_size[u_idx]),
        mean_p_rest=_mean_or_nan(pm.p_rest[u_idx]),
        mean_q_rest=_mean_or_nan(pm.q_rest[u_idx]),
        oracle_coverage=float(1 - pm.engine_outside_oracle[u_idx].sum() / eng_k) if eng_k else math.nan,
        buckets=buckets,
        n_usable=n_usable,
        top1_se=top1_se,
        top1_decided_se=top1_d_se,
        r20_hard_fails=int(np.count_nonzero(usable & ~np.isfinite(pm.kl_r20))),
        regions=regions,
    )


@dataclass
class PanelMetrics:
    """Per-domain and overall results of one engine record against the reference."""

    overall: GroupReport
    domains: dict[str, GroupReport]
    macro_kl: float                 # mean of per-domain mean KL_part, domains weighted equally
    macro_kl_ci: tuple[float, float]
    macro_top1: float               # mean of per-domain top-1; domains without usable positions skipped
    positions: PositionMetrics

    def as_dict(self) -> dict:
        return {
            "overall": self.overall.as_dict(),
            "domains": {k: v.as_dict() for k, v in self.domains.items()},
            "macro": {"kl_part": self.macro_kl, "kl_part_ci": list(self.macro_kl_ci), "top1": self.macro_top1},
        }


def _nanmean(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return float(np.mean(vals)) if vals else math.nan


def panel_metrics(ref: Record, eng: Record, n_boot: int = 2000, seed: int = 0,
                  continuation: np.ndarray | None = None) -> PanelMetrics:
    """Every metric of `eng` against `ref`, per domain (panel order) and overall.

    `continuation` (optional bool [P]) marks continuation-region positions; when absent, a
    `continuation` array carried by the reference record (a future record field) is used if present.
    """
    pm = position_metrics(ref, eng)
    if continuation is None:
        continuation = getattr(ref, "continuation", None)
    # Domain masks from per-sequence codes (an int comparison, not a string one, per domain); codes are
    # assigned in sorted-name order so that the macro bootstrap draws in np.unique's domain order.
    names = sorted(set(ref.domains))
    code_of = {d: i for i, d in enumerate(names)}
    pos_code = np.asarray([code_of[d] for d in ref.domains], dtype=np.int64)[pm.seq]
    domains = {}
    for d in dict.fromkeys(ref.domains):  # panel order
        domains[d] = group_report(pm, pos_code == code_of[d], d, n_boot, seed, continuation)
    finite = np.flatnonzero(np.isfinite(pm.kl_part) & ~pm.ambiguous)
    return PanelMetrics(
        overall=group_report(pm, np.ones(pm.kl_part.size, dtype=bool), "overall", n_boot, seed, continuation),
        domains=domains,
        macro_kl=_nanmean([g.kl_part.mean for g in domains.values() if g.kl_part.n_positions]),
        macro_kl_ci=macro_bootstrap(pm.kl_part[finite], pm.seq[finite], pos_code[finite], n_boot, seed),
        macro_top1=_nanmean([g.top1 for g in domains.values()]),
        positions=pm,
    )

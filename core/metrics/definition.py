"""The per-position metrics of gates.md §2, written to be checked against the text line by line.

One position at a time, with Python dicts for the id → logprob tables and scipy's `logsumexp`, in
float64. This is the definition the fast kernel (`core.metrics.kernel`) is tested equal to; it is
slow (tens of microseconds a position) and meant for tests and spot checks, or for
`DS41_METRICS_BACKEND=definition`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from scipy.special import logsumexp

from core.records import Record, RecordError

REST_FLOOR = 1e-12          # §2.2: below this a rest mass counts as empty (P) or is floored (Q)
NEAR_TIE_DELTA = 0.05       # §1: a position is a near-tie when ln p(1) - ln p(2) < δ (nats)
R20_SUPPORT = 20            # §2.3: the oracle's top-20 ids
# a KL below −this at a position is impossible, not rounding: records pass the top-k mass check
# (core.records.TOPK_MASS_SLACK), so a partition KL can dip below 0 by about that slack and no more
KL_NEGATIVE_SLACK = 2e-4
CONFIDENCE_EDGES = (0.0, 0.25, 0.5, 0.75, 0.95, 1.0)  # §2.4: buckets of the oracle top-1 probability
CONFIDENCE_LABELS = ("[0,.25)", "[.25,.5)", "[.5,.75)", "[.75,.95)", "[.95,1]")


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


def refuse_bad_values(rec: Record, role: str) -> None:
    """RecordError naming the first sequence and position whose logprobs hold NaN or +inf."""
    for name in ("topk_logprobs", "actual_logprob"):
        arr = getattr(rec, name)
        bad = np.isnan(arr) | (arr == np.inf)
        if bad.any():
            flat = int(np.argwhere(bad)[0][0])
            s = int(rec.pos_seq[flat])
            raise RecordError(f"{role} record: sequence {rec.seq_ids[s]!r} position {int(rec.pos_index[flat])}: "
                              f"{name} holds {arr.reshape(len(arr), -1)[flat].tolist()} (NaN or +inf)")


def refuse_impossible_kl(pm: PositionMetrics, ref: Record) -> PositionMetrics:
    """`pm` unchanged, or RecordError naming the first sequence and position whose KL_part or KL_r20 is below
    −KL_NEGATIVE_SLACK: a KL is never negative, so such a number says the inputs are not distributions and no
    mean of it may reach a report."""
    for name in ("kl_part", "kl_r20"):
        values = getattr(pm, name)
        bad = values < -KL_NEGATIVE_SLACK        # NaN (undefined KL_r20) compares False
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise RecordError(f"{name} {float(values[i]):.6g} < 0 at sequence {ref.seq_ids[int(ref.pos_seq[i])]!r} "
                              f"position {int(ref.pos_index[i])} (slack {KL_NEGATIVE_SLACK:g}): a KL divergence "
                              "cannot be negative; the reference or the engine record is not a distribution")
    return pm


class PartitionKL(NamedTuple):
    kl: float
    support_size: int
    p_rest: float
    q_rest: float
    rest_floored: bool
    engine_outside_oracle: int
    engine_topk_count: int


class RenormalisedKL(NamedTuple):
    kl: float
    imputed: int


def engine_values(topk_ids, topk_logprobs, actual_id: int, actual_logprob: float) -> dict[int, float]:
    """E with its ln q (§2.1): the engine's top-k (padding ids < 0 dropped) plus the actual token a.
    A top-k value wins over the separately reported ln q_a. Clamped values (ln q ≤ −9999, §2.2: q_t = 0)
    were turned into −inf when the record was built (`core.records.CLAMP_LOGPROB`)."""
    known = {int(t): float(v) for t, v in zip(topk_ids, topk_logprobs) if t >= 0}
    known.setdefault(int(actual_id), float(actual_logprob))
    return known


class FullVocabulary(Mapping):
    """ln p of every id of a stored full-vocabulary row (float32 on disk, read as float64)."""

    def __init__(self, row: np.ndarray):
        self.row = row

    def __getitem__(self, t: int) -> float:
        if not 0 <= t < len(self.row):
            raise KeyError(t)
        return float(self.row[t])

    def __contains__(self, t: object) -> bool:
        return isinstance(t, int) and 0 <= t < len(self.row)

    def __iter__(self):
        return iter(range(len(self.row)))

    def __len__(self) -> int:
        return len(self.row)


def oracle_values(topk_ids, topk_logprobs, actual_id: int, actual_logprob: float,
                  full_logprobs=None) -> Mapping[int, float]:
    """O with its ln p (§2.1): the full vocabulary when stored, else the oracle top-K_O ∪ {a}."""
    if full_logprobs is not None:
        return FullVocabulary(full_logprobs)
    known = {int(t): float(v) for t, v in zip(topk_ids, topk_logprobs) if t >= 0}
    known.setdefault(int(actual_id), float(actual_logprob))
    return known


def partition_kl(oracle: Mapping[int, float], engine: dict[int, float], engine_topk_ids) -> PartitionKL:
    """KL_part (§2.2) on the cells S = E ∩ O plus one rest cell."""
    support = [t for t in engine if t in oracle]                    # §2.2.1 S = E ∩ O
    ln_p = np.array([oracle[t] for t in support], dtype=np.float64)
    ln_q = np.array([engine[t] for t in support], dtype=np.float64)
    p_rest = -math.expm1(logsumexp(ln_p)) if support else 1.0       # §2.2 rules: P_rest = −expm1(logsumexp_S ln p)
    q_rest = -math.expm1(logsumexp(ln_q)) if support else 1.0
    p = np.exp(ln_p)
    # q_t = 0 (ln q = −inf) under p_t > 0 gives +inf: a hard fail of the position
    with np.errstate(invalid="ignore"):
        kl = float(np.sum(np.where(p > 0, p * (ln_p - ln_q), 0.0)))  # a term with p_t = 0 contributes 0
    floored = False
    if p_rest >= REST_FLOOR:                                        # P_rest < 1e-12: the rest term is 0
        if q_rest < REST_FLOOR:                                     # Σ_S q over 1 by rounding: floor, count it
            floored = True
        kl += p_rest * (math.log(p_rest) - math.log(REST_FLOOR if floored else q_rest))
    topk = [int(t) for t in engine_topk_ids if t >= 0]
    outside = sum(1 for t in topk if t not in oracle)               # reported: oracle coverage
    return PartitionKL(kl, len(support), max(p_rest, 0.0), max(q_rest, 0.0), floored, outside, len(topk))


def renormalised_top20_kl(ref_topk_ids, ref_topk_logprobs, engine: dict[int, float],
                          engine_topk_logprobs) -> RenormalisedKL:
    """KL_r20 (§2.3) over T = the oracle's first 20 ids in rank order (the record keeps ties by lower id)."""
    top = [(int(t), float(v)) for t, v in zip(ref_topk_ids[:R20_SUPPORT], ref_topk_logprobs[:R20_SUPPORT]) if t >= 0]
    if not top:
        return RenormalisedKL(0.0, 0)
    finite = [float(v) for v in engine_topk_logprobs if np.isfinite(v)]
    ln_q_min = min(finite) if finite else None                      # q_min: smallest probability the engine gave
    imputed = sum(1 for t, _ in top if t not in engine)
    if imputed and ln_q_min is None:                                # nothing to impute from: undefined
        return RenormalisedKL(math.nan, imputed)
    ln_p = np.array([v for _, v in top])
    ln_q = np.array([engine.get(t, ln_q_min) for t, _ in top])     # t ∉ E: impute q_t := q_min, counted
    lse_p = logsumexp(ln_p)
    if lse_p == -math.inf:                                          # no reference mass on T: undefined
        return RenormalisedKL(math.nan, imputed)
    with np.errstate(invalid="ignore"):
        ln_p_hat = ln_p - lse_p                                     # p̂_t = p_t / Σ_T p
        ln_q_hat = ln_q - logsumexp(ln_q)                           # q̂_t = q_t / Σ_T q
        p_hat = np.exp(ln_p_hat)
        kl = float(np.sum(np.where(p_hat > 0, p_hat * (ln_p_hat - ln_q_hat), 0.0)))
    return RenormalisedKL(kl, imputed)


class PositionRow(NamedTuple):
    partition: PartitionKL
    r20: RenormalisedKL
    top1_agree: bool
    margin: float
    ref_top1_prob: float
    nll_ref: float
    nll_eng: float
    delta_p: float


def position_row(ref: Record, eng: Record, i: int, actual_id: int) -> PositionRow:
    """Every per-position metric of position i (row i of both records)."""
    full = ref.full_logprobs[i] if ref.full_logprobs is not None else None
    oracle = oracle_values(ref.topk_ids[i], ref.topk_logprobs[i], actual_id, ref.actual_logprob[i], full)
    engine = engine_values(eng.topk_ids[i], eng.topk_logprobs[i], actual_id, eng.actual_logprob[i])
    ln_p1 = float(ref.topk_logprobs[i, 0])
    ln_p2 = float(ref.topk_logprobs[i, 1]) if ref.k > 1 else -math.inf
    ln_p_a, ln_q_a = float(ref.actual_logprob[i]), float(eng.actual_logprob[i])
    with np.errstate(invalid="ignore"):
        margin = float(np.float64(ln_p1) - ln_p2)                   # §1 m = ln p(1) − ln p(2); NaN when both padded
    return PositionRow(
        partition=partition_kl(oracle, engine, eng.topk_ids[i]),
        r20=renormalised_top20_kl(ref.topk_ids[i], ref.topk_logprobs[i], engine, eng.topk_logprobs[i]),
        top1_agree=bool(eng.topk_ids[i, 0] == ref.topk_ids[i, 0]),  # §2.4 engine rank-1 id = oracle rank-1 id
        margin=margin,
        ref_top1_prob=float(np.exp(ln_p1)),                         # §2.4 p(1), for the confidence bucket
        nll_ref=-ln_p_a,                                            # §2.5 NLL_ref = −ln p_a
        nll_eng=-ln_q_a,                                            # §2.5 NLL_eng = −ln q_a
        delta_p=float(np.exp(ln_q_a) - np.exp(ln_p_a)),             # §2.5 Δp = q_a − p_a, in probabilities
    )


def definition_position_metrics(ref: Record, eng: Record) -> PositionMetrics:
    """`position_metrics` computed position by position from the functions above."""
    ref.check_compatible(eng)
    refuse_bad_values(ref, "reference")
    refuse_bad_values(eng, "engine")
    n = ref.n_positions
    actual = ref.actual_ids()
    rows = [position_row(ref, eng, i, int(actual[i])) for i in range(n)]

    def column(get, dtype):
        return np.fromiter((get(r) for r in rows), dtype=dtype, count=n)

    return refuse_impossible_kl(PositionMetrics(
        seq=ref.pos_seq.copy(),
        domain=ref.position_domains(),
        kl_part=column(lambda r: r.partition.kl, np.float64),
        kl_r20=column(lambda r: r.r20.kl, np.float64),
        r20_imputed=column(lambda r: r.r20.imputed, np.int64),
        support_size=column(lambda r: r.partition.support_size, np.int64),
        p_rest=column(lambda r: r.partition.p_rest, np.float64),
        q_rest=column(lambda r: r.partition.q_rest, np.float64),
        rest_floored=column(lambda r: r.partition.rest_floored, bool),
        engine_outside_oracle=column(lambda r: r.partition.engine_outside_oracle, np.int64),
        engine_topk_count=column(lambda r: r.partition.engine_topk_count, np.int64),
        top1_agree=column(lambda r: r.top1_agree, bool),
        margin=column(lambda r: r.margin, np.float64),
        ref_top1_prob=column(lambda r: r.ref_top1_prob, np.float64),
        nll_ref=column(lambda r: r.nll_ref, np.float64),
        nll_eng=column(lambda r: r.nll_eng, np.float64),
        delta_p=column(lambda r: r.delta_p, np.float64),
        ambiguous=(np.asarray(eng.ambiguous, dtype=bool).copy() if eng.ambiguous is not None
                   else np.zeros(n, dtype=bool)),        # engines.md §10: string-keyed surface collisions
    ), ref)

"""Fidelity metrics between a reference record and an engine record (gates.md §2).

Pure, vectorised functions over `Record` arrays. Every per-position metric is computed once by
`position_metrics`; summaries, domain aggregation and paired comparisons work on its output.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

import numpy as np
from scipy import stats
from scipy.special import logsumexp

from core.records import Record, RecordError

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


# ---------------------------------------------------------------------------- per-position core
#
# Two implementations of the same per-position core (§2.2 partition KL, §2.3 renormalised top-20 KL):
#   * "numba": one compiled row kernel, rows in parallel; every row is computed independently and
#     sequentially, so results do not depend on the thread count. Used when numba is importable.
#   * "numpy": the vectorised reference path (row-wise sorted lookups, scipy logsumexp), chunked.
# They agree to rounding: a KL_part with a small Q_rest is ill-conditioned (δQ_rest ~ 1e-16 moves it by
# P_rest·1e-16/Q_rest), so the two can differ by ~1e-12 where Q_rest ~ 1e-5.
# DS41_METRICS_BACKEND=numpy|numba forces one; tests run both against a per-position Python reference.

try:  # optional compiled backend
    import numba as _numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    _numba = None

_CORE_FIELDS = ("kl_part", "support_size", "p_rest", "q_rest", "rest_floored", "outside", "eng_k",
                "kl_r20", "r20_imputed")


def backend() -> str:
    """The per-position backend `position_metrics` uses: "numba" or "numpy"."""
    want = os.environ.get("DS41_METRICS_BACKEND", "auto").strip().lower()
    if want == "numpy":
        return "numpy"
    if want not in ("auto", "numba"):
        raise ValueError(f"DS41_METRICS_BACKEND={want!r}: expected auto, numba or numpy")
    if _numba is None:
        if want == "numba":
            raise RuntimeError("DS41_METRICS_BACKEND=numba but numba is not installed")
        return "numpy"
    return "numba"


def _find(ids, i, t, hint):
    """Column of id t in row i of ids (unique ids), searching outwards from column `hint`; -1 if absent.
    Both sides list ids in logprob order, so an id is usually found within a column or two of `hint`."""
    width = ids.shape[1]
    hi = min(hint, width)
    lo = hi - 1
    while lo >= 0 or hi < width:
        if hi < width:
            if ids[i, hi] == t:
                return hi
            hi += 1
        if lo >= 0:
            if ids[i, lo] == t:
                return lo
            lo -= 1
    return -1


def _ln(s):
    return math.log(s) if s > 0.0 else -np.inf


def _core_rows(ref_ids, ref_lp, ref_act, full, has_full, eng_ids, eng_lp, eng_act, actual, width, rest_floor,
               lo_row, hi_row, ref_e, eng_e, pt, qt, pe20, qe20,
               kl_part, support, p_rest_o, q_rest_o, floored, outside, eng_k, kl_r20, r20_imp, bad):
    """Rows [lo_row, hi_row): each row is computed on its own, in a fixed order (thread-count independent).

    Every probability exp(ln p) is computed once per row and shared by the two divergences. Sums over a
    support are sums of probabilities (logprobs are <= 0, so nothing overflows): logsumexp_S ln p =
    ln Σ_S p. The rest masses P_rest = -expm1(logsumexp) = 1 - Σ_S p are taken from compensated
    (Neumaier) sums, so they are exact to the rounding of the exp values even when they are tiny.
    """
    k_ref = ref_ids.shape[1]
    k_eng = eng_ids.shape[1]
    vocab = full.shape[1]
    for i in range(lo_row, hi_row):
        a = actual[i]
        # -- NaN / +inf guard (the caller turns a flagged row into a RecordError naming it)
        flag = 0
        for r in range(k_ref):
            v = ref_lp[i, r]
            if v != v or v == np.inf:
                flag = 1
        for j in range(k_eng):
            v = eng_lp[i, j]
            if v != v or v == np.inf:
                flag = 1
        for v in (ref_act[i], eng_act[i]):
            if v != v or v == np.inf:
                flag = 1
        bad[i] = flag
        for j in range(k_eng):
            eng_e[j] = math.exp(eng_lp[i, j])
        for r in range(k_ref):
            ref_e[r] = math.exp(ref_lp[i, r]) if r < width else -1.0  # -1: not computed yet
        # -- partition KL (§2.2): S = (engine top-k ∪ {a}) ∩ O
        sp = 0.0
        sq = 0.0
        sp_c = 0.0
        sq_c = 0.0
        terms = 0.0
        ns = 0
        n_out = 0
        ek = 0
        a_in_topk = False
        for j in range(k_eng + 1):
            if j < k_eng:
                t = eng_ids[i, j]
                if t < 0:
                    continue
                ek += 1
                if t == a:
                    a_in_topk = True
                q = eng_lp[i, j]
                qe = eng_e[j]
            else:
                if a_in_topk:
                    break
                t = a
                q = eng_act[i]
                qe = math.exp(q)
            found = False
            p = 0.0
            pe = 0.0
            if has_full:
                if t < vocab:
                    p = np.float64(full[i, t])
                    pe = math.exp(p)
                    found = True
            else:
                c = _find(ref_ids, i, t, j)
                if c >= 0:
                    p = ref_lp[i, c]
                    if ref_e[c] < 0.0:
                        ref_e[c] = math.exp(p)
                    pe = ref_e[c]
                    found = True
                elif t == a:
                    p = ref_act[i]
                    pe = math.exp(p)
                    found = True
            if found:
                ns += 1
                # Neumaier-compensated sums: the rest masses 1 - Σ are the ill-conditioned part
                t1 = sp + pe
                if sp >= pe:
                    sp_c += (sp - t1) + pe
                else:
                    sp_c += (pe - t1) + sp
                sp = t1
                t1 = sq + qe
                if sq >= qe:
                    sq_c += (sq - t1) + qe
                else:
                    sq_c += (qe - t1) + sq
                sq = t1
                if pe > 0.0:
                    terms += pe * (p - q)
            elif j < k_eng:
                n_out += 1
        pr = (1.0 - sp) - sp_c  # = -expm1(logsumexp_S ln p), without the rounding of ln and expm1
        qr = (1.0 - sq) - sq_c
        rest = 0.0
        fl = False
        if pr >= rest_floor:
            qu = qr
            if qr < rest_floor:
                qu = rest_floor
                fl = True
            rest = pr * (math.log(pr) - math.log(qu))
        kl_part[i] = terms + rest
        support[i] = ns
        p_rest_o[i] = max(pr, 0.0)
        q_rest_o[i] = max(qr, 0.0)
        floored[i] = fl
        outside[i] = n_out
        eng_k[i] = ek
        # -- renormalised top-20 KL (§2.3) over the reference's first `width` ids
        q_min = np.inf
        for j in range(k_eng):
            v = eng_lp[i, j]
            if v > -np.inf and v < q_min:
                q_min = v
        qe_min = math.exp(q_min) if q_min < np.inf else 0.0
        nt = 0
        imputed = 0
        sp = 0.0
        sq = 0.0
        for r in range(width):
            t = ref_ids[i, r]
            if t < 0:
                continue
            pt[nt] = ref_lp[i, r]
            pe20[nt] = ref_e[r]
            c = _find(eng_ids, i, t, r)
            if c >= 0:
                qt[nt] = eng_lp[i, c]
                qe20[nt] = eng_e[c]
            elif t == a:
                qt[nt] = eng_act[i]
                qe20[nt] = math.exp(eng_act[i])
            else:
                qt[nt] = q_min
                qe20[nt] = qe_min
                imputed += 1
            sp += pe20[nt]
            sq += qe20[nt]
            nt += 1
        r20_imp[i] = imputed
        if (imputed > 0 and q_min == np.inf) or (nt > 0 and sp == 0.0):
            kl_r20[i] = np.nan  # nothing to impute from / no reference mass: undefined, an r20 hard fail
            continue
        lp = _ln(sp)
        lq = _ln(sq)
        acc = 0.0
        for s in range(nt):
            if pe20[s] > 0.0:
                acc += (pe20[s] / sp) * ((pt[s] - lp) - (qt[s] - lq))
        kl_r20[i] = acc


def _core_parallel(ref_ids, ref_lp, ref_act, full, has_full, eng_ids, eng_lp, eng_act, actual, width, rest_floor,
                   n_blocks, kl_part, support, p_rest_o, q_rest_o, floored, outside, eng_k, kl_r20, r20_imp, bad):
    n = ref_ids.shape[0]
    step = (n + n_blocks - 1) // n_blocks
    for b in _prange(n_blocks):
        lo_row = b * step
        hi_row = min(n, lo_row + step)
        ref_e = np.empty(max(ref_ids.shape[1], 1))
        eng_e = np.empty(max(eng_ids.shape[1], 1))
        pt = np.empty(max(width, 1))
        qt = np.empty(max(width, 1))
        pe20 = np.empty(max(width, 1))
        qe20 = np.empty(max(width, 1))
        _core_rows(ref_ids, ref_lp, ref_act, full, has_full, eng_ids, eng_lp, eng_act, actual, width, rest_floor,
                   lo_row, hi_row, ref_e, eng_e, pt, qt, pe20, qe20,
                   kl_part, support, p_rest_o, q_rest_o, floored, outside, eng_k, kl_r20, r20_imp, bad)


if _numba is not None:
    _prange = _numba.prange
    _ln = _numba.njit(cache=True, nogil=True)(_ln)
    _find = _numba.njit(cache=True, nogil=True)(_find)
    _core_rows = _numba.njit(cache=True, nogil=True)(_core_rows)
    _core_parallel = _numba.njit(cache=True, nogil=True, parallel=True)(_core_parallel)
else:  # pragma: no cover
    _prange = range


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


def _table_lookup(ids: np.ndarray, lps: np.ndarray, act_ids: np.ndarray, act_lp: np.ndarray,
                  queries: np.ndarray) -> np.ndarray:
    """Values of `queries` in (top-k ∪ {a}) per row; a top-k value wins over the actual column."""
    keys = np.concatenate([ids, act_ids[:, None]], axis=1)
    vals = np.concatenate([lps, act_lp[:, None]], axis=1)
    order = np.argsort(keys, axis=1, kind="stable")
    return _lookup(np.take_along_axis(keys, order, 1), np.take_along_axis(vals, order, 1), queries)


def _core_numpy(ref: Record, eng: Record, actual: np.ndarray, rows: slice) -> tuple[np.ndarray, ...]:
    """Vectorised per-position core over `rows` (the fallback when numba is absent)."""
    a = actual[rows]
    # ---- partition KL (§2.2). E = engine top-k ∪ {a}; the actual column is dropped where it is in the top-k.
    e_ids = eng.topk_ids[rows]
    in_topk = (e_ids == a[:, None]).any(axis=1)
    cand = np.concatenate([e_ids, np.where(in_topk, -1, a)[:, None]], axis=1)
    q_lp = np.concatenate([eng.topk_logprobs[rows], eng.actual_logprob[rows][:, None]], axis=1)
    if ref.full_logprobs is not None:
        full = ref.full_logprobs[rows]
        vocab = full.shape[1]
        known = (cand >= 0) & (cand < vocab)
        p_lp = np.where(known, np.take_along_axis(full, np.clip(cand, 0, vocab - 1), axis=1).astype(np.float64),
                        np.nan)
    else:
        p_lp = _table_lookup(ref.topk_ids[rows], ref.topk_logprobs[rows], a, ref.actual_logprob[rows], cand)
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
    # ---- renormalised top-20 KL (§2.3)
    width = min(R20_SUPPORT, ref.k)
    t_ids = ref.topk_ids[rows, :width]
    present = t_ids >= 0
    eng_lp = eng.topk_logprobs[rows]
    q20 = _table_lookup(e_ids, eng_lp, a, eng.actual_logprob[rows], t_ids)
    q_min = np.where(np.isfinite(eng_lp), eng_lp, np.inf).min(axis=1, initial=np.inf)
    missing = present & np.isnan(q20)
    p20 = np.where(present, ref.topk_logprobs[rows, :width], -np.inf)
    q20 = np.where(present, np.where(missing, q_min[:, None], q20), -np.inf)
    with np.errstate(invalid="ignore"):
        lse_p = logsumexp(p20, axis=1, keepdims=True)
        p_hat = p20 - lse_p
        q_hat = q20 - logsumexp(q20, axis=1, keepdims=True)
        e = np.exp(p_hat)
        r20 = np.where(present & (e > 0), e * (p_hat - q_hat), 0.0).sum(axis=1)
    n_missing = missing.sum(axis=1)
    undefined = ((n_missing > 0) & (q_min == np.inf)) | (present.any(axis=1) & (lse_p[:, 0] == -np.inf))
    r20 = np.where(undefined, np.nan, r20)
    return (kl, in_s.sum(axis=1), np.maximum(p_rest, 0.0), np.maximum(q_rest, 0.0), floored, outside,
            valid[:, :-1].sum(axis=1), r20, n_missing)


def _core_numba(ref: Record, eng: Record, actual: np.ndarray) -> tuple[np.ndarray, ...]:
    n = ref.n_positions
    out = (np.empty(n), np.empty(n, np.int64), np.empty(n), np.empty(n), np.empty(n, np.bool_),
           np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n), np.empty(n, np.int64))
    bad = np.zeros(n, np.uint8)
    if n:
        if ref.full_logprobs is not None:
            full, has_full = np.ascontiguousarray(ref.full_logprobs), True
        else:
            full, has_full = np.zeros((1, 1), np.float32), False
        f64 = functools.partial(np.ascontiguousarray, dtype=np.float64)
        i64 = functools.partial(np.ascontiguousarray, dtype=np.int64)
        n_blocks = max(1, min(n, 16 * _numba.get_num_threads()))
        _core_parallel(i64(ref.topk_ids), f64(ref.topk_logprobs), f64(ref.actual_logprob), full, has_full,
                       i64(eng.topk_ids), f64(eng.topk_logprobs), f64(eng.actual_logprob), i64(actual),
                       min(R20_SUPPORT, ref.k), REST_FLOOR, n_blocks, *out, bad)
    if bad.any():  # name the first bad sequence and position
        _check_values(ref, "reference")
        _check_values(eng, "engine")
    return out


def position_metrics(ref: Record, eng: Record, chunk: int = 131072) -> PositionMetrics:
    """All per-position metrics of engine record `eng` against reference `ref` (gates.md §2).

    Raises RecordMismatch when the records are not comparable and RecordError on NaN / +inf logprobs.
    `chunk` bounds the temporaries of the numpy backend (rows per pass).
    """
    ref.check_compatible(eng)
    n = ref.n_positions
    actual = ref.actual_ids()  # same tokens on both sides (checked above)
    if backend() == "numba":
        cat = dict(zip(_CORE_FIELDS, _core_numba(ref, eng, actual)))
    else:
        _check_values(ref, "reference")
        _check_values(eng, "engine")
        parts = [_core_numpy(ref, eng, actual, slice(s, min(n, s + chunk))) for s in range(0, n, chunk)]
        cat = {k: (np.concatenate([p[i] for p in parts]) if parts else np.zeros(0))
               for i, k in enumerate(_CORE_FIELDS)}
    ref_lp1 = ref.topk_logprobs[:, 0]
    ref_lp2 = ref.topk_logprobs[:, 1] if ref.k > 1 else np.full(n, -np.inf)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both top-2 are padded: margin NaN, not decided
        margin = ref_lp1 - ref_lp2
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
        margin=margin,
        ref_top1_prob=np.exp(ref_lp1),
        nll_ref=-ref.actual_logprob,
        nll_eng=-eng.actual_logprob,
        delta_p=np.exp(eng.actual_logprob) - np.exp(ref.actual_logprob),
        ambiguous=(eng.ambiguous.astype(bool) if eng.ambiguous is not None else np.zeros(n, dtype=bool)),
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


def _group_sums(values: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-group sum of `values` and position count, groups in sorted label order (as np.unique)."""
    labels = np.asarray(labels)
    if labels.dtype.kind in "iu" and labels.size and labels.min() >= 0 and labels.max() <= 4 * labels.size + 4096:
        counts = np.bincount(labels)
        present = np.flatnonzero(counts)
        return np.bincount(labels, weights=values, minlength=counts.size)[present], counts[present].astype(np.float64)
    _, inv = np.unique(labels, return_inverse=True)
    return np.bincount(inv, weights=values), np.bincount(inv).astype(np.float64)


def _n_groups(labels: np.ndarray) -> int:
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
    n_prompts = _n_groups(prompt)
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


def _binomial(hits: np.ndarray) -> tuple[float, float]:
    """Rate and its binomial standard error sqrt(p(1-p)/n); NaN, NaN for no trials."""
    n = hits.size
    if n == 0:
        return math.nan, math.nan
    p = float(np.count_nonzero(hits)) / n
    return p, math.sqrt(p * (1 - p) / n)


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
    top1, top1_se = _binomial(pm.top1_agree[u_idx])
    top1_d, top1_d_se = _binomial(pm.top1_agree[decided])
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
        n_prompts=_n_groups(seq[mask]),
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

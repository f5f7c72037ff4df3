"""The per-position metrics of `core.metrics.definition`, fast: one compiled pass over the rows.

Rows are processed in chunks of `CHUNK_ROWS`. For each chunk numpy's vectorised `exp` fills two small
buffers, the probabilities of the engine top-k and of the reference's first 20 ids (about 1 ns a value
against 6–7 ns for a scalar `exp` inside the compiled loop, which dominated the per-position work);
deeper reference columns are exponentiated only when the engine lists them. The numba row loop does
everything else: the NaN/+inf guard, the merge of the two id lists (through an id → engine column
table, one pass over the reference ids), the §2.2 and §2.3 sums, and the scalar columns (top-1,
margin, NLL, Δp). No per-position temporaries, no Python objects; the buffers stay in cache. Compiled
without fastmath, one thread: every row is computed on its own in a fixed order, so results do not
depend on the chunk size.

Rest masses: 1 − Σ_S p is taken from a compensated (Neumaier) sum, exact to the rounding of the exp
values, where the definition's −expm1(logsumexp) loses about one ulp of 1 (≈1e-16 absolute). The two
therefore agree to that absolute error in P_rest / Q_rest, which moves KL_part's rest term by about
P_rest·1e-16/Q_rest; tests/core/test_metrics_kernel.py states the tolerance.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from core.metrics.definition import (R20_SUPPORT, REST_FLOOR, PositionMetrics, refuse_bad_values,
                                     refuse_impossible_kl)
from core.records import Record, RecordError

CHUNK_ROWS = 2048  # rows per exp buffer: 2048 × (20 + 20) float64 ≈ 0.65 MB, cache-resident
ID_TABLE_SIZE = 1 << 18  # ids below this merge through an id → engine column table (256 KB as int8);
#                          larger ids are searched in the reference row

_INF = np.inf


@numba.njit(cache=True, nogil=True)
def _find(ids, i, t, hint):
    """Column of id t in row i of ids (ids unique in a row), searching outwards from column `hint`; -1 if
    absent. Both sides list ids in logprob order, so a shared id is usually within a column or two."""
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


@numba.njit(cache=True, nogil=True, inline="always")
def _add(total, compensation, x):
    """Neumaier step: total + compensation is the sum so far, exact to O(n ε²) for these ≤ 1 summands."""
    s = total + x
    if total >= x:
        compensation += (total - s) + x
    else:
        compensation += (x - s) + total
    return s, compensation


@numba.njit(cache=True, nogil=True)
def _rows(lo_row, hi_row, ref_ids, ref_lp, ref_e, ref_act, ref_act_e, full, has_full,
          eng_ids, eng_lp, eng_e, eng_act, eng_act_e, actual, width, rest_floor, eng_col_of, eng_of_ref,
          kl_part, support, p_rest_o, q_rest_o, floored, outside, eng_k, kl_r20, r20_imp,
          top1, margin, ref_top1_prob, nll_ref, nll_eng, delta_p):
    """Rows [lo_row, hi_row). ref_e holds exp of those rows' first `width` reference logprobs and eng_e
    exp of their engine logprobs (row i at i − lo_row). Returns the first row holding NaN or +inf (the
    caller names it in a RecordError), else -1.

    The two id lists are merged through `eng_col_of` (id → engine column, -1 elsewhere; reset after
    each row): the engine's ids go in, with a in slot k_eng when a is not in the engine top-k; one
    pass over the reference ids then finds the shared ones and accumulates both divergences. Ids at or
    above the table size are searched in the reference row instead and noted in `eng_of_ref`
    (reference column → engine slot, -1 elsewhere; reset as the pass reads it)."""
    k_ref = ref_ids.shape[1]
    k_eng = eng_ids.shape[1]
    vocab = full.shape[1]
    table = eng_col_of.shape[0]
    for i in range(lo_row, hi_row):
        c = i - lo_row
        a = actual[i]
        bad = not (ref_act[i] < _INF) or not (eng_act[i] < _INF)
        for r in range(k_ref):
            bad |= not (ref_lp[i, r] < _INF)
        for j in range(k_eng):
            bad |= not (eng_lp[i, j] < _INF)
        if bad:
            return i
        # ---- the engine side: E's ids into the table, q_min (§2.3), the top-k count
        a_col = -1
        n_expected = 0
        ek = 0
        q_min = _INF
        qe_min = 0.0
        for j in range(k_eng):
            q = eng_lp[i, j]
            if q > -_INF and q < q_min:  # §2.3 q_min: smallest probability the engine returned
                q_min = q
                qe_min = eng_e[c, j]
            t = eng_ids[i, j]
            if t < 0:
                continue
            ek += 1
            if t == a:
                a_col = j
            if t < table:
                eng_col_of[t] = j
                n_expected += 1
            else:
                col = _find(ref_ids, i, t, min(j, k_ref - 1))
                if col >= 0:
                    eng_of_ref[col] = j
                    n_expected += 1
        if a_col < 0:
            if a < table:
                eng_col_of[a] = k_eng
                n_expected += 1
            else:
                col = _find(ref_ids, i, a, k_ref - 1)
                if col >= 0:
                    eng_of_ref[col] = k_eng
                    n_expected += 1
        # ---- one pass over the reference ids: S = E ∩ O (§2.2) and T = the first `width` ids (§2.3)
        sp = 0.0
        sq = 0.0
        sp_c = 0.0
        sq_c = 0.0
        terms = 0.0
        ns = 0
        n_matched_topk = 0
        a_matched = False
        nt = 0
        imputed = 0
        sp20 = 0.0
        sq20 = 0.0
        acc20 = 0.0
        n_found = 0
        for r in range(k_ref):
            if n_found == n_expected and r >= width:
                break
            t = ref_ids[i, r]
            if t < 0:
                continue
            if t < table:
                j = eng_col_of[t]
            else:
                j = eng_of_ref[r]
                eng_of_ref[r] = -1
            q = 0.0
            qe = 0.0
            if j >= 0:
                n_found += 1
                if j < k_eng:
                    q = eng_lp[i, j]
                    qe = eng_e[c, j]
                    n_matched_topk += 1
                else:
                    q = eng_act[i]
                    qe = eng_act_e[i]
                if t == a:
                    a_matched = True
            if r < width:
                p = ref_lp[i, r]
                pe = ref_e[c, r]
                nt += 1
                if j < 0:  # t ∉ E (a always is): impute q_t := q_min, counted
                    q = q_min
                    qe = qe_min
                    imputed += 1
                sp20 += pe
                sq20 += qe
                if pe > 0.0:
                    acc20 += pe * (p - q)
            elif j >= 0 and not has_full:
                p = ref_lp[i, r]
                pe = math.exp(p)
            if j >= 0 and not has_full:
                ns += 1
                sp, sp_c = _add(sp, sp_c, pe)
                sq, sq_c = _add(sq, sq_c, qe)
                if pe > 0.0:
                    terms += pe * (p - q)
        for j in range(k_eng):
            t = eng_ids[i, j]
            if t >= 0 and t < table:
                eng_col_of[t] = -1
        if a_col < 0 and a < table:
            eng_col_of[a] = -1
        if has_full:  # O = the vocabulary: S = E restricted to ids below it
            n_out = 0
            for j in range(k_eng + 1):
                if j < k_eng:
                    t = eng_ids[i, j]
                    if t < 0:
                        continue
                    q = eng_lp[i, j]
                    qe = eng_e[c, j]
                elif a_col >= 0:
                    break
                else:
                    t = a
                    q = eng_act[i]
                    qe = eng_act_e[i]
                if t < vocab:
                    p = np.float64(full[i, t])
                    pe = math.exp(p)
                    ns += 1
                    sp, sp_c = _add(sp, sp_c, pe)
                    sq, sq_c = _add(sq, sq_c, qe)
                    if pe > 0.0:
                        terms += pe * (p - q)
                elif j < k_eng:
                    n_out += 1
        else:
            n_out = ek - n_matched_topk
            if not a_matched:  # a ∈ O through ln p_a even outside the oracle top-K
                if a_col >= 0:
                    q = eng_lp[i, a_col]
                    qe = eng_e[c, a_col]
                    n_out -= 1
                else:
                    q = eng_act[i]
                    qe = eng_act_e[i]
                p = ref_act[i]
                pe = ref_act_e[i]
                ns += 1
                sp, sp_c = _add(sp, sp_c, pe)
                sq, sq_c = _add(sq, sq_c, qe)
                if pe > 0.0:
                    terms += pe * (p - q)
        # ---- §2.2 rest cell and result
        pr = (1.0 - sp) - sp_c
        qr = (1.0 - sq) - sq_c
        rest = 0.0
        fl = False
        if pr >= rest_floor:
            qu = qr
            if qr < rest_floor:
                qu = rest_floor
                fl = True
            rest = pr * math.log(pr / qu)
        kl_part[i] = terms + rest
        support[i] = ns
        p_rest_o[i] = max(pr, 0.0)
        q_rest_o[i] = max(qr, 0.0)
        floored[i] = fl
        outside[i] = n_out
        eng_k[i] = ek
        # ---- §2.3 result: Σ p̂ (ln p̂ − ln q̂) = Σ_{p>0} p (ln p − ln q) / Σp − ln(Σp / Σq)
        r20_imp[i] = imputed
        if (imputed > 0 and q_min == _INF) or (nt > 0 and sp20 == 0.0):
            kl_r20[i] = np.nan  # nothing to impute from, or no reference mass on T: undefined
        elif nt == 0:
            kl_r20[i] = 0.0
        elif sq20 == 0.0:
            kl_r20[i] = np.nan  # every q_t = 0: q̂ undefined
        else:
            kl_r20[i] = acc20 / sp20 - math.log(sp20 / sq20)
        # ---- §1, §2.4, §2.5 scalar columns
        top1[i] = eng_ids[i, 0] == ref_ids[i, 0]
        margin[i] = ref_lp[i, 0] - (ref_lp[i, 1] if k_ref > 1 else -_INF)
        ref_top1_prob[i] = ref_e[c, 0]
        nll_ref[i] = -ref_act[i]
        nll_eng[i] = -eng_act[i]
        delta_p[i] = eng_act_e[i] - ref_act_e[i]
    return -1


def kernel_position_metrics(ref: Record, eng: Record, chunk_rows: int = CHUNK_ROWS) -> PositionMetrics:
    """`definition.definition_position_metrics`, computed by the compiled row loop."""
    ref.check_compatible(eng)
    n = ref.n_positions
    actual = ref.actual_ids()
    f64 = np.float64
    ref_lp = np.ascontiguousarray(ref.topk_logprobs, dtype=f64)
    eng_lp = np.ascontiguousarray(eng.topk_logprobs, dtype=f64)
    ref_ids = np.ascontiguousarray(ref.topk_ids)
    eng_ids = np.ascontiguousarray(eng.topk_ids)
    ref_act = np.ascontiguousarray(ref.actual_logprob, dtype=f64)
    eng_act = np.ascontiguousarray(eng.actual_logprob, dtype=f64)
    if ref.full_logprobs is not None:
        full, has_full = np.ascontiguousarray(ref.full_logprobs), True
    else:
        full, has_full = np.zeros((1, 1), np.float32), False
    ref_act_e = np.exp(ref_act)
    eng_act_e = np.exp(eng_act)
    k_ref, k_eng = ref_lp.shape[1], eng_lp.shape[1]
    width = min(R20_SUPPORT, k_ref)
    rows = max(1, min(n, chunk_rows))
    ref_e = np.empty((rows, width))
    eng_e = np.empty((rows, k_eng))
    # the smallest column type that holds k_eng: a smaller table stays in a nearer cache
    col_type = np.int8 if k_eng < 127 else np.int16 if k_eng < 32767 else np.int32
    eng_col_of = np.full(ID_TABLE_SIZE, -1, col_type)
    eng_of_ref = np.full(max(k_ref, 1), -1, np.int64)
    out = dict(
        kl_part=np.empty(n), support_size=np.empty(n, np.int64), p_rest=np.empty(n), q_rest=np.empty(n),
        rest_floored=np.empty(n, bool), engine_outside_oracle=np.empty(n, np.int64),
        engine_topk_count=np.empty(n, np.int64), kl_r20=np.empty(n), r20_imputed=np.empty(n, np.int64),
        top1_agree=np.empty(n, bool), margin=np.empty(n), ref_top1_prob=np.empty(n), nll_ref=np.empty(n),
        nll_eng=np.empty(n), delta_p=np.empty(n),
    )
    outputs = tuple(out.values())
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        np.exp(ref_lp[lo:hi, :width], out=ref_e[:hi - lo])
        np.exp(eng_lp[lo:hi], out=eng_e[:hi - lo])
        bad = _rows(lo, hi, ref_ids, ref_lp, ref_e, ref_act, ref_act_e, full, has_full,
                    eng_ids, eng_lp, eng_e, eng_act, eng_act_e, actual, width, REST_FLOOR,
                    eng_col_of, eng_of_ref, *outputs)
        if bad >= 0:
            refuse_bad_values(ref, "reference")
            refuse_bad_values(eng, "engine")
            raise RecordError(f"position row {bad}: NaN or +inf logprob")  # unreachable: the checks above name it
    return refuse_impossible_kl(PositionMetrics(
        seq=ref.pos_seq.copy(),
        domain=ref.position_domains(),
        ambiguous=(np.asarray(eng.ambiguous, dtype=bool).copy() if eng.ambiguous is not None
                   else np.zeros(n, dtype=bool)),
        **out,
    ), ref)

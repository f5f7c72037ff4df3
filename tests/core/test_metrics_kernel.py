"""The compiled kernel against the readable definition (core.metrics.kernel vs core.metrics.definition).

Records are random with every edge case the definition has a rule for: clamped (−inf) engine and
reference entries, padded (−1) top-k slots, actual tokens outside both top-k lists, tied logprobs,
k = 1 on either side, an engine that misses the oracle's top token, an engine whose top-k sums to 1
(rest floored), a reference top-k covering the vocabulary (P_rest ≈ 0), a full-vocabulary reference,
and ambiguous positions.

Tolerance. Counts, flags and the scalar columns (top-1, margin, NLL) are compared exactly; Δp and
p(1) to 1e-15 (one ulp of each exp). The rest masses: the definition's −expm1(logsumexp) carries an
absolute error of a few ulps of 1, the kernel's compensated sum is exact to the rounding of the exps,
so P_rest and Q_rest agree to 1e-15 absolute. KL_part's rest term P·(ln P − ln Q) moves by
δP·(|ln P − ln Q| + 1) + P·δQ/Q under those errors, so KL_part is compared to
1e-12·(1 + |KL|) + 1e-15·(1 + |ln P − ln Q| + P/Q) with Q floored at 1e-12 as the rule does.
KL_r20 (no cancellation) to 1e-12·(1 + |KL|). Infinite and NaN values must coincide.
"""

import math

import numpy as np
import pytest

from core import metrics
from core.metrics import definition, kernel
from core.records import Record, RecordError, SequenceScores
from tests.core.recordkit import provenance, topk_from_full


def _normalise(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))


def edge_case_records(rng, n_seq=12, length=25, vocab=30, k_ref=8, k_eng=5, ref_full=False):
    """A reference and an engine record on the same tokens, with every edge case on some rows."""
    ref_seqs, eng_seqs = [], []
    for s in range(n_seq):
        tokens = rng.integers(0, vocab, size=length)
        n = length - 1
        logits = rng.normal(size=(n, vocab)) * rng.uniform(0.5, 4.0, size=(n, 1))
        tie = rng.random(n) < 0.2  # the two largest logits made equal: ties broken by the lower id
        top2 = np.argsort(-logits, axis=1)[:, :2]
        logits[tie, top2[tie, 1]] = logits[tie, top2[tie, 0]]
        p = _normalise(logits)
        noise = rng.choice([0.0, 0.05, 0.5, 3.0], size=(n, 1))  # 0: identical engine; 3: often misses the top token
        q = _normalise(p + rng.normal(size=p.shape) * noise)
        ref_ids, ref_lp = topk_from_full(p, k_ref)
        eng_ids, eng_lp = topk_from_full(q, k_eng)
        ref_ids, ref_lp, eng_ids, eng_lp = ref_ids.copy(), ref_lp.copy(), eng_ids.copy(), eng_lp.copy()
        actual = tokens[1:]
        ref_act = p[np.arange(n), actual].copy()
        eng_act = q[np.arange(n), actual].copy()
        for i in range(n):
            kind = rng.integers(0, 8)
            if kind == 1 and k_eng > 1:  # engine clamps its tail to -9999 (q = 0 where p > 0: a hard fail)
                eng_lp[i, rng.integers(1, k_eng):] = -9999.0
            elif kind == 2:  # padded tails on both sides
                cut_e, cut_r = rng.integers(1, k_eng + 1), rng.integers(1, k_ref + 1)
                eng_ids[i, cut_e:], eng_lp[i, cut_e:] = -1, -np.inf
                ref_ids[i, cut_r:], ref_lp[i, cut_r:] = -1, -np.inf
            elif kind == 3:  # engine top-k sums to 1 (Σ_S q ≥ 1 - rounding: Q_rest floored)
                eng_lp[i] = eng_lp[i] - np.log(np.exp(eng_lp[i]).sum())
                if actual[i] not in eng_ids[i]:   # nothing is left for it: more would be a mass above 1
                    eng_act[i] = -9999.0
            elif kind == 4:  # the actual token has probability 0 on one side
                if rng.random() < 0.5:
                    eng_act[i] = -9999.0
                else:
                    ref_act[i] = -np.inf
            elif kind == 5 and k_ref > 1:  # reference tail entries with p = 0
                ref_lp[i, rng.integers(1, k_ref):] = -np.inf
        ranks = 1 + (p > p[np.arange(n), actual][:, None]).sum(axis=1)
        scored = np.ones(length, dtype=bool)
        scored[0] = False
        ambiguous = rng.random(n) < 0.1
        ref_seqs.append(SequenceScores(f"s{s}", "ab"[s % 2], tokens, scored, ref_ids, ref_lp, ref_act, ranks,
                                       full_logprobs=p.astype(np.float32) if ref_full else None))
        eng_seqs.append(SequenceScores(f"s{s}", "ab"[s % 2], tokens, scored, eng_ids, eng_lp, eng_act, ranks,
                                       ambiguous=ambiguous))
    return (Record.from_sequences(provenance("oracle"), ref_seqs),
            Record.from_sequences(provenance("engine"), eng_seqs))


EXACT = ("seq", "domain", "r20_imputed", "support_size", "rest_floored", "engine_outside_oracle",
         "engine_topk_count", "top1_agree", "margin", "nll_ref", "nll_eng", "ambiguous")


def assert_kernel_equals_definition(fast: metrics.PositionMetrics, ref: metrics.PositionMetrics) -> None:
    for name in EXACT:
        np.testing.assert_array_equal(getattr(fast, name), getattr(ref, name), err_msg=name)
    for name in ("delta_p", "ref_top1_prob", "p_rest", "q_rest"):
        np.testing.assert_allclose(getattr(fast, name), getattr(ref, name), rtol=0, atol=1e-15, err_msg=name)
    np.testing.assert_array_equal(np.isfinite(fast.kl_part), np.isfinite(ref.kl_part))
    np.testing.assert_array_equal(np.isnan(fast.kl_part), np.isnan(ref.kl_part))
    finite = np.isfinite(ref.kl_part)
    np.testing.assert_array_equal(fast.kl_part[~finite], ref.kl_part[~finite])
    p = ref.p_rest[finite]
    q = np.maximum(ref.q_rest[finite], metrics.REST_FLOOR)
    with np.errstate(divide="ignore"):
        log_gap = np.where(p >= metrics.REST_FLOOR, np.abs(np.log(np.maximum(p, 1e-300)) - np.log(q)), 0.0)
    tol = 1e-12 * (1 + np.abs(ref.kl_part[finite])) + 1e-15 * (1 + log_gap + p / q)
    err = np.abs(fast.kl_part[finite] - ref.kl_part[finite])
    assert np.all(err <= tol), f"KL_part off by {err.max():.3g} (worst tolerance ratio {np.max(err / tol):.3g})"
    np.testing.assert_allclose(fast.kl_r20, ref.kl_r20, rtol=1e-12, atol=1e-12, err_msg="kl_r20")


CONFIGS = [  # (k_ref, k_eng, ref_full)
    (8, 5, False), (1, 1, False), (1, 5, False), (8, 1, False), (30, 5, False), (25, 20, False), (30, 30, False),
    (8, 5, True), (1, 3, True), (30, 30, True),
]


@pytest.mark.parametrize("k_ref,k_eng,ref_full", CONFIGS)
def test_kernel_equals_definition_on_edge_case_records(k_ref, k_eng, ref_full):
    rng = np.random.default_rng(1000 + 7 * k_ref + k_eng + 100 * ref_full)
    ref, eng = edge_case_records(rng, k_ref=k_ref, k_eng=k_eng, ref_full=ref_full)
    fast = kernel.kernel_position_metrics(ref, eng)
    slow = definition.definition_position_metrics(ref, eng)
    assert_kernel_equals_definition(fast, slow)


def test_edge_cases_are_present_in_the_generated_records():
    """The comparison above is only as good as its records: every edge case must actually occur."""
    ref, eng = edge_case_records(np.random.default_rng(5), k_ref=8, k_eng=5)
    pm = definition.definition_position_metrics(ref, eng)
    actual = ref.actual_ids()
    assert (~np.isfinite(pm.kl_part)).any()                       # hard fails (q = 0 under p > 0)
    assert pm.rest_floored.any()                                  # Σ_S q rounded over 1
    assert (eng.topk_ids < 0).any() and (ref.topk_ids < 0).any()  # padding
    assert (~(eng.topk_ids == actual[:, None]).any(axis=1)).any()  # actual token outside the engine top-k
    assert (~(ref.topk_ids == actual[:, None]).any(axis=1)).any()
    assert (~pm.top1_agree).any() and pm.top1_agree.any()         # engine misses the oracle's top token
    assert (pm.r20_imputed > 0).any() and (pm.engine_outside_oracle > 0).any()
    assert (ref.topk_logprobs[:, 0] == ref.topk_logprobs[:, 1]).any()  # ties
    assert np.isinf(pm.nll_ref).any() and np.isinf(pm.nll_eng).any()
    assert pm.ambiguous.any()
    covered = edge_case_records(np.random.default_rng(6), k_ref=30, k_eng=30)  # S = the vocabulary
    assert (definition.definition_position_metrics(*covered).p_rest < metrics.REST_FLOOR).any()  # P_rest ≈ 0


@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_kernel_result_does_not_depend_on_the_chunk_size(chunk_rows):
    ref, eng = edge_case_records(np.random.default_rng(9), k_ref=12, k_eng=6)
    a = kernel.kernel_position_metrics(ref, eng)
    b = kernel.kernel_position_metrics(ref, eng, chunk_rows=chunk_rows)
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@pytest.mark.parametrize("backend", ["numba", "definition"])
def test_backend_switch(backend, monkeypatch):
    monkeypatch.setenv("DS41_METRICS_BACKEND", backend)
    assert metrics.backend() == backend
    ref, eng = edge_case_records(np.random.default_rng(3), n_seq=2, k_ref=6, k_eng=4)
    assert_kernel_equals_definition(metrics.position_metrics(ref, eng),
                                    definition.definition_position_metrics(ref, eng))
    monkeypatch.setenv("DS41_METRICS_BACKEND", "numpy")
    with pytest.raises(ValueError, match="DS41_METRICS_BACKEND='numpy'"):
        metrics.backend()


@pytest.mark.parametrize("scorer", [kernel.kernel_position_metrics, definition.definition_position_metrics])
@pytest.mark.parametrize("side", ["reference", "engine"])
def test_nan_and_plus_inf_are_refused_naming_the_position(scorer, side):
    ref, eng = edge_case_records(np.random.default_rng(4), n_seq=3, length=6, k_ref=6, k_eng=4)
    rec = ref if side == "reference" else eng
    rec.topk_logprobs = rec.topk_logprobs.copy()
    rec.topk_logprobs[7, 2] = np.nan  # sequence s1 (5 scored positions each), position 3
    with pytest.raises(RecordError, match=rf"{side} record: sequence 's1' position 3"):
        scorer(ref, eng)
    rec.topk_logprobs[7, 2] = -1.0
    rec.actual_logprob = rec.actual_logprob.copy()
    rec.actual_logprob[11] = math.inf  # s2, position 2
    with pytest.raises(RecordError, match=rf"{side} record: sequence 's2' position 2"):
        scorer(ref, eng)


def test_benchmark_records_kernel_equals_definition():
    """The benchmark's synthetic structure (engine ids outside the reference top-32, deep actual tokens)."""
    from benchmarks.bench_metrics import make_records
    ref, eng = make_records(3000, seq_len=300, seed=3)
    assert_kernel_equals_definition(kernel.kernel_position_metrics(ref, eng),
                                    definition.definition_position_metrics(ref, eng))


@pytest.mark.parametrize("table_size", [1, 16])
def test_ids_beyond_the_merge_table_are_searched(table_size, monkeypatch):
    """Ids at or above the kernel's id → column table size take the search path; results are unchanged."""
    monkeypatch.setattr(kernel, "ID_TABLE_SIZE", table_size)
    ref, eng = edge_case_records(np.random.default_rng(11), k_ref=10, k_eng=6)  # vocab 30: ids 0..29
    assert_kernel_equals_definition(kernel.kernel_position_metrics(ref, eng),
                                    definition.definition_position_metrics(ref, eng))

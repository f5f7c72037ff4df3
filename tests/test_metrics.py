"""Metrics against independent computations: scipy on full distributions, hand-worked examples."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats
from scipy.special import rel_entr

from ds41gates import metrics
from ds41gates.records import Record, RecordError, RecordMismatch, SequenceScores
from tests.recordkit import pair_of_records, provenance, random_logprobs, sequence_from_full


def _full_kl(full):
    return np.concatenate([rel_entr(np.exp(p), np.exp(q)).sum(axis=1) for p, q in full])


def test_partition_kl_equals_full_kl_when_engine_covers_vocabulary():
    rng = np.random.default_rng(1)
    ref, eng, full = pair_of_records(rng, vocab=40, k_ref=40, k_eng=40)
    pm = metrics.position_metrics(ref, eng)
    np.testing.assert_allclose(pm.kl_part, _full_kl(full), rtol=1e-9, atol=1e-12)


def test_partition_kl_equals_scipy_on_the_coarsened_distribution():
    rng = np.random.default_rng(2)
    ref, eng, full = pair_of_records(rng, n_seq=2, vocab=30, k_ref=30, k_eng=4)
    pm = metrics.position_metrics(ref, eng)
    expected = []
    for (p, q), s in zip(full, range(2)):
        tokens = ref.sequence_tokens(s)
        for i in range(p.shape[0]):
            support = set(np.argsort(-q[i], kind="stable")[:4].tolist()) | {int(tokens[i + 1])}
            idx = sorted(support)
            pp, qq = np.exp(p[i, idx]), np.exp(q[i, idx])
            cells_p = np.append(pp, 1 - pp.sum())
            cells_q = np.append(qq, 1 - qq.sum())
            expected.append(stats.entropy(cells_p, cells_q))
    np.testing.assert_allclose(pm.kl_part, expected, rtol=1e-7, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 12), noise=st.floats(0.01, 2.0), ref_full=st.booleans())
def test_partition_kl_never_exceeds_full_kl(seed, k, noise, ref_full):
    rng = np.random.default_rng(seed)
    ref, eng, full = pair_of_records(rng, n_seq=2, length=6, vocab=24, k_ref=24 if not ref_full else 8,
                                     k_eng=k, noise=noise, ref_full=ref_full)
    pm = metrics.position_metrics(ref, eng)
    assert np.all(pm.kl_part <= _full_kl(full) + 1e-7)
    assert np.all(pm.kl_part >= -1e-12)


def test_partition_kl_grows_with_k():
    rng = np.random.default_rng(3)
    results = []
    for k in (1, 3, 8, 20, 40):
        r = np.random.default_rng(7)
        ref, eng, full = pair_of_records(r, vocab=40, k_ref=40, k_eng=k)
        results.append(metrics.position_metrics(ref, eng).kl_part)
    for lo, hi in zip(results, results[1:]):
        assert np.all(hi >= lo - 1e-12)
    np.testing.assert_allclose(results[-1], _full_kl(full), rtol=1e-9)


def _one_position(ref_ids, ref_lps, eng_ids, eng_lps, actual, ref_actual_lp, eng_actual_lp, k_pad=None):
    tokens = np.array([0, actual])
    scored = np.array([False, True])
    ref = SequenceScores("x", "d", tokens, scored, np.array([ref_ids]), np.array([ref_lps]),
                         np.array([ref_actual_lp]), np.array([0]))
    eng = SequenceScores("x", "d", tokens, scored, np.array([eng_ids]), np.array([eng_lps]),
                         np.array([eng_actual_lp]), np.array([0]))
    return Record.from_sequences(provenance("oracle"), [ref]), Record.from_sequences(provenance("engine"), [eng])


def test_hand_worked_partition_example():
    # Reference p = (.5, .3, .2 rest); engine top-2 = (.4, .4), actual = id 1.
    # S = {0, 1}; KL = .5 ln(.5/.4) + .3 ln(.3/.4) + .2 ln(.2/.2) = 0.025270...
    ref, eng = _one_position([0, 1], np.log([0.5, 0.3]), [0, 1], np.log([0.4, 0.4]), 1,
                             math.log(0.3), math.log(0.4))
    pm = metrics.position_metrics(ref, eng)
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)
    assert pm.kl_part[0] == pytest.approx(expected, rel=1e-12)
    assert pm.support_size[0] == 2
    assert pm.p_rest[0] == pytest.approx(0.2)


def test_engine_id_outside_oracle_topk_leaves_the_known_set():
    # Engine's id 7 is unknown to the oracle (top-2 only): it goes into the rest cell on both sides.
    ref, eng = _one_position([0, 1], np.log([0.6, 0.3]), [0, 7], np.log([0.5, 0.2]), 0,
                             math.log(0.6), math.log(0.5))
    pm = metrics.position_metrics(ref, eng)
    expected = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5)
    assert pm.kl_part[0] == pytest.approx(expected, rel=1e-12)
    assert pm.engine_outside_oracle[0] == 1


def test_engine_zero_probability_is_a_hard_failure_not_a_number():
    ref, eng = _one_position([0, 1], np.log([0.6, 0.3]), [1, 0], [math.log(0.9), -9999.0], 0,
                             math.log(0.6), -9999.0)
    pm = metrics.position_metrics(ref, eng)
    assert pm.hard_fail[0]
    report = metrics.group_report(pm, np.ones(1, bool), "all")
    assert report.hard_fails == 1


def test_rest_floor_is_counted():
    # Engine top-2 sum to 1 (rest 0) while the reference leaves 0.1 outside.
    ref, eng = _one_position([0, 1], np.log([0.6, 0.3]), [0, 1], np.log([0.5, 0.5]), 0,
                             math.log(0.6), math.log(0.5))
    pm = metrics.position_metrics(ref, eng)
    assert pm.rest_floored[0]
    expected = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.5) + 0.1 * math.log(0.1 / 1e-12)
    assert pm.kl_part[0] == pytest.approx(expected, rel=1e-9)


def test_kl_r20_matches_manual_renormalisation_and_counts_imputation():
    rng = np.random.default_rng(4)
    p = random_logprobs(rng, 1, 60)
    q = random_logprobs(rng, 1, 60)
    tokens = np.array([0, 5])
    ref = Record.from_sequences(provenance("oracle"), [sequence_from_full("x", "d", tokens, p, 60)])
    eng = Record.from_sequences(provenance("engine"), [sequence_from_full("x", "d", tokens, q, 10)])
    pm = metrics.position_metrics(ref, eng)
    top20 = np.argsort(-p[0], kind="stable")[:20]
    eng_known = set(np.argsort(-q[0], kind="stable")[:10].tolist()) | {5}
    q_min = np.sort(q[0])[::-1][9]
    q_vals = np.array([q[0, t] if t in eng_known else q_min for t in top20])
    ph = np.exp(p[0, top20]) / np.exp(p[0, top20]).sum()
    qh = np.exp(q_vals) / np.exp(q_vals).sum()
    assert pm.kl_r20[0] == pytest.approx(stats.entropy(ph, qh), rel=1e-9)
    assert pm.r20_imputed[0] == sum(1 for t in top20 if t not in eng_known)


def test_top1_perplexity_and_delta_p():
    rng = np.random.default_rng(5)
    ref, eng, full = pair_of_records(rng, n_seq=4, vocab=20, k_ref=20, k_eng=5)
    pm = metrics.position_metrics(ref, eng)
    p_all = np.concatenate([f[0] for f in full])
    q_all = np.concatenate([f[1] for f in full])
    np.testing.assert_array_equal(pm.top1_agree, p_all.argmax(1) == q_all.argmax(1))
    actual = ref.actual_ids()
    pa = p_all[np.arange(len(actual)), actual]
    qa = q_all[np.arange(len(actual)), actual]
    ppl = metrics.perplexity_stats(pm.nll_ref, pm.nll_eng)
    assert ppl["ppl_ref"] == pytest.approx(math.exp(-pa.mean()))
    assert ppl["ppl_eng"] == pytest.approx(math.exp(-qa.mean()))
    assert ppl["ratio"] == pytest.approx(ppl["ppl_eng"] / ppl["ppl_ref"])
    np.testing.assert_allclose(pm.delta_p, np.exp(qa) - np.exp(pa))
    dp = metrics.delta_p_stats(pm.delta_p)
    assert dp["rms"] == pytest.approx(np.sqrt(np.mean((np.exp(qa) - np.exp(pa)) ** 2)))
    assert dp["p50"] == pytest.approx(np.median(np.exp(qa) - np.exp(pa)))


def test_confidence_buckets_follow_reference_top1_probability():
    probs = np.array([0.1, 0.25, 0.5, 0.74, 0.95, 1.0])
    pm = metrics.PositionMetrics(*[np.zeros(6)] * 11, top1_agree=np.ones(6, bool), margin=np.ones(6),
                                 ref_top1_prob=probs, nll_ref=np.zeros(6), nll_eng=np.zeros(6),
                                 delta_p=np.zeros(6), ambiguous=np.zeros(6, bool))
    assert pm.confidence_bucket.tolist() == [0, 1, 2, 2, 4, 4]


def test_bootstrap_resamples_prompts_not_positions():
    # Two prompts: one with 1000 positions of value 0, one with 1 position of value 1.
    # Resampled prompt sets are {0,0}, {0,1}, {1,1} with probabilities 1/4, 1/2, 1/4, so the
    # 95% interval is [0, 1]; resampling positions would give an interval around 0.001 only.
    values = np.concatenate([np.zeros(1000), np.ones(1)])
    prompts = np.concatenate([np.zeros(1000, int), np.ones(1, int)])
    lo, hi = metrics.prompt_bootstrap(values, prompts, n_boot=4000, seed=0)
    assert lo == 0.0 and hi == 1.0
    s = metrics.summarize(values, prompts)
    assert s.n_prompts == 2 and s.n_positions == 1001
    assert s.p99 is not None and s.p999 is None  # p99 needs 1,000 positions, p99.9 needs 10,000


def test_percentiles_hidden_below_their_sample_size():
    s = metrics.summarize(np.arange(150, dtype=float), np.arange(150))
    assert s.p90 is not None and s.p99 is None and s.p999 is None
    assert metrics.summarize(np.arange(50, dtype=float), np.arange(50)).median is None


def test_domain_macro_weights_domains_equally():
    rng = np.random.default_rng(6)
    ref, eng, _ = pair_of_records(rng, n_seq=6, vocab=20, k_ref=20, k_eng=4, domains=("a", "a", "b"))
    pm = metrics.panel_metrics(ref, eng, n_boot=200)
    per = [pm.positions.kl_part[pm.positions.domain == d].mean() for d in ("a", "b")]
    assert pm.macro_kl == pytest.approx(np.mean(per))
    assert pm.overall.kl_part.mean == pytest.approx(pm.positions.kl_part.mean())


def test_paired_comparison_uses_per_prompt_differences_and_wilcoxon():
    rng = np.random.default_rng(8)
    ref, eng_a, _ = pair_of_records(np.random.default_rng(9), n_seq=12, vocab=20, k_ref=20, k_eng=5, noise=0.1)
    _, eng_b, _ = pair_of_records(np.random.default_rng(9), n_seq=12, vocab=20, k_ref=20, k_eng=5, noise=0.6)
    a = metrics.position_metrics(ref, eng_a)
    b = metrics.position_metrics(ref, eng_b)
    cmp = metrics.paired_comparison(a, b)
    ma = np.array([a.kl_part[a.seq == s].mean() for s in range(12)])
    mb = np.array([b.kl_part[b.seq == s].mean() for s in range(12)])
    assert cmp.mean_diff == pytest.approx((mb - ma).mean())
    assert cmp.wilcoxon_p == pytest.approx(stats.wilcoxon(mb - ma).pvalue)
    assert cmp.ci_low <= cmp.mean_diff <= cmp.ci_high
    assert cmp.mean_diff > 0 and cmp.wilcoxon_p < 0.01


# ----------------------------------------------------------------------------- bad input

def test_nan_logprob_is_refused_with_sequence_and_position():
    tokens = np.array([3, 4, 5])
    with pytest.raises(RecordError, match=r"sequence 'bad' position 2"):
        Record.from_sequences(provenance(), [SequenceScores(
            "bad", "d", tokens, np.array([False, True, True]), np.array([[4], [5]]), np.array([[-0.1], [np.nan]]),
            np.array([-0.1, -0.2]), np.array([1, 1]))])


def test_inf_logprob_is_refused():
    tokens = np.array([3, 4])
    with pytest.raises(RecordError, match="position 1"):
        Record.from_sequences(provenance(), [SequenceScores(
            "bad", "d", tokens, np.array([False, True]), np.array([[4]]), np.array([[0.5]]),
            np.array([np.inf]), np.array([1]))])


def test_length_mismatch_is_refused():
    with pytest.raises(RecordError, match="shape"):
        Record.from_sequences(provenance(), [SequenceScores(
            "bad", "d", np.array([1, 2, 3]), np.array([False, True, True]), np.array([[4]]), np.array([[-0.1]]),
            np.array([-0.1]), np.array([1]))])


def test_token_id_mismatch_names_sequence_and_position():
    rng = np.random.default_rng(10)
    ref, eng, _ = pair_of_records(rng, n_seq=2, length=6, vocab=20, k_ref=20, k_eng=3)
    eng.token_ids = eng.token_ids.copy()
    eng.token_ids[6 + 4] = (eng.token_ids[6 + 4] + 1) % 20
    with pytest.raises(RecordMismatch, match=r"sequence 's1' position 4: token ids differ"):
        metrics.position_metrics(ref, eng)


def test_nan_in_loaded_record_is_refused_by_metrics(tmp_path):
    rng = np.random.default_rng(11)
    ref, eng, _ = pair_of_records(rng, n_seq=1, length=5, vocab=20, k_ref=20, k_eng=3)
    eng.topk_logprobs = eng.topk_logprobs.copy()
    eng.topk_logprobs[2, 1] = np.nan
    eng.save(tmp_path / "e.safetensors")
    loaded = Record.load(tmp_path / "e.safetensors")
    with pytest.raises(RecordError, match=r"engine record: sequence 's0' position 3"):
        metrics.position_metrics(ref, loaded)

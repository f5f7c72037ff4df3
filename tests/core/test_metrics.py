"""Metrics against independent computations: scipy on full distributions, hand-worked examples."""

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats
from scipy.special import rel_entr

from core import metrics
from core.records import Record, RecordError, RecordMismatch, SequenceScores
from tests.core.recordkit import pair_of_records, provenance, random_logprobs, sequence_from_full


@pytest.fixture(params=["numba", "definition"])
def each_backend(request, monkeypatch):
    """Run a test against the compiled kernel and against the readable definition."""
    monkeypatch.setenv("DS41_METRICS_BACKEND", request.param)
    return request.param


def _full_kl(full):
    return np.concatenate([rel_entr(np.exp(p), np.exp(q)).sum(axis=1) for p, q in full])


@pytest.mark.usefixtures("each_backend")
def test_partition_kl_equals_full_kl_when_engine_covers_vocabulary():
    rng = np.random.default_rng(1)
    ref, eng, full = pair_of_records(rng, vocab=40, k_ref=40, k_eng=40)
    pm = metrics.position_metrics(ref, eng)
    np.testing.assert_allclose(pm.kl_part, _full_kl(full), rtol=1e-9, atol=1e-12)


@pytest.mark.usefixtures("each_backend")
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
@given(seed=st.integers(0, 10_000), k=st.integers(1, 12), noise=st.floats(0.01, 2.0), ref_full=st.booleans(),
       scorer=st.sampled_from([metrics.kernel_position_metrics, metrics.definition_position_metrics]))
def test_partition_kl_never_exceeds_full_kl(seed, k, noise, ref_full, scorer):
    rng = np.random.default_rng(seed)
    ref, eng, full = pair_of_records(rng, n_seq=2, length=6, vocab=24, k_ref=24 if not ref_full else 8,
                                     k_eng=k, noise=noise, ref_full=ref_full)
    pm = scorer(ref, eng)
    assert np.all(pm.kl_part <= _full_kl(full) + 1e-7)
    assert np.all(pm.kl_part >= -1e-12)


@pytest.mark.usefixtures("each_backend")
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


@pytest.mark.usefixtures("each_backend")
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


@pytest.mark.usefixtures("each_backend")
def test_engine_id_outside_oracle_topk_leaves_the_known_set():
    # Engine's id 7 is unknown to the oracle (top-2 only): it goes into the rest cell on both sides.
    ref, eng = _one_position([0, 1], np.log([0.6, 0.3]), [0, 7], np.log([0.5, 0.2]), 0,
                             math.log(0.6), math.log(0.5))
    pm = metrics.position_metrics(ref, eng)
    expected = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5)
    assert pm.kl_part[0] == pytest.approx(expected, rel=1e-12)
    assert pm.engine_outside_oracle[0] == 1


@pytest.mark.usefixtures("each_backend")
def test_engine_zero_probability_is_a_hard_failure_not_a_number():
    ref, eng = _one_position([0, 1], np.log([0.6, 0.3]), [1, 0], [math.log(0.9), -9999.0], 0,
                             math.log(0.6), -9999.0)
    pm = metrics.position_metrics(ref, eng)
    assert pm.hard_fail[0]
    report = metrics.group_report(pm, np.ones(1, bool), "all")
    assert report.hard_fails == 1


@pytest.mark.usefixtures("each_backend")
def test_rest_floor_is_counted():
    # Engine top-2 sum to 1 (rest 0) while the reference leaves 0.1 outside.
    ref, eng = _one_position([0, 1], np.log([0.6, 0.3]), [0, 1], np.log([0.5, 0.5]), 0,
                             math.log(0.6), math.log(0.5))
    pm = metrics.position_metrics(ref, eng)
    assert pm.rest_floored[0]
    expected = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.5) + 0.1 * math.log(0.1 / 1e-12)
    assert pm.kl_part[0] == pytest.approx(expected, rel=1e-9)


@pytest.mark.usefixtures("each_backend")
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


@pytest.mark.usefixtures("each_backend")
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


def test_paired_prompt_comparison_from_per_prompt_means():
    rng = np.random.default_rng(12)
    ma = rng.gamma(2.0, 0.01, size=40)
    mb = ma + rng.normal(0.004, 0.003, size=40)
    ma[3] = np.nan  # a prompt without a value on one side is left out
    cmp = metrics.paired_prompt_comparison(ma, mb, "kl_r20", n_boot=4000, seed=1)
    d = (mb - ma)[~np.isnan(ma)]
    assert cmp.metric == "kl_r20" and cmp.n_prompts == 39
    assert cmp.mean_diff == pytest.approx(d.mean(), rel=1e-12)
    assert cmp.wilcoxon_p == pytest.approx(stats.wilcoxon(d).pvalue, rel=1e-12)
    se = d.std(ddof=1) / math.sqrt(d.size)  # the percentile interval is close to the normal one here
    assert cmp.ci_low == pytest.approx(d.mean() - 1.96 * se, abs=0.25 * se)
    assert cmp.ci_high == pytest.approx(d.mean() + 1.96 * se, abs=0.25 * se)
    assert metrics.paired_prompt_comparison(ma, ma).wilcoxon_p == 1.0
    with pytest.raises(ValueError, match="one length"):
        metrics.paired_prompt_comparison(ma, mb[:-1])


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


def test_nan_in_record_is_refused_on_load_and_by_metrics(tmp_path):
    rng = np.random.default_rng(11)
    ref, eng, _ = pair_of_records(rng, n_seq=1, length=5, vocab=20, k_ref=20, k_eng=3)
    eng.topk_logprobs = eng.topk_logprobs.copy()
    eng.topk_logprobs[2, 1] = np.nan
    eng.save(tmp_path / "e.safetensors")
    with pytest.raises(RecordError, match=r"e.safetensors: sequence 's0' position 3: top-2 logprob nan"):
        Record.load(tmp_path / "e.safetensors")
    with pytest.raises(RecordError, match=r"engine record: sequence 's0' position 3"):
        metrics.position_metrics(ref, eng)     # a record built in memory still meets the metrics' own check


# ----------------------------------------------------------------------------- both backends vs an exactly rounded reference

def _reference_position(ref, eng, i, actual):
    """gates.md §2.2/§2.3 for one position, with Python dicts, math.fsum and scipy's logsumexp."""
    from scipy.special import logsumexp
    a = int(actual[i])
    e = {int(t): float(v) for t, v in zip(eng.topk_ids[i], eng.topk_logprobs[i]) if t >= 0}
    e_k = len(e)
    e.setdefault(a, float(eng.actual_logprob[i]))
    if ref.full_logprobs is not None:
        o = {t: float(v) for t, v in enumerate(ref.full_logprobs[i])}
    else:
        o = {int(t): float(v) for t, v in zip(ref.topk_ids[i], ref.topk_logprobs[i]) if t >= 0}
        o.setdefault(a, float(ref.actual_logprob[i]))
    support = [t for t in e if t in o]
    outside = sum(1 for t in list(e)[:e_k] if t not in o)
    p = [math.exp(o[t]) for t in support]
    q = [math.exp(e[t]) for t in support]
    p_rest = math.fsum([1.0] + [-x for x in p])
    q_rest = math.fsum([1.0] + [-x for x in q])
    floored = p_rest >= metrics.REST_FLOOR and q_rest < metrics.REST_FLOOR
    terms = [pp * (o[t] - e[t]) for pp, t in zip(p, support) if pp > 0]
    if p_rest >= metrics.REST_FLOOR:
        terms.append(p_rest * (math.log(p_rest) - math.log(metrics.REST_FLOOR if floored else q_rest)))
    kl_part = math.fsum(terms)
    top = [(int(t), float(v)) for t, v in zip(ref.topk_ids[i, :20], ref.topk_logprobs[i, :20]) if t >= 0]
    finite_e = [float(v) for v in eng.topk_logprobs[i] if np.isfinite(v)]
    q_min = min(finite_e) if finite_e else math.inf
    pl = np.array([v for _, v in top])
    ql = np.array([e.get(t, q_min) for t, _ in top])
    imputed = sum(1 for t, _ in top if t not in e)
    ph, qh = pl - logsumexp(pl), ql - logsumexp(ql)
    kl_r20 = float(np.sum(np.exp(ph) * (ph - qh)))
    return kl_part, kl_r20, len(support), outside, imputed, floored, max(p_rest, 0.0), max(q_rest, 0.0)


@pytest.mark.parametrize("backend", ["numba", "definition"])
@pytest.mark.parametrize("ref_full", [False, True])
def test_fast_core_matches_a_per_position_reference(backend, ref_full, monkeypatch):
    monkeypatch.setenv("DS41_METRICS_BACKEND", backend)
    assert metrics.backend() == backend
    rng = np.random.default_rng(21)
    # 30 sequences x 11 positions = 300 positions; k_ref < vocab so engine ids fall outside the oracle top-K.
    ref, eng, _ = pair_of_records(rng, n_seq=30, length=12, vocab=60, k_ref=12 if not ref_full else 25, k_eng=8,
                                  noise=1.0, ref_full=ref_full)
    pm = metrics.position_metrics(ref, eng)
    actual = ref.actual_ids()
    exp = np.array([_reference_position(ref, eng, i, actual) for i in range(ref.n_positions)])
    np.testing.assert_allclose(pm.kl_part, exp[:, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(pm.kl_r20, exp[:, 1], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(pm.support_size, exp[:, 2])
    np.testing.assert_array_equal(pm.engine_outside_oracle, exp[:, 3])
    np.testing.assert_array_equal(pm.r20_imputed, exp[:, 4])
    np.testing.assert_array_equal(pm.rest_floored, exp[:, 5].astype(bool))
    np.testing.assert_allclose(pm.p_rest, exp[:, 6], rtol=0, atol=1e-15)
    np.testing.assert_allclose(pm.q_rest, exp[:, 7], rtol=0, atol=1e-15)
    assert pm.engine_outside_oracle.sum() > 0 or ref_full


def test_numba_backend_names_the_bad_position(monkeypatch):
    monkeypatch.setenv("DS41_METRICS_BACKEND", "numba")
    rng = np.random.default_rng(11)
    ref, eng, _ = pair_of_records(rng, n_seq=1, length=5, vocab=20, k_ref=20, k_eng=3)
    eng.topk_logprobs = eng.topk_logprobs.copy()
    eng.topk_logprobs[2, 1] = np.nan
    with pytest.raises(RecordError, match=r"engine record: sequence 's0' position 3"):
        metrics.position_metrics(ref, eng)


# ----------------------------------------------------------------------------- reported issues

def test_infinite_engine_nll_is_counted_not_a_nan_se():
    nll_ref = np.array([1.0, 2.0, 0.5, 1.5])
    nll_eng = np.array([1.1, np.inf, 0.4, 1.7])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ppl = metrics.perplexity_stats(nll_ref, nll_eng)
        dp = metrics.delta_p_stats(np.array([0.1, -0.2, np.inf, 0.05]))
    assert ppl["n_infinite"] == 1 and ppl["n_finite"] == 3
    assert ppl["ln_ratio"] == math.inf and ppl["ppl_eng"] == math.inf
    finite_d = np.array([0.1, -0.1, 0.2])
    assert ppl["ln_ratio_finite"] == pytest.approx(finite_d.mean())
    assert ppl["ln_ratio_se"] == pytest.approx(finite_d.std(ddof=1) / math.sqrt(3))
    assert dp["n_nonfinite"] == 1 and dp["n"] == 3 and dp["max"] == pytest.approx(0.1)


def test_ambiguous_positions_leave_every_statistic_and_top1_has_binomial_se():
    rng = np.random.default_rng(23)
    ref, eng, _ = pair_of_records(rng, n_seq=4, length=30, vocab=20, k_ref=20, k_eng=5, noise=1.0)
    amb = np.zeros(ref.n_positions, bool)
    amb[::3] = True
    eng.ambiguous = amb
    pm = metrics.position_metrics(ref, eng)
    g = metrics.group_report(pm, np.ones(ref.n_positions, bool), "all", n_boot=50)
    keep = ~amb
    assert g.ambiguous == amb.sum() and g.n_usable == keep.sum() and g.n_positions == ref.n_positions
    assert g.perplexity["ppl_eng"] == pytest.approx(math.exp(pm.nll_eng[keep].mean()))
    assert g.delta_p["mean"] == pytest.approx(pm.delta_p[keep].mean())
    assert g.kl_part.n_positions == keep.sum()
    p = pm.top1_agree[keep].mean()
    assert g.top1 == pytest.approx(p) and g.top1_se == pytest.approx(math.sqrt(p * (1 - p) / keep.sum()))
    dec = keep & pm.decided
    pd_ = pm.top1_agree[dec].mean()
    assert g.top1_decided_se == pytest.approx(math.sqrt(pd_ * (1 - pd_) / dec.sum()))


def test_macro_means_skip_domains_without_usable_positions():
    rng = np.random.default_rng(24)
    ref, eng, _ = pair_of_records(rng, n_seq=6, vocab=20, k_ref=20, k_eng=4, domains=("a", "b", "c"))
    eng.ambiguous = ref.position_domains() == "c"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        panel = metrics.panel_metrics(ref, eng, n_boot=100)
    assert math.isnan(panel.domains["c"].top1)
    assert panel.macro_top1 == pytest.approx(np.mean([panel.domains[d].top1 for d in ("a", "b")]))
    assert panel.macro_kl == pytest.approx(np.mean([panel.domains[d].kl_part.mean for d in ("a", "b")]))


@pytest.mark.usefixtures("each_backend")
def test_r20_without_any_finite_engine_value_is_a_counted_hard_fail():
    # The engine's only top-k entry is clamped (q = 0): no q_min to impute the reference's ids from.
    ref, eng = _one_position([0, 1], np.log([0.6, 0.3]), [5], [-9999.0], 0, math.log(0.6), math.log(0.2))
    pm = metrics.position_metrics(ref, eng)
    assert np.isnan(pm.kl_r20[0]) and pm.r20_imputed[0] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = metrics.group_report(pm, np.ones(1, bool), "all", n_boot=10)
    assert g.r20_hard_fails == 1 and g.kl_r20.n_positions == 0


def test_regions_report_perplexity_and_delta_p_separately():
    rng = np.random.default_rng(25)
    ref, eng, _ = pair_of_records(rng, n_seq=4, length=20, vocab=20, k_ref=20, k_eng=5)
    pm = metrics.position_metrics(ref, eng)
    cont = ref.pos_index >= 12
    g = metrics.group_report(pm, np.ones(ref.n_positions, bool), "all", n_boot=10, continuation=cont)
    assert g.regions["continuation"]["n"] == cont.sum()
    assert g.regions["prompt"]["perplexity"]["ppl_eng"] == pytest.approx(math.exp(pm.nll_eng[~cont].mean()))
    assert g.regions["continuation"]["delta_p"]["mean"] == pytest.approx(pm.delta_p[cont].mean())
    assert metrics.group_report(pm, np.ones(ref.n_positions, bool), "all", n_boot=10).regions == {}

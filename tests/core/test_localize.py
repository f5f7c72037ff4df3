"""core/localize.py: the localizer's distances, its thresholds, its verdict and the ds41-localize/2 record (pure,
no engine)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
import pytest

from core.localize import (
    FORMAT,
    LocalizeError,
    LocalizeRecord,
    calibration,
    decide,
    greedy_differences,
    kl_per_position,
    localize_sites,
    parse_key,
    position_distances,
    set_distances,
    site_order,
    site_threshold,
    summary_rows,
)

RNG = np.random.default_rng(0)
N, D, LAYERS, V = 12, 32, 4, 50


def _keys(phase: str) -> list[str]:
    return ([f"{phase}/embed"] + [f"{phase}/L{L}.{s}" for L in range(LAYERS) for s in ("attn", "mlp", "resid")]
            + [f"{phase}/final_norm", f"{phase}/logits"])


def _oracle() -> dict:
    acts = {}
    for phase, n in (("prefill", N), ("decode", 1)):
        for k in _keys(phase):
            acts[k] = RNG.standard_normal((n, V if k.endswith("logits") else D)) * 3
    return acts


def _noisy(acts: dict, rel: float, seed: int) -> dict:
    """Each row moved by ``rel`` of its size times a log-normal factor (a floor-like per-position spread)."""
    g = np.random.default_rng(seed)
    out = {}
    for k, v in acts.items():
        size = np.linalg.norm(v, axis=1, keepdims=True) / math.sqrt(v.shape[1])
        out[k] = v + rel * size * np.exp(0.3 * g.standard_normal((len(v), 1))) * g.standard_normal(v.shape)
    return out


def _ids() -> list[int]:
    return list(range(100, 100 + N + 1))


def test_position_distances_are_relative_per_position_and_the_cosine_ignores_scale():
    o = RNG.standard_normal((5, D))
    o[0] *= 100.0  # an attention-sink-like row: its own size, not the site's, sets its distance
    rel, cos, scale = position_distances(o * (1 + 1e-3), o)
    assert np.allclose(rel, 1e-3, rtol=1e-9)
    assert np.all(cos < 1e-15)
    assert scale == pytest.approx(math.sqrt(np.mean(np.linalg.norm(o, axis=1) ** 2)))
    ortho = np.zeros((1, 2)), np.zeros((1, 2))
    ortho[0][0, 0], ortho[1][0, 1] = 1.0, 1.0
    assert position_distances(*ortho)[1][0] == pytest.approx(1.0)
    with pytest.raises(LocalizeError):
        position_distances(np.zeros((2, 3)), np.zeros((3, 3)))


def test_logits_compare_as_distributions_and_index_sets_as_sets():
    ref = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    test = np.log(np.array([[0.5, 0.5], [0.5, 0.5]]))
    want = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)     # KL(ref || test), by hand
    kl = kl_per_position(test + 7.0, ref)                           # a shift of the logits is no change
    assert kl[0] == pytest.approx(0.0, abs=1e-15) and kl[1] == pytest.approx(want, rel=1e-12)
    # in row chunks (the memory bound for long prompts): every row the same as an independent computation
    from scipy.special import log_softmax as lsm

    rng = np.random.default_rng(4)
    r, t = rng.normal(size=(11, 50)) * 3, rng.normal(size=(11, 50)) * 3
    t[6, 2] = np.inf
    lr, lt = lsm(r, axis=1), lsm(np.where(np.isfinite(t), t, 0.0), axis=1)   # row 6 is not compared
    want_rows = np.sum(np.exp(lr) * (lr - lt), axis=1)
    for rows in (1, 4, 64):
        got = kl_per_position(t.astype(np.float32), r.astype(np.float32), rows=rows)
        assert got[6] == np.inf and np.isfinite(np.delete(got, 6)).all()
        np.testing.assert_allclose(np.delete(got, 6), np.delete(want_rows, 6), rtol=1e-5)
    sets = set_distances(np.array([[1, 2, 3], [4, 5, -1]]), np.array([[3, 2, 1], [4, 6, -1]]))
    assert sets.tolist() == [0.0, pytest.approx(1 - 1 / 3)]


def test_sites_run_from_the_embedding_to_the_logits_in_forward_order():
    keys = _keys("decode") + _keys("prefill")
    ordered = sorted(keys, key=site_order)
    assert ordered[0] == "prefill/embed" and ordered[1] == "prefill/L0.attn"
    assert ordered[len(ordered) // 2 - 2:len(ordered) // 2] == ["prefill/final_norm", "prefill/logits"]
    assert parse_key("decode/logits") == ("decode", None, "logits")
    assert parse_key("prefill/L2.attn_stream") == ("prefill", 2, "attn_stream")
    for bad in ("prefill/L2.nonsense", "prefill/embedding", "L2.mlp"):
        with pytest.raises(LocalizeError):
            parse_key(bad)


def test_the_threshold_holds_its_stated_false_alarm_rate_on_runs_distributed_like_the_floor():
    """Simulated runs whose per-position distances come from the floor's own distribution: the share of runs in
    which some site is named stays at or under the stated rate (it is set for; Bonferroni is conservative)."""
    g = np.random.default_rng(7)
    rate, sites, n, runs = 0.05, 20, 30, 4000
    cal = calibration(rate, sites * n)
    alarms = 0
    for _ in range(runs):
        mu = g.normal(-9, 1, size=sites)
        floor = np.exp(mu[:, None] + 0.5 * g.standard_normal((sites, n)))
        engine = np.exp(mu[:, None] + 0.5 * g.standard_normal((sites, n)))
        thr = np.array([site_threshold(f, cal) for f in floor])
        alarms += bool((engine > thr[:, None]).any())
    assert alarms / runs <= rate, f"{alarms} false alarms in {runs} runs at a stated rate of {rate}"
    # and a fault a few sigma out is seen: the same engine with one position of one site 30x its floor's median
    floor = np.exp(-9 + 0.5 * g.standard_normal(n))
    assert 30 * np.exp(-9) > site_threshold(floor, cal)
    # a zero floor (a deterministic engine against itself): any difference departs
    assert site_threshold(np.zeros(n), cal) == 0.0
    with pytest.raises(LocalizeError, match="false-alarm"):
        calibration(1.5, 10)


def test_the_verdict_names_the_first_diverged_site_with_its_onset():
    oracle = _oracle()
    floor = _noisy(oracle, 1e-7, 1)
    engine = _noisy(oracle, 1e-7, 2)
    # a fault in layer 2's MLP from prompt position 5 on: that site and everything computed after it move
    for k in engine:
        phase, L, site = parse_key(k)
        if L is not None and (L, site) >= (2, "mlp") or site in ("final_norm", "logits"):
            if phase == "prefill":
                engine[k] = engine[k].copy()
                engine[k][5:] *= (1 + 1e-3)
            else:
                engine[k] = engine[k] * (1 + 1e-3)
    sites, rows, _ = localize_sites(engine, oracle, floor)
    texts = [f"t{i}" for i in _ids()]
    v = decide(sites, rows, _ids(), texts)
    assert (v.status, v.site, v.first_divergent_layer, v.first_divergent_module, v.phase) == \
        ("named", "L2.mlp", 2, "mlp", "prefill")
    assert v.onset_position == 5 and v.onset_step == 1      # the first departing position, and the decode step
    assert v.ratio_at_first > 100 and v.ratio_before < 1
    assert {p.position for p in v.positions} <= set(range(5, N)) and all(p.ratio > 1 for p in v.positions)
    assert [g.layer for g in v.growth] == [2, 3] and v.growth_factor is not None


def test_a_change_before_layer_0_is_the_embedding_and_after_the_last_layer_the_final_norm():
    oracle = _oracle()
    floor = _noisy(oracle, 1e-7, 3)
    for first, moved in (("embed", lambda k: True), ("final_norm", lambda k: k.endswith(("final_norm", "logits")))):
        engine = _noisy(oracle, 1e-7, 4)
        engine = {k: (v * 1.01 if moved(k) else v) for k, v in engine.items()}
        v = decide(*localize_sites(engine, oracle, floor)[:2], _ids())
        assert (v.status, v.site, v.first_divergent_layer) == ("named", first, None)
    engine = _noisy(oracle, 1e-7, 4)
    engine["prefill/logits"] = engine["prefill/logits"] + np.linspace(0, 1, V)   # only the distribution moved
    v = decide(*localize_sites(engine, oracle, floor)[:2], _ids())
    assert v.site == "logits" and v.output_differs and "KL" in v.output_differs[0]


def test_the_rule_outputs_that_differ_never_read_as_nothing_diverged():
    """If the outputs differ, the verdict names a site or says the floor is too wide, and by how much."""
    oracle = _oracle()
    floor, engine = _noisy(oracle, 1e-7, 5), _noisy(oracle, 1e-7, 6)
    sites, rows, _ = localize_sites(engine, oracle, floor)
    v = decide(sites, rows, _ids())
    assert v.status == "clean" and not v.named and 0 < v.max_ratio < 1 and v.output_differs == ()
    diffs = greedy_differences([7, 8], [7, 9], "oracle")
    assert diffs == ["greedy token 2: 8 vs the oracle's 9"]
    v = decide(sites, rows, _ids(), output_differs=diffs)
    assert v.status == "floor_too_wide" and not v.named and v.site is None
    assert "greedy token 2" in v.explanation and f"{1 / v.max_ratio:.3g}x narrower" in v.explanation
    assert v.max_ratio_site in v.explanation
    # over many random runs with and without a difference, "clean" only ever stands beside agreeing outputs
    g = np.random.default_rng(11)
    for trial in range(30):
        e = _noisy(oracle, 1e-7 * (1 + 10 * g.random()), 100 + trial)
        d = greedy_differences([1, int(g.integers(2))], [1, 0])
        v = decide(*localize_sites(e, oracle, floor)[:2], _ids(), output_differs=d)
        assert v.status in ("named", "floor_too_wide") if d else v.status in ("named", "clean")


def test_the_record_round_trips_and_refuses_a_wrong_one(tmp_path):
    oracle = _oracle()
    engine = dict(oracle)
    engine["prefill/L0.resid"] = engine["prefill/L0.resid"].copy()
    engine["prefill/L0.resid"][3] = np.inf  # a non-finite engine row is infinitely far
    sites, rows, cal = localize_sites(engine, oracle, _noisy(oracle, 1e-7, 5))
    v = decide(sites, rows, _ids())
    assert (v.first_divergent_layer, v.first_divergent_module, v.onset_position) == (0, "resid", 3)
    rec = LocalizeRecord(engine={"profile": "p"}, oracle={"oracle": "o"}, floor={"precision": "fp64"},
                         calibration=cal, prompt={"token_ids": list(range(N))}, verdict=v, sites=tuple(sites))
    path = rec.save(tmp_path / "localize.json")
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["verdict"]["named"] is True and data["verdict"]["status"] == "named"
    assert data["verdict"]["site"] == "L0.resid" and data["calibration"]["false_alarm_rate"] == 1e-3
    back = LocalizeRecord.load(path)
    assert back == rec
    assert summary_rows(back)[1]["diverged"] == "resid" and summary_rows(back)[0]["layer"] == "embed"
    data["format"] = "ds41-localize/1"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(LocalizeError, match="format"):
        LocalizeRecord.load(tmp_path / "bad.json")
    data["format"] = FORMAT
    data["verdict"]["status"] = "fine"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(LocalizeError, match="status"):
        LocalizeRecord.load(tmp_path / "bad.json")
    del data["verdict"]["first_divergent_layer"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(LocalizeError, match="malformed"):
        LocalizeRecord.load(tmp_path / "bad.json")


class _Lazy(Mapping):
    """Arrays made on access; counts how many of every _Lazy's arrays are alive at once (the comparison's
    working set)."""

    live: list = []
    peak = 0

    def __init__(self, acts: dict):
        self._acts = acts   # kept as bytes: nothing of it is an array until asked for
        self.reads = []

    def __getitem__(self, key):
        import weakref

        self.reads.append(key)
        a = np.frombuffer(self._acts[key][0], dtype=np.float64).reshape(self._acts[key][1]).copy()
        _Lazy.live.append(weakref.ref(a))
        _Lazy.peak = max(_Lazy.peak, sum(r() is not None for r in _Lazy.live))
        return a

    def __iter__(self):
        return iter(self._acts)

    def __len__(self):
        return len(self._acts)


def test_the_comparison_holds_one_site_of_the_engine_the_oracle_and_the_floor_at_a_time():
    oracle = _oracle()
    as_bytes = lambda acts: {k: (v.tobytes(), v.shape) for k, v in acts.items()}   # noqa: E731
    eng, orc, flo = (_Lazy(as_bytes(a)) for a in (_noisy(oracle, 1e-7, 2), oracle, _noisy(oracle, 1e-7, 1)))
    _Lazy.live, _Lazy.peak = [], 0
    sites, _, _ = localize_sites(eng, orc, flo)
    assert len(sites) == len(oracle) and _Lazy.peak <= 3, f"{_Lazy.peak} arrays alive at once"
    # each site read once from each side, in forward order
    assert eng.reads == orc.reads == flo.reads == _keys("prefill") + _keys("decode")

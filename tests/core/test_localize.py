"""core/localize.py: the localizer's distances, its verdict and the ds41-localize/1 record (pure, no engine)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
import pytest

from core.localize import (DEFAULT_FACTOR, FORMAT, LocalizeError, LocalizeRecord, compare_site, decide,
                           localize_sites, parse_key, position_distances, summary_rows)

RNG = np.random.default_rng(0)
N, D, LAYERS = 12, 32, 4


def _oracle() -> dict:
    acts = {}
    for L in range(LAYERS):
        for site in ("attn", "mlp", "resid"):
            for phase, n in (("prefill", N), ("decode", 1)):
                acts[f"{phase}/L{L}.{site}"] = RNG.standard_normal((n, D)) * (1 + L)
    return acts


def _noisy(acts: dict, rel: float, seed: int) -> dict:
    g = np.random.default_rng(seed)
    return {k: v + rel * np.abs(v).mean() * g.standard_normal(v.shape) for k, v in acts.items()}


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


def test_a_site_diverges_only_beyond_the_factor_times_its_floor():
    o = RNG.standard_normal((N, D))
    floor = o + 1e-7 * RNG.standard_normal((N, D))
    same_noise = o + 2e-7 * RNG.standard_normal((N, D))
    s, per_pos = compare_site("prefill/L3.mlp", same_noise, o, floor)
    assert not s.diverged and 1.0 < s.ratio < DEFAULT_FACTOR and per_pos.shape == (2, N)
    s, _ = compare_site("prefill/L3.mlp", o * (1 + 1e-3), o, floor)
    assert s.diverged and s.ratio > 1000 and (s.layer, s.module, s.phase) == (3, "mlp", "prefill")
    assert s.rel_mean == pytest.approx(1e-3, rel=1e-6)


def test_the_verdict_names_the_first_diverged_site_in_forward_order():
    oracle = _oracle()
    floor = _noisy(oracle, 1e-7, 1)
    engine = _noisy(oracle, 1e-7, 2)
    # a fault in layer 2's MLP: that site and everything computed after it move
    for k in engine:
        phase, L, site = parse_key(k)
        if (L, site) >= (2, "mlp") and not (L == 2 and site == "attn"):
            engine[k] = engine[k] * (1 + 1e-3) + (1e-4 if (L, site) > (2, "mlp") else 0)
    sites, per_pos = localize_sites(engine, oracle, floor)
    ids = list(range(100, 100 + N + 1))
    texts = [f"t{i}" for i in ids]
    v = decide(sites, per_pos, ids, texts)
    assert (v.first_divergent_layer, v.first_divergent_module, v.phase) == (2, "mlp", "prefill")
    assert v.ratio_at_first > 1000 and v.ratio_layer_before < DEFAULT_FACTOR
    assert len(v.positions) == 8 and all(p.ratio > DEFAULT_FACTOR for p in v.positions)
    assert {p.text for p in v.positions} <= set(texts[:N])
    assert [g.layer for g in v.growth] == [2, 3] and v.growth_factor is not None


def test_the_unperturbed_engine_names_nothing_and_a_decode_only_fault_is_named_in_the_decode_step():
    oracle = _oracle()
    floor, engine = _noisy(oracle, 1e-7, 3), _noisy(oracle, 1e-7, 4)
    v = decide(*localize_sites(engine, oracle, floor), list(range(N + 1)))
    assert not v.named and v.first_divergent_module is None and 0 < v.max_ratio < DEFAULT_FACTOR
    engine["decode/L1.attn"] = engine["decode/L1.attn"] * 1.01
    v = decide(*localize_sites(engine, oracle, floor), list(range(N + 1)), [str(i) for i in range(N + 1)])
    assert (v.first_divergent_layer, v.first_divergent_module, v.phase) == (1, "attn", "decode")
    assert [p.position for p in v.positions] == [N]  # the decode row is the position after the prompt


def test_the_record_round_trips_and_refuses_a_wrong_one(tmp_path):
    oracle = _oracle()
    engine = dict(oracle)
    engine["prefill/L0.resid"] = engine["prefill/L0.resid"].copy()
    engine["prefill/L0.resid"][3] = np.inf  # a non-finite engine row is infinitely far
    sites, per_pos = localize_sites(engine, oracle, _noisy(oracle, 1e-7, 5))
    v = decide(sites, per_pos, list(range(N + 1)))
    assert (v.first_divergent_layer, v.first_divergent_module) == (0, "resid")
    rec = LocalizeRecord(engine={"profile": "p"}, oracle={"oracle": "o"}, floor={"precision": "fp64"},
                         factor=DEFAULT_FACTOR, prompt={"token_ids": list(range(N))}, verdict=v, sites=tuple(sites))
    path = rec.save(tmp_path / "localize.json")
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["verdict"]["named"] is True
    assert data["verdict"]["first_divergent_layer"] == 0 and data["verdict"]["first_divergent_module"] == "resid"
    back = LocalizeRecord.load(path)
    assert back == rec
    assert summary_rows(back)[0]["diverged"] == "resid"
    data["format"] = "ds41-localize/0"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(LocalizeError, match="format"):
        LocalizeRecord.load(tmp_path / "bad.json")
    data["format"] = FORMAT
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
    sites, _ = localize_sites(eng, orc, flo)
    assert len(sites) == len(oracle) and _Lazy.peak <= 3, f"{_Lazy.peak} arrays alive at once"
    # each site read once from each side, in forward order
    assert eng.reads == orc.reads == flo.reads == sorted(oracle, key=lambda k: (k.startswith("decode"),
                                                                                  int(k.split("L")[1].split(".")[0]),
                                                                                  ("attn", "mlp", "resid").index(
                                                                                      k.rsplit(".", 1)[1])))

"""gates.lib.selfconsistency: band from run-to-run spread, regions, failures."""

import math

import numpy as np
import pytest

from gates.lib import selfconsistency as sc
from gates.lib.common import step


def _steps(ids, p1s):
    """Steps whose top-2 are (a, p1) and (a+1, 1-p1-0.01)."""
    return tuple(step(a, math.log(p), [(a, math.log(p)), (a + 1, math.log(max(1e-6, 0.99 - p)))]) for a, p in zip(ids, p1s))


def _run(pid, decode_p, prefill_p, n=40, prompt_len=10, decode2_p=None, prefill2_p=None):
    ids = list(range(100, 100 + n))
    d = _steps(ids, [decode_p] * n)
    f = _steps(ids, [prefill_p] * n)
    d2 = _steps(ids, [decode2_p or decode_p] * n)
    f2 = _steps(ids, [prefill2_p or prefill_p] * n)
    return sc.PromptRuns(pid, "code", prompt_len, (d, d2), (f, f2))


def test_identical_decode_and_prefill_pass():
    res = sc.judge([_run("a", 0.8, 0.8), _run("b", 0.7, 0.7)])
    assert res.passed, res.failures
    assert res.summary["kl_part_mean"] == pytest.approx(0.0, abs=1e-12)
    assert {r["region"] for r in res.rows} >= {"all", "pos%2=0", "pos%8=7", "pos<128", "bin <2K"}


def test_decode_drift_fails_against_floor():
    res = sc.judge([_run("a", 0.5, 0.9)])
    assert not res.passed
    assert any("region all: mean KL_part" in f for f in res.failures)
    assert any("worst per-prompt mean" in f for f in res.failures)


def test_band_widens_with_measured_spread():
    # the same decode/prefill gap passes when the engine's own prefill repeats differ by as much
    gap = _run("a", 0.80, 0.81)
    assert not sc.judge([gap], sc.Band(floor_mean=1e-6, floor_worst=1e-6, min_positions=1)).passed
    noisy = _run("a", 0.80, 0.81, prefill2_p=0.79)
    res = sc.judge([noisy], sc.Band(floor_mean=1e-6, floor_worst=1e-6, min_positions=1))
    assert res.passed, res.failures
    assert res.summary["spread_mean"] > 0


def test_small_regions_are_reported_not_gated():
    res = sc.judge([_run("a", 0.5, 0.9, n=4)], sc.Band(min_positions=16, floor_worst=10.0))
    assert res.passed
    assert all(r["gated"] is False for r in res.rows)


def test_block_regions_and_nan_are_caught():
    masks = sc.region_masks(np.arange(120, 140), block=128)
    assert masks["block 128 ±2"].sum() == 5  # 126..130
    bad = _run("a", 0.8, 0.8)
    d = list(bad.decode[0])
    d[3] = step(d[3].actual_id, float("nan"), [(d[3].actual_id, -0.2)])
    res = sc.judge([sc.PromptRuns("a", "code", 10, (tuple(d), bad.decode[1]), bad.prefill)])
    assert any("NaN" in f for f in res.failures)


def test_prefill_must_rescore_decode_ids():
    r = _run("a", 0.8, 0.8)
    other = _steps(list(range(200, 240)), [0.8] * 40)
    with pytest.raises(ValueError, match="re-score"):
        sc.judge([sc.PromptRuns("a", "code", 10, r.decode, (other, other))])


def test_a_flag_floor_replaces_the_profile_floor_only_with_that_flag():
    """gates/config-vllm-cpu-dsv4.toml gives fp8_weights its own floor (decode and prefill run different fp8
    GEMM paths); the profile without the flag keeps the default."""
    from engine.target import checked_target
    from gates.sizes import load_gate_sizes
    from gates.test_self_consistency import _band

    cfg = load_gate_sizes(checked_target("vllm-cpu-dsv4").sizes).selfconsistency
    with_flag = _band(cfg, "vllm-cpu-dsv4", ("fp8_weights",))
    assert (with_flag.floor_mean, with_flag.floor_worst) == (1e-3, 2e-3)
    plain = _band(cfg, "vllm-cpu-dsv4")
    assert (plain.floor_mean, plain.floor_worst) == (cfg.floor_mean, cfg.floor_worst) == (1e-4, 1e-3)
    assert _band(cfg, "vllm-cpu-dsv4", ("kv_cache_2g",)).floor_mean == 1e-4      # another flag: the profile's
    fp32 = _band(cfg, "vllm-cpu-fp32", ("fp8_weights",))                          # no such key: the profile's own
    assert (fp32.floor_mean, fp32.floor_worst) == (1e-4, 1e-3)

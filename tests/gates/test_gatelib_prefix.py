"""gates.lib.prefix: expected hit length, every verdict, and the two-pass judge."""

import pytest

from gates.lib import prefix
from gates.lib.common import step


def _run(ids, cached, p1=0.8, m=1.0):
    """Top-2 steps: the runner-up `m` nats below `p1`, but never above the mass left (1 − p1): a record's
    logprobs are one distribution."""
    import math
    second = min(math.log(p1) - m, math.log1p(-p1))
    return prefix.Run(tuple(ids), tuple(step(a, math.log(p1), [(a, math.log(p1)), (a + 1, second)])
                                        for a in ids), cached)


def test_expected_cached_is_block_aligned_and_leaves_the_last_token():
    assert prefix.expected_cached(256, 256, 128) == 128
    assert prefix.expected_cached(257, 257, 128) == 256
    assert prefix.expected_cached(256, 280, 128) == 256
    assert prefix.expected_cached(127, 150, 128) == 0


@pytest.mark.parametrize("cold_c,warm_c,why", [(None, 128, "missing"), (0, None, "missing"), (5, 128, "cold run"),
                                               (0, 0, "no hit proven"), (0, 64, "no hit proven")])
def test_unproven_hits_are_invalid(cold_c, warm_c, why):
    v = prefix.classify("c", _run([1, 2, 3], cold_c), _run([1, 2, 3], warm_c), 128, 1e-6)
    assert v.verdict == "INVALID" and why in v.reason


def test_pass_noise_fail_corrupt():
    cold = _run([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0)
    assert prefix.classify("c", cold, _run(cold.ids, 128), 128, 1e-6).verdict == "PASS"
    tie = _run([1, 2, 3, 4], 0, p1=0.45, m=0.01)
    assert prefix.classify("c", tie, _run([1, 2, 9, 4], 128), 128, 1e-6).verdict == "NOISE"
    assert prefix.classify("c", cold, _run([1, 2, 3, 9], 128), 128, 1e-6).verdict == "FAIL"
    assert prefix.classify("c", cold, _run([9, 2, 3], 128), 128, 1e-6).verdict == "CORRUPT"
    confident = _run([1, 2, 3], 0, p1=0.95)
    assert prefix.classify("c", confident, _run([1, 2, 3], 128, p1=0.4), 128, 1e-6).verdict == "CORRUPT"
    drift = prefix.classify("c", cold, _run(cold.ids, 128, p1=0.7), 128, 1e-6)
    assert drift.verdict == "FAIL" and "KL_part" in drift.reason


def test_judge_and_run_to_run():
    cold = _run([1, 2, 3], 0)
    ok = prefix.classify("c", cold, _run([1, 2, 3], 128), 128, 1e-6)
    bad = prefix.classify("c", cold, _run([1, 2, 3], 0), 128, 1e-6)
    assert prefix.judge([("pass 1", ok), ("pass 2", ok)]).passed
    res = prefix.judge([("pass 1", ok), ("pass 2", bad)])
    assert not res.passed and res.counts["INVALID"] == 1 and "pass 2" in res.failures[0]
    assert prefix.run_to_run([(cold, cold)]) == pytest.approx(0.0, abs=1e-15)
    assert prefix.run_to_run([(cold, _run([1, 2, 3], 0, p1=0.7))]) > 1e-3

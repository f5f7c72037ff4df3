"""gates.lib.bench: decode/prefill/TTFT formulas, stream aggregates, invalid measurements, regressions."""

import pytest

from gates.lib import bench


def _s(t_send, first, last, n, n_in=100, cached=0):
    # first chunk carries 1 token, the rest evenly spread (n-1 tokens) up to `last`
    times = [first] + [first + (last - first) * (i + 1) / (n - 1) for i in range(n - 1)]
    return bench.StreamTimes(t_send, tuple(times), tuple([1] * n), n_in, cached)


def test_single_stream_formulas():
    s = _s(10.0, 10.5, 12.5, 41)
    assert bench.ttft(s) == pytest.approx(0.5)
    assert bench.decode_tps(s) == pytest.approx(40 / 2.0)
    assert bench.inter_token_s(s) == pytest.approx(0.05)
    assert bench.prefill_tps(s) == pytest.approx(100 / 0.5)


def test_chunks_are_not_tokens():
    s = bench.StreamTimes(0.0, (1.0, 2.0, 2.5), (1, 3, 0))
    assert s.n_out == 4 and s.t_last == 2.0
    assert bench.decode_tps(s) == pytest.approx(3 / 1.0)


@pytest.mark.parametrize("cached,msg", [(5, "prefix cache"), (None, "unknown")])
def test_prefill_refuses_cache_hits(cached, msg):
    with pytest.raises(bench.BenchInvalid, match=msg):
        bench.prefill_tps(_s(0, 1, 2, 3, cached=cached))


def test_invalid_decode_measurements():
    with pytest.raises(bench.BenchInvalid):
        bench.decode_tps(bench.StreamTimes(0.0, (1.0,), (1,)))
    with pytest.raises(bench.BenchInvalid, match="one chunk"):
        bench.decode_tps(bench.StreamTimes(0.0, (1.0,), (5,)))


def test_aggregate_and_regressions():
    a = _s(0.0, 1.0, 3.0, 21)
    b = _s(0.5, 1.5, 4.0, 21)
    agg = bench.aggregate([a, b])
    assert agg["aggregate_e2e_tps"] == pytest.approx(42 / 4.0)
    assert agg["aggregate_decode_tps"] == pytest.approx(42 / 3.0)
    assert bench.med([3, 1, 2])["median"] == 2
    assert bench.regressions({"x": 96.0}, {"x": 100.0}) == []
    assert bench.regressions({"x": 94.0}, {"x": 100.0})
    assert bench.regressions({}, {"x": 100.0})
    assert bench.regressions({"ttft": 1.1}, {"ttft": 1.0}, lower_is_better=["ttft"])

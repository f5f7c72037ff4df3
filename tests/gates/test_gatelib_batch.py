"""gates.lib.batch: token-id equality verdict, first divergence, margins, truncation."""

import math

from gates.lib import batch
from gates.lib.common import step


def _out(ids, m=1.0):
    return batch.Output(tuple(ids), tuple(step(a, -0.1, [(a, -0.1), (a + 1, -0.1 - m)]) for a in ids))


def test_equal_outputs_pass_and_are_bitwise():
    c = batch.compare("2 copies", "code", _out([1, 2, 3]), _out([1, 2, 3]))
    assert c.equal_ids and c.bitwise_logprobs and c.first_divergence is None
    assert batch.judge([c]).passed


def test_divergence_reports_position_and_margin():
    c = batch.compare("companions", "code", _out([1, 2, 3, 4], m=0.01), _out([1, 2, 9, 4]))
    assert not c.equal_ids and c.first_divergence == 2
    assert c.near_tie is True and math.isclose(c.solo_margin_at_divergence, 0.01)
    res = batch.judge([c])
    assert not res.passed and "near-tie" in res.failures[0]
    assert res.scenarios[0]["failures"] == "1/1"


def test_truncated_output_is_a_mismatch():
    c = batch.compare("burst", "code", _out([1, 2, 3]), _out([1, 2]))
    assert not c.equal_ids and c.first_divergence == 2
    assert not batch.judge([c]).passed


def test_logprob_difference_is_reported_not_failed():
    solo = _out([1, 2])
    test = batch.Output(solo.ids, (solo.steps[0], step(2, -0.1000001, [(2, -0.1000001), (3, -1.1)])))
    c = batch.compare("3 copies", "code", solo, test)
    assert c.equal_ids and not c.bitwise_logprobs and c.max_abs_dlogprob > 0
    assert batch.judge([c]).passed
    assert not batch.judge([]).passed

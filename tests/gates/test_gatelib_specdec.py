"""gates.lib.specdec: counters, α/τ/α_j, draft health, L1 losslessness."""

import pytest

from gates.lib import specdec
from gates.lib.common import step


def _samples(d, p, a, per):
    s = [(specdec.DRAFTS, {}, d), (specdec.DRAFT_TOKENS, {}, p), (specdec.ACCEPTED, {}, a)]
    return s + [(specdec.PER_POS, {"position": str(j)}, v) for j, v in enumerate(per)]


def test_counters_delta_and_acceptance():
    before = specdec.counters_from_samples(_samples(10, 30, 12, (6, 4, 2)))
    after = specdec.counters_from_samples(_samples(30, 90, 42, (21, 14, 7)))
    acc = specdec.Acceptance("code", after - before, 3)
    assert acc.alpha == pytest.approx(30 / 60)
    assert acc.tau == pytest.approx(1 + 30 / 20)
    assert acc.alpha_j == pytest.approx((15 / 20, 10 / 20, 5 / 20))
    assert acc.problems() == []
    assert specdec.counters_from_samples([("other", {}, 1.0)]) is None


@pytest.mark.parametrize("c,msg", [((10, 0, 0, (0, 0, 0)), "empty drafts"), ((10, 40, 5, (5, 0, 0)), "exceeds N"),
                                   ((10, 30, 31, (11, 10, 10)), "accepted 31"), ((10, 30, 6, (2, 4, 0)), "rises"),
                                   ((10, 30, float("nan"), ()), "NaN")])
def test_draft_health(c, msg):
    acc = specdec.Acceptance("d", specdec.Counters(*c), 3)
    assert any(msg in p for p in acc.problems())
    assert not specdec.judge([specdec.lossless("p", "d", [1], [], [1])], [acc]).passed


def test_lossless_and_never_drafting():
    steps = [step(1, -0.1, [(1, -0.1), (2, -0.12)]), step(2, -0.1, [(2, -0.1), (3, -3.0)])]
    same = specdec.lossless("p", "d", [1, 2], steps, [1, 2])
    diff = specdec.lossless("p", "d", [1, 2], steps, [1, 5])
    tie = specdec.lossless("p", "d", [1, 2], steps, [7, 2])
    ok = specdec.Acceptance("d", specdec.Counters(4, 12, 6, (3, 2, 1)), 3)
    assert same.equal and same.sha_plain == same.sha_spec
    assert specdec.judge([same], [ok]).passed
    assert not diff.equal and diff.first_divergence == 1
    assert not specdec.judge([diff], [ok], strict=False).passed        # decided position
    assert specdec.judge([tie], [ok], strict=False).passed             # near-tie allowed when not strict
    assert not specdec.judge([tie], [ok], strict=True).passed
    idle = specdec.Acceptance("d", specdec.Counters(0, 0, 0, ()), 3)
    res = specdec.judge([same], [idle])
    assert not res.passed and "never drafted" in res.failures[0]

"""Exact McNemar against hand-worked binomial sums (math.comb), and the scores of records."""

from __future__ import annotations

from math import comb

import pytest

from evals.stats import mcnemar_exact


def _two_sided(b: int, n: int) -> float:
    # exact two-sided binomial(n, 1/2) p-value: twice the smaller tail, capped at 1
    k = min(b, n - b)
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n)


def test_worked_example_one_against_six():
    # 1 problem solved by A only, 6 by B only, 3 by both: p = 2 * (C(7,0) + C(7,1)) / 2^7 = 16/128
    a = [True] * 3 + [True] + [False] * 6 + [False] * 5
    b = [True] * 3 + [False] + [True] * 6 + [False] * 5
    t = mcnemar_exact(a, b)
    assert (t.n, t.both, t.a_only, t.b_only) == (15, 3, 1, 6)
    assert t.p_value == pytest.approx(16 / 128, rel=1e-12)
    assert t.score_a == pytest.approx(4 / 15) and t.score_b == pytest.approx(9 / 15)


@pytest.mark.parametrize("a_only, b_only", [(0, 6), (6, 0), (0, 5), (3, 3), (10, 25), (40, 61)])
def test_matches_the_binomial_sum(a_only, b_only):
    a = [True] * a_only + [False] * b_only + [True, False]
    b = [False] * a_only + [True] * b_only + [True, False]
    assert mcnemar_exact(a, b).p_value == pytest.approx(_two_sided(a_only, a_only + b_only), rel=1e-9)


def test_no_discordant_pairs_is_p_one_and_six_one_sided_is_significant():
    assert mcnemar_exact([True, False], [True, False]).p_value == 1.0
    assert mcnemar_exact([True] * 6, [False] * 6).p_value == pytest.approx(2 / 64)
    assert mcnemar_exact([True] * 5, [False] * 5).p_value > 0.05   # five is never enough at alpha 0.05


def test_unequal_lengths_are_refused():
    with pytest.raises(ValueError, match="one length"):
        mcnemar_exact([True], [True, False])

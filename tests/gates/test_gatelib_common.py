"""gates.lib.common: first divergence, margins, step-wise KL_part through core.metrics."""

import math

import numpy as np
import pytest
from scipy.special import rel_entr

from gates.lib.common import first_divergence, margin, non_finite, step, step_metrics


def test_first_divergence_counts_missing_ids():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


def test_margin_and_non_finite():
    s = step(1, -0.1, [(1, -0.1), (2, -2.5)])
    assert margin(s) == pytest.approx(2.4)
    assert margin(step(1, -0.1, [(1, -0.1)])) == math.inf
    assert non_finite([s, step(1, float("nan"), [(1, -0.1)]), step(1, -math.inf, [(1, -0.1)])]) == [1]


def test_step_metrics_zero_for_identical_and_exact_on_partition():
    p = np.array([0.6, 0.3, 0.1])
    q = np.array([0.5, 0.3, 0.2])
    ref = [step(0, math.log(p[0]), [(0, math.log(p[0])), (1, math.log(p[1]))])]
    test = [step(0, math.log(q[0]), [(0, math.log(q[0])), (1, math.log(q[1]))])]
    sm = step_metrics([ref], [test])
    # S = {0, 1} plus the rest bucket {2}: exactly KL over three cells
    assert sm.kl_part[0] == pytest.approx(rel_entr(p, q).sum(), rel=1e-9)
    same = step_metrics([ref], [ref])
    assert same.kl_part[0] == pytest.approx(0.0, abs=1e-15)
    assert bool(same.top1_agree[0])


def test_step_metrics_refuses_different_ids():
    with pytest.raises(ValueError, match="different ids"):
        step_metrics([[step(1, -0.1, [(1, -0.1)])]], [[step(2, -0.1, [(2, -0.1)])]])

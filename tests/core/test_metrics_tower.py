"""core.metrics.tower: relative L2 against numpy, the per-image limit from the bf16 floor, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from core.metrics.tower import TowerInputError, relative_l2, tower_verdict


def _noisy(ref, rel, seed):
    """ref plus noise whose L2 norm is exactly `rel` x ||ref||."""
    n = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (ref.double() + n * (rel * ref.double().norm() / n.norm())).float()


def test_relative_l2_equals_numpy():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 33, generator=g), torch.randn(7, 33, generator=g)
    want = np.linalg.norm(a.double().numpy() - b.double().numpy()) / np.linalg.norm(b.double().numpy())
    assert relative_l2(a, b) == pytest.approx(want, rel=1e-12)
    assert relative_l2(b, b) == 0.0
    assert relative_l2(torch.full_like(b, math.nan), b) == math.inf


def test_verdict_limits_each_image_by_its_own_bf16_floor():
    g = torch.Generator().manual_seed(1)
    fp32 = {"a": torch.randn(9, 64, generator=g), "b": torch.randn(4, 64, generator=g)}
    bf16 = {"a": _noisy(fp32["a"], 2.7e-2, 2), "b": _noisy(fp32["b"], 1.0e-2, 3)}
    good = {"a": _noisy(fp32["a"], 1.5e-2, 4), "b": _noisy(fp32["b"], 0.9e-2, 5)}
    v = tower_verdict(good, fp32, bf16)
    assert v.passed, v.why
    figures = {r.image: (r.engine_rel_l2, r.floor_rel_l2) for r in v.images}
    assert figures["a"] == (pytest.approx(1.5e-2, rel=1e-5), pytest.approx(2.7e-2, rel=1e-5))
    # image b at 1.5e-2 is within a's floor but not within its own (1.0e-2)
    bad = dict(good, b=_noisy(fp32["b"], 1.5e-2, 6))
    v = tower_verdict(bad, fp32, bf16)
    assert not v.passed and "b: engine 1.500e-02 > limit 1.000e-02" in v.why and "a:" not in v.why
    assert tower_verdict(bad, fp32, bf16, floor_factor=1.6).passed
    assert tower_verdict(bad, fp32, bf16, abs_floor=2e-2).passed
    assert not tower_verdict(dict(good, a=torch.full_like(fp32["a"], math.inf)), fp32, bf16).passed


def test_verdict_refuses_inputs_it_cannot_compare():
    x = {"a": torch.ones(2, 3)}
    with pytest.raises(TowerInputError, match=r"missing \['a'\], extra \['z'\]"):
        tower_verdict({"z": torch.ones(2, 3)}, x, x)
    with pytest.raises(TowerInputError, match="shapes differ"):
        tower_verdict({"a": torch.ones(3, 2)}, x, x)
    with pytest.raises(TowerInputError, match="all zeros"):
        tower_verdict(x, {"a": torch.zeros(2, 3)}, x)
    with pytest.raises(TowerInputError, match="no images"):
        tower_verdict({}, {}, {})

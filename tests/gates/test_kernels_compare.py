"""Pure parts of the kernel gate: ULP distance (checked against independent computations), error
statistics and tolerance logic, the runner's perturbation and fp8_ds_mla cache packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels.registry import Tolerance
from engine.kernels.runner import pack_fp8_ds_mla, perturb, unpack_fp8_ds_mla
from gates.lib.kernels import error_stats, ulp_distance


def _steps_f32(a: np.float32, k: int, direction: float) -> np.float32:
    for _ in range(k):
        a = np.nextafter(a, np.float32(direction), dtype=np.float32)
    return a


def test_ulp_float32_matches_nextafter_stepping():
    rng = np.random.default_rng(1)
    starts = np.concatenate([rng.standard_normal(40).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 40),
                             np.array([0.0, -0.0, 1e-45, -1e-45, 1.0, 2.0 ** -126, 3.4e38], np.float32)])
    for a in starts.astype(np.float32):
        for k in (0, 1, 2, 7, 33):
            for direction in (np.inf, -np.inf):
                b = _steps_f32(np.float32(a), k, direction)
                if not np.isfinite(b):
                    continue
                got = ulp_distance(torch.tensor([a]), torch.tensor([b]))
                # numpy's nextafter visits only one zero, so crossing it is one step per side, as ours
                assert int(got) == k, (a, b, k)


def test_ulp_zero_signs_and_nan():
    z = ulp_distance(torch.tensor([0.0, 1.0, float("nan")]), torch.tensor([-0.0, float("nan"), 1.0]))
    assert z.tolist() == [0, -1, -1]
    with pytest.raises(TypeError, match="dtypes differ"):
        ulp_distance(torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shapes differ"):
        ulp_distance(torch.zeros(2), torch.zeros(3))


def test_ulp_bfloat16_matches_rank_in_sorted_value_table():
    """Independent: rank every finite bf16 value (all 65536 patterns, +-0 merged) in sorted order."""
    allbits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    vals = allbits.view(torch.bfloat16).float().numpy()
    finite = np.unique(vals[np.isfinite(vals)])  # unique merges +0 and -0
    rank = {float(v): i for i, v in enumerate(finite)}
    rng = np.random.default_rng(2)
    a = rng.choice(finite, 3000)
    b = np.where(rng.random(3000) < 0.5, rng.choice(finite, 3000),
                 finite[np.clip(np.searchsorted(finite, a) + rng.integers(-5, 6, 3000), 0, len(finite) - 1)])
    got = ulp_distance(torch.tensor(a).bfloat16(), torch.tensor(b).bfloat16()).numpy()
    want = np.array([abs(rank[float(x)] - rank[float(y)]) for x, y in zip(a, b)])
    assert (got == want).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2])
def test_perturb_moves_exactly_n_ulp_away_from_zero(dtype, n):
    x = (torch.randn(500, generator=torch.Generator().manual_seed(3)) * 100).to(dtype)
    x[0] = 0.0
    y = perturb(x, f"ulp+{n}")
    assert (ulp_distance(x, y) == n).all()
    assert (y.float().abs() > x.float().abs()).all()


def test_error_stats_exact_and_tolerances():
    ref = torch.tensor([1.0, 2.0, -3.0, 0.0], dtype=torch.float64)
    eng = torch.tensor([1.0, 2.0, -3.0, 0.0])
    s = error_stats(eng, ref, Tolerance(exact=True))
    assert (s.max_ulp, s.mismatches, s.violations, s.max_abs) == (0, 0, 0, 0.0)
    eng2 = eng.clone()
    eng2[1] = torch.nextafter(torch.tensor(2.0), torch.tensor(3.0))
    eng2[2] = torch.nextafter(torch.nextafter(torch.tensor(-3.0), torch.tensor(0.0)), torch.tensor(0.0))
    assert error_stats(eng2, ref, Tolerance(exact=True)).violations == 2
    assert error_stats(eng2, ref, Tolerance(max_ulp=1)).violations == 1  # the 2-ulp element
    assert error_stats(eng2, ref, Tolerance(max_ulp=2)).violations == 0
    assert error_stats(eng2, ref, Tolerance(max_ulp=1, atol=5e-7)).violations == 0  # |d| = 4.8e-7
    s = error_stats(eng2, ref, Tolerance(max_ulp=1))
    assert s.ulp_hist == {"0": 2, "1": 1, "2": 1, ">2": 0} and s.max_ulp == 2
    assert s.max_rel == pytest.approx(float(2 * 2.0 ** -22 / 3.0))


def test_error_stats_rounds_oracle_to_engine_dtype_and_row_rtol():
    ref = torch.tensor([[100.0, 1.0 + 2.0 ** -9], [1.0, 2.0 ** -20]], dtype=torch.float64)
    eng = ref.to(torch.bfloat16)  # correctly rounded: 0 ulp even though the values differ
    s = error_stats(eng, ref, Tolerance(exact=True))
    assert s.violations == 0 and s.max_abs == pytest.approx(2.0 ** -9)
    eng2 = eng.clone()
    eng2[1, 1] = 0.0  # near-zero element: huge ulp count, tiny absolute error
    assert error_stats(eng2, ref, Tolerance(max_ulp=4)).violations == 1
    # 2^-20 against the row max 1.0: inside row_rtol 2^-8, outside 2^-24
    assert error_stats(eng2, ref, Tolerance(max_ulp=4, row_rtol=2.0 ** -8)).violations == 0
    assert error_stats(eng2, ref, Tolerance(max_ulp=4, row_rtol=2.0 ** -24)).violations == 1
    with pytest.raises(ValueError, match="shape mismatch"):
        error_stats(eng, ref[0], Tolerance(exact=True))


def test_tolerance_rejects_negative_bounds():
    with pytest.raises(ValueError, match="greater than or equal to 0"):   # pydantic's ValidationError
        Tolerance(max_ulp=-1)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Tolerance(atol=-1e-9)


def test_fp8_ds_mla_pack_roundtrip_and_layout():
    from oracle.dsv41.quant import act_quant_dequant
    g = torch.Generator().manual_seed(4)
    nope = act_quant_dequant(torch.randn(11, 448, generator=g) * 3, 64)
    rope = torch.randn(11, 64, generator=g).bfloat16().float()
    kv = torch.cat([nope, rope], -1)
    cache = pack_fp8_ds_mla(kv, block=4)
    assert cache.shape == (3, 4 * 584) and cache.dtype == torch.uint8
    n2, r2 = unpack_fp8_ds_mla(cache, 11, 4)
    assert torch.equal(n2, nope) and torch.equal(r2.float(), rope)
    # slot 5 = block 1, position 1: its 7 scale bytes sit after the block's 4 x 576 token bytes
    amax = nope[5].view(7, 64).abs().amax(-1)
    exps = cache[1, 4 * 576 + 8:4 * 576 + 15].to(torch.int32) - 127
    assert (amax <= 448 * torch.ldexp(torch.ones(7), exps)).all()
    with pytest.raises(ValueError, match="not exactly representable"):
        pack_fp8_ds_mla(kv + 1e-3, block=4)

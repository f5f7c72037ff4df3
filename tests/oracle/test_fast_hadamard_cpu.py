"""The CPU stand-in for fast_hadamard_transform (tests/oracle/fast_hadamard_cpu.py) that the DeepSeek-V4
reference conformance runs the reference's `rotate_activation` with, checked independently: against
scipy.linalg.hadamard in float64 at the rounding the CUDA kernel does (fp32 sums, fp32 product with the fp32
scale, one cast to the input dtype). Then the oracle's reference-bf16 `rotate_activation` against the stand-in,
and a bf16-matmul Hadamard (the fallback of some public reference copies) shown to differ. Cheap; in CI."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch

sys.path.insert(0, str(Path(__file__).parent))
import fast_hadamard_cpu  # noqa: E402

from oracle.dsv41.compressor_v4 import rotate_activation  # noqa: E402
from oracle.dsv41.numerics import Numerics  # noqa: E402


def kernel_rounding_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """bf16/fp32 x -> (x @ scipy H) in float64, rounded to fp32 (the kernel's fp32 sums, when no partial sum
    needs more than 24 bits), times fp32(scale) in fp32, cast to x's dtype."""
    d = x.shape[-1]
    exact = x.double().numpy().reshape(-1, d) @ scipy.linalg.hadamard(d).astype(np.float64)
    s32 = np.float32(scale)
    out = (exact.astype(np.float32) * s32).astype(np.float32)
    return torch.from_numpy(out).to(x.dtype).reshape(x.shape)


def lattice(rows: int, d: int, seed: int) -> torch.Tensor:
    """bf16 values k * 2^-7 with |k| <= 255: every butterfly partial sum is a multiple of 2^-7 below 2^10,
    so exact in fp32 and the reference above is exact too."""
    k = torch.randint(-255, 256, (rows, d), generator=torch.Generator().manual_seed(seed))
    val = k.double() * 2.0 ** -7
    x = val.to(torch.bfloat16)
    assert torch.equal(x.double(), val)  # 8 significant bits: bf16 values
    return x


@pytest.mark.parametrize("d", [8, 16, 64, 128, 512])
def test_equals_scipy_at_the_kernel_rounding_where_fp32_sums_are_exact(d):
    x = lattice(64, d, d)
    got = fast_hadamard_cpu.hadamard_transform(x, scale=d ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, kernel_rounding_reference(x, d ** -0.5))
    x32 = x.float()  # fp32 input: fp32 output, same sums
    assert torch.equal(fast_hadamard_cpu.hadamard_transform(x32, scale=0.3), kernel_rounding_reference(x32, 0.3))


def test_equals_scipy_at_the_kernel_rounding_on_trained_scale_activations():
    """Gaussian bf16 rows at d = 128 (the V4 indexer's head dim), 2,048 rows: bit-identical to the float64
    reference rounded as the kernel rounds; the outputs whose exact sums are not fp32 numbers are counted
    (there the fp32 butterfly itself rounds, and stage order could matter)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2048, 128, generator=g) * 3).to(torch.bfloat16)
    got = fast_hadamard_cpu.hadamard_transform(x, scale=128 ** -0.5)
    want = kernel_rounding_reference(x, 128 ** -0.5)
    exact = x.double().numpy() @ scipy.linalg.hadamard(128).astype(np.float64)
    inexact = int((exact.astype(np.float32).astype(np.float64) != exact).sum())
    differ = int((got != want).sum())
    print(f"\nd=128, 2048 rows: {inexact} of {exact.size} exact sums are not fp32 numbers; "
          f"{differ} outputs differ from scipy at the kernel rounding")
    assert differ == 0


def test_scale_is_the_fp32_product_then_one_rounding():
    """A value where multiplying by the double scale and rounding once to bf16 differs from the kernel's
    fp32 product: the stand-in follows the kernel (fp32(scale), fp32 product, then bf16)."""
    d = 4
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    for scale in (d ** -0.5, 1 / 3, 0.1, 3.7e-3):
        got = fast_hadamard_cpu.hadamard_transform(x, scale)
        want = torch.tensor(np.float32(1.0) * np.float32(scale)).to(torch.bfloat16)
        assert torch.equal(got, want.expand(1, 4)), scale


def test_refuses_what_the_stand_in_does_not_do():
    with pytest.raises(ValueError, match="power of two"):
        fast_hadamard_cpu.hadamard_transform(torch.zeros(2, 12, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        fast_hadamard_cpu.hadamard_transform(torch.zeros(2, 8, dtype=torch.float64))


def test_the_oracles_reference_bf16_rotation_equals_the_stand_in():
    """What the V4 conformance relies on: the oracle's reference-bf16 `rotate_activation` (its own fp32
    butterfly) gives the stand-in's bits, so the conformance's bit-identity checks the oracle's Hadamard
    against scipy (through the stand-in), not against itself."""
    g = torch.Generator().manual_seed(2)
    for d, rows in ((128, 512), (64, 64), (512, 32)):
        x = (torch.randn(rows, d, generator=g) * 2).to(torch.bfloat16)
        ora = rotate_activation(x.float(), Numerics("reference-bf16"))
        assert torch.equal(ora, fast_hadamard_cpu.hadamard_transform(x, d ** -0.5).float()), d


def test_a_bf16_matmul_hadamard_is_not_the_kernel():
    """Can fail: `torch.matmul(x, H.to(bf16)) * scale` in bf16 (a fallback some public copies of the V4
    reference ship) rounds the unscaled product to bf16 first; it misses the kernel's result on many
    elements, which the long conformance case then shows as a logit difference."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 128, generator=g) * 3).to(torch.bfloat16)
    h = torch.from_numpy(scipy.linalg.hadamard(128)).to(torch.bfloat16)
    bf16_mm = torch.matmul(x, h) * 128 ** -0.5
    differ = int((bf16_mm != kernel_rounding_reference(x, 128 ** -0.5)).sum())
    print(f"\nbf16 matmul Hadamard: {differ} of {x.numel()} outputs differ from the kernel rounding")
    assert differ > 0


def test_the_v4_harness_installs_it_as_fast_hadamard_transform(monkeypatch):
    import dsv4_reference_harness as H4
    monkeypatch.setitem(sys.modules, "fast_hadamard_transform", None)  # restored (removed) after the test
    H4.install_hadamard_stand_in()
    from fast_hadamard_transform import hadamard_transform
    assert hadamard_transform is fast_hadamard_cpu.hadamard_transform

"""The EXL3 kernel gate's CPU half (engine/exllamav3_kernels.py): reference, floor, verdict and the planted faults.
The kernels themselves run on the GPU only (tests/engine/test_exllamav3_gpu.py, marker gpu)."""

from __future__ import annotations

import pytest
import torch

from engine import exllamav3_kernels as K
from oracle.dsv41 import formats as F


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(0)
    w = K.random_weights(256, 256, 3, 2, g)
    x = torch.randn(4, 256, generator=g).half().float()
    return w, x, K.reference(w, x), g


def test_floor_is_the_fp16_weight_and_output_rounding_and_small(case):
    w, x, y_ref, _ = case
    floor = K.floor_of(w, x, y_ref)
    assert 1e-5 < floor < 5e-3
    # an exact kernel is at 0, the ideal fp16 kernel at the floor: both pass; 10x the floor does not
    assert K.verdict(0.0, floor) == "PASS" and K.verdict(floor, floor) == "PASS"
    assert K.verdict(10 * floor, floor) == "FAIL" and K.verdict(float("nan"), floor) == "FAIL"


@pytest.mark.parametrize("fault", K.PLANTED)
def test_each_planted_fault_moves_the_output_far_beyond_the_floor(case, fault):
    """What the GPU kernel would compute from the planted weights, emulated exactly on the CPU, must FAIL."""
    w, x, y_ref, g = case
    bad = K.plant(w, fault, g)
    if fault == "wrong_k":
        assert bad.k != w.k and bad.trellis.shape[-1] == 16 * bad.k
    y_bad = x.double() @ F.exl3_dequant(bad.trellis, bad.suh, bad.svh, bad.cb).double().t()
    err = K.max_rel(y_bad, y_ref)
    assert K.verdict(err, K.floor_of(w, x, y_ref)) == "FAIL", err
    assert err > 0.01


def test_summary_requires_every_real_case_to_pass_and_every_planted_one_to_fail():
    row = lambda v, planted=None: {"verdict": v, "planted": planted, "ratio": 1.0,
                                   "detected": (v == "FAIL") if planted else None}
    assert K.summary([row("PASS"), row("FAIL", "wrong_k")])["gate_passed"]
    assert not K.summary([row("PASS"), row("PASS", "wrong_k")])["gate_passed"]
    assert not K.summary([row("FAIL"), row("FAIL", "wrong_k")])["gate_passed"]

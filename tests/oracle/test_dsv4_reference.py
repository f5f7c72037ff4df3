"""Conformance of the oracle's DeepSeek-V4 reference-bf16 mode with DeepSeek's V4 reference code
(docs/ORACLE.md "DeepSeek-V4 mode"). Needs a local reference folder in DS4_REFERENCE_CODE (see
tests/oracle/dsv4_reference_harness.py); marked `reference` and kept out of CI. Without the variable the
tests are skipped, saying why."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import dsv4_reference_harness as H  # noqa: E402

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def ref():
    folder = H.reference_dir()
    if folder is None:
        pytest.skip(f"{H.ENV} is not set: no local copy of the V4 reference code to compare against")
    return H.import_reference(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(seed):
        if seed not in made:
            made[seed] = H.write_tiny_v4_checkpoint(tmp_path_factory.mktemp(f"v4-{seed}") / "ck", seed=seed,
                                                    overrides=H.CONFIGS["tiny"])
        return made[seed]
    return get


def test_tiny_v4_checkpoint_loads_in_the_reference_unchanged(ref, checkpoint):
    H.load_reference(ref, checkpoint(0))  # raises on a missing or left-over tensor


@pytest.mark.parametrize("case", sorted(H.CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_bf16_reproduces_the_v4_reference(ref, checkpoint, seed, case):
    c = H.conformance_case(ref, checkpoint(seed), seed, case)
    assert c.first_divergence is None, c.first_divergence
    assert c.max_abs_prefill == 0.0 and c.max_abs_decode == 0.0, c


def test_the_comparison_separates_the_fp32_mode(ref, checkpoint):
    c = H.conformance_case(ref, checkpoint(0), 0, "short", precision="fp32")
    assert c.first_divergence is not None and c.max_abs_prefill > 0

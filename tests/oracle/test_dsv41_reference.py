"""Conformance of the oracle's reference-bf16 mode with DeepSeek's reference code (docs/ORACLE.md).

Needs a local copy of the reference folder (see tests/oracle/dsv41_reference_harness.py) in DS41_REFERENCE_CODE;
marked `reference` and kept out of CI (scripts/test.sh runs -m "not gpu and not reference"). Without the
variable the tests are skipped, saying why. Each case writes a tiny checkpoint, loads it unchanged into the
reference, runs prefill (21 tokens) + 8 teacher-forced decode steps with a DSpark draft after each, beside the
oracle in reference-bf16 mode, and compares every logit, every indexer pick and every Engram hash id; a
failure names the first layer and op (Engram / attention / MoE / block output) that differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import dsv41_reference_harness as H  # noqa: E402

pytestmark = pytest.mark.reference

# Measured 0.0 on every case of the docs/ORACLE.md table; the target is 1e-3.
LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def ref():
    folder = H.reference_dir()
    if folder is None:
        pytest.skip(f"{H.ENV} is not set: no local copy of the reference code to compare against")
    return H.import_reference(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(seed, cname):
        if (seed, cname) not in made:
            made[seed, cname] = H.write_tiny_checkpoint(tmp_path_factory.mktemp(f"{cname}-{seed}") / "ck", seed=seed,
                                                        config_overrides=H.CONFIGS[cname])
        return made[seed, cname]
    return get


def test_tiny_checkpoint_loads_in_the_reference_unchanged(ref, checkpoints):
    """ModelArgs(**config.json) and every tensor, none missing and none left over (load_reference raises)."""
    model = H.load_reference(ref, checkpoints(0, "tiny"))
    assert model.layers[0].ffn.gate.bias_vl is None  # vision off: the reference's gate has no bias_vl


@pytest.mark.parametrize("quirk", [True, False], ids=["quirk-on", "quirk-off"])
@pytest.mark.parametrize("cname", sorted(H.CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_bf16_reproduces_the_reference(ref, checkpoints, seed, cname, quirk):
    c = H.conformance_case(ref, checkpoints(seed, cname), H.input_ids(seed, 512), quirk)
    where = f"first divergence: {c.first_divergence}; oracle top-k ties (call, site): {c.tie_calls}"
    assert c.hashes_equal, "Engram hash ids differ; " + where
    assert c.picks_equal, f"indexer picks differ at (call, layer) {c.pick_mismatches}; " + where
    for phase, d in c.max_abs.items():
        assert d <= LOGIT_TOL, f"{phase}: max |Δ logit| {d:.3g}; " + where
    assert min(c.argmax_agree.values()) == 1.0, where

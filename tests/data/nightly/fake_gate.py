"""A stand-in gate suite for the nightly runner's own tests (tests/nightly/test_nightly.py): no engine.

Not collected by default (no test_ prefix); the nightly config names it. DS41_FAKE_GATE_MODE=green|regress (env):
`regress` makes the engine record noisier (per-prompt KL up on every prompt) and fails the exact gate.
It goes through the real plugin: gate_run → results.json, session report, per_prompt.json.
"""

import os

import numpy as np
import pytest

from core.results import GateEntry
from tests.core.recordkit import pair_of_records

pytestmark = pytest.mark.gate


def test_fake_kl_panel(gate_run, request):
    mode = os.environ.get("DS41_FAKE_GATE_MODE", "green")
    profile = request.config.getoption("--engine-profile") or "fake"
    rng = np.random.default_rng(7)
    ref, eng, _ = pair_of_records(rng, n_seq=12, length=10, vocab=40, k_ref=40, k_eng=10,
                                  noise=0.1 if mode == "green" else 0.6, domains=("a", "b", "c"))
    gate_run.reference = ref
    gate_run.engines.append((profile, eng))
    gate_run.add(GateEntry("kl_panel", True, profile=profile,
                           metrics={"kl_part_mean": 0.01 if mode == "green" else 0.2}))


def test_fake_exact():
    assert os.environ.get("DS41_FAKE_GATE_MODE", "green") == "green", "fake exact gate: outputs changed"

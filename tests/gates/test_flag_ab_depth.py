"""The flag A/B at depth (issue 39): a flag whose code runs only past the short panel's reach is A/B'd on long@1
(kl_depth / bitwise_depth), and the depth rule judges per bucket."""

from __future__ import annotations

import numpy as np
import pytest

from gates.lib import flag_ab as verdicts
from gates.lib.depth import judge_at_depth
from nightly.flags import CLASS_GATES, FlagRegistryError, parse_registry
from tests.core.recordkit import pair_of_records

BANDS = """
[depth.p.default]
kl_mean = 0.01
kl_p99 = 1.0
top1_decided = 0.0
ln_ppl = 10.0
"""


def _entry(cls: str, mechanisms=(), gates=None):
    table = {"description": "d", "class": cls, "mechanisms": list(mechanisms)}
    if gates is not None:
        table["gates"] = gates
    return parse_registry({"flags": {"f": table}}, "unit").get("f")


@pytest.mark.parametrize("cls, deep", [("numerics", "kl_depth"), ("exact", "bitwise_depth"), ("perf", "bitwise_depth")])
def test_a_flag_whose_code_runs_at_depth_gets_its_class_depth_gate(cls, deep):
    assert _entry(cls, ["indexer_pruning"]).effective_gates() == (*CLASS_GATES[cls], deep)
    assert _entry(cls, ["window_full_evicting", "compressed_r128"]).effective_gates() == (*CLASS_GATES[cls], deep)
    # mechanisms the short panel reaches (ratio-4 entries from the 4th token) need no long prompt
    assert _entry(cls, ["compressed_r4"]).effective_gates() == CLASS_GATES[cls]
    assert _entry(cls).effective_gates() == CLASS_GATES[cls]


def test_a_declared_gates_list_is_taken_as_written_and_depth_gates_are_known_names():
    assert _entry("numerics", ["indexer_pruning"], ["kl_band"]).effective_gates() == ("kl_band",)
    assert _entry("numerics", ["indexer_pruning"], ["kl_depth"]).effective_gates() == ("kl_depth",)
    with pytest.raises(FlagRegistryError, match="kl_deep"):
        _entry("numerics", ["indexer_pruning"], ["kl_deep"])


def test_the_depth_rule_passes_the_reference_itself_and_fails_a_distorted_engine(tmp_path):
    bands = tmp_path / "bands.toml"
    bands.write_text(BANDS)
    rng = np.random.default_rng(3)
    ref, same, _ = pair_of_records(rng, n_seq=2, length=300, vocab=40, k_ref=40, k_eng=40, noise=0.0)
    ok = judge_at_depth(ref, same, bands, "p")
    assert ok.passed and ok.failures == ()
    assert {r["bucket"] for r in ok.rows} >= {"d0-128", "d128-2K", "last256"}
    assert all(r["verdict"] == "pass" and r["kl_part_mean"] == pytest.approx(0.0, abs=1e-12) for r in ok.rows)
    v = verdicts.depth_band_verdict(ok.passed, ok.failures, "p", ok.rows, [300])
    assert v.gate == "kl_depth" and v.passed and "worst bucket mean KL_part" in v.why

    ref, noisy, _ = pair_of_records(np.random.default_rng(3), n_seq=2, length=300, vocab=40, k_ref=40, k_eng=40,
                                    noise=1.0)
    bad = judge_at_depth(ref, noisy, bands, "p")
    assert not bad.passed and any("d128-2K" in f for f in bad.failures)
    v = verdicts.depth_band_verdict(bad.passed, bad.failures, "p", bad.rows, [300])
    assert not v.passed and v.why == "; ".join(bad.failures)

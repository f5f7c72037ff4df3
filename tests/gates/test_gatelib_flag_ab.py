"""The flag A/B gate's pure verdicts (gates/lib/flag_ab.py) and the gate file's coverage of the registry's gates."""

from __future__ import annotations

import inspect

import pytest

from core.results import FlagGateVerdict, GateResults
from gates.lib import flag_ab as v
from nightly.flag_ab import BitwiseResult, PairedVerdict, SpeedVerdict
from nightly.flags import KNOWN_GATES
from panels.model import EncodedSequence


def _bit(identical=True, ids=True, max_abs=0.0, n=0, what="greedy"):
    return BitwiseResult(what, identical, 10, ("s step 3: logprob values differ",) if n else (), n, max_abs, ids)


def test_bitwise_verdict_names_the_mismatches():
    ok = v.bitwise_verdict(_bit(what="panel"))
    assert ok.gate == "bitwise_panel" and ok.passed and ok.why == "panel: 10 positions bit-identical"
    assert ok.evidence["compared"] == 10 and ok.max_abs_diff == 0.0
    bad = v.bitwise_verdict(_bit(False, True, 2e-7, 1, "panel"))
    assert not bad.passed and bad.why == ("panel: 1 of 10 differ (max |Δ logprob| 2e-07): "
                                          "s step 3: logprob values differ")
    assert bad.max_abs_diff == 2e-7


@pytest.mark.parametrize("off_off,off_on,passed,provisional", [
    (_bit(), _bit(), True, False),                                   # deterministic, identical
    (_bit(), _bit(False, True, 1e-9, 1), False, False),              # deterministic, one ulp off: fails
    (_bit(False, True, 1e-6, 2), _bit(False, True, 1e-7, 1), True, True),   # inside off's own spread
    (_bit(False, True, 1e-8, 2), _bit(False, True, 1e-7, 1), False, True),  # beyond off's own spread
    (_bit(False, True, 1e-6, 2), _bit(False, False, 0.0, 1), False, True),  # ids differ: never within spread
])
def test_greedy_verdict_falls_back_to_the_observed_spread(off_off, off_on, passed, provisional):
    got = v.greedy_verdict(off_off, off_on)
    assert got.gate == "bitwise_greedy" and got.passed is passed and got.provisional is provisional
    assert got.evidence["baseline_deterministic"] is off_off.identical
    if provisional:
        assert got.why.startswith("baseline not deterministic")


def test_band_paired_and_speed_verdicts_carry_the_numbers_the_history_tracks():
    band = v.band_verdict(True, [], "vllm-cpu-fp32", {"kl_part_mean": 1e-9})
    assert (band.gate, band.passed, band.why) == ("kl_band", True, "within the vllm-cpu-fp32 bands")
    assert band.evidence == {"band_profile": "vllm-cpu-fp32", "summary": {"kl_part_mean": 1e-9}}
    assert v.band_verdict(False, ["a: x", "b: y"], "p", {}).why == "a: x; b: y"
    pv = PairedVerdict(False, 1.0, 2.0, 1.0, 0.5, 1.5, 0.01, 0.05, 20, "worse")
    paired = v.paired_verdict(pv, _bit(False, True, 0.3, 4, "panel"))
    assert not paired.passed and paired.why == "worse" and paired.evidence["bit_identical"] is False
    assert paired.max_abs_diff == 0.3 and paired.mean_diff == 1.0 and paired.evidence["n_prompts"] == 20
    sv = SpeedVerdict(True, 100.0, 95.0, 0.95, 0.1, 3, "fine")
    assert v.speed_verdict(sv).ratio == 0.95 and v.speed_verdict(sv).why == "fine"


def test_verdicts_accumulate_per_flag_and_the_report_rows_follow():
    r = GateResults().with_flag_verdict("f", "exact", "", "prof", FlagGateVerdict("bitwise_panel", True, "same"))
    r2 = r.with_flag_verdict("f", "exact", "", "prof", FlagGateVerdict("bitwise_greedy", False, "diverge"))
    exact = ("bitwise_panel", "bitwise_greedy")
    assert [g.gate for g in r.flag("f").gates] == ["bitwise_panel"]
    # one recorded pass is not the flag's pass: its class expects bitwise_greedy too (issue 35)
    assert r.flag("f").passed_all(("bitwise_panel",)) and not r.flag("f").passed_all(exact)
    assert not r2.flag("f").passed_all(exact) and [g.gate for g in r2.flag("f").gates] == list(exact)
    r3 = r2.with_flag_verdict("g", "perf", "", "prof", FlagGateVerdict("speed", True, "ok"))
    assert v.report_rows(r3, {"f": exact, "g": ("bitwise_panel", "bitwise_greedy", "speed")}) == [
        {"flag": "f", "class": "exact", "gate": "(all expected)", "verdict": "FAIL",
         "why": "FAIL (bitwise_greedy: failed)"},
        {"flag": "f", "class": "exact", "gate": "bitwise_panel", "verdict": "pass", "why": "same"},
        {"flag": "f", "class": "exact", "gate": "bitwise_greedy", "verdict": "failed", "why": "diverge"},
        {"flag": "g", "class": "perf", "gate": "(all expected)", "verdict": "ERROR",
         "why": "ERROR (bitwise_panel: missing, bitwise_greedy: missing)"},
        {"flag": "g", "class": "perf", "gate": "bitwise_panel", "verdict": "missing",
         "why": "never ran: no verdict and no test outcome"},
        {"flag": "g", "class": "perf", "gate": "bitwise_greedy", "verdict": "missing",
         "why": "never ran: no verdict and no test outcome"},
        {"flag": "g", "class": "perf", "gate": "speed", "verdict": "pass", "why": "ok"}]


def test_greedy_prompts_take_the_unscored_prefix_per_domain():
    seqs = [EncodedSequence("a1", "code", (1, 2, 3, 4), (False, False, True, True)),
            EncodedSequence("a2", "code", (5, 6, 7), (False, True, True)),
            EncodedSequence("b1", "prose", (8, 9, 10, 11, 12), (False, False, False, False, True)),
            EncodedSequence("c1", "math", (13, 14), (False, False))]
    assert v.greedy_prompts(seqs, 1, 256) == [("a1", (1, 2)), ("b1", (8, 9, 10, 11)), ("c1", (13, 14))]
    assert v.greedy_prompts(seqs, 2, 3) == [("a1", (1, 2)), ("a2", (5,)), ("b1", (8, 9, 10)), ("c1", (13, 14))]


def test_gate_file_has_one_test_per_registry_gate():
    import gates.test_flag_ab as gate_file

    guarded = [f.ab_gate for _, f in inspect.getmembers(gate_file, inspect.isfunction) if hasattr(f, "ab_gate")]
    assert sorted(guarded) == sorted(KNOWN_GATES)

"""core.results: the typed `ds41-results/1` file round-trips, and anything else is refused naming the file and what
it found (no tag, another tag, a renamed key, a value of the wrong type)."""

from __future__ import annotations

import json
import math

import pytest

from core.results import (
    FORMAT_VERSION,
    FlagGateVerdict,
    GateEntry,
    GateOutcome,
    GateResults,
    GateTimings,
    ReportSection,
    ResultsError,
    headline,
)


def _full() -> GateResults:
    r = GateResults()
    r = r.with_gate(GateEntry("kl_panel", True, profile="vllm-cpu-fp32", failures=[],
                              metrics={"kl_part_mean": 0.002, "kl_part_max": math.inf, "positions": 640},
                              evidence={"answered_by": ["http://127.0.0.1:8000"]}))
    r = r.with_gate(GateEntry("prefix_cache", None, failures=["not applicable: no prefix caching"]))
    r = r.with_flag_verdict("fast_path", "exact", "env", "vllm-cpu-fp32",
                            FlagGateVerdict("bitwise_panel", True, "640 positions bit-identical", max_abs_diff=0.0))
    r = r.with_flag_verdict("fast_path", "exact", "env", "vllm-cpu-fp32",
                            FlagGateVerdict("bitwise_greedy", False, "1 of 64 differ", provisional=True,
                                            max_abs_diff=0.25))
    r = r.with_outcome(GateOutcome("gates/test_kl_panel.py::test_kl", "test_kl", "passed", "call"))
    r = r.with_outcome(GateOutcome("gates/test_needles.py::test_needles", "test_needles", "error", "setup",
                                   "EngineTransportError: connection reset"))
    r = r.with_timings(GateTimings({"gates/test_kl_panel.py::test_kl": 1.5}, {"gates/test_kl_panel.py": 1.5}))
    return r.with_section(ReportSection("Needles", [{"cell": "1k@50%", "found": True}], "note"))


def test_round_trip_keeps_every_typed_field(tmp_path):
    r = _full()
    r.save(tmp_path / "results.json")
    back = GateResults.load(tmp_path)                       # a results folder names its results.json
    assert back == r
    assert json.loads((tmp_path / "results.json").read_text())["format"] == FORMAT_VERSION
    assert back.gate("kl_panel").metrics["kl_part_max"] == math.inf      # a hard fail survives as a number
    assert back.gate("prefix_cache").passed is None
    assert not back.flag("fast_path").passed_all(("bitwise_panel", "bitwise_greedy"))
    assert back.flag("fast_path").cls == "exact"
    assert [o.nodeid for o in back.errored()] == ["gates/test_needles.py::test_needles"]


def test_a_later_entry_with_the_same_key_replaces_the_earlier_in_place():
    r = _full().with_gate(GateEntry("kl_panel", False, profile="vllm-cpu-fp32", failures=["kl too high"]))
    assert [g.gate for g in r.gates] == ["kl_panel", "prefix_cache"] and r.gate("kl_panel").passed is False
    # another profile's verdict of the same gate (the demo gates several) stands beside it
    r = r.with_gate(GateEntry("kl_panel", True, profile="sglang-cpu-fp32"))
    assert [(g.gate, g.profile) for g in r.gates][::2] == [("kl_panel", "vllm-cpu-fp32"), ("kl_panel", "sglang-cpu-fp32")]
    assert r.gate("kl_panel", "sglang-cpu-fp32").passed is True and r.gate("kl_panel").passed is False
    r = r.with_flag_verdict("fast_path", "exact", "env", "p", FlagGateVerdict("bitwise_greedy", True, "ok"))
    assert [v.gate for v in r.flag("fast_path").gates] == ["bitwise_panel", "bitwise_greedy"]
    assert r.flag("fast_path").passed_all(("bitwise_panel", "bitwise_greedy"))


@pytest.mark.parametrize("doc,found", [
    ({"kl_panel": {"passed": True}}, "no format tag (found top-level keys ['kl_panel'])"),
    ({"format": "ds41-record/1"}, "results format 'ds41-record/1', this harness reads 'ds41-results/1'"),
    ({"format": "ds41-results/0", "gates": []}, "results format 'ds41-results/0'"),
    ([1, 2], "not a ds41-results/1 results file: found a JSON list"),
])
def test_an_old_or_foreign_file_is_refused_naming_file_and_what_it_found(tmp_path, doc, found):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsError) as err:
        GateResults.load(path)
    assert str(path) in str(err.value) and found in str(err.value)


def _doc_with(**entry) -> str:
    data = json.loads(_full().to_json())
    data["gates"][0] = entry
    return json.dumps(data)


@pytest.mark.parametrize("entry,found", [
    ({"gate": "kl_panel", "pased": True}, "unknown key gates.0.pased; missing key gates.0.passed"),
    ({"gate": "kl_panel", "passed": 1}, "gates.0.passed: input should be a valid boolean, found 1"),
    ({"gate": "kl_panel", "passed": True, "metrics": {"kl": "0.1"}}, ("gates.0.metrics.kl: input should be a valid "
                                                                      "number, found '0.1'")),
    ({"gate": "kl_panel", "passed": True, "failures": "one"}, "gates.0.failures"),
])
def test_a_renamed_key_or_a_wrong_type_is_refused_naming_where(entry, found):
    with pytest.raises(ResultsError) as err:
        GateResults.from_json(_doc_with(**entry), where="run/results.json")
    assert str(err.value).startswith("run/results.json: not a ds41-results/1 results file: ")
    assert found in str(err.value)


def test_an_unknown_outcome_is_refused_and_the_flag_table_is_typed_too():
    data = json.loads(_full().to_json())
    data["outcomes"][0]["outcome"] = "PASS"
    with pytest.raises(ResultsError, match="outcomes.0.outcome"):
        GateResults.from_json(json.dumps(data))
    data = json.loads(_full().to_json())
    data["flag_ab"][0]["gates"][0]["ratio"] = "fast"
    with pytest.raises(ResultsError, match="flag_ab.0.gates.0.ratio"):
        GateResults.from_json(json.dumps(data))


def test_a_gate_building_a_wrong_entry_fails_at_once_not_at_load():
    with pytest.raises(ValueError):
        GateEntry("kl_panel", passed="yes")        # not a bool: the gate errors, no untyped file is written
    with pytest.raises(ValueError):
        GateEntry("kl_panel", True, metrics={"kl": "high"})


def test_secrets_are_redacted_in_the_file(monkeypatch, tmp_path):
    from core import redact

    monkeypatch.setattr(redact, "_registered", set())      # the canary stays out of the other tests' redaction
    redact.register_secret("sk-canary-123456")
    r = GateResults().with_gate(GateEntry("kl_panel", False, failures=["engine said sk-canary-123456"]))
    r.save(tmp_path / "results.json")
    assert "sk-canary-123456" not in (tmp_path / "results.json").read_text()
    assert GateResults.load(tmp_path).gate("kl_panel").failures[0].startswith("engine said ")


def test_headline_keeps_numbers_only():
    assert headline({"kl": 0.5, "n": 3, "ok": True, "why": "x", "none": None, "nan": math.nan, "inf": math.inf}) == \
        {"kl": 0.5, "n": 3.0, "inf": math.inf}

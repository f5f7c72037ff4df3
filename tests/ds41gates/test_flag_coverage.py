"""The coverage rule (issue 39): a flag whose mechanism a run never reached is NOT EXERCISED — never PASS — in
results.json and in the report, with the coverage table beside the verdicts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.coverage import coverage_of, encode
from core.flag_coverage import judge_flag, merge
from core.records import Record
from core.results import FlagCoverage, FlagGateVerdict, GateResults, ResultsError
from core.results_folder import ResultsFolder
from ds41gates import coverage as session_coverage
from ds41gates.pipeline import write_report
from ds41gates.pytest_plugin import GateRun
from nightly.flags import FlagRegistryError, load_registry, parse_registry
from tests.core.recordkit import provenance, random_logprobs, sequence_from_full

REGISTRY = {"flags": {
    "fused_indexer": {"description": "fused indexer kernel", "class": "numerics", "mechanisms": ["indexer_pruning"]},
    "window_kernel": {"description": "sliding-window kernel", "class": "numerics",
                      "mechanisms": ["window_full_evicting"]},
    "plain": {"description": "no mechanism declared", "class": "exact"},
}}


def _reference(length: int, masks_of, rng=None) -> Record:
    """An oracle record of one sequence of ``length`` tokens whose scored positions carry ``masks_of(pos)``."""
    rng = rng or np.random.default_rng(0)
    seq = sequence_from_full("s0", "code", rng.integers(0, 20, size=length), random_logprobs(rng, length - 1, 20), 4)
    seq.mechanisms = np.array([masks_of(p) for p in range(1, length)], dtype=np.int64)
    return Record.from_sequences(provenance("oracle"), [seq])


def test_the_rule_on_coverage_summaries():
    short = coverage_of(np.zeros(40, np.int64), np.arange(1, 41), np.full(40, 41))
    deep_pos = np.array([10, 200, 2100, 3000])
    deep = coverage_of(np.array([0, encode(["window_full_evicting"]), encode(["window_full_evicting",
                                 "indexer_pruning"]), encode(["indexer_pruning"])], np.int64), deep_pos,
                       np.full(4, 3001))
    v = judge_flag("fused_indexer", ["indexer_pruning"], short, ["dsv4-ci@1"])
    assert v.verdict == "not exercised" and v.missing == ("indexer_pruning",) and v.reached == ()
    assert "NOT EXERCISED" in v.why and "40 scored positions of dsv4-ci@1" in v.why
    both = merge([short, deep])
    assert both.total_scored == 44 and both.total_live["indexer_pruning"] == 2
    assert both.live["indexer_pruning"]["d2K-8K"] == 2 and both.scored["d0-128"] == 41
    v = judge_flag("fused_indexer", ["indexer_pruning"], both, ["dsv4-ci@1", "long@1"])
    assert v.verdict == "exercised" and v.reached == ("indexer_pruning",) and v.missing == ()
    # every declared mechanism must be reached: one missing is enough
    v = judge_flag("attn", ["indexer_pruning", "compressed_r128"], both)
    assert v.verdict == "not exercised" and v.missing == ("compressed_r128",) and v.reached == ("indexer_pruning",)
    assert judge_flag("plain", [], both).verdict == "not declared"
    # a run whose references state no mechanisms reached none of them
    v = judge_flag("fused_indexer", ["indexer_pruning"], None, unstated=["default@1"])
    assert v.verdict == "not exercised" and "default@1" in v.why
    assert merge([]) is None


def test_the_registry_declares_mechanisms_strictly():
    reg = parse_registry(REGISTRY, "unit")
    assert reg.get("fused_indexer").mechanisms == ("indexer_pruning",) and reg.get("plain").mechanisms == ()
    with pytest.raises(FlagRegistryError, match=r"\[flags.x\]: 'mechanisms' must name each of"):
        parse_registry({"flags": {"x": {"description": "d", "class": "exact", "mechanisms": ["indexer"]}}}, "unit")
    with pytest.raises(FlagRegistryError, match="must name each of"):
        parse_registry({"flags": {"x": {"description": "d", "class": "exact",
                                        "mechanisms": ["engram_lookup", "engram_lookup"]}}}, "unit")
    shipped = load_registry(["nightly/flags-vllm-cpu.toml"])
    assert shipped.get("VLLM_DS41_ATTENTION_COMPUTE").mechanisms == ("indexer_pruning", "compressed_r4")
    assert shipped.get("VLLM_DS41_ENGRAM_PREFETCH").mechanisms == ("engram_lookup",)
    assert shipped.get("VLLM_DS41_MARKOV_NVFP4").mechanisms == ("dspark_taps",)
    assert shipped.get("chunked_prefill_256").mechanisms == ("window_full_evicting", "compressed_r128")


def test_flag_coverage_round_trips_and_is_strict():
    res = GateResults().with_coverage(FlagCoverage("f", "not exercised", ("indexer_pruning",), (),
                                                   ("indexer_pruning",), ("dsv4-ci@1",), "NOT EXERCISED: ..."))
    back = GateResults.from_json(res.to_json())
    assert back.flag_coverage("f") == res.flag_coverage("f") and back.flag_coverage("g") is None
    bad = json.loads(res.to_json())
    bad["coverage"][0]["verdict"] = "passed"
    with pytest.raises(ResultsError, match="coverage.0.verdict"):
        GateResults.from_json(json.dumps(bad))
    # a results file written before coverage existed still reads (no coverage)
    old = json.loads(GateResults().to_json())
    del old["coverage"]
    assert GateResults.from_json(json.dumps(old)).coverage == ()


def test_a_short_run_leaves_a_long_context_flag_not_exercised_in_results_and_report(tmp_path):
    """A session scored only a short reference (positions < 128: no mechanism live) and A/B'd ``fused_indexer``,
    whose gates all passed: the flag is NOT EXERCISED in results.json (typed coverage, a failed flag_coverage entry,
    a failed coverage verdict in its A/B) and in the report's verdicts and coverage table. The same session with
    a reference past 2K where the indexer prunes exercises it."""
    reg = parse_registry(REGISTRY, "unit")
    short = _reference(60, lambda p: 0)
    run = GateRun(ResultsFolder.of(tmp_path))
    run.reference = short
    run.engines.append(("eng", short))
    run.add_flag_verdict("fused_indexer", "numerics", "", "p", FlagGateVerdict("kl_band", True, "within band"))
    session_coverage.add_reference(run, "short@1", short)                         # the session's engine
    session_coverage.add_reference(run, "short@1", short, arm="fused_indexer")    # the flag's on-arm
    verdicts = session_coverage.judge_session(run, reg, ab_flags=["fused_indexer", "plain", "unknown_flag"],
                                              profile="p")
    assert [v.verdict for v in verdicts] == ["not exercised", "not declared", "not declared"]

    saved = GateResults.load(tmp_path)
    cov = saved.flag_coverage("fused_indexer")
    assert cov.verdict == "not exercised" and cov.missing == ("indexer_pruning",)
    assert cov.sources == ("short@1 (flag fused_indexer on)",)
    entry = next(g for g in saved.gates if g.gate == "flag_coverage" and g.flag == "fused_indexer")
    assert entry.passed is False and "NOT EXERCISED" in entry.failures[0]
    # its kl_band PASS does not make the flag pass: the flag's aggregate is NOT EXERCISED, naming why
    agg = saved.flag_aggregate("fused_indexer", ["kl_band"])
    assert agg.verdict == "NOT EXERCISED" and not agg.passed
    assert agg.gates[-1].gate == "coverage" and agg.gates[-1].why.startswith("NOT EXERCISED")
    # a measured failure stands as FAIL
    failed = saved.with_flag_verdict("fused_indexer", "numerics", "", "p", FlagGateVerdict("kl_band", False, "x"))
    assert failed.flag_aggregate("fused_indexer", ["kl_band"]).verdict == "FAIL"
    assert saved.flag_coverage("unknown_flag").why.startswith("not in the flags registry")
    assert not [g for g in saved.gates if g.flag in ("plain", "unknown_flag")]

    paths = write_report(short, run.engines, tmp_path / "report", extra=run.report_sections,
                         coverage=saved.coverage)
    md = paths.markdown.read_text()
    verdict_line = next(line for line in md.splitlines() if line.startswith("| flag fused\\_indexer |"))
    assert "**NOT EXERCISED**" in verdict_line and "PASS" not in verdict_line
    assert session_coverage.COVERAGE_TITLE in md and session_coverage.FLAGS_TITLE in md
    assert "| indexer\\_pruning | 0/59 | 0/59 | 0/59 |" in md     # d0-128, last256 and total columns
    assert "| fused\\_indexer | NOT EXERCISED | indexer\\_pruning | indexer\\_pruning |" in md

    # a long reference where the indexer prunes past 2,048, scored on the flag's on-arm, exercises the flag
    long = _reference(2200, lambda p: encode(["indexer_pruning"]) if p >= 2048 else 0)
    run2 = GateRun(ResultsFolder.of(tmp_path / "long"))
    (tmp_path / "long").mkdir()
    session_coverage.add_reference(run2, "short@1", short, arm="fused_indexer")
    session_coverage.add_reference(run2, "long@1", long, arm="fused_indexer")
    (v,) = session_coverage.judge_session(run2, reg, ab_flags=["fused_indexer"])
    assert v.verdict == "exercised" and v.sources == ("short@1 (flag fused_indexer on)", "long@1 (flag fused_indexer on)")
    exercised = GateResults.load(tmp_path / "long")
    assert exercised.gate("flag_coverage").passed is True
    exercised = exercised.with_flag_verdict("fused_indexer", "numerics", "", "p", FlagGateVerdict("kl_band", True, "ok"))
    assert exercised.flag_aggregate("fused_indexer", ["kl_band"]).verdict == "PASS"
    assert session_coverage.COVERAGE_TITLE not in run2.report_sections     # the session's engine scored nothing
    table = run2.report_sections[session_coverage.coverage_title("fused_indexer")]["rows"]
    row = next(r for r in table if r["mechanism"] == "indexer_pruning")
    assert row["d2K-8K"] == "152/152" and row["d128-2K"] == "0/1920" and row["total"] == "152/2258"


def test_an_ab_flag_counts_only_its_own_on_arm(tmp_path):
    """The session's engine (flag off) scored long@1 past 2K and the flag's on-arm only the short panel: the
    off-arm's depth does not vouch for the flag's code, so the A/B flag is NOT EXERCISED, naming the arm rule; the
    same reference on the session's engine exercises an --engine-flag flag (its code ran there)."""
    reg = parse_registry(REGISTRY, "unit")
    short = _reference(60, lambda p: 0)
    long = _reference(2200, lambda p: encode(["indexer_pruning"]) if p >= 2048 else 0)
    run = GateRun(ResultsFolder.of(tmp_path))
    session_coverage.add_reference(run, "long@1", long)                          # the session's engine
    session_coverage.add_reference(run, "short@1", short, arm="fused_indexer")   # the flag's on-arm
    (ab,) = session_coverage.judge_session(run, reg, ab_flags=["fused_indexer"])
    assert ab.verdict == "not exercised" and ab.missing == ("indexer_pruning",)
    assert ab.sources == ("short@1 (flag fused_indexer on)",) and "flag-on arm" in ab.why

    run2 = GateRun(ResultsFolder.of(tmp_path / "engine-flag"))
    (tmp_path / "engine-flag").mkdir()
    session_coverage.add_reference(run2, "long@1", long)
    session_coverage.add_reference(run2, "short@1", short, arm="fused_indexer")
    (eng,) = session_coverage.judge_session(run2, reg, engine_flags=["fused_indexer"])
    assert eng.verdict == "exercised" and eng.sources == ("long@1",)

"""The generations file: a crash keeps finished problems, a torn last line is dropped, another run's file
is refused, and eval records round-trip with their provenance."""

from __future__ import annotations

import json

import pytest

from core.records import Provenance
from evals.compare import compare_records
from evals.records import EvalRecord, EvalRecordError, ProblemResult
from evals.run import EvalRunMismatch, GenerationStore

HEADER = {"suite": "humaneval", "data_sha256": "ab", "max_tokens": 64}


def test_finished_lines_survive_and_a_torn_tail_is_dropped(tmp_path):
    path = tmp_path / "g.jsonl"
    s = GenerationStore(path, HEADER)
    s.add({"id": "HumanEval/0", "reply": "a"})
    s.add({"id": "HumanEval/1", "reply": "b"})
    with open(path, "ab") as f:            # a crash in the middle of the third line
        f.write(b'{"id": "HumanEval/2", "re')
    again = GenerationStore(path, HEADER)
    assert sorted(again.done) == ["HumanEval/0", "HumanEval/1"]
    again.add({"id": "HumanEval/2", "reply": "c"})
    lines = path.read_text().splitlines()
    assert [json.loads(x).get("id") for x in lines] == [None, "HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_another_runs_file_is_refused(tmp_path):
    path = tmp_path / "g.jsonl"
    GenerationStore(path, HEADER).add({"id": "x", "reply": ""})
    with pytest.raises(EvalRunMismatch, match="max_tokens: 64 here, 128 asked"):
        GenerationStore(path, {**HEADER, "max_tokens": 128})


def _rec(outcomes, suite="humaneval", data="sha256:ab"):
    prov = Provenance(side="engine", panel_name=suite, panel_version="x", panel_hash=data, tokenizer_hash="t")
    return EvalRecord(suite, prov, [ProblemResult(f"HumanEval/{i}", 10, "stop", base=o) for i, o in enumerate(outcomes)])


def test_records_round_trip_and_pair(tmp_path):
    a = _rec([True] * 7 + [False] * 3)
    b = _rec([False] * 7 + [False] * 3)
    a.save(tmp_path / "a.json")
    back = EvalRecord.load(tmp_path / "a.json")
    assert back.scores() == {"pass@1 base": 0.7} and back.provenance == a.provenance
    c = compare_records(back, b, "a", "b")
    assert c.metrics[0].test.a_only == 7 and c.metrics[0].test.p_value == pytest.approx(2 / 128)


def test_unpairable_records_are_refused():
    with pytest.raises(EvalRecordError, match="different data"):
        compare_records(_rec([True]), _rec([True], data="sha256:cd"))
    with pytest.raises(EvalRecordError, match="different problems"):
        compare_records(_rec([True, True]), _rec([True]))

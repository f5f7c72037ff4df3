"""core/results_folder.py: the names of a run's files, the typed per_prompt.json, claiming and reading a folder."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from core import metrics
from core.errors import ResultsDirError, UnsafeNameError
from core.results_folder import RUN_LOCK, RUN_MARKER
from core.results import GateEntry, GateResults, ResultsError
from core.results_folder import (
    PER_PROMPT_FORMAT,
    PerPrompt,
    PerPromptError,
    PromptMeans,
    ResultsFolder,
    eval_record_name,
    generations_name,
)
from tests.core.recordkit import pair_of_records


# ================================================================================ names

def test_every_file_a_run_writes_is_named_inside_the_folder(tmp_path):
    f = ResultsFolder.of(tmp_path / "run")
    named = {f.results_file: "results.json", f.per_prompt_file: "per_prompt.json", f.junit_file: "junit.xml",
             f.pytest_log: "pytest.log", f.report_json: "report.json", f.report_markdown: "report.md",
             f.report_html: "report.html", f.needles_heatmap: "needles_heatmap.png",
             f.vision_tower_file: "vision_tower.json", f.vision_tower_work: "vision-tower-work",
             f.kernels_file: "kernels.json", f.kernels_work: "kernels-work",
             f.engine_bench_file: "engine_bench.json", f.engine_bench_plot: "engine_bench.png",
             f.evals_dir: "evals", f.localize_dir: "localize",
             f.localize_flag_dir("VLLM_DS41_HC_FUSED"): "localize-flag-VLLM_DS41_HC_FUSED",
             f.engine_record_file("vllm-cpu-fp32"): "engine-vllm-cpu-fp32.safetensors"}
    for path, name in named.items():
        assert path == tmp_path / "run" / name
    assert f.eval_record_file("humaneval+") == tmp_path / "run" / "evals" / "humanevalplus.eval.json"
    assert eval_record_name("ifeval") == "ifeval.eval.json"
    assert generations_name("humaneval+") == "humanevalplus.generations.jsonl"
    assert not (tmp_path / "run").exists()      # naming a file makes nothing


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", "", "/etc"])
def test_names_from_outside_never_leave_the_folder(tmp_path, bad):
    f = ResultsFolder.of(tmp_path)
    with pytest.raises(UnsafeNameError, match="engine label"):
        f.engine_record_file(bad)
    with pytest.raises(UnsafeNameError, match="flag"):
        f.localize_flag_dir(bad)
    with pytest.raises(UnsafeNameError, match="eval suite"):
        eval_record_name(bad)


# ================================================================================ per_prompt.json

def test_per_prompt_are_per_sequence_means_of_finite_unambiguous_kl():
    ref, eng, _ = pair_of_records(np.random.default_rng(2), n_seq=4, length=9, vocab=30, noise=0.4)
    out = PerPrompt.of(ref, [("e", eng)])
    assert out.format == PER_PROMPT_FORMAT and out.seq_ids == tuple(ref.seq_ids)
    assert out.domains == tuple(ref.domains)
    pm = metrics.position_metrics(ref, eng)
    for i, got in enumerate(out.engines["e"].kl_part):   # the mean over each sequence's positions, by hand
        vals = [k for k, s, amb in zip(pm.kl_part, pm.seq, pm.ambiguous) if s == i and np.isfinite(k) and not amb]
        assert got == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    assert out.engines["e"].hard_fails == int(np.sum(~np.isfinite(pm.kl_part)))


def test_a_prompt_with_no_finite_position_is_none_and_counts_its_hard_fails():
    ref, eng, _ = pair_of_records(np.random.default_rng(5), n_seq=2, length=6, vocab=20, noise=0.2)
    pm = metrics.position_metrics(ref, eng)
    # the engine gives probability 0 to every token it lists in sequence 1: every position there a hard fail
    eng.actual_logprob[eng.pos_seq == 1] = -np.inf
    eng.topk_logprobs[eng.pos_seq == 1] = -np.inf
    out = PerPrompt.of(ref, [("e", eng)])
    assert out.engines["e"].kl_part[1] is None and out.engines["e"].kl_part[0] is not None
    assert out.engines["e"].hard_fails == int(np.sum(eng.pos_seq == 1)) + int(np.sum(~np.isfinite(pm.kl_part)))


def test_per_prompt_round_trips_through_the_folder(tmp_path):
    ref, eng, _ = pair_of_records(np.random.default_rng(3), n_seq=3, length=7, vocab=25)
    folder = ResultsFolder.of(tmp_path)
    assert folder.read_per_prompt() is None                # the run wrote none
    written = PerPrompt.of(ref, [("a", eng), ("b", eng)])
    folder.write_per_prompt(written)
    assert folder.read_per_prompt() == written
    doc = json.loads(folder.per_prompt_file.read_text())
    assert doc["format"] == PER_PROMPT_FORMAT and sorted(doc["engines"]) == ["a", "b"]
    assert set(doc["engines"]["a"]) == {"kl_part", "hard_fails"}


@pytest.mark.parametrize("text, found", [
    ("not json", "not JSON"),
    ("[1]", "found a JSON list"),
    (json.dumps({"format": "ds41-per-prompt/0", "seq_ids": [], "domains": [], "engines": {}}), "format"),
    (json.dumps({"format": PER_PROMPT_FORMAT, "seq_ids": [], "domains": [], "engines": {}, "extra": 1}), "extra"),
    (json.dumps({"format": PER_PROMPT_FORMAT, "seq_ids": ["s"], "domains": ["d"],
                 "engines": {"e": {"kl_part": ["0.5"], "hard_fails": 0}}}), "engines.e.kl_part.0"),
    (json.dumps({"format": PER_PROMPT_FORMAT, "seq_ids": ["s"], "domains": ["d"],
                 "engines": {"e": {"kl_part": [0.5], "hard_fails": -1}}}), "engines.e.hard_fails"),
])
def test_a_bad_per_prompt_file_is_refused_naming_the_file_and_the_key(tmp_path, text, found):
    folder = ResultsFolder.of(tmp_path)
    folder.per_prompt_file.write_text(text)
    with pytest.raises(PerPromptError) as exc:
        folder.read_per_prompt()
    msg = str(exc.value)
    assert str(folder.per_prompt_file) in msg and found in msg and "\n" not in msg, msg


def test_prompt_means_are_strict():
    with pytest.raises(ValueError):
        PromptMeans(kl_part=(0.1,), hard_fails=True)        # a bool is not a count


# ================================================================================ claiming, reading a run

def test_claim_marks_and_locks_and_release_lets_go(tmp_path):
    folder = ResultsFolder.claim(tmp_path / "run")
    try:
        assert sorted(os.listdir(folder.path)) == [RUN_MARKER, RUN_LOCK]
        marker = folder.marker()
        assert marker is not None and marker.pid == os.getpid() and marker.format == "ds41-results-dir/1"
        folder.write_results(GateResults().with_gate(GateEntry("kl_panel", True)))
        with pytest.raises(ResultsDirError, match="--out .*already holds it"):
            ResultsFolder.claim(folder.path, replace=True, option="--out")
    finally:
        folder.release()
    again = ResultsFolder.claim(folder.path, replace=True)   # released: an earlier run's folder, cleared
    again.release()
    assert again.marker().run_id != marker.run_id and not again.results_file.exists()


def test_check_refuses_without_touching(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ResultsDirError, match="--out .*not empty.*--replace-results"):
        ResultsFolder.check(tmp_path, option="--out")
    with pytest.raises(ResultsDirError, match="no ds41-gates run marker"):
        ResultsFolder.check(tmp_path, replace=True)
    assert os.listdir(tmp_path) == ["keep.txt"]
    ResultsFolder.check(None)                                   # no folder given: nothing to check


def test_fresh_folders_are_new_each_time(tmp_path):
    a, b = ResultsFolder.fresh(tmp_path, stem="today"), ResultsFolder.fresh(tmp_path, stem="today")
    try:
        assert (a.path.name, b.path.name) == ("today", "today-2")
        assert a.marker() is not None and b.marker() is not None
    finally:
        a.release()
        b.release()
    assert ResultsFolder.claim_or_fresh(tmp_path / "given").path == tmp_path / "given"
    ResultsFolder.of(tmp_path / "given").release()


def test_reading_a_run_that_wrote_no_results_names_the_file(tmp_path):
    folder = ResultsFolder.of(tmp_path)
    with pytest.raises(ResultsError, match="results.json: no such results file"):
        folder.read_results()
    assert folder.marker() is None
    folder.write_results(GateResults().with_gate(GateEntry("kl_panel", False, failures=("too far",))))
    assert folder.read_results().gate("kl_panel").failures == ("too far",)


def test_engine_records_are_saved_and_loaded_by_label(tmp_path):
    ref, eng, _ = pair_of_records(np.random.default_rng(4), n_seq=2, length=6, vocab=20)
    folder = ResultsFolder.of(tmp_path)
    path = folder.save_engine_record("vllm-cpu-fp32", eng)
    assert path.name == "engine-vllm-cpu-fp32.safetensors"
    back = folder.load_engine_record("vllm-cpu-fp32")
    assert back.seq_ids == eng.seq_ids and np.array_equal(back.topk_logprobs, eng.topk_logprobs)


def test_a_folder_holds_a_run_when_it_has_results_or_a_marker_file(tmp_path):
    for sign in ("results.json", RUN_MARKER):
        folder = ResultsFolder.of(tmp_path / sign)
        folder.path.mkdir()
        assert not folder.holds_a_run()
        (folder.path / sign).write_text("anything")      # even a marker that marks nothing: not another tool's
        assert folder.holds_a_run()
    assert not ResultsFolder.of(tmp_path / "absent").holds_a_run()

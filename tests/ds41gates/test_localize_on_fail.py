"""--localize-on-fail's wiring (ds41gates/localize_plugin.py) without an engine: the worst prompt of the KL panel
gate is what gets localized, with the session's profile and flags (and no environment: a session carrying the
fault injector's variables is refused at configure), and the verdict, table and plot land in results.json and the
report."""

from __future__ import annotations

import numpy as np
import pytest

from core.localize import LocalizeRecord, decide, localize_sites
from core.records import Record
from core.results import GateResults
from core.results_folder import ResultsFolder
from ds41gates.localize_plugin import TITLE, localize_failed_gate
from ds41gates.pytest_plugin import GateRun
from tests.core.recordkit import provenance, random_logprobs, sequence_from_full


def _records():
    rng = np.random.default_rng(1)
    ref, eng = [], []
    for s, noise in enumerate((0.01, 1.5, 0.1)):   # s1 is the engine's worst prompt
        tokens = rng.integers(0, 40, size=10)
        p = random_logprobs(rng, 9, 40)
        q = p + rng.normal(size=p.shape) * noise
        q = q - np.log(np.exp(q).sum(1, keepdims=True))
        ref.append(sequence_from_full(f"s{s}", "a", tokens, p, 40))
        eng.append(sequence_from_full(f"s{s}", "a", tokens, q, 5))
    return Record.from_sequences(provenance("oracle"), ref), Record.from_sequences(provenance("engine"), eng)


def _fake_localize_record(n: int) -> LocalizeRecord:
    rng = np.random.default_rng(2)
    oracle = {f"{ph}/L{L}.{m}": rng.standard_normal((k, 8)) for ph, k in (("prefill", n), ("decode", 1))
              for L in range(3) for m in ("attn", "mlp", "resid")}
    floor = {k: v + 1e-7 * rng.standard_normal(v.shape) for k, v in oracle.items()}
    engine = {k: v * (1.01 if k.endswith(("L1.mlp", "L1.resid", "L2.attn", "L2.mlp", "L2.resid")) else 1.0)
              + 1e-7 * rng.standard_normal(v.shape) for k, v in oracle.items()}
    sites, per_pos, cal = localize_sites(engine, oracle, floor)
    return LocalizeRecord(engine={"profile": "vllm-cpu-fp32"}, oracle={"oracle": "oracle.hf", "precision": "fp32"},
                          floor={"precision": "fp64"}, calibration=cal, prompt={"n_tokens": n},
                          verdict=decide(sites, per_pos, list(range(n + 1))), sites=tuple(sites))


class _Config:
    def __init__(self, **opts):
        self.opts = {"--engine-profile": None, "--engine-url": None, "--engine-flag": [], **opts}

    def getoption(self, name):
        return self.opts[name]


def test_the_worst_prompt_is_localized_into_results_and_report(tmp_path):
    from ds41gates.pipeline import write_report

    ref, eng = _records()
    run = GateRun(folder=ResultsFolder.of(tmp_path))
    run.reference, run.engines = ref, [("vllm-cpu-fp32", eng)]
    seen = {}

    def runner(profile, ids, source, work, **kw):
        seen.update(profile=profile, ids=ids, source=source, **kw)
        return {"run": _fake_localize_record(len(ids))}

    entry = localize_failed_gate(_Config(**{"--engine-flag": ["no_prefix_cache", "no_prefix_cache"]}), run, runner)
    assert seen["profile"] == "vllm-cpu-fp32" and seen["source"]["seq_id"] == "s1" == entry.evidence["seq_id"]
    assert seen["ids"] == [int(t) for t in ref.token_ids[ref.seq_offsets[1]:ref.seq_offsets[2]]]
    # the profile and its flags, nothing from the session's environment
    assert seen["flags"] == ("no_prefix_cache",) and "engine_env" not in seen
    v = GateResults.load(tmp_path).gate("localize").evidence["verdict"]
    assert (v["first_divergent_layer"], v["first_divergent_module"]) == (1, "mlp")
    assert (tmp_path / "localize" / "localize.json").exists() and (tmp_path / "localize" / "localize.png").exists()
    assert TITLE in run.report_sections and "first divergent: L1.mlp" in run.report_sections[TITLE]["note"]
    paths = write_report(run.reference, run.engines, tmp_path, (), run.report_sections, plots=run.plots)
    html = paths.html.read_text()
    assert "Divergence localizer: s1" in html and TITLE in html


def test_without_a_profile_an_engine_url_is_not_localized_and_a_failure_is_reported(tmp_path):
    ref, eng = _records()
    run = GateRun(folder=ResultsFolder.of(tmp_path))
    run.reference, run.engines = ref, [("default", eng)]
    assert localize_failed_gate(_Config(**{"--engine-url": "http://h:1"}), run, lambda *a, **k: pytest.fail()) is None
    assert "not localized" in run.report_sections[TITLE]["note"]

    def broken(*a, **k):
        raise RuntimeError("engine died")

    assert localize_failed_gate(_Config(), run, broken) is None
    assert "engine died" in run.report_sections[TITLE]["note"]
    assert GateResults.load(tmp_path).gate("localize").failures[0].endswith("engine died")


def test_a_failed_flag_gate_is_localized_in_ab_mode_on_its_worst_prompt(tmp_path):
    """--localize-on-fail on a flag A/B gate: run_ab with that flag, on the prompt where flag-on is furthest from
    flag-off; the verdict lands in results.json (keyed by the flag) and the report."""
    from ds41gates.localize_plugin import FLAG_TITLE, localize_failed_flag

    off, on = _records()
    run = GateRun(folder=ResultsFolder.of(tmp_path))
    run.reference, run.engines = off, [("vllm-cpu-fp32", on)]
    seen = {}

    def runner(profile, ids, source, work, flags=()):
        seen.update(profile=profile, ids=ids, source=source, flags=flags)
        return {"flag": _fake_localize_record(len(ids))}

    entry = localize_failed_flag(_Config(**{"--engine-profile": "vllm-cpu-fp32"}), run, "kv_cache_2g", off, on,
                                 runner)
    assert seen["flags"] == ["kv_cache_2g"] and seen["source"]["seq_id"] == "s1" == entry.evidence["seq_id"]
    assert seen["ids"] == [int(t) for t in on.token_ids[on.seq_offsets[1]:on.seq_offsets[2]]]
    got = next(g for g in GateResults.load(tmp_path).gates if g.gate == "localize" and g.flag == "kv_cache_2g")
    assert got.evidence["verdict"]["site"] == "L1.mlp" and got.passed is None
    assert (tmp_path / "localize-flag-kv_cache_2g" / "localize.json").exists()
    assert "first divergent: L1.mlp" in run.report_sections[FLAG_TITLE.format(flag="kv_cache_2g")]["note"]
    assert localize_failed_flag(_Config(), run, "x", off, None, runner) is None   # no flag-on record: said so
    assert "not localized" in run.report_sections[FLAG_TITLE.format(flag="x")]["note"]


def test_a_session_carrying_the_fault_injectors_variables_is_refused_before_anything_is_localized(tmp_path):
    """The only way a planted fault could have reached --localize-on-fail was the session's own environment (the
    launched server inherited it). That route is closed: the gate session refuses to start, naming the variable,
    before any gate, engine or localizer runs (exit 4, pytest's usage error; no results folder written)."""
    import os
    import subprocess
    import sys

    from core.paths import repo_root

    env = {**os.environ, "DS41_PERTURB_LAYER": "3", "DS41_PERTURB_MODULE": "mlp"}
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "pytest", "gates/test_kl_panel.py", "-m", "gate",
                           "--localize-on-fail", "--results", str(out), "-p", "no:cacheprovider", "-q"],
                          cwd=str(repo_root()), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stdout + proc.stderr
    assert "DS41_PERTURB_LAYER='3'" in err and "ds41gate localize" in err and "unset DS41_PERTURB_LAYER" in err
    assert not out.exists()

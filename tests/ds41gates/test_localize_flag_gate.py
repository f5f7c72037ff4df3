"""`--localize-on-fail` on a real flag A/B gate that fails on a real engine (vLLM CPU, SmolLM2, vllm-cpu-fp32).

Flag ``dtype_bf16`` (nightly/flags-vllm-cpu.toml: ``--dtype bfloat16``, declared exact on purpose) changes every
logit, so its bitwise panel gate fails, as it must (docs/NIGHTLY.md). With ``--localize-on-fail`` the session then
localizes, in A/B mode, where the flag-on engine leaves the flag-off one on the gate's worst prompt: the base arm
(fp32) twice in one engine process, the flag arm (bf16) in its own, the oracle beside them. The first place a
bf16 engine differs from an fp32 one is the embedding (its table is held in bf16), and that is what must be named;
the verdict lands in results.json (entry ``localize`` keyed by the flag) and ``localize-flag-dtype_bf16/``.

A whole gate session in a child pytest (the flag A/B's two engine servers, then the localizer's two engine
processes): marker `long`, the nightly job runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.long]

FLAG = "dtype_bf16"


def test_a_failing_flag_gate_is_localized_on_the_real_engine(tmp_path):
    from core.localize import LocalizeRecord
    from core.paths import repo_root
    from core.results import GateResults

    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "pytest", "gates/test_flag_ab.py", "-m", "gate", "-k", "test_bitwise_panel",
           "--engine-profile", "vllm-cpu-fp32", "--flag-registry", "nightly/flags-vllm-cpu.toml", "--flag", FLAG,
           "--localize-on-fail", "--results", str(out), "-p", "no:cacheprovider", "-q"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS41_PERTURB_")}
    proc = subprocess.run(cmd, cwd=str(repo_root()), env=env, capture_output=True, text=True, timeout=3000)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 1, log                    # the gate failed (and nothing errored: that would be 1 too)
    res = GateResults.load(out)
    outcomes = {o.gate.split("[")[0]: o.outcome for o in res.outcomes}   # test_bitwise_panel[dtype_bf16]
    assert outcomes.get("test_bitwise_panel") == "failed", (outcomes, log)
    entry = next((g for g in res.gates if g.gate == "localize" and g.flag == FLAG), None)
    assert entry is not None and entry.passed is None and not entry.failures, (entry, log)
    v = entry.evidence["verdict"]
    assert (v["status"], v["site"], v["phase"], v["onset_position"]) == ("named", "embed", "prefill", 0), v
    rec = LocalizeRecord.load(out / f"localize-flag-{FLAG}" / "localize.json")
    assert rec.mode == "ab" and rec.engine["flags"] == [FLAG] and rec.engine["dtype"] == "bfloat16"
    assert rec.prompt["seq_id"] == entry.evidence["seq_id"] and rec.verdict.site == "embed"
    # the base arm is deterministic: its second run is the floor, zero everywhere
    assert all(s.floor_worst == 0.0 for s in rec.sites)
    assert (out / f"localize-flag-{FLAG}" / "localize.png").exists()

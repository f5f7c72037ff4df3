"""`ds41gate demo -p P` gates P's own model on P's own panel with P's own oracle, as the gate suite does
(before: always SmolLM2's panel and reference, so the DeepSeek-V4 server was judged against SmolLM2)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ds41gates import pipeline
from ds41gates.cli import app


class _Stop(Exception):
    pass


def test_demo_on_the_deepseek_profile_references_deepseek_with_its_panel(tmp_path, monkeypatch):
    seen = {}

    def reference(encoded, model_dir, top_k=pipeline.ORACLE_TOP_K, oracle="transformers", precision="fp32"):
        seen.update(panel=encoded.panel_name, oracle=oracle, model_dir=model_dir, precision=precision)
        raise _Stop   # what follows (the engine server) is the real gate session's, tested with the server

    monkeypatch.setattr(pipeline, "ensure_reference", reference)
    result = CliRunner().invoke(app, ["demo", "-p", "vllm-cpu-dsv4", "--out", str(tmp_path / "out")])
    assert isinstance(result.exception, _Stop), result.output
    from engine.target import resolve_gate_target

    plugin = resolve_gate_target("vllm-cpu-dsv4")   # what the plugin's gate_target fixture resolves
    assert seen == {"panel": plugin.encoded.panel_name, "oracle": plugin.oracle, "model_dir": plugin.model_dir,
                    "precision": plugin.precision}
    assert seen["panel"] == "dsv4-ci" and seen["oracle"] == "deepseek"


def test_demo_refuses_profiles_that_serve_different_models_before_any_work(tmp_path, monkeypatch):
    import engine.target

    monkeypatch.setattr(engine.target, "resolve_gate_target", lambda *a, **k: pytest.fail("work started"))
    result = CliRunner().invoke(app, ["demo", "-p", "vllm-cpu-fp32", "-p", "vllm-cpu-dsv4",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code != 0 and "gated on different targets" in str(result.exception)
    assert not (tmp_path / "out").exists()

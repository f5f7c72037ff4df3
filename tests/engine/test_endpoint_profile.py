"""engine.endpoint.launch_endpoint carries the typed Profile it is given (parsed once, by the caller) and describes
the server as it was started (its overrides included), on the launcher tests' real fake server."""

from __future__ import annotations

import json

import pytest

from engine.endpoint import launch_endpoint
from engine.profiles import load_profile
from tests.engine.test_launcher import _write_profile


def test_a_typed_profile_is_launched_without_parsing_it_again(tmp_path, monkeypatch):
    import engine.launcher
    import engine.profiles

    prof = load_profile(_write_profile(tmp_path, engine="vllm"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 77}))
    for module in (engine.launcher, engine.profiles):
        monkeypatch.setattr(module, "load_profile", lambda *a, **k: pytest.fail("the profile was parsed again"))
    server, endpoint = launch_endpoint(prof, model_dir, overrides={"engine": "sglang"})
    try:
        assert server.profile.name == prof.name and endpoint.base_url == server.base_url
        assert (endpoint.profile, endpoint.model, endpoint.vocab_size) == (prof.name, "fake", 77)
        # the endpoint describes the server as started (the override), not the profile before it
        assert endpoint.engine == "sglang" and prof.engine == "vllm"
    finally:
        server.stop()

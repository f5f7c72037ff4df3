"""Hardening, end to end: a real vLLM CPU server started from the shipped profile with ``--api-key``.

Before: the launcher's health probe (``/v1/models``) sent no key, so a key-protected start 401-ed for the
whole ``start_timeout_s`` (900 s) and then failed. Now the probe and the client send the server's own key,
and the key appears in nothing the harness writes or prints.
"""

from __future__ import annotations

import os
import time

import pytest

from core import metrics
from engine import launcher
from engine.endpoint import endpoint_for_server, score_engine
from engine.launcher import EngineServer
from engine.profiles import load_profile
from tests.reliability.helpers import RESUME_TOP_K, files_containing, http_status, smol_reference, smol_subset

pytestmark = [pytest.mark.engine]


@pytest.mark.timeout(1200)
def test_vllm_with_api_key_starts_scores_and_never_writes_the_key(tmp_path):
    venv = launcher._cache() / "venvs" / launcher.VLLM_VENV
    if not (venv / ".ds41-ready").exists():
        pytest.skip(f"{venv} not set up (scripts/setup-vllm.sh)")
    from engine.models import default_model_dir

    secret = "sk-ds41-" + os.urandom(16).hex()
    lines: list[str] = []
    prof = load_profile("vllm-cpu-fp32")
    # the profile's own health_url (/v1/models, which vLLM protects with the key) is kept on purpose
    srv = EngineServer(prof, flags=["enforce_eager"], echo=lines.append,
                       overrides={"extra_args": ["--api-key", secret], "start_timeout_s": 600,
                                  "log_file": str(tmp_path / "vllm.log")})
    t0 = time.monotonic()
    srv.start()
    try:
        start_s = time.monotonic() - t0
        statuses = {"none": http_status(srv.base_url + "/v1/models"), "wrong": http_status(srv.base_url + "/v1/models", "x"),
                    "right": http_status(srv.base_url + "/v1/models", secret)}
        endpoint = endpoint_for_server(srv, prof, default_model_dir(), flags=["enforce_eager"])
        rec = score_engine(endpoint, smol_subset(), 20)
        rec.save(tmp_path / "engine.safetensors")
    finally:
        srv.stop()
    assert statuses == {"none": 401, "wrong": 401, "right": 200}
    kl = metrics.panel_metrics(smol_reference(RESUME_TOP_K), rec, n_boot=100).overall.kl_part.mean
    assert kl < 1e-4, kl                                      # the fp32 engine matches the fp32 oracle
    assert any("healthy after" in ln for ln in lines)
    assert all(secret not in ln for ln in lines) and secret not in repr(endpoint)
    assert files_containing([tmp_path / "engine.safetensors"], secret) == []
    header = (tmp_path / "vllm.log").read_text(errors="replace").split("\n")[:3]
    assert not any(secret in ln for ln in header)            # the launcher's own lines
    print(f"vLLM --api-key start {start_s:.0f} s; /v1/models statuses {statuses}; KL_part mean {kl:.3g}; "
          f"key in the engine's own log: {secret in (tmp_path / 'vllm.log').read_text(errors='replace')}")

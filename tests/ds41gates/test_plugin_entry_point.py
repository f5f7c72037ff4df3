"""The gate plugins are `pytest11` entry points of the installed project: a pytest run anywhere in this environment
has them, exactly once, with or without ``-p ds41gates.pytest_plugin`` (which names the same plugin)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PLUGINS = ("ds41gates.pytest_plugin", "ds41gates.localize_plugin")
TEST = "def test_uses_the_fixture(gate_session, gate_run):\n    assert gate_run is gate_session.run\n"


@pytest.mark.parametrize("extra", [(), ("-p", "ds41gates.pytest_plugin")], ids=["entry point", "and -p"])
def test_the_plugins_load_once_outside_the_checkout(tmp_path, extra):
    (tmp_path / "test_outside.py").write_text(TEST)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--trace-config", "-q", "-p", "no:cacheprovider", *extra,
                           "--results", str(tmp_path / "results"), str(tmp_path / "test_outside.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for name in PLUGINS:
        assert out.count(f"PLUGIN registered: <module '{name}'") == 1, out[-3000:]
    assert out.count("PLUGIN registered: <ds41gates.pytest_plugin.GateSession") == 1, out[-3000:]

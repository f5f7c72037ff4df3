"""`pytest -m gate` from the project root collects the gate suite (README); `pytest` alone stays on tests/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _collected(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [ln for ln in proc.stdout.splitlines() if "::" in ln]


def test_marker_gate_without_paths_collects_the_gate_suite():
    ids = _collected("-m", "gate")
    assert ids and all(i.startswith("gates/") for i in ids), ids[:5]
    assert {i.split("::")[0] for i in ids} >= {"gates/test_kl_panel.py", "gates/test_prefix_cache.py"}


def test_named_paths_are_kept_with_marker_gate():
    ids = _collected("-m", "gate", "gates/test_prefix_cache.py")
    assert ids and all(i.startswith("gates/test_prefix_cache.py::") for i in ids), ids[:5]

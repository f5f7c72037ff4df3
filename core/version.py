"""The harness's own version, stamped into every record's provenance."""

from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from pathlib import Path


@functools.cache
def code_version() -> str:
    """``ds41-gates <version>`` plus ``+g<commit>`` when the code runs from a git checkout."""
    try:
        ver = importlib.metadata.version("ds41-gates")
    except importlib.metadata.PackageNotFoundError:
        ver = "unknown"
    commit = ""
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            commit = "+g" + out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return f"ds41-gates {ver}{commit}"

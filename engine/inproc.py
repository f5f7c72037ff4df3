"""The one command line of the in-process runners (engine/kernels/runner.py, engine/vision_tower_runner.py,
engine/localize_runner.py). Each runs in the ENGINE's interpreter — the vLLM venv, started by the harness as
``python -m engine.<runner> request.json`` — reads one JSON request and writes its JSON report where the request
says. Standard library only: nothing of the harness (pydantic, core's records) is importable there.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def write_report(report: Mapping[str, Any], path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)


def request_main(run: Callable[[dict], Any], module: str, env_defaults: Mapping[str, str] = {},
                 argv: Sequence[str] | None = None) -> int:
    """``python -m <module> request.json``: the engine's environment defaults set (before vLLM is imported by
    ``run``), then ``run(request)``; a wrong command line is exit 2 with the usage."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1:
        print(f"usage: python -m {module} request.json", file=sys.stderr)
        return 2
    for key, value in env_defaults.items():
        os.environ.setdefault(key, value)
    with open(argv[0]) as fh:
        run(json.load(fh))
    return 0

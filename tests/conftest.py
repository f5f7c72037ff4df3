"""Fixtures shared by the tests of several packages (each package's own fixtures stay in its folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """`tiny_checkpoint(seed=0)` → a generated DeepSeek-V4.1 tiny checkpoint (§20.1), written once per seed
    per session. Shared and read-only: a test that damages a checkpoint copies it first."""
    from oracle.dsv41.tiny import write_tiny_checkpoint

    made: dict[int, Path] = {}

    def get(seed: int = 0) -> Path:
        if seed not in made:
            made[seed] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"dsv41-tiny-{seed}") / "tiny", seed=seed)
        return made[seed]

    return get

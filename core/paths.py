"""Where large artefacts live: outside the checkout, so fresh clones on the same machine reuse them."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$DS41_CACHE, else ~/.cache/ds41-gates."""
    root = os.environ.get("DS41_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ds41-gates")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent

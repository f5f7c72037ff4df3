"""Where large artefacts live (outside the checkout, so fresh clones on the same machine reuse them) and the one
check for names that become file names. A run's results folder is core/results_folder.py's."""

from __future__ import annotations

import os
import re
from pathlib import Path

from core.errors import UnsafeNameError


def cache_dir() -> Path:
    """$DS41_CACHE, else ~/.cache/ds41-gates."""
    root = os.environ.get("DS41_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ds41-gates")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ names

SAFE_NAME_MAX = 128
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+@=-]*")
SAFE_NAME_RULE = (f"letters, digits and . _ + @ = - only, starting with a letter or digit, no '..', "
                  f"at most {SAFE_NAME_MAX} characters")


def safe_name(value: object, what: str) -> str:
    """`value` unchanged when it can be used as one file or folder name, else UnsafeNameError naming `what`.

    Every name that becomes part of a path (profile, nightly run and cell, panel, engine label) goes through
    here once, so a `../x` or `a/b` never leaves the folder it is meant to live in."""
    if (not isinstance(value, str) or len(value) > SAFE_NAME_MAX or not _SAFE_NAME.fullmatch(value)
            or ".." in value):
        raise UnsafeNameError(f"{what} {value!r} is not a safe name ({SAFE_NAME_RULE}): it becomes a file name")
    return value

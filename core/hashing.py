"""The SHA-256 of a file: the one helper every pin, cache check and manifest uses."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path | str) -> str:
    """Hex SHA-256 of the file's bytes, read in chunks by ``hashlib.file_digest`` (never the whole file in memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()

"""Reading one TOML file with an error that names the file and what it was meant to be."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any


def read_toml(path: str | os.PathLike, what: str, error: type[Exception]) -> dict[str, Any]:
    """Parse ``path``; a missing or malformed file raises ``error`` naming ``what`` and the path."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{what} {p} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise error(f"{what} {p}: cannot read ({exc})") from None

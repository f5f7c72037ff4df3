"""Reading one TOML file with an error that names the file and what it was meant to be."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any


def read_toml(path: str | os.PathLike, what: str, error: type[Exception]) -> dict[str, Any]:
    """Parse ``path``; a missing or malformed file raises ``error`` whose message starts with the path (the
    house form of a user error: where, then what)."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{p}: {what} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise error(f"{p}: cannot read {what} ({exc})") from None

"""Reading one TOML file with an error that names the file and what it was meant to be.

The one TOML reader of the project: every config file goes through ``read_toml`` (and into its schema through
core/schema.read_model), so a missing, undecodable or malformed file reads the same everywhere."""

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
    except UnicodeDecodeError as exc:
        raise error(f"{p}: cannot read {what}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{p}: cannot read {what}: not valid TOML ({exc})") from None
    except OSError as exc:
        raise error(f"{p}: cannot read {what} ({exc.strerror or exc})") from None

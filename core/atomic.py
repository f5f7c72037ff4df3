"""Atomic writes: a file is either its old content or its complete new content, never half of one.

Every file the harness writes that a later run reads (records, results, reports, caches) goes through
here: written to a temp file in the same folder, flushed and fsynced, then renamed over the target,
and the folder fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable (a no-op where the OS cannot open folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".partial") -> Iterator[Path]:
    """Yield a temp path beside `path`; on a clean exit it is fsynced and renamed onto `path`.

    On an exception the temp file is removed and the target is left as it was.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}{suffix}")
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """JSON with sorted keys and 2-space indent; values JSON cannot hold are written as their str()."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str))

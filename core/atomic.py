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


# ------------------------------------------------------------------------------------------ sets of files

def _sha256(data: bytes) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_folder(folder: Path, error: type[Exception], what: str) -> None:
    """Create `folder` with its parents; a path that is a file, or runs through one, is `error` naming `what`.
    Any other OSError (a full disk, no permission) is left to the caller."""
    if folder.exists() and not folder.is_dir():
        raise error(f"{what}: exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise error(f"{what}: a part of the path is a file, not a folder") from None


def write_file_set(folder: str | os.PathLike, files: dict[str, bytes], manifest: str) -> Path:
    """Write several files that are only meaningful together (report.json / .md / .html) as one unit.

    1. every file is written in full to a temp file beside its target and fsynced; if any write fails (a full
       disk), the temps are removed and the folder is exactly as it was: the old set with its manifest;
    2. the old manifest is removed, the temps are renamed onto their targets;
    3. the manifest (name, size and sha256 of each file) is written last, atomically.

    So the folder holds either the old complete set, or the new complete set, or (a crash inside step 2 only)
    files without a manifest, which `check_file_set` reports as incomplete. A failure raises
    core.errors.OutputWriteError naming the folder and the file; returns the manifest's path."""
    from core.errors import OutputWriteError

    target = Path(folder)
    try:
        make_folder(target, OutputWriteError, str(target))
    except OutputWriteError:
        raise
    except OSError as exc:
        raise OutputWriteError(f"{target}: cannot create the folder ({exc.strerror or exc})") from None
    staged: list[tuple[Path, Path]] = []
    name, committing = "", False
    try:
        for name, data in files.items():
            final = target / name
            tmp = final.with_name(f".{name}.{os.getpid()}.partial")
            staged.append((tmp, final))
            tmp.write_bytes(data)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        committing = True
        name = manifest
        with contextlib.suppress(FileNotFoundError):
            (target / manifest).unlink()
        for tmp, final in staged:
            name = final.name
            os.replace(tmp, final)
        name = manifest
        doc = {"format": "ds41-file-set/1",
               "files": {n: {"bytes": len(d), "sha256": _sha256(d)} for n, d in files.items()}}
        atomic_write_text(target / manifest, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
        left = (f"the folder holds no complete set now ({manifest} missing)" if committing
                else "nothing was replaced: the previous set, if any, is unchanged")
        err = OutputWriteError(f"{target}: cannot write {name} ({exc.strerror or exc}); {left}")
        err.errno = exc.errno
        raise err from None
    fsync_dir(target)
    return target / manifest


def check_file_set(folder: str | os.PathLike, manifest: str) -> list[str]:
    """Why the set in `folder` is not one complete set ([] when it is): no manifest, a file missing, or a file
    whose size or sha256 differs from the manifest's (a mixed or torn set)."""
    target = Path(folder)
    try:
        doc = json.loads((target / manifest).read_text(encoding="utf-8"))
        entries = doc["files"]
        if not isinstance(entries, dict):
            raise TypeError("files is not a table")
    except FileNotFoundError:
        return [f"{target / manifest}: missing (the set was never completed)"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{target / manifest}: unreadable ({exc})"]
    problems = []
    for name, want in entries.items():
        try:
            data = (target / name).read_bytes()
        except OSError as exc:
            problems.append(f"{target / name}: {exc.strerror or exc}")
            continue
        if not isinstance(want, dict) or want.get("bytes") != len(data) or want.get("sha256") != _sha256(data):
            problems.append(f"{target / name}: does not match {manifest} (a file of another set)")
    return problems

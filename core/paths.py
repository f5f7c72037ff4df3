"""Where large artefacts live (outside the checkout, so fresh clones on the same machine reuse them), the one
check for names that become file names, and the one way a run claims its results folder."""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from filelock import FileLock, Timeout

from core.atomic import make_folder
from core.errors import ResultsDirError, UnsafeNameError


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


# ------------------------------------------------------------------------------------------ results folders

RUN_MARKER = ".ds41-results"            # written by the harness when it claims a folder: {format, run_id, ...}
RUN_LOCK = ".ds41-results.lock"         # held (filelock) for as long as the run that claimed the folder lives
MARKER_FORMAT = "ds41-results-dir/1"
# the locks this process holds, by folder: released by `release_results_dir` (or when the process ends)
_HELD: dict[Path, FileLock] = {}


def _describe(entries: list[str]) -> str:
    shown = sorted(entries)[:5]
    return ", ".join(shown) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


def read_marker(folder: Path) -> dict | None:
    """The run marker of `folder` when it is one the harness wrote (a plain file, a JSON object of
    MARKER_FORMAT with a run id), else None: a file merely named like it marks nothing."""
    marker = folder / RUN_MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        doc = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT or not isinstance(doc.get("run_id"), str):
        return None
    return doc


def _holder(folder: Path) -> str:
    doc = read_marker(folder)
    if doc is None:
        return "a run that has not written its marker yet"
    return (f"run {doc.get('run_id')} (pid {doc.get('pid')} on {doc.get('host')}, since "
            f"{doc.get('created')})")


def _lock(folder: Path, option: str) -> None:
    """Take this folder's run lock without waiting; held by another live run: ResultsDirError naming it."""
    folder = folder.resolve()
    if folder in _HELD:
        raise ResultsDirError(f"{option} {folder}: this process already holds it for another run")
    lock = FileLock(folder / RUN_LOCK, timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        raise ResultsDirError(f"{option} {folder}: in use by {_holder(folder)}; a results folder holds one run "
                              "at a time — wait for it to finish, or choose another folder") from None
    _HELD[folder] = lock


def release_results_dir(folder: str | os.PathLike) -> None:
    """Let go of the run lock this process took on `folder` (a no-op when it holds none)."""
    lock = _HELD.pop(Path(folder).resolve(), None)
    if lock is not None:
        lock.release(force=True)


def claim_results_dir(path: str | os.PathLike, *, replace: bool = False, option: str = "--results",
                      replace_option: str = "--replace-results") -> Path:
    """Make `path` the folder of exactly one run, locked for this process, and return it.

    Absent: created. Empty: used. Holding anything: refused (ResultsDirError) unless `replace`, and then only
    when it carries the run marker a harness run wrote when it claimed it (a folder merely holding a
    results.json or report.json — a checkout, `.git/` — is never cleared); its contents are removed first, so
    no file of the earlier run (a PASS report beside this run's ERROR) survives. The folder's run lock (a
    filelock) is taken before anything is removed and held until `release_results_dir` or the end of the
    process, so a second run on the same folder, with or without `replace`, is refused naming the holder.
    Call this only after the run's own inputs are checked: a run that stops on a bad input clears nothing."""
    folder = Path(path)
    make_folder(folder, ResultsDirError, f"{option} {folder}")
    if RUN_LOCK not in os.listdir(folder):      # not yet a run's folder: refused before a lock file is made in it
        _refuse_unless_claimable(folder, os.listdir(folder), replace, option, replace_option)
    _lock(folder, option)                        # a run still holding it is named, with or without `replace`
    try:
        entries = [e for e in os.listdir(folder) if e != RUN_LOCK]
        _refuse_unless_claimable(folder, entries, replace, option, replace_option)  # again, now that it is ours
        for entry in entries:
            p = folder / entry
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        _write_marker(folder, option)
    except BaseException:
        release_results_dir(folder)
        raise
    return folder


def check_results_dir(path: str | os.PathLike | None, *, replace: bool = False, option: str = "--results",
                      replace_option: str = "--replace-results") -> None:
    """`claim_results_dir`'s refusals without touching anything (no folder made, nothing cleared, no lock): a
    caller whose inputs take a while to check refuses a reused folder before that work, and claims it after."""
    if path is None:
        return
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ResultsDirError(f"{option} {folder}: exists and is not a folder")
    if folder.is_dir():
        _refuse_unless_claimable(folder, os.listdir(folder), replace, option, replace_option)


def _refuse_unless_claimable(folder: Path, entries: list[str], replace: bool, option: str,
                             replace_option: str) -> None:
    entries = [e for e in entries if e != RUN_LOCK]
    if not entries:
        return
    if not replace:
        raise ResultsDirError(
            f"{option} {folder}: folder is not empty ({_describe(entries)}); a results folder holds one run — "
            f"choose a new folder, or pass {replace_option} to clear it first")
    if read_marker(folder) is None:
        raise ResultsDirError(
            f"{option} {folder}: folder is not empty and carries no ds41-gates run marker ({RUN_MARKER}); "
            f"{replace_option} clears only a folder an earlier run claimed — refusing to clear it")


def _write_marker(folder: Path, option: str) -> None:
    try:
        fd = os.open(folder / RUN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ResultsDirError(f"{option} {folder}: another run claimed this folder at the same time") from None
    with os.fdopen(fd, "w") as fh:
        json.dump({"format": MARKER_FORMAT, "run_id": uuid.uuid4().hex[:12], "pid": os.getpid(),
                   "host": socket.gethostname(),
                   "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}, fh)
        fh.flush()
        os.fsync(fh.fileno())


def fresh_results_dir(root: str | os.PathLike = "results", stem: str | None = None) -> Path:
    """A new folder `root/<stem or timestamp>[-N]` that no other run has used (created exclusively)."""
    base = Path(root)
    stem = stem or _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        folder = base / (stem if n == 1 else f"{stem}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            n += 1
            continue
        _lock(folder, "results folder")
        _write_marker(folder, "results folder")
        return folder

"""Where large artefacts live (outside the checkout, so fresh clones on the same machine reuse them), the one
check for names that become file names, and the one way a run claims its results folder."""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
from pathlib import Path

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

RUN_MARKER = ".ds41-results"
# files whose presence says "this folder is (or was) a ds41-gates results folder": only such a folder is
# ever cleared for --replace-results, so a typo (--results ~) cannot empty a home folder
_RESULTS_SIGNS = (RUN_MARKER, "results.json", "report.json", "report.manifest.json", "nightly.json")


def _describe(entries: list[str]) -> str:
    shown = sorted(entries)[:5]
    return ", ".join(shown) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


def claim_results_dir(path: str | os.PathLike, *, replace: bool = False, option: str = "--results",
                      replace_option: str = "--replace-results") -> Path:
    """Make `path` the folder of exactly one run and return it.

    Absent: created. Empty: used. Holding anything: refused (ResultsDirError) unless `replace`, and then only
    when it looks like a results folder (one of results.json, report.json, …, or the run marker); its contents
    are removed first, so no file of the earlier run (a PASS report beside this run's ERROR) survives. The run
    marker is created exclusively, so two runs started on one folder cannot both claim it."""
    folder = Path(path)
    make_folder(folder, ResultsDirError, f"{option} {folder}")
    entries = os.listdir(folder)
    if entries:
        if not replace:
            raise ResultsDirError(
                f"{option} {folder}: folder is not empty ({_describe(entries)}); a results folder holds one run — "
                f"choose a new folder, or pass {replace_option} to clear it first")
        if not any(e in _RESULTS_SIGNS for e in entries):
            raise ResultsDirError(
                f"{option} {folder}: folder is not empty and does not look like a results folder (no results.json, "
                f"report.json or {RUN_MARKER}); refusing to clear it with {replace_option}")
        for entry in entries:
            p = folder / entry
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    _write_marker(folder, option)
    return folder


def _write_marker(folder: Path, option: str) -> None:
    try:
        fd = os.open(folder / RUN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ResultsDirError(f"{option} {folder}: another run claimed this folder at the same time") from None
    with os.fdopen(fd, "w") as fh:
        json.dump({"format": "ds41-results-dir/1", "pid": os.getpid(),
                   "claimed": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}, fh)


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
        _write_marker(folder, "results folder")
        return folder

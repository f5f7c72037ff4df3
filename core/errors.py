"""The one base class of every error caused by what the user gave (a file, an option, a URL).

A `UserError` is reported as ONE line naming what and where, exit code 2 (ds41gates/cli.py has the one
handler); anything else that escapes is a bug of the harness and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A bad input: the message names the input (file, key, option) and what is allowed."""


def one_line(exc: BaseException) -> str:
    """The first line of an error's message (multi-line details stay in the log, not on the terminal)."""
    text = str(exc).strip() or type(exc).__name__
    return text.split("\n")[0].rstrip("\r")


class UnsafeNameError(UserError, ValueError):
    """A name that becomes a file or folder name (profile, nightly run or cell, panel, engine label) is not a
    plain name: it holds a path separator, `..`, or a character outside the safe set (core.paths.safe_name)."""


class ResultsDirError(UserError):
    """A results folder cannot hold this run: it holds another run's files (and replacing was not asked for),
    it is not a folder, or it does not look like a results folder and so will not be cleared."""


class OutputWriteError(UserError, OSError):
    """A set of output files (report.json/.md/.html) could not be written as a whole (a full disk, a read-only
    folder); the message names the folder and says what was left there. Being an OSError too, code that
    catches OSError keeps working."""

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

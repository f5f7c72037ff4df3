"""The harness's voice on the terminal: one status-line printer and one progress display, both on stderr.

stdout stays for what a command returns (a URL, JSON, a table); everything said along the way goes to stderr,
so a caller that pipes a command's output never reads a progress bar or a status line in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn

PREFIX = "[bold cyan]ds41[/]"


def echo(msg: str) -> None:
    """One status line on stderr, prefixed ``ds41``; rich markup in ``msg`` is rendered, numbers are not highlighted."""
    Console(stderr=True).print(f"{PREFIX} {msg}", highlight=False)


def progress(enabled: bool = True, *, transient: bool = False) -> Progress:
    """The one progress display (rich): description, bar, n/total, elapsed, remaining. Disabled, it is rich's
    own no-op display (tasks are still counted, nothing is drawn), so callers need no second code path."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=transient, disable=not enabled)


@contextmanager
def counting(label: str, total: int, *, enabled: bool = True, done: int = 0,
             transient: bool = False) -> Iterator[Callable[[], None]]:
    """One bar of ``total`` items (``done`` of them already done, e.g. on resume); yields ``advance()``."""
    with progress(enabled, transient=transient) as display:
        task = display.add_task(label, total=total, completed=done)
        yield lambda: display.advance(task)


class StagedProgress:
    """Two bars for work done in stages over the same items: stages done of all, and items done in this stage.
    ``begin(name, stages_done)`` starts a stage, ``step()`` counts one item, ``close()`` ends the display."""

    def __init__(self, enabled: bool, n_stages: int, n_items: int, *, label: str = "stages"):
        self._display = progress(enabled)
        self._display.start()
        self._stages: TaskID = self._display.add_task(label, total=n_stages)
        self._items: TaskID = self._display.add_task("", total=n_items)

    def begin(self, name: str, stages_done: int) -> None:
        self._display.update(self._stages, completed=stages_done)
        self._display.reset(self._items, description=name)

    def step(self) -> None:
        self._display.advance(self._items)

    def close(self) -> None:
        self._display.update(self._stages, completed=self._display.tasks[0].total)
        self._display.stop()

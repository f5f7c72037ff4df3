"""Process-group supervision for engine servers: ports, stopping a whole group, log tails, and the safety net.

Every server runs in a new session, so its process group holds it and every child it forks. Stopping sends
SIGTERM to the whole group, then SIGKILL after a grace period, and waits until no process of the group is
left (``stop_group``). The servers a process started are tracked here until stopped; an atexit hook and a
SIGTERM/SIGHUP handler (installed only where none was set) stop any still running when the interpreter goes
away (``stop_all``).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil

from core.redact import redact

LOG_TAIL_BYTES = 6000


class EngineStopError(RuntimeError):
    """Processes of the server's group survived SIGKILL."""


class Stoppable(Protocol):
    def stop(self, grace_s: float | None = None) -> None: ...


# ---------------------------------------------------------------------------------- ports


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


# ---------------------------------------------------------------------------------- process groups


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out: list[int] = []
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            continue
        try:
            if os.getpgid(proc.pid) == pgid:   # psutil has no process-group field; the kernel answers per pid
                out.append(proc.pid)
        except ProcessLookupError:             # gone between the listing and the question
            continue
    return out


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def wait_group_empty(proc: subprocess.Popen[bytes], pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()  # reap the leader so it does not linger as a zombie
        if not group_members(pgid):
            proc.poll()
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float, name: str, echo: Callable[[str], None]) -> None:
    """SIGTERM the whole process group of ``proc`` (started with start_new_session=True), SIGKILL after
    ``grace_s``, and wait until it is empty; EngineStopError if any process survives SIGKILL."""
    pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
    signal_group(pgid, signal.SIGTERM)
    if not wait_group_empty(proc, pgid, grace_s):
        echo(f"{name}: group {pgid} still alive after {grace_s:.0f} s; SIGKILL")
        signal_group(pgid, signal.SIGKILL)
        if not wait_group_empty(proc, pgid, 10.0):
            raise EngineStopError(
                f"engine {name!r}: processes {group_members(pgid)} of group {pgid} survived SIGKILL"
            )


def log_tail(path: Path, nbytes: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - nbytes))
            data = fh.read()
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"
    text = redact(data.decode(errors="replace"))   # the engine may log its own arguments, --api-key included
    return ("...\n" if size > nbytes else "") + text


# ---------------------------------------------------------------------------------- the servers still running

_live: dict[int, Stoppable] = {}
_live_lock = threading.RLock()  # re-entrant: the SIGTERM handler may run while it is held
_hooks_installed = False
_previous_handlers: dict[int, Any] = {}


def track(pid: int, server: Stoppable) -> None:
    """Remember a started server (by its leader's pid) until ``untrack``."""
    with _live_lock:
        _live[pid] = server


def is_tracked(pid: int, server: Stoppable) -> bool:
    with _live_lock:
        return _live.get(pid) is server


def untrack(pid: int) -> None:
    with _live_lock:
        _live.pop(pid, None)


def stop_all(grace_s: float | None = None) -> None:
    """Stop every server this process started and has not stopped yet."""
    with _live_lock:
        servers = list(_live.values())
    for server in servers:
        try:
            server.stop(grace_s=grace_s)
        except Exception as exc:  # keep stopping the others; say what failed
            spec = getattr(server, "spec", None)
            print(f"[engine.launcher] stopping {spec.profile if spec else '?'}: {exc}", file=sys.stderr)


def _on_fatal_signal(signum: int, frame: Any) -> None:
    stop_all(grace_s=5.0)
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    else:
        os.kill(os.getpid(), signum)


def install_safety_net() -> None:
    """Before the first server starts: stop_all at exit and on SIGTERM/SIGHUP (where no handler was set)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(stop_all, 5.0)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, None):
            _previous_handlers[sig] = current
            signal.signal(sig, _on_fatal_signal)

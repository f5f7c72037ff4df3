"""Run untrusted Python (code written by the model under test) in a bubblewrap sandbox, never in the
harness process.

The boundary (docs/EVALS.md, "The sandbox"):

* namespaces (bubblewrap ``--unshare-all``): no network (a fresh net namespace has no route), its own
  PID namespace (the harness and every other host process are invisible, so ``os.kill`` of the parent
  reaches only the sandbox's own init and ends the sandbox), own IPC/UTS/cgroup/user namespaces;
* file system: ``/usr`` read-only (the system interpreter and its standard library), the root
  read-only, one size-capped tmpfs as the only writable place (``/sandbox``, with ``/tmp`` a link to it:
  `Limits.disk_mb` in all, so many files cannot add up past it either), the program and its files bound
  into it read-only; the harness checkout, the cache and ``/root`` are not mounted at all;
* rlimits set before bubblewrap starts (inherited, hard = soft, unraisable without capabilities):
  CPU seconds, address space, file size, and the number of processes. As root the sandbox runs under an
  unprivileged uid of its own, because the kernel never applies RLIMIT_NPROC to uid 0;
* a wall-clock deadline enforced here: the whole process group is killed when it passes;
* an empty environment: bubblewrap itself is started with only ``SANDBOX_ENV`` (the sandbox's init is the
  ``bwrap`` process, whose ``/proc/1/environ`` the code can read, so ``--clearenv`` alone is not enough);
* output read with a cap (`Limits.output_mb` per stream, of bytes not yet taken by the harness): past it
  the stream is cut and marked, the process killed, and nothing more is buffered.

Why bubblewrap rather than Landlock (PyPI ``sandlock``): Landlock restricts files (and TCP on ABI 4+)
but not processes or signals, and needs a kernel that enables it; namespaces give the PID and network
isolation directly and bubblewrap is one Debian package (``apt-get install bubblewrap``, done by
scripts/setup-evals.sh).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from core.errors import UserError

SANDBOX_PYTHON = "/usr/bin/python3"     # the system interpreter: lives in /usr, the one tree mounted
# The whole environment bubblewrap (and so the sandbox's init, /proc/1) starts with: nothing of the harness's.
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
TRUNCATED_MARK = "\n[ds41-gates: output truncated at the {mb} MiB cap; the process was killed]\n"
_UID_BASE = 61000                       # unprivileged uids for sandboxes started by root


class SandboxUnavailable(UserError):
    """bubblewrap or the sandbox interpreter is missing, or the kernel refuses the namespaces."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 15.0
    cpu_s: int = 10
    memory_mb: int = 1024       # address space
    processes: int = 32         # RLIMIT_NPROC for the sandbox's uid
    file_mb: int = 16           # largest file the code may write
    disk_mb: int = 64           # all the files it may write together (the size of its tmpfs)
    output_mb: int = 4          # per stream (stdout, stderr): bytes held that the harness has not taken yet


Status = Literal["ok", "failed", "timeout", "overflow"]


@dataclass(frozen=True)
class Outcome:
    status: Status              # ok: exit 0; failed: any other exit; timeout: killed at the deadline;
    returncode: int | None      # overflow: killed when its output passed the cap
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False     # stdout or stderr was cut at the cap (the text ends with TRUNCATED_MARK)


def _tool(name: str) -> str:
    found = shutil.which(name, path=SANDBOX_ENV["PATH"])
    if found is None:
        raise SandboxUnavailable(f"{name} is missing (util-linux); generated code is never run without it")
    return found


def _bwrap() -> str:
    found = shutil.which("bwrap", path=SANDBOX_ENV["PATH"]) or shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed: run `bash scripts/setup-evals.sh` "
                                 "(apt-get install bubblewrap); generated code is never run outside it")
    return found


def _python() -> str:
    py = os.environ.get("DS41_SANDBOX_PYTHON", SANDBOX_PYTHON)
    if not Path(py).is_file() or not py.startswith("/usr/"):
        raise SandboxUnavailable(f"sandbox interpreter {py!r} is missing or outside /usr (the only tree the "
                                 "sandbox mounts); install Debian's python3 or set DS41_SANDBOX_PYTHON")
    return py


_slot_lock = threading.Lock()
_slots_in_use: set[int] = set()


def _take_slot() -> int:
    with _slot_lock:
        slot = next(i for i in range(10_000) if i not in _slots_in_use)
        _slots_in_use.add(slot)
        return slot


def _pids_of_uid(uid: int, running_only: bool = False) -> list[int]:
    """Processes whose real uid is ``uid`` (they count against that uid's RLIMIT_NPROC, zombies included);
    ``running_only`` leaves out zombies (dead, waiting for a parent to reap them: they run nothing)."""
    gone = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) if running_only else ()
    return [proc.pid for proc in psutil.process_iter(["uids", "status"])
            # info is None for a field the process took with it when it ended while we looked
            if proc.info["uids"] is not None and proc.info["uids"].real == uid and proc.info["status"] not in gone]


def _free_uid(slot: int) -> int:
    """An unprivileged uid no live process uses: a fork bomb's stragglers under a reused uid would
    otherwise eat the next sandbox's process budget before its code runs."""
    for attempt in range(400):
        uid = _UID_BASE + ((os.getpid() + attempt) % 400) * 10 + slot % 10
        if not _pids_of_uid(uid):
            return uid
    raise SandboxUnavailable(f"every sandbox uid {_UID_BASE}..{_UID_BASE + 3999} has live processes")


def _reap_uid(uid: int, deadline_s: float = 15.0) -> None:
    """Kill every process left under a sandbox uid and wait until none remains."""
    t_end = time.monotonic() + deadline_s
    while pids := _pids_of_uid(uid, running_only=True):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > t_end:
            raise SandboxUnavailable(f"sandbox uid {uid}: processes {pids[:8]} survive SIGKILL")
        time.sleep(0.02)


def _give_slot(slot: int) -> None:
    with _slot_lock:
        _slots_in_use.discard(slot)


def command(workdir: Path, argv: list[str], limits: Limits, uid: int | None) -> list[str]:
    """The full command line: (setpriv to an unprivileged uid) → prlimit → bwrap → argv."""
    mb = 1024 * 1024
    cmd: list[str] = []
    if uid is not None:
        cmd += [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    cmd += [_tool("prlimit"), f"--cpu={limits.cpu_s}", f"--as={limits.memory_mb * mb}",
            f"--fsize={limits.file_mb * mb}", f"--nproc={limits.processes}", "--core=0", "--"]
    # the writable place is a tmpfs of disk_mb (RLIMIT_FSIZE caps one file only: 640 MB were written in 4 s
    # as many files on the host's disk); the harness's files are bound into it read-only
    inputs = [a for p in sorted(workdir.iterdir()) for a in ("--ro-bind", str(p), f"/sandbox/{p.name}")]
    cmd += [_bwrap(), "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev",
            "--size", str(limits.disk_mb * mb), "--perms", "0700", "--tmpfs", "/sandbox", *inputs,
            "--symlink", "/sandbox", "/tmp", "--remount-ro", "/",
            "--chdir", "/sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/sandbox",
            "--setenv", "LANG", SANDBOX_ENV["LANG"], "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--"]
    return cmd + argv


class _Stream(threading.Thread):
    """Reads one pipe of a sandboxed process in chunks. Holds at most ``cap`` bytes the harness has not taken
    yet; past that the held bytes are cut to the cap, ``overflow`` is set, ``on_overflow`` kills the process and
    the rest is read and dropped (never buffered). ``keep_tail`` holds only the last bytes (stderr: the
    traceback's last line is what a verdict quotes) while still counting everything against the cap."""

    def __init__(self, pipe, cap: int, on_overflow, keep_tail: int = 0):
        super().__init__(daemon=True)
        self._pipe, self.cap, self._on_overflow, self._keep_tail = pipe, cap, on_overflow, keep_tail
        self._buf = bytearray()
        self._cond = threading.Condition()
        self.total = 0
        self.eof = False
        self.overflow = False
        self.start()

    def run(self) -> None:
        fd = self._pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            with self._cond:
                if not chunk:
                    self.eof = True
                    self._cond.notify_all()
                    return
                self.total += len(chunk)
                if self.overflow:
                    continue
                if self._keep_tail:
                    self._buf += chunk
                    del self._buf[:-self._keep_tail]
                    over = self.total > self.cap
                else:
                    self._buf += chunk
                    over = len(self._buf) > self.cap
                if over:
                    if not self._keep_tail:
                        del self._buf[self.cap:]
                    self.overflow = True
                    self._cond.notify_all()
                else:
                    self._cond.notify_all()
                    continue
            self._on_overflow()

    def take_line(self, deadline: float) -> bytes | None:
        """The next whole line (without its newline), or None at EOF, overflow or the deadline."""
        with self._cond:
            while True:
                nl = self._buf.find(b"\n")
                if nl >= 0 and not self.overflow:
                    line = bytes(self._buf[:nl])
                    del self._buf[:nl + 1]
                    return line
                if self.eof or self.overflow:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.5))

    def held(self) -> bytes:
        with self._cond:
            return bytes(self._buf)

    def pending(self) -> bool:
        with self._cond:
            return bool(self._buf.strip())


class SandboxProcess:
    """One sandboxed ``/usr/bin/python3 -I main.py`` with ``files`` beside it, talked to over its stdin and
    stdout (capped, see `_Stream`) until `close` (a context manager). The wall deadline counts from the start."""

    def __init__(self, source: str, limits: Limits = Limits(), files: dict[str, str] | None = None):
        self.limits = limits
        py = _python()
        self._slot = _take_slot()
        self._uid: int | None = None
        self._workdir: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._stdin_closed = False
        try:
            self._uid = _free_uid(self._slot) if os.geteuid() == 0 else None
            self._workdir = Path(tempfile.mkdtemp(prefix="ds41-sandbox-"))
            (self._workdir / "main.py").write_text(source, encoding="utf-8")
            for name, text in (files or {}).items():
                (self._workdir / name).write_text(text, encoding="utf-8")
            if self._uid is not None:
                for p in [self._workdir, *self._workdir.iterdir()]:
                    os.chown(p, self._uid, self._uid)
            cmd = command(self._workdir, [py, "-I", "main.py"], limits, self._uid)
            self.t0 = time.monotonic()
            self.deadline = self.t0 + limits.wall_s
            # env: the whole environment of setpriv → prlimit → bwrap (the sandbox's pid 1); nothing else passes
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True, env=dict(SANDBOX_ENV))
        except BaseException:
            self.close()
            raise
        cap = max(1, int(limits.output_mb * 1024 * 1024))
        self.out = _Stream(self._proc.stdout, cap, self.kill)
        self.err = _Stream(self._proc.stderr, cap, self.kill, keep_tail=64 * 1024)
        self.timed_out = False
        # the deadline holds even while the harness is blocked writing to a process that does not read
        self._watchdog = threading.Timer(limits.wall_s, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        if self._proc.poll() is None:
            self.timed_out = True
            self.kill()

    # -- talking
    def send(self, data: bytes) -> bool:
        """Write to the process's stdin; False when it is gone (a closed pipe)."""
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def close_stdin(self) -> None:
        self._stdin_closed = True
        try:
            self._proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def read_line(self, deadline: float | None = None) -> bytes | None:
        """The next line of stdout, or None: the process ended (`ended`), overflowed, or the deadline passed
        (the process is then killed and `timed_out` set)."""
        end = self.deadline if deadline is None else min(deadline, self.deadline)
        line = self.out.take_line(end)
        if line is None and not (self.out.eof or self.out.overflow) and time.monotonic() >= end:
            if end >= self.deadline:
                self.timed_out = True
                self.kill()
        return line

    @property
    def overflow(self) -> bool:
        return self.out.overflow or self.err.overflow

    def why(self) -> str:
        """Why no (more) answer came: a timeout, output over the cap, or the process's exit and last error line."""
        if self.overflow:
            return f"output over the {self.limits.output_mb} MiB cap; killed"
        if self.timed_out:
            return f"timeout after {self.limits.wall_s:.1f}s"
        rc = self.wait(min(self.deadline, time.monotonic() + 2.0))
        lines = [ln for ln in self.stderr_text().strip().splitlines() if ln.strip()]
        return (lines[-1] if lines else f"exit {rc} with no answer")[:300]

    # -- ending
    def wait(self, deadline: float | None = None) -> int | None:
        """Wait for the exit until ``deadline`` (default: the wall deadline; then killed, `timed_out`)."""
        end = self.deadline if deadline is None else deadline
        try:
            return self._proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            if end >= self.deadline:
                self.timed_out = True
            self.kill()
            return self._proc.wait()

    def kill(self) -> None:
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stderr_text(self) -> str:
        return self.err.held().decode("utf-8", errors="replace")

    def check_bwrap(self) -> None:
        """bubblewrap itself failed before the code ran: a harness fault, never the sample's score."""
        err = self.stderr_text()
        if self._proc.returncode not in (0, None) and "bwrap:" in err and (
                "namespace" in err or "Operation not permitted" in err or "Can't fork" in err):
            raise SandboxUnavailable(f"bubblewrap could not build the sandbox: {err.strip()[-300:]}")

    def close(self) -> None:
        try:
            if getattr(self, "_watchdog", None) is not None:
                self._watchdog.cancel()
            if self._proc is not None:
                if self._stdin_closed and self._proc.poll() is None:
                    try:            # told to end: let bubblewrap reap its own children rather than orphan them
                        self._proc.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        pass
                self.kill()
                self._proc.wait()
                for s in (getattr(self, "out", None), getattr(self, "err", None)):
                    if s is not None:
                        s.join(timeout=5.0)
                for f in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
                    try:
                        f.close()
                    except OSError:
                        pass
        finally:
            try:
                if self._uid is not None:
                    _reap_uid(self._uid)
            finally:
                _give_slot(self._slot)
                if self._workdir is not None:
                    shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "SandboxProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_python(source: str, limits: Limits = Limits(), stdin: str = "", files: dict[str, str] | None = None) -> Outcome:
    """Run ``source`` as ``/sandbox/main.py`` with the system interpreter in isolated mode (``-I``); its
    output read with the cap (`Limits.output_mb`): cut, marked, and the process killed past it."""
    with SandboxProcess(source, limits, files) as sp:
        if stdin:
            sp.send(stdin.encode("utf-8"))
        sp.close_stdin()
        rc = sp.wait()
        sp.out.join(timeout=max(0.1, sp.deadline + 5.0 - time.monotonic()))
        sp.err.join(timeout=5.0)
        wall = time.monotonic() - sp.t0
        status: Status = ("overflow" if sp.overflow else "timeout" if sp.timed_out
                          else "ok" if rc == 0 else "failed")
        if status == "failed":
            sp.check_bwrap()
        mark = TRUNCATED_MARK.format(mb=limits.output_mb)
        out = sp.out.held().decode("utf-8", errors="replace") + (mark if sp.out.overflow else "")
        err = sp.stderr_text() + (mark if sp.err.overflow else "")
        return Outcome(status, rc, out, err, wall, truncated=sp.overflow)



"""Run untrusted Python (code written by the model under test) in a bubblewrap sandbox, never in the
harness process.

The boundary (docs/EVALS.md, "The sandbox"):

* namespaces (bubblewrap ``--unshare-all``): no network (a fresh net namespace has no route), its own
  PID namespace (the harness and every other host process are invisible, so ``os.kill`` of the parent
  reaches only the sandbox's own init and ends the sandbox), own IPC/UTS/cgroup/user namespaces;
* file system: ``/usr`` read-only (the system interpreter and its standard library), the root
  read-only, one fresh temp folder as the only writable place (mounted at ``/sandbox`` and ``/tmp``);
  the harness checkout, the cache and ``/root`` are not mounted at all;
* rlimits set before bubblewrap starts (inherited, hard = soft, unraisable without capabilities):
  CPU seconds, address space, file size, and the number of processes. As root the sandbox runs under an
  unprivileged uid of its own, because the kernel never applies RLIMIT_NPROC to uid 0;
* a wall-clock deadline enforced here: the whole process group is killed when it passes.

Why bubblewrap rather than Landlock (PyPI ``sandlock``): Landlock restricts files (and TCP on ABI 4+)
but not processes or signals, and needs a kernel that enables it; namespaces give the PID and network
isolation directly and bubblewrap is one Debian package (``apt-get install bubblewrap``, done by
scripts/setup-evals.sh).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.errors import UserError

SANDBOX_PYTHON = "/usr/bin/python3"     # the system interpreter: lives in /usr, the one tree mounted
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


Status = Literal["ok", "failed", "timeout"]


@dataclass(frozen=True)
class Outcome:
    status: Status              # ok: exit 0; failed: any other exit; timeout: killed at the deadline
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


def _bwrap() -> str:
    found = shutil.which("bwrap")
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


def _pids_of_uid(uid: int) -> list[int]:
    """Live processes whose real uid is ``uid`` (they count against that uid's RLIMIT_NPROC)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for line in (entry / "status").read_text().split("\n"):
                if line.startswith("Uid:"):
                    if int(line.split()[1]) == uid:
                        pids.append(int(entry.name))
                    break
        except (OSError, ValueError, IndexError):
            continue            # the process ended while we looked
    return pids


def _free_uid(slot: int) -> int:
    """An unprivileged uid no live process uses: a fork bomb's stragglers under a reused uid would
    otherwise eat the next sandbox's process budget before its code runs."""
    for attempt in range(400):
        uid = _UID_BASE + ((os.getpid() + attempt) % 400) * 10 + slot % 10
        if not _pids_of_uid(uid):
            return uid
    raise SandboxUnavailable(f"every sandbox uid {_UID_BASE}..{_UID_BASE + 3999} has live processes")


def _reap_uid(uid: int, deadline_s: float = 5.0) -> None:
    """Kill every process left under a sandbox uid and wait until none remains."""
    t_end = time.monotonic() + deadline_s
    while pids := _pids_of_uid(uid):
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
        cmd += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    cmd += ["prlimit", f"--cpu={limits.cpu_s}", f"--as={limits.memory_mb * mb}", f"--fsize={limits.file_mb * mb}",
            f"--nproc={limits.processes}", f"--core=0", "--"]
    cmd += [_bwrap(), "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev",
            "--bind", str(workdir), "/sandbox", "--bind", str(workdir), "/tmp", "--remount-ro", "/",
            "--chdir", "/sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/sandbox",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--"]
    return cmd + argv


def run_python(source: str, limits: Limits = Limits(), stdin: str = "", files: dict[str, str] | None = None) -> Outcome:
    """Run ``source`` as ``/sandbox/main.py`` with the system interpreter in isolated mode (``-I``)."""
    py = _python()
    slot = _take_slot()
    uid = _free_uid(slot) if os.geteuid() == 0 else None
    workdir = Path(tempfile.mkdtemp(prefix="ds41-sandbox-"))
    try:
        (workdir / "main.py").write_text(source, encoding="utf-8")
        for name, text in (files or {}).items():
            (workdir / name).write_text(text, encoding="utf-8")
        if uid is not None:
            for p in [workdir, *workdir.iterdir()]:
                os.chown(p, uid, uid)
        cmd = command(workdir, [py, "-I", "main.py"], limits, uid)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, text=True, errors="replace")
        try:
            out, err = proc.communicate(stdin, timeout=limits.wall_s)
            status: Status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            status = "timeout"
        wall = time.perf_counter() - t0
        if status == "failed" and "bwrap:" in err and ("namespace" in err or "Operation not permitted" in err
                                                       or "Can't fork" in err):
            # bubblewrap itself failed before the sample ran: a harness fault, never the sample's score
            raise SandboxUnavailable(f"bubblewrap could not build the sandbox: {err.strip()[-300:]}")
        return Outcome(status, proc.returncode, out[-20_000:], err[-20_000:], wall)
    finally:
        try:
            if uid is not None:
                _reap_uid(uid)
        finally:
            _give_slot(slot)
            shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def nonce() -> str:
    """A per-run token the test driver prints only after every test passed (an early ``os._exit(0)``
    or a printed 'PASS' in generated code does not count as passing)."""
    return secrets.token_hex(16)

"""The work dir of a resumable panel run, and the crash points the resume tests kill it at.

A run's work dir holds a lock, the activation file of the last committed stage (`acts-NNN.bin`, written by
spill.StageWriter) and `manifest.json`, which names that file, its SHA-256 and byte table, the stages done and
what the run has read and timed so far. Each stage is committed in two atomic steps: the activation file,
then the manifest. A run killed at any point therefore leaves either the old manifest (naming the old, intact
activation file) or the new one, and the next run with the same identity continues from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Callable, Iterator

from core.atomic import atomic_path

from .options import RunnerError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "ds41-runner/1"
KILL_ENV = "DS41_RUNNER_KILL"  # test hook: "point@stage[,point@stage...]" -> SIGKILL at that point


def fault(point: str, stage: int) -> None:
    """SIGKILL ourselves at a named point when the test hook asks for it (no clean-up can run: like a crash)."""
    spec = os.environ.get(KILL_ENV)
    if spec and f"{point}@{stage}" in spec.split(","):
        os.kill(os.getpid(), signal.SIGKILL)


class WorkDir:
    """One run's work dir. `identity` is what must be equal for the dir to be continued (checkpoint, panel,
    precision, device, threads, ...): continuing another run's dir would mix two computations."""

    def __init__(self, path: str | os.PathLike, identity: dict):
        self.path = Path(path)
        self.identity = identity
        self.job = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        self.manifest_path = self.path / MANIFEST

    @contextlib.contextmanager
    def locked(self) -> Iterator["WorkDir"]:
        """Create the dir and hold its lock: two runs in one work dir would overwrite each other's stages."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = open(self.path / "lock", "w")
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunnerError(f"{self.path}: another run holds this work dir") from None
            yield self
        finally:
            lock.close()

    def resume(self, restart: bool) -> dict | None:
        """The manifest of the last committed stage (None: start from stage 0), after removing every file no
        manifest names (temp files of an interrupted write, activation files of uncommitted stages)."""
        for p in self.path.glob("*.partial"):  # a crash inside a write: the manifest never named these
            p.unlink()
        if self.manifest_path.exists() and restart:
            self.manifest_path.unlink()
        manifest = None
        if self.manifest_path.exists():
            try:
                manifest = json.loads(self.manifest_path.read_text())
            except json.JSONDecodeError as e:
                raise RunnerError(f"{self.manifest_path}: unreadable manifest ({e}); rerun with --restart to "
                                  f"start over") from e
            if manifest.get("format") != MANIFEST_FORMAT or manifest.get("job") != self.job:
                diff = sorted(k for k in self.identity if manifest.get("identity", {}).get(k) != self.identity[k])
                raise RunnerError(f"{self.path}: the work dir belongs to another run (differs in {diff}); use "
                                  f"another --work or --restart")
        for p in self.path.glob("acts-*.bin"):  # files of stages the manifest does not name: recomputed
            if manifest is None or p.name != manifest["acts"]:
                p.unlink()
        return manifest

    def acts_path(self, stage: int) -> Path:
        return self.path / f"acts-{stage:03d}.bin"

    def commit(self, entry: dict, hook: Callable[[str], None] = lambda point: None) -> None:
        """Atomically replace the manifest with `entry` (plus this run's format, job and identity)."""
        manifest = {"format": MANIFEST_FORMAT, "job": self.job, "identity": self.identity, **entry}
        with atomic_path(self.manifest_path) as tmp:
            tmp.write_text(json.dumps(manifest, sort_keys=True))
            hook("manifest-written")

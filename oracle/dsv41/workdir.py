"""The work dir of a resumable panel run, its manifest, and the crash points the resume tests kill it at.

A run's work dir holds a lock, the activation file of the last committed stage (`acts-NNN.bin`, written by
spill.StageWriter) and `manifest.json` (a `Manifest`), which names that file, its SHA-256 and byte table, the
stages done and what the run has read and timed so far. Each stage is committed in two atomic steps: the
activation file, then the manifest. A run killed at any point therefore leaves either the old manifest (naming
the old, intact activation file) or the new one, and the next run with the same identity continues from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from filelock import FileLock, Timeout

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


@dataclass(frozen=True)
class RunTotals:
    """What a run has spent and seen over its committed stages; a resumed run starts from these totals, so its
    record reports the whole computation, not the part after the restart."""

    read_s: float = 0.0  # weights: read + exact decode to fp32
    compute_s: float = 0.0
    io_s: float = 0.0  # activation get / put / commit
    largest_stage_weight_bytes: int = 0
    largest_stage_name: str = ""
    activation_bytes: int = 0  # the largest committed stage


TIMING_FIELDS = ("read_s", "compute_s", "io_s")


@dataclass(frozen=True)
class Manifest:
    """The last committed stage of a run: `stages_done` stages are in the activation file `acts` (its SHA-256
    and spill byte `table`); `loaded` maps every tensor read so far to the SHA-256 of its bytes."""

    stages_done: int
    stage_name: str
    acts: str
    acts_sha256: str
    acts_bytes: int
    table: list[dict]
    loaded: dict[str, str]
    totals: RunTotals = field(default_factory=RunTotals)

    def to_json(self, job: str, identity: dict) -> dict:
        """The on-disk form (flat, as ds41-runner/1 has always been written)."""
        p = dataclasses.asdict(self.totals)
        return {"format": MANIFEST_FORMAT, "job": job, "identity": identity,
                "stages_done": self.stages_done, "stage_name": self.stage_name, "acts": self.acts,
                "acts_sha256": self.acts_sha256, "acts_bytes": self.acts_bytes, "table": self.table,
                "loaded": self.loaded, "timing": {k: p.pop(k) for k in TIMING_FIELDS}, **p}

    @classmethod
    def from_json(cls, obj: Any, path: Path) -> "Manifest":
        """Checks every field's type; a manifest of another format or a garbled one is refused naming `path`."""
        def bad(what: str) -> RunnerError:
            return RunnerError(f"{path}: {what}; rerun with --restart to start over")

        if not isinstance(obj, dict):
            raise bad(f"not a runner manifest (a JSON {type(obj).__name__}, not an object)")
        if obj.get("format") != MANIFEST_FORMAT:
            raise bad(f"manifest format {obj.get('format')!r}, this runner reads {MANIFEST_FORMAT!r}")

        def get(obj: dict, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
            v = obj.get(key)
            # bool is an int to isinstance: a true/false count is as garbled as a missing one
            if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
                raise bad(f"garbled manifest: {where}{key!r} is {v!r}")
            return v

        timing = get(obj, "timing", dict)
        totals = RunTotals(**{k: float(get(timing, k, (int, float), "timing.")) for k in TIMING_FIELDS},
                            largest_stage_weight_bytes=get(obj, "largest_stage_weight_bytes", int),
                            largest_stage_name=get(obj, "largest_stage_name", str),
                            activation_bytes=get(obj, "activation_bytes", int))
        loaded = get(obj, "loaded", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()):
            raise bad("garbled manifest: 'loaded' maps a tensor to something other than a digest")
        table = get(obj, "table", list)
        if not all(isinstance(e, dict) for e in table):
            raise bad("garbled manifest: 'table' holds an entry that is not an object")
        return cls(stages_done=get(obj, "stages_done", int), stage_name=get(obj, "stage_name", str),
                   acts=get(obj, "acts", str), acts_sha256=get(obj, "acts_sha256", str),
                   acts_bytes=get(obj, "acts_bytes", int), table=table, loaded=loaded, totals=totals)


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
        lock = FileLock(self.path / "lock", timeout=0, thread_local=False)
        try:
            lock.acquire()
        except Timeout:
            raise RunnerError(f"{self.path}: another run holds this work dir") from None
        try:
            yield self
        finally:
            lock.release()

    def resume(self, restart: bool) -> Manifest | None:
        """The manifest of the last committed stage (None: start from stage 0), after removing every file no
        manifest names (temp files of an interrupted write, activation files of uncommitted stages)."""
        for p in self.path.glob("*.partial"):  # a crash inside a write: the manifest never named these
            p.unlink()
        if self.manifest_path.exists() and restart:
            self.manifest_path.unlink()
        manifest = None
        if self.manifest_path.exists():
            try:
                obj = json.loads(self.manifest_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RunnerError(f"{self.manifest_path}: unreadable manifest ({e}); rerun with --restart to "
                                  f"start over") from e
            manifest = Manifest.from_json(obj, self.manifest_path)
            if obj.get("job") != self.job:
                theirs = obj.get("identity") if isinstance(obj.get("identity"), dict) else {}
                diff = sorted(k for k in self.identity if theirs.get(k) != self.identity[k])
                raise RunnerError(f"{self.path}: the work dir belongs to another run (differs in {diff}); use "
                                  f"another --work or --restart")
        for p in self.path.glob("acts-*.bin"):  # files of stages the manifest does not name: recomputed
            if manifest is None or p.name != manifest.acts:
                p.unlink()
        return manifest

    def acts_path(self, stage: int) -> Path:
        return self.path / f"acts-{stage:03d}.bin"

    def commit(self, manifest: Manifest, hook: Callable[[str], None] = lambda point: None) -> None:
        """Atomically replace the manifest file with `manifest` (under this run's job and identity)."""
        with atomic_path(self.manifest_path) as tmp:
            tmp.write_text(json.dumps(manifest.to_json(self.job, self.identity), sort_keys=True))
            hook("manifest-written")


def record_to_file(make: Callable[[Path], Any], out: str | os.PathLike, work: str | os.PathLike | None,
                   keep_work: bool):
    """``make(work_dir)`` -> a record, written atomically to ``out``; the work dir (default ``<out>.work``, where a
    killed run resumes) is deleted after unless ``keep_work``."""
    out = Path(out)
    work = Path(work) if work is not None else out.with_name(out.name + ".work")
    rec = make(work)
    rec.save(out)
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return rec

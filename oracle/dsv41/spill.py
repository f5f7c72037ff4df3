"""Per-sequence activation files for the layer-streamed runner (oracle/dsv41/runner.py).

After every stage (embedding, each layer) the runner holds one *state* per panel sequence: a few named
arrays (the hyper-connection residual streams, the collapse weights, the attention state later layers
read) plus a small JSON `meta`. A `StageWriter` collects the states of one stage, either in RAM or
appended straight to a file on disk (spill), and `commit()` makes them durable atomically:

    temp file (fully written, fsync) -> os.replace -> final name -> fsync(dir)

so a crash at any moment leaves either the previous stage's file or the new one, never a torn file.
The file is raw bytes: sequence after sequence, array after array (sorted names), C order. Where each
array lives is the `table` the runner stores in its manifest; the SHA-256 of the whole file is computed
while writing and checked when a run resumes.

Reading a spilled stage uses pread into fresh buffers rather than a numpy memmap on purpose: pages of a
mapped file count toward the process's RSS while mapped, and the runner's memory bound is about RSS.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import numpy as np

from core.atomic import fsync_dir
from core.errors import UserError
from core.hashing import sha256_file

Hook = Callable[[str], None]
RESTART_HINT = ("; the saved state of the interrupted run is damaged: run the same command with --restart to "
                "start over")
CHUNK = 8 << 20  # bytes per write/read call (and between the 'half written' fault points)


class SpillError(UserError, RuntimeError):
    """An activation file is missing, short, or does not hash to what the manifest says."""


def _bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class StageWriter:
    """Collects the states of one stage, sequence by sequence in panel order."""

    def __init__(self, path: Path, spill: bool):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.spill = spill
        self.table: list[dict] = []
        self.held: list[tuple[dict[str, np.ndarray], dict]] = []  # RAM mode
        self.offset = 0
        self._hash = hashlib.sha256()
        self._f = open(self.tmp, "wb") if spill else None

    def put(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        entry = {}
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name])
            entry[name] = [a.dtype.str, list(a.shape), self.offset]
            view = _bytes_view(a)
            self._hash.update(view)  # file order: the hash of the finished file
            if self._f is not None:
                self._f.write(view)
            self.offset += a.nbytes
        self.table.append({"arrays": entry, "meta": meta})
        if self._f is None:
            self.held.append(({n: np.ascontiguousarray(a) for n, a in arrays.items()}, meta))

    def commit(self, hook: Hook = lambda point: None) -> str:
        """Make the stage durable under its final name; returns the file's SHA-256."""
        if self._f is None:  # RAM mode: write the held arrays in the same order put() hashed them
            self._f = open(self.tmp, "wb")
            written, half_done = 0, False
            for arrays, _ in self.held:
                for name in sorted(arrays):
                    view = _bytes_view(arrays[name])
                    for s in range(0, len(view), CHUNK):
                        self._f.write(view[s:s + CHUNK])
                        written += min(CHUNK, len(view) - s)
                        if not half_done and written * 2 >= self.offset:
                            self._f.flush()
                            half_done = True
                            hook("acts-half")
        else:
            hook("acts-half")  # spilled stages are written while computing; the point is 'end of data'
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        hook("acts-written")
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        hook("acts-replaced")
        return self._hash.hexdigest()

    def reader(self) -> "StageReader":
        """The committed stage as the next stage's input (RAM mode hands over its arrays, no re-read)."""
        return StageReader(self.path, self.table, held=self.held if not self.spill else None)


class StageReader:
    """One committed stage; `get(i)` returns sequence i's arrays and meta. In RAM mode the arrays are handed
    over and forgotten (each stage reads each sequence exactly once), so input memory shrinks as the next
    stage's output grows."""

    def __init__(self, path: Path, table: list[dict], held: list | None = None):
        self.path, self.table, self.held = Path(path), table, held
        self._fd: int | None = None

    @classmethod
    def open_verified(cls, path: Path, table: list[dict], sha256: str) -> "StageReader":
        path = Path(path)
        if not path.is_file():
            raise SpillError(f"{path}: the manifest names this activation file but it does not exist{RESTART_HINT}")
        got = sha256_file(path)
        if got != sha256:
            raise SpillError(f"{path}: SHA-256 {got[:16]}... does not match the manifest's {sha256[:16]}..."
                             f"{RESTART_HINT}")
        return cls(path, table)

    def get(self, i: int) -> tuple[dict[str, np.ndarray], dict]:
        entry = self.table[i]
        if self.held is not None:
            arrays, meta = self.held[i]
            self.held[i] = None  # type: ignore[assignment]
            if arrays is None:
                raise SpillError(f"stage state of sequence {i} was already consumed")
            return arrays, meta
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        out = {}
        for name, (dtype, shape, offset) in entry["arrays"].items():
            a = np.empty(shape, dtype=np.dtype(dtype))
            view = _bytes_view(a)
            done = 0
            while done < len(view):
                n = os.preadv(self._fd, [view[done:done + CHUNK]], offset + done)
                if n <= 0:
                    raise SpillError(f"{self.path}: short read of {name} for sequence {i} at byte {offset + done}"
                                     f"{RESTART_HINT}")
                done += n
            out[name] = a
        return out, entry["meta"]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.held = None

"""Raw reading of one folder of safetensors shards (the official checkpoint, or a pack over it): the header of
each shard parsed and checked against the file size, the index's weight map checked against the headers, and
lazy reads of one tensor, a row range, or a few bytes at a time. No knowledge of the model: checkpoint.py
decides which tensors a configuration needs and decodes them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from core.hashing import sha256_file  # noqa: F401  (checkpoint.py imports it from here)
from . import formats as F

INDEX_NAME = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}


class ShortRead(OSError):
    """A shard file ended before the bytes its header promised (a truncated shard)."""

    def __init__(self, path: Path, detail: str):
        self.path, self.detail = path, detail
        super().__init__(f"{path}: {detail}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offsets of the data in the file
    end: int

    @property
    def header(self) -> F.Header:
        return F.Header(self.dtype, self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict, list[str]]:
    """Parse a safetensors header (8-byte LE length, JSON) and check it against the file size (§19)."""
    problems: list[str] = []
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return {}, {}, [f"{path.name}: truncated file ({size} bytes, no header)"]
        n = struct.unpack("<Q", raw)[0]
        if 8 + n > size:
            return {}, {}, [f"{path.name}: truncated file (header says {n} bytes, file has {size})"]
        try:
            hdr = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return {}, {}, [f"{path.name}: unreadable header JSON ({e})"]
    meta = hdr.pop("__metadata__", None) or {}
    infos: dict[str, TensorInfo] = {}
    data_end = 0
    for name, h in hdr.items():
        try:
            dtype, shape, (b, e) = h["dtype"], tuple(int(s) for s in h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            problems.append(f"{path.name}: malformed header entry for {name}")
            continue
        nbytes = math.prod(shape) * DTYPE_BYTES.get(dtype, 0)
        if dtype not in DTYPE_BYTES:
            problems.append(f"{name} ({path.name}): unknown dtype {dtype}")
        elif e - b != nbytes:
            problems.append(f"{name} ({path.name}): {e - b} data bytes for {dtype} {list(shape)} ({nbytes} expected)")
        data_end = max(data_end, e)
        infos[name] = TensorInfo(name, dtype, shape, path, 8 + n + b, 8 + n + e)
    if 8 + n + data_end > size:
        problems.append(f"{path.name}: truncated file ({size} bytes, tensors need {8 + n + data_end})")
    return infos, meta, problems


class ShardFolder:
    """The shards of one folder: inventory from the index if present, else the union of shard headers."""

    def __init__(self, folder: Path, role: str):
        self.dir, self.role = folder, role
        self.problems: list[str] = []
        self.infos: dict[str, TensorInfo] = {}
        self.index_sha256: str | None = None
        self._handles: dict[Path, object] = {}
        if not folder.is_dir():
            self.problems.append(f"{role} folder {folder} does not exist")
            return
        index = folder / INDEX_NAME
        declared: dict[str, str] | None = None
        if index.exists():
            self.index_sha256 = sha256_file(index)
            try:
                declared = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                self.problems.append(f"{index}: no readable weight_map ({e})")
        files = sorted(set(declared.values())) if declared else sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            self.problems.append(f"{role} folder {folder} holds no safetensors shards")
        for fn in files:
            path = folder / fn
            if not path.exists():
                self.problems.append(f"{INDEX_NAME} names shard {fn}, which does not exist in {folder}")
                continue
            infos, _, probs = read_header(path)
            self.problems += probs
            for name, info in infos.items():
                if name in self.infos:
                    self.problems.append(f"{name}: in both {self.infos[name].file.name} and {fn}")
                elif declared is not None and declared.get(name) != fn:
                    self.problems.append(f"{name}: in shard {fn} but the index maps it to {declared.get(name)}")
                else:
                    self.infos[name] = info
        if declared:
            for name, fn in declared.items():
                if name not in self.infos and (folder / fn).exists():
                    self.problems.append(f"{name}: listed in {INDEX_NAME} but absent from shard {fn}")

    def release_handles(self) -> None:
        self._handles.clear()

    def read(self, info: TensorInfo, rows: slice | None = None) -> torch.Tensor:
        """Lazy read of one tensor (or a row range) through safetensors; 1-byte float formats as uint8."""
        h = self._handles.get(info.file)
        if h is None:
            h = self._handles[info.file] = safe_open(str(info.file), framework="pt")
        t = h.get_tensor(info.name) if rows is None else h.get_slice(info.name)[rows]
        return t.view(torch.uint8) if info.dtype.startswith("F8_") else t


class RandomReads:
    """Positional reads of a few bytes at a time from shard files opened with readahead off (POSIX_FADV_RANDOM):
    only the pages holding the requested bytes are read from storage."""

    def __init__(self):
        self.fds: dict[Path, int] = {}

    def __enter__(self) -> "RandomReads":
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def pread(self, path: Path, offset: int, n: int) -> np.ndarray:
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.open(path, os.O_RDONLY)
            try:  # advice only: the bytes read are the same without it (some sandboxes refuse it)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            except (AttributeError, OSError):
                pass
        b = os.pread(fd, n, offset)
        if len(b) != n:
            raise ShortRead(path, f"short read: {len(b)} of {n} bytes at offset {offset} (truncated shard?)")
        return np.frombuffer(b, dtype=np.uint8)

"""The tiny DeepSeek-V4 checkpoint the ``vllm-cpu-dsv4`` profile serves, generated once into the cache.

``ensure_dsv4_tiny()`` returns ``$DS41_CACHE/models/dsv4-tiny-<writer hash>-s<seed>-<expert dtype>/``, written
by ``oracle.dsv41.tiny_v4.write_tiny_v4_checkpoint`` (seed 0, MXFP4 experts; ``expert_dtype="bf16"`` = the
unquantized form of the same model). The folder name carries the
writer's code hash, so a change to the writer generates a new checkpoint instead of serving a stale one.
It is written into a temporary folder beside its destination and renamed into place (a folder that
exists is complete); a file lock serialises concurrent builders. ``ds41gate setup dsv4-tiny`` builds
it if needed and prints the path (scripts/setup-engines.sh does this).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path

from .models import Reporter, _file_lock, _stderr_reporter, cache_root

# the writer's source, hashed without importing it (torch): a cached start stays well under a second
WRITER_SOURCE = Path(__file__).resolve().parent.parent / "oracle" / "dsv41" / "tiny_v4.py"
MARKER = "ds41_tiny_v4.json"  # oracle.dsv41.tiny_v4.TINY_V4_MARKER (checked when writing)


def writer_hash() -> str:
    """= ``oracle.dsv41.tiny_v4.writer_code_hash()``, read from the file."""
    return hashlib.sha256(WRITER_SOURCE.read_bytes()).hexdigest()[:16]

DEFAULT_SEED = 0
DEFAULT_EXPERT_DTYPE = "fp4"


def dsv4_tiny_dir(cache: Path | None = None, seed: int = DEFAULT_SEED, expert_dtype: str = DEFAULT_EXPERT_DTYPE) -> Path:
    """Where the checkpoint lives, built or not (pure apart from reading the writer's source)."""
    return (cache or cache_root()) / "models" / f"dsv4-tiny-{writer_hash()}-s{seed}-{expert_dtype}"


def ensure_dsv4_tiny(cache: Path | None = None, seed: int = DEFAULT_SEED, expert_dtype: str = DEFAULT_EXPERT_DTYPE,
                     report: Reporter | None = None) -> Path:
    """Generate the tiny DeepSeek-V4 checkpoint unless it is already in the cache; returns its folder."""
    report = report or _stderr_reporter
    dest = dsv4_tiny_dir(cache, seed, expert_dtype)
    if (dest / MARKER).is_file():
        return dest
    from oracle.dsv41.tiny_v4 import TINY_V4_MARKER, write_tiny_v4_checkpoint, writer_code_hash

    if writer_code_hash() != writer_hash() or TINY_V4_MARKER != MARKER:
        raise RuntimeError(f"engine.dsv4_model: {WRITER_SOURCE} is not the imported writer; install the harness "
                           "editable from this checkout (scripts/setup-harness.sh)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(dest.parent / f".{dest.name}.lock", report):
        if (dest / MARKER).is_file():
            return dest
        t0 = time.monotonic()
        report(f"writing the tiny DeepSeek-V4 checkpoint into {dest} ...")
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            if expert_dtype == "bf16":
                write_tiny_v4_checkpoint(tmp / "ck", seed=seed, quantized=False)
            else:
                write_tiny_v4_checkpoint(tmp / "ck", seed=seed, expert_dtype=expert_dtype)
            if dest.exists():  # an interrupted older build without its marker
                shutil.rmtree(dest)
            (tmp / "ck").rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        report(f"tiny DeepSeek-V4 checkpoint ready in {time.monotonic() - t0:.1f} s: {dest}")
    return dest


def ensure_dsv4_tiny_bf16(cache: Path | None = None, report: Reporter | None = None) -> Path:
    """The same model unquantized (bf16 linears holding the decoded fp8 / MXFP4 values): what a CPU with
    AVX512-BF16 but no AMX can serve (what profile vllm-cpu-dsv4 serves; flag ``fp8_weights`` the release form)."""
    return ensure_dsv4_tiny(cache, expert_dtype="bf16", report=report)

"""The models the exllamav3 profiles serve, built on demand into the cache (engine/profiles/exllamav3-*.toml).

* ``dsv4-tiny-bf16``: the tiny DeepSeek-V4 in its unquantized form (``engine.dsv4_model.ensure_dsv4_tiny_bf16``:
  bf16 linears holding exactly the release layout's decoded fp8 / MXFP4 values) — exllamav3 loads it as is;
* ``dsv4-tiny-exl3-b<N>``: that folder quantized by exllamav3's own converter at N bits per weight
  (``python -m exllamav3.conversion.convert_model -b N -hb 16 -cr 16 -cc 256``: head kept at 16 bits, a small
  calibration set), written once into ``$DS41_CACHE/models/`` (temp folder + rename, so a folder that exists is
  complete). Needs exllamav3 and a CUDA device (the converter runs the model);
* ``dsv4-tiny-bf16-dspark``: the unquantized form with the DSpark drafter (``mtp.*``, oracle.dsv41.tiny_v4.TinyDSpark)
  written after the trunk from its own seed: its trunk is bit for bit ``dsv4-tiny-bf16``'s
  (tests/oracle/test_dsv4_dspark.py), so the same reference judges it; the bf16 profile's ``dspark`` flag serves it;
* :func:`oracle_pack` translates an EXL3 folder into the pack the DeepSeek oracle layers over the release
  checkpoint (``oracle.dsv41.exllamav3_pack``), so the KL gate's reference decodes the very EXL3 weights served.

``python -m engine.exllamav3_models NAME`` builds one and prints its folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .models import cache_root

CONVERT = ["-hb", "16", "-cr", "16", "-cc", "256"]
_EXL3 = re.compile(r"^dsv4-tiny-exl3-b(?P<bits>[2-8](?:\.5)?)$")
NAMES = ("dsv4-tiny-bf16", "dsv4-tiny-bf16-dspark", "dsv4-tiny-exl3-b4", "dsv4-tiny-exl3-b3", "dsv4-tiny-exl3-b2")
WITH_DRAFTER = "dsv4-tiny-bf16-dspark"


def bits_of(name: str) -> float | None:
    """Bits per weight of an EXL3 model name, None for the unquantized one; ValueError for an unknown name."""
    if name in ("dsv4-tiny-bf16", WITH_DRAFTER):
        return None
    m = _EXL3.match(name)
    if not m:
        raise ValueError(f"unknown exllamav3 model {name!r}: expected dsv4-tiny-bf16[-dspark] or dsv4-tiny-exl3-b<N> "
                         f"(N in 2..8), e.g. {', '.join(NAMES)}")
    return float(m["bits"])


def model_dir(name: str, cache: Path | None = None, log=None) -> Path:
    """The folder exllamav3 loads for ``name`` (built if missing)."""
    from .dsv4_model import dsv4_tiny_dir, ensure_dsv4_tiny_bf16

    bits = bits_of(name)
    if name == WITH_DRAFTER:
        return _bf16_with_drafter(cache)
    bf16 = ensure_dsv4_tiny_bf16(cache)
    if bits is None:
        return bf16
    base = dsv4_tiny_dir(cache, expert_dtype="bf16")
    dest = base.parent / f"{base.name}-exl3-b{bits:g}"
    if (dest / "config.json").is_file():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(bf16), "-o", str(tmp / "out"),
               "-w", str(tmp / "work"), "-b", f"{bits:g}", *CONVERT]
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if log is not None:
            log(f"convert {name}: {time.monotonic() - t0:.1f} s, rc {done.returncode}")
        if done.returncode != 0:
            raise RuntimeError(f"exllamav3 converter failed for {name} (rc {done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
        for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (bf16 / extra).is_file() and not (tmp / "out" / extra).exists():
                shutil.copy(bf16 / extra, tmp / "out" / extra)
        if dest.exists():
            shutil.rmtree(dest)
        (tmp / "out").rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _bf16_with_drafter(cache: Path | None) -> Path:
    """The unquantized tiny V4 with its DSpark drafter, written once beside the plain one (temp folder + rename)."""
    from oracle.dsv41.tiny_v4 import TinyDSpark, write_tiny_v4_checkpoint

    from .dsv4_model import DEFAULT_SEED, dsv4_tiny_dir

    base = dsv4_tiny_dir(cache, expert_dtype="bf16")
    dest = base.parent / f"{base.name}-dspark"
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write_tiny_v4_checkpoint(tmp / "ck", seed=DEFAULT_SEED, quantized=False, dspark=TinyDSpark())
        if dest.exists():
            shutil.rmtree(dest)
        (tmp / "ck").rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def oracle_pack(name: str, cache: Path | None = None) -> Path | None:
    """The oracle pack for an EXL3 model (None for the unquantized one: the release checkpoint is its reference)."""
    if bits_of(name) is None:
        return None
    from oracle.dsv41.exllamav3_pack import PACK_MARKER, translate_pack

    src = model_dir(name, cache)
    dest = src.parent / f"{src.name}.oracle-pack"
    if not (dest / PACK_MARKER).is_file():
        translate_pack(src, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m engine.exllamav3_models {{{'|'.join(NAMES)}}}", file=sys.stderr)
        return 2
    print(model_dir(args[0], log=lambda m: print(m, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["NAMES", "bits_of", "model_dir", "oracle_pack", "cache_root", "os"]

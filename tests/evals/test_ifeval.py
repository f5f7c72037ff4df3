"""The official IFEval checkers as loaded from the pinned wheel, with the offline sentence splitter:
worked examples for number_sentences, strict vs loose, and the word_tokenize seam; no download."""

from __future__ import annotations

import pytest

from evals import punkt
from evals.data import IFEvalPrompt
from evals.ifeval import checkers, instruction_types, score_response


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    import nltk

    def refuse(*a, **k):
        raise AssertionError("an IFEval checker tried to download NLTK data")

    monkeypatch.setattr(nltk, "download", refuse)


def test_the_25_official_instruction_types_are_registered():
    types = instruction_types()
    assert len(types) == 25
    assert "length_constraints:number_sentences" in types and "punctuation:no_comma" in types


@pytest.mark.parametrize("text, n", [
    ("One. Two. Three.", 3),
    ("Dr. Smith arrived at 5 p.m. on Friday. He was late!", 2),
    ("Is it? It is, e.g. when Mr. Jones calls. Etc.", 3),
    ("No final stop here", 1),
    ("The U.S. economy grew. Prices rose in Jan. and Feb. as expected.", 2),
    ("Wait... what? Yes!", 2),   # an ellipsis before a lower-case word ends nothing
])
def test_sentence_counts_on_worked_examples(text, n):
    assert len(punkt.split_sentences(text)) == n
    assert checkers().instructions_util.count_sentences(text) == n


def _prompt(instruction: str, kwargs: dict) -> IFEvalPrompt:
    return IFEvalPrompt(1, "p", (instruction,), (kwargs,))


def test_number_sentences_checker():
    less3 = _prompt("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 3})
    assert score_response(less3, "Dr. Who came. He left.").strict == (True,)      # 2 sentences ("Dr." is no stop)
    assert score_response(less3, "A came. B left. C stayed.").strict == (False,)  # 3
    atleast = _prompt("length_constraints:number_sentences", {"relation": "at least", "num_sentences": 3})
    assert score_response(atleast, "A came. B left. C stayed.").strict == (True,)


def test_strict_and_loose_differ_as_the_official_definition_says():
    # loose also tries the reply without its first line: a chatty preamble with a comma fails strict only
    p = _prompt("punctuation:no_comma", {})
    out = score_response(p, "Sure, here it is:\nNo commas in this answer at all")
    assert out.strict == (False,) and out.loose == (True,)
    assert (out.prompt_strict, out.prompt_loose) == (False, True)


def test_capital_word_frequency_uses_the_offline_word_tokenizer():
    p = _prompt("change_case:capital_word_frequency", {"capital_relation": "at least", "capital_frequency": 2})
    assert score_response(p, "THIS is VERY important.").strict == (True,)
    assert score_response(p, "Only ONE here.").strict == (False,)


def test_empty_reply_follows_nothing():
    p = _prompt("punctuation:no_comma", {})
    assert score_response(p, "   ").strict == (False,)

"""An English sentence splitter built offline: NLTK's Punkt algorithm with parameters written here.

IFEval's ``length_constraints:number_sentences`` counts sentences with NLTK's pretrained English Punkt
model (``tokenizers/punkt/english.pickle``, or ``punkt_tab``). That model is data no package registry
ships and that the harness never downloads at run time, so the parameters are built here instead: the
same unsupervised Punkt boundary rules (nltk.tokenize.punkt, Kiss & Strunk 2006) with an abbreviation
list for the common English abbreviations the pretrained model learned (titles, Latin shorthands,
months, units). A period after one of these does not end a sentence; every other ``.``/``?``/``!``
followed by white space and a new token does. Counts can differ from the pretrained model on rare
abbreviations; docs/EVALS.md says so, and tests/evals/test_ifeval.py holds worked examples.
"""

from __future__ import annotations

import functools

ABBREVIATIONS: frozenset[str] = frozenset("""
mr mrs ms dr prof sr jr st mt rev gen col lt sgt capt gov sen rep hon pres
e.g i.e etc vs cf al approx dept est inc ltd co corp bros no nos vol vols fig figs ed eds
jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun
a.m p.m u.s u.k u.n ph.d b.a m.a b.sc m.sc d.c
min max ft lb lbs oz km kg cm mm sq
""".split())


@functools.lru_cache(maxsize=1)
def sentence_tokenizer():
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(ABBREVIATIONS)
    return PunktSentenceTokenizer(params)


def split_sentences(text: str) -> list[str]:
    return sentence_tokenizer().tokenize(text)


def word_tokenize(text: str) -> list[str]:
    """``nltk.word_tokenize`` without its punkt download: our sentences, then NLTK's Treebank-style word
    tokenizer (what word_tokenize runs on each sentence)."""
    from nltk.tokenize import NLTKWordTokenizer

    words = NLTKWordTokenizer()
    return [w for s in split_sentences(text) for w in words.tokenize(s)]

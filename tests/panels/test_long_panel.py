"""The long-context panel long@1 (issue 39): published hash and version, exact token lengths in the DeepSeek
tokenizer, scored positions per depth bucket, sub-panels by length, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.depth import BUCKET_LABELS, bucket_members
from panels import encode_panel, load_panel, load_tokenizer
from panels.chat import ChatFormatError
from panels.long import (CI_TOKENS, LENGTHS, LONGEST, PER_BUCKET, bucket_counts, depth_positions,
                         encoded_bucket_counts, po_strings, select)
from panels.model import PanelError
from panels.store import parse_item

PUBLISHED = "sha256:9292eae91ebfc42f29c0fc04140716ee6eb8b3b92ec1956ee0229a928a27ccd5"


@pytest.fixture(scope="module")
def panel():
    return load_panel("long@1")


@pytest.fixture(scope="module")
def deepseek():
    return load_tokenizer("deepseek")


def test_published_hash_domains_and_lengths(panel):
    assert panel.ref == "long@1" and panel.content_hash == PUBLISHED
    assert panel.domains() == ("code", "agentic", "knowledge", "multilingual", "structured")
    lengths = {d: sorted(i.tokens for i in panel.items if i.domain == d) for d in panel.domains()}
    assert lengths["code"] == lengths["knowledge"] == [*LENGTHS, LONGEST]
    assert lengths["multilingual"] == lengths["structured"] == lengths["agentic"] == list(LENGTHS)
    assert all(i.score == "positions" and i.positions == depth_positions(i.tokens) for i in panel.items)


def test_ci_items_encode_to_exact_lengths_with_the_chosen_positions(panel, deepseek):
    ci = select(panel, [CI_TOKENS])
    assert ci.content_hash != panel.content_hash and len(ci.items) == 5
    enc = encode_panel(ci, deepseek)
    for seq, item in zip(enc.sequences, ci.items):
        assert len(seq.token_ids) == CI_TOKENS == item.tokens
        assert tuple(np.flatnonzero(seq.scored_mask)) == item.positions
    counts = encoded_bucket_counts(enc)["code-2560"]
    # 2,560 tokens: [1,128) and [128,2048) give 48 each; [2048, 2304) 48 more, and the last 256 (also d2K-8K) 48
    assert counts == {**{b: 0 for b in BUCKET_LABELS}, "d0-128": 48, "d128-2K": 48, "d2K-8K": 96, "last256": 48}
    # the indexer of the tiny V4 (top-512 of ratio 4) prunes from row 2051: scored positions past it exist
    assert sum(p - 1 >= 2051 for p in ci.items[0].positions) >= PER_BUCKET


def test_another_tokenizer_is_refused_not_rescored(panel, deepseek):
    smol = load_tokenizer("smollm2")
    with pytest.raises(ChatFormatError, match="built to 2560 tokens, but tokenizer 'smollm2'"):
        encode_panel(select(panel, [CI_TOKENS], ["code"]), smol)


def test_depth_positions_fill_every_bucket_reached():
    pos = depth_positions(65536)
    assert list(pos) == sorted(set(pos)) and pos[0] >= 1 and pos[-1] < 65536
    counts = bucket_counts(pos, 65536)
    assert counts["d0-128"] == counts["d128-2K"] == counts["d2K-8K"] == counts["d8K-32K"] == PER_BUCKET
    assert counts["last256"] == PER_BUCKET and counts["d32K-128K"] == 2 * PER_BUCKET and counts["d128K+"] == 0
    assert depth_positions(65536) == pos                      # seeded: the same positions every build
    assert depth_positions(40) == tuple(range(1, 40))         # fewer than asked: the whole (tail) range
    short = depth_positions(100)                              # all of it is the tail: 48 of its 99
    assert len(short) == PER_BUCKET and bucket_counts(short, 100)["last256"] == PER_BUCKET
    members = bucket_members(np.array(pos), np.full(len(pos), 65536))
    assert int(members["d128K+"].sum()) == 0


def test_select_refuses_an_absent_length(panel):
    with pytest.raises(PanelError, match="no item of length \\[3000\\]"):
        select(panel, [3000])
    assert select(panel) is panel


@pytest.mark.parametrize("tokens,positions,match", [
    (10, [0, 3], "positions\\[0\\] = 0 is outside"), (10, [3, 3], "does not increase"),
    (10, [3, 10], "positions\\[1\\] = 10 is outside"), (10, [], "non-empty list"), (1, [1], "at least 2"),
])
def test_bad_positions_are_refused_by_the_panel_parser(tokens, positions, match):
    obj = {"id": "x", "domain": "code", "kind": "raw", "score": "positions", "text": "t", "tokens": tokens,
           "positions": positions}
    with pytest.raises(PanelError, match=match):
        parse_item(obj, "long-1.jsonl:1")
    with pytest.raises(PanelError, match="raw items are scored with 'all'"):
        parse_item({**obj, "score": "all"}, "long-1.jsonl:1")


def test_po_strings_reads_translations_only():
    po = ('msgid ""\nmsgstr ""\n"Project-Id-Version: x\\n"\n\nmsgid "Hello"\nmsgstr "Hola"\n\n'
          'msgid ""\n"a long"\n" one"\nmsgstr ""\n"una "\n"larga"\n\nmsgid "untranslated"\nmsgstr ""\n')
    assert po_strings(po) == ["Hola", "una larga"]
    assert json.loads(json.dumps(po_strings(po))) == ["Hola", "una larga"]


def test_panel_show_prints_lengths_and_bucket_counts():
    from typer.testing import CliRunner

    from panels.cli import panel_app

    r = CliRunner().invoke(panel_app, ["show", "long@1"], terminal_width=200)
    assert r.exit_code == 0, r.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in r.output.split("\n") if line.startswith("│") and line.count("│") == 11}
    # id | tokens | scored | d0-128 | d128-2K | d2K-8K | d8K-32K | d32K-128K | d128K+ | last256
    assert rows["code-131072"] == ["131072", "288", "48", "48", "48", "48", "96", "0", "48"]
    assert rows["agentic-2560"] == ["2560", "192", "48", "48", "96", "0", "0", "0", "48"]
    assert len(rows) == 22

"""The published IFEval-reply panel: immutable (its manifest hash holds), chat items whose scored
positions are the oracle's reply only, and the builder refuses to rewrite a published version."""

from __future__ import annotations

import pytest

from core.errors import UserError
from evals.ifeval_panel import PANEL_NAME, build_panel
from panels import encode_panel, load_panel, load_tokenizer
from panels.store import DATA_DIR


def test_the_published_panel_scores_the_reply_only():
    panel = load_panel(PANEL_NAME)               # recomputes the content hash against the manifest
    assert panel.version == 1 and len(panel.items) >= 30
    assert all(i.kind == "chat" and i.score == "last" and i.domain == "chat" for i in panel.items)
    assert all([m.role for m in i.messages] == ["user", "assistant"] for i in panel.items)
    tok = load_tokenizer("smollm2")
    enc = encode_panel(panel, tok)
    for item, seq in zip(panel.items[:5], enc.sequences[:5]):
        scored = [t for t, m in zip(seq.token_ids, seq.scored_mask) if m]
        text = tok.tokenizer.decode(scored, skip_special_tokens=False)
        assert text.rstrip().removesuffix("<|im_end|>").strip() == item.messages[1].content.strip()
        first = seq.scored_mask.index(True)
        prompt = tok.tokenizer.decode(list(seq.token_ids[:first]), skip_special_tokens=False)
        assert item.messages[0].content in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_a_published_version_is_never_rebuilt():
    with pytest.raises(UserError, match=r"ifeval-replies@1 is published and never rewritten; build version 2"):
        build_panel(DATA_DIR.parent, 1, 1, 1, DATA_DIR)

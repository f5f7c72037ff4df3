"""The image panel: its hash follows the pixels (any changed pixel changes it, a re-compressed PNG does not),
its OpenAI messages carry the exact pixels (also inside a tool result), and its encodings lay each image out
as the model's own processor does (transformers' chat template renderer; the DeepSeek-V4.1 oracle's
`prompt_from_ids`)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from panels.images import (IMAGE_DATA_DIR, FixedSpanLayout, encode_image_messages, encode_image_panel,
                           image_panel_hash, load_image_panel, openai_messages, pixels_sha256,
                           read_image_panel_files, scored_after_images)
from panels.model import PanelError, PanelHashMismatch


@pytest.fixture(scope="module")
def panel():
    return load_image_panel("images")


def _copy(tmp_path: Path) -> Path:
    for f in IMAGE_DATA_DIR.glob("images-1*"):
        (shutil.copytree if f.is_dir() else shutil.copy)(f, tmp_path / f.name)
    return tmp_path / "images-1.manifest.json"


def test_the_published_panel_loads_with_its_hash_and_covers_the_kinds(panel):
    man = json.loads((IMAGE_DATA_DIR / "images-1.manifest.json").read_text())
    assert panel.content_hash == man["content_hash"] and panel.ref == "images@1"
    assert load_image_panel("images@1").content_hash == panel.content_hash   # stable across loads
    assert {"note-total.png", "chart-sales.png", "screen-editor.png", "table-stock.png", "photo-dusk.png"} <= set(panel.images)
    tool = panel.item("img-tool-screenshot")
    assert [m.role for m in tool.messages if m.images] == ["tool"]
    assert max(len(it.images) for it in panel.items) == 2
    assert sum(1 for it in panel.items if it.readback) >= 3 and any(not it.images for it in panel.items)


def test_pixel_hash_is_sha256_of_size_and_rgb_bytes():
    rgb = np.array([[[1, 2, 3], [4, 5, 6]]], dtype=np.uint8)       # 1 x 2 pixels
    want = hashlib.sha256(b"rgb8:2x1\n" + bytes([1, 2, 3, 4, 5, 6])).hexdigest()
    assert pixels_sha256(rgb) == "sha256:" + want
    assert pixels_sha256(rgb.reshape(2, 1, 3)) != pixels_sha256(rgb)  # same bytes, other shape


def test_one_changed_pixel_changes_the_hash_and_the_load_refuses_it(tmp_path):
    manifest = _copy(tmp_path)
    base = image_panel_hash(*read_image_panel_files(tmp_path / "images-1.jsonl", tmp_path / "images-1"))
    png = tmp_path / "images-1" / "chart-sales.png"
    rgb = np.asarray(Image.open(png).convert("RGB")).copy()
    rgb[7, 11, 2] ^= 1                                              # one channel of one pixel, by one
    Image.fromarray(rgb).save(png)
    moved = image_panel_hash(*read_image_panel_files(tmp_path / "images-1.jsonl", tmp_path / "images-1"))
    assert moved != base
    with pytest.raises(PanelHashMismatch, match="pixel"):
        load_image_panel(manifest)


def test_recompressed_png_with_the_same_pixels_keeps_the_hash(tmp_path, panel):
    manifest = _copy(tmp_path)
    png = tmp_path / "images-1" / "photo-dusk.png"
    before = png.read_bytes()
    Image.open(png).convert("RGB").save(png, compress_level=0)
    assert png.read_bytes() != before
    assert load_image_panel(manifest).content_hash == panel.content_hash


def test_an_edited_item_changes_the_hash(tmp_path):
    manifest = _copy(tmp_path)
    items = tmp_path / "images-1.jsonl"
    items.write_text(items.read_text().replace("What is written on this receipt?", "What is written here?"))
    with pytest.raises(PanelHashMismatch):
        load_image_panel(manifest)


def test_bad_items_are_refused_with_the_line(tmp_path):
    _copy(tmp_path)
    items = tmp_path / "images-1.jsonl"
    lines = items.read_text().split("\n")
    lines[1] = lines[1].replace('"note-code.png"', '"missing.png"')
    items.write_text("\n".join(lines))
    with pytest.raises(PanelError, match=r"images-1.jsonl \(item 'img-note-code'\).*missing.png"):
        read_image_panel_files(items, tmp_path / "images-1")
    lines[1] = lines[1].replace('"type": "image", "file": "missing.png"', '"type": "video", "file": "x.png"')
    items.write_text("\n".join(lines))
    with pytest.raises(PanelError, match=r"images-1.jsonl:2 .*unknown part type 'video'"):
        read_image_panel_files(items, tmp_path / "images-1")


def test_openai_messages_carry_the_exact_pixels_also_in_tool_results(panel):
    item = panel.item("img-tool-screenshot")
    msgs = openai_messages(panel, item)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    call = msgs[1]["tool_calls"][0]
    assert call["type"] == "function" and json.loads(call["function"]["arguments"]) == {"window": "editor"}
    tool = msgs[2]
    assert tool["tool_call_id"] == "call_1"
    part = [p for p in tool["content"] if p["type"] == "image_url"][0]
    url = part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
    assert np.array_equal(decoded, panel.images["screen-editor.png"].rgb)
    two = openai_messages(panel, panel.item("img-two-photos"))[0]["content"]
    assert [p["type"] for p in two] == ["text", "image_url", "image_url", "text"]
    assert len(openai_messages(panel, item, upto=3)) == 3


def test_scored_positions_are_the_text_after_the_first_image():
    from panels.model import ImageSpanRef

    spans = (ImageSpanRef(2, 3, "a.png"), ImageSpanRef(7, 2, "b.png"))
    assert scored_after_images(10, spans) == [False] * 5 + [True, True, False, False, True]
    assert scored_after_images(3, ()) == [False, True, True]


def test_encoding_equals_transformers_rendering_of_content_parts(panel):
    """The panel renders image parts as a sentinel through its own jinja renderer; transformers renders the
    OpenAI content parts with the same template (what vLLM does): the ids must agree, image for image."""
    from transformers import AutoTokenizer

    from engine.vlm import ensure_tiny_vlm, image_layout
    from panels import load_tokenizer

    d = ensure_tiny_vlm()
    tok, layout = load_tokenizer(d), image_layout(d)
    hf = AutoTokenizer.from_pretrained(str(d))
    enc = encode_image_panel(panel, tok, layout)
    for it, e in zip(panel.items, enc.sequences):
        msgs = []
        for m in it.messages:
            d_ = {"role": m.role, "content": m.text() if m.role == "assistant" else
                  [{"type": "text", "text": p.text} if hasattr(p, "text") else {"type": "image"} for p in m.parts]}
            if m.tool_calls:
                d_["tool_calls"] = [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                    for c in m.tool_calls]
            msgs.append(d_)
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        expanded = []
        for t in ids:
            expanded += list(layout.span_ids(None)) if t == layout.image_token_id else [t]
        assert expanded == list(e.token_ids), it.id
        assert [s.start for s in e.spans] == [i for i, t in enumerate(expanded) if t == layout.prefix[0]][::2]


def test_deepseek_encoding_is_what_the_oracle_lays_out(panel):
    """Encoded for DeepSeek-V4.1 (its tokenizer and encoder, spans from the oracle's plan_grid), every item's
    ids are accepted by the oracle's prompt_from_ids, which recomputes each span from the image."""
    from oracle.dsv41.config import ModelConfig
    from oracle.dsv41.image_processor import DeepSeekImageLayout, prompt_from_ids
    from panels import load_tokenizer

    cfg = ModelConfig()
    layout = DeepSeekImageLayout(cfg)
    enc = encode_image_panel(panel, load_tokenizer("deepseek"), layout)
    for e in enc.sequences:
        if not e.spans:
            continue
        p = prompt_from_ids(e.token_ids, [(s.start, panel.images[s.file].rgb) for s in e.spans], cfg)
        assert [s.start for s in p.spans] == [s.start for s in e.spans]
        first = e.spans[0]
        with pytest.raises(Exception, match="image_token_id"):   # a span shifted by one is refused
            prompt_from_ids(e.token_ids, [(first.start + 1, panel.images[first.file].rgb)], cfg)


def test_the_generator_reproduces_every_stored_image(panel):
    """panels/image_gen.py draws images@1 pixel for pixel. A Pillow / matplotlib that draws one pixel
    differently fails here: publish a new panel version from the new drawings, never rewrite images-1."""
    from panels.image_gen import IMAGES_1

    assert sorted(f"{k}.png" for k in IMAGES_1) == sorted(panel.images)
    for stem, draw in IMAGES_1.items():
        rgb = np.asarray(draw().convert("RGB"))
        assert pixels_sha256(rgb) == panel.images[f"{stem}.png"].pixels_sha256, stem


def test_image_items_are_chat_items_of_the_one_panel_model(panel):
    """One Panel / PanelItem / Message family: an image item is a chat item scored after its images whose user
    and tool messages hold parts; written back, every item is its line of the published file, and a text
    message's JSON (hence a text panel's hash) is what it always was."""
    from panels.images import image_item_json
    from panels.model import ImagePart, Message, Panel, PanelItem, TextPart

    assert isinstance(panel, Panel) and all(isinstance(it, PanelItem) for it in panel.items)
    assert {(it.kind, it.score) for it in panel.items} == {("chat", "after_images")}
    lines = [json.loads(x) for x in (IMAGE_DATA_DIR / "images-1.jsonl").read_text().splitlines() if x.strip()]
    assert [image_item_json(it) for it in panel.items] == lines
    two = panel.item("img-two-photos")
    user = next(m for m in two.messages if len(m.images) == 2)
    assert isinstance(user.content, tuple) and {type(p) for p in user.content} == {TextPart, ImagePart}
    assert user.text("<img>").count("<img>") == 2 and "<img>" not in user.text()
    assert Message("user", "hi").to_json() == {"role": "user", "content": "hi"}
    assert Message("user", "hi").parts == (TextPart("hi"),) and Message("user", "").parts == ()

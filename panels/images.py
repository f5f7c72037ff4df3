"""Image panels: versioned chat transcripts whose user and tool messages carry images.

    panel = load_image_panel("images")                       # newest version; "images@1"; a manifest path
    enc = encode_image_panel(panel, tokenizer, layout)       # ids with each image's span laid out
    msgs = openai_messages(panel, item)                      # OpenAI chat messages, image_url data URLs

Files: ``panels/data/images/<name>-<version>.jsonl`` (one item a line), ``<name>-<version>/`` (the PNGs) and
``<name>-<version>.manifest.json`` (name, version, content hash). The content hash covers the items' JSON and
each image's **pixels** (``pixels_sha256``: RGB bytes and size, not the PNG bytes), so any changed pixel
changes it and re-compressing a PNG does not. Loading refuses a mismatch, as text panels do.

An item's messages hold parts: ``{"type": "text", "text": ...}`` or ``{"type": "image", "file": NAME.png}``;
a tool message may hold images (a screenshot a tool returned). The last message is the assistant reply.
Loaded, an image panel is the one panel model of ``panels/model.py``: a ``Panel`` whose ``images`` map file
names to ``PanelImage``, chat ``PanelItem``s (score policy ``after_images``, optional ``readback``) whose
``Message`` content is a tuple of ``TextPart`` / ``ImagePart``, and an ``EncodedPanel`` whose sequences carry
their image spans. This module keeps what is image-specific: pixels, their hash, the image store, the layout.

Encoding (``encode_image_panel``): each image part becomes the span ``layout.span_ids(image)`` gives (the
model's own rule: Idefics3's markers around a fixed run of image ids, DeepSeek-V4.1's ``image_token_id`` run
over the grid ``oracle.dsv41.image_processor.plan_grid`` gives); the text between images is rendered by the tokenizer's
chat format with a sentinel per image, split there and tokenized piece by piece (vLLM and HF processors
tokenize around the image placeholder token the same way). Scored: the text positions after the first
image (every non-image position; in an item without images, every position but 0).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from core.domains import DOMAINS
from panels.model import (EncodedPanel, EncodedSequence, ImagePart, ImageSpanRef, Message, Panel, PanelError,
                          PanelHashMismatch, PanelItem, Part, TextPart, ToolCall, ToolSpec)
from panels.store import DATA_DIR, canonical_json
from panels.store import _check_keys as _keys, _need   # the text panels' field checks
from panels.tokenizers import PanelTokenizer

IMAGE_DATA_DIR = DATA_DIR / "images"
# a private-use character no panel text holds: where an image sits in the rendered chat
IMAGE_SENTINEL = "\ue0a0"
_REF_RE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9_-]*)(?:@(?P<version>[0-9]+))?$")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_FILE_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}\.png$")
MAX_IMAGE_SIDE = 2048


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class PanelImage:
    """One stored image: its RGB pixels (uint8 [H, W, 3]) and their hash."""

    file: str
    rgb: np.ndarray = field(repr=False, compare=False)
    pixels_sha256: str

    @property
    def width(self) -> int:
        return int(self.rgb.shape[1])

    @property
    def height(self) -> int:
        return int(self.rgb.shape[0])

    def pil(self):
        from PIL import Image

        return Image.fromarray(self.rgb, "RGB")

    def png(self) -> bytes:
        """The pixels as a PNG (lossless: decoding it gives back exactly `rgb`)."""
        buf = io.BytesIO()
        self.pil().save(buf, format="PNG")
        return buf.getvalue()

    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png()).decode("ascii")


def pixels_sha256(rgb: np.ndarray) -> str:
    """sha256 over the size and the raw RGB bytes: changes with any pixel, not with the PNG encoding."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise PanelError(f"pixels must be RGB uint8 [H, W, 3], got {rgb.dtype} {list(rgb.shape)}")
    h = hashlib.sha256(f"rgb8:{rgb.shape[1]}x{rgb.shape[0]}\n".encode())
    h.update(np.ascontiguousarray(rgb).tobytes())
    return "sha256:" + h.hexdigest()


def image_item_json(item: PanelItem) -> dict[str, Any]:
    """An image item as its panel file writes it (no kind or score: every image item is a chat scored after
    its images)."""
    return {k: v for k, v in item.to_json().items() if k not in ("kind", "score")}


def image_panel_hash(items: Sequence[PanelItem], images: Mapping[str, PanelImage]) -> str:
    """sha256 over the canonical JSON of the items and of every used image's pixel hash."""
    used = sorted({f for it in items for f in it.images})
    doc = {"items": [image_item_json(i) for i in items], "images": {f: images[f].pixels_sha256 for f in used}}
    return "sha256:" + hashlib.sha256(canonical_json(doc)).hexdigest()


# ---------------------------------------------------------------------------------------------- parsing
def _parse_part(obj: Any, where: str) -> Part:
    if not isinstance(obj, dict):
        raise PanelError(f"{where}: a content part must be an object")
    kind = _need(obj, "type", str, where)
    if kind == "text":
        _keys(obj, {"type", "text"}, where)
        text = _need(obj, "text", str, where)
        if not text:
            raise PanelError(f"{where}: empty text part")
        if IMAGE_SENTINEL in text:
            raise PanelError(f"{where}: text holds U+{ord(IMAGE_SENTINEL):04X}, the encoder's image marker")
        return TextPart(text)
    if kind == "image":
        _keys(obj, {"type", "file"}, where)
        name = _need(obj, "file", str, where)
        if not _FILE_RE.match(name):
            raise PanelError(f"{where}: image file {name!r} must be a bare lowercase NAME.png")
        return ImagePart(name)
    raise PanelError(f"{where}: unknown part type {kind!r}; expected 'text' or 'image'")


def _parse_message(obj: Any, where: str) -> Message:
    if not isinstance(obj, dict):
        raise PanelError(f"{where}: a message must be an object")
    _keys(obj, {"role", "content", "tool_calls", "tool_call_id"}, where)
    role = _need(obj, "role", str, where)
    if role not in ("system", "user", "assistant", "tool"):
        raise PanelError(f"{where}: unknown role {role!r}")
    content = obj.get("content")
    if role == "assistant":
        if not isinstance(content, str):
            raise PanelError(f"{where}: an assistant message's content is a string (assistants send no images)")
        parts: str | tuple[Part, ...] = content
    else:
        if not isinstance(content, list) or not content:
            raise PanelError(f"{where}: a {role} message's content is a non-empty list of parts")
        parts = tuple(_parse_part(p, f"{where} content[{k}]") for k, p in enumerate(content))
        if role == "system" and any(isinstance(p, ImagePart) for p in parts):
            raise PanelError(f"{where}: a system message cannot carry images")
    calls = []
    for k, c in enumerate(obj.get("tool_calls", [])):
        cw = f"{where} tool_calls[{k}]"
        if role != "assistant" or not isinstance(c, dict):
            raise PanelError(f"{cw}: only assistant messages carry tool calls, as objects")
        _keys(c, {"id", "name", "arguments"}, cw)
        calls.append(ToolCall(_need(c, "id", str, cw), _need(c, "name", str, cw), _need(c, "arguments", dict, cw)))
    call_id = obj.get("tool_call_id")
    if (role == "tool") != isinstance(call_id, str):
        raise PanelError(f"{where}: 'tool_call_id' is required on tool messages and only there")
    if not parts and not calls:
        raise PanelError(f"{where}: empty {role} message")
    return Message(role, parts, tuple(calls), call_id)


def parse_image_item(obj: Any, where: str) -> PanelItem:
    if not isinstance(obj, dict):
        raise PanelError(f"{where}: an item must be a JSON object")
    _keys(obj, {"id", "domain", "messages", "tools", "readback"}, where)
    item_id = _need(obj, "id", str, where)
    if not _ID_RE.match(item_id):
        raise PanelError(f"{where}: bad id {item_id!r}")
    where = f"{where} (item '{item_id}')"
    domain = _need(obj, "domain", str, where)
    if domain not in DOMAINS:
        raise PanelError(f"{where}: unknown domain {domain!r}; expected one of {list(DOMAINS)}")
    msgs = tuple(_parse_message(m, f"{where} messages[{k}]") for k, m in enumerate(_need(obj, "messages", list, where)))
    if not msgs or msgs[-1].role != "assistant" or not msgs[-1].text().strip():
        raise PanelError(f"{where}: the last message must be a non-empty assistant reply")
    tools = []
    for k, t in enumerate(obj.get("tools", [])):
        tw = f"{where} tools[{k}]"
        if not isinstance(t, dict):
            raise PanelError(f"{tw}: a tool must be an object")
        _keys(t, {"name", "description", "parameters"}, tw)
        tools.append(ToolSpec(_need(t, "name", str, tw), _need(t, "description", str, tw),
                              _need(t, "parameters", dict, tw)))
    names, open_ids = {t.name for t in tools}, set()
    for k, m in enumerate(msgs):
        for c in m.tool_calls:
            if c.name not in names:
                raise PanelError(f"{where} messages[{k}]: call to undeclared tool {c.name!r}")
            open_ids.add(c.id)
        if m.role == "tool" and m.tool_call_id not in open_ids:
            raise PanelError(f"{where} messages[{k}]: tool result for unknown call id {m.tool_call_id!r}")
    readback = obj.get("readback")
    if readback is not None and (not isinstance(readback, str) or not readback.strip()):
        raise PanelError(f"{where}: 'readback' must be a non-empty string")
    if readback is not None and not any(m.images for m in msgs):
        raise PanelError(f"{where}: a read-back item needs an image")
    return PanelItem(item_id, domain, "chat", "after_images", messages=msgs, tools=tuple(tools), readback=readback)


def load_image(path: Path, where: str) -> PanelImage:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            if im.format != "PNG":
                raise PanelError(f"{where}: {path.name} is {im.format}, not PNG")
            if max(im.size) > MAX_IMAGE_SIDE:
                raise PanelError(f"{where}: {path.name} is {im.size[0]}x{im.size[1]}; sides are at most {MAX_IMAGE_SIDE}")
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
    except FileNotFoundError:
        raise PanelError(f"{where}: image file {path} not found") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise PanelError(f"{where}: {path} is not a readable PNG ({type(exc).__name__}: {exc})") from None
    return PanelImage(path.name, rgb, pixels_sha256(rgb))


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PanelError(f"{path}: cannot read the image panel manifest ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise PanelError(f"{path}: a manifest must be a JSON object")
    _keys(obj, {"name", "version", "file", "images_dir", "content_hash", "description"}, str(path))
    for key, typ in (("name", str), ("version", int), ("file", str), ("images_dir", str), ("content_hash", str)):
        _need(obj, key, typ, str(path))
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", obj["content_hash"]):
        raise PanelError(f"{path}: content_hash must be 'sha256:<64 hex>'")
    return obj


def read_image_panel_files(items_path: Path, images_dir: Path) -> tuple[tuple[PanelItem, ...], dict[str, PanelImage]]:
    """The items of a JSONL file and every image they name, decoded (no hash check: see load_image_panel)."""
    try:
        lines = items_path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise PanelError(f"{items_path}: cannot read the panel ({type(exc).__name__}: {exc})") from None
    items: list[PanelItem] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{items_path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PanelError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        item = parse_image_item(obj, where)
        if item.id in seen:
            raise PanelError(f"{where}: duplicate id {item.id!r} (first on line {seen[item.id]})")
        seen[item.id] = lineno
        items.append(item)
    if not items:
        raise PanelError(f"{items_path}: no items")
    images: dict[str, PanelImage] = {}
    for it in items:
        for f in it.images:
            if f not in images:
                images[f] = load_image(images_dir / f, f"{items_path} (item '{it.id}')")
    return tuple(items), images


def load_image_panel(ref: str | Path = "images", data_dir: Path = IMAGE_DATA_DIR) -> Panel:
    """`name` (newest version), `name@version`, or a manifest path; refuses content that moved off its hash."""
    if str(ref).endswith(".manifest.json"):
        mpath = Path(ref)
    else:
        m = _REF_RE.match(str(ref))
        if not m:
            raise PanelError(f"bad image panel reference {str(ref)!r}; use NAME, NAME@VERSION or a manifest path")
        found = sorted(data_dir.glob(f"{m['name']}-*.manifest.json"),
                       key=lambda p: int(p.name.removesuffix(".manifest.json").rsplit("-", 1)[1]))
        if m["version"] is not None:
            found = [p for p in found if p.name == f"{m['name']}-{m['version']}.manifest.json"]
        if not found:
            raise PanelError(f"no image panel {str(ref)!r} in {data_dir}")
        mpath = found[-1]
    man = _read_manifest(mpath)
    items, images = read_image_panel_files(mpath.parent / man["file"], mpath.parent / man["images_dir"])
    got = image_panel_hash(items, images)
    if got != man["content_hash"]:
        raise PanelHashMismatch(f"{mpath}: content hash {got} does not match the published {man['content_hash']} "
                                "(an item or a pixel changed). A published panel never changes; publish a new version.")
    return Panel(man["name"], man["version"], got, items, man.get("description", ""), images)


# ---------------------------------------------------------------------------------------------- OpenAI shape
def openai_messages(panel: Panel, item: PanelItem, *, upto: int | None = None) -> list[dict[str, Any]]:
    """The item's messages (or the first `upto`) as an OpenAI chat request sends them: user and tool content
    as parts, images as ``image_url`` parts with PNG data URLs, tool calls with JSON-string arguments."""
    out: list[dict[str, Any]] = []
    for m in item.messages[:upto]:
        if m.role == "assistant":
            d: dict[str, Any] = {"role": "assistant", "content": m.text()}
        else:
            parts = []
            for p in m.parts:
                if isinstance(p, TextPart):
                    parts.append({"type": "text", "text": p.text})
                else:
                    parts.append({"type": "image_url", "image_url": {"url": panel.images[p.file].data_url()}})
            d = {"role": m.role, "content": parts}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def openai_tools(item: PanelItem) -> list[dict[str, Any]]:
    return [{"type": "function", "function": t.to_json()} for t in item.tools]


# ---------------------------------------------------------------------------------------------- encoding
class ImageLayout(Protocol):
    """How a model lays out an image in the token sequence: the ids of its span, in which the positions
    holding `image_token_id` take the image's rows (the others are the model's markers around them)."""

    name: str
    image_token_id: int

    def span_ids(self, image: PanelImage) -> Sequence[int]: ...


@dataclass(frozen=True)
class FixedSpanLayout:
    """Every image takes the same span: `prefix`, `tokens_per_image` image ids, `suffix` (an unsplit
    Idefics3 / LLaVA-style tower at one crop size)."""

    name: str
    image_token_id: int
    tokens_per_image: int
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def span_ids(self, image: PanelImage) -> tuple[int, ...]:
        return (*self.prefix, *([self.image_token_id] * self.tokens_per_image), *self.suffix)


def _as_messages(item: PanelItem, upto: int | None) -> list[Message]:
    """The transcript as the chat format renders it: text, each image part written as the sentinel."""
    return [replace(m, content=m.text(IMAGE_SENTINEL)) for m in item.messages[:upto]]


def encode_image_messages(item: PanelItem, images: Mapping[str, PanelImage], tok: PanelTokenizer,
                          layout: ImageLayout, *, upto: int | None = None,
                          add_generation_prompt: bool = False) -> tuple[list[int], tuple[ImageSpanRef, ...]]:
    """Token ids of the item's messages (the first `upto`) with every image's span laid out, and the spans."""
    text = tok.chat_format.render(_as_messages(item, upto), item.tools, add_generation_prompt)
    files = [f for m in item.messages[:upto] for f in m.images]
    pieces = text.split(IMAGE_SENTINEL)
    if len(pieces) != len(files) + 1:
        raise PanelError(f"item '{item.id}': the chat format rendered {len(pieces) - 1} of {len(files)} images")
    ids: list[int] = []
    spans = []
    for k, piece in enumerate(pieces):
        if piece:
            got = list(tok.tokenizer.encode(piece, add_special_tokens=False).ids)
            if layout.image_token_id in got:
                raise PanelError(f"item '{item.id}': its text encodes to the image token {layout.image_token_id}")
            ids += got
        if k < len(files):
            span = [int(t) for t in layout.span_ids(images[files[k]])]
            if layout.image_token_id not in span:
                raise PanelError(f"item '{item.id}' image {files[k]}: layout {layout.name} gives a span without "
                                 f"the image token {layout.image_token_id}")
            spans.append(ImageSpanRef(len(ids), len(span), files[k]))
            ids += span
    return ids, tuple(spans)


def scored_after_images(n: int, spans: Sequence[ImageSpanRef]) -> list[bool]:
    """Text positions after the first image; with no image, every position but 0."""
    first = spans[0].end if spans else 1
    mask = [i >= first for i in range(n)]
    for s in spans:
        mask[s.start:s.end] = [False] * s.length
    if mask:
        mask[0] = False
    return mask


def encode_image_panel(panel: Panel, tok: PanelTokenizer, layout: ImageLayout) -> EncodedPanel:
    seqs = []
    for it in panel.items:
        ids, spans = encode_image_messages(it, panel.images, tok, layout)
        mask = scored_after_images(len(ids), spans)
        if not any(mask):
            raise PanelError(f"item '{it.id}': no text position after its images")
        seqs.append(EncodedSequence(it.id, it.domain, tuple(ids), tuple(mask), spans))
    ident = hashlib.sha256(f"{tok.hash}\0{layout.name}\0{layout.image_token_id}".encode()).hexdigest()
    return EncodedPanel(panel.name, panel.version, panel.content_hash, "sha256:" + ident, tuple(seqs),
                        tokenizer_name=tok.name, chat_format=tok.chat_format.name,
                        notes=(f"image layout {layout.name}",), layout=layout.name)


def publish_manifest(items_path: Path, images_dir: Path, name: str, version: int, description: str) -> dict[str, Any]:
    """The manifest a new panel version publishes (used once, when the version is written)."""
    items, images = read_image_panel_files(items_path, images_dir)
    return {"name": name, "version": version, "file": items_path.name, "images_dir": images_dir.name,
            "content_hash": image_panel_hash(items, images), "description": description}

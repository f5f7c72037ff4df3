"""Typed records for panels and their encodings.

Everything here is a frozen dataclass so a loaded panel cannot be mutated by accident: the content
hash is computed once at load time and must stay true for the object's lifetime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from core.domains import DOMAINS
from core.errors import UserError


ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

# Which positions of an item are scored. Part of each item, hence part of the content hash.
#   all        every position 1..L-1 of the sequence (raw items; position 0 never has a distribution)
#   assistant  the tokens of every assistant message (content, tool calls, end-of-turn marker)
#   last       only the final assistant message
#   after_images  image panels: every text position after the first image (panels/images.py)
#   positions  raw items built to an exact token length (`tokens`): only the listed positions (long panels,
#              chosen per depth bucket: panels/long.py)
ScorePolicy = Literal["all", "assistant", "last", "after_images", "positions"]
SCORE_POLICIES: tuple[str, ...] = ("all", "assistant", "last", "positions")   # what a text panel file may name


class PanelError(UserError, ValueError):
    """A panel file, manifest or item is malformed. The message names the file and line."""


class PanelHashMismatch(PanelError):
    """A published panel's content no longer matches the hash in its manifest."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class ToolSpec:
    """A function the assistant may call, in the JSON-schema shape every chat format accepts."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass(frozen=True)
class TextPart:
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text}


@dataclass(frozen=True)
class ImagePart:
    """An image of the panel's image store (panels/images.py), by file name."""

    file: str

    def to_json(self) -> dict[str, Any]:
        return {"type": "image", "file": self.file}


Part = TextPart | ImagePart


@dataclass(frozen=True)
class Message:
    """One chat message. `content` is its text, or a sequence of parts (text and images) for the user and
    tool messages of image panels; a text panel's messages hold strings, so their JSON (and hash) is text."""

    role: str
    content: str | tuple[Part, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    # Assistant reasoning text, rendered only by formats with a thinking mode.
    reasoning: str | None = None

    @property
    def parts(self) -> tuple[Part, ...]:
        if isinstance(self.content, str):
            return (TextPart(self.content),) if self.content else ()
        return self.content

    @property
    def images(self) -> tuple[str, ...]:
        return tuple(p.file for p in self.parts if isinstance(p, ImagePart))

    def text(self, image_marker: str = "") -> str:
        """The text of the message, each image part written as `image_marker`."""
        return "".join(p.text if isinstance(p, TextPart) else image_marker for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else [p.to_json() for p in self.content]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_json() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class PanelItem:
    """One panel entry: raw text, or a chat transcript that ends in an assistant reply."""

    id: str
    domain: str
    kind: Literal["raw", "chat"]
    score: ScorePolicy
    text: str | None = None
    messages: tuple[Message, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    lang: str | None = None
    readback: str | None = None   # image panels: the string rendered in the item's image (the read-back check)
    tokens: int | None = None     # score "positions": the exact token count the text was built to
    positions: tuple[int, ...] = ()   # score "positions": the scored positions, increasing, in [1, tokens)

    @property
    def images(self) -> tuple[str, ...]:
        return tuple(f for m in self.messages for f in m.images)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "domain": self.domain, "kind": self.kind, "score": self.score}
        if self.kind == "raw":
            out["text"] = self.text
        else:
            out["messages"] = [m.to_json() for m in self.messages]
            if self.tools:
                out["tools"] = [t.to_json() for t in self.tools]
        if self.lang is not None:
            out["lang"] = self.lang
        if self.readback is not None:
            out["readback"] = self.readback
        if self.tokens is not None:
            out["tokens"] = self.tokens
            out["positions"] = list(self.positions)
        return out


@dataclass(frozen=True)
class Panel:
    name: str
    version: int
    content_hash: str
    items: tuple[PanelItem, ...]
    description: str = ""
    # image panels: file name -> panels.images.PanelImage (pixels and their hash); empty for text panels
    images: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def item(self, item_id: str) -> PanelItem:
        for it in self.items:
            if it.id == item_id:
                return it
        raise PanelError(f"panel {self.ref}: no item {item_id!r}")

    def domains(self) -> tuple[str, ...]:
        seen = dict.fromkeys(i.domain for i in self.items)
        return tuple(d for d in DOMAINS if d in seen) + tuple(d for d in seen if d not in DOMAINS)


@dataclass(frozen=True)
class PanelInfo:
    """What `list_panels` reports without parsing the items."""

    name: str
    version: int
    content_hash: str
    path: str
    description: str


@dataclass(frozen=True)
class ImageSpanRef:
    """Where one image sits in an encoded sequence: `length` ids from `start`, the layout's span for `file`."""

    start: int
    length: int
    file: str

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class EncodedSequence:
    seq_id: str
    domain: str
    token_ids: tuple[int, ...]
    scored_mask: tuple[bool, ...]
    spans: tuple[ImageSpanRef, ...] = ()   # image panels: each image's span, in order

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.scored_mask):
            raise ValueError(f"{self.seq_id}: {len(self.token_ids)} ids but {len(self.scored_mask)} mask entries")
        if self.scored_mask and self.scored_mask[0]:
            raise ValueError(f"{self.seq_id}: position 0 has no distribution and cannot be scored")

    @property
    def n_scored(self) -> int:
        return sum(self.scored_mask)


@dataclass(frozen=True)
class EncodedPanel:
    panel_name: str
    panel_version: int
    panel_hash: str
    tokenizer_hash: str
    sequences: tuple[EncodedSequence, ...]
    tokenizer_name: str = ""
    chat_format: str = ""
    notes: tuple[str, ...] = field(default=())
    layout: str = ""   # image panels: the image layout the spans were laid out with

    def spans(self, seq_id: str) -> tuple[ImageSpanRef, ...]:
        for s in self.sequences:
            if s.seq_id == seq_id:
                return s.spans
        raise KeyError(seq_id)

    def scored_by_domain(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sequences:
            out[s.domain] = out.get(s.domain, 0) + s.n_scored
        return out

"""Typed records for panels and their encodings.

Everything here is a frozen dataclass so a loaded panel cannot be mutated by accident: the content
hash is computed once at load time and must stay true for the object's lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from core.domains import DOMAINS
from core.errors import UserError


ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

# Which positions of an item are scored. Part of each item, hence part of the content hash.
#   all        every position 1..L-1 of the sequence (raw items; position 0 never has a distribution)
#   assistant  the tokens of every assistant message (content, tool calls, end-of-turn marker)
#   last       only the final assistant message
ScorePolicy = Literal["all", "assistant", "last"]
SCORE_POLICIES: tuple[str, ...] = ("all", "assistant", "last")


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
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    # Assistant reasoning text, rendered only by formats with a thinking mode.
    reasoning: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
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
        return out


@dataclass(frozen=True)
class Panel:
    name: str
    version: int
    content_hash: str
    items: tuple[PanelItem, ...]
    description: str = ""

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

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
class EncodedSequence:
    seq_id: str
    domain: str
    token_ids: tuple[int, ...]
    scored_mask: tuple[bool, ...]

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

    def scored_by_domain(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sequences:
            out[s.domain] = out.get(s.domain, 0) + s.n_scored
        return out

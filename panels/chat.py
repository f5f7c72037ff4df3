"""Chat formats: turn a panel transcript into the exact prompt text a model was trained on.

Two formats:

* `HFJinjaFormat` renders a Hugging Face chat template (jinja, as shipped in chat_template.jinja or
  tokenizer_config.json). SmolLM2 uses this (ChatML with a default system message).
* `DeepSeekV41Format` is our own implementation of the DeepSeek-V4.1 prompt encoding. The V4.1
  checkpoint ships an `encoding/` folder and no jinja template; vLLM formats its chats with a Python
  encoder. The rules below follow the public description of that encoder (vllm-project/vllm
  `vllm/tokenizers/deepseek_v41_encoding.py` and its test fixtures); the code is ours.

Scored spans are found the same way for both formats, by rendering prefixes: the reply of assistant
message i is the text between render(messages[:i], generation prompt on) and render(messages[:i+1]).
That only works when rendering is prefix-stable, which `chat_spans` checks instead of assuming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.errors import UserError
from panels.model import Message, PanelItem, ToolSpec


class ChatFormatError(UserError, ValueError):
    """A transcript cannot be rendered faithfully by this chat format."""


class ChatFormat(Protocol):
    name: str

    def identity(self) -> bytes:
        """Bytes that pin the rendering rules; part of the tokenizer hash."""

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSpec], add_generation_prompt: bool) -> str: ...

    def markers(self) -> tuple[str, ...]:
        """Control strings the format emits that the model expects as single special tokens."""


# ----------------------------------------------------------------------------------------------
# Hugging Face jinja templates


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatFormatError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    # Templates that print today's date make renders time-dependent; a fixed date keeps panels
    # reproducible. The date is part of the format identity through the template source.
    return datetime(2026, 1, 1).strftime(fmt)


# Tool rendering for templates that know nothing about tools (SmolLM2's ChatML template ignores
# `tool_calls` and would drop them). The transcript is then written in the widely used
# `<tool_call>{json}</tool_call>` text convention. It is part of the format identity, never implicit.
INLINE_TOOLS_INTRO = (
    "# Tools\n\nYou can call the functions described below. Their signatures, one JSON object per line:\n"
    "<tools>\n{schemas}\n</tools>\n\n"
    'To call a function, reply with a <tool_call></tool_call> block that holds a JSON object with "name" '
    'and "arguments". Results come back in messages from the role "tool".'
)


@dataclass(frozen=True)
class HFJinjaFormat:
    template: str
    bos_token: str = ""
    eos_token: str = ""
    special_tokens: tuple[str, ...] = ()
    name: str = "hf-jinja"
    _compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], undefined=jinja2.StrictUndefined
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            compiled = env.from_string(self.template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatFormatError(f"chat template line {e.lineno}: {e.message}") from e
        object.__setattr__(self, "_compiled", compiled)

    @property
    def native_tools(self) -> bool:
        return "tool_calls" in self.template

    @property
    def tool_style(self) -> str:
        return "template" if self.native_tools else "inline-tool_call-json"

    def identity(self) -> bytes:
        return f"hf-jinja/1\ntool_style={self.tool_style}\n".encode() + self.template.encode("utf-8")

    def markers(self) -> tuple[str, ...]:
        return tuple(t for t in self.special_tokens if t and t in self.template)

    def _messages_json(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                if self.native_tools:
                    d["tool_calls"] = [
                        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in m.tool_calls
                    ]
                else:
                    blocks = [
                        "<tool_call>\n" + _tojson({"name": c.name, "arguments": c.arguments}) + "\n</tool_call>"
                        for c in m.tool_calls
                    ]
                    d["content"] = (m.content + "\n" if m.content else "") + "\n".join(blocks)
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.reasoning is not None:
                d["reasoning_content"] = m.reasoning
            out.append(d)
        if tools and not self.native_tools:
            intro = INLINE_TOOLS_INTRO.format(schemas="\n".join(_tojson(t.to_json()) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + intro}
            else:
                out.insert(0, {"role": "system", "content": intro})
        return out

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSpec], add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {
            "messages": self._messages_json(messages, tools),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if tools and self.native_tools:
            kwargs["tools"] = [{"type": "function", "function": t.to_json()} for t in tools]
        try:
            return self._compiled.render(**kwargs)
        except jinja2.UndefinedError as e:
            raise ChatFormatError(f"chat template needs a variable we do not provide: {e}") from e


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4.1

DS_BOS = "<｜begin▁of▁sentence｜>"
DS_EOS = "<｜end▁of▁sentence｜>"
DS_USER = "<｜User｜>"
DS_ASSISTANT = "<｜Assistant｜>"
DS_SYSTEM = "<｜System｜>"
DS_THINK = "<think>"
DS_END_THINK = "</think>"
DS_DSML = "｜DSML｜"

# Named efforts as the V4.1 encoder maps them to its numeric budget.
DS_EFFORTS: dict[str, int] = {"low": 25, "high": 50, "xhigh": 75, "max": 100}

_DS_TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{D} calls>" block like the following:

<{D} calls>
<{D} invoke name="$TOOL_NAME">
<{D} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D} parameter>
...
</{D} invoke>
<{D} invoke name="$TOOL_NAME2">
...
</{D} invoke>
</{D} calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{SCHEMAS}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _ds_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _ds_tool_calls(message: Message) -> str:
    if not message.tool_calls:
        return ""
    invokes = []
    for c in message.tool_calls:
        params = [
            f'<{DS_DSML} parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _ds_json(v)}</{DS_DSML} parameter>"
            for k, v in c.arguments.items()
        ]
        invokes.append(f'<{DS_DSML} invoke name="{c.name}">\n' + "\n".join(params) + f"\n</{DS_DSML} invoke>")
    return f"\n\n<{DS_DSML} calls>\n" + "\n".join(invokes) + f"\n</{DS_DSML} calls>"


@dataclass(frozen=True)
class _Turn:
    role: str  # system | user | assistant
    text: str = ""
    message: Message | None = None


@dataclass(frozen=True)
class DeepSeekV41Format:
    """DeepSeek-V4.1 prompt encoding. `thinking=False` is the chat mode the panel uses.

    In thinking mode the reasoning-effort prefix must be given explicitly: public versions of the
    encoder disagree on the default budget, and a silent default would move tokens between runs.
    As upstream, reasoning of assistant turns before the last user turn is dropped unless the
    conversation declares tools.
    """

    thinking: bool = False
    reasoning_effort: int | str | None = None
    name: str = "deepseek-v4.1"

    def __post_init__(self) -> None:
        if self.thinking:
            e = self.reasoning_effort
            ok = (type(e) is int and 1 <= e <= 100) or (isinstance(e, str) and e in DS_EFFORTS)
            if not ok:
                raise ChatFormatError(
                    f"thinking mode needs reasoning_effort as an int in [1, 100] or one of {list(DS_EFFORTS)}, got {e!r}"
                )
        elif self.reasoning_effort is not None:
            raise ChatFormatError("reasoning_effort only applies in thinking mode")

    @property
    def budget(self) -> int | None:
        e = self.reasoning_effort
        return DS_EFFORTS[e] if isinstance(e, str) else e

    def identity(self) -> bytes:
        return f"deepseek-v4.1-chat/1 thinking={self.thinking} effort={self.budget}".encode()

    def markers(self) -> tuple[str, ...]:
        return (DS_BOS, DS_EOS, DS_USER, DS_ASSISTANT, DS_SYSTEM, DS_THINK, DS_END_THINK, DS_DSML)

    def _turns(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> list[_Turn]:
        """Tool results become `<tool_result>` blocks inside a user turn (V4.1 has no tool role);
        consecutive user-side messages merge into one turn joined by a blank line, and tool results
        are ordered by the call order of the assistant turn that requested them."""
        turns: list[_Turn] = []
        pending: list[tuple[int, str]] = []  # (sort key, text) of the open user turn
        call_order: dict[str, int] = {}
        for m in messages:
            if m.role in ("user", "tool"):
                if m.role == "tool":
                    key = call_order.get(m.tool_call_id or "", 0)
                    pending.append((key, f"<tool_result>{m.content}</tool_result>"))
                else:
                    pending.append((-1, m.content))
                continue
            if pending:
                turns.append(_Turn("user", _merge_user_parts(pending)))
                pending = []
            if m.role == "assistant":
                call_order = {c.id: k for k, c in enumerate(m.tool_calls)}
                turns.append(_Turn("assistant", message=m))
            else:
                turns.append(_Turn("system", m.content))
        if pending:
            turns.append(_Turn("user", _merge_user_parts(pending)))
        if tools:
            schema_text = "\n".join(_ds_json(t.to_json()) for t in tools)
            block = _DS_TOOLS_PROMPT.replace("{D}", DS_DSML).replace("{SCHEMAS}", schema_text)
            if turns and turns[0].role == "system":
                turns[0] = _Turn("system", turns[0].text + "\n\n" + block)
            else:
                turns.insert(0, _Turn("system", "\n\n" + block))
        return turns

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSpec], add_generation_prompt: bool) -> str:
        turns = self._turns(messages, tools)
        # A mid-conversation system turn counts as a user turn for the generation header.
        last_user = max((k for k, t in enumerate(turns) if t.role == "user" or (t.role == "system" and k > 0)), default=-1)
        # Tools keep past reasoning in the upstream encoder; without tools it is dropped.
        keep_thinking = bool(tools)

        def header(k: int) -> str:
            opened = self.thinking and (keep_thinking or k >= last_user)
            return DS_ASSISTANT + (DS_THINK if opened else DS_END_THINK)

        out = [DS_BOS]
        for k, t in enumerate(turns):
            part = ""
            if k == 0 and (self.thinking or t.role == "system"):
                part += DS_SYSTEM
            if k == 0 and self.thinking:
                part += f"Reasoning Effort: {self.budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
            if t.role == "system":
                part += (DS_SYSTEM if k > 0 else "") + t.text
            elif t.role == "user":
                part += DS_USER + t.text
            else:
                m = t.message
                assert m is not None
                shown = self.thinking and (keep_thinking or k > last_user)
                thinking_part = (m.reasoning or "") + DS_END_THINK if shown else ""
                part += thinking_part + m.content + _ds_tool_calls(m) + DS_EOS
            nxt = turns[k + 1].role if k + 1 < len(turns) else None
            if nxt == "assistant" and (t.role == "user" or (t.role == "system" and k > 0)):
                part += header(k)
            out.append(part)
        if add_generation_prompt:
            out.append(header(len(turns)))
        return "".join(out)


def _merge_user_parts(parts: list[tuple[int, str]]) -> str:
    # Only the tool results are reordered; plain user text keeps its place.
    results = sorted((p for p in parts if p[0] >= 0), key=lambda p: p[0])
    it = iter(results)
    return "\n\n".join(next(it)[1] if key >= 0 else text for key, text in parts)


# ----------------------------------------------------------------------------------------------
# scored spans


@dataclass(frozen=True)
class RenderedChat:
    text: str
    spans: tuple[tuple[int, int], ...]  # character spans [start, end) of scored assistant text


def chat_spans(fmt: ChatFormat, item: PanelItem) -> RenderedChat:
    """Render a chat item and locate the assistant replies its score policy selects.

    A reply's span runs from the end of the generation prompt to the end of the message as the
    template writes it (content, tool calls and the end-of-turn marker), minus trailing whitespace
    the template adds between turns.
    """
    msgs = item.messages
    full = fmt.render(msgs, item.tools, add_generation_prompt=False)
    targets = [k for k, m in enumerate(msgs) if m.role == "assistant"]
    if item.score == "last":
        targets = targets[-1:]
    spans = []
    for k in targets:
        before = fmt.render(msgs[:k], item.tools, add_generation_prompt=True)
        upto = fmt.render(msgs[: k + 1], item.tools, add_generation_prompt=False)
        if not upto.startswith(before) or not full.startswith(upto):
            raise ChatFormatError(
                f"item '{item.id}': format '{fmt.name}' is not prefix-stable at message {k}; "
                "cannot locate the assistant reply"
            )
        end = len(upto.rstrip())
        if end <= len(before):
            raise ChatFormatError(f"item '{item.id}': assistant message {k} renders empty")
        spans.append((len(before), end))
    return RenderedChat(text=full, spans=tuple(spans))

"""Image prompts through an engine's OpenAI chat API: prompt logprobs and greedy replies (vLLM's surface).

    rec = score_image_panel(client, encoded, panel, k, source)       # engine record of an image panel
    ids, text = greedy_reply(client, panel, item, max_tokens)        # the read-back

A chat request carries the item's messages as OpenAI sends them (panels.images.openai_messages: ``image_url``
parts with PNG data URLs, in user and tool messages; tool calls with JSON-string arguments) and asks vLLM for
``prompt_logprobs=k`` with ``return_token_ids``. vLLM 0.32 answers at the **top level** of the chat response
(not per choice): ``prompt_token_ids`` are the ids after its multimodal processor expanded each image
placeholder into the image's span, and ``prompt_logprobs`` has one entry per such id (entry 0 null, image
positions included). So alignment is by ids: the harness lays the spans out itself (panels/images.py) and
refuses a reply whose ``prompt_token_ids`` differ from them in any position (``PROMPT_IDS_MISMATCH``, with
the first differing position) — a different image token count, template or tokenization is an error, never
a shifted comparison. The entries are then parsed by the completions parser (engine/adapters/vllm.py), so
a chat record is checked exactly like a completions record.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from core.records import Provenance, Record
from core.version import code_version
from engine.adapters import vllm as v
from engine.adapters.base import HttpTiming, SequenceLogprobs
from engine.client import EngineClient, EngineSource, to_sequence_scores
from engine.errors import EngineResponseError, Malformed
from panels.images import openai_messages, openai_tools
from panels.model import EncodedPanel, Panel, PanelItem

CHAT = "/v1/chat/completions"
SURFACE = "vllm.chat.prompt_logprobs"


def chat_body(model: str, messages: list[dict[str, Any]], item: PanelItem, *, max_tokens: int,
              prompt_logprobs: int | None, add_generation_prompt: bool, salt: str | None,
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "return_token_ids": True, "add_generation_prompt": add_generation_prompt}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    if item.tools:
        body["tools"] = openai_tools(item)
        body["tool_choice"] = "none"   # the transcript is replayed, not continued with a call
    body["cache_salt"] = salt if salt is not None else v.fresh_salt()
    body.update(extra or {})
    return body


def parse_chat_prompt_logprobs(data: Any, sent: Sequence[int], k: int, model: str, seq_id: str,
                               vocab_size: int | None = None):
    """A chat response with top-level ``prompt_token_ids`` / ``prompt_logprobs`` -> canonical rows."""
    if not isinstance(data, dict):
        raise EngineResponseError(Malformed.WRONG_TYPE, "chat response is not a JSON object", seq_id)
    got = data.get("prompt_token_ids")
    if not isinstance(got, list):
        raise EngineResponseError(Malformed.MISSING_FIELD, "prompt_token_ids absent (return_token_ids)", seq_id)
    first = next((i for i, (a, b) in enumerate(zip(got, sent)) if int(a) != int(b)), None)
    if first is not None or len(got) != len(sent):
        pos = first if first is not None else min(len(got), len(sent))
        raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH,
                                  f"engine laid the prompt out as {len(got)} ids, the panel as {len(sent)}; first "
                                  f"difference at position {pos} (engine "
                                  f"{got[pos] if pos < len(got) else 'end'}, panel "
                                  f"{sent[pos] if pos < len(sent) else 'end'})", seq_id, pos)
    shaped = {"model": data.get("model"), "usage": data.get("usage"), "choices": [
        {"prompt_token_ids": got, "prompt_logprobs": data.get("prompt_logprobs")}]}
    return v.parse_prompt_logprobs(shaped, sent, k, model, seq_id, vocab_size)


def image_prompt_logprobs(client: EngineClient, panel: Panel, item: PanelItem, sent: Sequence[int], k: int,
                          *, salt: str | None = None) -> SequenceLogprobs:
    body = chat_body(client.model, openai_messages(panel, item), item, max_tokens=1, prompt_logprobs=k,
                     add_generation_prompt=False, salt=salt)
    reply = client.post_json(CHAT, body, seq_id=item.id)
    try:
        rows, cached = parse_chat_prompt_logprobs(reply.data, sent, k, client.model, item.id, client.config.vocab_size)
    except EngineResponseError as exc:
        raise exc.at(item.id, reply.url) from None
    return SequenceLogprobs(item.id, tuple(int(t) for t in sent), k, SURFACE, "id", tuple(rows),
                            HttpTiming(1, reply.elapsed_s), cached)


def score_image_panel(client: EngineClient, enc: EncodedPanel, panel: Panel, k: int,
                      source: EngineSource) -> Record:
    """Every sequence of the encoded image panel through the chat API, one request each -> engine record."""
    t0 = time.perf_counter()
    scores, timing = [], HttpTiming()
    for seq in enc.sequences:
        got = image_prompt_logprobs(client, panel, panel.item(seq.seq_id), seq.token_ids, k)
        timing = timing + got.timing
        scores.append(to_sequence_scores(seq, got))
    prov = Provenance(side="engine", panel_name=enc.panel_name, panel_version=str(enc.panel_version),
                      panel_hash=enc.panel_hash, tokenizer_hash=enc.tokenizer_hash,
                      source=source.as_source(), precision=source.precision, code_version=code_version(),
                      created=Provenance.now(),
                      extra={"adapter": "vllm", "surface": [SURFACE], "keyed_by": ["id"], "k_requested": k,
                             "image_layout": enc.layout, "requests": timing.requests,
                             "seconds": round(time.perf_counter() - t0, 3)})
    return Record.from_sequences(prov, scores, k=k)


def greedy_reply(client: EngineClient, panel: Panel, item: PanelItem, max_tokens: int) -> tuple[list[int], str, list[int]]:
    """The engine's greedy reply to the item's messages before its last (assistant) one: (ids, text, prompt ids).
    Exactly `max_tokens` tokens (``ignore_eos``), so it compares with an oracle continuation of that length."""
    body = chat_body(client.model, openai_messages(panel, item, upto=len(item.messages) - 1), item,
                     max_tokens=max_tokens, prompt_logprobs=None, add_generation_prompt=True, salt=None,
                     extra={"skip_special_tokens": False, "ignore_eos": True})
    data = client.post_json(CHAT, body, seq_id=item.id).data
    try:
        choice = data["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        text = choice["message"]["content"] or ""
        prompt = [int(t) for t in data["prompt_token_ids"]]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineResponseError(Malformed.WRONG_TYPE, f"chat reply lacks choices[0].token_ids / message.content "
                                  f"/ prompt_token_ids ({type(exc).__name__}: {exc})", item.id) from None
    return ids, text, prompt

"""vLLM adapter (primary engine): id-keyed surfaces only (engines.md §3, §10 rule 1).

* prompt positions: ``/v1/completions`` with a token-id prompt, ``prompt_logprobs=k`` and
  ``return_token_ids`` — one entry per prompt token, entry 0 null, each entry keyed by the id as a JSON
  string with ``{logprob, rank, decoded_token}``; the actual token is always present (k or k+1 keys).
* generated positions: ``logprobs=k`` with ``return_tokens_as_token_ids`` (keys ``"token_id:N"``) and
  ``return_token_ids`` (the generated ids as a list), temperature 0.
* every request carries a fresh random ``cache_salt`` unless the caller passes one, so no request reads
  another's prefix cache (§10 rule 8).
* the behaviour gates' shapes: greedy generation with ``ignore_eos`` and chosen salts (``GenerateOptions``),
  the same request streamed (SSE, ``stream_options.include_usage``), and the server's facts: ``max_model_len``
  from the /v1/models card, the KV-cache settings from the ``vllm:cache_config_info`` gauge in /metrics.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from core.records import CLAMP_LOGPROB
from engine.adapters.base import (
    Generation, GenerateOptions, HttpTiming, PositionLogprobs, SequenceLogprobs, StreamedGeneration, Transport,
    check_model, check_same_ids, logprob_value, need, parse_id_key, single_choice, split_topk, token_id,
    usage_cached_tokens,
)
from engine.errors import EngineResponseError, Malformed

COMPLETIONS = "/v1/completions"
TOKEN_ID_PREFIX = "token_id:"


def fresh_salt() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------- requests
def prompt_request(model: str, token_ids: Sequence[int], k: int, cache_salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": k, "return_token_ids": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def generate_request(model: str, prompt_ids: Sequence[int], max_tokens: int, k: int,
                     cache_salt: str | None, stream: bool = False, ignore_eos: bool | None = None,
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0,
        "logprobs": k, "return_tokens_as_token_ids": True, "return_token_ids": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if ignore_eos is not None:
        body["ignore_eos"] = ignore_eos
    body.update(extra or {})
    return body


# ---------------------------------------------------------------------------------------------- parsing
def parse_prompt_logprobs(data: Any, sent: Sequence[int], k: int, model: str, seq_id: str | None = None,
                          vocab_size: int | None = None) -> tuple[list[PositionLogprobs], int | None]:
    """A ``prompt_logprobs`` completions response → canonical rows for positions 1..n-1, and cached_tokens."""
    choice = single_choice(data, seq_id)
    check_model(data, model, seq_id)
    check_same_ids(sent, need(choice, "prompt_token_ids", list, "choices[0]", seq_id=seq_id),
                   "choices[0].prompt_token_ids", seq_id)
    plp = choice.get("prompt_logprobs")
    if plp is None:
        raise EngineResponseError(Malformed.MISSING_LOGPROBS, "choices[0].prompt_logprobs is absent or null", seq_id)
    if not isinstance(plp, list):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"prompt_logprobs is {type(plp).__name__}, expected a list", seq_id)
    if len(plp) != len(sent):
        raise EngineResponseError(Malformed.LENGTH_MISMATCH,
                                  f"prompt_logprobs has {len(plp)} entries for {len(sent)} prompt tokens", seq_id)
    if plp and plp[0] is not None:
        raise EngineResponseError(Malformed.POSITION0_NOT_NULL, "prompt_logprobs[0] is not null", seq_id, 0)
    rows = []
    for i in range(1, len(sent)):
        entry = plp[i]
        if entry is None:
            raise EngineResponseError(Malformed.NULL_ENTRY, "prompt_logprobs entry is null", seq_id, i)
        if not isinstance(entry, dict):
            raise EngineResponseError(Malformed.WRONG_TYPE, f"prompt_logprobs entry is {type(entry).__name__}", seq_id, i)
        fast = _entry_fast(entry, vocab_size)
        values, ranks = fast if fast is not None else _entry_checked(entry, i, seq_id, vocab_size)
        actual = int(sent[i])
        if actual not in values:
            raise EngineResponseError(Malformed.ACTUAL_MISSING,
                                      f"actual token {actual} is missing from prompt_logprobs (vLLM always adds it)",
                                      seq_id, i)
        top_ids, top_lps = split_topk(values, actual, k, seq_id, i, ranks=ranks)
        if actual in top_ids and ranks[actual] > k:
            raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT,
                                      f"actual token {actual} is inside the top-{k} but has rank {ranks[actual]}",
                                      seq_id, i)
        if actual not in top_ids and ranks[actual] <= k and values[actual] < top_lps[-1] - 1e-9:
            raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT,
                                      f"actual token {actual} has rank {ranks[actual]} <= {k} but is not in the top-{k}",
                                      seq_id, i)
        rows.append(PositionLogprobs(i, actual, values[actual], ranks[actual], top_ids, top_lps))
    _, cached = usage_cached_tokens(data.get("usage"), seq_id)
    return rows, cached


def _entry_fast(entry: dict, vocab_size: int | None) -> tuple[dict[int, float], dict[int, int]] | None:
    """Values and ranks of one well-formed prompt_logprobs entry, or None at the first oddity.

    Accepts only what :func:`_entry_checked` accepts without change (plain decimal keys in range, float
    logprobs in (CLAMP_LOGPROB, 0], int ranks >= 1); anything else — including clamped values — goes through the
    checked path, which raises the precise error or normalises the value.
    """
    values: dict[int, float] = {}
    ranks: dict[int, int] = {}
    limit = vocab_size if vocab_size is not None else 1 << 62
    clamp = CLAMP_LOGPROB
    for key, item in entry.items():
        if type(item) is not dict or not key.isascii() or not key.isdigit() or (key[0] == "0" and len(key) > 1):
            return None
        lp = item.get("logprob")
        r = item.get("rank")
        if type(lp) is not float or type(r) is not int or not (clamp < lp <= 0.0) or r < 1 or r > limit:
            return None
        tid = int(key)
        if tid >= limit:
            return None
        values[tid] = lp
        ranks[tid] = r
    return values, ranks


def _entry_checked(entry: dict, i: int, seq_id: str | None,
                   vocab_size: int | None) -> tuple[dict[int, float], dict[int, int]]:
    values: dict[int, float] = {}
    ranks: dict[int, int] = {}
    for key, item in entry.items():
        tid = parse_id_key(key, seq_id, i, vocab_size)
        if tid in values:  # '7' and '07' are both refused by parse_id_key; kept as a guard
            raise EngineResponseError(Malformed.DUPLICATE_ID, f"id {tid} appears twice", seq_id, i)
        values[tid] = logprob_value(need(item, "logprob", float, f"entry {key}", seq_id=seq_id, position=i),
                                    f"logprob of id {tid}", seq_id, i)
        r = need(item, "rank", int, f"entry {key}", seq_id=seq_id, position=i)
        if r < 1 or (vocab_size is not None and r > vocab_size):
            raise EngineResponseError(Malformed.BAD_RANK, f"id {tid} has rank {r}", seq_id, i)
        ranks[tid] = r
    return values, ranks


def _legacy_generated(lp: Any, ids: list[int], k: int, start: int, seq_id: str | None,
                      vocab_size: int | None) -> list[PositionLogprobs]:
    """Legacy ``{tokens, token_logprobs, top_logprobs}`` with token-id keys → canonical rows."""
    if lp is None:
        raise EngineResponseError(Malformed.MISSING_LOGPROBS, "choices[0].logprobs is null", seq_id)
    tokens = need(lp, "tokens", list, "logprobs", seq_id=seq_id)
    tlp = need(lp, "token_logprobs", list, "logprobs", seq_id=seq_id)
    top = need(lp, "top_logprobs", list, "logprobs", seq_id=seq_id)
    if not (len(tokens) == len(tlp) == len(top) == len(ids)):
        raise EngineResponseError(Malformed.GENERATED_MISMATCH,
                                  f"{len(ids)} generated ids but {len(tokens)} tokens, {len(tlp)} token_logprobs, "
                                  f"{len(top)} top_logprobs", seq_id)
    rows = []
    for j, tid in enumerate(ids):
        pos = start + j
        if not isinstance(tokens[j], str):
            raise EngineResponseError(Malformed.WRONG_TYPE, f"tokens[{j}] is {tokens[j]!r}", seq_id, pos)
        named = parse_id_key(tokens[j], seq_id, pos, vocab_size, prefix=TOKEN_ID_PREFIX)
        if named != tid:
            raise EngineResponseError(Malformed.GENERATED_MISMATCH,
                                      f"tokens[{j}] names id {named}, token_ids has {tid}", seq_id, pos)
        actual_lp = logprob_value(tlp[j], f"token_logprobs[{j}]", seq_id, pos)
        entry = top[j]
        if entry is None:
            raise EngineResponseError(Malformed.NULL_ENTRY, f"top_logprobs[{j}] is null", seq_id, pos)
        if not isinstance(entry, dict):
            raise EngineResponseError(Malformed.WRONG_TYPE, f"top_logprobs[{j}] is {type(entry).__name__}", seq_id, pos)
        values: dict[int, float] = {}
        for key, v in entry.items():
            eid = parse_id_key(key, seq_id, pos, vocab_size, prefix=TOKEN_ID_PREFIX)
            values[eid] = logprob_value(v, f"top logprob of id {eid}", seq_id, pos)
        if tid in values and values[tid] != actual_lp:
            raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT,
                                      f"sampled id {tid}: token_logprobs says {actual_lp!r}, top_logprobs says "
                                      f"{values[tid]!r}", seq_id, pos)
        top_ids, top_lps = split_topk(values, tid, k, seq_id, pos)
        rank = top_ids.index(tid) + 1 if tid in top_ids else 0
        rows.append(PositionLogprobs(pos, tid, actual_lp, rank, top_ids, top_lps))
    return rows


def parse_generation(data: Any, prompt: Sequence[int], k: int, model: str, seq_id: str | None = None,
                     vocab_size: int | None = None) -> Generation:
    choice = single_choice(data, seq_id)
    check_model(data, model, seq_id)
    check_same_ids(prompt, need(choice, "prompt_token_ids", list, "choices[0]", seq_id=seq_id),
                   "choices[0].prompt_token_ids", seq_id)
    ids = need(choice, "token_ids", list, "choices[0]", seq_id=seq_id)
    ids = [token_id(x, "generated id", seq_id, len(prompt) + j, vocab_size) for j, x in enumerate(ids)]
    rows = _legacy_generated(choice.get("logprobs"), ids, k, len(prompt), seq_id, vocab_size)
    text = need(choice, "text", str, "choices[0]", seq_id=seq_id)
    prompt_tokens, cached = usage_cached_tokens(data.get("usage"), seq_id)
    return Generation(seq_id or "", tuple(prompt), tuple(ids), tuple(rows), k, "vllm.completions.logprobs",
                      text, choice.get("finish_reason"), prompt_tokens, cached)


def parse_stream_chunk(event: Any, model: str, seq_id: str | None, position: int, k: int,
                       vocab_size: int | None) -> tuple[list[int], list[PositionLogprobs], str, str | None, dict | None]:
    """One SSE completion chunk → (ids, rows, text, finish_reason, usage)."""
    if not isinstance(event, dict):
        raise EngineResponseError(Malformed.STREAM_MALFORMED, f"chunk is {type(event).__name__}", seq_id, position)
    check_model(event, model, seq_id)
    choices = need(event, "choices", list, "chunk", seq_id=seq_id, position=position)
    usage = event.get("usage")
    if not choices:
        return [], [], "", None, usage
    if len(choices) != 1 or not isinstance(choices[0], dict):
        raise EngineResponseError(Malformed.STREAM_MALFORMED, f"chunk has {len(choices)} choices", seq_id, position)
    ch = choices[0]
    lp = ch.get("logprobs")
    if "token_ids" in ch and ch["token_ids"] is not None:
        ids = [token_id(x, "generated id", seq_id, position + j, vocab_size)
               for j, x in enumerate(need(ch, "token_ids", list, "chunk choice", seq_id=seq_id))]
    elif lp is not None:
        ids = [parse_id_key(t, seq_id, position + j, vocab_size, prefix=TOKEN_ID_PREFIX)
               for j, t in enumerate(need(lp, "tokens", list, "chunk logprobs", seq_id=seq_id))]
    else:
        ids = []
    rows = _legacy_generated(lp, ids, k, position, seq_id, vocab_size) if (ids or lp is not None) else []
    text = ch.get("text") or ""
    return ids, rows, text, ch.get("finish_reason"), usage


# ---------------------------------------------------------------------------------------------- adapter
class VllmAdapter:
    name = "vllm"
    keyed_by = "id"
    surface = "vllm.completions.prompt_logprobs"

    def __init__(self, vocab_size: int | None = None):
        self.vocab_size = vocab_size

    def prompt_logprobs(self, transport: Transport, seq_id: str, token_ids: Sequence[int], k: int, *,
                        cache_salt: str | None = None) -> SequenceLogprobs:
        salt = cache_salt if cache_salt is not None else fresh_salt()
        reply = transport.post_json(COMPLETIONS, prompt_request(transport.model, token_ids, k, salt), seq_id=seq_id)
        try:
            rows, cached = parse_prompt_logprobs(reply.data, token_ids, k, transport.model, seq_id, self.vocab_size)
        except EngineResponseError as exc:
            raise exc.at(seq_id, reply.url) from None
        return SequenceLogprobs(seq_id, tuple(int(t) for t in token_ids), k, self.surface, "id", tuple(rows),
                                HttpTiming(1, reply.elapsed_s), cached)

    def generate(self, transport: Transport, seq_id: str, prompt_ids: Sequence[int], max_tokens: int, k: int,
                 options: GenerateOptions | None = None) -> Generation:
        o = options or GenerateOptions()
        salt = o.cache_salt if o.cache_salt is not None else fresh_salt()
        body = generate_request(transport.model, prompt_ids, max_tokens, k, salt, ignore_eos=o.ignore_eos,
                                extra=o.extra)
        reply = transport.post_json(COMPLETIONS, body, seq_id=seq_id)
        try:
            gen = parse_generation(reply.data, prompt_ids, k, transport.model, seq_id, self.vocab_size)
        except EngineResponseError as exc:
            raise exc.at(seq_id, reply.url) from None
        return replace(gen, timing=HttpTiming(1, reply.elapsed_s))

    def stream(self, transport: Transport, seq_id: str, prompt_ids: Sequence[int], max_tokens: int, k: int,
               options: GenerateOptions | None = None,
               on_tokens: Callable[[int], None] | None = None) -> StreamedGeneration:
        """The generation request streamed; usage.prompt_tokens and usage.completion_tokens, when sent, must
        match what was sent and what streamed."""
        o = options or GenerateOptions()
        prompt_ids = [int(x) for x in prompt_ids]
        salt = o.cache_salt if o.cache_salt is not None else fresh_salt()
        body = generate_request(transport.model, prompt_ids, max_tokens, k, salt, stream=True,
                                ignore_eos=o.ignore_eos, extra=o.extra)
        ids: list[int] = []
        rows: list[PositionLogprobs] = []
        text: list[str] = []
        times: list[float] = []
        counts: list[int] = []
        finish = None
        usage = None
        for ev in transport.stream_events(COMPLETIONS, body, seq_id=seq_id):
            got, r, t, fin, u = parse_stream_chunk(ev.data, transport.model, seq_id, len(prompt_ids) + len(ids), k,
                                                   self.vocab_size)
            ids += got
            rows += r
            text.append(t)
            times.append(ev.t_s)
            counts.append(len(got))
            finish = fin or finish
            usage = u if u is not None else usage
            if got and on_tokens is not None:
                on_tokens(len(ids))
        prompt_tokens, cached = usage_cached_tokens(usage, seq_id)
        if prompt_tokens is not None and prompt_tokens != len(prompt_ids):
            raise EngineResponseError(Malformed.USAGE_MALFORMED,
                                      f"usage.prompt_tokens {prompt_tokens} != {len(prompt_ids)} ids sent", seq_id)
        completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if completion is not None and completion != len(ids):
            raise EngineResponseError(Malformed.USAGE_MALFORMED,
                                      f"usage.completion_tokens {completion} but {len(ids)} ids streamed", seq_id)
        gen = Generation(seq_id, tuple(prompt_ids), tuple(ids), tuple(rows), k, "vllm.completions.stream",
                         "".join(text), finish, prompt_tokens, cached, HttpTiming(1, times[-1] if times else 0.0))
        return StreamedGeneration(gen, tuple(times), tuple(counts))

    def max_model_len(self, transport: Transport) -> int | None:
        """``max_model_len`` from the served model's /v1/models card."""
        data = transport.get_json("/v1/models").data.get("data") or []
        for m in data:
            if isinstance(m, dict) and m.get("id") == transport.model and isinstance(m.get("max_model_len"), int):
                return int(m["max_model_len"])
        return None

    def cache_config(self, transport: Transport) -> dict[str, str]:
        """Labels of the ``vllm:cache_config_info`` gauge (block_size, enable_prefix_caching, ...)."""
        for fam in transport.metrics().families.values():
            for name, labels, _ in fam:
                if name == "vllm:cache_config_info":
                    return dict(labels)
        return {}

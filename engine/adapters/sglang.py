"""SGLang adapter: native ``POST /generate`` with ``[logprob, token_id, text|null]`` triples (engines.md §4).

Id-keyed (rule 1). Prompt positions: ``input_ids`` + ``return_logprob`` + ``logprob_start_len=0`` +
``top_logprobs_num=k``, temperature 0 (SGLang scales logprobs by temperature unless greedy).
``meta_info.input_token_logprobs[i]`` is the actual token at position i (its id must equal the id sent;
entry 0's logprob is null) and ``meta_info.input_top_logprobs[i]`` the top-k (entry 0 null). The top-k
list does not append the actual token, so the rank is known only when the actual token is inside it.

SGLang cannot run on a CPU-only machine (§11.5); this adapter is tested against JSON responses built to
the format documented in §4 (tests/data/sglang/README.md), and has not yet met a live server.
"""

from __future__ import annotations

from typing import Any, Sequence

from engine.adapters.base import (
    Generation, GenerateOptions, HttpTiming, PositionLogprobs, SequenceLogprobs, Transport, WithoutServerSurfaces,
    logprob_value, need, plain_options, token_id,
)
from engine.errors import EngineResponseError, Malformed

GENERATE = "/generate"


def prompt_request(token_ids: Sequence[int], k: int, max_new_tokens: int = 1) -> dict[str, Any]:
    return {
        "input_ids": list(token_ids),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k,
        "return_text_in_logprobs": False,
    }


def _triple(x: Any, what: str, seq_id: str | None, pos: int, vocab: int | None, allow_null_lp: bool = False):
    if not isinstance(x, list) or len(x) != 3:
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{what} is {x!r}, expected [logprob, id, text|null]",
                                  seq_id, pos)
    lp, tid, text = x
    if text is not None and not isinstance(text, str):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{what} text is {text!r}", seq_id, pos)
    tid = token_id(tid, f"{what} id", seq_id, pos, vocab)
    if lp is None and allow_null_lp:
        return None, tid
    return logprob_value(lp, f"{what} logprob", seq_id, pos), tid


def _top_list(entry: Any, k: int, what: str, seq_id: str | None, pos: int, vocab: int | None):
    if entry is None:
        raise EngineResponseError(Malformed.NULL_ENTRY, f"{what} is null", seq_id, pos)
    if not isinstance(entry, list):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{what} is {type(entry).__name__}", seq_id, pos)
    if len(entry) < k:
        raise EngineResponseError(Malformed.TOO_FEW_ENTRIES, f"{what} has {len(entry)} entries, expected {k}", seq_id, pos)
    if len(entry) > k:
        raise EngineResponseError(Malformed.TOO_MANY_ENTRIES, f"{what} has {len(entry)} entries, expected {k}", seq_id, pos)
    ids, lps = [], []
    for j, t in enumerate(entry):
        lp, tid = _triple(t, f"{what}[{j}]", seq_id, pos, vocab)
        if tid in ids:
            raise EngineResponseError(Malformed.DUPLICATE_ID, f"{what}: id {tid} appears twice", seq_id, pos)
        if lps and lp > lps[-1] + 1e-9:
            raise EngineResponseError(Malformed.RANK_ORDER, f"{what}[{j}] logprob {lp!r} above [{j - 1}] {lps[-1]!r}",
                                      seq_id, pos)
        ids.append(tid)
        lps.append(lp)
    return tuple(ids), tuple(lps)


def _row(pos: int, actual: int, actual_lp: float, top_ids, top_lps, seq_id) -> PositionLogprobs:
    if actual in top_ids:
        j = top_ids.index(actual)
        if top_lps[j] != actual_lp:
            raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT,
                                      f"actual id {actual}: token logprob {actual_lp!r}, top-k entry {top_lps[j]!r}",
                                      seq_id, pos)
        rank = j + 1
    else:
        if top_lps and actual_lp > top_lps[-1] + 1e-6:
            raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT,
                                      f"actual id {actual} is outside the top-{len(top_ids)} with logprob {actual_lp!r} "
                                      f"above the k-th {top_lps[-1]!r}", seq_id, pos)
        rank = 0
    return PositionLogprobs(pos, actual, actual_lp, rank, top_ids, top_lps)


def _single(data: Any, seq_id: str | None) -> dict:
    if isinstance(data, list):
        if len(data) != 1:
            raise EngineResponseError(Malformed.NO_CHOICES, f"batch response with {len(data)} items for one request", seq_id)
        data = data[0]
    if not isinstance(data, dict):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"response is {type(data).__name__}, expected an object", seq_id)
    return data


def parse_prompt_logprobs(data: Any, sent: Sequence[int], k: int, seq_id: str | None = None,
                          vocab_size: int | None = None) -> list[PositionLogprobs]:
    data = _single(data, seq_id)
    meta = need(data, "meta_info", dict, "response", seq_id=seq_id)
    itl = meta.get("input_token_logprobs")
    itop = meta.get("input_top_logprobs")
    if itl is None or itop is None:
        raise EngineResponseError(Malformed.MISSING_LOGPROBS,
                                  "meta_info lacks input_token_logprobs / input_top_logprobs (return_logprob, "
                                  "logprob_start_len=0)", seq_id)
    if not isinstance(itl, list) or not isinstance(itop, list):
        raise EngineResponseError(Malformed.WRONG_TYPE, "input_token_logprobs / input_top_logprobs are not lists", seq_id)
    for name, lst in (("input_token_logprobs", itl), ("input_top_logprobs", itop)):
        if len(lst) != len(sent):
            raise EngineResponseError(Malformed.LENGTH_MISMATCH, f"{name} has {len(lst)} entries for {len(sent)} ids",
                                      seq_id)
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None and prompt_tokens != len(sent):
        raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH, f"meta_info.prompt_tokens {prompt_tokens} for "
                                  f"{len(sent)} ids sent", seq_id)
    rows = []
    for i in range(len(sent)):
        lp, tid = _triple(itl[i], f"input_token_logprobs[{i}]", seq_id, i, vocab_size, allow_null_lp=(i == 0))
        if tid != sent[i]:
            raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH, f"sent id {sent[i]}, engine scored id {tid}",
                                      seq_id, i)
        if i == 0:
            if lp is not None or itop[0] is not None:
                raise EngineResponseError(Malformed.POSITION0_NOT_NULL, "position 0 carries a logprob", seq_id, 0)
            continue
        top_ids, top_lps = _top_list(itop[i], k, f"input_top_logprobs[{i}]", seq_id, i, vocab_size)
        rows.append(_row(i, tid, lp, top_ids, top_lps, seq_id))
    return rows


def parse_generation(data: Any, prompt: Sequence[int], k: int, seq_id: str | None = None,
                     vocab_size: int | None = None) -> Generation:
    data = _single(data, seq_id)
    meta = need(data, "meta_info", dict, "response", seq_id=seq_id)
    otl = meta.get("output_token_logprobs")
    otop = meta.get("output_top_logprobs")
    if otl is None or otop is None:
        raise EngineResponseError(Malformed.MISSING_LOGPROBS, "meta_info lacks output_token_logprobs / "
                                  "output_top_logprobs", seq_id)
    if not isinstance(otl, list) or not isinstance(otop, list) or len(otl) != len(otop):
        raise EngineResponseError(Malformed.GENERATED_MISMATCH, "output_token_logprobs and output_top_logprobs differ "
                                  "in type or length", seq_id)
    out_ids = data.get("output_ids")
    rows, ids = [], []
    for j in range(len(otl)):
        pos = len(prompt) + j
        lp, tid = _triple(otl[j], f"output_token_logprobs[{j}]", seq_id, pos, vocab_size)
        top_ids, top_lps = _top_list(otop[j], k, f"output_top_logprobs[{j}]", seq_id, pos, vocab_size)
        rows.append(_row(pos, tid, lp, top_ids, top_lps, seq_id))
        ids.append(tid)
    if out_ids is not None and list(out_ids) != ids:
        raise EngineResponseError(Malformed.GENERATED_MISMATCH, f"output_ids {out_ids} but logprob ids {ids}", seq_id)
    completion = meta.get("completion_tokens")
    if completion is not None and completion != len(ids):
        raise EngineResponseError(Malformed.GENERATED_MISMATCH,
                                  f"completion_tokens {completion} but {len(ids)} output logprob entries", seq_id)
    fin = meta.get("finish_reason")
    finish = fin.get("type") if isinstance(fin, dict) else fin
    cached = meta.get("cached_tokens")
    if cached is not None and (isinstance(cached, bool) or not isinstance(cached, int) or cached < 0):
        raise EngineResponseError(Malformed.USAGE_MALFORMED, f"meta_info.cached_tokens is {cached!r}", seq_id)
    return Generation(seq_id or "", tuple(prompt), tuple(ids), tuple(rows), k, "sglang.generate.output",
                      data.get("text") or "", finish, meta.get("prompt_tokens"), cached)


class SglangAdapter(WithoutServerSurfaces):
    name = "sglang"
    keyed_by = "id"
    surface = "sglang.generate.input_logprobs"

    def __init__(self, vocab_size: int | None = None):
        self.vocab_size = vocab_size

    def prompt_logprobs(self, transport: Transport, seq_id: str, token_ids: Sequence[int], k: int, *,
                        cache_salt: str | None = None) -> SequenceLogprobs:
        # SGLang has no per-request cache salt; run the server with radix caching off for cold prefills.
        reply = transport.post_json(GENERATE, prompt_request(token_ids, k), seq_id=seq_id)
        try:
            rows = parse_prompt_logprobs(reply.data, token_ids, k, seq_id, self.vocab_size)
        except EngineResponseError as exc:
            raise exc.at(seq_id, reply.url) from None
        meta = _single(reply.data, seq_id).get("meta_info", {})
        cached = meta.get("cached_tokens") if isinstance(meta.get("cached_tokens"), int) else None
        return SequenceLogprobs(seq_id, tuple(int(t) for t in token_ids), k, self.surface, "id", tuple(rows),
                                HttpTiming(1, reply.elapsed_s), cached)

    def generate(self, transport: Transport, seq_id: str, prompt_ids: Sequence[int], max_tokens: int, k: int,
                 options: GenerateOptions | None = None) -> Generation:
        o = plain_options(self.name, options)
        body = prompt_request(prompt_ids, k, max_new_tokens=max_tokens)
        body["logprob_start_len"] = -1
        if o.ignore_eos is not None:
            body["sampling_params"]["ignore_eos"] = o.ignore_eos
        body.update(o.extra)
        reply = transport.post_json(GENERATE, body, seq_id=seq_id)
        try:
            gen = parse_generation(reply.data, prompt_ids, k, seq_id, self.vocab_size)
        except EngineResponseError as exc:
            raise exc.at(seq_id, reply.url) from None
        from dataclasses import replace
        return replace(gen, timing=HttpTiming(1, reply.elapsed_s))

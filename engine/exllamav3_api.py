"""The vLLM-shaped HTTP surface of the exllamav3 front (engine/exllamav3_server.py), as pure functions.

The front speaks the subset of vLLM's OpenAI-compatible API that the harness uses (``engine/adapters/vllm.py``),
so the vLLM adapter, the client and every gate run unchanged against exllamav3:

* ``/v1/completions`` with a token-id prompt: ``prompt_logprobs=k`` (entry 0 null, then per position the
  top-k plus the actual token, keyed by the id as a string, with ``logprob``/``rank``/``decoded_token``),
  ``logprobs=k`` for generated tokens in the legacy shape with ``token_id:N`` keys, ``return_token_ids``,
  ``ignore_eos``, ``cache_salt``, ``stream`` with ``stream_options.include_usage``;
* ``usage.prompt_tokens_details.cached_tokens`` from exllamav3's own job result (``cached_tokens``);
* ``/v1/models`` with ``max_model_len``; ``/metrics`` with vLLM's ``vllm:cache_config_info`` gauge.

Everything here takes float64 logprob rows (``log_softmax`` of the engine's logits) and ids; nothing imports
exllamav3 or touches a GPU, so it is tested on the CPU (tests/engine/test_exllamav3_front.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import torch

ENGINE_NAME = "exllamav3"
PAGE_SIZE = 256  # exllamav3.constants.PAGE_SIZE: the page (prefix-reuse) granularity of its paged cache


class RequestError(ValueError):
    """A request the front refuses (HTTP 400), with the field it is about."""


@dataclass(frozen=True)
class CompletionRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    prompt_logprobs: int | None
    logprobs: int | None
    ignore_eos: bool
    cache_salt: str | None
    stream: bool
    include_usage: bool


def parse_completion(body: Any, model: str, vocab_size: int, max_model_len: int) -> CompletionRequest:
    """Validate a ``/v1/completions`` body: greedy only, a token-id prompt, ids in range, fits the context."""
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object")
    if body.get("model", model) != model:
        raise RequestError(f"model {body.get('model')!r} is not served here (serving {model!r})")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt):
        raise RequestError("prompt must be a non-empty list of token ids (this front takes ids, not text)")
    bad = [t for t in prompt if t < 0 or t >= vocab_size]
    if bad:
        raise RequestError(f"prompt id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    temp = body.get("temperature", 0)
    if temp not in (0, 0.0, None):
        raise RequestError(f"temperature {temp!r}: this front decodes greedily only (temperature 0)")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("n must be 1")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(f"max_tokens {max_tokens!r} must be an integer >= 1")
    if len(prompt) + max_tokens > max_model_len:
        raise RequestError(f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed max_model_len {max_model_len}")

    def k_of(name: str) -> int | None:
        v = body.get(name)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 1000:
            raise RequestError(f"{name} {v!r} must be an integer in 0..1000")
        return v

    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError("cache_salt must be a non-empty string")
    opts = body.get("stream_options") or {}
    return CompletionRequest(tuple(int(t) for t in prompt), max_tokens, k_of("prompt_logprobs"), k_of("logprobs"),
                             bool(body.get("ignore_eos", False)), salt, bool(body.get("stream", False)),
                             bool(isinstance(opts, dict) and opts.get("include_usage")))


# ---------------------------------------------------------------------------------------------- logprob rows
def log_softmax_rows(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Engine logits [n, V_padded] (any float dtype) → float64 logprobs over the real vocabulary [n, V]."""
    return torch.log_softmax(logits[..., :vocab_size].to(torch.float64), dim=-1)


def _ranks_of(row: torch.Tensor, ids: torch.Tensor) -> list[int]:
    """vLLM's rank: 1 + the number of ids with a strictly greater logprob."""
    return [int((row > row[i]).sum()) + 1 for i in ids.tolist()]


def topk_of(row: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """Top-k ids of one float64 row in rank order, ties broken by id (what split_topk expects)."""
    if k <= 0:
        return [], []
    vals, idx = torch.topk(row, min(k, row.numel()))
    pairs = sorted(zip(idx.tolist(), vals.tolist()), key=lambda p: (-p[1], p[0]))
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _finite(x: float) -> float:
    return -9999.0 if not math.isfinite(x) else float(x)


def prompt_logprobs_entries(lp: torch.Tensor, prompt: Sequence[int], k: int, piece=None) -> list[dict | None]:
    """``prompt_logprobs`` for a prompt of n ids from float64 rows ``lp[i]`` = distribution after ids[: i + 1]
    (n - 1 rows used): entry 0 is null, entry i holds the top-k of row i - 1 plus the actual id ``prompt[i]``."""
    out: list[dict | None] = [None]
    piece = piece or (lambda t: "")
    for i in range(1, len(prompt)):
        row = lp[i - 1]
        ids, vals = topk_of(row, k)
        actual = int(prompt[i])
        keep = list(zip(ids, vals))
        if actual not in ids:
            keep.append((actual, float(row[actual])))
        # top-k members are ranked by their slot (1..k); an actual id outside them by 1 + #(strictly greater),
        # as vLLM ranks it (so an exact tie with the k-th entry reads rank <= k, which the adapter accepts)
        ranks = list(range(1, len(ids) + 1))
        if len(keep) > len(ids):
            ranks += _ranks_of(row, torch.tensor([actual]))
        entry = {}
        for (t, v), r in zip(keep, ranks):
            entry[str(t)] = {"logprob": _finite(v), "rank": r, "decoded_token": piece(t)}
        out.append(entry)
    return out


def generated_logprobs(lp: torch.Tensor, gen: Sequence[int], k: int) -> dict:
    """Legacy ``logprobs`` block for generated ids: row j is the distribution that chose ``gen[j]``."""
    tokens, token_lps, tops = [], [], []
    for j, t in enumerate(gen):
        row = lp[j]
        ids, vals = topk_of(row, k)
        tokens.append(f"token_id:{int(t)}")
        token_lps.append(_finite(float(row[int(t)])))
        tops.append({f"token_id:{i}": _finite(v) for i, v in zip(ids, vals)})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": [0] * len(tokens)}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": int(cached_tokens)}
    return u


def completion_response(model: str, req: CompletionRequest, gen: Sequence[int], text: str, finish: str,
                        prompt_lp: list | None, gen_lp: dict | None, cached_tokens: int | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": gen_lp, "finish_reason": finish, "stop_reason": None,
              "token_ids": [int(t) for t in gen], "prompt_logprobs": prompt_lp,
              "prompt_token_ids": list(req.prompt)}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(len(req.prompt), len(gen), cached_tokens)}


def stream_chunk(model: str, cid: str, ids: Sequence[int], text: str, lp: dict | None, finish: str | None) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish,
                         "token_ids": [int(t) for t in ids]}]}


def usage_chunk(model: str, cid: str, prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached)}


def models_card(model: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                        "owned_by": ENGINE_NAME, "root": model, "max_model_len": max_model_len}]}


def metrics_text(prefix_caching: bool, counters: dict[str, float], spec: dict[str, float] | None = None) -> str:
    """Prometheus text: vLLM's cache-config gauge (the gates read block_size / enable_prefix_caching from it),
    the front's own counters and, with a drafter, vLLM's spec-decode counters (names without `_total`)."""
    lines = ["# HELP vllm:cache_config_info Information of the KV cache (exllamav3 front).",
             "# TYPE vllm:cache_config_info gauge",
             f'vllm:cache_config_info{{block_size="{PAGE_SIZE}",enable_prefix_caching="{prefix_caching}",'
             f'engine="{ENGINE_NAME}"}} 1.0']
    for name, value in sorted(counters.items()):
        lines += [f"# TYPE ds41_exl3_{name} counter", f"ds41_exl3_{name}_total {float(value)}"]
    for name, value in sorted((spec or {}).items()):
        lines += [f"# TYPE {name} counter", f"{name}_total {float(value)}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- speculation
SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED = (f"vllm:spec_decode_num_{n}" for n in
                                                 ("drafts", "draft_tokens", "accepted_tokens"))


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int | None
    model: str | None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """vLLM's --speculative-config JSON as this front understands it: method "mtp" (the checkpoint's own drafter;
    DeepSeek-V4: DSpark), optional num_speculative_tokens and model. Anything else: ValueError naming it."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r:.60}")  # noqa: TRY004 (a bad config value)
    unknown = sorted(set(spec) - {"method", "num_speculative_tokens", "model"})
    if unknown:
        raise ValueError(f"--speculative-config: keys {unknown} are not supported by the exllamav3 front "
                         "(method, num_speculative_tokens, model)")
    if spec.get("method") != "mtp":
        raise ValueError(f"--speculative-config method {spec.get('method')!r}: the exllamav3 front drafts with the "
                         "checkpoint's own drafter only (method \"mtp\")")
    n = spec.get("num_speculative_tokens")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"--speculative-config num_speculative_tokens {n!r}: a positive integer")
    model = spec.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"--speculative-config model {model!r}: a model name")
    return SpeculativeConfig(n, model)


def spec_counters() -> dict[str, float]:
    return {SPEC_DRAFTS: 0.0, SPEC_DRAFT_TOKENS: 0.0, SPEC_ACCEPTED: 0.0}


def count_spec(counters: dict[str, float], generated: int, accepted: int | None, rejected: int | None) -> None:
    """Add one finished job. exllamav3 reports its accepted and rejected draft tokens per job; every verification
    round emits its accepted drafts plus one token of the target's own, so drafts = generated - accepted (a round
    the confidence gate leaves undrafted counts as a draft of 0 tokens). Missing totals add nothing: a drafter
    that never reports is seen by the gate as one that never drafts."""
    if accepted is None:
        return
    counters[SPEC_ACCEPTED] += accepted
    counters[SPEC_DRAFT_TOKENS] += accepted + (rejected or 0)
    counters[SPEC_DRAFTS] += max(generated - accepted, 0)


# ---------------------------------------------------------------------------------------------- cache salt
def salt_root(salt: str | None) -> bytes | None:
    """The 16-byte root a request's page-hash chain starts from: requests share cached pages only when they carry
    the same ``cache_salt`` (vLLM's rule); no salt is the unsalted chain exllamav3 uses by itself."""
    if salt is None:
        return None
    return hashlib.blake2b(b"ds41-cache-salt\0" + salt.encode(), digest_size=16).digest()

"""IO edge of the engine-behaviour gates: request shapes the gates need beyond EngineClient's defaults.

The gates need fixed lengths (``ignore_eos``), chosen salts (prefix cache) and concurrent bursts.
``stream`` is EngineClient.stream with those defaults and a send timestamp; ``complete`` builds the same
vLLM body as the client (``engine.adapters.vllm.generate_request``) plus those fields and parses with the
adapter's strict parser, so every reply is checked exactly like the client's own calls.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from engine.adapters import vllm as v
from engine.adapters.base import Generation, HttpTiming, StreamedGeneration
from engine.client import EngineClient


def complete(client: EngineClient, prompt_ids: Sequence[int], max_tokens: int, k: int, *,
             salt: str | None = None, ignore_eos: bool = True, seq_id: str = "gate",
             extra: dict[str, Any] | None = None) -> Generation:
    """One greedy completion (temperature 0) with top-k logprobs; a fresh salt unless one is given."""
    body = v.generate_request(client.model, list(map(int, prompt_ids)), max_tokens, k,
                              salt if salt is not None else v.fresh_salt())
    body["ignore_eos"] = ignore_eos
    body.update(extra or {})
    reply = client.post_json(v.COMPLETIONS, body, seq_id=seq_id)
    gen = v.parse_generation(reply.data, list(map(int, prompt_ids)), k, client.model, seq_id, client.config.vocab_size)
    return replace(gen, timing=HttpTiming(1, reply.elapsed_s))


@dataclass(frozen=True)
class Timed:
    """A streamed generation with absolute perf_counter stamps (for multi-stream aggregates)."""

    stream: StreamedGeneration
    t_send: float          # perf_counter just before the request was written

    @property
    def generation(self) -> Generation:
        return self.stream.generation


def stream(client: EngineClient, prompt_ids: Sequence[int], max_tokens: int, k: int = 1, *,
           salt: str | None = None, ignore_eos: bool = True, seq_id: str = "gate",
           on_tokens: Callable[[int], None] | None = None) -> Timed:
    """EngineClient.stream with the gates' default (fixed length: ignore_eos) and the send time stamped."""
    t_send = time.perf_counter()
    got = client.stream(prompt_ids, max_tokens, k, seq_id=seq_id, cache_salt=salt, ignore_eos=ignore_eos,
                        on_tokens=on_tokens)
    return Timed(got, t_send)


def together(calls: Sequence[Callable[[], Any]], stagger_s: float = 0.0) -> list[Any]:
    """Run the calls at once (threads released by a barrier, optionally staggered); results in order."""
    if not calls:
        return []
    barrier = threading.Barrier(len(calls))

    def run(i: int, fn: Callable[[], Any]) -> Any:
        barrier.wait()
        if stagger_s:
            time.sleep(i * stagger_s)
        return fn()

    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="ds41-gate") as pool:
        futures = [pool.submit(run, i, fn) for i, fn in enumerate(calls)]
        return [f.result() for f in futures]


def max_model_len(client: EngineClient) -> int | None:
    """``max_model_len`` from vLLM's /v1/models card (None when the engine does not say)."""
    data = client.get_json("/v1/models").data.get("data") or []
    for m in data:
        if isinstance(m, dict) and m.get("id") == client.model and isinstance(m.get("max_model_len"), int):
            return int(m["max_model_len"])
    return None


def cache_config(client: EngineClient) -> dict[str, str]:
    """Labels of vLLM's ``vllm:cache_config_info`` gauge (block_size, enable_prefix_caching, …); {} if absent."""
    snap = client.metrics()
    for fam in snap.families.values():
        for name, labels, _ in fam:
            if name == "vllm:cache_config_info":
                return dict(labels)
    return {}

"""IO edge of the engine-behaviour gates: the gates' defaults over the adapter of the profile's engine.

The gates need fixed lengths (``ignore_eos``), chosen salts (prefix cache), streams with send timestamps,
concurrent bursts and the server's own facts (context length, KV-cache settings). Every request shape is
the adapter's (``engine/adapters``: ``generate`` with ``GenerateOptions``, ``stream``, ``max_model_len``,
``cache_config``), so a gate speaks to whichever engine the profile serves, and an engine that cannot do
what a gate asks says so (UnsupportedSurface: "... not supported by this engine").
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from engine.adapters.base import GenerateOptions, Generation, StreamedGeneration
from engine.client import EngineClient


def complete(client: EngineClient, prompt_ids: Sequence[int], max_tokens: int, k: int, *,
             salt: str | None = None, ignore_eos: bool = True, seq_id: str = "gate",
             extra: dict[str, Any] | None = None) -> Generation:
    """One greedy completion (temperature 0) with top-k logprobs; a fresh salt unless one is given."""
    return client.generate([int(t) for t in prompt_ids], max_tokens, k, seq_id=seq_id,
                           options=GenerateOptions(cache_salt=salt, ignore_eos=ignore_eos, extra=dict(extra or {})))


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
    """The server's context length, as its adapter reads it (None when the engine does not say)."""
    return client.adapter.max_model_len(client)


def cache_config(client: EngineClient) -> dict[str, str]:
    """The server's KV-cache settings (block_size, enable_prefix_caching, …), as its adapter reads them."""
    return client.adapter.cache_config(client)

"""Speed benches (gates.md §9): decode tok/s, TTFT, prefill tok/s, multi-stream aggregates, medians.

Single stream (times in seconds, one clock):
  decode tok/s = (N_out − 1) / (t_last − t_first); TTFT = t_first − t_send;
  prefill tok/s = (N_in − cached) / TTFT, valid only when cached == 0 (a missing count is invalid);
  mean inter-token time = (t_last − t_first) / (N_out − 1).
Streams (N clients on a barrier):
  aggregate end-to-end tok/s = Σ N_out / (max t_last − min t_send);
  aggregate decode tok/s = Σ N_out / (max t_last − min t_first); per-stream decode tok/s p05/p50/p95.
N_out counts tokens (from the ids), never chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np


class BenchInvalid(ValueError):
    """A measurement that must not be reported as a speed (cache hit, too few tokens, no timestamps)."""


@dataclass(frozen=True)
class StreamTimes:
    """One streamed request: absolute send time and (time, tokens) of every chunk."""

    t_send: float
    chunk_times: tuple[float, ...]     # absolute, same clock as t_send
    chunk_tokens: tuple[int, ...]
    n_in: int | None = None
    cached: int | None = None

    @property
    def n_out(self) -> int:
        return int(sum(self.chunk_tokens))

    def _token_times(self) -> list[float]:
        return [t for t, n in zip(self.chunk_times, self.chunk_tokens) if n > 0]

    @property
    def t_first(self) -> float:
        ts = self._token_times()
        if not ts:
            raise BenchInvalid("no chunk carried a token")
        return ts[0]

    @property
    def t_last(self) -> float:
        ts = self._token_times()
        if not ts:
            raise BenchInvalid("no chunk carried a token")
        return ts[-1]


def ttft(s: StreamTimes) -> float:
    return s.t_first - s.t_send


def decode_tps(s: StreamTimes) -> float:
    if s.n_out < 2:
        raise BenchInvalid(f"{s.n_out} tokens: decode speed needs at least 2")
    span = s.t_last - s.t_first
    if span <= 0:
        raise BenchInvalid(f"{s.n_out} tokens arrived in one chunk: no decode span")
    return (s.n_out - 1) / span


def inter_token_s(s: StreamTimes) -> float:
    return 1.0 / decode_tps(s)


def prefill_tps(s: StreamTimes) -> float:
    if s.n_in is None:
        raise BenchInvalid("prompt token count unknown")
    if s.cached is None:
        raise BenchInvalid("cached token count unknown: a prefix-cache hit cannot be ruled out")
    if s.cached != 0:
        raise BenchInvalid(f"{s.cached} of {s.n_in} prompt tokens came from the prefix cache")
    return (s.n_in - s.cached) / ttft(s)


def aggregate(streams: Sequence[StreamTimes]) -> dict[str, Any]:
    if not streams:
        raise BenchInvalid("no streams")
    total = sum(s.n_out for s in streams)
    end = max(s.t_last for s in streams)
    per = [decode_tps(s) for s in streams]
    return {
        "streams": len(streams), "tokens": total,
        "aggregate_e2e_tps": total / (end - min(s.t_send for s in streams)),
        "aggregate_decode_tps": total / (end - min(s.t_first for s in streams)),
        "per_stream_decode_tps_p05": float(np.percentile(per, 5)),
        "per_stream_decode_tps_p50": float(np.percentile(per, 50)),
        "per_stream_decode_tps_p95": float(np.percentile(per, 95)),
        "ttft_p50": float(np.percentile([ttft(s) for s in streams], 50)),
    }


def med(values: Sequence[float]) -> dict[str, Any]:
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": float(np.median(vals)), "min": min(vals), "max": max(vals), "values": vals}


def regressions(medians: Mapping[str, float], best_known: Mapping[str, float], ratio: float = 0.95,
                lower_is_better: Sequence[str] = ()) -> list[str]:
    """Regression rule of gates.md §9: every median ≥ ratio × best-known (≤ best / ratio where lower is better)."""
    out = []
    for key, best in best_known.items():
        if key not in medians:
            out.append(f"{key}: no measurement for a best-known value")
            continue
        got = medians[key]
        if got is None or (isinstance(got, float) and math.isnan(got)):
            out.append(f"{key}: measurement missing")
        elif key in lower_is_better:
            if got > best / ratio:
                out.append(f"{key}: {got:.4g} > {best:.4g} / {ratio}")
        elif got < ratio * best:
            out.append(f"{key}: {got:.4g} < {ratio} × best-known {best:.4g}")
    return out

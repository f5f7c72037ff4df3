"""Depth buckets: where in a sequence a scored position sits (issue 39).

DeepSeek's attention changes character with depth — the sliding window fills at 128 tokens, the indexer starts
pruning past `index_topk x ratio` (2,048 in the tiny checkpoints), the ratio-128 compressor has emitted many
entries by 8K — so the long-context panel and its gates report every number per depth bucket.

The depth buckets partition absolute positions: [0,128), [128,2K), [2K,8K), [8K,32K), [32K,128K), and an open
bucket past 128K (the release context reaches 1M). `last256` is an overlay, not part of the partition: the last
256 positions of a sequence, where decode after a long prefill lives; a position there is counted in its depth
bucket and in `last256`. Pure functions, no IO.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from core.errors import UserError

DEPTH_BUCKETS: tuple[tuple[int, int], ...] = (
    (0, 128), (128, 2048), (2048, 8192), (8192, 32768), (32768, 131072))
OPEN_BUCKET_START = 131072          # positions from here on fall in the open bucket (1M-context needles)
TAIL_TOKENS = 256
TAIL_LABEL = "last256"


def _short(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


DEPTH_LABELS: tuple[str, ...] = tuple(f"d{_short(lo)}-{_short(hi)}" for lo, hi in DEPTH_BUCKETS) + (
    f"d{_short(OPEN_BUCKET_START)}+",)
"""One label per depth bucket, the open one last: d0-128, d128-2K, d2K-8K, d8K-32K, d32K-128K, d128K+."""

BUCKET_LABELS: tuple[str, ...] = DEPTH_LABELS + (TAIL_LABEL,)
"""Every bucket a table may show, in display order: the depth buckets, then the last-256 overlay."""

_EDGES = np.asarray([lo for lo, _ in DEPTH_BUCKETS] + [OPEN_BUCKET_START], dtype=np.int64)


class DepthError(UserError, ValueError):
    """A position outside its sequence, or a bucket label that does not exist."""


def _check(pos: int, seq_len: int) -> None:
    if seq_len < 1 or not 0 <= pos < seq_len:
        raise DepthError(f"position {pos} is outside a sequence of {seq_len} tokens (allowed: 0 <= pos < seq_len)")


def depth_index(pos: int) -> int:
    """Index into DEPTH_LABELS of the depth bucket holding absolute position `pos` (>= 0)."""
    if pos < 0:
        raise DepthError(f"position {pos} is negative")
    return int(np.searchsorted(_EDGES, pos, side="right") - 1)


def bucket_of(pos: int, seq_len: int) -> str:
    """The depth bucket (a DEPTH_LABELS entry) of position `pos` in a sequence of `seq_len` tokens."""
    _check(pos, seq_len)
    return DEPTH_LABELS[depth_index(pos)]


def in_tail(pos: int, seq_len: int) -> bool:
    """Whether `pos` is among the last TAIL_TOKENS positions of its sequence."""
    _check(pos, seq_len)
    return pos >= seq_len - TAIL_TOKENS


def buckets_of(pos: int, seq_len: int) -> tuple[str, ...]:
    """Every bucket `pos` counts in: its depth bucket, plus `last256` when it is in the tail."""
    depth = bucket_of(pos, seq_len)
    return (depth, TAIL_LABEL) if in_tail(pos, seq_len) else (depth,)


def depth_indices(positions: np.ndarray) -> np.ndarray:
    """Vectorised depth_index: int64 [P] of DEPTH_LABELS indices for absolute positions [P]."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and positions.min() < 0:
        raise DepthError(f"position {int(positions.min())} is negative")
    return (np.searchsorted(_EDGES, positions, side="right") - 1).astype(np.int64)


def tail_mask(positions: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """bool [P]: position i is in the last TAIL_TOKENS of its sequence (seq_lens[i] is that sequence's length)."""
    positions = np.asarray(positions, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if positions.shape != seq_lens.shape:
        raise DepthError(f"positions {positions.shape} and sequence lengths {seq_lens.shape} differ in shape")
    bad = (positions < 0) | (positions >= seq_lens)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _check(int(positions[i]), int(seq_lens[i]))
    return positions >= seq_lens - TAIL_TOKENS


def bucket_members(positions: np.ndarray, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
    """For every label of BUCKET_LABELS, the bool [P] mask of positions that count in it."""
    idx = depth_indices(positions)
    out = {label: idx == i for i, label in enumerate(DEPTH_LABELS)}
    out[TAIL_LABEL] = tail_mask(positions, seq_lens)
    return out


def bucket_range(label: str) -> tuple[int, int | None]:
    """[lo, hi) of a depth bucket label (hi None for the open bucket); `last256` has no absolute range."""
    if label not in DEPTH_LABELS:
        raise DepthError(f"unknown depth bucket {label!r}; known: {list(DEPTH_LABELS)}")
    i = DEPTH_LABELS.index(label)
    return DEPTH_BUCKETS[i] if i < len(DEPTH_BUCKETS) else (OPEN_BUCKET_START, None)


def labels_reached(seq_len: int) -> Sequence[str]:
    """The depth buckets a sequence of `seq_len` tokens has positions in, plus `last256`."""
    if seq_len < 1:
        raise DepthError(f"a sequence of {seq_len} tokens has no positions")
    return DEPTH_LABELS[:depth_index(seq_len - 1) + 1] + (TAIL_LABEL,)

"""`position_metrics`: every per-position metric of an engine record against the reference (gates.md §2).

The compiled kernel (`core.metrics.kernel`) computes them; `DS41_METRICS_BACKEND=definition` runs the
readable per-position definition (`core.metrics.definition`) instead, for spot checks on small records.
"""

from __future__ import annotations

import os

from core.metrics.definition import PositionMetrics, definition_position_metrics
from core.metrics.kernel import kernel_position_metrics
from core.records import Record

BACKENDS = ("numba", "definition")


def backend() -> str:
    """The implementation `position_metrics` uses: "numba" (default) or "definition"."""
    want = os.environ.get("DS41_METRICS_BACKEND", "auto").strip().lower()
    if want == "auto":
        return "numba"
    if want not in BACKENDS:
        raise ValueError(f"DS41_METRICS_BACKEND={want!r}: expected auto, {' or '.join(BACKENDS)}")
    return want


def position_metrics(ref: Record, eng: Record) -> PositionMetrics:
    """All per-position metrics of engine record `eng` against reference `ref` (gates.md §2).

    Raises RecordMismatch when the records are not comparable and RecordError on NaN / +inf logprobs.
    """
    if backend() == "definition":
        return definition_position_metrics(ref, eng)
    return kernel_position_metrics(ref, eng)

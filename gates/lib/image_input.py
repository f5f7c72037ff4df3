"""Pure verdicts of the image-input gate (gates/test_image_input.py): the read-back and the text-path check.

    readback_verdict(reply, expected)          # a rendered string must come back exactly
    same_greedy_verdict(engine_ids, oracle_ids, ...)  # what a random-weight model's read-back can show
    path_agreement(a, b, tol)                   # one text prompt's logprobs through two engine paths

The read-back a real vision-language model owes (the seed's "a text image read back exactly") is
``readback_verdict``: the reply, stripped of surrounding whitespace and closing punctuation, must hold the
rendered string exactly (case and inner whitespace as rendered; a newline in the image may come back as a
space). A random-weight model reads nothing, so on the CPU rig's tiny VLM the gate asks what is real there:
the engine's greedy reply to the rendered-text image equals the fp32 oracle's greedy reply token for token
(the image reached the model through the same pixels, tower and positions), and different images give
different replies (the reply depends on the image, so the equality is not vacuous).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ReadbackResult:
    passed: bool
    expected: str
    reply: str
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def readback_verdict(reply: str, expected: str) -> ReadbackResult:
    """The rendered string must appear in the reply exactly (whitespace runs compared as one space)."""
    if not expected.strip():
        raise ValueError("readback_verdict: the expected string is empty")
    want, got = _norm(expected), _norm(reply)
    if want in got:
        return ReadbackResult(True, expected, reply, f"reply holds {want!r} exactly")
    low = want.lower() in got.lower()
    why = (f"reply {got[:80]!r} lacks {want!r}" + (" (present only case-folded: not exact)" if low else ""))
    return ReadbackResult(False, expected, reply, why)


@dataclass(frozen=True)
class SameGreedyResult:
    passed: bool
    engine_ids: tuple[int, ...]
    oracle_ids: tuple[int, ...]
    first_difference: int | None
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


def same_greedy_verdict(engine_ids: Sequence[int], oracle_ids: Sequence[int]) -> SameGreedyResult:
    """Token-for-token equality of two greedy continuations of the same prompt (the same length asked)."""
    e, o = tuple(int(t) for t in engine_ids), tuple(int(t) for t in oracle_ids)
    if not o:
        raise ValueError("same_greedy_verdict: the oracle continuation is empty")
    first = next((i for i, (a, b) in enumerate(zip(e, o)) if a != b), None)
    if first is None and len(e) != len(o):
        first = min(len(e), len(o))
    if first is None:
        return SameGreedyResult(True, e, o, None, f"{len(o)} greedy tokens identical")
    return SameGreedyResult(False, e, o, first, f"greedy replies differ at token {first}: engine "
                            f"{e[first] if first < len(e) else 'end'} vs oracle {o[first] if first < len(o) else 'end'}")


def path_agreement(a: np.ndarray, b: np.ndarray, tol: float) -> dict:
    """Max |a - b| of two paths' actual-token logprobs of one prompt, and whether it is within `tol`."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"path_agreement: {a.shape} vs {b.shape} positions")
    d = float(np.max(np.abs(a - b))) if a.size else 0.0
    return {"max_abs_diff": d, "tol": tol, "passed": bool(d <= tol and not math.isnan(d)), "positions": int(a.size)}

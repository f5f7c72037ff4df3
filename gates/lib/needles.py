"""Needle in a haystack (gates.md §7): verdict, length × depth table and heatmap rows.

A cell passes when the passphrase appears in the answer as an exact substring (Unicode dashes
normalised to '-'). Pass: every cell of the grid passes and every burst copy equals its solo run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

DASHES = "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"


def normalise(text: str) -> str:
    return text.translate({ord(c): "-" for c in DASHES})


def found(answer: str, passphrase: str) -> bool:
    from panels.needles import score_needle

    return score_needle(normalise(answer), passphrase)


@dataclass(frozen=True)
class Cell:
    length: int
    depth: float
    seed: int
    prompt_tokens: int
    actual_depth: float
    passphrase: str
    answer: str
    ttft_s: float | None = None

    @property
    def passed(self) -> bool:
        return found(self.answer, self.passphrase)

    def as_row(self) -> dict[str, Any]:
        return {"length": self.length, "depth": self.depth, "prompt_tokens": self.prompt_tokens,
                "actual_depth": round(self.actual_depth, 3), "found": self.passed, "passphrase": self.passphrase,
                "answer": self.answer.strip()[:80], "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 3)}


@dataclass
class NeedleResult:
    passed: bool
    failures: list[str]
    rows: list[dict[str, Any]]
    heatmap: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)


def heatmap_rows(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """One row per length, one column per depth: '✓' found, '✗' missed."""
    depths = sorted({c.depth for c in cells})
    rows = []
    for n in sorted({c.length for c in cells}):
        row: dict[str, Any] = {"length": n}
        for d in depths:
            hit = [c for c in cells if c.length == n and c.depth == d]
            row[f"depth {d:g}"] = "" if not hit else ("✓" if all(c.passed for c in hit) else "✗")
        rows.append(row)
    return rows


def judge(cells: Sequence[Cell], burst_equal: Sequence[tuple[str, bool]] = (), gate_found: bool = True) -> NeedleResult:
    """``gate_found=False`` (a random-weight model, which cannot retrieve anything) keeps the cells and the
    found count in the result but gates only burst == solo."""
    misses = [f"needle missed at length {c.length}, depth {c.depth:g} ({c.prompt_tokens} tokens): "
              f"answer {c.answer.strip()[:60]!r}, passphrase {c.passphrase!r}" for c in cells if not c.passed]
    failures = list(misses) if gate_found else []
    failures += [f"burst != solo: {label}" for label, ok in burst_equal if not ok]
    if not cells:
        failures.append("no needle cells were run")
    summary = {"cells": len(cells), "found": sum(c.passed for c in cells),
               "lengths": sorted({c.length for c in cells}), "depths": sorted({c.depth for c in cells}),
               "burst_equal": f"{sum(ok for _, ok in burst_equal)}/{len(burst_equal)}", "found_gated": gate_found}
    return NeedleResult(not failures, failures, [c.as_row() for c in cells], heatmap_rows(cells), summary)

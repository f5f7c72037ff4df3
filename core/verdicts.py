"""The KL panel gate's verdict for one engine record against its reference (gates.md §3)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from core import metrics
from core.bands import judge_panel, load_bands
from core.records import Record


@dataclass
class PanelGateResult:
    """The verdict, and the pair's metrics it rests on (`pair`), which the report renders as they are."""

    label: str
    profile: str
    passed: bool
    failures: list[str]
    rows: list[dict]
    summary: dict[str, Any]
    pair: metrics.PairMetrics | None = None
    bands_file: str = ""        # the bands file the verdict was judged under (the report names it)


def judge_pair(pair: metrics.PairMetrics, profile: str, bands_file: str | os.PathLike) -> PanelGateResult:
    """The KL panel verdict of a scored pair under ``profile``'s bands in ``bands_file``."""
    result = pair.panel
    verdict = judge_panel(result, load_bands(profile, bands_file), profile)
    o = result.overall
    summary = {"kl_part_mean": o.kl_part.mean, "kl_part_macro": result.macro_kl, "top1": o.top1,
               "ppl_ratio": o.perplexity.get("ratio"), "positions": o.n_positions, "prompts": o.n_prompts}
    return PanelGateResult(pair.label, profile, verdict.passed, verdict.failures(), verdict.as_rows(), summary, pair,
                           str(bands_file))


def judge(ref: Record, eng: Record, profile: str, label: str, bands_file: str | os.PathLike):
    """Score ``eng`` against ``ref`` once and judge it: (its PanelMetrics, the PanelGateResult carrying the pair)."""
    gate = judge_pair(metrics.score_pair(ref, label, eng), profile, bands_file)
    return gate.pair.panel, gate

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
    label: str
    profile: str
    passed: bool
    failures: list[str]
    rows: list[dict]
    summary: dict[str, Any]


def judge(ref: Record, eng: Record, profile: str, label: str, bands_file: str | os.PathLike):
    """The KL panel verdict of ``eng`` against ``ref`` under ``profile``'s bands in ``bands_file``."""
    if set(eng.seq_ids) != set(ref.seq_ids):
        ref = ref.subset(eng.seq_ids)  # a text-only engine's record names what it left out
    result = metrics.panel_metrics(ref, eng)
    verdict = judge_panel(result, load_bands(profile, bands_file), profile)
    o = result.overall
    summary = {"kl_part_mean": o.kl_part.mean, "kl_part_macro": result.macro_kl, "top1": o.top1,
               "ppl_ratio": o.perplexity.get("ratio"), "positions": o.n_positions, "prompts": o.n_prompts}
    return result, PanelGateResult(label, profile, verdict.passed, verdict.failures(), verdict.as_rows(), summary)

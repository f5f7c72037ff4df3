"""KL / top-1 per depth bucket against the oracle's long-context reference (issue 39): the one rule the long-context
gate (gates/test_long_context.py, the session's engine) and the flag A/B's depth gates (gates/test_flag_ab.py, each
arm) apply. Pure over records; the IO (the reference, the engine's scoring) is the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.bands import judge_depth, load_depth_bands
from core.metrics import position_metrics
from core.metrics.by_depth import depth_reports, depth_rows
from core.records import Record


def not_applicable(lengths: Sequence[int], max_model_len: int | None, profile: str) -> str | None:
    """Why long@1 at ``lengths`` cannot be scored on this engine (none configured, or its context cannot hold
    them), or None when it can: a gate that cannot run at depth says so (xfail, never PASS)."""
    if not lengths:
        return f"no long@1 lengths configured for profile {profile!r}"
    if max_model_len is None or max(lengths) > max_model_len:
        return f"max_model_len {max_model_len} cannot hold {max(lengths)} tokens"
    return None


def long_items(lengths: Sequence[int], domains: Sequence[str], tokenizer):
    """long@1's items of ``lengths`` tokens (``domains``; none listed: every domain), encoded for the engine."""
    from panels import encode_panel, load_panel
    from panels.long import select

    return encode_panel(select(load_panel("long"), lengths=list(lengths), domains=list(domains or ()) or None), tokenizer)


@dataclass(frozen=True)
class DepthVerdict:
    passed: bool
    failures: tuple[str, ...]
    rows: tuple[dict, ...]       # one per depth bucket: depth_rows + verdict / why

    def metrics(self) -> dict[str, float]:
        return {f"kl_part_mean[{r['bucket']}]": float(r["kl_part_mean"]) for r in self.rows}


def judge_at_depth(reference: Record, engine: Record, bands_file: str | Path, band_profile: str) -> DepthVerdict:
    """The engine's record against the oracle's long-context reference, per depth bucket under the
    ``[depth.<band_profile>]`` bands of ``bands_file``. Every scored position lies in one bucket (checked)."""
    reports = depth_reports(reference, position_metrics(reference, engine))
    verdict = judge_depth(reports, load_depth_bands(band_profile, bands_file), band_profile)
    rows = depth_rows(reports)
    for row, v in zip(rows, verdict.domains):
        row["verdict"] = "pass" if v.passed else "FAIL"
        row["why"] = "; ".join(v.failures)
    counted = sum(r["positions"] for r in rows if r["bucket"] != "last256")
    if not rows or counted != len(reference.pos_index):
        raise AssertionError(f"depth buckets hold {counted} positions, the reference scores {len(reference.pos_index)}")
    return DepthVerdict(verdict.passed, tuple(verdict.failures()), tuple(rows))

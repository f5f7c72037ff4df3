"""KL / top-1 per depth bucket (issue 39): the panel summaries of core/metrics/panel.py, grouped by where in its
sequence each scored position sits (core/depth.py) instead of by domain.

DeepSeek's attention changes character with depth (the window fills at 128, the indexer prunes past 2,048 on the
tiny checkpoints), so a fault that lives only there is diluted to nothing in a whole-panel mean; per bucket it
stands alone. Each bucket's `GroupReport` is judged against its own band (core.bands.load_depth_bands). The
`last256` overlay is reported too (a position there is also counted in its depth bucket). Pure functions.
"""

from __future__ import annotations

import numpy as np

from core.depth import BUCKET_LABELS, bucket_members
from core.metrics.definition import PositionMetrics
from core.metrics.panel import GroupReport, group_report
from core.records import Record


def depth_reports(ref: Record, pm: PositionMetrics, n_boot: int = 2000, seed: int = 0) -> dict[str, GroupReport]:
    """One GroupReport per bucket that holds scored positions, in BUCKET_LABELS order; ``pm`` is aligned with
    ``ref``'s scored positions (core.metrics.position_metrics(ref, eng))."""
    if len(pm.kl_part) != len(ref.pos_index):
        raise ValueError(f"position metrics have {len(pm.kl_part)} rows, the reference {len(ref.pos_index)} scored "
                         "positions")
    lengths = np.diff(ref.seq_offsets)[ref.pos_seq]
    members = bucket_members(ref.pos_index, lengths)
    return {b: group_report(pm, members[b], b, n_boot, seed) for b in BUCKET_LABELS if members[b].any()}


def depth_rows(reports: dict[str, GroupReport]) -> list[dict]:
    """The per-bucket KL table: positions, prompts, KL_part mean with its prompt-bootstrap interval, p99, top-1
    on decided positions, |ln PPL ratio|, hard fails."""
    rows = []
    for bucket, g in reports.items():
        rows.append({"bucket": bucket, "positions": g.n_positions, "prompts": g.n_prompts,
                     "kl_part_mean": g.kl_part.mean, "kl_part_ci": [g.kl_part.ci_low, g.kl_part.ci_high],
                     "kl_part_p99": g.kl_part.p99, "top1_decided": g.top1_decided,
                     "ln_ppl_ratio": g.perplexity.get("ln_ratio"), "hard_fails": g.hard_fails})
    return rows

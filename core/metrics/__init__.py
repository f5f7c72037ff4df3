"""Fidelity metrics between a reference record and an engine record (gates.md §2).

    definition   the per-position metrics, written to be read against gates.md §2 (the reference)
    kernel       the same metrics, compiled; tested equal to the definition
    positions    position_metrics: picks the implementation (DS41_METRICS_BACKEND)
    summaries    percentiles, prompt and domain-macro bootstraps, Δp and perplexity statistics
    panel        group_report / panel_metrics: per-domain and overall reports, confidence buckets
    paired       paired_comparison: per-prompt paired differences, bootstrap interval, Wilcoxon
    pair         score_pair: one (reference, engine) pair scored once (PairMetrics), carried to the verdict
                 and the report; panel_evidence / score_panel: one report's pairs and their comparison
"""

from core.metrics.definition import (CONFIDENCE_EDGES, CONFIDENCE_LABELS, NEAR_TIE_DELTA, R20_SUPPORT, REST_FLOOR,
                                     PositionMetrics, definition_position_metrics)
from core.metrics.kernel import kernel_position_metrics
from core.metrics.pair import (PAIRED_METRICS, EvidenceError, PairMetrics, PanelEvidence, compare_pairs,
                               panel_evidence, score_pair, score_panel)
from core.metrics.paired import PairedComparison, paired_comparison, paired_prompt_comparison, per_prompt_means
from core.metrics.panel import GroupReport, PanelMetrics, group_report, panel_metrics
from core.metrics.positions import backend, position_metrics
from core.metrics.summaries import (DP_QUANTILES, Summary, delta_p_stats, macro_bootstrap, perplexity_stats,
                                    prompt_bootstrap, summarize)

__all__ = [
    "CONFIDENCE_EDGES", "CONFIDENCE_LABELS", "DP_QUANTILES", "NEAR_TIE_DELTA", "PAIRED_METRICS", "R20_SUPPORT",
    "REST_FLOOR", "EvidenceError", "GroupReport", "PairMetrics", "PairedComparison", "PanelEvidence",
    "PanelMetrics", "PositionMetrics", "Summary", "backend", "compare_pairs", "definition_position_metrics",
    "delta_p_stats", "group_report", "kernel_position_metrics", "macro_bootstrap", "paired_comparison",
    "paired_prompt_comparison", "panel_evidence", "panel_metrics", "per_prompt_means", "perplexity_stats",
    "position_metrics", "prompt_bootstrap", "score_pair", "score_panel", "summarize",
]

"""Per-flag A/B gate (gates.md §10.6): the verdict of each gate as a typed `core.results.FlagGateVerdict`, and its
report rows, and the greedy prompts. Pure: the statistics come from nightly.flag_ab, the IO (servers, scoring,
generation) is in gates/test_flag_ab.py; the verdicts accumulate in the session's results (`GateResults.flag_ab`).

Every verdict has ``passed`` and ``why`` (one line a person reads); the numbers the nightly history tracks are its
typed fields (``max_abs_diff``, ``mean_diff``, ``ratio``), the rest of the statistics its display-only evidence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from core.results import FlagGateVerdict, GateResults
from nightly.flag_ab import BitwiseResult, PairedVerdict, SpeedVerdict

REPORT_TITLE = "Flag A/B verdicts"
REPORT_NOTE = "gates.md §10; classes and thresholds in the flag registry"


def bitwise_why(res: BitwiseResult) -> str:
    if res.identical:
        return f"{res.what}: {res.compared} positions bit-identical"
    return (f"{res.what}: {res.n_mismatches} of {res.compared} differ (max |Δ logprob| {res.max_abs_diff:.3g}): "
            + "; ".join(res.mismatches))


def bitwise_verdict(res: BitwiseResult, gate: str = "bitwise_panel") -> FlagGateVerdict:
    """bitwise_panel (the panel) / bitwise_depth (long@1 at depth): every id and logprob of the on-record equals
    the off-record's."""
    return FlagGateVerdict(gate, res.identical, bitwise_why(res), max_abs_diff=res.max_abs_diff,
                           evidence=res.as_dict())


def depth_band_verdict(passed: bool, failures: Sequence[str], band_profile: str, rows: Sequence[Mapping[str, Any]],
                       lengths: Sequence[int]) -> FlagGateVerdict:
    """kl_depth: the on-run's KL / top-1 per depth bucket against the oracle's long-context reference, under
    ``band_profile``'s [depth] bands (gates/lib/depth.py)."""
    worst = max((float(r["kl_part_mean"]) for r in rows), default=float("nan"))
    return FlagGateVerdict("kl_depth", passed, "; ".join(failures) or
                           f"every depth bucket within the {band_profile} depth bands (long@1 items of {list(lengths)} "
                           f"tokens; worst bucket mean KL_part {worst:.4g})",
                           evidence={"band_profile": band_profile, "lengths": list(lengths), "buckets": list(rows)})


def greedy_verdict(off_vs_off: BitwiseResult, off_vs_on: BitwiseResult) -> FlagGateVerdict:
    """bitwise_greedy: on's greedy generations equal off's. When off is not even deterministic against itself,
    the verdict falls back to the observed spread and is marked provisional (gates.md §10.6 step 2)."""
    evidence = {"baseline_deterministic": off_vs_off.identical, **off_vs_on.as_dict()}
    if off_vs_off.identical:
        return FlagGateVerdict("bitwise_greedy", off_vs_on.identical, bitwise_why(off_vs_on),
                               max_abs_diff=off_vs_on.max_abs_diff, evidence=evidence)
    return FlagGateVerdict(
        "bitwise_greedy", off_vs_on.ids_identical and off_vs_on.max_abs_diff <= off_vs_off.max_abs_diff,
        f"baseline not deterministic (off vs off max |Δ| {off_vs_off.max_abs_diff:.3g}); provisional tolerance "
        f"verdict: {bitwise_why(off_vs_on)}", provisional=True, max_abs_diff=off_vs_on.max_abs_diff, evidence=evidence)


def band_verdict(passed: bool, failures: Sequence[str], band_profile: str,
                 summary: Mapping[str, Any]) -> FlagGateVerdict:
    """kl_band: the on-run's KL panel verdict (core.verdicts.judge) under ``band_profile``'s bands."""
    return FlagGateVerdict("kl_band", passed, "; ".join(failures) or f"within the {band_profile} bands",
                           evidence={"band_profile": band_profile, "summary": dict(summary)})


def paired_verdict(pv: PairedVerdict, bit: BitwiseResult) -> FlagGateVerdict:
    """paired_not_worse, with whether the two records happen to be bit-identical beside it."""
    return FlagGateVerdict("paired_not_worse", pv.passed, pv.reason, mean_diff=pv.diff_mean,
                           max_abs_diff=bit.max_abs_diff, evidence={**pv.as_dict(), "bit_identical": bit.identical})


def speed_verdict(sv: SpeedVerdict) -> FlagGateVerdict:
    """speed: median tokens/s on over off (the registry's tolerance decides)."""
    return FlagGateVerdict("speed", sv.passed, sv.reason, ratio=sv.ratio, evidence=sv.as_dict())


def report_rows(results: GateResults, expected: Mapping[str, Sequence[str]]) -> list[dict[str, str]]:
    """Per flag the run tested: its verdict over every gate its class expects (core.results.aggregate: an errored,
    skipped or missing gate is named, never left out), then each of those gates with how it ended."""
    rows = []
    for flag in results.flags_seen():
        ab = results.flag(flag)
        cls = ab.cls if ab is not None else ""
        agg = results.flag_aggregate(flag, expected.get(flag, ()))
        rows.append({"flag": flag, "class": cls, "gate": "(all expected)", "verdict": agg.verdict,
                     "why": agg.label()})
        rows += [{"flag": flag, "class": cls, "gate": t.gate, "verdict": t.state if t.state != "passed" else "pass",
                  "why": t.why} for t in agg.gates]
    return rows


def expected_gates(registry) -> dict[str, tuple[str, ...]]:
    """flag → the gates its class (or its own list) runs, for every flag of a nightly.flags.Registry."""
    return {e.name: e.effective_gates() for e in registry}


def greedy_prompts(sequences: Iterable, per_domain: int, max_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    """The first ``per_domain`` panel sequences of each domain, cut to their unscored prompt (at most
    ``max_tokens``, at least one token): (seq_id, prompt ids)."""
    seen: dict[str, int] = {}
    out = []
    for seq in sequences:
        if seen.get(seq.domain, 0) >= per_domain:
            continue
        seen[seq.domain] = seen.get(seq.domain, 0) + 1
        first = next((i for i, s in enumerate(seq.scored_mask) if s), len(seq.token_ids))
        out.append((seq.seq_id, tuple(seq.token_ids[:max(1, min(first, max_tokens))])))
    return out

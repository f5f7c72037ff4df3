"""Per-flag A/B gate (gates.md §10.6): the verdict of each gate as a results.json entry, the results table and
its report rows, and the greedy prompts. Pure: the statistics come from nightly.flag_ab, the IO (servers,
scoring, generation) is in gates/test_flag_ab.py.

Every verdict is a dict with at least ``passed`` (bool) and ``why`` (one line a person reads).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from nightly.flag_ab import BitwiseResult, PairedVerdict, SpeedVerdict

REPORT_TITLE = "Flag A/B verdicts"
REPORT_NOTE = "gates.md §10; classes and thresholds in the flag registry"


def bitwise_why(res: BitwiseResult) -> str:
    if res.identical:
        return f"{res.what}: {res.compared} positions bit-identical"
    return (f"{res.what}: {res.n_mismatches} of {res.compared} differ (max |Δ logprob| {res.max_abs_diff:.3g}): "
            + "; ".join(res.mismatches))


def bitwise_verdict(res: BitwiseResult) -> dict[str, Any]:
    """bitwise_panel: every id and logprob of the on-record equals the off-record's."""
    return {"passed": res.identical, "why": bitwise_why(res), **res.as_dict()}


def greedy_verdict(off_vs_off: BitwiseResult, off_vs_on: BitwiseResult) -> dict[str, Any]:
    """bitwise_greedy: on's greedy generations equal off's. When off is not even deterministic against itself,
    the verdict falls back to the observed spread and is marked provisional (gates.md §10.6 step 2)."""
    verdict = {"passed": off_vs_on.identical, "why": bitwise_why(off_vs_on),
               "baseline_deterministic": off_vs_off.identical, **off_vs_on.as_dict()}
    if not off_vs_off.identical:
        verdict.update(passed=off_vs_on.ids_identical and off_vs_on.max_abs_diff <= off_vs_off.max_abs_diff,
                       provisional=True,
                       why=f"baseline not deterministic (off vs off max |Δ| {off_vs_off.max_abs_diff:.3g}); "
                           f"provisional tolerance verdict: {bitwise_why(off_vs_on)}")
    return verdict


def band_verdict(passed: bool, failures: Sequence[str], band_profile: str, summary: Mapping[str, Any]) -> dict[str, Any]:
    """kl_band: the on-run's KL panel verdict (core.verdicts.judge) under ``band_profile``'s bands."""
    return {"passed": passed, "why": "; ".join(failures) or f"within the {band_profile} bands",
            "band_profile": band_profile, "summary": dict(summary)}


def paired_verdict(pv: PairedVerdict, bit: BitwiseResult) -> dict[str, Any]:
    """paired_not_worse, with whether the two records happen to be bit-identical beside it."""
    return {"passed": pv.passed, "why": pv.reason, **pv.as_dict(), "bit_identical": bit.identical,
            "max_abs_diff": bit.max_abs_diff}


def speed_entry(sv: SpeedVerdict) -> dict[str, Any]:
    return {"passed": sv.passed, "why": sv.reason, **sv.as_dict()}


def with_verdict(results: Mapping[str, dict], flag: str, cls: str, kind: str, profile: str, gate: str,
                 verdict: Mapping[str, Any]) -> dict[str, dict]:
    """``results`` (flag → {class, kind, profile, gates, passed}) with one more gate verdict; a new dict."""
    out = {f: {**slot, "gates": dict(slot["gates"])} for f, slot in results.items()}
    slot = out.setdefault(flag, {"class": cls, "kind": kind, "profile": profile, "gates": {}})
    slot["gates"][gate] = dict(verdict)
    slot["passed"] = all(v["passed"] for v in slot["gates"].values())
    return out


def report_rows(results: Mapping[str, dict]) -> list[dict[str, str]]:
    return [{"flag": f, "class": s["class"], "gate": g, "verdict": "pass" if v["passed"] else "FAIL", "why": v["why"]}
            for f, s in results.items() for g, v in s["gates"].items()]


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

"""Prefix cache (gates.md §6): a warm request served from a cached prefix against the same request cold.

Per case: **cold** (fresh salt, ``cached_tokens`` must be 0), **prime** (the shared prefix under salt s),
**warm** (the test prompt under s, ``cached_tokens`` must reach the block-aligned shared length).
A hit that is not proven makes the case INVALID, never a pass; a missing ``cached_tokens`` field is
*unknown*, not 0.

Verdicts (first matching rule):

* INVALID — cold not proven cold, or warm hit not proven (``cached_tokens`` < expected or 0, or unknown);
* CORRUPT — a non-finite logprob; the first token differs at a decided position; or a step where the cold
  run is confident (p₍₁₎ ≥ 0.9) has warm p₍₁₎ < 0.5 (before any divergence);
* NOISE — ids diverge first at a near-tie of the cold run (margin < δ);
* FAIL — ids diverge at a decided position (within ``fail_window`` tokens or later: PASS needs all M ids
  identical), or a per-step KL_part(cold ‖ warm) above ``kl_tol`` before any divergence;
* PASS — identical ids for all M tokens and every step within ``kl_tol``.

``kl_tol`` = max(c · F_run, floor), F_run being the largest per-step KL_part between two cold runs of the
same prompts measured on the same server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gates.lib.common import NEAR_TIE_DELTA, StepLike, first_divergence, margin, non_finite, step_metrics, top1_prob

VERDICTS = ("PASS", "NOISE", "FAIL", "CORRUPT", "INVALID")
BAD = ("FAIL", "CORRUPT", "INVALID")


def expected_cached(shared_len: int, test_len: int, block: int) -> int:
    """Tokens a prefix cache with full-block reuse must serve: whole blocks of the shared prefix, never
    the test prompt's last token (it must be computed to produce the next-token distribution)."""
    return (min(shared_len, test_len - 1) // block) * block


@dataclass(frozen=True)
class Run:
    ids: tuple[int, ...]
    steps: tuple[StepLike, ...]
    cached_tokens: int | None


@dataclass(frozen=True)
class CaseVerdict:
    case: str
    verdict: str
    reason: str
    first_divergence: int | None = None
    cold_cached: int | None = None
    warm_cached: int | None = None
    expected_cached: int = 0
    max_step_kl: float | None = None

    def as_row(self, **extra: Any) -> dict[str, Any]:
        return {"case": self.case, **extra, "verdict": self.verdict, "reason": self.reason,
                "cached": f"{self.warm_cached}/{self.expected_cached}", "cold_cached": self.cold_cached,
                "first_divergence": self.first_divergence, "max_step_kl": self.max_step_kl}


def classify(case: str, cold: Run, warm: Run, expected: int, kl_tol: float, fail_window: int = 8) -> CaseVerdict:
    base = dict(cold_cached=cold.cached_tokens, warm_cached=warm.cached_tokens, expected_cached=expected)
    if expected <= 0:
        return CaseVerdict(case, "INVALID", "no full block is shared: a hit cannot be proven", **base)
    if cold.cached_tokens is None or warm.cached_tokens is None:
        return CaseVerdict(case, "INVALID", "usage.prompt_tokens_details.cached_tokens is missing (unknown, not 0)",
                           **base)
    if cold.cached_tokens != 0:
        return CaseVerdict(case, "INVALID", f"cold run served {cold.cached_tokens} cached tokens", **base)
    if warm.cached_tokens <= 0 or warm.cached_tokens < expected:
        return CaseVerdict(case, "INVALID", f"no hit proven: cached_tokens {warm.cached_tokens} < {expected}", **base)
    if non_finite(cold.steps) or non_finite(warm.steps):
        return CaseVerdict(case, "CORRUPT", "non-finite logprob", **base)
    div = first_divergence(cold.ids, warm.ids)
    upto = len(cold.ids) if div is None else div
    upto = min(upto, len(cold.steps), len(warm.steps))
    sm = step_metrics([cold.steps[:upto]], [warm.steps[:upto]]) if upto else None
    max_kl = float(np.max(sm.kl_part)) if sm is not None and sm.kl_part.size else 0.0
    base["max_step_kl"] = max_kl
    base["first_divergence"] = div
    for j in range(upto):
        if top1_prob(cold.steps[j]) >= 0.9 and top1_prob(warm.steps[j]) < 0.5:
            return CaseVerdict(case, "CORRUPT", f"step {j}: cold p1 {top1_prob(cold.steps[j]):.3f}, "
                               f"warm p1 {top1_prob(warm.steps[j]):.3f}", **base)
    if div is not None:
        m = margin(cold.steps[div]) if div < len(cold.steps) else math.inf
        if m < NEAR_TIE_DELTA:
            return CaseVerdict(case, "NOISE", f"ids diverge at step {div}, a near-tie of the cold run (margin {m:.3g})",
                               **base)
        if div == 0:
            return CaseVerdict(case, "CORRUPT", f"the first token differs at a decided position (margin {m:.3g})",
                               **base)
        where = f"within {fail_window} tokens" if div < fail_window else "after the fail window"
        return CaseVerdict(case, "FAIL", f"ids diverge at step {div} ({where}), decided position (margin {m:.3g})",
                           **base)
    if not max_kl <= kl_tol:
        return CaseVerdict(case, "FAIL", f"per-step KL_part(cold ‖ warm) {max_kl:.3g} > {kl_tol:.3g}", **base)
    return CaseVerdict(case, "PASS", "identical ids, steps within tolerance", **base)


def run_to_run(pairs: Sequence[tuple[Run, Run]]) -> float:
    """F_run: the largest per-step KL_part between two cold runs of the same prompts (common prefix)."""
    worst = 0.0
    for a, b in pairs:
        div = first_divergence(a.ids, b.ids)
        upto = min(len(a.ids) if div is None else div, len(a.steps), len(b.steps))
        if upto:
            kl = step_metrics([a.steps[:upto]], [b.steps[:upto]]).kl_part
            worst = max(worst, float(np.max(kl)))
    return worst


@dataclass
class PrefixResult:
    passed: bool
    failures: list[str]
    counts: dict[str, int] = field(default_factory=dict)


def judge(verdicts: Sequence[tuple[str, CaseVerdict]]) -> PrefixResult:
    """``verdicts`` as (pass label, case verdict). Pass: no FAIL, CORRUPT or INVALID in any pass."""
    counts = {v: 0 for v in VERDICTS}
    failures = []
    for label, v in verdicts:
        counts[v.verdict] += 1
        if v.verdict in BAD:
            failures.append(f"{label} {v.case}: {v.verdict} — {v.reason}")
    if not verdicts:
        failures.append("no cases were run")
    return PrefixResult(not failures, failures, counts)


# ----------------------------------------------------------------------------------------------- applicability
PREFIX_OFF_ARG = "--no-enable-prefix-caching"


@dataclass(frozen=True)
class Applicability:
    """Whether the prefix-cache gate applies to this engine: ``applies``; else ``reason`` says why not, from the
    profile. ``problem``: the engine contradicts what its profile declares (a failure, never 'not applicable')."""

    applies: bool
    reason: str
    problem: str | None = None


CacheExpectation = str   # "required" | "optional" | "off"


def expected_prefix_caching(profile: Any, flags: Sequence[str] = ()) -> tuple[CacheExpectation, str]:
    """What the profile (engine.profiles.Profile, or None for an engine given by URL alone) says about prefix
    caching, and why: ``off`` when its launch arguments -- the profile's own and those of the flags it runs with --
    include --no-enable-prefix-caching; ``optional`` when its [gate] table declares ``prefix_cache = "optional"``
    (an engine that may turn it off by itself, e.g. vLLM CPU for MLA models without AMX); ``required`` otherwise.
    The engine under test has no say."""
    if profile is None:
        return "required", "no engine profile was given, and an engine is expected to cache prefixes"
    where = f"profile {profile.name}"
    if PREFIX_OFF_ARG in profile.args:
        return "off", f"{where} launches the engine with {PREFIX_OFF_ARG}"
    off_flags = [f for f in flags if f in profile.flags and PREFIX_OFF_ARG in profile.flags[f].args]
    if off_flags:
        return "off", f"{where} runs with flag {off_flags[0]}, which launches the engine with {PREFIX_OFF_ARG}"
    if getattr(profile.gate, "prefix_cache", "required") == "optional":
        return "optional", f'{where} declares [gate] prefix_cache = "optional"'
    return "required", (f'{where} expects prefix caching on (no {PREFIX_OFF_ARG} in its launch, no [gate] '
                        'prefix_cache = "optional")')


def prefix_cache_applicability(expected: CacheExpectation, why: str, engine_reports: bool | None) -> Applicability:
    """The gate applies whenever the engine caches (or does not say: its cases prove each hit or call it INVALID),
    unless the profile turned caching off. It is not applicable only when the profile turned caching off or made
    it optional, and the engine reports it off. An engine that reports caching off while its profile requires it
    is a problem (an engine change that disables caching must not turn the gate into an xfail), and so is one
    that caches although its profile launched it with caching off."""
    if expected == "off":
        if engine_reports:
            return Applicability(False, why, f"the engine reports prefix caching on (vllm:cache_config_info "
                                             f"enable_prefix_caching), but {why}")
        return Applicability(False, why)
    if engine_reports is not False:
        return Applicability(True, why)
    if expected == "optional":
        return Applicability(False, why)
    return Applicability(False, why, f"the engine reports prefix caching off (vllm:cache_config_info "
                                     f"enable_prefix_caching=False), but {why}; if this engine may run without it, "
                                     'declare [gate] prefix_cache = "optional" in the profile')

"""Speculative decoding (gates.md §8): losslessness (L1 greedy exactness), acceptance from the engine's
counters, and draft health (NaN or empty drafts, a drafter that never drafts).

Counters (vLLM ``/metrics``, server-global; deltas are taken around each domain's run on an idle
server): D = ``vllm:spec_decode_num_drafts_total``, P = ``…num_draft_tokens_total``,
A = ``…num_accepted_tokens_total``, A_j = ``…num_accepted_tokens_per_pos_total{position=j}``.
α = A / P (acceptance rate), τ = 1 + A / D (mean acceptance length, bonus token included), α_j = A_j / D.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gates.lib.common import NEAR_TIE_DELTA, StepLike, first_divergence, margin, non_finite

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class Counters:
    drafts: float
    draft_tokens: float
    accepted: float
    per_pos: tuple[float, ...] = ()

    def __sub__(self, other: "Counters") -> "Counters":
        n = max(len(self.per_pos), len(other.per_pos))
        a = list(self.per_pos) + [0.0] * (n - len(self.per_pos))
        b = list(other.per_pos) + [0.0] * (n - len(other.per_pos))
        return Counters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                        self.accepted - other.accepted, tuple(x - y for x, y in zip(a, b)))


def counters_from_samples(samples: Sequence[tuple[str, Mapping[str, str], float]]) -> Counters | None:
    """Counters from parsed Prometheus samples (name, labels, value); None when the engine exports none."""
    tot: dict[str, float] = {}
    pos: dict[int, float] = {}
    for name, labels, value in samples:
        if name == PER_POS:
            j = int(labels.get("position", "0"))
            pos[j] = pos.get(j, 0.0) + value
        elif name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
            tot[name] = tot.get(name, 0.0) + value
    if DRAFTS not in tot:
        return None
    per = tuple(pos.get(j, 0.0) for j in range(max(pos) + 1)) if pos else ()
    return Counters(tot[DRAFTS], tot.get(DRAFT_TOKENS, 0.0), tot.get(ACCEPTED, 0.0), per)


@dataclass(frozen=True)
class Acceptance:
    domain: str
    counters: Counters
    n_spec: int

    @property
    def alpha(self) -> float | None:
        return self.counters.accepted / self.counters.draft_tokens if self.counters.draft_tokens else None

    @property
    def tau(self) -> float | None:
        return 1 + self.counters.accepted / self.counters.drafts if self.counters.drafts else None

    @property
    def alpha_j(self) -> tuple[float, ...]:
        d = self.counters.drafts
        return tuple(a / d for a in self.counters.per_pos) if d else ()

    def problems(self) -> list[str]:
        c = self.counters
        out = []
        if any(math.isnan(x) for x in (c.drafts, c.draft_tokens, c.accepted, *c.per_pos)):
            out.append("a counter is NaN")
        if c.drafts > 0 and c.draft_tokens <= 0:
            out.append(f"{c.drafts:g} drafts carried no draft token (empty drafts)")
        if c.draft_tokens > self.n_spec * c.drafts + 1e-9:
            out.append(f"{c.draft_tokens:g} draft tokens in {c.drafts:g} drafts exceeds N={self.n_spec} per draft")
        if c.accepted > c.draft_tokens + 1e-9:
            out.append(f"accepted {c.accepted:g} > proposed {c.draft_tokens:g}")
        if c.per_pos and abs(sum(c.per_pos) - c.accepted) > 1e-6:
            out.append(f"per-position accepted sum {sum(c.per_pos):g} != accepted {c.accepted:g}")
        if c.per_pos and any(b > a + 1e-9 for a, b in zip(c.per_pos, c.per_pos[1:])):
            out.append("per-position acceptance rises with position (a later draft token accepted without an earlier)")
        return out

    def as_row(self) -> dict[str, Any]:
        c = self.counters
        return {"domain": self.domain, "drafts": c.drafts, "draft_tokens": c.draft_tokens, "accepted": c.accepted,
                "alpha": self.alpha, "tau": self.tau, "alpha_j": [round(x, 4) for x in self.alpha_j]}


def ids_sha(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Lossless:
    prompt: str
    domain: str
    equal: bool
    first_divergence: int | None
    plain_margin: float | None
    sha_plain: str
    sha_spec: str
    non_finite: bool

    def as_row(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "domain": self.domain, "identical": self.equal,
                "first_divergence": self.first_divergence, "plain_margin_at_divergence": self.plain_margin,
                "sha_plain": self.sha_plain, "sha_spec": self.sha_spec}


def lossless(prompt: str, domain: str, plain_ids: Sequence[int], plain_steps: Sequence[StepLike],
             spec_ids: Sequence[int], spec_steps: Sequence[StepLike] = ()) -> Lossless:
    div = first_divergence(plain_ids, spec_ids)
    m = margin(plain_steps[div]) if div is not None and div < len(plain_steps) else None
    return Lossless(prompt, domain, div is None, div, m, ids_sha(plain_ids), ids_sha(spec_ids),
                    bool(non_finite(spec_steps)))


@dataclass
class SpecResult:
    passed: bool
    failures: list[str]
    lossless_rows: list[dict[str, Any]]
    acceptance_rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)


def judge(lossless_checks: Sequence[Lossless], acceptance: Sequence[Acceptance], strict: bool = True) -> SpecResult:
    failures: list[str] = []
    for c in lossless_checks:
        if c.non_finite:
            failures.append(f"{c.prompt}: NaN/+inf logprob in drafted output")
        if not c.equal:
            tie = c.plain_margin is not None and c.plain_margin < NEAR_TIE_DELTA
            if strict or not tie:
                failures.append(f"{c.prompt}: drafted output differs from plain greedy at token {c.first_divergence}"
                                f" (plain margin {c.plain_margin if c.plain_margin is None else round(c.plain_margin, 4)})")
    for a in acceptance:
        failures += [f"{a.domain}: {p}" for p in a.problems()]
    total_drafts = sum(a.counters.drafts for a in acceptance)
    if acceptance and total_drafts <= 0:
        failures.append("the drafter never drafted (0 drafts over every domain): speculation was not exercised")
    if not lossless_checks:
        failures.append("no losslessness checks were run")
    summary = {"identical": f"{sum(c.equal for c in lossless_checks)}/{len(lossless_checks)}",
               "drafts": total_drafts,
               "alpha_overall": (sum(a.counters.accepted for a in acceptance)
                                 / max(1e-12, sum(a.counters.draft_tokens for a in acceptance))) if acceptance else None,
               "tau_overall": (1 + sum(a.counters.accepted for a in acceptance) / total_drafts) if total_drafts else None}
    return SpecResult(not failures, failures, [c.as_row() for c in lossless_checks],
                      [a.as_row() for a in acceptance], summary)

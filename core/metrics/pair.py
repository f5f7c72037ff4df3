"""A (reference, engine) pair scored once, and the evidence a panel report shows (gates.md §2, §3).

`score_pair` computes every metric of one engine record against its reference, bootstrap intervals and the
per-domain worst prompt included, into a `PairMetrics`. The KL panel verdict (`core.verdicts.judge`) reads
it, the gate result carries it, and the report renders it: nothing downstream scores the same pair again.
`panel_evidence` gathers the pairs of one report (one reference, its sequences shared by every engine) and
adds what only exists across pairs: each engine after the first compared with the first, prompt by prompt.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import UserError
from core.metrics.definition import PositionMetrics
from core.metrics.paired import paired_comparison, per_prompt_means
from core.metrics.panel import PanelMetrics, panel_metrics
from core.records import Record

PAIRED_METRICS = ("kl_part", "nll_eng")


class EvidenceError(UserError, ValueError):
    """These records cannot make one panel's evidence; the message says which record and why."""


@dataclass(frozen=True)
class PairMetrics:
    """Every metric of one engine record against its reference, computed once.

    `reference` is the reference restricted to the sequences the engine scored (a text-only engine's record
    leaves image sequences out). `n_boot` and `seed` are the bootstrap's, so a reader can tell two pairs'
    intervals were drawn alike. `worst_prompt`: per domain, the prompt with the highest mean KL_part."""

    label: str
    reference: Record
    engine: Record
    panel: PanelMetrics
    n_boot: int
    seed: int
    macro_kl_r20: float
    worst_prompt: dict[str, dict]

    def scores(self, reference: Record, engine: Record) -> bool:
        """Whether this pair is `engine` (the same record object) against exactly `reference`'s sequences of
        the same reference; a pair restricted to fewer sequences is another pair and is scored anew."""
        return (self.engine is engine and self.reference.seq_ids == reference.seq_ids
                and self.reference.provenance == reference.provenance)


def _worst_prompts(reference: Record, pm: PositionMetrics) -> dict[str, dict]:
    keep = np.isfinite(pm.kl_part) & ~pm.ambiguous
    means = per_prompt_means(pm.kl_part[keep], pm.seq[keep], reference.n_sequences)
    seq_domains = np.asarray(reference.domains, dtype=object)
    out = {}
    for d in dict.fromkeys(reference.domains):
        idx = np.flatnonzero((seq_domains == d) & ~np.isnan(means))
        if idx.size:
            worst = int(idx[np.argmax(means[idx])])
            out[d] = {"seq_id": reference.seq_ids[worst], "kl_part_mean": float(means[worst])}
    return out


def score_pair(reference: Record, label: str, engine: Record, n_boot: int = 2000, seed: int = 0) -> PairMetrics:
    """Score `engine` against `reference` (restricted to the engine's sequences when it scored fewer).
    A record that is not self-consistent raises RecordError naming it ("reference record", "engine record
    'label'"), as does a reference with no scored position."""
    reference._check_consistent("reference record")
    if reference.n_positions == 0:
        raise EvidenceError("reference record scores no position (every sequence has a single token or none is "
                            "scored): there is nothing to compare")
    engine._check_consistent(f"engine record {label!r}")
    if set(engine.seq_ids) != set(reference.seq_ids):
        reference = reference.subset(engine.seq_ids)  # a text-only engine's record names what it left out
    try:
        panel = panel_metrics(reference, engine, n_boot=n_boot, seed=seed)
    except ValueError as exc:  # RecordError / RecordMismatch: say which record
        raise type(exc)(f"engine record {label!r}: {exc}") from exc
    r20 = [g.kl_r20.mean for g in panel.domains.values() if g.kl_r20.n_positions]
    return PairMetrics(label=label, reference=reference, engine=engine, panel=panel, n_boot=n_boot, seed=seed,
                       macro_kl_r20=float(np.mean(r20)) if r20 else float("nan"),
                       worst_prompt=_worst_prompts(reference, panel.positions))


def _subset(pm: PositionMetrics, mask: np.ndarray) -> PositionMetrics:
    return PositionMetrics(**{f.name: getattr(pm, f.name)[mask] for f in dataclasses.fields(pm)})


def compare_pairs(pairs: Sequence[PairMetrics]) -> dict | None:
    """Each pair after the first against the first: paired per-prompt comparisons of PAIRED_METRICS, overall
    and per domain (gates.md §2.6); None for a single pair. The pairs share one reference's sequences."""
    if len(pairs) < 2:
        return None
    base = pairs[0]
    n_boot, seed = base.n_boot, base.seed
    domains = list(dict.fromkeys(base.reference.domains))
    candidates = []
    for cand in pairs[1:]:
        a, b = base.panel.positions, cand.panel.positions
        overall = {m: paired_comparison(a, b, m, n_boot, seed).as_dict() for m in PAIRED_METRICS}
        per_domain = {}
        for d in domains:
            mask = a.domain == d
            sa, sb = _subset(a, mask), _subset(b, mask)
            per_domain[d] = {m: paired_comparison(sa, sb, m, n_boot, seed).as_dict() for m in PAIRED_METRICS}
        closer = sum(1 for d in domains
                     if cand.panel.domains[d].kl_part.mean < base.panel.domains[d].kl_part.mean)
        ps = [(v["kl_part"]["wilcoxon_p"], d) for d, v in per_domain.items()
              if v["kl_part"]["wilcoxon_p"] is not None and math.isfinite(v["kl_part"]["wilcoxon_p"])]
        smallest = min(ps) if ps else (float("nan"), None)
        candidates.append({
            "label": cand.label,
            "overall": overall,
            "domains": per_domain,
            "closer_domains": closer,
            "n_domains": len(domains),
            "smallest_domain_p": {"p": smallest[0], "domain": smallest[1]},
        })
    return {"baseline": base.label, "metrics": list(PAIRED_METRICS), "candidates": candidates}


@dataclass(frozen=True)
class PanelEvidence:
    """What one panel report shows, every number already computed: the reference, each engine's pair, the
    comparison of the engines after the first with the first, and the oracle's other-precision run scored
    like an engine (the noise floor, or None)."""

    reference: Record
    pairs: tuple[PairMetrics, ...]
    comparison: dict | None
    noise_floor: PairMetrics | None
    n_boot: int
    seed: int


def _check_noise_floor(reference: Record, floor: PairMetrics) -> None:
    ref_p, nf_p = reference.provenance, floor.engine.provenance
    if nf_p.side != "oracle":
        raise EvidenceError(f"noise floor {floor.label!r}: is an {nf_p.side!r} record; the noise floor is the "
                            "oracle run in its other precision mode (e.g. ds41gate oracle run --precision "
                            "reference-bf16)")
    if nf_p.precision == ref_p.precision:
        raise EvidenceError(f"noise floor {floor.label!r}: has the reference's own precision {nf_p.precision!r}; "
                            "it must be the oracle's other precision mode")


def panel_evidence(pairs: Sequence[PairMetrics], noise_floor: PairMetrics | None = None) -> PanelEvidence:
    """One report's evidence from pairs scored already: at least one pair, unique labels, one reference (the
    same sequences, bootstrap settings) under every pair; the cross-engine comparison is computed here."""
    if not pairs:
        raise EvidenceError("a report needs at least one engine record")
    labels = [p.label for p in pairs]
    dupes = sorted({lb for lb in labels if labels.count(lb) > 1})
    if dupes:
        raise EvidenceError(f"engine record labels must be unique; repeated: {dupes}")
    reference = pairs[0].reference
    for p in (*pairs, *([noise_floor] if noise_floor is not None else [])):
        if p.reference.seq_ids != reference.seq_ids or p.reference.provenance != reference.provenance:
            raise EvidenceError(f"engine record {p.label!r} was scored against other reference sequences than "
                                f"{pairs[0].label!r}; restrict every record to the sequences all of them scored")
        if (p.n_boot, p.seed) != (pairs[0].n_boot, pairs[0].seed):
            raise EvidenceError(f"engine record {p.label!r}: bootstrap n_boot={p.n_boot}, seed={p.seed}, not "
                                f"{pairs[0].label!r}'s n_boot={pairs[0].n_boot}, seed={pairs[0].seed}")
    if noise_floor is not None:
        _check_noise_floor(reference, noise_floor)
    return PanelEvidence(reference=reference, pairs=tuple(pairs), comparison=compare_pairs(pairs),
                         noise_floor=noise_floor, n_boot=pairs[0].n_boot, seed=pairs[0].seed)


def score_panel(reference: Record, engines: Sequence[tuple[str, Record]], noise_floor: tuple[str, Record] | None = None,
                n_boot: int = 2000, seed: int = 0) -> PanelEvidence:
    """Score every (label, engine record) and the optional (label, noise-floor record) against `reference`:
    the evidence of a report made from records that no gate has scored yet (`ds41gate report`)."""
    if not engines:
        raise EvidenceError("a report needs at least one engine record")
    labels = [label for label, _ in engines]
    dupes = sorted({lb for lb in labels if labels.count(lb) > 1})
    if dupes:  # before minutes of scoring
        raise EvidenceError(f"engine record labels must be unique; repeated: {dupes}")
    pairs = [score_pair(reference, label, rec, n_boot, seed) for label, rec in engines]
    floor = None if noise_floor is None else score_pair(reference, *noise_floor, n_boot, seed)
    return panel_evidence(pairs, floor)

"""Self-consistency (gates.md §4): the engine's decode-time distributions against its own one-pass
prefill of the same tokens.

Per generated position j, D is the decode step (``logprobs=k`` while generating) and F the prefill
step (``prompt_logprobs=k`` over prompt + generated ids): KL_part(F ‖ D) with
S = (top-k_D ∩ top-k_F) ∪ {a} plus the rest bucket, |Δℓ| and top-1 agreement.

**Band** (the gate measures its own noise): every prompt is decoded twice and prefilled twice.
The run-to-run spread is the larger of mean KL_part(F₁ ‖ F₂) and mean KL_part(D₁ ‖ D₂) (the latter
over the two decodes' common prefix), for region means and per-prompt means alike. Then

    band_mean  = max(c · spread_mean,  floor_mean)
    band_worst = max(c · spread_worst, floor_worst)

with c = ``spread_factor`` (3, as c in gates.md §2.7) and small absolute floors, because an engine
that is bit-reproducible run to run (fp32 vLLM CPU is) has spread 0 and would otherwise get a band of 0.

**Pass:** every gated region (≥ ``min_positions`` positions) has mean KL_part ≤ band_mean and top-1
agreement on decided positions ≥ ``top1_decided_min``; the worst per-prompt mean ≤ band_worst; no
infinite KL_part (the decode gave probability 0 to a token prefill found likely) or non-finite logprob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gates.lib.common import StepLike, StepMetrics, first_divergence, non_finite, step_metrics

BINS: tuple[tuple[str, int, float], ...] = (
    ("<2K", 0, 2048), ("2K-8K", 2048, 8192), ("8K-32K", 8192, 32768), ("32K-64K", 32768, 65536),
    ("64K-128K", 65536, 131072), (">=128K", 131072, math.inf),
)


@dataclass(frozen=True)
class PromptRuns:
    """One prompt: two decodes and two prefill re-scorings of decode 1's ids (steps at generated positions)."""

    prompt_id: str
    domain: str
    prompt_len: int
    decode: tuple[Sequence[StepLike], Sequence[StepLike]]
    prefill: tuple[Sequence[StepLike], Sequence[StepLike]]


@dataclass(frozen=True)
class Band:
    factor: float = 3.0
    floor_mean: float = 1e-4
    floor_worst: float = 1e-3
    top1_decided_min: float = 0.99
    min_positions: int = 16


@dataclass
class SelfConsistencyResult:
    passed: bool
    failures: list[str]
    rows: list[dict[str, Any]]          # one per region
    prompts: list[dict[str, Any]]       # one per prompt
    summary: dict[str, Any] = field(default_factory=dict)


def region_masks(positions: np.ndarray, block: int | None = None, chunk: int | None = None) -> dict[str, np.ndarray]:
    """Named position regions: absolute bins, DeepSeek-V4.1 phases (mod 2, mod 8, the first 128),
    and ±2 around multiples of the engine's KV block and prefill chunk."""
    pos = np.asarray(positions, dtype=np.int64)
    out: dict[str, np.ndarray] = {"all": np.ones(pos.shape, dtype=bool)}
    for name, lo, hi in BINS:
        m = (pos >= lo) & (pos < hi)
        if m.any():
            out[f"bin {name}"] = m
    for r in range(2):
        out[f"pos%2={r}"] = pos % 2 == r
    for r in range(8):
        out[f"pos%8={r}"] = pos % 8 == r
    out["pos<128"] = pos < 128
    for label, size in (("block", block), ("chunk", chunk)):
        if size:
            off = pos % size
            near = (off <= 2) | (off >= size - 2)
            out[f"{label} {size} ±2"] = near & (pos >= size - 2)
    return {k: m for k, m in out.items() if m.any()}


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if x.size else float("nan")


def judge(runs: Sequence[PromptRuns], band: Band = Band(), block: int | None = None,
          chunk: int | None = None) -> SelfConsistencyResult:
    failures: list[str] = []
    main_ref, main_test, spread_pf, spread_dc, positions, prompt_of = [], [], [], [], [], []
    prompts: list[dict[str, Any]] = []
    for i, r in enumerate(runs):
        d1, d2 = r.decode
        f1, f2 = r.prefill
        for name, steps in (("decode 1", d1), ("decode 2", d2), ("prefill 1", f1), ("prefill 2", f2)):
            bad = non_finite(steps)
            if bad:
                failures.append(f"{r.prompt_id}: {name} holds a NaN/+inf logprob at generated step {bad[0]}")
        ids1 = [s.actual_id for s in d1]
        if [s.actual_id for s in f1] != ids1 or [s.actual_id for s in f2] != ids1:
            raise ValueError(f"{r.prompt_id}: prefill steps must re-score decode 1's ids")
        div = first_divergence(ids1, [s.actual_id for s in d2])
        common = len(ids1) if div is None else div
        main_ref.append(f1)
        main_test.append(d1)
        spread_pf.append((f1, f2))
        spread_dc.append((d1[:common], d2[:common]))
        positions.append(np.arange(r.prompt_len, r.prompt_len + len(d1)))
        prompt_of.append(np.full(len(d1), i))
        prompts.append({"prompt": r.prompt_id, "domain": r.domain, "prompt_tokens": r.prompt_len,
                        "generated": len(d1), "decode_repeat_first_divergence": div})
    if not runs:
        return SelfConsistencyResult(False, ["no prompts were run"], [], [])
    if failures:  # non-finite values: no divergence can be computed, the verdict is already a failure
        return SelfConsistencyResult(False, failures, [], prompts, {"prompts": len(runs)})
    sm: StepMetrics = step_metrics(main_ref, main_test)
    sp_f = step_metrics([a for a, _ in spread_pf], [b for _, b in spread_pf])
    sp_d = step_metrics([a for a, _ in spread_dc], [b for _, b in spread_dc])
    pos = np.concatenate(positions)
    who = np.concatenate(prompt_of)
    # the decode-spread rows cover each prompt's common prefix only: map them back to positions
    dc_pos = np.concatenate([np.arange(r.prompt_len, r.prompt_len + len(a)) for r, (a, _) in zip(runs, spread_dc)])
    dc_who = np.concatenate([np.full(len(a), i) for i, (a, _) in enumerate(spread_dc)])

    kl = sm.kl_part
    if (~np.isfinite(kl)).any():
        j = int(np.flatnonzero(~np.isfinite(kl))[0])
        failures.append(f"{runs[who[j]].prompt_id}: KL_part is infinite at position {pos[j]} "
                        "(decode gave probability 0 to a token the prefill scores)")
    per_prompt = np.array([_mean(kl[who == i]) for i in range(len(runs))])
    spread_prompt = np.array([max(_mean(sp_f.kl_part[who == i]), _mean(sp_d.kl_part[dc_who == i])
                                  if (dc_who == i).any() else 0.0) for i in range(len(runs))])
    spread_worst = float(np.nanmax(spread_prompt)) if spread_prompt.size else 0.0
    band_worst = max(band.factor * spread_worst, band.floor_worst)
    worst = float(np.nanmax(per_prompt))
    worst_i = int(np.nanargmax(per_prompt))
    if not worst <= band_worst:
        failures.append(f"worst per-prompt mean KL_part {worst:.3g} ({runs[worst_i].prompt_id}) > band {band_worst:.3g}")
    for i, p in enumerate(prompts):
        p["kl_part_mean"] = float(per_prompt[i])
        p["spread_mean"] = float(spread_prompt[i])

    rows: list[dict[str, Any]] = []
    masks = region_masks(pos, block, chunk)
    dc_masks = region_masks(dc_pos, block, chunk)
    spread_all = 0.0
    for name, m in masks.items():
        n = int(m.sum())
        s_f = _mean(sp_f.kl_part[m])
        s_d = _mean(sp_d.kl_part[dc_masks[name]]) if name in dc_masks else 0.0
        spread = max(s_f, s_d if not math.isnan(s_d) else 0.0)
        if name == "all":
            spread_all = spread
        b = max(band.factor * spread, band.floor_mean)
        dec = m & sm.decided
        top1 = float(np.mean(sm.top1_agree[dec])) if dec.any() else float("nan")
        mean = _mean(kl[m])
        gated = n >= band.min_positions
        ok = True
        if gated:
            if not mean <= b:
                ok = False
                failures.append(f"region {name}: mean KL_part {mean:.3g} > band {b:.3g} ({n} positions)")
            if dec.any() and not top1 >= band.top1_decided_min:
                ok = False
                failures.append(f"region {name}: top-1 on decided positions {top1:.3f} < {band.top1_decided_min}")
        fin = kl[m][np.isfinite(kl[m])]
        dl = sm.abs_dlogprob[dec]
        rows.append({
            "region": name, "positions": n, "kl_part_mean": mean,
            "kl_part_median": float(np.median(fin)) if fin.size else None,
            "kl_part_p99": float(np.percentile(fin, 99)) if fin.size >= 100 else None,
            "kl_part_max": float(np.max(kl[m])), "top1_decided": top1,
            "max_abs_dlogprob_decided": float(np.nanmax(dl)) if dl.size else None,
            "spread_mean": spread, "band": b, "gated": gated, "pass": ok if gated else None,
        })
    summary = {
        "prompts": len(runs), "positions": int(kl.size), "kl_part_mean": _mean(kl),
        "worst_prompt_mean": worst, "worst_prompt": runs[worst_i].prompt_id, "band_worst": band_worst,
        "spread_mean": spread_all, "spread_worst": spread_worst,
        "spread_prefill_max": float(np.max(sp_f.kl_part)) if sp_f.kl_part.size else 0.0,
        "spread_decode_max": float(np.max(sp_d.kl_part)) if sp_d.kl_part.size else 0.0,
        "decode_repeats_identical": sum(p["decode_repeat_first_divergence"] is None for p in prompts),
        "top1_decided": float(np.mean(sm.top1_agree[sm.decided])) if sm.decided.any() else None,
        "band_rule": f"band = max({band.factor} x run-to-run spread, floor {band.floor_mean:g} mean / "
                     f"{band.floor_worst:g} worst)",
    }
    return SelfConsistencyResult(not failures, failures, rows, prompts, summary)

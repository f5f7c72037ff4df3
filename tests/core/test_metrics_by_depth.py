"""KL / top-1 per depth bucket and the per-bucket bands (issue 39): a fault that lives only past 2,048 tokens fails
its bucket while the whole-sequence mean and every shallow bucket stay in band."""

from __future__ import annotations

import numpy as np
import pytest

from core.bands import (
    Band,
    BandsError,
    judge_depth,
    judge_domain,
    load_depth_bands,
    parse_bands,
)
from core.metrics import group_report, position_metrics
from core.metrics.by_depth import depth_reports, depth_rows
from core.records import Record
from tests.core.recordkit import provenance, random_logprobs, sequence_from_full

LENGTH, VOCAB, K = 2400, 32, 32
BAND = {"default": Band(kl_mean=0.01, kl_p99=0.2, top1_decided=0.9, ln_ppl=0.05)}


def _pair(fault_from: int | None, noise: float = 3.0):
    """Reference and engine on one 2,400-token sequence; the engine's logits equal the reference's, except at
    positions >= fault_from where noise is added (the long-only planted fault)."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, VOCAB, size=LENGTH)
    p = random_logprobs(rng, LENGTH - 1, VOCAB)
    q = p.copy()
    if fault_from is not None:
        rows = slice(fault_from - 1, None)        # row i scores position i + 1
        logits = p[rows] + rng.normal(size=p[rows].shape) * noise
        q[rows] = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ref = Record.from_sequences(provenance("oracle"), [sequence_from_full("s0", "code", tokens, p, K)])
    eng = Record.from_sequences(provenance("engine"), [sequence_from_full("s0", "code", tokens, q, K)])
    return ref, eng


def test_buckets_partition_the_positions_and_rows_carry_the_numbers():
    ref, eng = _pair(None)
    reports = depth_reports(ref, position_metrics(ref, eng), n_boot=200)
    assert list(reports) == ["d0-128", "d128-2K", "d2K-8K", "last256"]
    assert [reports[b].n_positions for b in reports] == [127, 1920, 352, 256]     # positions 1..2399
    rows = depth_rows(reports)
    assert rows[0]["bucket"] == "d0-128" and rows[0]["kl_part_mean"] == pytest.approx(0, abs=1e-12)
    assert all(r["top1_decided"] == 1.0 for r in rows)
    assert judge_depth(reports, BAND, "p").passed


def test_a_fault_past_2048_fails_only_its_buckets_and_hides_in_the_whole_mean():
    ref, eng = _pair(2048, noise=0.35)
    pm = position_metrics(ref, eng)
    reports = depth_reports(ref, pm, n_boot=200)
    verdict = judge_depth(reports, BAND, "p")
    by = {d.domain: d for d in verdict.domains}
    assert not verdict.passed
    assert by["d0-128"].passed and by["d128-2K"].passed
    assert not by["d2K-8K"].passed and not by["last256"].passed
    assert reports["d128-2K"].kl_part.mean == pytest.approx(0, abs=1e-12)
    # the same positions judged as one group: the whole-sequence mean is diluted ~7x by the clean positions
    whole = group_report(pm, np.ones(len(pm.kl_part), bool), "all", n_boot=200)
    assert whole.kl_part.mean < reports["d2K-8K"].kl_part.mean / 5
    assert whole.kl_part.mean == pytest.approx(reports["d2K-8K"].kl_part.mean * 352 / 2399, rel=1e-9)
    assert judge_domain(whole, Band(kl_mean=0.02, kl_p99=5, top1_decided=0.5, ln_ppl=1)).passed
    assert not judge_domain(reports["d2K-8K"], Band(kl_mean=0.02, kl_p99=5, top1_decided=0.5, ln_ppl=1)).passed


def test_depth_bands_are_checked_like_domain_bands(tmp_path):
    band = {"kl_mean": 0.1, "kl_p99": 1.0, "top1_decided": 0.5, "ln_ppl": 0.4}
    good = {"profiles": {"p": {"default": band}}, "depth": {"p": {"default": band, "d2K-8K": {**band, "kl_mean": 0.2}}}}
    parse_bands(good, tmp_path / "b.toml")
    with pytest.raises(BandsError, match=r"depth.p.d3K: unknown depth bucket"):
        parse_bands({"depth": {"p": {"default": band, "d3K": band}}}, tmp_path / "b.toml")
    with pytest.raises(BandsError, match=r"depth.p has no 'default' band"):
        parse_bands({"depth": {"p": {"last256": band}}}, tmp_path / "b.toml")
    with pytest.raises(BandsError, match="no per-depth-bucket bands for profile 'nobody'"):
        load_depth_bands("nobody", "gates/bands.toml")
    assert load_depth_bands("vllm-cpu-dsv4", "gates/bands.toml")["default"].kl_mean == 0.09
    assert not judge_depth({}, BAND, "p").passed

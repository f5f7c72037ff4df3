"""A pair scored once (score_pair) and one report's evidence (panel_evidence): what they hold and refuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core import metrics
from core.metrics import EvidenceError, panel_evidence, score_pair, score_panel
from tests.core.recordkit import pair_of_records

N_BOOT = 200


def _records(noise=0.3, seed=0):
    return pair_of_records(np.random.default_rng(seed), n_seq=8, length=12, domains=("code", "chat"), noise=noise)


def test_a_pair_holds_the_panel_metrics_and_the_worst_prompt_per_domain():
    ref, eng, _ = _records()
    pair = score_pair(ref, "e", eng, n_boot=N_BOOT, seed=3)
    assert pair.panel.as_dict() == metrics.panel_metrics(ref, eng, n_boot=N_BOOT, seed=3).as_dict()
    pm = pair.panel.positions
    for d, worst in pair.worst_prompt.items():
        means = {sid: pm.kl_part[(pm.seq == i) & np.isfinite(pm.kl_part)].mean()
                 for i, sid in enumerate(ref.seq_ids) if ref.domains[i] == d}
        assert worst["seq_id"] == max(means, key=means.get)
        assert worst["kl_part_mean"] == pytest.approx(means[worst["seq_id"]])
    assert pair.macro_kl_r20 == pytest.approx(np.mean([g.kl_r20.mean for g in pair.panel.domains.values()]))


def test_an_engine_that_scored_fewer_sequences_is_paired_with_that_part_of_the_reference():
    ref, eng, _ = _records()
    short = eng.subset(eng.seq_ids[2:])
    pair = score_pair(ref, "short", short, n_boot=N_BOOT)
    assert pair.reference.seq_ids == short.seq_ids
    assert pair.scores(ref.subset(short.seq_ids), short) and not pair.scores(ref, short)
    assert not pair.scores(pair.reference, eng.subset(eng.seq_ids[2:]))   # another record object: not this pair


def test_evidence_refuses_pairs_of_other_sequences_or_bootstraps_and_compares_the_rest():
    ref, eng_a, _ = _records(noise=0.3)
    _, eng_b, _ = _records(noise=0.5)
    a, b = score_pair(ref, "a", eng_a, N_BOOT), score_pair(ref, "b", eng_b, N_BOOT)
    with pytest.raises(EvidenceError, match="other reference sequences"):
        panel_evidence([a, score_pair(ref, "short", eng_b.subset(eng_b.seq_ids[1:]), N_BOOT)])
    with pytest.raises(EvidenceError, match="n_boot=100"):
        panel_evidence([a, score_pair(ref, "b", eng_b, 100)])
    with pytest.raises(EvidenceError, match="unique"):
        panel_evidence([a, dataclasses.replace(b, label="a")])
    ev = panel_evidence([a, b])
    cand = ev.comparison["candidates"][0]
    direct = metrics.paired_comparison(a.panel.positions, b.panel.positions, "kl_part", N_BOOT, 0)
    assert ev.comparison["baseline"] == "a" and cand["label"] == "b"
    assert cand["overall"]["kl_part"] == direct.as_dict() and direct.mean_diff > 0   # noisier engine: larger KL


def test_the_noise_floor_must_be_the_oracle_in_its_other_precision():
    ref, eng, _ = _records()
    with pytest.raises(EvidenceError, match="is an 'engine' record"):
        score_panel(ref, [("e", eng)], ("floor", eng), n_boot=N_BOOT)
    with pytest.raises(EvidenceError, match="own precision 'fp32'"):
        score_panel(ref, [("e", eng)], ("floor", ref), n_boot=N_BOOT)
    floor = dataclasses.replace(eng, provenance=dataclasses.replace(eng.provenance, side="oracle",
                                                                    precision="reference-bf16"))
    assert score_panel(ref, [("e", eng)], ("floor", floor), n_boot=N_BOOT).noise_floor.label == "floor"

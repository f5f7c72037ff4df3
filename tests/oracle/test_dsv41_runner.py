"""The layer-streamed DeepSeek-V4.1 panel runner (oracle/dsv41/runner.py) on generated tiny checkpoints:
bit-identical to the in-memory Model.forward, resumable after SIGKILL at any point, shardable, bounded memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.records import Record
from oracle.dsv41.checkpoint import Checkpoint
from oracle.dsv41.runner import KILL_ENV, MANIFEST, RunnerError, RunOptions, forward_in_memory, run_panel, run_to_file
from oracle.dsv41.panel_shards import MergeError, merge_records, select_shard
from oracle.dsv41.spill import SpillError, StageReader, StageWriter
from oracle.dsv41.tiny import write_tiny_checkpoint
from panels import PanelError, encoded_from_json

ROOT = Path(__file__).resolve().parents[2]
ARRAYS = ("seq_offsets", "token_ids", "scored", "pos_seq", "pos_index", "topk_ids", "topk_logprobs",
          "actual_logprob", "actual_rank", "logsumexp", "full_logprobs")
LENGTHS = (40, 17, 70, 9, 33)  # 70 > window 64 (ring order), odd lengths (ratio-2 carry), one 9-token sequence


def assert_same_record(a: Record, b: Record) -> None:
    assert a.seq_ids == b.seq_ids and a.domains == b.domains and a.k == b.k
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(x, y), f"{name} differs (max |diff| {np.abs(x - y).max()})"


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=0)


@pytest.fixture(scope="module")
def panel_json(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    seqs = [{"seq_id": f"q{i}", "domain": "code" if i % 2 else "chat",
             "token_ids": torch.randint(0, 512, (n,), generator=g).tolist()} for i, n in enumerate(LENGTHS)]
    seqs[1]["scored_mask"] = [False] * 5 + [True] * 12  # a partial mask
    p = tmp_path_factory.mktemp("panel") / "panel.json"
    p.write_text(json.dumps({"panel_name": "runner-test", "panel_version": "1", "sequences": seqs}))
    return p


def _opts(**kw) -> RunOptions:
    return RunOptions(**{"threads": 1, "progress": False, "full_logprobs": True, **kw})


@pytest.fixture(scope="module")
def in_memory(tiny, panel_json):
    """The independent reference: every sequence through Model.forward with all weights loaded."""
    return {p: forward_in_memory(Checkpoint(tiny), encoded_from_json(panel_json), p, full_logprobs=True, threads=1)
            for p in ("fp32", "reference-bf16")}


def as_record(rec: Record, in_memory, precision="fp32") -> Record:
    """The in-memory scores as a record (provenance borrowed from `rec`: only the arrays are compared)."""
    return Record.from_sequences(rec.provenance, in_memory[precision][0], k=256)


@pytest.fixture(scope="module")
def uninterrupted(tiny, panel_json, tmp_path_factory) -> Record:
    return run_panel(Checkpoint(tiny), encoded_from_json(panel_json), tmp_path_factory.mktemp("w") / "work", _opts())


@pytest.mark.parametrize("precision,spill", [("fp32", "ram"), ("reference-bf16", "disk")])
def test_streamed_run_is_bit_identical_to_the_in_memory_forward(tiny, panel_json, in_memory, tmp_path, precision, spill):
    rec = run_panel(Checkpoint(tiny), encoded_from_json(panel_json), tmp_path / "work", _opts(precision=precision, spill=spill))
    ties = in_memory[precision][1]
    assert_same_record(rec, as_record(rec, in_memory, precision))
    assert rec.provenance.extra["ties"]["counts"] == dict(sorted(ties.counts.items()))
    run = rec.provenance.extra["run"]
    assert run["spill"] == (spill == "disk") and run["resumed_from_stage"] == 0
    assert rec.provenance.precision == precision and rec.provenance.side == "oracle"


def test_the_oracle_seam_rescores_the_panel_a_record_was_made_from(tiny, uninterrupted, tmp_path):
    """oracle.seam.Oracle: DSV41Oracle.score on the panel recovered from a record (panels.encoded_from_record)
    reproduces the record's arrays and panel identity."""
    from oracle import Oracle
    from oracle.dsv41.runner import DSV41Oracle
    from panels import encoded_from_record

    seam = DSV41Oracle(Checkpoint(tiny), tmp_path / "w", _opts())
    assert isinstance(seam, Oracle)
    rec = seam.score(encoded_from_record(uninterrupted))
    assert_same_record(rec, uninterrupted)
    for k in ("side", "panel_name", "panel_version", "panel_hash", "tokenizer_hash", "source", "precision"):
        assert getattr(rec.provenance, k) == getattr(uninterrupted.provenance, k), k


def test_precision_modes_differ(in_memory):
    """Guards the test above against comparing a mode with itself."""
    a, b = in_memory["fp32"][0], in_memory["reference-bf16"][0]
    assert not np.array_equal(a[0].logsumexp, b[0].logsumexp)


def test_provenance_identifies_checkpoint_panel_and_weights(tiny, uninterrupted):
    rec = uninterrupted
    fresh = Checkpoint(tiny)
    src = rec.provenance.source
    assert src["checkpoint_hash"] == fresh.provenance_hash()  # the build's identity, before any read
    assert rec.vocab_size() == json.loads((tiny / "config.json").read_text())["vocab_size"]
    n_tensors = len(fresh.tensor_names())
    assert src["tensors_read"] > 0 and src["weights_read_sha256"]
    assert rec.provenance.panel_hash.startswith("sha256:") and rec.provenance.tokenizer_hash == "pre-encoded"
    assert rec.provenance.extra["seq_indices"] == list(range(len(LENGTHS)))
    # every backbone tensor was read: all but the DSpark (mtp.*) tensors
    assert src["tensors_read"] == len([n for n in fresh.tensor_names() if not n.startswith("mtp.")]) < n_tensors


# ---------------------------------------------------------------------------------------------------------
# resume


def _cli_run(tiny, panel, out, work, kill=None, spill="ram", extra=()):
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    if kill:
        env[KILL_ENV] = kill
    # oracle.cli directly: `ds41gate oracle` is the same app, but importing every sub-app costs seconds per run
    cmd = [sys.executable, "-m", "oracle.cli", "run", "--checkpoint", str(tiny), "--panel", str(panel),
           "--out", str(out), "--work", str(work), "--threads", "1", "--spill", spill, "--full-logprobs",
           "--no-progress", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _manifest(work: Path) -> dict:
    return json.loads((work / MANIFEST).read_text())


def test_resume_after_sigkill_at_every_kind_of_point(tiny, panel_json, in_memory, uninterrupted, tmp_path):
    """Stage s = 0 is the embedding, s = L + 1 layer L (8 layers). Each run is SIGKILLed at one point, the next
    run continues the same work dir; the last one finishes. The result equals the uninterrupted run. (Other
    points, e.g. 'acts-written' between fsync and rename, recover the same way; six processes keep this
    test under a minute on two cores.)"""
    out, work = tmp_path / "ref.safetensors", tmp_path / "work"
    chain = [  # (kill point, spill mode, stages the manifest must then say are done)
        ("seq@0", "disk", None),  # inside the very first stage: no manifest yet
        ("acts-half@4", "ram", 4),  # RAM stage killed half-way through writing its file (stages 0-3 done)
        ("acts-replaced@5", "disk", 5),  # new activation file in place, manifest still names the old one
        ("manifest-written@7", "disk", 7),  # new manifest written to its temp name, not renamed
        ("committed@8", "ram", 9),  # last layer committed; killed before the head
    ]
    for point, spill, done in chain:
        r = _cli_run(tiny, panel_json, out, work, kill=point, spill=spill)
        assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr[-2000:])
        assert not out.exists()
        if done is None:
            assert not (work / MANIFEST).exists()
        else:
            m = _manifest(work)
            assert m["stages_done"] == done, point
            assert (work / m["acts"]).is_file()
    r = _cli_run(tiny, panel_json, out, work)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = Record.load(out)
    assert rec.provenance.extra["run"]["resumed_from_stage"] == 9
    assert_same_record(rec, as_record(rec, in_memory))
    assert_same_record(rec, uninterrupted)
    assert rec.provenance.source == uninterrupted.provenance.source  # weights digests carried over resumes
    assert rec.provenance.extra["ties"] == uninterrupted.provenance.extra["ties"]
    assert not work.exists()  # cleaned up after success


def test_corrupt_activations_and_foreign_work_dirs_are_refused(tiny, panel_json, tmp_path):
    work = tmp_path / "work"
    r = _cli_run(tiny, panel_json, tmp_path / "o.safetensors", work, kill="committed@2", spill="disk")
    assert r.returncode == -signal.SIGKILL
    acts = work / _manifest(work)["acts"]
    data = bytearray(acts.read_bytes())
    data[len(data) // 2] ^= 1
    acts.write_bytes(bytes(data))
    with pytest.raises(SpillError, match="SHA-256"):
        run_panel(Checkpoint(tiny), encoded_from_json(panel_json), work, _opts())
    with pytest.raises(RunnerError, match=r"belongs to another run .*precision"):
        run_panel(Checkpoint(tiny), encoded_from_json(panel_json), work, _opts(precision="reference-bf16"))
    rec = run_panel(Checkpoint(tiny), encoded_from_json(panel_json), work, _opts(restart=True))
    assert rec.provenance.extra["run"]["resumed_from_stage"] == 0


def test_stage_writer_commit_is_atomic_and_readers_hand_over(tmp_path):
    for spill in (False, True):
        path = tmp_path / f"s{int(spill)}.bin"
        w = StageWriter(path, spill)
        states = [({"h": np.arange(12, dtype=np.float32).reshape(3, 4) * i, "m": np.array([True, False])}, {"i": i})
                  for i in range(3)]
        for a, m in states:
            w.put(a, m)
        assert not path.exists()  # nothing under the final name before commit
        sha = w.commit()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(path.name)) == [path.name]
        for r in (w.reader(), StageReader.open_verified(path, w.table, sha)):
            for i, (a, m) in enumerate(states):
                got, meta = r.get(i)
                assert meta == m and all(np.array_equal(got[k], a[k]) and got[k].dtype == a[k].dtype for k in a)
    with pytest.raises(SpillError, match="does not exist"):
        StageReader.open_verified(tmp_path / "nope.bin", [], "0")


# ---------------------------------------------------------------------------------------------------------
# shards


def test_shards_merge_to_the_unsharded_record(tiny, panel_json, in_memory, uninterrupted, tmp_path):
    paths = []
    for i in range(3):
        pin, picked = select_shard(encoded_from_json(panel_json), i, 3)
        assert picked == list(range(i, len(LENGTHS), 3))
        rec = run_to_file(Checkpoint(tiny), pin, tmp_path / f"s{i}.safetensors",
                          opts=_opts(shard=(i, 3), seq_indices=tuple(picked), panel_sequences=len(LENGTHS)))
        assert rec.seq_ids == [f"q{j}" for j in picked]
        paths.append(tmp_path / f"s{i}.safetensors")
    merged = merge_records(paths[::-1])  # any order
    ref = uninterrupted
    assert_same_record(merged, ref)
    assert_same_record(merged, as_record(ref, in_memory))
    assert merged.provenance.extra["ties"]["counts"] == ref.provenance.extra["ties"]["counts"]
    for k in ("panel_hash", "tokenizer_hash", "source", "precision"):
        assert getattr(merged.provenance, k) == getattr(ref.provenance, k)
    with pytest.raises(MergeError, match=r"shards \[1\] of 3 are missing"):
        merge_records([paths[0], paths[2]])
    with pytest.raises(MergeError, match="given twice"):
        merge_records([paths[0], paths[0], paths[1], paths[2]])
    ref.save(tmp_path / "full.safetensors")
    with pytest.raises(MergeError, match="not a shard record"):
        merge_records([tmp_path / "full.safetensors"])


def test_bad_inputs_fail_clearly(tiny, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[1, 2, 3], [4, 999]]))
    with pytest.raises(RunnerError, match=r"token id 999 is outside the checkpoint's vocabulary 0..511"):
        run_panel(Checkpoint(tiny), encoded_from_json(bad), tmp_path / "w", _opts())
    bad.write_text(json.dumps({"sequences": [{"token_ids": [1, 2], "scored_mask": [True, True]}]}))
    with pytest.raises(PanelError, match="position 0"):
        encoded_from_json(bad)
    bad.write_text("{")
    with pytest.raises(PanelError, match="not a readable JSON panel"):
        encoded_from_json(bad)
    with pytest.raises(RunnerError, match="shard 3/2"):
        select_shard(encoded_from_json(_write(tmp_path / "ok.json", [[1, 2]])), 3, 2)
    with pytest.raises(RunnerError, match="precision"):
        RunOptions(precision="bf16")


def _write(p: Path, obj) -> Path:
    p.write_text(json.dumps(obj))
    return p


# ---------------------------------------------------------------------------------------------------------
# memory


# three layers of ~210 MB fp32 each (32 MXFP4 experts of 512 x 1024), Engram on layers 1 and 2
MEM_OVERRIDES = {"dim": 1024, "moe_inter_dim": 512, "n_routed_experts": 32, "n_layers": 3,
                 "compress_ratios": [0, 0, 2, 0, 0, 0], "kv_source_layers": [2], "index_source_layers": [2],
                 "candidate_source_layer": -1, "dspark_target_layer_ids": [0, 1, 2]}

MEM_SCRIPT = r"""
import json, sys, torch
from oracle.dsv41.checkpoint import Checkpoint
from oracle.dsv41.runner import RunOptions, run_panel
from panels import encoded_from_json
rec = run_panel(Checkpoint(sys.argv[1]), encoded_from_json(sys.argv[2]), sys.argv[3],
                RunOptions(threads=1, progress=False, spill=sys.argv[4]))
print(json.dumps(rec.provenance.extra["run"]))
"""


def test_peak_memory_is_one_layer_plus_activations(tmp_path):
    """Fresh process: peak RSS growth over the pre-run baseline <= 1.5 x (largest stage's fp32 weights +
    activations), on a checkpoint whose whole fp32 size is twice that bound (loading everything would fail).
    On small models the bound has little slack: file-backed code pages of kernels first used during the run,
    the float64 copies of the matrices being multiplied, the decoders' JIT and loader transients were
    ~45 % of a 113 MB layer (16 experts; too close to the bound), ~33 % of this 210 MB one."""
    ck_dir = write_tiny_checkpoint(tmp_path / "mem", seed=1, config_overrides=MEM_OVERRIDES)
    ck = Checkpoint(ck_dir)
    total_fp32 = sum(4 * s.out * s.in_ for p, s in ck.inventory.linears.items() if not p.startswith("mtp."))
    panel = _write(tmp_path / "p.json", [list(range(1, 60)), list(range(100, 130))])
    for spill in ("disk",):
        r = subprocess.run([sys.executable, "-c", MEM_SCRIPT, str(ck_dir), str(panel), str(tmp_path / f"w{spill}"), spill],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        run = json.loads(r.stdout.strip().splitlines()[-1])
        growth = (run["peak_rss_kib"] - run["baseline_rss_kib"]) * 1024
        bound = 1.5 * (run["largest_stage_weight_bytes"] + run["activation_bytes"])
        assert growth <= bound, (spill, growth / 2**20, bound / 2**20)
        assert total_fp32 > 1.9 * bound  # the bound is meaningful: the whole model would not fit under it


def test_every_weight_is_read_once_per_panel(tiny, panel_json, tmp_path, monkeypatch):
    """Five sequences, one read of each backbone tensor (the MTP stages are never read: scoring needs no drafts)."""
    from oracle.dsv41.shard_io import ShardFolder

    reads: dict[str, int] = {}
    real = ShardFolder.read

    def counting(self, info, rows=None):
        reads[info.name] = reads.get(info.name, 0) + 1
        return real(self, info, rows)

    monkeypatch.setattr(ShardFolder, "read", counting)
    run_panel(Checkpoint(tiny), encoded_from_json(panel_json), tmp_path / "w", _opts())
    stored = {n for n in Checkpoint(tiny)._official.infos if not n.startswith("mtp.")}
    assert set(reads) == stored
    assert max(reads.values()) == 1


def test_row_read_engram_tables_give_the_same_record(tiny, panel_json, uninterrupted, tmp_path, monkeypatch):
    """Real-size Engram tables (~98 GB) are read row by row through Checkpoint.engram_rows; forced here."""
    from oracle.dsv41 import runner as R

    monkeypatch.setattr(R, "WHOLE_TABLE_BYTES", 0)
    rec = run_panel(Checkpoint(tiny), encoded_from_json(panel_json), tmp_path / "w", _opts())
    assert_same_record(rec, uninterrupted)
    assert rec.provenance.source["tensors_read"] == uninterrupted.provenance.source["tensors_read"] - 4  # 2 tables


def test_report_shows_the_precision_noise_floor_beside_engine_kl(tiny, panel_json, tmp_path):
    """§5.5: the KL between the oracle's two precision modes is the noise floor each report shows next to
    engine KL. With k covering the vocabulary KL_part is the full KL, so the floor per domain must equal
    scipy's rel_entr over the two records' full distributions."""
    from scipy.special import rel_entr

    from core.metrics import EvidenceError, score_panel
    from reports.render import build_report

    vocab = Checkpoint(tiny).model_config.vocab_size
    panel = encoded_from_json(panel_json)
    fp32 = run_panel(Checkpoint(tiny), panel, tmp_path / "w32", _opts(top_k=vocab))
    bf16 = run_panel(Checkpoint(tiny), panel, tmp_path / "w16", _opts(top_k=vocab, precision="reference-bf16"))
    paths = build_report(score_panel(fp32, [("engine-like", bf16)], ("oracle reference-bf16", bf16), n_boot=100),
                         tmp_path / "report")
    data = json.loads(paths.json.read_text())
    floor = data["noise_floor"]
    kl = rel_entr(np.exp(fp32.full_logprobs.astype(np.float64)),
                  np.exp(bf16.full_logprobs.astype(np.float64))).sum(-1)
    domains = np.asarray(fp32.domains)[fp32.pos_seq]
    assert set(floor["kl_part"]["domains"]) == {"chat", "code"}
    for d, value in floor["kl_part"]["domains"].items():
        assert value == pytest.approx(kl[domains == d].mean(), rel=1e-4, abs=1e-9)
        assert value > 0  # the two modes do differ on this model
        assert data["noise_floor"]["engine_ratio"]["engine-like"]["domains"][d] == pytest.approx(1.0)
    md = paths.markdown.read_text()
    assert "## KL_part beside the oracle noise floor" in md
    # §18.3: the tie rule's decisions are counted per run and shown beside the results
    assert data["reference"]["topk_ties"] == fp32.provenance.extra["ties"]["total"]
    assert data["engines"][0]["topk_ties"] == bf16.provenance.extra["ties"]["total"]
    assert bf16.provenance.extra["ties"]["total"] > 0  # bf16 index scores tie (this test panel: checked)
    assert "| top-k ties |" in md
    assert "noise floor (oracle reference-bf16)" in md and 'id="noise-floor"' in paths.html.read_text()

    with pytest.raises(EvidenceError, match="own precision 'fp32'"):
        score_panel(fp32, [("e", bf16)], ("same", fp32), n_boot=100)


def test_streamed_experts_give_the_same_record_holding_one_expert(tiny, panel_json, uninterrupted, tmp_path, monkeypatch):
    """--stream-experts: each routed expert decoded when the MoE reaches it, its arrays reused for the next
    one (one expert held instead of the layer's: 54 GB fp32 on the release). Same record, bit for bit; every
    used expert decoded once per MoE call; three fp32 arrays (w1, w2, w3) allocated per layer, however many
    experts it has."""
    from oracle.dsv41 import runner as R

    layers: list[R.StreamedExperts] = []
    real = R.StreamedExperts.__init__

    def keep(self, *a, **kw):
        real(self, *a, **kw)
        layers.append(self)

    monkeypatch.setattr(R.StreamedExperts, "__init__", keep)
    rec = run_panel(Checkpoint(tiny), encoded_from_json(panel_json), tmp_path / "w", _opts(stream_experts=True))
    assert_same_record(rec, uninterrupted)
    cfg = Checkpoint(tiny).model_config
    assert len(layers) == cfg.n_layers
    assert all(s.pool.allocated == 3 for s in layers), [s.pool.allocated for s in layers]
    assert all(0 < s.decoded <= cfg.n_routed_experts for s in layers)  # one MoE call per stage here
    # forcing one MoE call per sequence: each call decodes its experts again, the record does not change
    monkeypatch.setattr(R, "STREAM_GROUP_BYTES", 1)
    layers.clear()
    rec2 = run_panel(Checkpoint(tiny), encoded_from_json(panel_json), tmp_path / "w2", _opts(stream_experts=True))
    assert_same_record(rec2, uninterrupted)
    assert sum(s.decoded for s in layers) > cfg.n_layers * cfg.n_routed_experts


def test_row_read_engram_table_works_under_another_default_device(tiny):
    """Under --device cuda the runner computes inside `torch.device("cuda")`; the row reader's index
    arithmetic must stay on the CPU (it failed on the H200: searchsorted made a cuda index for a CPU table).
    CI has no GPU: the meta device stands in as the default device, the same failure mode."""
    from oracle.dsv41 import runner as R

    ck = Checkpoint(tiny)
    ids = torch.tensor([[5, 600, 5]])
    with torch.device("meta"):
        rows = R._EngramRows(ck, 1, "cpu")[ids]
    assert rows.device.type == "cpu" and torch.equal(rows, ck.load_table("layers.1.engram.embed")[ids])

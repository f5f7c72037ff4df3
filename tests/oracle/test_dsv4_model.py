"""The DeepSeek-V4 mode end to end: the tiny V4 checkpoint (oracle.dsv41.tiny_v4, official V4-Flash layout)
loads unchanged, fp32 decode equals the one-pass prefill bit for bit at every position, and the
layer-streamed runner's record equals the in-memory forward bit for bit in both precision modes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.records import Record
from oracle.dsv41.arch import V4, arch_of
from oracle.dsv41.block_v4 import BlockV4
from oracle.dsv41.checkpoint import Checkpoint, CheckpointError
from oracle.dsv41.model import Model
from oracle.dsv41.runner import RunOptions, forward_in_memory, full_weights, run_panel
from oracle.dsv41.tiny_v4 import write_tiny_v4_checkpoint
from panels import encoded_from_json

from .dsv4_random_weights import random_weights_v4, small_v4_config

ARRAYS = ("token_ids", "topk_ids", "topk_logprobs", "actual_logprob", "actual_rank", "logsumexp", "full_logprobs")


def _ids(n, seed, vocab):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill_then_decode(m: Model, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    st = m.new_state(ids.shape[0])
    out = [m.forward(ids[:, :n_prefill], st).logits]
    out += [m.forward(ids[:, p:p + 1], st).logits for p in range(n_prefill, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def small():
    cfg = small_v4_config()
    return cfg, random_weights_v4(cfg, seed=0)


@pytest.mark.parametrize("n_prefill,seed", [(1, 1), (3, 2), (13, 3), (30, 4)])
def test_decode_equals_prefill_at_every_position(small, n_prefill, seed):
    """Window 8 wrapped, ratio-4 (overlap + indexer picking 3 of up to 10) and ratio-8 groups completed both
    in the prefill and in decode, a hash layer: decode steps equal the one-pass prefill exactly."""
    cfg, w = small
    m = Model(cfg, w, None)
    ids = _ids(41, seed, cfg.vocab_size)
    full = m.forward(ids, m.new_state(1)).logits
    inc = _prefill_then_decode(m, ids, n_prefill)
    assert torch.equal(inc, full), f"first differing position {int((inc != full).any(-1)[0].nonzero()[0])}"


def test_batch_equals_sequences_run_alone(small):
    cfg, w = small
    m = Model(cfg, w, None)
    ids = torch.cat([_ids(23, 5, cfg.vocab_size), _ids(23, 6, cfg.vocab_size)])
    batch = _prefill_then_decode(m, ids, 17)
    for i in range(2):
        assert torch.equal(batch[i], _prefill_then_decode(m, ids[i:i + 1], 17)[0])


def test_every_v4_weight_moves_the_logits(small):
    """Each V4-specific tensor family is read: perturbing it changes the output (ape, indexer compressor,
    tid2eid, hc_head). (A constant added to ape would not: it cancels in the per-channel softmax.)"""
    cfg, w = small
    ids = _ids(33, 7, cfg.vocab_size)
    base = Model(cfg, w, None).forward(ids, Model(cfg, w, None).new_state(1)).logits
    g = torch.Generator().manual_seed(11)
    for name in ("layers.0.attn.compressor.ape", "layers.0.attn.indexer.compressor.wkv.weight",
                 "layers.1.attn.compressor.ape", "hc_head_base"):
        w2 = dict(w)
        w2[name] = w[name] + 0.5 * torch.randn(w[name].shape, generator=g)
        m = Model(cfg, w2, None)
        assert not torch.equal(m.forward(ids, m.new_state(1)).logits, base), name
    w2 = dict(w)
    w2["layers.0.ffn.gate.tid2eid"] = (w["layers.0.ffn.gate.tid2eid"] + 1) % cfg.n_routed_experts
    m = Model(cfg, w2, None)
    assert not torch.equal(m.forward(ids, m.new_state(1)).logits, base)


# ---- the tiny V4 checkpoint (official layout) through the loader and the layer-streamed runner -----------

LENGTHS = (140, 9)  # 140 > window 16 and > 128 (one ratio-128 entry), 9 (one ratio-4 entry and a remainder)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory) -> Path:
    return write_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4") / "ck", seed=1,
                                    overrides={"vocab_size": 512, "sliding_window": 16})


@pytest.fixture(scope="module")
def panel_json(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    seqs = [{"seq_id": f"q{i}", "domain": "chat", "token_ids": torch.randint(0, 512, (n,), generator=g).tolist()}
            for i, n in enumerate(LENGTHS)]
    p = tmp_path_factory.mktemp("panel") / "panel.json"
    p.write_text(json.dumps({"panel_name": "v4-runner-test", "panel_version": "1", "sequences": seqs}))
    return p


def test_the_tiny_v4_checkpoint_loads_unchanged_as_a_v4_model(tiny_v4):
    ck = Checkpoint(tiny_v4)  # every official tensor claimed by the V4 inventory; none missing, none extra
    cfg = ck.model_config
    assert arch_of(cfg) is V4 and ck.fp8_block == (128, 128) and cfg.compress_ratios == (0, 4, 128, 4)
    assert set(ck.tensor_names()) == set(json.loads((tiny_v4 / "model.safetensors.index.json").read_text())["weight_map"])
    w = ck.load_layer(0)
    assert w["ffn.gate.tid2eid"].shape == (512, 6) and "ffn.gate.bias" not in w
    assert w["attn.wq_a.weight"].dtype == torch.float32  # fp8 128x128 blocks decoded exactly


def test_a_checkpoint_missing_a_v4_tensor_is_refused(tiny_v4, tmp_path):
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    bad.mkdir()
    index = json.loads((tiny_v4 / "model.safetensors.index.json").read_text())
    victim = "layers.1.attn.indexer.compressor.ape"
    for f in sorted(set(index["weight_map"].values())):
        t = load_file(tiny_v4 / f)
        t.pop(victim, None)
        save_file(t, bad / f)
    index["weight_map"].pop(victim)
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    (bad / "config.json").write_text((tiny_v4 / "config.json").read_text())
    with pytest.raises(CheckpointError, match=f"missing: {victim}"):
        Checkpoint(bad)


def test_decode_equals_prefill_on_the_tiny_checkpoint(tiny_v4):
    ck = Checkpoint(tiny_v4)
    m = Model(ck.model_config, full_weights(ck), None)
    assert all(isinstance(b, BlockV4) for b in m.blocks)
    ids = _ids(21, 9, 512)  # window 16 wraps; ratio-4 entries complete in the prefill and in decode
    full = m.forward(ids, m.new_state(1)).logits
    assert torch.equal(_prefill_then_decode(m, ids, 2), full)


@pytest.mark.parametrize("precision,spill", [("fp32", "ram"), ("reference-bf16", "disk")])
def test_streamed_run_is_bit_identical_to_the_in_memory_forward(tiny_v4, panel_json, tmp_path, precision, spill):
    opts = RunOptions(threads=1, progress=False, full_logprobs=True, precision=precision, spill=spill)
    rec = run_panel(Checkpoint(tiny_v4), encoded_from_json(panel_json), tmp_path / "work", opts)
    mem, ties = forward_in_memory(Checkpoint(tiny_v4), encoded_from_json(panel_json), precision,
                                  full_logprobs=True, threads=1)
    ref = Record.from_sequences(rec.provenance, mem, k=256)
    for name in ARRAYS:
        assert np.array_equal(getattr(rec, name), getattr(ref, name)), name
    assert rec.provenance.extra["ties"]["total"] == ties.total
    assert rec.provenance.precision == precision

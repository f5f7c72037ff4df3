"""The oracle at long context (issue 39): a chunked prefill through the model's own caches equals the one-pass
prefill (`Model.forward`, the code path every other oracle test holds), the head runs only on scored rows, and
the mechanisms live at a position follow the worked examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.coverage import Mechanism, decode
from oracle.dsv41.config import ModelConfig
from oracle.dsv41.engram import tiny_token_map
from oracle.dsv41.long_context import (ChunkTrace, LongOptions, chunk_bounds, mechanism_masks, prefill_scored,
                                       run_long)
from oracle.dsv41.model import Model
from oracle.dsv41.options import RunnerError
from oracle.scoring import stats_from_logits

from .dsv41_random_weights import random_weights
from .dsv4_random_weights import random_weights_v4, small_v4_config


@pytest.fixture(autouse=True)
def one_thread():
    """The oracle's float64 kernels on a shared, loaded 2-core box: one thread is ~10x faster than two."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _ids(n, seed, vocab):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _chunked_logits(m: Model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Every row's logits through the chunked trunk (the long path's schedule, head on every row here)."""
    from oracle.dsv41.block import head_step
    from oracle.dsv41.long_context import chunk_align

    st = m.new_state(1)
    out = []
    for a, e in chunk_bounds(ids.shape[1], chunk, chunk_align(m.cfg)):
        h, pre, _ = m.trunk(ids[:, a:e], st)
        out.append(head_step(m.head, h, pre, st.num))
        for cache in st.caches.values():
            cache.trim_window(m.cfg.window_size - 1)
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def small_v4():
    cfg = small_v4_config()
    return cfg, random_weights_v4(cfg, seed=0)


@pytest.fixture(scope="module")
def tiny_v41():
    cfg = ModelConfig.tiny(max_seq_len=1024)
    return cfg, random_weights(cfg, seed=0)


def test_chunk_bounds_align_and_merge_a_short_rest():
    assert chunk_bounds(600, 256, 128) == [(0, 256), (256, 600)]          # rest 88 < 128 joins the chunk before
    assert chunk_bounds(700, 256, 128) == [(0, 256), (256, 512), (512, 700)]
    assert chunk_bounds(100, 256, 128) == [(0, 100)]
    with pytest.raises(RunnerError, match="not a multiple of 128"):
        chunk_bounds(600, 200, 128)


@pytest.mark.parametrize("chunk", [8, 48])
def test_v4_chunked_prefill_equals_one_pass(small_v4, chunk):
    """Window 8 (trimmed to 7 rows between chunks), ratio 4 with its overlapping compressor and an indexer
    keeping 3 of up to 60 groups, ratio 8 pooled: 240 tokens in chunks equal the one-pass prefill bit for bit
    (the ~600-token case on the tiny V4 checkpoint is test_tiny_v4_chunked_equals_one_pass, marked long)."""
    cfg, w = small_v4
    m = Model(cfg, w, None)
    ids = _ids(240, 7, cfg.vocab_size)
    one = m.forward(ids, m.new_state(1)).logits
    chunked = _chunked_logits(m, ids, chunk)
    assert chunked.shape == one.shape
    diff = (chunked != one).any(-1)[0]
    assert not diff.any(), f"first differing position {int(diff.nonzero()[0])}"


def test_v4_decode_after_chunked_prefill_equals_one_pass(small_v4):
    """The trimmed window and the compressors' state a chunked prefill leaves are what decode continues from."""
    cfg, w = small_v4
    m = Model(cfg, w, None)
    ids = _ids(120, 8, cfg.vocab_size)
    one = m.forward(ids, m.new_state(1)).logits
    st = m.new_state(1)
    from oracle.dsv41.long_context import chunk_align

    for a, e in chunk_bounds(100, 16, chunk_align(cfg)):
        m.trunk(ids[:, a:e], st)
        for cache in st.caches.values():
            cache.trim_window(cfg.window_size - 1)
    steps = torch.cat([m.forward(ids[:, p:p + 1], st).logits for p in range(100, 120)], dim=1)
    assert torch.equal(steps, one[:, 100:120])


@pytest.mark.parametrize("index_k", ["upstream", "intended"])
def test_v41_chunked_prefill_equals_one_pass(tiny_v41, index_k):
    """V4.1 at test size (§20.1): window 64, ratio-2 and ratio-1 compressed KV shared across layers, indexers
    keeping 16 with candidate blocks, Engram lookups and DSpark taps: 260 tokens in chunks of 64 (the last 68)
    equal the one-pass prefill bit for bit, taps included."""
    cfg, w = tiny_v41
    m = Model(cfg, w, tiny_token_map(cfg.vocab_size), index_k=index_k, with_mtp=False)
    ids = _ids(260, 9, cfg.vocab_size)
    one = m.forward(ids, m.new_state(1))
    st = m.new_state(1)
    logits, taps = [], []
    from oracle.dsv41.block import head_step

    for a, e in chunk_bounds(260, 64, 2):
        h, pre, tp = m.trunk(ids[:, a:e], st)
        logits.append(head_step(m.head, h, pre, st.num))
        taps.append(tp)
        for cache in st.caches.values():
            cache.trim_window(cfg.window_size - 1)
    assert torch.equal(torch.cat(logits, 1), one.logits)
    assert torch.equal(torch.cat(taps, 1), one.main_hidden)


def test_scored_head_never_sees_more_than_the_scored_rows(small_v4):
    """Memory is bounded by shapes, not timings: the head runs on each chunk's scored rows only, never on
    [S, V]; the stats equal those of the one-pass logits at the same rows."""
    cfg, w = small_v4
    m = Model(cfg, w, None)
    ids = _ids(400, 10, cfg.vocab_size)
    scored = np.array([5, 9, 130, 131, 250, 399])
    heads = []
    real_head = m.head

    class Recording:
        def logits(self, h, pre, num):
            heads.append(tuple(h.shape))
            return real_head.logits(h, pre, num)

    m.head = Recording()
    traces: list[ChunkTrace] = []
    stats, _ = prefill_scored(m, ids[0].tolist(), scored, 64, top_k=5, on_chunk=traces.append)
    m.head = real_head
    assert sum(t.head_rows for t in traces) == scored.size
    assert all(shape[1] == t.head_rows for shape, t in zip(heads, [t for t in traces if t.head_rows]))
    assert max(shape[1] for shape in heads) == 2   # of 64-row chunks
    one = m.forward(ids, m.new_state(1)).logits[0]
    want = stats_from_logits(one[torch.from_numpy(scored - 1)], ids[0, scored].numpy(), 5, False)
    assert np.array_equal(stats.topk_ids, want.topk_ids)
    assert np.array_equal(stats.topk_logprobs, want.topk_logprobs)
    assert np.array_equal(stats.actual_logprob, want.actual_logprob)


def test_mechanisms_on_the_worked_example():
    """The tiny V4 checkpoint's shape: window 128, ratios 0/4/128/4, index_topk 512."""
    cfg = small_v4_config(window_size=128, compress_ratios=(0, 4, 128, 4, 0), index_topk=512)
    rows = np.array([50, 127, 128, 200, 2050, 2051, 5000])
    got = [decode(m) for m in mechanism_masks(cfg, rows)]
    W, R4, R128, IDX = (Mechanism.WINDOW_FULL_EVICTING, Mechanism.COMPRESSED_R4, Mechanism.COMPRESSED_R128,
                        Mechanism.INDEXER_PRUNING)
    assert got[0] == {R4}                       # 13 ratio-4 groups, window not full, no ratio-128 group yet
    assert got[1] == {R4, R128}                 # the first ratio-128 group completes at row 127
    assert got[2] == {R4, R128, W}              # row 128: key 0 has left the 128-key window
    assert got[3] == {R4, R128, W}              # position 200 evicts, position 50 does not
    assert IDX not in got[4]                    # (2050 + 1) // 4 = 512 groups: top-512 keeps all
    assert got[5] == got[6] == {R4, R128, W, IDX}   # 513 groups > 512: the indexer prunes
    v41 = ModelConfig.tiny()
    live = [decode(m) for m in mechanism_masks(v41, np.array([0, 40]))]
    assert Mechanism.ENGRAM_LOOKUP not in live[0] and Mechanism.ENGRAM_LOOKUP in live[1]
    assert all(Mechanism.DSPARK_TAPS in x for x in live)
    assert Mechanism.INDEXER_PRUNING in live[1]     # ratio 2, 20 groups > index_topk 16


def test_long_options_refuse_nonsense():
    with pytest.raises(RunnerError, match="precision"):
        LongOptions(precision="fp16")
    with pytest.raises(RunnerError, match="at least 2"):
        LongOptions(chunk=1)
    assert callable(run_long)


@pytest.mark.long
def test_tiny_v4_chunked_equals_one_pass():
    """The tiny DeepSeek-V4 checkpoint (window 128, ratios 0/4/128/4, top-512): 600 tokens of long@1's code text
    in chunks of 128 and 256 equal `Model.forward`'s one-pass prefill bit for bit at every position."""
    from engine.dsv4_model import ensure_dsv4_tiny
    from oracle.dsv41.block import head_step
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.long_context import chunk_align
    from oracle.dsv41.runner import full_weights
    from panels import encode_panel, load_panel, load_tokenizer
    from panels.long import select

    ck = Checkpoint(ensure_dsv4_tiny())
    m = Model(ck.model_config, full_weights(ck), None, with_mtp=False)
    enc = encode_panel(select(load_panel("long@1"), [4096], ["code"]), load_tokenizer("deepseek"))
    ids = torch.tensor([enc.sequences[0].token_ids[:600]])
    one = m.forward(ids, m.new_state(1)).logits
    for chunk in (128, 256):
        st = m.new_state(1)
        out = []
        for a, e in chunk_bounds(600, chunk, chunk_align(m.cfg)):
            h, pre, _ = m.trunk(ids[:, a:e], st)
            out.append(head_step(m.head, h, pre, st.num))
            for cache in st.caches.values():
                cache.trim_window(m.cfg.window_size - 1)
        got = torch.cat(out, dim=1)
        diff = (got != one).any(-1)[0]
        assert not diff.any(), f"chunk {chunk}: first differing position {int(diff.nonzero()[0])}"


@pytest.fixture(scope="module")
def tiny_v41_checkpoint(tmp_path_factory):
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.tiny import write_tiny_checkpoint

    return Checkpoint(write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "ck", seed=0))


def _encoded(lengths, vocab):
    from panels.model import EncodedPanel, EncodedSequence

    seqs = []
    for k, n in enumerate(lengths):
        ids = _ids(n, 20 + k, vocab)[0].tolist()
        mask = [p in (1, 2, n // 2, n - 1) for p in range(n)]
        seqs.append(EncodedSequence(f"s{k}", "code", tuple(ids), tuple(mask)))
    return EncodedPanel("unit-long", 1, "sha256:" + "a" * 64, "sha256:" + "b" * 64, tuple(seqs))


@pytest.mark.long   # writes and loads a tiny V4.1 checkpoint: minutes on a loaded 2-core box
def test_run_long_record_mechanisms_and_resume(tiny_v41_checkpoint, tmp_path):
    """A record with per-position mechanisms; a rerun over the committed sequences loads no model and gives the
    same arrays; a work dir of another job (another chunk size) is refused, naming what differs."""
    from core.coverage import coverage_of_record

    ck = tiny_v41_checkpoint
    enc = _encoded([150, 90], ck.model_config.vocab_size)
    opts = LongOptions(chunk=64, top_k=8, threads=1)
    rec = run_long(ck, enc, tmp_path / "work", opts)
    assert rec.mechanism_names is not None and rec.mechanisms.shape == (rec.n_positions,)
    cov = coverage_of_record(rec)
    assert cov.total_scored == 8 and cov.exercised("dspark_taps") and cov.exercised("engram_lookup")
    assert cov.live["window_full_evicting"]["d0-128"] == 2       # rows 74 and 148 of s0 (window 64), not s1's 44
    again = run_long(ck, enc, tmp_path / "work", opts)
    assert again.provenance.extra["long_context"]["load_s"] == 0.0
    for name in ("topk_ids", "topk_logprobs", "actual_logprob", "mechanisms"):
        assert np.array_equal(getattr(rec, name), getattr(again, name))
    with pytest.raises(RunnerError, match="another job .*'chunk'"):
        run_long(ck, enc, tmp_path / "work", LongOptions(chunk=128, top_k=8, threads=1))


def test_reference_bf16_runs_chunked(small_v4):
    """reference-bf16 takes the same chunks (its products may depend on the row count, so no identity claim)."""
    cfg, w = small_v4
    m = Model(cfg, w, None, precision="reference-bf16")
    ids = _ids(120, 11, cfg.vocab_size)
    stats, _ = prefill_scored(m, ids[0].tolist(), np.array([3, 60, 119]), 16, top_k=4)
    assert stats.topk_ids.shape == (3, 4) and np.isfinite(stats.actual_logprob).all()


def test_the_mechanism_rule_matches_what_the_model_did(monkeypatch):
    """mechanism_masks states the mechanisms from the config's rules; here they are observed in the model's own data
    flow on a one-pass prefill instead, row by row: the window evicts where a window layer's attention list holds
    fewer keys than the tokens so far; a ratio-r layer's compressed entries are live where its list holds an index
    into the compressed rows; the indexer prunes where its top-k had more visible (finite) scores than it keeps."""
    import oracle.dsv41.attention_v4 as attention_v4
    from oracle.dsv41.numerics import Numerics

    cfg = small_v4_config(window_size=16, compress_ratios=(0, 4, 128, 4, 0), index_topk=8, max_seq_len=512)
    S = 300
    lists, pruned = [], {}
    real_attn, real_topk = attention_v4.sparse_attn, Numerics.topk

    def seen_attn(q, kv, sink, idx, scale, num, *a, **kw):
        lists.append((idx[0].clone(), kv.shape[1]))
        return real_attn(q, kv, sink, idx, scale, num, *a, **kw)

    def seen_topk(self, scores, k, site, *a, **kw):
        if site.startswith("indexer."):
            pruned[int(site.split(".")[1])] = (torch.isfinite(scores[0]).sum(-1) > k).numpy()
        return real_topk(self, scores, k, site, *a, **kw)

    monkeypatch.setattr(attention_v4, "sparse_attn", seen_attn)
    monkeypatch.setattr(Numerics, "topk", seen_topk)
    m = Model(cfg, random_weights_v4(cfg, seed=1), None)
    m.forward(_ids(S, 7, cfg.vocab_size), m.new_state(1))
    assert len(lists) == cfg.n_layers

    rows = np.arange(S)
    observed = {m_: np.zeros(S, bool) for m_ in Mechanism}
    for L, (idx, n_keys) in enumerate(lists):
        r = cfg.ratio(L)
        valid = idx >= 0
        if r == 0:
            observed[Mechanism.WINDOW_FULL_EVICTING] |= valid.sum(-1).numpy() < rows + 1
        else:
            # compressed rows follow the window's rows in kv: an index at or past them is a compressed entry
            offset = n_keys - S // r
            live = ((idx >= offset) & valid).any(-1).numpy()
            observed[Mechanism.COMPRESSED_R4 if r == 4 else Mechanism.COMPRESSED_R128] |= live
    for L, rows_pruned in pruned.items():
        observed[Mechanism.INDEXER_PRUNING] |= rows_pruned
    stated = [decode(x) for x in mechanism_masks(cfg, rows)]
    for mech in (Mechanism.WINDOW_FULL_EVICTING, Mechanism.COMPRESSED_R4, Mechanism.COMPRESSED_R128,
                 Mechanism.INDEXER_PRUNING):
        want = np.array([mech in s for s in stated])
        assert np.array_equal(observed[mech], want), (mech, np.flatnonzero(observed[mech] != want)[:10])
        assert want.any() and not want.all(), mech      # each mechanism switches on inside this prompt

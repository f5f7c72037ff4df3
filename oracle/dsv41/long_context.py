"""The DeepSeek oracle at long context: chunked prefill through the model's own caches, logits only where a
position is scored (issue 39).

    rec = run_long(ck, panel, work_dir, LongOptions(precision="fp32", chunk=512))   # -> core.records.Record

Why: `Model.forward` and the runner's head stage produce `[s, V]` fp32 logits for every position and the one-pass
sparse attention gathers `[s, window + top-k, head_dim]` float64 keys per layer, so memory grows with S x V and
S x k x d (4,096 tokens of the tiny V4 checkpoint: 17.6 GB). Here a sequence is prefilled in chunks
(`Model.trunk` at start_pos > 0 with s > 1: the attention, compressors and indexers continue from their caches;
attention.py / attention_v4.py / compressor*.py), the window cache is trimmed to `window - 1` rows after each
chunk (`LayerCache.trim_window`), and the head runs only on the rows that predict a scored token. What stays in
memory is the weights, the window, the compressed KV, the indexer keys and one chunk's activations.

Chunks are aligned to the largest compress ratio, and a last chunk shorter than that joins the one before
(`chunk_bounds`): every chunk then completes a group of every compressor, so the key owners publish in each
chunk as they do in the one-pass prefill (V4.1's upstream index-key pointer, §18.1, follows the same owners).
In fp32 mode the chunked prefill equals the one-pass prefill (tests/oracle/test_long_context.py: bit for bit on
the small configs and the tiny V4 checkpoint); reference-bf16 runs the same chunks (its fp32/bf16 products may
depend on the row count, as the reference's own chunked prefill would).

Every scored position also gets the mechanisms that were live where its distribution was computed (row p - 1
for position p): `mechanism_masks` (core/coverage.py's bits).

Weights are held in memory (`runner.full_weights`): the tiny checkpoints; a release-size long reference goes
through the layer-streamed runner, whose stages would take the same chunked attention (not done here).
Resumable: each finished sequence is committed to the work dir (atomic), a rerun with the same identity
continues after the last one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from core.atomic import atomic_write_bytes, write_json_atomic
from core.coverage import MECHANISM_NAMES, Mechanism, bit
from core.records import Record, SequenceScores
from oracle.scoring import PositionStats, oracle_provenance, stats_from_logits
from panels.model import EncodedPanel, EncodedSequence
from panels.pre_encoded import sequences_hash

from .block import head_step
from .checkpoint import Checkpoint
from .config import ModelConfig
from .host import reset_peak_rss, status_kib
from .model import Model
from .numerics import PRECISION_MODES, TieStats
from .options import TOP_K, RunnerError, compute_context
from .runner import checkpoint_identity, engram_token_map, full_weights, weights_read_hash
from .workdir import record_to_file

IDENTITY = "identity.json"
DEFAULT_CHUNK = 512


@dataclass(frozen=True)
class LongOptions:
    precision: str = "fp32"
    chunk: int = DEFAULT_CHUNK  # tokens per prefill chunk; a multiple of the largest compress ratio
    threads: int = 0
    top_k: int = TOP_K
    full_logprobs: bool = False
    index_k: str = "upstream"
    restart: bool = False
    keep_work: bool = False

    def __post_init__(self):
        if self.precision not in PRECISION_MODES:
            raise RunnerError(f"precision {self.precision!r}: expected one of {PRECISION_MODES}")
        if self.chunk < 2:
            raise RunnerError(f"chunk {self.chunk}: a prefill chunk needs at least 2 tokens")


# ----------------------------------------------------------------------------------------------------------
# Pure pieces: chunk boundaries and the mechanisms live at a query row


def chunk_align(cfg: ModelConfig) -> int:
    """Chunks start at multiples of this: the largest compress ratio (so every chunk completes every
    compressor's groups), at least 2 (a 1-token call is a decode step, not a chunk)."""
    return max([2, *(cfg.ratio(L) for L in range(cfg.n_layers))])


def chunk_bounds(seq_len: int, chunk: int, align: int) -> list[tuple[int, int]]:
    """[start, end) of each prefill chunk: `chunk` tokens each (a multiple of `align`), the last one holding the
    rest; a rest shorter than `align` joins the chunk before it."""
    if chunk % align:
        raise RunnerError(f"chunk {chunk} is not a multiple of {align} (the largest compress ratio)")
    if seq_len < 1:
        raise RunnerError("a sequence to prefill needs at least one token")
    bounds = [(a, min(seq_len, a + chunk)) for a in range(0, seq_len, chunk)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < align:
        (a, _), (_, e) = bounds[-2], bounds[-1]
        bounds[-2:] = [(a, e)]
    return bounds


def mechanism_masks(cfg: ModelConfig, rows: np.ndarray) -> np.ndarray:
    """int64 [n] bitmasks (core.coverage bits) of the mechanisms live at query rows `rows` (absolute positions
    whose hidden state is computed), by the rules the attention follows:

    * window_full_evicting: row t >= window (the window holds `window` keys and key t - window has left it);
    * compressed_r4 / compressed_r128: a layer of that ratio has a complete group visible, (t + 1) // r >= 1;
    * indexer_pruning: an indexer layer sees more complete groups than it keeps, (t + 1) // r > index_topk
      (V4.1's candidate source scores every visible group, so it prunes exactly then too);
    * dspark_taps: the checkpoint taps layers for DSpark, at every row;
    * engram_lookup: Engram layers look up an n-gram of at least two real tokens, t >= 1."""
    t = np.asarray(rows, dtype=np.int64)
    out = np.zeros(t.shape, dtype=np.int64)
    on = lambda m, where: np.where(where, bit(m), 0)  # noqa: E731
    out |= on(Mechanism.WINDOW_FULL_EVICTING, t >= cfg.window_size)
    ratios = {cfg.ratio(L) for L in range(cfg.n_layers)}
    for r, m in ((4, Mechanism.COMPRESSED_R4), (128, Mechanism.COMPRESSED_R128)):
        if r in ratios:
            out |= on(m, (t + 1) // r >= 1)
    for r in sorted(_indexer_ratios(cfg)):
        out |= on(Mechanism.INDEXER_PRUNING, (t + 1) // r > cfg.index_topk)
    if cfg.dspark_target_layer_ids:
        out |= bit(Mechanism.DSPARK_TAPS)
    if cfg.engram_layer_ids:
        out |= on(Mechanism.ENGRAM_LOOKUP, t >= 1)
    return out


def _indexer_ratios(cfg: ModelConfig) -> set[int]:
    """The compress ratios of the layers that run an indexer (V4: its ratio-4 layers; V4.1: index sources)."""
    if cfg.arch == "v4":
        return {4} if any(cfg.ratio(L) == 4 for L in range(cfg.n_layers)) else set()
    return {cfg.ratio(L) for L in range(cfg.n_layers) if cfg.is_index_source(L) and cfg.ratio(L) > 0}


# ----------------------------------------------------------------------------------------------------------
# One sequence


@dataclass(frozen=True)
class ChunkTrace:
    """What one chunk computed (the memory tests read it): its bounds and the rows its head ran on."""

    start: int
    end: int
    head_rows: int


def prefill_scored(model: Model, token_ids: Sequence[int], scored: np.ndarray, chunk: int, top_k: int,
                   full_logprobs: bool = False,
                   on_chunk: Callable[[ChunkTrace], None] | None = None) -> tuple[PositionStats, TieStats]:
    """Chunked prefill of one sequence; the head only on rows p - 1 of the scored positions `scored` (sorted,
    >= 1) -> their stats in position order, and the numerics' tie counts."""
    cfg = model.cfg
    ids = torch.tensor([list(token_ids)], dtype=torch.int64)
    st = model.new_state(1)
    rows = np.asarray(scored, dtype=np.int64) - 1
    parts: list[PositionStats] = []
    for a, e in chunk_bounds(ids.shape[1], chunk, chunk_align(cfg)):
        h, pre, _taps = model.trunk(ids[:, a:e], st)
        take = rows[(rows >= a) & (rows < e)]
        if take.size:
            local = torch.from_numpy(take - a)
            logits = head_step(model.head, h[:, local], pre[:, local], st.num)[0]
            parts.append(stats_from_logits(logits, ids[0, take + 1].numpy(), top_k, full_logprobs))
            del logits
        if on_chunk is not None:
            on_chunk(ChunkTrace(a, e, int(take.size)))
        del h, pre, _taps
        for cache in st.caches.values():
            cache.trim_window(cfg.window_size - 1)
    return _concat(parts, top_k, cfg.vocab_size, full_logprobs), st.num.ties


def _concat(parts: list[PositionStats], top_k: int, vocab: int, full: bool) -> PositionStats:
    if not parts:
        return PositionStats(np.empty((0, top_k), np.int64), np.empty((0, top_k)), np.empty(0), np.empty(0, np.int64),
                             np.empty(0), np.empty((0, vocab), np.float32) if full else None)
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return PositionStats(cat("topk_ids"), cat("topk_logprobs"), cat("actual_logprob"), cat("actual_rank"),
                         cat("logsumexp"), cat("full_logprobs") if full else None)


# ----------------------------------------------------------------------------------------------------------
# A panel, resumable


def run_long(ck: Checkpoint, panel: EncodedPanel, work: str | Path, opts: LongOptions = LongOptions(),
             token_map: np.ndarray | None = None) -> Record:
    """Score every sequence of `panel` by chunked prefill; each finished sequence is committed to `work`, so a
    killed run continues after the last one (same identity), and the record is the same as uninterrupted."""
    t0 = time.perf_counter()
    cfg = ck.model_config
    for s in panel.sequences:
        bad = [t for t in s.token_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise RunnerError(f"sequence {s.seq_id!r}: token id {bad[0]} is outside the checkpoint's vocabulary "
                              f"0..{cfg.vocab_size - 1}")
    work = Path(work)
    identity = {"format": "ds41-long/1", "checkpoint_hash": checkpoint_identity(ck), "panel_hash": panel.panel_hash,
                "sequences": sequences_hash(panel.sequences), "precision": opts.precision, "chunk": opts.chunk,
                "index_k": opts.index_k, "top_k": opts.top_k, "full_logprobs": opts.full_logprobs,
                "torch": torch.__version__}
    _open_work(work, identity, opts.restart)
    if token_map is None:
        token_map = engram_token_map(ck)
    threads = opts.threads or torch.get_num_threads()
    seqs: list[tuple[SequenceScores, dict]] = []
    model, load_s = None, 0.0
    reset_peak_rss()
    with compute_context("cpu", threads):
        for i, seq in enumerate(panel.sequences):
            done = work / f"seq-{i:05d}.npz"
            if not done.is_file():
                if model is None:
                    t = time.perf_counter()
                    model = Model(cfg, full_weights(ck), token_map, precision=opts.precision, index_k=opts.index_k,
                                  with_mtp=False)
                    load_s = time.perf_counter() - t
                t = time.perf_counter()
                scored = np.flatnonzero(np.asarray(seq.scored_mask, dtype=bool))
                stats, ties = prefill_scored(model, seq.token_ids, scored, opts.chunk, opts.top_k,
                                             opts.full_logprobs)
                _commit_sequence(done, stats, ties, time.perf_counter() - t)
            seqs.append(_load_sequence(done, seq, cfg))
    scores = [s for s, _ in seqs]
    ties = {"total": sum(t.get("ties", 0) for _, t in seqs)}
    source = {"oracle": "oracle.dsv41.long_context", "checkpoint": str(ck.dir.resolve()),
              "pack": str(ck.pack_dir.resolve()) if ck.pack_dir else None,
              "checkpoint_hash": identity["checkpoint_hash"],
              "weights_read_sha256": weights_read_hash(ck.loaded_digests()), "tensors_read": len(ck.loaded_digests())}
    run = {"chunk": opts.chunk, "threads": threads, "total_s": round(time.perf_counter() - t0, 3),
           "load_s": round(load_s, 3),
           "peak_rss_kib": status_kib("VmHWM"), "tokens": sum(len(s.token_ids) for s in panel.sequences),
           "sequences": [t for _, t in seqs]}
    prov = oracle_provenance(panel, precision=opts.precision, vocab_size=int(cfg.vocab_size), source=source,
                             extra={"top_k": opts.top_k, "index_k": opts.index_k, "device": "cpu", "threads": threads,
                                    "torch": torch.__version__, "log_softmax_dtype": "float64",
                                    "long_context": run, "ties": ties})
    rec = Record.from_sequences(prov, scores, k=opts.top_k, mechanism_names=list(MECHANISM_NAMES))
    return rec


def run_long_to_file(ck: Checkpoint, panel: EncodedPanel, out: str | Path, work: str | Path | None = None,
                     opts: LongOptions = LongOptions(), token_map: np.ndarray | None = None) -> Record:
    """`run_long`, then write the record atomically and (unless keep_work) delete the work dir."""
    return record_to_file(lambda w: run_long(ck, panel, w, opts, token_map), out, work, opts.keep_work)


def _open_work(work: Path, identity: dict, restart: bool) -> None:
    path = work / IDENTITY
    if path.is_file() and not restart:
        try:
            old = json.loads(path.read_text())
        except ValueError:
            raise RunnerError(f"{path}: not JSON; pass restart to start the work dir afresh") from None
        if old != identity:
            diff = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
            raise RunnerError(f"{work}: the work dir belongs to another job (differs in {diff}); pass restart to "
                              "start it afresh, or choose another work dir")
        return
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_json_atomic(path, identity)


def _commit_sequence(path: Path, stats: PositionStats, ties: TieStats, seconds: float) -> None:
    arrays = {f.name: getattr(stats, f.name) for f in dataclasses.fields(PositionStats)
              if getattr(stats, f.name) is not None}
    meta = json.dumps({"seconds": round(seconds, 3), "ties": int(ties.total), "peak_rss_kib": status_kib("VmHWM")})
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(meta.encode(), dtype=np.uint8), **arrays)
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    atomic_write_bytes(path.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())


def _load_sequence(path: Path, seq: EncodedSequence, cfg: ModelConfig) -> tuple[SequenceScores, dict]:
    data = path.read_bytes()
    digest = path.with_suffix(".sha256")
    if not digest.is_file() or digest.read_text() != hashlib.sha256(data).hexdigest():
        raise RunnerError(f"{path}: its digest is missing or does not match; delete it to recompute the sequence")
    z = np.load(io.BytesIO(data))
    meta = json.loads(bytes(z["meta"]).decode())
    ids = np.asarray(seq.token_ids, dtype=np.int64)
    mask = np.asarray(seq.scored_mask, dtype=bool)
    pos = np.flatnonzero(mask)
    scores = SequenceScores(seq.seq_id, seq.domain, ids, mask, z["topk_ids"], z["topk_logprobs"],
                            z["actual_logprob"], z["actual_rank"], logsumexp=z["logsumexp"],
                            full_logprobs=z["full_logprobs"] if "full_logprobs" in z else None,
                            mechanisms=mechanism_masks(cfg, pos - 1))
    return scores, {"seq_id": seq.seq_id, "tokens": int(ids.size), "scored": int(pos.size), **meta}

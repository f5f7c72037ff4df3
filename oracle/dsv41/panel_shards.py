"""Sharded panel runs: machine I of N scores every N-th sequence of the panel (`--shard I/N`), and the N
shard records are joined into the record one unsharded run writes (same arrays, same order)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from core.records import Provenance, Record, SequenceScores
from panels.model import EncodedPanel

from .numerics import TieStats
from .options import RunnerError


class MergeError(RunnerError):
    """Shards that do not form one panel run."""


def select_shard(panel: EncodedPanel, index: int, count: int) -> tuple[EncodedPanel, list[int]]:
    """Machine `index` of `count` takes every count-th sequence, starting at `index`; returns its panel and
    the panel indices of its sequences."""
    if not (count >= 1 and 0 <= index < count):
        raise RunnerError(f"shard {index}/{count}: need 0 <= I < N")
    picked = list(range(index, len(panel.sequences), count))
    if not picked:
        raise RunnerError(f"shard {index}/{count}: the panel has only {len(panel.sequences)} sequences")
    return dataclasses.replace(panel, sequences=tuple(panel.sequences[i] for i in picked)), picked


def _record_sequences(rec: Record) -> list[SequenceScores]:
    out = []
    starts = np.searchsorted(rec.pos_seq, np.arange(rec.n_sequences + 1))
    for i, (sid, dom) in enumerate(zip(rec.seq_ids, rec.domains)):
        a, b = int(starts[i]), int(starts[i + 1])
        lo, hi = int(rec.seq_offsets[i]), int(rec.seq_offsets[i + 1])
        opt = lambda arr: None if arr is None else arr[a:b]  # noqa: E731
        out.append(SequenceScores(sid, dom, rec.token_ids[lo:hi], rec.scored[lo:hi], rec.topk_ids[a:b],
                                  rec.topk_logprobs[a:b], rec.actual_logprob[a:b], rec.actual_rank[a:b],
                                  logsumexp=opt(rec.logsumexp), full_logprobs=opt(rec.full_logprobs),
                                  ambiguous=opt(rec.ambiguous)))
    return out


def merge_records(paths: Sequence[str | os.PathLike]) -> Record:
    """Join `--shard I/N` records into the record an unsharded run writes (same arrays, same order)."""
    if not paths:
        raise MergeError("merge: no shard records given")
    recs = [(Path(p), Record.load(p)) for p in paths]
    p0, r0 = recs[0]
    a = r0.provenance
    same = ("side", "panel_name", "panel_version", "panel_hash", "tokenizer_hash", "source", "precision")
    shard_n = None
    by_index: dict[int, SequenceScores] = {}
    seen_shards = set()
    ties = TieStats()
    for p, r in recs:
        b = r.provenance
        diff = [k for k in same if getattr(a, k) != getattr(b, k)]
        if r.k != r0.k:
            diff.append("k")
        if diff:
            raise MergeError(f"{p}: differs from {p0} in {diff}; these shards are not one panel run")
        ex = b.extra
        if not ex.get("shard") or "seq_indices" not in ex:
            raise MergeError(f"{p}: not a shard record (no provenance extra.shard)")
        i, n = ex["shard"]
        if shard_n is None:
            shard_n, total = n, ex["panel_sequences"]
        if n != shard_n or ex["panel_sequences"] != total:
            raise MergeError(f"{p}: shard {i}/{n} of {ex['panel_sequences']} sequences; {p0} is one of {shard_n} "
                             f"shards of {total}")
        if i in seen_shards:
            raise MergeError(f"{p}: shard {i}/{n} given twice")
        seen_shards.add(i)
        if len(ex["seq_indices"]) != r.n_sequences:
            raise MergeError(f"{p}: provenance names {len(ex['seq_indices'])} sequences, the record holds {r.n_sequences}")
        for idx, s in zip(ex["seq_indices"], _record_sequences(r)):
            by_index[idx] = s
        for site, c in ex.get("ties", {}).get("counts", {}).items():
            ties.add(site, c, 0)
    missing = sorted(set(range(shard_n)) - seen_shards)
    if missing or sorted(by_index) != list(range(total)):
        raise MergeError(f"merge: shards {missing} of {shard_n} are missing "
                         f"({total - len(by_index)} of {total} sequences absent)")
    per_shard = ("run", "cluster")  # timings, and where a cluster ran the shard: kept per shard below
    extra = {k: v for k, v in a.extra.items() if k not in ("shard", "seq_indices", "ties") + per_shard}
    extra.update({"shard": None, "panel_sequences": total, "seq_indices": list(range(total)),
                  "ties": {"total": ties.total, "counts": dict(sorted(ties.counts.items()))},
                  "merged_from": [{"file": str(p), "shard": r.provenance.extra["shard"],
                                   **{k: r.provenance.extra[k] for k in per_shard if k in r.provenance.extra}}
                                  for p, r in recs]})
    prov = dataclasses.replace(a, created=Provenance.now(), extra=extra)
    return Record.from_sequences(prov, [by_index[i] for i in range(total)], k=r0.k)

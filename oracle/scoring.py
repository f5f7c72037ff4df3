"""What every oracle does after its logits: per scored position the top-K ids and logprobs, the actual
token's logprob and rank, and the logsumexp, all from the fp32 logits in float64; and the provenance of an
oracle record. Shared by the transformers oracle (oracle/hf.py) and the DeepSeek-V4.1 oracle
(oracle/dsv41/runner.py), so both write the same numbers for the same logits.

Top-K is ordered by logprob descending, ties broken by the lower id; the rank is 1 + the number of ids with a
strictly larger logprob (the convention vLLM uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.errors import UserError
from core.records import Provenance, SequenceScores
from core.version import code_version
from panels.model import EncodedPanel, EncodedSequence


class OracleError(UserError, RuntimeError):
    """The oracle cannot run on this input; the message names the model dir / sequence / position."""


@dataclass(frozen=True)
class PositionStats:
    """Per-scored-position oracle values of one sequence (rows in position order)."""

    topk_ids: np.ndarray        # int64 [n, K]
    topk_logprobs: np.ndarray   # float64 [n, K]
    actual_logprob: np.ndarray  # float64 [n]
    actual_rank: np.ndarray     # int64 [n]
    logsumexp: np.ndarray       # float64 [n]
    full_logprobs: np.ndarray | None  # float32 [n, V]


def stats_from_logits(logits, actual_ids, top_k: int, full_vocab: bool, chunk: int = 256) -> PositionStats:
    """``logits[r]`` (float32 torch [n, V]) is the distribution that predicts ``actual_ids[r]``.

    Everything after the logits is float64. Top-K is ordered by logprob descending, ties by lower id.
    """
    n, vocab = logits.shape
    if top_k > vocab:
        raise OracleError(f"top_k={top_k} exceeds the vocabulary size {vocab}")
    # on the logits' device even inside a `with torch.device("cuda")` block (the runner's GPU mode)
    actual = torch.as_tensor(np.asarray(actual_ids, dtype=np.int64), device=logits.device)
    out_ids = np.empty((n, top_k), dtype=np.int64)
    out_lp = np.empty((n, top_k), dtype=np.float64)
    out_act = np.empty(n, dtype=np.float64)
    out_rank = np.empty(n, dtype=np.int64)
    out_lse = np.empty(n, dtype=np.float64)
    full = np.empty((n, vocab), dtype=np.float32) if full_vocab else None
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        x = logits[a:b].to(torch.float64)
        lse = torch.logsumexp(x, dim=-1)
        lp = x - lse[:, None]
        act = lp.gather(1, actual[a:b, None])[:, 0]
        rank = 1 + (lp > act[:, None]).sum(dim=1)
        # candidates: top (K + margin) by value, then a stable (value desc, id asc) order among them; the
        # margin covers ties at the K boundary unless more than `margin` ids tie there (checked below)
        m = min(vocab, top_k + 64)
        vals, idx = torch.topk(lp, m, dim=-1, largest=True, sorted=True)
        idx_np = idx.numpy()
        vals_np = vals.numpy()
        order = np.lexsort((idx_np, -vals_np), axis=-1)[:, :top_k]
        ids = np.take_along_axis(idx_np, order, 1)
        lps = np.take_along_axis(vals_np, order, 1)
        if m < vocab and np.any(vals_np[:, -1] == lps[:, -1]):
            r = int(np.flatnonzero(vals_np[:, -1] == lps[:, -1])[0])
            raise OracleError(f"row {a + r}: more than {m - top_k} ids tie at the top-{top_k} boundary")
        out_ids[a:b] = ids
        out_lp[a:b] = lps
        out_act[a:b] = act.numpy()
        out_rank[a:b] = rank.numpy()
        out_lse[a:b] = lse.numpy()
        if full is not None:
            full[a:b] = lp.to(torch.float32).numpy()
    return PositionStats(out_ids, out_lp, out_act, out_rank, out_lse, full)


def sequence_scores(seq: EncodedSequence, logits: torch.Tensor, top_k: int, full_vocab: bool) -> SequenceScores:
    """logits [s, V] fp32 of one sequence (`logits[p - 1]` predicts token p) -> its record rows."""
    ids = np.asarray(seq.token_ids, dtype=np.int64)
    mask = np.asarray(seq.scored_mask, dtype=bool)
    pos = np.flatnonzero(mask)
    rows = logits[torch.from_numpy(pos - 1).to(logits.device)].cpu()
    st = stats_from_logits(rows, ids[pos], top_k, full_vocab)
    return SequenceScores(seq.seq_id, seq.domain, ids, mask, st.topk_ids, st.topk_logprobs, st.actual_logprob,
                          st.actual_rank, logsumexp=st.logsumexp, full_logprobs=st.full_logprobs)


def oracle_provenance(panel: EncodedPanel, *, source: dict[str, Any], precision: str,
                      extra: dict[str, Any], vocab_size: int) -> Provenance:
    """The provenance of an oracle record over `panel`: its identity, the oracle's `source` (with the model's
    `vocab_size`, so a loaded record can refuse out-of-vocabulary ids), and the code version and time."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"oracle provenance: vocab_size must be a positive int, got {vocab_size!r}")
    return Provenance(side="oracle", panel_name=panel.panel_name, panel_version=str(panel.panel_version),
                      panel_hash=panel.panel_hash, tokenizer_hash=panel.tokenizer_hash,
                      source={**source, "vocab_size": vocab_size},
                      precision=precision, code_version=code_version(), created=Provenance.now(), extra=extra)

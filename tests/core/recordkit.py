"""Builders for records from explicit full distributions, so tests can compare against scipy."""

from __future__ import annotations

import numpy as np

from core.records import Provenance, Record, SequenceScores


def provenance(side: str = "oracle", panel_hash: str = "p" * 64, tokenizer_hash: str = "t" * 64) -> Provenance:
    return Provenance(side=side, panel_name="unit", panel_version="1", panel_hash=panel_hash,
                      tokenizer_hash=tokenizer_hash, precision="fp32", created=Provenance.now())


def topk_from_full(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k in rank order with ties broken by the lower id."""
    order = np.lexsort((np.arange(logprobs.shape[-1])[None, :].repeat(len(logprobs), 0), -logprobs), axis=-1)
    ids = order[:, :k]
    return ids, np.take_along_axis(logprobs, ids, axis=1)


def sequence_from_full(seq_id: str, domain: str, tokens: np.ndarray, logprobs: np.ndarray, k: int,
                       keep_full: bool = False) -> SequenceScores:
    """`logprobs[i]` is the distribution at position i+1 (positions 1..T-1 scored)."""
    tokens = np.asarray(tokens)
    scored = np.ones(tokens.size, dtype=bool)
    scored[0] = False
    actual = tokens[1:]
    ids, lps = topk_from_full(logprobs, k)
    ranks = 1 + (logprobs > np.take_along_axis(logprobs, actual[:, None], 1)).sum(axis=1)
    return SequenceScores(
        seq_id=seq_id, domain=domain, token_ids=tokens, scored=scored, topk_ids=ids, topk_logprobs=lps,
        actual_logprob=np.take_along_axis(logprobs, actual[:, None], 1)[:, 0], actual_rank=ranks,
        full_logprobs=logprobs.astype(np.float32) if keep_full else None,
    )


def random_logprobs(rng: np.random.Generator, n: int, vocab: int, scale: float = 3.0) -> np.ndarray:
    logits = rng.normal(size=(n, vocab)) * scale
    return logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)


def pair_of_records(rng, n_seq=3, length=9, vocab=50, k_ref=50, k_eng=5, noise=0.3, domains=("a", "b"),
                    ref_full=False):
    """A reference record and an engine record on the same tokens, plus the full distributions."""
    ref_seqs, eng_seqs, full = [], [], []
    for s in range(n_seq):
        tokens = rng.integers(0, vocab, size=length)
        p = random_logprobs(rng, length - 1, vocab)
        logits_q = p + rng.normal(size=p.shape) * noise
        q = logits_q - np.log(np.exp(logits_q).sum(1, keepdims=True))
        dom = domains[s % len(domains)]
        ref_seqs.append(sequence_from_full(f"s{s}", dom, tokens, p, k_ref, keep_full=ref_full))
        eng_seqs.append(sequence_from_full(f"s{s}", dom, tokens, q, k_eng))
        full.append((p, q))
    ref = Record.from_sequences(provenance("oracle"), ref_seqs)
    eng = Record.from_sequences(provenance("engine"), eng_seqs)
    return ref, eng, full

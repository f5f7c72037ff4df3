"""Generic fp32 CPU oracle for HF-format causal LMs (transformers).

``score_panel_hf(model_dir, encoded_panel)`` loads the directory with ``dtype=torch.float32``, runs one
forward pass per :class:`EncodedSequence` (the token ids exactly as encoded, no BOS added), takes
``log_softmax`` of the full-vocabulary logits **in float64**, and writes the shared record format
(side ``oracle``): per scored position the top-K ids and logprobs (default K = 256, ties broken by the
lower id), the actual token's logprob and 1-based rank (1 + number of ids with a strictly larger logprob,
the convention vLLM uses), the logsumexp of the logits, and optionally the full-vocabulary logprobs in
float32.

Determinism: ``torch.use_deterministic_algorithms(True)`` inside the run, a fixed thread count (recorded
in the provenance), eval mode, no autocast. Repeated runs with the same thread count are bitwise equal.

Resumability: with ``checkpoint_dir``, each finished sequence is written as one safetensors file named by
the panel hash, model hash and sequence id; a rerun loads those instead of recomputing. A checkpoint is
used only when its stored token ids equal the sequence's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from core.records import Provenance, Record, SequenceScores
from core.version import code_version

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class OracleError(RuntimeError):
    """The oracle cannot run on this input; the message names the model dir / sequence / position."""


# the panels seam (docs/DESIGN.md): what is scored is always an encoded panel
from panels.model import EncodedPanel as _EncodedPanel, EncodedSequence as _EncodedSequence  # noqa: E402


# ---------------------------------------------------------------------------------------------- hashing
def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    d = Path(model_dir)
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise OracleError(f"{d}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    return files


def model_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over (file name, sha256 of file) of every weight file, in name order."""
    outer = hashlib.sha256()
    for f in weight_files(model_dir):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        outer.update(f.name.encode() + b"\0" + h.hexdigest().encode() + b"\n")
    return outer.hexdigest()


# ---------------------------------------------------------------------------------------------- math
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
    import torch

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


@contextlib.contextmanager
def _deterministic(threads: int) -> Iterator[None]:
    import torch

    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)


# ---------------------------------------------------------------------------------------------- model
@dataclass
class HFOracle:
    """A loaded fp32 model; ``score_sequence`` is the per-sequence unit (used by resumable runs)."""

    model_dir: Path
    model: Any
    vocab_size: int
    model_hash: str
    threads: int

    @classmethod
    def load(cls, model_dir: str | os.PathLike, threads: int = 2) -> "HFOracle":
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        d = Path(model_dir)
        if not (d / "config.json").is_file():
            raise OracleError(f"{d}: not an HF model directory (no config.json)")
        digest = model_hash(d)
        try:
            cfg = AutoConfig.from_pretrained(d, local_files_only=True)
            with _deterministic(threads):
                model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True,
                                                                   output_loading_info=True)
        except Exception as exc:  # truncated/corrupt weights, unreadable config, shape mismatch
            raise OracleError(f"{d}: cannot load the model: {type(exc).__name__}: {str(exc)[:500]}") from exc
        # transformers fills a missing tensor with random values and ignores an extra one (a warning only):
        # an oracle must refuse both
        wrong = {k: sorted(info.get(k) or ())[:5] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(wrong.values()):
            raise OracleError(f"{d}: weights do not match the configuration: "
                              + "; ".join(f"{k.split('_')[0]} {v}" for k, v in wrong.items() if v))
        model.eval()
        bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
        if bad:
            raise OracleError(f"{d}: parameters not float32 after loading: {bad[:3]}")
        vocab = int(model.get_output_embeddings().weight.shape[0])
        if getattr(cfg, "vocab_size", vocab) != vocab:
            raise OracleError(f"{d}: config vocab_size {cfg.vocab_size} != output embedding rows {vocab}")
        return cls(d, model, vocab, digest, threads)

    def logits(self, token_ids: Sequence[int], seq_id: str = "adhoc"):
        import torch

        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise OracleError(f"sequence {seq_id!r}: needs a non-empty 1-D token-id sequence")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            p = int(bad[0])
            raise OracleError(f"sequence {seq_id!r} position {p}: id {int(ids[p])} outside vocabulary {self.vocab_size}")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and ids.size > limit:
            raise OracleError(f"sequence {seq_id!r}: {ids.size} tokens exceed max_position_embeddings {limit}")
        with _deterministic(self.threads):
            out = self.model(input_ids=torch.from_numpy(ids)[None, :], use_cache=False)
            logits = out.logits[0].to(torch.float32)
        if not torch.isfinite(logits).all():
            row = int(torch.nonzero(~torch.isfinite(logits).all(dim=1))[0, 0])
            raise OracleError(f"sequence {seq_id!r} position {row + 1}: non-finite logits")
        return logits

    def score_sequence(self, seq: _EncodedSequence, top_k: int = 256, full_vocab: bool = False) -> SequenceScores:
        ids = np.asarray(seq.token_ids, dtype=np.int64)
        mask = np.asarray(seq.scored_mask, dtype=bool)
        if mask.shape != ids.shape:
            raise OracleError(f"sequence {seq.seq_id!r}: scored_mask has {mask.size} entries for {ids.size} ids")
        if mask.size and mask[0]:
            raise OracleError(f"sequence {seq.seq_id!r} position 0: position 0 cannot be scored")
        positions = np.flatnonzero(mask)
        logits = self.logits(ids, seq.seq_id)
        # logits[i] predicts token i+1, so position p reads row p-1
        import torch
        rows = logits[torch.from_numpy(positions - 1)] if positions.size else logits[:0]
        st = stats_from_logits(rows, ids[positions], top_k, full_vocab)
        return SequenceScores(seq.seq_id, seq.domain, ids, mask, st.topk_ids, st.topk_logprobs, st.actual_logprob,
                              st.actual_rank, logsumexp=st.logsumexp, full_logprobs=st.full_logprobs)


# ---------------------------------------------------------------------------------------------- checkpoints
def _ckpt_path(ckpt_dir: Path, panel_hash: str, mhash: str, seq_id: str, top_k: int, full_vocab: bool) -> Path:
    key = hashlib.sha256(f"{panel_hash}\0{mhash}\0{seq_id}\0{top_k}\0{int(full_vocab)}".encode()).hexdigest()[:32]
    return ckpt_dir / f"{key}.safetensors"


def _save_ckpt(path: Path, s: SequenceScores) -> None:
    from safetensors.numpy import save_file

    tensors = {"token_ids": s.token_ids, "scored": s.scored, "topk_ids": s.topk_ids, "topk_logprobs": s.topk_logprobs,
               "actual_logprob": s.actual_logprob, "actual_rank": s.actual_rank, "logsumexp": s.logsumexp}
    if s.full_logprobs is not None:
        tensors["full_logprobs"] = s.full_logprobs
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata={"seq_id": s.seq_id, "domain": s.domain})
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _load_ckpt(path: Path, seq: _EncodedSequence) -> SequenceScores | None:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        arr = load_file(str(path))
        if meta.get("seq_id") != seq.seq_id or not np.array_equal(arr["token_ids"], np.asarray(seq.token_ids, np.int64)) \
                or not np.array_equal(arr["scored"], np.asarray(seq.scored_mask, bool)):
            return None  # stale checkpoint (different tokens): recompute
        return SequenceScores(seq.seq_id, seq.domain, arr["token_ids"], arr["scored"], arr["topk_ids"],
                              arr["topk_logprobs"], arr["actual_logprob"], arr["actual_rank"],
                              logsumexp=arr["logsumexp"], full_logprobs=arr.get("full_logprobs"))
    except Exception:  # truncated / corrupt (a crash, a full disk): a checkpoint is only a cache, recompute
        return None


# ---------------------------------------------------------------------------------------------- entry point
def score_panel_hf(model_dir: str | os.PathLike, encoded_panel: _EncodedPanel, top_k: int = 256,
                   full_vocab: bool = False, *, threads: int = 2, checkpoint_dir: str | os.PathLike | None = None,
                   oracle: HFOracle | None = None, progress: bool = False) -> Record:
    """Score ``encoded_panel`` with the fp32 transformers model in ``model_dir`` → oracle ``Record``."""
    seqs = list(encoded_panel.sequences)
    if not seqs:
        raise OracleError(f"panel {encoded_panel.panel_name!r} has no sequences")
    t0 = time.perf_counter()
    orc = oracle if oracle is not None else HFOracle.load(model_dir, threads=threads)
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt is not None:
        ckpt.mkdir(parents=True, exist_ok=True)
    scores: list[SequenceScores] = []
    resumed = 0
    for n, seq in enumerate(seqs):
        path = _ckpt_path(ckpt, encoded_panel.panel_hash, orc.model_hash, seq.seq_id, top_k, full_vocab) if ckpt else None
        s = _load_ckpt(path, seq) if path is not None else None
        if s is None:
            s = orc.score_sequence(seq, top_k, full_vocab)
            if path is not None:
                _save_ckpt(path, s)
        else:
            resumed += 1
        scores.append(s)
        if progress:
            print(f"[oracle.hf] {n + 1}/{len(seqs)} {seq.seq_id}", flush=True)
    import torch
    import transformers

    prov = Provenance(
        side="oracle",
        panel_name=encoded_panel.panel_name,
        panel_version=str(encoded_panel.panel_version),
        panel_hash=encoded_panel.panel_hash,
        tokenizer_hash=encoded_panel.tokenizer_hash,
        source={"model_dir": str(Path(model_dir).resolve()), "model_hash": orc.model_hash,
                "weight_files": [f.name for f in weight_files(orc.model_dir)]},
        precision="fp32",
        code_version=code_version(),
        created=Provenance.now(),
        extra={"oracle": "oracle.hf", "top_k": top_k, "log_softmax_dtype": "float64", "threads": orc.threads,
               "torch": torch.__version__, "transformers": transformers.__version__,
               "deterministic_algorithms": True, "resumed_sequences": resumed,
               "seconds": round(time.perf_counter() - t0, 3)},
    )
    return Record.from_sequences(prov, scores, k=top_k)

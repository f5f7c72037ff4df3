"""Generic fp32 CPU oracle for HF-format causal LMs (transformers).

``HFPanelOracle(model_dir).score(encoded_panel)`` (the oracle seam, oracle/seam.py; ``score_panel_hf`` is
the same as a function) loads the directory with ``dtype=torch.float32`` (a DeepSeek-V4 folder in the release
layout through oracle/hf_dsv4.py's explicit mapping into ``DeepseekV4ForCausalLM``), runs one forward pass per
:class:`EncodedSequence` (the token ids exactly as encoded, no BOS added), and turns the logits into the
shared record format (side ``oracle``) with oracle/scoring.py: per scored position the top-K ids and
logprobs (default K = 256) of the float64 ``log_softmax``, the actual token's logprob and rank, the
logsumexp, and optionally the full-vocabulary logprobs in float32.

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

from core.atomic import atomic_path
from core.records import Record, SequenceScores
from oracle.scoring import OracleError, oracle_provenance, sequence_scores
from panels.model import EncodedPanel, EncodedSequence

__all__ = ["HFOracle", "HFPanelOracle", "OracleError", "model_hash", "score_panel_hf", "weight_files"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


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
    load_info: dict | None = None  # how the weights were mapped (oracle/hf_dsv4.py), for the provenance

    @classmethod
    def load(cls, model_dir: str | os.PathLike, threads: int = 2) -> "HFOracle":
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        d = Path(model_dir)
        if not (d / "config.json").is_file():
            raise OracleError(f"{d}: not an HF model directory (no config.json)")
        digest = model_hash(d)
        from oracle.hf_dsv4 import is_official_v4, load_official_v4

        if is_official_v4(d):  # DeepSeek's release layout: mapped explicitly, FP8 / MXFP4 decoded exactly
            model, _, report = load_official_v4(d, threads)
            vocab = int(model.get_output_embeddings().weight.shape[0])
            return cls(d, model, vocab, digest, threads, {"layout": "deepseek-v4-official", **report.as_dict()})
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

    def score_sequence(self, seq: EncodedSequence, top_k: int = 256, full_vocab: bool = False) -> SequenceScores:
        ids = np.asarray(seq.token_ids, dtype=np.int64)
        mask = np.asarray(seq.scored_mask, dtype=bool)
        if mask.shape != ids.shape:
            raise OracleError(f"sequence {seq.seq_id!r}: scored_mask has {mask.size} entries for {ids.size} ids")
        if mask.size and mask[0]:
            raise OracleError(f"sequence {seq.seq_id!r} position 0: position 0 cannot be scored")
        return sequence_scores(seq, self.logits(ids, seq.seq_id), top_k, full_vocab)


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
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"seq_id": s.seq_id, "domain": s.domain})


def _load_ckpt(path: Path, seq: EncodedSequence) -> SequenceScores | None:
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
@dataclass
class HFPanelOracle:
    """The transformers oracle behind the oracle seam (oracle.seam.Oracle): `score(panel) -> Record`."""

    model_dir: Path
    top_k: int = 256
    full_vocab: bool = False
    threads: int = 2
    checkpoint_dir: Path | None = None
    oracle: HFOracle | None = None
    progress: bool = False

    def score(self, panel: EncodedPanel) -> Record:
        """Score `panel` with the fp32 transformers model in `model_dir` -> oracle `Record`."""
        seqs = list(panel.sequences)
        if not seqs:
            raise OracleError(f"panel {panel.panel_name!r} has no sequences")
        t0 = time.perf_counter()
        orc = self.oracle if self.oracle is not None else HFOracle.load(self.model_dir, threads=self.threads)
        ckpt = Path(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        if ckpt is not None:
            ckpt.mkdir(parents=True, exist_ok=True)
        scores: list[SequenceScores] = []
        resumed = 0
        for n, seq in enumerate(seqs):
            path = _ckpt_path(ckpt, panel.panel_hash, orc.model_hash, seq.seq_id, self.top_k,
                              self.full_vocab) if ckpt else None
            s = _load_ckpt(path, seq) if path is not None else None
            if s is None:
                s = orc.score_sequence(seq, self.top_k, self.full_vocab)
                if path is not None:
                    _save_ckpt(path, s)
            else:
                resumed += 1
            scores.append(s)
            if self.progress:
                print(f"[oracle.hf] {n + 1}/{len(seqs)} {seq.seq_id}", flush=True)
        import torch
        import transformers

        prov = oracle_provenance(
            panel, precision="fp32", vocab_size=int(orc.vocab_size),
            source={"model_dir": str(Path(self.model_dir).resolve()), "model_hash": orc.model_hash,
                    "weight_files": [f.name for f in weight_files(orc.model_dir)]},
            extra={"oracle": "oracle.hf", "top_k": self.top_k, "log_softmax_dtype": "float64",
                   "threads": orc.threads, "torch": torch.__version__, "transformers": transformers.__version__,
                   "deterministic_algorithms": True, "resumed_sequences": resumed,
                   **({"load": orc.load_info} if orc.load_info else {}),
                   "seconds": round(time.perf_counter() - t0, 3)})
        return Record.from_sequences(prov, scores, k=self.top_k)


def score_panel_hf(model_dir: str | os.PathLike, encoded_panel: EncodedPanel, top_k: int = 256,
                   full_vocab: bool = False, *, threads: int = 2, checkpoint_dir: str | os.PathLike | None = None,
                   oracle: HFOracle | None = None, progress: bool = False) -> Record:
    """Score ``encoded_panel`` with the fp32 transformers model in ``model_dir`` → oracle ``Record``."""
    return HFPanelOracle(Path(model_dir), top_k, full_vocab, threads,
                         Path(checkpoint_dir) if checkpoint_dir is not None else None, oracle,
                         progress).score(encoded_panel)

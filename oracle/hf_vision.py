"""fp32 transformers oracle for image prompts (Idefics3 folders: ``Idefics3ForConditionalGeneration``, the
tiny VLM of engine/vlm.py).

    orc = HFVisionOracle.load(model_dir)
    record = orc.score(encoded_image_panel, image_panel)      # the record seam: side "oracle", top-K per position
    feats = orc.image_features(pixel_values, mask)            # the rows that enter the LLM (gate 1)

The images go through the folder's own image processor (transformers' Idefics3 processor, PIL backend:
resize, rescale, normalise, pad), or one with ``processor_overrides`` (``{"image_mean": ..., "resample": ...}``): the
can-fail checks build a deliberately wrong oracle that way. The token ids are the panel's, with each image's
span already laid out (panels/images.py); the model places the image rows at the ``image_token_id``
positions in order, which this oracle checks against the spans before the forward pass.

Everything after the fp32 logits is oracle/scoring.py's (float64 log_softmax, top-K, rank, logsumexp), so an
image record is scored exactly like a text record. Deterministic: ``torch.use_deterministic_algorithms`` and a
fixed thread count (oracle/hf.py's context).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from core.records import Record, SequenceScores
from oracle.hf import _deterministic, model_hash, weight_files
from oracle.scoring import OracleError, oracle_provenance, sequence_scores
from panels.images import PanelImage
from panels.model import EncodedPanel, ImageSpanRef, Panel


@dataclass
class HFVisionOracle:
    model_dir: Path
    model: Any
    image_processor: Any
    image_token_id: int
    vocab_size: int
    model_hash: str
    threads: int = 2
    processor_overrides: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, model_dir: str | os.PathLike, threads: int = 2,
             processor_overrides: Mapping[str, Any] | None = None) -> "HFVisionOracle":
        import torch
        from transformers import AutoImageProcessor, Idefics3ForConditionalGeneration

        d = Path(model_dir)
        if not (d / "config.json").is_file():
            raise OracleError(f"{d}: not an HF model directory (no config.json)")
        try:
            with _deterministic(threads):
                model, info = Idefics3ForConditionalGeneration.from_pretrained(
                    d, dtype=torch.float32, local_files_only=True, output_loading_info=True)
            improc = AutoImageProcessor.from_pretrained(d, local_files_only=True, **dict(processor_overrides or {}))
        except Exception as exc:  # corrupt weights, a config transformers cannot read
            raise OracleError(f"{d}: cannot load the vision-language model: {type(exc).__name__}: "
                              f"{str(exc)[:500]}") from exc
        wrong = {k: sorted(info.get(k) or ())[:5] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(wrong.values()):
            raise OracleError(f"{d}: weights do not match the configuration: {wrong}")
        model.eval()
        bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
        if bad:
            raise OracleError(f"{d}: parameters not float32 after loading: {bad[:3]}")
        vocab = int(model.get_output_embeddings().weight.shape[0])
        return cls(d, model, improc, int(model.config.image_token_id), vocab, model_hash(d), threads,
                   dict(processor_overrides or {}))

    # ------------------------------------------------------------------------------------------ images
    def pixel_values(self, images: Sequence[PanelImage]):
        """(pixel values [1, n, 3, H, W] fp32, pixel attention mask [1, n, H, W]) from the image processor (the
        folder's, or the overridden one), one image at a time (no image splitting: one tile an image)."""
        import torch

        pv, masks = [], []
        for im in images:
            out = self.image_processor([[im.pil()]], return_tensors="pt")
            pv.append(out["pixel_values"].to(torch.float32))
            masks.append(out["pixel_attention_mask"])
        return torch.cat(pv, dim=1), torch.cat(masks, dim=1)

    def image_features(self, pixel_values, pixel_attention_mask, dtype=None):
        """The rows that enter the LLM, per image [n, tokens, d] fp32: the vision tower's last hidden state
        through the connector (pixel shuffle + projection), computed in `dtype` (default fp32): the tower
        gate's oracle (fp32) and its noise floor (bf16 weights and activations)."""
        import copy

        import torch

        inner = self.model.model
        if dtype is not None and dtype != torch.float32:
            inner = copy.deepcopy(inner).to(dtype)
        with _deterministic(self.threads):
            out = inner.get_image_features(pixel_values=pixel_values.to(inner.dtype),
                                           pixel_attention_mask=pixel_attention_mask)
        rows = torch.cat(list(out.pooler_output)).to(torch.float32)   # one tensor per prompt: its images' rows
        return rows.view(pixel_values.shape[1], -1, rows.shape[-1])

    # ------------------------------------------------------------------------------------------ text
    def logits(self, ids: Sequence[int], spans: Sequence[ImageSpanRef], images: Mapping[str, PanelImage],
               seq_id: str = "adhoc"):
        import torch

        arr = np.asarray(ids, dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise OracleError(f"sequence {seq_id!r}: needs a non-empty 1-D token-id sequence")
        bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
        if bad.size:
            raise OracleError(f"sequence {seq_id!r} position {int(bad[0])}: id {int(arr[bad[0]])} outside the "
                              f"vocabulary {self.vocab_size}")
        inside = np.zeros(arr.size, dtype=bool)
        for s in spans:
            if s.start < 0 or s.end > arr.size or not (arr[s.start:s.end] == self.image_token_id).any():
                raise OracleError(f"sequence {seq_id!r}: image span {s.start}..{s.end - 1} ({s.file}) holds no "
                                  f"image token {self.image_token_id} or runs outside the {arr.size} ids")
            inside[s.start:s.end] = True
        stray = np.flatnonzero((arr == self.image_token_id) & ~inside)
        if stray.size:
            raise OracleError(f"sequence {seq_id!r} position {int(stray[0])}: image token {self.image_token_id} "
                              "outside every image span")
        kwargs: dict[str, Any] = {"input_ids": torch.from_numpy(arr)[None, :], "use_cache": False}
        if spans:
            kwargs["pixel_values"], kwargs["pixel_attention_mask"] = self.pixel_values([images[s.file] for s in spans])
        with _deterministic(self.threads):
            try:
                out = self.model(**kwargs)
            except (ValueError, RuntimeError) as exc:  # transformers' own image-token / feature count checks
                raise OracleError(f"sequence {seq_id!r}: the model refused the prompt: {exc}") from exc
            logits = out.logits[0].to(torch.float32)
        if not torch.isfinite(logits).all():
            row = int(torch.nonzero(~torch.isfinite(logits).all(dim=1))[0, 0])
            raise OracleError(f"sequence {seq_id!r} position {row + 1}: non-finite logits")
        return logits

    def greedy(self, ids: Sequence[int], spans: Sequence[ImageSpanRef], images: Mapping[str, PanelImage],
               max_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation by repeated full forward passes (no cache: the same fp32 ops as scoring)."""
        seq = [int(t) for t in ids]
        out: list[int] = []
        for _ in range(max_tokens):
            nxt = int(self.logits(seq, spans, images)[-1].argmax())
            out.append(nxt)
            if nxt in stop_ids:
                break
            seq.append(nxt)
        return out

    def score(self, enc: EncodedPanel, panel: Panel, top_k: int = 256, full_vocab: bool = False) -> Record:
        """Every scored position of every sequence, as an oracle record (the record seam)."""
        if enc.panel_hash != panel.content_hash:
            raise OracleError(f"encoded panel {enc.panel_name} hash {enc.panel_hash} is not "
                              f"panel {panel.ref}'s {panel.content_hash}")
        t0 = time.perf_counter()
        scores: list[SequenceScores] = []
        for seq in enc.sequences:
            logits = self.logits(seq.token_ids, seq.spans, panel.images, seq.seq_id)
            scores.append(sequence_scores(seq, logits, top_k, full_vocab))
        import torch
        import transformers

        prov = oracle_provenance(
            enc, precision="fp32", vocab_size=self.vocab_size,
            source={"model_dir": str(self.model_dir.resolve()), "model_hash": self.model_hash,
                    "weight_files": [f.name for f in weight_files(self.model_dir)]},
            extra={"oracle": "oracle.hf_vision", "top_k": top_k, "log_softmax_dtype": "float64",
                   "threads": self.threads, "torch": torch.__version__, "transformers": transformers.__version__,
                   "image_layout": enc.layout, "processor_overrides": dict(self.processor_overrides),
                   "images": {f: im.pixels_sha256 for f, im in panel.images.items()},
                   "seconds": round(time.perf_counter() - t0, 3)})
        return Record.from_sequences(prov, scores, k=top_k)

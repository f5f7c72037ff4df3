"""Panels that arrive already encoded: the sequences an existing record scored, or a JSON file of token ids.

`encoded_from_record(record)` gives back exactly the ids and scored masks a record (oracle or engine) was
computed on, so a second side scores the same tokens; `encoded_from_json(path)` reads a pre-encoded panel.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from core.records import Record
from panels.model import EncodedPanel, EncodedSequence, PanelError


def _sequence(seq_id, domain, ids, mask, where: str) -> EncodedSequence:
    ids = tuple(int(t) for t in ids)
    mask = tuple(bool(m) for m in mask) if mask is not None else (False,) + (True,) * (len(ids) - 1)
    if not ids:
        raise PanelError(f"{where}: sequence {seq_id!r} has no tokens")
    if len(mask) != len(ids):
        raise PanelError(f"{where}: sequence {seq_id!r} has {len(ids)} ids but {len(mask)} mask entries")
    if mask[0]:
        raise PanelError(f"{where}: sequence {seq_id!r} scores position 0, which has no distribution")
    return EncodedSequence(str(seq_id), str(domain), ids, mask)


def _panel_version(v):
    """Versions are integers for published panels; a record stores them as text."""
    return int(v) if str(v).isdigit() else v


def encoded_from_record(record: Record, where: str = "record") -> EncodedPanel:
    """The sequences (ids, scored masks, seq ids, domains) and panel identity `record` was computed on."""
    seqs = tuple(_sequence(sid, dom, record.sequence_tokens(i),
                           record.scored[record.seq_offsets[i]:record.seq_offsets[i + 1]], where)
                 for i, (sid, dom) in enumerate(zip(record.seq_ids, record.domains)))
    p = record.provenance
    return EncodedPanel(p.panel_name, _panel_version(p.panel_version), p.panel_hash, p.tokenizer_hash, seqs)


def sequences_hash(seqs) -> str:
    """sha256 over (seq_id, domain, token ids, scored mask) of every sequence, in order."""
    body = [[s.seq_id, s.domain, list(s.token_ids), [int(m) for m in s.scored_mask]] for s in seqs]
    return "sha256:" + hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()


def encoded_from_json(path: str | os.PathLike) -> EncodedPanel:
    """A pre-encoded panel: a JSON list of token-id lists, or {"panel_name", "panel_version", "panel_hash",
    "tokenizer_hash", "sequences": [{"seq_id", "domain", "token_ids", "scored_mask"?}]} (all but sequences
    optional). Unscored masks default to every position after the first; the panel hash defaults to
    `sequences_hash` of the sequences."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PanelError(f"{p}: not a readable JSON panel ({e})") from e
    if isinstance(obj, list):
        obj = {"sequences": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("sequences"), list) or not obj["sequences"]:
        raise PanelError(f"{p}: expected a non-empty list of token-id lists or an object with 'sequences'")
    seqs = []
    for i, s in enumerate(obj["sequences"]):
        if isinstance(s, list):
            s = {"token_ids": s}
        if not isinstance(s, dict) or not isinstance(s.get("token_ids"), list) \
                or not all(isinstance(t, int) for t in s["token_ids"]):
            raise PanelError(f"{p}: sequence {i} is not a list of integer token ids")
        seqs.append(_sequence(s.get("seq_id", f"s{i:05d}"), s.get("domain", "pre-encoded"), s["token_ids"],
                              s.get("scored_mask"), str(p)))
    if len({s.seq_id for s in seqs}) != len(seqs):
        raise PanelError(f"{p}: duplicate seq_id")
    return EncodedPanel(str(obj.get("panel_name", p.stem)), str(obj.get("panel_version", "0")),
                        str(obj.get("panel_hash") or sequences_hash(seqs)),
                        str(obj.get("tokenizer_hash", "pre-encoded")), tuple(seqs))

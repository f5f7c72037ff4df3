"""Per-position logprob records: the one on-disk format both the oracle and the engine side write.

Format `ds41-record/1` (docs/DESIGN.md, "The record format"): one safetensors file of flat arrays, with provenance and the
sequence table as JSON in the safetensors metadata. No pickle. Writes are atomic.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np
from safetensors.numpy import load_file, save_file
from safetensors import safe_open

from core.atomic import atomic_path
from core.coverage import MECHANISM_NAMES, CoverageError, check_masks
from core.errors import UserError
from core.redact import redact

FORMAT_VERSION = "ds41-record/1"
CLAMP_LOGPROB = -9999.0  # vLLM clamps -inf to -9999.0 (engines.md §3.3)
LOGPROB_SLACK = 1e-6     # a logprob above this is not log of a probability (float rounding stays below)
# Σ exp(logprob) over a position's top-k and its actual token is a part of one distribution: at most 1. fp32
# logprobs (vLLM, llama.cpp, the oracle) sum to within ~1e-6 of it; past this slack the numbers are not
# probabilities, and every KL computed from them is meaningless (a negative mean KL_part reached a report)
TOPK_MASS_SLACK = 1e-4

Side = Literal["oracle", "engine"]

# the exact dtype of every array (docs/DESIGN.md, "The record format"): float16 logprobs or int32 ids are another
# format, not a variant of this one
DTYPES = {name: np.dtype(t) for name, t in (
    ("seq_offsets", np.int64), ("token_ids", np.int64), ("scored", np.bool_), ("pos_seq", np.int64),
    ("pos_index", np.int64), ("topk_ids", np.int64), ("topk_logprobs", np.float64), ("actual_logprob", np.float64),
    ("actual_rank", np.int64), ("logsumexp", np.float64), ("full_logprobs", np.float32), ("ambiguous", np.bool_),
    ("mechanisms", np.int64))}


class RecordError(UserError, ValueError):
    """A record is malformed; the message names the sequence and position."""


class RecordMismatch(RecordError):
    """Two records cannot be compared (panel, tokenizer, format or token ids differ)."""


@dataclass(frozen=True)
class Provenance:
    side: Side
    panel_name: str
    panel_version: str
    panel_hash: str
    tokenizer_hash: str
    source: dict[str, Any] = field(default_factory=dict)
    precision: str = "unknown"
    code_version: str = ""
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "record") -> "Provenance":
        """Parse provenance JSON; a wrong type, a missing or an unknown key is a RecordError naming it."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"{where}: provenance is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise RecordError(f"{where}: provenance must be a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise RecordError(f"{where}: provenance has unknown key(s) {unknown}; allowed: {sorted(fields)}")
        required = [n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise RecordError(f"{where}: provenance lacks key(s) {missing}")
        for name, value in data.items():
            want = dict if name in ("source", "extra") else str
            if not isinstance(value, want):
                raise RecordError(f"{where}: provenance key {name!r} must be a {want.__name__}, "
                                  f"got {type(value).__name__} {value!r:.60}")
        if data["side"] not in ("oracle", "engine"):
            raise RecordError(f"{where}: provenance side {data['side']!r}; allowed: 'oracle', 'engine'")
        return cls(**data)

    @staticmethod
    def now() -> str:
        return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class SequenceScores:
    """One sequence as a writer builds it: per-position arrays hold one row per scored position."""

    seq_id: str
    domain: str
    token_ids: np.ndarray
    scored: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    actual_logprob: np.ndarray
    actual_rank: np.ndarray
    logsumexp: np.ndarray | None = None
    full_logprobs: np.ndarray | None = None
    ambiguous: np.ndarray | None = None
    mechanisms: np.ndarray | None = None   # int64 [scored]: live DeepSeek mechanisms, bits per core.coverage


def _where(seq_id: str, pos: int | None = None) -> str:
    return f"sequence {seq_id!r}" + (f" position {pos}" if pos is not None else "")


def _validate_sequence(s: SequenceScores, k: int) -> None:
    tok = np.asarray(s.token_ids)
    scored = np.asarray(s.scored, dtype=bool)
    if tok.ndim != 1 or scored.shape != tok.shape:
        raise RecordError(f"{_where(s.seq_id)}: token_ids {tok.shape} and scored {scored.shape} lengths differ")
    if tok.size and scored[0]:
        raise RecordError(f"{_where(s.seq_id, 0)}: position 0 has no distribution and cannot be scored")
    positions = np.flatnonzero(scored)
    n = positions.size
    expect = {"topk_ids": (n, k), "topk_logprobs": (n, k), "actual_logprob": (n,), "actual_rank": (n,)}
    for name, shape in expect.items():
        got = np.asarray(getattr(s, name)).shape
        if got != shape:
            raise RecordError(f"{_where(s.seq_id)}: {name} has shape {got}, expected {shape} "
                              f"({n} scored positions, k={k})")
    for name in ("logsumexp", "ambiguous", "mechanisms"):
        arr = getattr(s, name)
        if arr is not None and np.asarray(arr).shape != (n,):
            raise RecordError(f"{_where(s.seq_id)}: {name} has shape {np.asarray(arr).shape}, expected ({n},)")
    if s.full_logprobs is not None and (np.asarray(s.full_logprobs).ndim != 2 or len(s.full_logprobs) != n):
        raise RecordError(f"{_where(s.seq_id)}: full_logprobs must be [scored positions, vocab]")
    actual = np.asarray(s.actual_logprob, dtype=np.float64)
    bad = ~np.isfinite(actual) & ~(actual == -np.inf)
    bad |= actual > 1e-6
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RecordError(f"{_where(s.seq_id, int(positions[i]))}: actual-token logprob {actual[i]!r} is not a valid logprob")
    lp = np.asarray(s.topk_logprobs, dtype=np.float64)
    ids = np.asarray(s.topk_ids)
    bad_lp = np.isnan(lp) | (lp == np.inf) | (lp > 1e-6)
    if bad_lp.any():
        i, j = np.argwhere(bad_lp)[0]
        raise RecordError(f"{_where(s.seq_id, int(positions[i]))}: top-{j + 1} logprob {lp[i, j]!r} is not a valid logprob")
    pad = ids < 0
    if (pad & np.isfinite(lp)).any():
        i, j = np.argwhere(pad & np.isfinite(lp))[0]
        raise RecordError(f"{_where(s.seq_id, int(positions[i]))}: padded top-k slot {j} carries a finite logprob")
    if k > 1:
        finite = np.where(pad, -np.inf, lp)
        rising = np.diff(finite, axis=1) > 1e-9
        if rising.any():
            i, j = np.argwhere(rising)[0]
            raise RecordError(f"{_where(s.seq_id, int(positions[i]))}: top-k logprobs are not in rank order at slot {j + 1}")
        dup = np.sort(np.where(pad, -1 - np.arange(k), ids), axis=1)
        if (np.diff(dup, axis=1) == 0).any():
            i = int(np.argwhere(np.diff(dup, axis=1) == 0)[0][0])
            raise RecordError(f"{_where(s.seq_id, int(positions[i]))}: duplicate id in top-k")
    excess = topk_mass_excess(ids, lp, tok[positions], actual)
    if excess is not None:
        i, mass = excess
        raise RecordError(f"{_where(s.seq_id, int(positions[i]))}: {_mass_message(mass)}")


def topk_mass_excess(topk_ids: np.ndarray, topk_logprobs: np.ndarray, actual_ids: np.ndarray,
                     actual_logprob: np.ndarray) -> tuple[int, float] | None:
    """(row, mass) of the first position whose probability mass — Σ exp over its top-k (padding left out) and
    its actual token when that is not among them — exceeds 1 + TOPK_MASS_SLACK; None when every row is a part
    of a distribution. Ids are assumed distinct within a row (checked separately)."""
    ids, actual = np.asarray(topk_ids), np.asarray(actual_ids)
    for lo in range(0, len(ids), 8192):      # in row blocks: a k=256 reference stays a few MiB of temporaries
        rows = slice(lo, lo + 8192)
        with np.errstate(over="ignore", invalid="ignore"):
            block = np.asarray(topk_logprobs[rows], dtype=np.float64)
            mass = np.where(ids[rows] >= 0, np.exp(block), 0.0).sum(axis=1)
            outside = ~(ids[rows] == actual[rows, None]).any(axis=1)
            mass += np.where(outside, np.exp(np.asarray(actual_logprob[rows], dtype=np.float64)), 0.0)
        over = mass > 1.0 + TOPK_MASS_SLACK
        if over.any():
            i = int(np.flatnonzero(over)[0])
            return lo + i, float(mass[i])
    return None


def _mass_message(mass: float) -> str:
    return (f"top-k probability mass {mass:.6g} > 1 (Σ exp(logprob) over the top-k and the actual token; slack "
            f"{TOPK_MASS_SLACK:g}): these logprobs are not one distribution")


def _side(rec: "Record") -> str:
    return "reference" if rec.provenance.side == "oracle" else rec.provenance.side


def _content_sha256(arrays: dict[str, np.ndarray], seq_ids: list, domains: list, k: int,
                    mechanism_names: list[str] | None = None) -> str:
    """sha256 over every array (name, dtype, shape, bytes) and the sequence table: a flipped byte in a
    logprob is otherwise a valid, different number. The mechanism names join only when present, so a record
    without them keeps the hash it always had."""
    h = hashlib.sha256(json.dumps([seq_ids, domains, k]).encode())
    if mechanism_names is not None:
        h.update(("mechanism_names|" + json.dumps(list(mechanism_names))).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{list(a.shape)}|".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


@dataclass
class Record:
    """Columnar record of many sequences; see docs/DESIGN.md for every array's meaning."""

    provenance: Provenance
    k: int
    seq_ids: list[str]
    domains: list[str]
    seq_offsets: np.ndarray
    token_ids: np.ndarray
    scored: np.ndarray
    pos_seq: np.ndarray
    pos_index: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    actual_logprob: np.ndarray
    actual_rank: np.ndarray
    logsumexp: np.ndarray | None = None
    full_logprobs: np.ndarray | None = None
    ambiguous: np.ndarray | None = None
    mechanisms: np.ndarray | None = None          # int64 [P] bitmask of live mechanisms (core/coverage.py)
    mechanism_names: list[str] | None = None      # the name of each bit of `mechanisms`, bit 0 first

    # ------------------------------------------------------------------ building
    @classmethod
    def from_sequences(cls, provenance: Provenance, sequences: Iterable[SequenceScores], k: int | None = None,
                       mechanism_names: list[str] | None = None) -> "Record":
        seqs = list(sequences)
        if not seqs:
            raise RecordError("a record needs at least one sequence")
        if k is None:
            k = int(np.asarray(seqs[0].topk_ids).shape[1])
        ids_seen: set[str] = set()
        for s in seqs:
            if s.seq_id in ids_seen:
                raise RecordError(f"{_where(s.seq_id)}: duplicate sequence id")
            ids_seen.add(s.seq_id)
            _validate_sequence(s, k)

        def opt(name: str, dtype) -> np.ndarray | None:
            present = [getattr(s, name) is not None for s in seqs]
            if not any(present):
                return None
            if not all(present):
                raise RecordError(f"{name} is given for some sequences but not all")
            return np.concatenate([np.asarray(getattr(s, name), dtype=dtype) for s in seqs])

        lengths = [len(s.token_ids) for s in seqs]
        scored = np.concatenate([np.asarray(s.scored, dtype=bool) for s in seqs])
        pos_seq = np.concatenate([np.full(int(np.sum(s.scored)), i, dtype=np.int64) for i, s in enumerate(seqs)])
        pos_index = np.concatenate([np.flatnonzero(np.asarray(s.scored, dtype=bool)).astype(np.int64) for s in seqs])
        lp = np.concatenate([np.asarray(s.topk_logprobs, dtype=np.float64) for s in seqs])
        lp = np.where(lp <= CLAMP_LOGPROB, -np.inf, lp)
        actual = np.concatenate([np.asarray(s.actual_logprob, dtype=np.float64) for s in seqs])
        actual = np.where(actual <= CLAMP_LOGPROB, -np.inf, actual)
        return cls(
            provenance=provenance,
            k=k,
            seq_ids=[s.seq_id for s in seqs],
            domains=[s.domain for s in seqs],
            seq_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            token_ids=np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in seqs]),
            scored=scored,
            pos_seq=pos_seq,
            pos_index=pos_index,
            topk_ids=np.concatenate([np.asarray(s.topk_ids, dtype=np.int64).reshape(-1, k) for s in seqs]),
            topk_logprobs=lp.reshape(-1, k),
            actual_logprob=actual,
            actual_rank=np.concatenate([np.asarray(s.actual_rank, dtype=np.int64) for s in seqs]),
            logsumexp=opt("logsumexp", np.float64),
            full_logprobs=opt("full_logprobs", np.float32),
            ambiguous=opt("ambiguous", bool),
            mechanisms=(mech := opt("mechanisms", np.int64)),
            mechanism_names=None if mech is None else list(mechanism_names or MECHANISM_NAMES),
        )

    # ------------------------------------------------------------------ views
    @property
    def n_sequences(self) -> int:
        return len(self.seq_ids)

    @property
    def n_positions(self) -> int:
        return int(self.pos_seq.shape[0])

    def sequence_tokens(self, i: int) -> np.ndarray:
        return self.token_ids[self.seq_offsets[i]:self.seq_offsets[i + 1]]

    def actual_ids(self) -> np.ndarray:
        """The actual token id at every scored position."""
        return self.token_ids[self.seq_offsets[self.pos_seq] + self.pos_index]

    def position_domains(self) -> np.ndarray:
        return np.asarray(self.domains, dtype=object)[self.pos_seq]

    def to_frame(self):
        import pandas as pd

        frame = pd.DataFrame({
            "seq_id": np.asarray(self.seq_ids, dtype=object)[self.pos_seq],
            "domain": self.position_domains(),
            "position": self.pos_index,
            "actual_id": self.actual_ids(),
            "actual_logprob": self.actual_logprob,
            "actual_rank": self.actual_rank,
        })
        frame["topk_ids"] = list(self.topk_ids)
        frame["topk_logprobs"] = list(self.topk_logprobs)
        if self.logsumexp is not None:
            frame["logsumexp"] = self.logsumexp
        if self.ambiguous is not None:
            frame["ambiguous"] = self.ambiguous
        return frame

    def subset(self, seq_ids: Iterable[str]) -> "Record":
        """The same record restricted to `seq_ids` (kept in this record's order)."""
        wanted = set(seq_ids)
        unknown = sorted(wanted - set(self.seq_ids))
        if unknown:
            raise RecordError(f"subset names sequences this record lacks: {unknown[:5]}")
        keep = [i for i, sid in enumerate(self.seq_ids) if sid in wanted]
        tok_mask = np.zeros(self.token_ids.size, dtype=bool)
        for i in keep:
            tok_mask[self.seq_offsets[i]:self.seq_offsets[i + 1]] = True
        pos_mask = np.isin(self.pos_seq, keep)
        remap = np.full(self.n_sequences, -1, dtype=np.int64)
        remap[keep] = np.arange(len(keep))
        lengths = np.diff(self.seq_offsets)[keep]

        def pick(arr):
            return None if arr is None else arr[pos_mask]

        return Record(
            provenance=self.provenance, k=self.k,
            seq_ids=[self.seq_ids[i] for i in keep], domains=[self.domains[i] for i in keep],
            seq_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            token_ids=self.token_ids[tok_mask], scored=self.scored[tok_mask],
            pos_seq=remap[self.pos_seq[pos_mask]], pos_index=self.pos_index[pos_mask],
            topk_ids=self.topk_ids[pos_mask], topk_logprobs=self.topk_logprobs[pos_mask],
            actual_logprob=self.actual_logprob[pos_mask], actual_rank=self.actual_rank[pos_mask],
            logsumexp=pick(self.logsumexp), full_logprobs=pick(self.full_logprobs), ambiguous=pick(self.ambiguous),
            mechanisms=pick(self.mechanisms), mechanism_names=self.mechanism_names,
        )

    # ------------------------------------------------------------------ checks
    def check_compatible(self, other: "Record") -> None:
        """Refuse a comparison whose two sides did not score the same tokens of the same panel."""
        a, b = self.provenance, other.provenance
        problems = []
        if a.panel_name != b.panel_name or a.panel_version != b.panel_version:
            problems.append(f"panel {a.panel_name}@{a.panel_version} vs {b.panel_name}@{b.panel_version}")
        if a.panel_hash != b.panel_hash:
            problems.append(f"panel hash {a.panel_hash[:16]} vs {b.panel_hash[:16]}")
        if a.tokenizer_hash != b.tokenizer_hash:
            problems.append(f"tokenizer hash {a.tokenizer_hash[:16]} vs {b.tokenizer_hash[:16]}")
        va, vb = self.vocab_size(), other.vocab_size()
        if va is not None and vb is not None and va != vb:
            problems.append(f"vocabulary sizes differ ({_side(self)} {va} vs {_side(other)} {vb})")
        if problems:
            raise RecordMismatch("records are not comparable: " + "; ".join(problems))
        if va is not None or vb is not None:   # the known vocabulary bounds every id of both sides
            owner = self if va is not None else other
            for rec in (self, other):
                rec.check_ids_in_vocabulary(va if va is not None else vb, f"the {_side(owner)}'s", f"{_side(rec)} record")
        if self.seq_ids != other.seq_ids:
            missing = sorted(set(self.seq_ids) ^ set(other.seq_ids))[:5]
            raise RecordMismatch(f"records hold different sequences (first differing ids: {missing})")
        for i, sid in enumerate(self.seq_ids):
            x, y = self.sequence_tokens(i), other.sequence_tokens(i)
            if x.shape != y.shape:
                raise RecordMismatch(f"{_where(sid)}: lengths differ ({x.size} vs {y.size} tokens)")
            diff = np.flatnonzero(x != y)
            if diff.size:
                p = int(diff[0])
                raise RecordMismatch(f"{_where(sid, p)}: token ids differ ({int(x[p])} vs {int(y[p])})")
        if not np.array_equal(self.scored, other.scored):
            p = int(np.flatnonzero(self.scored != other.scored)[0])
            s = int(np.searchsorted(self.seq_offsets, p, side="right") - 1)
            raise RecordMismatch(f"{_where(self.seq_ids[s], p - int(self.seq_offsets[s]))}: scored masks differ")

    # ------------------------------------------------------------------ IO
    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "seq_offsets": self.seq_offsets, "token_ids": self.token_ids, "scored": self.scored,
            "pos_seq": self.pos_seq, "pos_index": self.pos_index, "topk_ids": self.topk_ids,
            "topk_logprobs": self.topk_logprobs, "actual_logprob": self.actual_logprob,
            "actual_rank": self.actual_rank,
        }
        for name in ("logsumexp", "full_logprobs", "ambiguous", "mechanisms"):
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
        self._check_mechanisms(path)
        meta = {
            "content_sha256": _content_sha256(tensors, self.seq_ids, self.domains, self.k, self.mechanism_names),
            "format": FORMAT_VERSION,
            "provenance": redact(self.provenance.to_json()),   # an engine URL may carry user:password@
            "seq_ids": json.dumps(self.seq_ids),
            "domains": json.dumps(self.domains),
            "k": str(self.k),
        }
        if self.mechanism_names is not None:
            meta["mechanism_names"] = json.dumps(list(self.mechanism_names))
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, trust_unhashed: bool = False) -> "Record":
        """Read and check a record. A record without ``content_sha256`` (written before records were hashed, or
        by another tool) is refused unless ``trust_unhashed`` — the caller vouches for the file; a stored hash
        is always checked. ``ds41gate rehash PATH`` writes the hash into a trusted old record."""
        path = Path(path)
        if not path.is_file():
            raise RecordError(f"{path}: no such record file")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
            arrays = load_file(str(path))
        except Exception as exc:  # safetensors raises several types for truncated/corrupt files
            raise RecordError(f"{path}: not a readable record file ({exc})") from exc
        fmt = meta.get("format")
        if fmt != FORMAT_VERSION:
            raise RecordMismatch(f"{path}: record format {fmt!r}, this harness reads {FORMAT_VERSION!r}")
        required = ["seq_offsets", "token_ids", "scored", "pos_seq", "pos_index", "topk_ids",
                    "topk_logprobs", "actual_logprob", "actual_rank"]
        missing = [n for n in required if n not in arrays]
        if missing:
            raise RecordError(f"{path}: record lacks arrays {missing}")
        missing_meta = [n for n in ("provenance", "seq_ids", "domains", "k") if n not in meta]
        if missing_meta:
            raise RecordError(f"{path}: record metadata lacks {missing_meta}")
        try:
            k = int(meta["k"])
            seq_ids = json.loads(meta["seq_ids"])
            domains = json.loads(meta["domains"])
        except ValueError as exc:
            raise RecordError(f"{path}: record metadata k / seq_ids / domains unreadable ({exc})") from None
        for name, value in (("seq_ids", seq_ids), ("domains", domains)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise RecordError(f"{path}: record metadata {name} must be a list of strings")
        if k < 1:
            raise RecordError(f"{path}: record metadata k={k}; must be at least 1")
        mechanism_names = None
        if "mechanism_names" in meta:
            try:
                mechanism_names = json.loads(meta["mechanism_names"])
            except ValueError as exc:
                raise RecordError(f"{path}: record metadata mechanism_names unreadable ({exc})") from None
            if not isinstance(mechanism_names, list) or not all(isinstance(v, str) for v in mechanism_names):
                raise RecordError(f"{path}: record metadata mechanism_names must be a list of strings")
        stored = meta.get("content_sha256")
        if stored is None and not trust_unhashed:
            raise RecordError(f"{path}: record has no content_sha256 (written before records were hashed, or by "
                              "another tool), so an edit of it would go unnoticed; if you trust this file, re-hash "
                              f"it: ds41gate rehash {path} (in code: Record.load(path, "
                              "trust_unhashed=True))")
        if stored is not None and stored != _content_sha256(arrays, seq_ids, domains, k, mechanism_names):
            raise RecordError(f"{path}: the record's arrays, ids or domains do not match its content_sha256 "
                              "(the file was corrupted or edited after it was written)")
        rec = cls(
            provenance=Provenance.from_json(meta["provenance"], where=str(path)),
            k=k,
            seq_ids=seq_ids,
            domains=domains,
            logsumexp=arrays.get("logsumexp"),
            full_logprobs=arrays.get("full_logprobs"),
            ambiguous=arrays.get("ambiguous"),
            mechanisms=arrays.get("mechanisms"),
            mechanism_names=mechanism_names,
            **{n: arrays[n] for n in required},
        )
        rec._check_consistent(path)
        return rec

    def _check_consistent(self, where: Path | str = "record") -> None:
        for name, want in DTYPES.items():
            arr = getattr(self, name)
            if arr is not None and (not isinstance(arr, np.ndarray) or arr.dtype != want):
                got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
                raise RecordError(f"{where}: array {name} has dtype {got}, expected {want.name} "
                                  f"(format {FORMAT_VERSION})")
        n_seq = len(self.seq_ids)
        p = self.n_positions
        if self.seq_offsets.shape != (n_seq + 1,) or int(self.seq_offsets[-1]) != self.token_ids.size:
            raise RecordError(f"{where}: sequence table does not match the token array")
        if self.scored.shape != self.token_ids.shape or int(self.scored.sum()) != p:
            raise RecordError(f"{where}: scored mask does not match {p} scored positions")
        for name in ("pos_index", "actual_logprob", "actual_rank"):
            if getattr(self, name).shape != (p,):
                raise RecordError(f"{where}: {name} has {getattr(self, name).shape[0]} rows, expected {p}")
        if self.topk_ids.shape != (p, self.k) or self.topk_logprobs.shape != (p, self.k):
            raise RecordError(f"{where}: top-k arrays are not [{p}, {self.k}]")
        if self.pos_seq.shape != (p,):
            raise RecordError(f"{where}: pos_seq has shape {self.pos_seq.shape}, expected ({p},)")
        for name in ("logsumexp", "ambiguous", "mechanisms"):
            arr = getattr(self, name)
            if arr is not None and arr.shape != (p,):
                raise RecordError(f"{where}: {name} has shape {arr.shape}, expected ({p},)")
        self._check_mechanisms(where)
        if self.full_logprobs is not None and (self.full_logprobs.ndim != 2 or len(self.full_logprobs) != p):
            raise RecordError(f"{where}: full_logprobs must be [{p} scored positions, vocab]")
        if len(self.domains) != n_seq or len(set(self.seq_ids)) != n_seq:
            raise RecordError(f"{where}: {n_seq} sequence ids (unique: {len(set(self.seq_ids))}) "
                              f"and {len(self.domains)} domains")
        self._check_values(where)

    def _check_mechanisms(self, where: Path | str) -> None:
        """The mechanism masks and their names come together, and every set bit is named."""
        if (self.mechanisms is None) != (self.mechanism_names is None):
            has, lacks = ("mechanisms", "mechanism_names") if self.mechanism_names is None else (
                "mechanism_names", "mechanisms")
            raise RecordError(f"{where}: record has {has} but no {lacks} (they come together)")
        if self.mechanisms is not None:
            try:
                check_masks(self.mechanisms, self.mechanism_names, "mechanisms")
            except CoverageError as exc:
                raise RecordError(f"{where}: {exc}") from None

    def vocab_size(self) -> int | None:
        """The vocabulary size when the record knows it (full logprobs, or `vocab_size` in provenance); a
        `vocab_size` that is not a positive int, or sources that disagree, are a RecordError."""
        sizes: dict[str, int] = {}
        if self.full_logprobs is not None:
            sizes["full_logprobs"] = int(self.full_logprobs.shape[1])
        for name, table in (("provenance extra", self.provenance.extra), ("provenance source", self.provenance.source)):
            if "vocab_size" in table:
                v = table["vocab_size"]
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise RecordError(f"{name} vocab_size {v!r:.40} is not a positive integer")
                sizes[name] = v
        if len(set(sizes.values())) > 1:
            raise RecordError(f"the record's vocabulary sizes disagree: {sizes}")
        return next(iter(sizes.values()), None)

    def check_ids_in_vocabulary(self, vocab: int, whose: str, where: str = "record") -> None:
        """Every token id and top-k id of this record lies in [0, vocab) (top-k padding -1 aside)."""
        if self.token_ids.size and (self.token_ids.max() >= vocab or self.token_ids.min() < 0):
            i = int(np.flatnonzero((self.token_ids >= vocab) | (self.token_ids < 0))[0])
            s = int(np.searchsorted(self.seq_offsets, i, side="right") - 1)
            raise RecordError(f"{where}: {_where(self.seq_ids[s], i - int(self.seq_offsets[s]))}: token id "
                              f"{int(self.token_ids[i])} is outside {whose} vocabulary (size {vocab})")
        if self.n_positions and (self.topk_ids.max() >= vocab or self.topk_ids.min() < -1):
            i, j = (int(x) for x in np.argwhere((self.topk_ids >= vocab) | (self.topk_ids < -1))[0])
            raise RecordError(f"{where}: {_where(self.seq_ids[int(self.pos_seq[i])], int(self.pos_index[i]))}: "
                              f"top-k id {int(self.topk_ids[i, j])} is outside {whose} vocabulary (size {vocab})")

    def _check_values(self, where: Path | str) -> None:
        """What `_validate_sequence` checks when a record is built, re-checked on the loaded arrays: a
        file edited or written by another tool must not reach the metrics as a silent number."""
        offsets = self.seq_offsets
        if np.any(np.diff(offsets) < 0) or int(offsets[0]) != 0:
            raise RecordError(f"{where}: sequence offsets are not increasing from 0")
        lengths = np.diff(offsets)
        p = self.n_positions
        if p and (self.pos_seq.min() < 0 or self.pos_seq.max() >= len(self.seq_ids)):
            raise RecordError(f"{where}: pos_seq holds a sequence index outside [0, {len(self.seq_ids)})")
        if p and np.any(np.diff(self.pos_seq) < 0):
            raise RecordError(f"{where}: positions are not grouped by sequence in order")

        def at(i: int) -> str:
            s = int(self.pos_seq[i])
            return f"{where}: {_where(self.seq_ids[s], int(self.pos_index[i]))}"

        if p:
            bad = (self.pos_index < 1) | (self.pos_index >= lengths[self.pos_seq])
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                s = int(self.pos_seq[i])
                raise RecordError(f"{where}: {_where(self.seq_ids[s])}: position index {int(self.pos_index[i])} "
                                  f"outside [1, {int(lengths[s]) - 1}] (the sequence has {int(lengths[s])} tokens)")
            flat = offsets[self.pos_seq] + self.pos_index
            if not self.scored[flat].all() or (p > 1 and np.any(np.diff(flat) <= 0)):
                raise RecordError(f"{where}: position indices do not match the scored mask")
        for s in np.flatnonzero(lengths > 0):
            if self.scored[offsets[s]]:
                raise RecordError(f"{where}: {_where(self.seq_ids[s], 0)}: position 0 has no distribution "
                                  "and cannot be scored")
        if self.token_ids.size and self.token_ids.min() < 0:
            i = int(np.flatnonzero(self.token_ids < 0)[0])
            raise RecordError(f"{where}: token id {int(self.token_ids[i])} at flat index {i} is negative")
        try:
            vocab = self.vocab_size()
        except RecordError as exc:
            raise RecordError(f"{where}: {exc}") from None
        if vocab is not None:
            if self.token_ids.size and self.token_ids.max() >= vocab:
                raise RecordError(f"{where}: token id {int(self.token_ids.max())} is outside the vocabulary "
                                  f"(size {vocab})")
            if p and self.topk_ids.max() >= vocab:
                i = int(np.argwhere(self.topk_ids >= vocab)[0][0])
                raise RecordError(f"{at(i)}: top-k id {int(self.topk_ids[i].max())} is outside the vocabulary "
                                  f"(size {vocab})")
        if not p:
            return
        actual = self.actual_logprob.astype(np.float64)
        bad = np.isnan(actual) | (actual == np.inf) | (actual > LOGPROB_SLACK)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise RecordError(f"{at(i)}: actual-token logprob {float(actual[i])!r} is not a valid logprob (must be <= 0)")
        lp = self.topk_logprobs.astype(np.float64)
        ids = self.topk_ids
        bad = np.isnan(lp) | (lp == np.inf) | (lp > LOGPROB_SLACK)
        if bad.any():
            i, j = (int(x) for x in np.argwhere(bad)[0])
            raise RecordError(f"{at(i)}: top-{j + 1} logprob {float(lp[i, j])!r} is not a valid logprob (must be <= 0)")
        pad = ids < 0
        if np.any(ids < -1):
            i, j = (int(x) for x in np.argwhere(ids < -1)[0])
            raise RecordError(f"{at(i)}: top-{j + 1} id {int(ids[i, j])} is negative (only -1 marks padding)")
        if (pad & np.isfinite(lp)).any():
            i, j = (int(x) for x in np.argwhere(pad & np.isfinite(lp))[0])
            raise RecordError(f"{at(i)}: padded top-k slot {j} carries a finite logprob")
        if self.k > 1:
            rising = np.diff(np.where(pad, -np.inf, lp), axis=1) > 1e-9
            if rising.any():
                i, j = (int(x) for x in np.argwhere(rising)[0])
                raise RecordError(f"{at(i)}: top-k logprobs are not in rank order at slot {j + 1}")
            keyed = np.sort(np.where(pad, -1 - np.arange(self.k), ids), axis=1)
            dup = np.diff(keyed, axis=1) == 0
            if dup.any():
                i = int(np.argwhere(dup)[0][0])
                raise RecordError(f"{at(i)}: duplicate id in top-k")
        excess = topk_mass_excess(ids, lp, self.actual_ids(), actual)
        if excess is not None:
            i, mass = excess
            raise RecordError(f"{at(i)}: {_mass_message(mass)}")
        if np.any(self.actual_rank < 1):
            i = int(np.flatnonzero(self.actual_rank < 1)[0])
            raise RecordError(f"{at(i)}: actual-token rank {int(self.actual_rank[i])}; ranks start at 1")
        if self.logsumexp is not None and np.isnan(self.logsumexp).any():
            i = int(np.flatnonzero(np.isnan(self.logsumexp))[0])
            raise RecordError(f"{at(i)}: logsumexp is NaN")


# ---------------------------------------------------------------------------------------------- rehash
def rehash(path: str | os.PathLike) -> str:
    """Write ``content_sha256`` into a trusted record that has none (written before records were hashed): every
    other check still runs, a record that has a hash is only checked, never re-hashed. Returns the hash."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            stored = (f.metadata() or {}).get("content_sha256")
    except Exception as exc:  # safetensors raises several types for truncated/corrupt files
        raise RecordError(f"{path}: not a readable record file ({exc})") from None
    rec = Record.load(path, trust_unhashed=True)
    if stored is not None:
        return stored
    rec.save(path)
    with safe_open(str(path), framework="numpy") as f:
        return f.metadata()["content_sha256"]

"""Mechanism coverage: which DeepSeek attention mechanisms were live at each scored position (issue 39).

A gate can only vouch for what it reached. The oracle states, per scored position, which mechanisms were live
there as an int64 bitmask (the record's optional `mechanisms` array, its bit names in the record metadata); this
module names the mechanisms, encodes and decodes the masks, and summarises them into a typed `Coverage` — per
mechanism, how many scored positions had it live, per depth bucket (core/depth.py). A flag whose mechanism no
scored position reached is "not exercised", never PASS (the gates and the flags registry decide that from
`Coverage.exercised`).

Bit i of a mask is MECHANISMS[i]; a record carries the names in its own order, so a reader decodes by name
(`decode_names`), never by a position it assumes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from core.depth import BUCKET_LABELS, bucket_members
from core.errors import UserError


class Mechanism(str, enum.Enum):
    """A DeepSeek attention mechanism a scored position may have reached."""

    WINDOW_FULL_EVICTING = "window_full_evicting"   # the sliding window holds `window` keys and has dropped older ones
    COMPRESSED_R4 = "compressed_r4"                 # a ratio-4 compressor has emitted at least one entry visible here
    COMPRESSED_R128 = "compressed_r128"             # a ratio-128 compressor (HCA) has emitted at least one entry
    INDEXER_PRUNING = "indexer_pruning"             # the indexer's candidates exceed index_topk: it dropped some
    DSPARK_TAPS = "dspark_taps"                     # DSpark taps were read at this position (V4.1)
    ENGRAM_LOOKUP = "engram_lookup"                 # an Engram table lookup fed this position (V4.1)


MECHANISMS: tuple[Mechanism, ...] = tuple(Mechanism)
MECHANISM_NAMES: tuple[str, ...] = tuple(m.value for m in MECHANISMS)
# the mechanisms only a long prompt reaches (the 29-51-token dsv4-ci panel reaches none of them; ratio-4 entries,
# DSpark taps and Engram lookups are live from the first few tokens): a flag touching one is A/B'd at depth
DEPTH_MECHANISMS: frozenset[str] = frozenset({Mechanism.WINDOW_FULL_EVICTING.value, Mechanism.COMPRESSED_R128.value,
                                              Mechanism.INDEXER_PRUNING.value})
MASK_DTYPE = np.dtype(np.int64)


class CoverageError(UserError, ValueError):
    """A mechanism name, mask or coverage table that does not fit the encoding; the message names it."""


def bit(mechanism: Mechanism | str) -> int:
    """The mask bit of one mechanism (in this module's order)."""
    return 1 << MECHANISMS.index(Mechanism(mechanism))


def encode(mechanisms: Iterable[Mechanism | str]) -> int:
    """The bitmask of a set of mechanisms; an unknown name is a CoverageError naming it."""
    mask = 0
    for m in mechanisms:
        try:
            mask |= bit(m)
        except ValueError:
            raise CoverageError(f"unknown mechanism {m!r}; known: {list(MECHANISM_NAMES)}") from None
    return mask


def decode(mask: int, names: Sequence[str] = MECHANISM_NAMES) -> frozenset[Mechanism]:
    """The mechanisms of one mask whose bits are named by `names` (a record's own order)."""
    check_names(names)
    mask = int(mask)
    if mask < 0 or mask >> len(names):
        raise CoverageError(f"mask {mask} sets bits outside the {len(names)} named mechanisms {list(names)}")
    return frozenset(Mechanism(n) for i, n in enumerate(names) if mask >> i & 1)


def check_names(names: Sequence[str], where: str = "mechanism names") -> None:
    """Names must be known mechanisms, each once."""
    unknown = [n for n in names if n not in MECHANISM_NAMES]
    if unknown:
        raise CoverageError(f"{where}: unknown mechanism(s) {unknown}; known: {list(MECHANISM_NAMES)}")
    if len(set(names)) != len(names):
        raise CoverageError(f"{where}: a mechanism is named twice in {list(names)}")


def check_masks(masks: np.ndarray, names: Sequence[str], where: str = "mechanisms") -> None:
    """Masks are int64, non-negative and set only bits that `names` names."""
    check_names(names, where)
    masks = np.asarray(masks)
    if masks.dtype != MASK_DTYPE:
        raise CoverageError(f"{where}: masks have dtype {masks.dtype}, expected int64")
    if masks.size:
        bad = (masks < 0) | (masks >> len(names) != 0)
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(-1))[0])
            raise CoverageError(f"{where}: mask {int(masks.reshape(-1)[i])} at row {i} sets bits outside the "
                                f"{len(names)} named mechanisms {list(names)}")


def live(masks: np.ndarray, mechanism: Mechanism | str, names: Sequence[str] = MECHANISM_NAMES) -> np.ndarray:
    """bool [P]: where `mechanism` is live, reading masks whose bits are named by `names`."""
    name = Mechanism(mechanism).value
    if name not in names:   # a record that does not name a mechanism never saw it live
        return np.zeros(np.shape(masks), dtype=bool)
    return (np.asarray(masks, dtype=np.int64) >> list(names).index(name) & 1).astype(bool)


@dataclass(frozen=True)
class Coverage:
    """How many scored positions had each mechanism live, per bucket (core.depth.BUCKET_LABELS).

    `scored[b]` is the number of scored positions in bucket b; `live[m][b]` how many of them had mechanism m live.
    Totals count each position once (the `last256` overlay is not added again).
    """

    scored: Mapping[str, int]
    live: Mapping[str, Mapping[str, int]]
    total_scored: int
    total_live: Mapping[str, int]

    def exercised(self, mechanism: Mechanism | str) -> bool:
        """At least one scored position had this mechanism live."""
        return self.total_live.get(Mechanism(mechanism).value, 0) > 0

    def exercised_all(self, mechanisms: Iterable[Mechanism | str]) -> bool:
        return all(self.exercised(m) for m in mechanisms)

    def not_exercised(self, mechanisms: Iterable[Mechanism | str]) -> list[str]:
        """The names among `mechanisms` that no scored position reached."""
        return [Mechanism(m).value for m in mechanisms if not self.exercised(m)]

    def to_dict(self) -> dict[str, Any]:
        return {"scored": dict(self.scored), "live": {m: dict(b) for m, b in self.live.items()},
                "total_scored": self.total_scored, "total_live": dict(self.total_live)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "coverage") -> "Coverage":
        """Read `to_dict`'s shape back; a missing or unknown key, a wrong type or an unknown bucket or
        mechanism is a CoverageError naming it."""
        if not isinstance(data, dict) or set(data) != {"scored", "live", "total_scored", "total_live"}:
            raise CoverageError(f"{where}: expected keys scored, live, total_scored, total_live; got "
                                f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")

        def counts(table: Any, keys: Sequence[str], what: str) -> dict[str, int]:
            if not isinstance(table, dict):
                raise CoverageError(f"{where}: {what} must be an object, got {type(table).__name__}")
            for k, v in table.items():
                if k not in keys:
                    raise CoverageError(f"{where}: {what} has unknown key {k!r}; known: {list(keys)}")
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise CoverageError(f"{where}: {what}[{k!r}] = {v!r} is not a count")
            return dict(table)

        total = data["total_scored"]
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise CoverageError(f"{where}: total_scored = {total!r} is not a count")
        live_raw = data["live"]
        if not isinstance(live_raw, dict):
            raise CoverageError(f"{where}: live must be an object")
        live_tables = {}
        for m, table in live_raw.items():
            if m not in MECHANISM_NAMES:
                raise CoverageError(f"{where}: live names unknown mechanism {m!r}")
            live_tables[m] = counts(table, BUCKET_LABELS, f"live[{m!r}]")
        return cls(scored=counts(data["scored"], BUCKET_LABELS, "scored"), live=live_tables, total_scored=total,
                   total_live=counts(data["total_live"], MECHANISM_NAMES, "total_live"))


def coverage_of(masks: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray,
                names: Sequence[str] = MECHANISM_NAMES) -> Coverage:
    """Summarise per-scored-position masks: `positions[i]` is position i's index in its sequence and
    `seq_lens[i]` that sequence's length (for the last-256 overlay); `names` names the masks' bits."""
    masks = np.asarray(masks)
    positions = np.asarray(positions, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if not masks.shape == positions.shape == seq_lens.shape or masks.ndim != 1:
        raise CoverageError(f"masks {masks.shape}, positions {positions.shape} and sequence lengths "
                            f"{seq_lens.shape} must be one row per scored position")
    check_masks(masks, names)
    members = bucket_members(positions, seq_lens)
    scored = {b: int(members[b].sum()) for b in BUCKET_LABELS}
    live_tables: dict[str, dict[str, int]] = {}
    total_live: dict[str, int] = {}
    for m in MECHANISMS:
        on = live(masks, m, names)
        live_tables[m.value] = {b: int((on & members[b]).sum()) for b in BUCKET_LABELS}
        total_live[m.value] = int(on.sum())
    return Coverage(scored=scored, live=live_tables, total_scored=int(positions.size), total_live=total_live)


def coverage_of_record(record: Any) -> Coverage | None:
    """The coverage of a core.records.Record that carries `mechanisms` (None when it does not)."""
    if getattr(record, "mechanisms", None) is None:
        return None
    lengths = np.diff(record.seq_offsets)[record.pos_seq]
    return coverage_of(record.mechanisms, record.pos_index, lengths, record.mechanism_names)

"""A gate run's results: the one typed contract between the gates that write results.json and the floors that read it.

Format `ds41-results/1` (docs/DESIGN.md, "The results format"), in the spirit of `ds41-record/1` (core/records.py):
small frozen dataclasses, written as JSON with a format tag, read back through the same types. A file without the tag
(written before results were typed) or with another tag is refused with a one-line error naming the file and what
it found; so is a renamed key, an unknown key, or a value of the wrong type. The nightly (nightly/) and the reports
read attributes of these types, never string paths into a dict, so a renamed field is an AttributeError in a test,
not a silently empty history.

What is typed is what other floors consume: every gate's verdict (`GateEntry`: passed / failures / headline
numbers), the flag A/B verdicts per flag and gate (`FlagABResult`, `FlagGateVerdict`), the outcome of each gate
test node (`GateOutcome`), the wall times (`GateTimings`). A gate's wider evidence (`GateEntry.evidence`) and the
report sections (`ReportSection`) are display-only: a person or the report reads them, no code branches on them.

Validation is pydantic's (strict on load: `1` is not `true`, `"0.5"` is not a number); writing is pure
(`with_*` return a new `GateResults`) and `save` is the one IO: redacted (core/redact.py), atomic (core/atomic.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import ConfigDict, Field, TypeAdapter
from pydantic.dataclasses import dataclass

from core.atomic import atomic_write_text
from core.errors import UserError
from core.redact import redact_data

FORMAT_VERSION = "ds41-results/1"
FILE_NAME = "results.json"

# strict (`"yes"` is not a bool, `"0.5"` not a number) for the gates building records and for `GateResults.load`
# alike; only the sequences are lax, so a gate may hand a list where the record keeps a tuple
_RECORD = ConfigDict(extra="forbid", strict=True)
T = TypeVar("T")
Seq = Annotated[tuple[T, ...], Field(strict=False)]

Outcome = Literal["passed", "failed", "error", "skipped", "xfailed"]
CoverageVerdict = Literal["exercised", "not exercised", "not declared"]
Phase = Literal["setup", "call", "teardown"]
GateState = Literal["passed", "failed", "error", "skipped", "xfailed", "missing"]   # an Outcome, or never ran
Verdict = Literal["PASS", "FAIL", "ERROR", "NOT EXERCISED"]
# a flag A/B gate's test node is named test_<gate>[<flag>] (gates/test_flag_ab.py; tests/reliability checks it)
FLAG_AB_FILE = "test_flag_ab.py"
_FLAG_NODE = re.compile(r"^test_(?P<gate>[a-z_]+)\[(?P<flag>[^\]]+)\]$")


class ResultsError(UserError, ValueError):
    """A results file cannot be read as `ds41-results/1`; the message names the file, the key and what it found."""


def headline(values: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a gate's summary as headline metrics: ints and floats (inf kept: a hard fail is a number
    here), bools, None, text and NaN left out (they are the gate's evidence, not a trend a history can plot)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)}


@dataclass(frozen=True, config=_RECORD)
class GateTally:
    """How one expected gate of an aggregate ended: an outcome, or ``missing`` (expected, never ran)."""

    gate: str
    state: GateState
    why: str = ""


@dataclass(frozen=True, config=_RECORD)
class Aggregate:
    """A verdict over several gates (a flag's, a cell's): see :func:`aggregate`."""

    verdict: Verdict
    gates: Seq[GateTally] = ()

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    def not_passed(self) -> tuple[GateTally, ...]:
        return tuple(t for t in self.gates if t.state != "passed")

    def label(self) -> str:
        """``pass``, or the verdict naming each gate that did not pass and how: ``ERROR (bitwise_greedy: error)``."""
        if self.passed:
            return "pass"
        bad = self.not_passed()
        return f"{self.verdict} ({', '.join(f'{t.gate}: {t.state}' for t in bad)})" if bad else \
            f"{self.verdict} (no gate expected)"


def aggregate(tallies: Sequence[GateTally]) -> Aggregate:
    """The one aggregation rule (issue 35): PASS only when at least one gate is expected and every expected gate
    ran and passed. A failed gate makes it FAIL (a measured failure stands whatever else happened); otherwise an
    errored gate, or passed gates beside skipped / xfailed / missing ones, make it ERROR; when no expected gate
    ran at all (each skipped, xfailed or missing, or none expected) it is NOT EXERCISED. Never PASS over a gate
    that did not run."""
    states = {t.state for t in tallies}
    if not tallies:
        verdict: Verdict = "NOT EXERCISED"
    elif "failed" in states:
        verdict = "FAIL"
    elif states == {"passed"}:
        verdict = "PASS"
    elif states <= {"skipped", "xfailed", "missing"}:
        verdict = "NOT EXERCISED"
    else:
        verdict = "ERROR"
    return Aggregate(verdict, tuple(tallies))


def _union(expected: Sequence[str], recorded) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*expected, *recorded]))


@dataclass(frozen=True, config=_RECORD)
class GateEntry:
    """One gate's verdict. ``passed`` None: the gate did not apply here (``failures`` then say why not). A check
    of the checker (a planted violation, ``*_violation``) passes when it caught the violation."""

    gate: str
    passed: bool | None
    profile: str = ""
    flag: str = ""                     # the engine flag this verdict is about, when it is about one
    failures: Seq[str] = ()
    metrics: dict[str, float] = field(default_factory=dict)    # headline numbers (history, trends, report)
    evidence: dict[str, Any] = field(default_factory=dict)     # display only: rows, cells, sizes, file names


@dataclass(frozen=True, config=_RECORD)
class FlagGateVerdict:
    """One registry gate of one flag's A/B (gates.md §10.6). The three numbers are what the nightly history
    tracks per flag and gate; each is None when the gate does not measure it."""

    gate: str
    passed: bool
    why: str
    provisional: bool = False          # bitwise_greedy on a baseline not deterministic against itself
    ratio: float | None = None         # speed: median tokens/s on / off
    mean_diff: float | None = None     # paired_not_worse: mean per-prompt KL_part on − off
    max_abs_diff: float | None = None  # bitwise gates: largest |Δ logprob|
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, config=_RECORD)
class FlagABResult:
    """One flag's A/B on one profile: its class and kind from the registry, a verdict per gate its class runs."""

    flag: str
    cls: str
    kind: str
    profile: str
    gates: Seq[FlagGateVerdict] = ()

    def passed_all(self, expected: Sequence[str]) -> bool:
        """Every gate of ``expected`` (the registry's for this flag's class) has a passing verdict here; a gate
        without a verdict (errored, skipped, never ran) is not a pass. The whole run's view, node outcomes
        included, is :meth:`GateResults.flag_aggregate`."""
        return aggregate(self.tallies(expected)).passed

    def tallies(self, expected: Sequence[str]) -> tuple[GateTally, ...]:
        """One tally per expected gate (and per recorded gate outside it), from the verdicts alone."""
        recorded = {v.gate: v for v in self.gates}
        return tuple(GateTally(g, ("passed" if recorded[g].passed else "failed") if g in recorded else "missing",
                               recorded[g].why if g in recorded else "no verdict recorded")
                     for g in _union(expected, recorded))

    def with_verdict(self, verdict: FlagGateVerdict) -> FlagABResult:
        kept = tuple(v for v in self.gates if v.gate != verdict.gate)
        return dataclasses.replace(self, gates=(*kept, verdict))


@dataclass(frozen=True, config=_RECORD)
class FlagCoverage:
    """Whether a gate run reached the DeepSeek mechanisms a flag's code runs in (the flags registry's
    ``mechanisms``, core/coverage.py). ``not exercised``: some declared mechanism was live at no scored position of
    the run's references (or no reference said which were live) — never a PASS, whatever the flag's gates said.
    ``not declared``: the registry names no mechanism for the flag, so coverage does not apply to it."""

    flag: str
    verdict: CoverageVerdict
    mechanisms: Seq[str] = ()          # what the registry says the flag touches
    reached: Seq[str] = ()             # those live at one scored position or more
    missing: Seq[str] = ()             # those live at none
    sources: Seq[str] = ()             # the references whose scored positions were counted
    why: str = ""


@dataclass(frozen=True, config=_RECORD)
class GateOutcome:
    """How one gate test node ended. ``error``: the gate or its fixtures raised anything but an assertion (the
    engine died, hung, answered malformed bytes): it neither passed nor failed, and the run is not a pass."""

    nodeid: str
    gate: str
    outcome: Outcome
    phase: Phase
    detail: str | None = None


@dataclass(frozen=True, config=_RECORD)
class GateTimings:
    """Wall seconds per gate test (setup + call + teardown) and per gate file."""

    per_test_s: dict[str, float] = field(default_factory=dict)
    per_gate_file_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, config=_RECORD)
class ReportSection:
    """A table of the session report (title, rows, note): display only, nobody reads it back."""

    title: str
    rows: Seq[dict[str, Any]] = ()
    note: str = ""


def json_object(text: str, refused: str, error: type[Exception]) -> dict:
    """``text`` parsed as a JSON object; else ``error`` as one line, ``<refused>: not JSON (...)`` or ``<refused>:
    found a JSON <type>, not an object`` (the shared first check of every typed file the harness reads back)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise error(f"{refused}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{refused}: found a JSON {type(data).__name__}, not an object")
    return data


@dataclass(frozen=True, config=_RECORD)
class GateResults:
    """A gate run's results.json. Each ``with_*`` returns a new value; an entry keyed like an earlier one
    replaces it: a gate entry by (gate, profile, flag) — the demo gates several profiles in one run —, a flag A/B
    by flag, an outcome by node id, a section by title."""

    format: Literal["ds41-results/1"] = FORMAT_VERSION
    gates: Seq[GateEntry] = ()
    flag_ab: Seq[FlagABResult] = ()
    outcomes: Seq[GateOutcome] = ()
    timings: GateTimings | None = None
    sections: Seq[ReportSection] = ()
    coverage: Seq[FlagCoverage] = ()

    # ------------------------------------------------------------------ reading
    def gate(self, name: str, profile: str | None = None) -> GateEntry | None:
        """The entry of gate ``name`` (of ``profile``, when given; else the first)."""
        return next((g for g in self.gates if g.gate == name and profile in (None, g.profile)), None)

    def flag(self, name: str) -> FlagABResult | None:
        return next((f for f in self.flag_ab if f.flag == name), None)

    def flag_coverage(self, name: str) -> FlagCoverage | None:
        return next((c for c in self.coverage if c.flag == name), None)

    def errored(self) -> list[GateOutcome]:
        return [o for o in self.outcomes if o.outcome == "error"]

    def outcome(self, nodeid: str) -> GateOutcome | None:
        return next((o for o in self.outcomes if o.nodeid == nodeid), None)

    def flags_seen(self) -> tuple[str, ...]:
        """Every flag this run A/B-tested: those with a verdict and those whose gate nodes only errored or
        skipped (a flag whose on-server never started has no verdict, yet it was asked for)."""
        return tuple(dict.fromkeys([*(f.flag for f in self.flag_ab),
                                    *(m["flag"] for _, m in self._flag_nodes())]))

    def flag_aggregate(self, flag: str, expected: Sequence[str]) -> Aggregate:
        """The verdict of one flag over every gate ``expected`` of it (the registry's list for its class, from
        the reader; gates recorded beyond it count too): each gate's verdict where one was recorded, else how its
        test node ended (error, skipped, xfailed), else ``missing``. A node that ended worse than its passing
        verdict (a teardown error) counts as that; the registration check's node counts when it did not pass.
        Pure: one rule for `ds41gate flags`, the nightly, its history and nightly.md."""
        ab = self.flag(flag)
        recorded = {v.gate: v for v in ab.gates} if ab is not None else {}
        nodes = {m["gate"]: o for o, m in self._flag_nodes() if m["flag"] == flag}
        tallies = []
        registered = nodes.get("flag_registered")
        if registered is not None and registered.outcome != "passed":
            tallies.append(GateTally("flag_registered", registered.outcome, registered.detail or ""))
        for gate in _union(expected, recorded):
            node, verdict = nodes.get(gate), recorded.get(gate)
            if node is not None and node.outcome in ("error", "skipped", "xfailed") and (
                    verdict is None or verdict.passed):
                tallies.append(GateTally(gate, node.outcome, node.detail or ""))
            elif verdict is not None:
                tallies.append(GateTally(gate, "passed" if verdict.passed else "failed", verdict.why))
            elif node is not None:
                # the test ended without recording the verdict it exists to record: that verdict is missing
                tallies.append(GateTally(gate, "error" if node.outcome == "passed" else node.outcome,
                                         node.detail or f"test {node.outcome} without recording a verdict"))
            else:
                tallies.append(GateTally(gate, "missing", "never ran: no verdict and no test outcome"))
        verdict = aggregate(tallies)
        coverage = self.flag_coverage(flag)
        if verdict.passed and coverage is not None and coverage.verdict == "not exercised":
            # the coverage rule (core/flag_coverage.py): gates that passed where the flag's code never ran vouch
            # for nothing; a FAIL or an ERROR stands as it is
            return Aggregate("NOT EXERCISED", (*verdict.gates, GateTally("coverage", "missing", coverage.why)))
        return verdict

    def _flag_nodes(self):
        for o in self.outcomes:
            m = _FLAG_NODE.match(o.nodeid.rsplit("::", 1)[-1])
            if m is not None and FLAG_AB_FILE in o.nodeid:
                yield o, m

    # ------------------------------------------------------------------ writing (pure)
    def with_gate(self, entry: GateEntry) -> GateResults:
        return dataclasses.replace(self, gates=_replaced(self.gates, entry, lambda e: (e.gate, e.profile, e.flag)))

    def with_flag_verdict(self, flag: str, cls: str, kind: str, profile: str,
                          verdict: FlagGateVerdict) -> GateResults:
        slot = self.flag(flag) or FlagABResult(flag, cls, kind, profile)
        return dataclasses.replace(self, flag_ab=_replaced(self.flag_ab, slot.with_verdict(verdict), lambda f: f.flag))

    def with_outcome(self, outcome: GateOutcome) -> GateResults:
        return dataclasses.replace(self, outcomes=_replaced(self.outcomes, outcome, lambda o: o.nodeid))

    def with_coverage(self, verdict: FlagCoverage) -> GateResults:
        return dataclasses.replace(self, coverage=_replaced(self.coverage, verdict, lambda c: c.flag))

    def with_timings(self, timings: GateTimings) -> GateResults:
        return dataclasses.replace(self, timings=timings)

    def with_section(self, section: ReportSection) -> GateResults:
        return dataclasses.replace(self, sections=_replaced(self.sections, section, lambda s: s.title))

    # ------------------------------------------------------------------ the file
    def to_json(self) -> str:
        """JSON of these results, every string redacted; values JSON cannot hold (a Path) as their str()."""
        return json.dumps(redact_data(dataclasses.asdict(self)), indent=2, default=str)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (a crash leaves the previous complete file, never half of this one)."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def from_json(cls, text: str, where: str = FILE_NAME) -> GateResults:
        refused = f"{where}: not a {FORMAT_VERSION} results file"
        data = json_object(text, refused, ResultsError)
        if "format" not in data:
            raise ResultsError(f"{refused}: no format tag (found top-level keys {sorted(data)[:8]}), so written "
                               "before results were typed or by another tool (rerun the gates to get one)")
        if data["format"] != FORMAT_VERSION:
            raise ResultsError(f"{where}: results format {data['format']!r:.60}, this harness reads "
                               f"{FORMAT_VERSION!r}")
        try:
            return _ADAPTER.validate_json(text, strict=True)
        except pydantic.ValidationError as exc:
            raise ResultsError(f"{refused}: {_problems(exc)}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> GateResults:
        """Read a results.json (or the results.json of a results folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / FILE_NAME
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ResultsError(f"{path}: no such results file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ResultsError(f"{path}: cannot read the results file ({exc})") from None
        return cls.from_json(text, where=str(path))


_ADAPTER = TypeAdapter(GateResults)


def _replaced(items: tuple, new: Any, key) -> tuple:
    """``items`` with ``new`` in place of the item of the same key (in its place), else appended."""
    k = key(new)
    if any(key(i) == k for i in items):
        return tuple(new if key(i) == k else i for i in items)
    return (*items, new)


def _problems(exc: pydantic.ValidationError, shown: int = 3) -> str:
    """The first problems pydantic found, unknown keys first (a renamed key is an unknown one plus a missing one)."""
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "unexpected_keyword_argument")
    lines = []
    for err in errors[:shown]:
        where = ".".join(str(p) for p in err["loc"]) or "top level"
        if err["type"] == "unexpected_keyword_argument":
            lines.append(f"unknown key {where}")
        elif err["type"] == "missing":
            lines.append(f"missing key {where}")
        else:
            lines.append(f"{where}: {err['msg'].lower()}, found {err['input']!r:.80}")
    more = f" (and {len(errors) - shown} more)" if len(errors) > shown else ""
    return "; ".join(lines) + more

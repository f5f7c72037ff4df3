"""The nightly history database (SQLite, stdlib): runs, cells, gate results, metrics, flag verdicts.

Schema (``SCHEMA_VERSION`` 3; a version-1 or -2 file is migrated in place on open)::

    runs(id, started, finished, config_name, config_path, config_hash, git_commit, host, status, exit_code, out_dir)
    cells(run_id, cell, profile, flags, pytest_exit, duration_s, status, results_dir)
    gate_results(run_id, cell, gate, outcome, duration_s, message, nodeid, phase)  -- one row per gate test node
    metrics(run_id, cell, name, value, per_prompt)                        -- per_prompt: JSON list or NULL
    flag_verdicts(run_id, cell, flag, class, gate, passed, why, outcome)  -- one row per EXPECTED gate of a flag

A gate row is one ``core.results.GateOutcome`` of the cell's typed results.json (the one outcome type: the history
stores it and reads it back as one), keyed by ``gate``, the junit-style id the history has always keyed by
(:func:`history_id`), so a baseline written before the outcomes were typed still compares; ``nodeid`` and ``phase``
are the outcome's own (NULL in rows before version 3). ``outcome``: passed | failed | error | skipped | xfailed
(version 1 could not hold an xfail: junit writes it as a skip). ``flag_verdicts.outcome`` adds ``missing``
(expected by the flag's class, never ran); version-1 rows have none (their ``passed`` is all they say).

``status`` of a run: ``green`` (every gate of every cell passed), ``red`` (failures, no regression against a
baseline) or ``regression``. A cell's status is ``green`` or ``red``: red when a gate failed or errored, pytest
exited non-zero, or a finding against its baseline names it (a gate that passed there and did not pass now), so
a red cell is never the next night's baseline. Writes are one transaction per run.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from core.results import Aggregate, GateOutcome, GateResults, GateTally, aggregate

SCHEMA_VERSION = 3
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    started TEXT NOT NULL, finished TEXT NOT NULL,
    config_name TEXT NOT NULL, config_path TEXT NOT NULL, config_hash TEXT NOT NULL,
    git_commit TEXT NOT NULL, host TEXT NOT NULL,
    status TEXT NOT NULL CHECK(status IN ('green', 'red', 'regression')),
    exit_code INTEGER NOT NULL, out_dir TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cells(
    run_id INTEGER NOT NULL REFERENCES runs(id), cell TEXT NOT NULL, profile TEXT NOT NULL,
    flags TEXT NOT NULL, pytest_exit INTEGER NOT NULL, duration_s REAL NOT NULL,
    status TEXT NOT NULL CHECK(status IN ('green', 'red')), results_dir TEXT NOT NULL,
    PRIMARY KEY(run_id, cell));
CREATE TABLE IF NOT EXISTS gate_results(
    run_id INTEGER NOT NULL REFERENCES runs(id), cell TEXT NOT NULL, gate TEXT NOT NULL,
    outcome TEXT NOT NULL CHECK(outcome IN ('passed', 'failed', 'error', 'skipped', 'xfailed')),
    duration_s REAL NOT NULL, message TEXT NOT NULL,
    nodeid TEXT, phase TEXT CHECK(phase IN ('setup', 'call', 'teardown')), PRIMARY KEY(run_id, cell, gate));
CREATE TABLE IF NOT EXISTS metrics(
    run_id INTEGER NOT NULL REFERENCES runs(id), cell TEXT NOT NULL, name TEXT NOT NULL,
    value REAL, per_prompt TEXT, PRIMARY KEY(run_id, cell, name));
CREATE TABLE IF NOT EXISTS flag_verdicts(
    run_id INTEGER NOT NULL REFERENCES runs(id), cell TEXT NOT NULL, flag TEXT NOT NULL, class TEXT NOT NULL,
    gate TEXT NOT NULL, passed INTEGER NOT NULL, why TEXT NOT NULL,
    outcome TEXT CHECK(outcome IN ('passed', 'failed', 'error', 'skipped', 'xfailed', 'missing')),
    PRIMARY KEY(run_id, cell, flag, gate));
CREATE INDEX IF NOT EXISTS gate_results_cell ON gate_results(cell, gate);
CREATE INDEX IF NOT EXISTS metrics_cell ON metrics(cell, name);
"""


class HistoryError(RuntimeError):
    pass


def history_id(nodeid: str) -> str:
    """A gate node as the history keys it: junit's spelling of the pytest node id (``gates/test_x.py::Cls::test_y[p]``
    → ``gates.test_x.Cls::test_y[p]``), what the history was keyed by when outcomes came from junit, so a baseline of
    that time still compares. Idempotent: an id already spelt so is returned as it is."""
    path, *rest = nodeid.split("::")
    return "::".join([".".join([path.removesuffix(".py").replace("/", "."), *rest[:-1]]), rest[-1]]) if rest else path


def failed(outcome: GateOutcome) -> bool:
    """Whether a gate node ended red by itself (failed, or errored: neither passed nor failed)."""
    return outcome.outcome in ("failed", "error")


@dataclass(frozen=True)
class Metric:
    name: str
    value: float | None
    per_prompt: tuple[float | None, ...] | None = None


@dataclass(frozen=True)
class FlagVerdict:
    """One expected gate of one flag's A/B in one cell: how it ended (``outcome``, core.results.GateState)."""

    flag: str
    cls: str
    gate: str
    passed: bool
    why: str
    outcome: str = ""    # "" only in rows written before schema 2: then ``passed`` is all there is

    @property
    def state(self) -> str:
        return self.outcome or ("passed" if self.passed else "failed")


@dataclass
class CellRecord:
    cell: str
    profile: str
    flags: tuple[str, ...]
    pytest_exit: int
    duration_s: float
    results_dir: str
    gates: list[GateOutcome] = field(default_factory=list)          # the cell's typed outcomes (results.json)
    metrics: list[Metric] = field(default_factory=list)
    flag_verdicts: list[FlagVerdict] = field(default_factory=list)
    red_findings: tuple[str, ...] = ()    # findings against the baseline that make this cell red (the runner's)
    durations: dict[str, float] = field(default_factory=dict)       # wall seconds per gate node id

    @property
    def green(self) -> bool:
        return (self.pytest_exit == 0 and bool(self.gates) and not any(failed(g) for g in self.gates)
                and not self.red_findings and all(a.passed for a in self.flag_aggregates().values()))

    def flag_aggregates(self) -> dict[str, Aggregate]:
        """Each flag's verdict over its stored rows (one per expected gate): the one rule of core.results."""
        return flag_aggregates(self.flag_verdicts)


@dataclass(frozen=True)
class RunInfo:
    id: int
    started: str
    finished: str
    config_name: str
    status: str
    exit_code: int
    git_commit: str
    out_dir: str


def connect(path: str | Path) -> sqlite3.Connection:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=30)
    conn.execute("PRAGMA foreign_keys = ON")
    conn.executescript(SCHEMA)
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if row is None:
        with conn:
            conn.execute("INSERT INTO meta(key, value) VALUES('schema_version', ?)", (str(SCHEMA_VERSION),))
    elif row[0] in ("1", "2"):
        _migrate(conn, int(row[0]))
    elif int(row[0]) != SCHEMA_VERSION:
        conn.close()
        raise HistoryError(f"{path}: history schema version {row[0]}, this harness writes {SCHEMA_VERSION}")
    return conn


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    """An older file made version 3 in one transaction. From 1: gate_results rebuilt (it may hold 'xfailed' now, and
    SQLite changes a CHECK only by rebuilding the table; the rebuilt table has version 3's columns), flag_verdicts
    gains its outcome column (NULL for the old rows). From 2: gate_results gains nodeid and phase (NULL for the old
    rows)."""
    conn.execute("BEGIN")   # explicit: the sqlite3 module opens no transaction before DDL by itself
    try:
        if version == 1:
            conn.execute("ALTER TABLE gate_results RENAME TO gate_results_v1")
            conn.execute("DROP INDEX IF EXISTS gate_results_cell")
            for stmt in SCHEMA.split(";"):
                if "gate_results" in stmt:
                    conn.execute(stmt)
            conn.execute("INSERT INTO gate_results(run_id, cell, gate, outcome, duration_s, message) "
                         "SELECT * FROM gate_results_v1")
            conn.execute("DROP TABLE gate_results_v1")
        else:
            conn.execute("ALTER TABLE gate_results ADD COLUMN nodeid TEXT")
            conn.execute("ALTER TABLE gate_results ADD COLUMN phase TEXT CHECK(phase IN ('setup', 'call', 'teardown'))")
        if "outcome" not in {r[1] for r in conn.execute("PRAGMA table_info(flag_verdicts)")}:
            conn.execute("ALTER TABLE flag_verdicts ADD COLUMN outcome TEXT CHECK(outcome IN ('passed', 'failed', "
                         "'error', 'skipped', 'xfailed', 'missing'))")
        conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
    except BaseException:
        conn.rollback()
        raise
    conn.commit()


def insert_run(db: str | Path, *, started: str, finished: str, config_name: str, config_path: str,
               config_hash: str, git_commit: str, host: str, status: str, exit_code: int, out_dir: str,
               cells: Sequence[CellRecord]) -> int:
    """Append one run with all its cells in one transaction; returns the run id. Every text written goes through
    core.redact (a gate's failure message may quote an engine URL with user:password@ or an echoed key)."""
    from core.redact import known_secrets, redact

    secrets = known_secrets()

    def r(text: str) -> str:
        return redact(text, secrets)

    with closing(connect(db)) as conn, conn:
        cur = conn.execute(
            "INSERT INTO runs(started, finished, config_name, config_path, config_hash, git_commit, host, status,"
            " exit_code, out_dir) VALUES(?,?,?,?,?,?,?,?,?,?)",
            (started, finished, r(config_name), r(config_path), config_hash, r(git_commit), r(host), status, exit_code,
             r(out_dir)))
        run_id = int(cur.lastrowid)
        for c in cells:
            conn.execute("INSERT INTO cells VALUES(?,?,?,?,?,?,?,?)",
                         (run_id, r(c.cell), r(c.profile), r(json.dumps(list(c.flags))), c.pytest_exit, c.duration_s,
                          "green" if c.green else "red", r(c.results_dir)))
            conn.executemany("INSERT OR REPLACE INTO gate_results VALUES(?,?,?,?,?,?,?,?)",
                             [(run_id, r(c.cell), r(history_id(g.nodeid)), g.outcome, c.durations.get(g.nodeid, 0.0),
                               r(g.detail or ""), r(g.nodeid), g.phase) for g in c.gates])
            conn.executemany("INSERT OR REPLACE INTO metrics VALUES(?,?,?,?,?)",
                             [(run_id, r(c.cell), r(m.name), m.value,
                               None if m.per_prompt is None else json.dumps(list(m.per_prompt))) for m in c.metrics])
            conn.executemany("INSERT OR REPLACE INTO flag_verdicts VALUES(?,?,?,?,?,?,?,?)",
                             [(run_id, r(c.cell), r(v.flag), v.cls, r(v.gate), int(v.state == "passed"), r(v.why),
                               v.state) for v in c.flag_verdicts])
        return run_id


def runs(db: str | Path, limit: int | None = None) -> list[RunInfo]:
    with closing(connect(db)) as conn:
        q = "SELECT id, started, finished, config_name, status, exit_code, git_commit, out_dir FROM runs ORDER BY id DESC"
        rows = conn.execute(q + (f" LIMIT {int(limit)}" if limit else "")).fetchall()
    return [RunInfo(*r) for r in rows]


def load_cell(db: str | Path, run_id: int, cell: str) -> CellRecord | None:
    with closing(connect(db)) as conn:
        row = conn.execute("SELECT cell, profile, flags, pytest_exit, duration_s, results_dir FROM cells "
                           "WHERE run_id=? AND cell=?", (run_id, cell)).fetchone()
        if row is None:
            return None
        rec = CellRecord(row[0], row[1], tuple(json.loads(row[2])), row[3], row[4], row[5])
        for gate, outcome, duration_s, message, nodeid, phase in conn.execute(
                "SELECT gate, outcome, duration_s, message, nodeid, phase FROM gate_results WHERE run_id=? AND cell=? "
                "ORDER BY gate", (run_id, cell)):
            # a row before version 3 kept neither the node id nor the phase: its history id stands for the node
            # (history_id of it is itself), and "call" for the phase, which nothing compares
            nodeid = nodeid or gate
            rec.gates.append(GateOutcome(nodeid, nodeid.rsplit("::", 1)[-1], outcome, phase or "call", message or None))
            rec.durations[nodeid] = duration_s
        rec.metrics = [Metric(n, v, None if pp is None else tuple(json.loads(pp))) for n, v, pp in conn.execute(
            "SELECT name, value, per_prompt FROM metrics WHERE run_id=? AND cell=? ORDER BY name", (run_id, cell))]
        rec.flag_verdicts = [FlagVerdict(f, c, g, bool(p), w, o or "") for f, c, g, p, w, o in conn.execute(
            "SELECT flag, class, gate, passed, why, outcome FROM flag_verdicts WHERE run_id=? AND cell=? "
            "ORDER BY flag, gate", (run_id, cell))]
        return rec


def last_green_cell(db: str | Path, cell: str, before_run: int | None = None) -> tuple[int, CellRecord] | None:
    """The newest earlier run in which this cell was green: the baseline of the comparison."""
    with closing(connect(db)) as conn:
        q = "SELECT run_id FROM cells WHERE cell=? AND status='green'"
        args: list[Any] = [cell]
        if before_run is not None:
            q += " AND run_id < ?"
            args.append(before_run)
        row = conn.execute(q + " ORDER BY run_id DESC LIMIT 1", args).fetchone()
    if row is None:
        return None
    rec = load_cell(db, int(row[0]), cell)
    return (int(row[0]), rec) if rec is not None else None


def metric_series(db: str | Path, name: str | None = None) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(cell, metric) → [(run_id, value), ...] in run order."""
    with closing(connect(db)) as conn:
        q = "SELECT cell, name, run_id, value FROM metrics WHERE value IS NOT NULL"
        args: tuple = ()
        if name:
            q += " AND name=?"
            args = (name,)
        out: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for cell, n, run_id, value in conn.execute(q + " ORDER BY run_id", args):
            out.setdefault((cell, n), []).append((int(run_id), float(value)))
    return out


def gate_series(db: str | Path) -> list[tuple[int, str, int, int]]:
    """(run_id, status, gates passed, gates failed) per run."""
    with closing(connect(db)) as conn:
        rows = conn.execute(
            "SELECT r.id, r.status, SUM(g.outcome='passed'), SUM(g.outcome IN ('failed','error')) FROM runs r "
            "LEFT JOIN gate_results g ON g.run_id=r.id GROUP BY r.id ORDER BY r.id").fetchall()
    return [(int(a), s, int(p or 0), int(f or 0)) for a, s, p, f in rows]


def latest_flag_verdicts(db: str | Path, expected: Mapping[str, Sequence[str]] | None = None
                         ) -> dict[str, dict[str, Any]]:
    """flag → {run_id, cell, class, started, verdict, passed, gates: {gate: {outcome, why}}} of the newest run that
    tested it. ``expected`` (flag → the gates its class runs, from the reader's registry) adds the gates that
    left no row as ``missing``: the verdict is core.results.aggregate over every expected gate, never ``all()``
    over the rows that happen to be there."""
    expected = expected or {}
    rows_of: dict[str, list[FlagVerdict]] = {}
    out: dict[str, dict[str, Any]] = {}
    with closing(connect(db)) as conn:
        rows = conn.execute("SELECT v.run_id, v.cell, v.flag, v.class, v.gate, v.passed, v.why, v.outcome, r.started "
                            "FROM flag_verdicts v JOIN runs r ON r.id=v.run_id ORDER BY v.run_id DESC").fetchall()
    for run_id, cell, flag, cls, gate, passed, why, outcome, started in rows:
        slot = out.get(flag)
        if slot is None:
            slot = out[flag] = {"run_id": run_id, "cell": cell, "class": cls, "started": started}
        if slot["run_id"] != run_id or slot["cell"] != cell:
            continue
        rows_of.setdefault(flag, []).append(FlagVerdict(flag, cls, gate, bool(passed), why, outcome or ""))
    for flag, slot in out.items():
        agg = aggregate_rows(rows_of[flag], expected.get(flag, ()))
        slot.update(aggregate_dict(agg))
    return out


def aggregate_rows(rows: Sequence[FlagVerdict], expected: Sequence[str] = ()) -> Aggregate:
    """One flag's stored rows (and the gates ``expected`` of it that left none, as missing) under the one rule."""
    have = {v.gate for v in rows}
    return aggregate([*(GateTally(v.gate, v.state, v.why) for v in rows),  # type: ignore[arg-type]
                      *(GateTally(g, "missing", "no row in the history") for g in expected if g not in have)])


def flag_aggregates(rows: Sequence[FlagVerdict]) -> dict[str, Aggregate]:
    by: dict[str, list[FlagVerdict]] = {}
    for v in rows:
        by.setdefault(v.flag, []).append(v)
    return {flag: aggregate_rows(vs) for flag, vs in by.items()}


def aggregate_dict(agg: Aggregate) -> dict[str, Any]:
    """An aggregate as the flags CLI and nightly.json print it."""
    return {"verdict": agg.verdict, "passed": agg.passed, "label": agg.label(),
            "gates": {t.gate: {"outcome": t.state, "why": t.why} for t in agg.gates}}


def flag_verdicts_from_results(results: GateResults | None, cell: str = "",
                               expected: Mapping[str, tuple[str, Sequence[str]]] | None = None) -> list[FlagVerdict]:
    """One FlagVerdict row per expected gate of every flag the run tested or was asked to (pure). ``expected``:
    flag → (class, the gates its class runs), from the registry of the run (the nightly's cell flags); a flag
    in it that left no trace in the results is all ``missing``. Without results, only those."""
    expected = dict(expected or {})
    flags = list(dict.fromkeys([*(results.flags_seen() if results is not None else ()), *expected]))
    out: list[FlagVerdict] = []
    for flag in sorted(flags):
        ab = results.flag(flag) if results is not None else None
        cls, gates = expected.get(flag, (ab.cls if ab is not None else "", ()))
        agg = (results or GateResults()).flag_aggregate(flag, gates)
        out += [FlagVerdict(flag, cls, t.gate, t.state == "passed", t.why, t.state) for t in agg.gates]
    return out

"""The nightly history database (SQLite, stdlib): runs, cells, gate results, metrics, flag verdicts.

Schema (``SCHEMA_VERSION`` 1)::

    runs(id, started, finished, config_name, config_path, config_hash, git_commit, host, status, exit_code, out_dir)
    cells(run_id, cell, profile, flags, pytest_exit, duration_s, status, results_dir)
    gate_results(run_id, cell, gate, outcome, duration_s, message)         -- one row per junit test case
    metrics(run_id, cell, name, value, per_prompt)                        -- per_prompt: JSON list or NULL
    flag_verdicts(run_id, cell, flag, class, gate, passed, why)

``status`` of a run: ``green`` (every gate of every cell passed), ``red`` (failures, no regression against a
baseline) or ``regression``. A cell's status is ``green`` or ``red``. Writes are one transaction per run.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from core.results import GateResults

SCHEMA_VERSION = 1

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
    outcome TEXT NOT NULL CHECK(outcome IN ('passed', 'failed', 'error', 'skipped')),
    duration_s REAL NOT NULL, message TEXT NOT NULL, PRIMARY KEY(run_id, cell, gate));
CREATE TABLE IF NOT EXISTS metrics(
    run_id INTEGER NOT NULL REFERENCES runs(id), cell TEXT NOT NULL, name TEXT NOT NULL,
    value REAL, per_prompt TEXT, PRIMARY KEY(run_id, cell, name));
CREATE TABLE IF NOT EXISTS flag_verdicts(
    run_id INTEGER NOT NULL REFERENCES runs(id), cell TEXT NOT NULL, flag TEXT NOT NULL, class TEXT NOT NULL,
    gate TEXT NOT NULL, passed INTEGER NOT NULL, why TEXT NOT NULL, PRIMARY KEY(run_id, cell, flag, gate));
CREATE INDEX IF NOT EXISTS gate_results_cell ON gate_results(cell, gate);
CREATE INDEX IF NOT EXISTS metrics_cell ON metrics(cell, name);
"""


class HistoryError(RuntimeError):
    pass


@dataclass(frozen=True)
class GateOutcome:
    gate: str            # junit id: "file::test[param]"
    outcome: str         # passed | failed | error | skipped
    duration_s: float = 0.0
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.outcome in ("failed", "error")


@dataclass(frozen=True)
class Metric:
    name: str
    value: float | None
    per_prompt: tuple[float | None, ...] | None = None


@dataclass(frozen=True)
class FlagVerdict:
    flag: str
    cls: str
    gate: str
    passed: bool
    why: str


@dataclass
class CellRecord:
    cell: str
    profile: str
    flags: tuple[str, ...]
    pytest_exit: int
    duration_s: float
    results_dir: str
    gates: list[GateOutcome] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)
    flag_verdicts: list[FlagVerdict] = field(default_factory=list)

    @property
    def green(self) -> bool:
        return self.pytest_exit == 0 and bool(self.gates) and not any(g.failed for g in self.gates)


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
    elif int(row[0]) != SCHEMA_VERSION:
        conn.close()
        raise HistoryError(f"{path}: history schema version {row[0]}, this harness writes {SCHEMA_VERSION}")
    return conn


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
            conn.executemany("INSERT OR REPLACE INTO gate_results VALUES(?,?,?,?,?,?)",
                             [(run_id, r(c.cell), r(g.gate), g.outcome, g.duration_s, r(g.message)) for g in c.gates])
            conn.executemany("INSERT OR REPLACE INTO metrics VALUES(?,?,?,?,?)",
                             [(run_id, r(c.cell), r(m.name), m.value,
                               None if m.per_prompt is None else json.dumps(list(m.per_prompt))) for m in c.metrics])
            conn.executemany("INSERT OR REPLACE INTO flag_verdicts VALUES(?,?,?,?,?,?,?)",
                             [(run_id, r(c.cell), r(v.flag), v.cls, r(v.gate), int(v.passed), r(v.why))
                              for v in c.flag_verdicts])
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
        rec.gates = [GateOutcome(*r) for r in conn.execute(
            "SELECT gate, outcome, duration_s, message FROM gate_results WHERE run_id=? AND cell=? ORDER BY gate",
            (run_id, cell))]
        rec.metrics = [Metric(n, v, None if pp is None else tuple(json.loads(pp))) for n, v, pp in conn.execute(
            "SELECT name, value, per_prompt FROM metrics WHERE run_id=? AND cell=? ORDER BY name", (run_id, cell))]
        rec.flag_verdicts = [FlagVerdict(f, c, g, bool(p), w) for f, c, g, p, w in conn.execute(
            "SELECT flag, class, gate, passed, why FROM flag_verdicts WHERE run_id=? AND cell=? ORDER BY flag, gate",
            (run_id, cell))]
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


def latest_flag_verdicts(db: str | Path) -> dict[str, dict[str, Any]]:
    """flag → {run_id, cell, class, passed, gates: {gate: (passed, why)}} of the newest run that tested it."""
    out: dict[str, dict[str, Any]] = {}
    with closing(connect(db)) as conn:
        rows = conn.execute("SELECT v.run_id, v.cell, v.flag, v.class, v.gate, v.passed, v.why, r.started "
                            "FROM flag_verdicts v JOIN runs r ON r.id=v.run_id ORDER BY v.run_id DESC").fetchall()
    for run_id, cell, flag, cls, gate, passed, why, started in rows:
        slot = out.get(flag)
        if slot is None:
            slot = out[flag] = {"run_id": run_id, "cell": cell, "class": cls, "started": started, "gates": {}}
        if slot["run_id"] != run_id or slot["cell"] != cell:
            continue
        slot["gates"][gate] = (bool(passed), why)
    for slot in out.values():
        slot["passed"] = all(p for p, _ in slot["gates"].values())
    return out


def flag_verdicts_from_results(results: GateResults | None, cell: str = "") -> list[FlagVerdict]:
    """The flag A/B verdicts of a gate run's results as FlagVerdict rows (pure); none without results."""
    if results is None:
        return []
    return [FlagVerdict(f.flag, f.cls, v.gate, v.passed, v.why)
            for f in sorted(results.flag_ab, key=lambda f: f.flag) for v in sorted(f.gates, key=lambda v: v.gate)]


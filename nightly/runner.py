"""The nightly runner: a matrix of engine profiles × flag sets, one ``pytest -m gate`` per cell, history, alerts.

Config (TOML)::

    [nightly]
    name = "cpu-smoke"
    gates = ["gates/test_kl_panel.py", "gates/test_flag_ab.py"]   # the gate selection (pytest paths)
    registry = ["nightly/flags-vllm-cpu.toml"]                      # extra flag registries (repo-relative)
    pytest_args = []                                                 # appended to every cell's pytest
    cell_timeout_s = 3600
    [nightly.regression]                     # metric rule (gates.md §2.7) for run-vs-baseline comparisons
    margin_rel = 0.05
    floor_abs = 0.0
    alpha = 0.05

    [matrix]                                 # cells = profiles × flag_sets, named "profile" / "profile+f1+f2"
    profiles = ["vllm-cpu-fp32"]
    flag_sets = [[], ["no_prefix_cache"]]

    [[cells]]                                # and/or explicit cells
    name = "fp32"
    profile = "vllm-cpu-fp32"                # a shipped profile name, or a .toml path (relative to the config)
    flags = ["no_prefix_cache"]
    gates = ["gates/test_kl_panel.py"]       # optional: replaces [nightly].gates for this cell
    env = { DS41_GATES_CONFIG = "gates/config.toml" }   # optional: extra environment of the cell's pytest
                                             # (engine/environment.py's allow-list and DS41_*; it does not reach
                                             # the engine, which starts from its profile's env)

Each cell runs ``python -m pytest GATES -m gate --engine-profile P --flag F ... --results DIR --junitxml
DIR/junit.xml --per-prompt-metrics`` as a subprocess; its typed results.json and per_prompt.json are read
(core.results_folder.ResultsFolder; junit.xml is written for CI's test viewers, never read back), stored in the
history DB (nightly.history), and compared with the cell's last green run:

* a **gate regression**: a gate that passed in the baseline did not pass now, for any reason: failed, errored,
  skipped, xfailed or not run at all (each named with its outcome); a cell whose pytest did not finish or whose
  results.json is missing or unreadable is an error (``nightly::cell_ran``), never green;
* a **skip** while DS41_REQUIRE_ENGINES=1 is a finding of its own, baseline or not;
* a **metric regression**: a per-prompt metric (mean KL_part of each engine record vs the oracle) whose
  paired difference (now − baseline, per prompt) has an upper 95% bootstrap bound above
  max(floor_abs, margin_rel · baseline mean) with Wilcoxon p < alpha — the §2.7 rule.

A flag's verdict in a cell is core.results.aggregate over every gate its class expects (the registry's), so an
errored or missing flag gate is ERROR in the history, nightly.md and `ds41gate flags`, never ``pass``. A cell
that is not green always has a finding that says why.

Exit code: 0 all green; 1 at least one regression (named on stderr and in nightly.md); 3 failures without
a green baseline to compare against (first run, new gates) or a cell that could not run.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from pydantic import Field, field_validator, model_validator

from core.atomic import atomic_write_text
from core.errors import UserError, one_line
from core.paths import repo_root, safe_name
from core.redact import known_secrets, redact, redact_command, redact_data, register_argv, register_secret, \
    scrub_file, secret_env_name
from core.results import GateOutcome, GateResults, ResultsError
from core.results_folder import PerPrompt, PerPromptError, ResultsFolder
from core.schema import Problem, Seq, StrictModel, key_path, parse_model, value_at
from core.tomlfile import read_toml
from nightly import history as H
from nightly.flag_ab import paired_series, regression_rule
from nightly.trends import plot_trends

REPO_ROOT = repo_root()
DEFAULT_GATES = ("gates/test_kl_panel.py", "gates/test_flag_ab.py")
EXIT_GREEN, EXIT_REGRESSION, EXIT_FAILURES = 0, 1, 3


class NightlyConfigError(UserError, ValueError):
    pass


class RegressionRule(StrictModel):
    """The metric rule (gates.md §2.7) of a run-vs-baseline comparison: ``[nightly.regression]``."""

    margin_rel: float = Field(0.05, ge=0, allow_inf_nan=False)
    floor_abs: float = Field(0.0, ge=0, allow_inf_nan=False)
    alpha: float = Field(0.05, gt=0, lt=1)
    n_boot: int = Field(2000, ge=100)


class NightlyTable(StrictModel):
    """``[nightly]``: what every cell runs and how a run is compared."""

    name: str | None = Field(None, pattern=r"\S")  # default: the config file's stem
    gates: Seq[str] = DEFAULT_GATES
    registry: Seq[str] = ()
    pytest_args: Seq[str] = ()
    cell_timeout_s: float = Field(3600.0, gt=0, allow_inf_nan=False)
    regression: RegressionRule = RegressionRule()

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str | None) -> str | None:
        if name is not None:
            safe_name(name, "nightly.name")   # the run folder is --out/<name>-<stamp>
        return name


class MatrixTable(StrictModel):
    """``[matrix]``: cells = profiles × flag_sets, named "profile" / "profile+f1+f2"."""

    profiles: Seq[str] = ()
    flag_sets: Seq[Seq[str]] = ((),)


class CellTable(StrictModel):
    """One ``[[cells]]`` table."""

    name: str | None = None
    profile: str
    flags: Seq[str] = ()
    gates: Seq[str] = ()
    env: dict[str, str] = {}
    pytest_args: Seq[str] = ()


class NightlyFile(StrictModel):
    """A nightly config file as written (docs/NIGHTLY.md); :func:`parse_config` resolves it into a NightlyConfig."""

    nightly: NightlyTable = NightlyTable()
    matrix: MatrixTable | None = None
    cells: Seq[CellTable] = ()

    def cell_tables(self) -> list[tuple[str, str, tuple[str, ...], CellTable | None]]:
        """(name, profile as written, flags, its [[cells]] table or None for a matrix cell), in file order."""
        out: list[tuple[str, str, tuple[str, ...], CellTable | None]] = []
        if self.matrix is not None:
            out += [(cell_name(p, fs), p, fs, None) for p in self.matrix.profiles for fs in self.matrix.flag_sets]
        out += [(c.name or cell_name(c.profile, c.flags), c.profile, c.flags, c) for c in self.cells]
        return out

    @model_validator(mode="after")
    def _cells_are_named_once(self) -> NightlyFile:
        names = [name for name, *_ in self.cell_tables()]
        if not names:
            raise ValueError("no cells: give [matrix] profiles or [[cells]]")
        for name in names:
            safe_name(name, "cell name")   # each cell's results folder is <run folder>/<cell name>
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate cell name(s) {dup}")
        return self

    @classmethod
    def explain(cls, problem: Problem, data: Any) -> str | None:
        """The established wording of this file's messages (docs/NIGHTLY.md, the hardening tests)."""
        loc = problem.loc
        if problem.kind == "extra_forbidden":
            unknown = sorted(problem.unknown)
            if loc == ():
                return f"unknown top-level key(s) {unknown}; known: nightly, matrix, cells"
            if loc == ("nightly",):
                return f"unknown [nightly] key(s) {unknown}"
            if loc == ("nightly", "regression"):
                return f"unknown [nightly.regression] key(s) {unknown}; known: {sorted(RegressionRule.model_fields)}"
            if loc == ("matrix",):
                return "[matrix] holds profiles and flag_sets only"
        if len(loc) >= 2 and loc[0] == "cells" and (len(loc) == 2 or problem.kind == "extra_forbidden"):
            return f"{key_path(loc[:2])}: a cell holds {', '.join(CellTable.model_fields)}"
        if len(loc) == 3 and loc[0] == "cells" and loc[2] == "profile":
            return f"{key_path(loc[:2])}: 'profile' (a profile name or .toml path) is required"
        if loc == ("nightly", "regression"):
            return f"[nightly.regression] must be a table, got {problem.value!r}"
        if problem.kind == "value_error" and loc in ((), ("nightly", "name")):
            return problem.text                   # the validator's own sentence names its key
        for n in range(len(loc), 0, -1):          # the innermost key with an established "must be"
            allowed = _MUST_BE.get(tuple(-1 if isinstance(p, int) else p for p in loc[:n]))
            if allowed is not None:
                return f"{key_path(loc[:n])} must be {allowed}, got {value_at(data, loc[:n])!r}"
        return None


_LIST = "a list of strings"
# what each key must be, in the words its messages have always used ("-1": any index of an array)
_MUST_BE: dict[tuple[str | int, ...], str] = {
    ("nightly", "name"): "a non-empty string", ("nightly", "gates"): _LIST, ("nightly", "registry"): _LIST,
    ("nightly", "pytest_args"): _LIST, ("nightly", "cell_timeout_s"): "a number > 0",
    ("nightly", "regression", "margin_rel"): "a number >= 0", ("nightly", "regression", "floor_abs"): "a number >= 0",
    ("nightly", "regression", "alpha"): "a number in (0, 1)",
    ("nightly", "regression", "n_boot"): "an integer >= 100",
    ("matrix", "profiles"): _LIST, ("matrix", "flag_sets"): "a list of lists of flag names",
    ("matrix", "flag_sets", -1): _LIST,
    ("cells", -1, "name"): "a string", ("cells", -1, "flags"): _LIST, ("cells", -1, "gates"): _LIST,
    ("cells", -1, "pytest_args"): _LIST, ("cells", -1, "env"): "a table of strings",
}


@dataclass(frozen=True)
class Cell:
    name: str
    profile: str                         # name or absolute .toml path
    flags: tuple[str, ...] = ()
    gates: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    pytest_args: tuple[str, ...] = ()   # this cell's own, after the config's (e.g. the --reference of its weights)


@dataclass(frozen=True)
class NightlyConfig:
    """A nightly config resolved: its cells expanded from [matrix] and [[cells]], profile paths made absolute."""

    name: str
    path: str
    content_hash: str
    cells: tuple[Cell, ...]
    gates: tuple[str, ...] = DEFAULT_GATES
    registry: tuple[str, ...] = ()
    pytest_args: tuple[str, ...] = ()
    cell_timeout_s: float = 3600.0
    rule: RegressionRule = RegressionRule()


def _resolve_profile(profile: str, base: Path) -> str:
    if profile.endswith(".toml") or os.sep in profile:
        p = Path(profile)
        p = p if p.is_absolute() else (base / p)
        return str(p.resolve())
    return profile


def cell_name(profile: str, flags: Sequence[str]) -> str:
    stem = Path(profile).stem if profile.endswith(".toml") else profile
    return "+".join([stem, *flags])


def parse_config(data: Mapping[str, Any], path: str = "<config>", base_dir: Path | None = None) -> NightlyConfig:
    """A NightlyConfig from parsed TOML (pure apart from resolving profile paths against base_dir)."""
    base = base_dir or Path(path).resolve().parent
    doc = parse_model(NightlyFile, data, path, NightlyConfigError)
    from engine.environment import check_engine_env

    for i, table in enumerate(doc.cells):
        # the cell's gate session environment (the engine starts from its profile's env, not this): the
        # allow-list plus the harness's DS41_* settings; no loader variable, no fault injector
        check_engine_env(table.env, f"{path}: cells[{i}]", cell=True, error=NightlyConfigError)
    cells = tuple(Cell(name, _resolve_profile(profile, base), flags, *(
        (table.gates, dict(table.env), table.pytest_args) if table is not None else ()))
        for name, profile, flags, table in doc.cell_tables())
    top = doc.nightly
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
    return NightlyConfig(top.name or Path(path).stem, path, "sha256:" + digest, cells, top.gates, top.registry,
                         top.pytest_args, top.cell_timeout_s, top.regression)


def load_config(path: str | os.PathLike) -> NightlyConfig:
    p = Path(path)
    cfg = parse_config(read_toml(p, "nightly config", NightlyConfigError), str(p), p.resolve().parent)
    check_cells(cfg)
    return cfg


def flag_expectations(cfg: NightlyConfig, cell: Cell) -> dict[str, tuple[str, tuple[str, ...]]]:
    """flag → (class, the gates its class runs) for each flag of the cell, from the registry its pytest reads (the
    shipped one, $DS41_FLAG_REGISTRY and the config's): what the cell's flag verdicts are aggregated over."""
    from nightly.flags import FlagRegistryError, load_registry

    if not cell.flags:
        return {}
    extra = [r if Path(r).is_absolute() else REPO_ROOT / r for r in cfg.registry]
    try:
        registry = load_registry(extra, {**os.environ, **cell.env})
    except FlagRegistryError as exc:
        raise NightlyConfigError(f"{cfg.path}: cell {cell.name!r}: {exc}") from None
    return {f: (registry.get(f).cls, registry.get(f).effective_gates()) for f in cell.flags if f in registry}


def check_cells(cfg: NightlyConfig) -> None:
    """Every cell's profile loads and every flag is registered, checked before any cell starts an engine: a typo
    is a configuration error, not a night of "new-failure" rows in the history."""
    from engine.profiles import ProfileError, load_profile
    from engine.target import check_gate_target
    from nightly.flags import FlagRegistryError, load_registry

    extra = [r if Path(r).is_absolute() else REPO_ROOT / r for r in cfg.registry]
    for cell in cfg.cells:
        where = f"{cfg.path}: cell {cell.name!r}"
        try:
            check_gate_target(load_profile(cell.profile))   # the profile and what its gates compare against
        except ProfileError as exc:
            raise NightlyConfigError(f"{where}: {exc}") from None
        if not cell.flags:
            continue
        try:
            registry = load_registry(extra, {**os.environ, **cell.env})
        except FlagRegistryError as exc:
            raise NightlyConfigError(f"{where}: {exc}") from None
        unknown = [f for f in cell.flags if f not in registry]
        if unknown:
            raise NightlyConfigError(f"{where}: unknown flag(s) {unknown}; known: {sorted(e.name for e in registry)}")


# --------------------------------------------------------------------------------------------- one cell

def cell_argv(cfg: NightlyConfig, cell: Cell, cell_dir: Path, python: str = sys.executable) -> list[str]:
    folder = ResultsFolder.of(cell_dir)
    # junit.xml only for CI's test viewers (the workflow publishes it); the nightly reads results.json
    argv = [python, "-m", "pytest", *(cell.gates or cfg.gates), "-m", "gate", "-p", "no:cacheprovider",
            "--engine-profile", cell.profile, "--results", str(folder.path), "--junitxml", str(folder.junit_file),
            "--per-prompt-metrics", "-rfE"]
    for r in cfg.registry:
        argv += ["--flag-registry", str(r if Path(r).is_absolute() else REPO_ROOT / r)]
    for f in cell.flags:
        argv += ["--flag", f]
    return argv + list(cfg.pytest_args) + list(cell.pytest_args)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def cell_metrics(results: GateResults | None, per_prompt: PerPrompt | None) -> list[H.Metric]:
    """What a cell's results.json / per_prompt.json hold, as history metrics (pure): the KL panel gate's headline
    numbers, each flag A/B gate's tracked numbers, each engine record's per-prompt mean KL_part."""
    out: list[H.Metric] = []
    kl = results.gate("kl_panel") if results is not None else None
    for key, value in sorted((kl.metrics if kl is not None else {}).items()):
        out.append(H.Metric(f"kl_panel.{key}", _finite(value)))
    for flag in sorted(results.flag_ab if results is not None else (), key=lambda f: f.flag):
        for v in sorted(flag.gates, key=lambda v: v.gate):
            for key, value in (("ratio", v.ratio), ("mean_diff", v.mean_diff), ("max_abs_diff", v.max_abs_diff)):
                if value is not None:
                    out.append(H.Metric(f"flag_ab.{flag.flag}.{v.gate}.{key}", _finite(value)))
    for label, means in sorted((per_prompt.engines if per_prompt is not None else {}).items()):
        vals = tuple(_finite(x) for x in means.kl_part)
        finite = [x for x in vals if x is not None]
        out.append(H.Metric(f"kl_part_prompt_mean[{label}]", float(np.mean(finite)) if finite else None, vals))
    return out


CELL_RAN = "nightly::cell_ran"   # the outcome a cell gets when it did not run to typed results


def collect_cell(cell: Cell, cell_dir: Path, pytest_exit: int, duration_s: float,
                 expected_flags: Mapping[str, tuple[str, Sequence[str]]] | None = None) -> H.CellRecord:
    """A cell's record from its results folder: every gate node's outcome, the flag verdicts and the metrics from
    the typed results.json (and per_prompt.json), wall times from its timings. junit.xml is not read: its cell's
    pytest writes it for CI's test viewers, and it cannot tell an xfail from a skip. A cell whose pytest did not
    finish (exit other than 0 / 1), or whose results.json or per_prompt.json is missing or unreadable, gets the
    error outcome ``nightly::cell_ran`` saying so: an error, never green (and the night goes on to the next cell)."""
    folder = ResultsFolder.of(cell_dir)
    problems = [] if pytest_exit in (0, 1) else [f"pytest exited {pytest_exit} (see {folder.pytest_log})"]
    results: GateResults | None = None
    per_prompt: PerPrompt | None = None
    try:
        results = folder.read_results()
    except ResultsError as exc:
        problems.append(one_line(exc))
    try:
        per_prompt = folder.read_per_prompt()
    except PerPromptError as exc:
        problems.append(one_line(exc))
    gates = list(results.outcomes) if results is not None else []
    durations = dict(results.timings.per_test_s) if results is not None and results.timings is not None else {}
    if problems:
        gates.append(GateOutcome(CELL_RAN, "cell_ran", "error", "call", "; ".join(problems)))
        durations[CELL_RAN] = duration_s
    return H.CellRecord(cell.name, cell.profile, cell.flags, pytest_exit, duration_s, str(cell_dir), gates,
                        cell_metrics(results, per_prompt),
                        H.flag_verdicts_from_results(results, cell.name, expected_flags), durations=durations)


Runner = Callable[[list[str], Mapping[str, str], Path, float], int]


def subprocess_runner(argv: list[str], env: Mapping[str, str], log_path: Path, timeout_s: float) -> int:
    """Run one cell's pytest; stdout+stderr to log_path, line by line through core.redact (the secrets of the
    cell's own environment included), so no secret is ever on disk; a time-out kills its process group (exit 124)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    secrets = known_secrets(env)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=str(REPO_ROOT), env=dict(env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        pump = threading.Thread(target=_redacting_pump, args=(proc.stdout, log, secrets), daemon=True,
                                name="ds41-nightly-log")
        pump.start()
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # pytest's atexit/SIGTERM hooks stop its engine servers
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        finally:
            pump.join(timeout=30)   # a left-over grandchild holding the pipe must not hang the nightly


def _redacting_pump(stream, log, secrets: list[str]) -> None:
    """Copy a child's output to its log, each line redacted (undecodable bytes kept as they were)."""
    try:
        for line in iter(stream.readline, b""):
            text = line.decode("utf-8", "surrogateescape")
            log.write(redact(text, secrets).encode("utf-8", "surrogateescape"))
            log.flush()
    except (OSError, ValueError):   # the log was closed after the join timed out
        pass
    finally:
        stream.close()


def register_config_secrets(cfg: NightlyConfig) -> None:
    """What a nightly config carries that is secret -- URL credentials and secret options in pytest_args, the
    values of secret-named variables in a cell's env table -- is redacted from everything the nightly prints or
    writes (the cells' own environment is the nightly's, whose secrets core.redact knows already)."""
    register_argv(cfg.pytest_args)
    for cell in cfg.cells:
        register_argv(cell.pytest_args)
        for k, v in cell.env.items():
            if secret_env_name(k):   # by key, the broad rule (core.redact.SECRET_ENV_NAME)
                register_secret(v)


def scrub_cell_dir(cell_dir: Path) -> list[Path]:
    """Redact every text file a cell's pytest wrote (junit XML, results, reports, logs): the last line of defence
    behind the plugin's own redaction, so the history, the summary and the uploaded artifact hold no secret."""
    secrets = known_secrets()
    return [p for p in sorted(cell_dir.rglob("*")) if p.is_file() and scrub_file(p, secrets)]


# --------------------------------------------------------------------------------------------- comparison

@dataclass(frozen=True)
class Finding:
    kind: str      # regression | new-failure | skipped | flag | error | fixed
    cell: str
    name: str
    detail: str

    def line(self) -> str:
        return f"[{self.kind}] {self.cell} :: {self.name} — {self.detail}"


def _first_line(text: str) -> str:
    return text.splitlines()[0][:300] if text else ""


def compare_cell(baseline: H.CellRecord | None, current: H.CellRecord, rule: RegressionRule,
                 baseline_run: int | None = None, require_engines: bool = False) -> list[Finding]:
    """Findings of one cell against its last green run (pure). The outcome SETS are compared: a gate that passed
    in the baseline and did not pass now -- failed, errored, skipped, xfailed or absent -- is a regression, named
    with its outcome now. With ``require_engines`` (DS41_REQUIRE_ENGINES=1) a skip is a finding baseline or not.
    A flag whose verdict (core.results.aggregate over its expected gates) is not PASS is a finding. A cell that is
    not green gets a finding saying so when nothing else names it."""
    out: list[Finding] = []
    # keyed as the history keys a gate node (history_id: the same for a baseline read back and a cell read now)
    base_gates = {H.history_id(g.nodeid): g for g in baseline.gates} if baseline else {}
    ref = f"run {baseline_run}" if baseline_run is not None else "baseline"
    for g in current.gates:
        gate, message = H.history_id(g.nodeid), g.detail or ""
        b = base_gates.get(gate)
        passed_before = b is not None and b.outcome == "passed"
        if g.nodeid == CELL_RAN and H.failed(g):
            out.append(Finding("error", current.cell, gate, message))
        elif passed_before and g.outcome != "passed":
            out.append(Finding("regression", current.cell, gate,
                               f"passed in {ref}, {g.outcome} now: {_first_line(message)}".rstrip(": ")))
        elif H.failed(g):
            out.append(Finding("new-failure", current.cell, gate, _first_line(message) or g.outcome))
        elif g.outcome == "skipped" and require_engines:
            out.append(Finding("skipped", current.cell, gate,
                               f"skipped while DS41_REQUIRE_ENGINES=1: {_first_line(message)}".rstrip(": ")))
        elif b is not None and H.failed(b) and g.outcome == "passed":
            out.append(Finding("fixed", current.cell, gate, f"{b.outcome} in {ref}, passes now"))
    now = {H.history_id(g.nodeid) for g in current.gates}
    for gate, b in base_gates.items():
        if gate not in now and b.outcome == "passed":
            out.append(Finding("regression", current.cell, gate, f"passed in {ref}, not run now"))
    for flag, agg in sorted(current.flag_aggregates().items()):
        if not agg.passed:
            out.append(Finding("flag", current.cell, flag, agg.label()))
    if baseline is not None:
        base_m = {m.name: m for m in baseline.metrics if m.per_prompt is not None}
        for m in current.metrics:
            b = base_m.get(m.name)
            if m.per_prompt is None or b is None:
                continue
            try:
                pc = paired_series(b.per_prompt, m.per_prompt, m.name, rule.n_boot)
            except ValueError as exc:
                out.append(Finding("error", current.cell, m.name, str(exc)))
                continue
            regressed, _, why = regression_rule(pc.ci_high, pc.mean_diff, pc.wilcoxon_p, pc.mean_a,
                                                rule.floor_abs, rule.margin_rel, rule.alpha)
            if regressed:
                out.append(Finding("regression", current.cell, m.name,
                                   f"{pc.mean_a:.3g} in {ref} → {pc.mean_b:.3g} now over {pc.n_prompts} prompts; {why}"))
    return out


RED_KINDS = frozenset({"regression", "new-failure", "skipped", "flag", "error"})


def exit_code(findings: Sequence[Finding]) -> int:
    kinds = {f.kind for f in findings}
    if "regression" in kinds:
        return EXIT_REGRESSION
    if kinds & RED_KINDS:
        return EXIT_FAILURES
    return EXIT_GREEN


def unexplained_red(cell: H.CellRecord, findings: Sequence[Finding]) -> Finding | None:
    """A finding for a cell that is not green while no red finding names it (pytest exited non-zero with every
    gate passed: a session hook failed the run), so a RED night always says why."""
    if cell.green or any(f.cell == cell.cell and f.kind in RED_KINDS for f in findings):
        return None
    return Finding("error", cell.cell, "nightly::cell_green",
                   f"the cell is not green (pytest exit {cell.pytest_exit}, {len(cell.gates)} gate outcome(s)) and no "
                   f"gate names why: see {ResultsFolder.of(cell.results_dir).pytest_log}")


# --------------------------------------------------------------------------------------------- the run

@dataclass
class NightlyResult:
    run_id: int
    out_dir: Path
    exit_code: int
    status: str
    findings: list[Finding]
    cells: list[H.CellRecord]
    baselines: dict[str, int | None]
    plots: list[Path] = field(default_factory=list)

    @property
    def regressions(self) -> list[Finding]:
        return [f for f in self.findings if f.kind == "regression"]


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def run_nightly(cfg: NightlyConfig, db: Path, out_root: Path, runner: Runner = subprocess_runner,
                only: Sequence[str] = (), echo: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> NightlyResult:
    started = _now()
    from engine.environment import refuse_injector

    refuse_injector(os.environ, "nightly environment", NightlyConfigError)   # before any folder or cell
    db, out_root = Path(db).resolve(), Path(out_root).resolve()  # the cells' pytest runs in the repo root
    if out_root.exists() and not out_root.is_dir():
        raise NightlyConfigError(f"--out {out_root}: exists and is not a folder (it takes a folder for the runs)")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = out_root / f"{cfg.name}-{stamp}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = out_root / f"{cfg.name}-{stamp}-{n}"
    run_dir.mkdir(parents=True)
    register_config_secrets(cfg)
    cells = [c for c in cfg.cells if not only or c.name in only]
    if only and len(cells) != len(set(only)):
        raise NightlyConfigError(f"unknown cell(s) {sorted(set(only) - {c.name for c in cfg.cells})}; "
                                 f"cells: {[c.name for c in cfg.cells]}")
    records: list[H.CellRecord] = []
    for cell in cells:
        # a new, empty folder per cell (names are checked, duplicates refused): it holds this cell's run only;
        # the cell's pytest claims it (--results), so its log is written beside it until pytest has finished
        cell_dir = run_dir / cell.name
        cell_dir.mkdir(parents=True)
        argv = cell_argv(cfg, cell, cell_dir)
        env = {**os.environ, **cell.env, "DS41_NIGHTLY": "1"}
        echo(redact(f"nightly: cell {cell.name}: {redact_command(argv[1:])}"))
        t0 = time.monotonic()
        log = run_dir / f".{cell.name}.pytest.log"
        try:
            code = runner(argv, env, log, cfg.cell_timeout_s)
        finally:
            if log.exists():
                cell_dir.mkdir(parents=True, exist_ok=True)
                os.replace(log, ResultsFolder.of(cell_dir).pytest_log)
        scrub_cell_dir(cell_dir)
        rec = collect_cell(cell, cell_dir, code, time.monotonic() - t0, flag_expectations(cfg, cell))
        echo(redact(f"nightly: cell {cell.name}: pytest exit {code} in {rec.duration_s:.0f} s, "
                    f"{sum(not H.failed(g) for g in rec.gates)}/{len(rec.gates)} gates passed"))
        records.append(rec)
    findings: list[Finding] = []
    baselines: dict[str, int | None] = {}
    for cell, rec in zip(cells, records):
        base = H.last_green_cell(db, rec.cell)
        baselines[rec.cell] = base[0] if base else None
        require = {**os.environ, **cell.env}.get("DS41_REQUIRE_ENGINES") == "1"
        found = compare_cell(base[1] if base else None, rec, cfg.rule, base[0] if base else None, require)
        rec.red_findings = tuple(f.line() for f in found if f.kind in RED_KINDS)   # a red cell is no baseline
        unexplained = unexplained_red(rec, found)
        findings += found + ([unexplained] if unexplained else [])
    code = exit_code(findings)
    status = {EXIT_GREEN: "green", EXIT_REGRESSION: "regression"}.get(code, "red")
    if code == EXIT_GREEN and not all(r.green for r in records):
        status, code = "red", EXIT_FAILURES
    run_id = H.insert_run(db, started=started, finished=_now(), config_name=cfg.name, config_path=cfg.path,
                          config_hash=cfg.content_hash, git_commit=_git_commit(), host=socket.gethostname(),
                          status=status, exit_code=code, out_dir=str(run_dir), cells=records)
    result = NightlyResult(run_id, run_dir, code, status, findings, records, baselines)
    try:
        result.plots = plot_trends(db, run_dir / "trends")
    except Exception as exc:  # a plot must never hide the verdict
        echo(redact(f"nightly: trend plots failed: {exc!r}"))
    write_summary(result, cfg)
    return result


def summary_data(result: NightlyResult, cfg: NightlyConfig) -> dict[str, Any]:
    return {
        "format": "ds41-nightly/1", "config": cfg.name, "config_path": cfg.path, "run_id": result.run_id,
        "status": result.status, "exit_code": result.exit_code,
        "cells": [{"cell": c.cell, "profile": c.profile, "flags": list(c.flags), "pytest_exit": c.pytest_exit,
                   "duration_s": round(c.duration_s, 1), "green": c.green, "baseline_run": result.baselines.get(c.cell),
                   "results_dir": c.results_dir,
                   "gates": [{"gate": H.history_id(g.nodeid), "nodeid": g.nodeid, "outcome": g.outcome,
                              "phase": g.phase, "duration_s": c.durations.get(g.nodeid, 0.0), "message": g.detail or ""}
                             for g in c.gates],
                   "metrics": {m.name: m.value for m in c.metrics},
                   "flag_verdicts": [{**dataclasses.asdict(v), "outcome": v.state} for v in c.flag_verdicts],
                   "flag_aggregates": {flag: H.aggregate_dict(agg) for flag, agg in sorted(c.flag_aggregates().items())}}
                  for c in result.cells],
        "findings": [dataclasses.asdict(f) for f in result.findings],
        "plots": [str(p) for p in result.plots],
    }


def render_markdown(data: Mapping[str, Any]) -> str:
    lines = [f"# Nightly {data['config']} — run {data['run_id']}: **{data['status'].upper()}** (exit {data['exit_code']})", ""]
    regs = [f for f in data["findings"] if f["kind"] == "regression"]
    if regs:
        lines += ["## Regressions", ""] + [f"- `{f['cell']}` :: `{f['name']}` — {f['detail']}" for f in regs] + [""]
    others = [f for f in data["findings"] if f["kind"] != "regression"]
    if others:
        lines += ["## Other findings", ""] + [f"- [{f['kind']}] `{f['cell']}` :: `{f['name']}` — {f['detail']}"
                                              for f in others] + [""]
    lines += ["## Cells", "", "| cell | profile | flags | gates passed | baseline run | time (s) | report |",
              "|---|---|---|---|---|---|---|"]
    for c in data["cells"]:
        passed = sum(g["outcome"] == "passed" for g in c["gates"])
        report = Path(c["results_dir"]) / "report.html"
        shown = "—"
        if report.exists():   # linked only when it is one complete report set (reports.render manifest)
            from reports.render import report_set_problems

            shown = report.name if not report_set_problems(report.parent) else "incomplete"
        lines.append(f"| {c['cell']} | {Path(c['profile']).name} | {' '.join(c['flags']) or '—'} | "
                     f"{passed}/{len(c['gates'])} | {c['baseline_run'] or '—'} | {c['duration_s']} | {shown} |")
    if any(c.get("flag_aggregates") for c in data["cells"]):
        # each flag's verdict over every gate its class expects, then each of those gates with how it ended
        lines += ["", "## Flag verdicts", "", "| cell | flag | class | verdict | gate | outcome | why |",
                  "|---|---|---|---|---|---|---|"]
        for c in data["cells"]:
            classes = {v["flag"]: v["cls"] for v in c["flag_verdicts"]}
            for flag, agg in c.get("flag_aggregates", {}).items():
                cls = classes.get(flag, "")
                lines.append(f"| {c['cell']} | {flag} | {cls} | **{agg['verdict']}** | all expected | — | "
                             f"{_cell_text(agg['label'])} |")
                for gate, g in agg["gates"].items():
                    lines.append(f"| {c['cell']} | {flag} | {cls} | | {gate} | {g['outcome']} | {_cell_text(g['why'])} |")
    if data["plots"]:
        lines += ["", "## Trends", ""] + [f"![{Path(p).stem}](trends/{Path(p).name})" for p in data["plots"]]
    return "\n".join(lines) + "\n"


def _cell_text(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")[:200]


def write_summary(result: NightlyResult, cfg: NightlyConfig) -> None:
    data = redact_data(summary_data(result, cfg))
    atomic_write_text(result.out_dir / "nightly.json", json.dumps(data, indent=2, default=str))
    atomic_write_text(result.out_dir / "nightly.md", render_markdown(data))

"""The ds41-gates pytest plugin: markers, command-line options, one session object, and the fixtures gates use as seams.

Shaped like pytest-benchmark: `pytest_addoption` declares every option once; `pytest_configure` checks them (a bad
flag, profile or results folder is a usage error before any engine starts), makes the one `GateSession`, keeps it
in ``config.stash[SESSION]`` and registers it as a plugin, so its hooks (outcomes, timings, the report, the
terminal summary) are methods of the object that holds the state. Fixtures are thin: they read the session.

The profile under test and the flag registry are parsed once, at configure, and carried by the session; the results
folder is claimed once, at configure (or made on first use), as the `core.results_folder.ResultsFolder` that names
and writes every file of the run. The gates write through the one `gate_run` fixture (`GateRun`): what they
measured (the reference, engine records, panel verdicts) and the typed `core.results.GateResults` (format
`ds41-results/1`), rewritten to results.json after every gate so a run killed later keeps what it measured. Heavy
floors (the engine, the oracle, the pipeline) are imported inside the fixtures that use them: this plugin (a
`pytest11` entry point, pyproject.toml) is loaded by every pytest run of this environment, most of which never start
an engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from core.errors import UserError, one_line
from core.redact import redact, register_url_credentials
from core.results import (
    FlagGateVerdict,
    GateEntry,
    GateOutcome,
    GateResults,
    GateTimings,
    ReportSection,
)
from core.results_folder import PerPrompt, ResultsFolder

if TYPE_CHECKING:
    from engine.profiles import Profile

MARKERS = {
    "gate": "the gate suite (pytest -m gate)",
    "bench": "speed benches",
    "engine": "needs a real engine server",
    "slow": "slow test",
    "long": "a long end-to-end flow (several engine launches): the nightly job runs these (`pytest tests gates -m long`), "
            "CI deselects them (scripts/test.sh) to stay inside its time budget",
    "gpu": "needs a CUDA device",
    "reference": "runs DeepSeek's reference code (DS41_REFERENCE_CODE=/path to a local copy); kept out of CI",
    "flag_ab": "per-flag A/B gates (gates/test_flag_ab.py); deselected unless --flag is given",
}

OUTCOMES_TITLE = "Gate outcomes"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ds41-gates")
    group.addoption("--engine-url", default=None, help="gate an engine that is already running at this URL")
    group.addoption("--engine-profile", default=None, help="engine profile to launch (default: vllm-cpu-fp32)")
    group.addoption("--reference", default=None, help="oracle reference record for the panel")
    group.addoption("--panel", default=None, help="panel name[@version] (default: the gate config's panel)")
    group.addoption("--flag", action="append", default=[], help="VLLM_DS41_* flag to A/B (repeatable)")
    group.addoption("--engine-flag", action="append", default=[],
                    help="profile flag the engine under test runs with (repeatable): the launched server gets it; "
                         "with --engine-url it says what that server runs with (per-flag bands and floors)")
    group.addoption("--results", default=None, help="directory for this run's results and report: new or empty "
                                                    "(a results folder holds one run); default results/<timestamp>")
    group.addoption("--replace-results", action="store_true", default=False,
                    help="--results names an earlier run's results folder: clear it first")
    group.addoption("--eval-baseline", default=None,
                    help="results folder of a known-good task-eval run (gates/test_task_evals.py pairs against it)")
    ab = parser.getgroup("ds41-gates flag A/B")
    ab.addoption("--flag-registry", action="append", default=[],
                 help="extra flag registry TOML merged over nightly/flags.toml (repeatable; also "
                      "$DS41_FLAG_REGISTRY, os.pathsep-separated)")
    ab.addoption("--ab-greedy-tokens", type=int, default=64, help="greedy tokens per prompt in the A/B")
    ab.addoption("--ab-prompts-per-domain", type=int, default=1, help="greedy A/B prompts per panel domain")
    ab.addoption("--ab-speed-rounds", type=int, default=3, help="alternating off/on rounds of the perf compare")
    ab.addoption("--per-prompt-metrics", action="store_true", default=False,
                 help="write per_prompt.json (per-prompt mean KL_part of every engine record) to --results")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    _refuse_fault_injector()
    _gate_suite_by_default(config)
    registry = _check_requested_flags(config)
    profile = _engine_profile(config)
    _check_engine_flags(config, profile)
    reference = _check_reference(config)   # inputs first: a bad one stops the run before its folder is touched
    session = GateSession(config, GateOptions.of(config), profile, claimed=_claim_results(config), registry=registry)
    session.checked_reference = reference
    config.stash[SESSION] = session
    config.pluginmanager.register(session, "ds41-gates-session")


def session_of(config: pytest.Config) -> GateSession:
    return config.stash[SESSION]


# ------------------------------------------------------------------------------------------------ what gates write

@dataclasses.dataclass
class GateRun:
    """What this session's gates measured, and where its files go (``folder``). ``results`` is the typed
    results.json, rewritten after every change (crash-safe); the records, verdict objects and plots stay in memory
    for the session report."""

    folder: ResultsFolder
    results: GateResults = dataclasses.field(default_factory=GateResults)
    engines: list = dataclasses.field(default_factory=list)        # (label, Record)
    reference: Any = None
    panel_gates: list = dataclasses.field(default_factory=list)    # core.verdicts.PanelGateResult
    plots: dict[str, str] = dataclasses.field(default_factory=dict)  # report figures (the localizer's)
    coverages: list = dataclasses.field(default_factory=list)      # ds41gates.coverage.ScoredReference

    def save_engine_record(self, label: str, record) -> None:
        """An engine record this session scored: beside the results, and counted for the session report."""
        self.folder.save_engine_record(label, record)
        self.engines.append((label, record))

    def _save(self, results: GateResults) -> None:
        self.results = results
        self.folder.write_results(results)

    def add(self, entry: GateEntry) -> None:
        self._save(self.results.with_gate(entry))

    def add_flag_verdict(self, flag: str, cls: str, kind: str, profile: str, verdict: FlagGateVerdict) -> None:
        self._save(self.results.with_flag_verdict(flag, cls, kind, profile, verdict))

    def add_section(self, title: str, rows: list[dict], note: str = "") -> None:
        self._save(self.results.with_section(ReportSection(title, rows, note)))

    def add_coverage(self, reference, arm: str | None = None, lengths: Sequence[int] = ()) -> None:
        """Count an oracle reference's scored positions towards the mechanism coverage of ``arm`` (None: the
        session's engine; a flag's name: its A/B on-arm) (ds41gates/coverage.py; judged at the session's end),
        named by its panel (and the item ``lengths`` chosen from it)."""
        from ds41gates.coverage import add_reference

        prov = reference.provenance
        source = f"{prov.panel_name}@{prov.panel_version}" + (f":{list(lengths)}" if lengths else "")
        add_reference(self, source, reference, arm)

    def mark(self, outcome: GateOutcome) -> None:
        """One gate's outcome (passed / failed / error / ...), in results.json the moment it is known."""
        self._save(self.results.with_outcome(outcome))

    def set_timings(self, timings: GateTimings) -> None:
        self._save(self.results.with_timings(timings))

    @property
    def report_sections(self) -> dict[str, dict]:
        """The sections as the report renders them (title → rows and note)."""
        return {s.title: {"rows": list(s.rows), "note": s.note} for s in self.results.sections}


# ------------------------------------------------------------------------------------------------ the session

@dataclasses.dataclass(frozen=True)
class GateOptions:
    """The options the plugin's fixtures read, parsed once."""

    engine_url: str | None
    engine_profile: str | None
    reference: str | None
    panel: str | None
    engine_flags: tuple[str, ...]
    per_prompt_metrics: bool

    @classmethod
    def of(cls, config: pytest.Config) -> GateOptions:
        return cls(engine_url=config.getoption("--engine-url"), engine_profile=config.getoption("--engine-profile"),
                   reference=config.getoption("--reference"), panel=config.getoption("--panel"),
                   engine_flags=tuple(dict.fromkeys(config.getoption("--engine-flag"))),
                   per_prompt_metrics=config.getoption("--per-prompt-metrics"))


class GateSession:
    """One per pytest session: the options, the profile under test (parsed once: --engine-profile, else the
    default), the results folder and its GateRun (made on first use, so a project test run that never touches a
    gate leaves no results folder), the report's paths, and the hooks that fill them."""

    def __init__(self, config: pytest.Config, options: GateOptions, profile: Profile,
                 claimed: ResultsFolder | None = None, registry=None):
        self.config = config
        self.options = options
        self.profile = profile
        self._claimed = claimed
        self._registry = registry                # nightly.flags.Registry, when configure parsed it for --flag
        self.checked_reference = None            # --reference, loaded and checked at configure time
        self._run: GateRun | None = None
        self.report_paths = None                 # reports.render's paths once the session report is written
        self.skipped_required: list[str] = []    # engine/gate tests skipped while DS41_REQUIRE_ENGINES=1
        self.default_reference_announced = False
        self.durations: dict[str, float] = {}    # gate nodeid → setup + call + teardown seconds
        self.echo: Callable[..., None] = _print_echo   # the terminal reporter's, once the session starts

    @property
    def run(self) -> GateRun:
        if self._run is None:
            self._run = GateRun(self._claimed or ResultsFolder.fresh())
        return self._run

    @property
    def flag_registry(self):
        """The flag registry (nightly/flags.toml and --flag-registry), parsed once: at configure when --flag asks
        for it, else on first use."""
        if self._registry is None:
            from nightly.flags import load_registry

            self._registry = load_registry(self.config.getoption("--flag-registry"))
        return self._registry

    @property
    def gated_profile(self) -> Profile | None:
        """The profile whose [gate] table says what the run is gated on; None when no --engine-profile was given
        (the embedded default target, engine.target)."""
        return self.profile if self.options.engine_profile else None

    def profile_named(self, name: str) -> Profile:
        """The session's profile when `name` is it (parsed once), else the profile of that name parsed now."""
        if name == self.profile.name:
            return self.profile
        from engine.profiles import load_profile

        return load_profile(name)

    @functools.cached_property
    def default_profile(self) -> Profile:
        """The embedded default's profile (its served model names the SmolLM2 reference), parsed once."""
        from engine.endpoint import DEFAULT_PROFILE
        from engine.profiles import load_profile

        return self.profile if self.profile.name == DEFAULT_PROFILE else load_profile(DEFAULT_PROFILE)

    @property
    def started_run(self) -> GateRun | None:
        """The GateRun when a gate has used it (else None: nothing to report)."""
        return self._run

    def warn(self, message: str) -> None:
        """Loud even under -q: straight to the terminal (a warnings-summary entry is easy to miss)."""
        self.echo(f"ds41-gates WARNING: {message}", yellow=True, bold=True)

    def launcher_echo(self, line: str) -> None:
        """The launcher's progress on the terminal even under -q and output capture (an engine start takes minutes)."""
        self.echo(f"[engine.launcher] {line}")

    # -------------------------------------------------------------------------------------------- hooks
    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            def echo(line: str, **markup: bool) -> None:
                with _uncaptured(self.config):
                    tr.ensure_newline()
                    tr.write_line(line, **markup)

            self.echo = echo

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        outcome = yield
        report = outcome.get_result()
        _redact_report(report)
        if item.get_closest_marker("gate"):
            self.durations[item.nodeid] = self.durations.get(item.nodeid, 0.0) + report.duration
            self._note_gate_outcome(item, call, report)
        expected_failure = hasattr(report, "wasxfail")  # a documented known issue, not a skip
        if report.skipped and not expected_failure and _requires_engines() and (
                item.get_closest_marker("engine") or item.get_closest_marker("gate")):
            why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
            self.skipped_required.append(f"{item.nodeid}: {why}")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self._judge_coverage()
        if self._run is not None and self.durations:
            per_file: dict[str, float] = {}
            for nodeid, d in self.durations.items():
                f = nodeid.split("::")[0]
                per_file[f] = per_file.get(f, 0.0) + d
            self._run.set_timings(GateTimings({k: round(v, 2) for k, v in self.durations.items()},
                                              {k: round(v, 2) for k, v in per_file.items()}))
        if self.skipped_required and session.exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        run = self._run
        if run is not None:
            try:
                self.write_report()
            except Exception as exc:  # noqa: BLE001 - the summary still names results.json and the errored gates
                terminalreporter.write_line(f"ds41-gates: report could not be written: {exc!r}")
            terminalreporter.section("ds41-gates")
            terminalreporter.write_line(f"results: {run.folder.results_file}")
            if self.report_paths is not None:
                terminalreporter.write_line(f"report:  {self.report_paths.html}")
            else:
                terminalreporter.write_line("report:  not written (no engine record: the engine never scored the panel)")
            for o in run.results.errored():
                terminalreporter.write_line(f"ERRORED gate (neither passed nor failed): {o.nodeid}")
        if self.skipped_required:
            terminalreporter.section("ds41-gates: engine/gate tests skipped while DS41_REQUIRE_ENGINES=1 (run fails)")
            for line in self.skipped_required:
                terminalreporter.write_line(line)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        run = self._run
        try:
            if run is not None and run.reference is not None and run.engines and self.options.per_prompt_metrics:
                run.folder.write_per_prompt(PerPrompt.of(run.reference, run.engines))
        finally:   # the folder's run lock is held until this run has written its last file
            for folder in {run.folder if run is not None else None, self._claimed} - {None}:
                folder.release()

    def _judge_coverage(self) -> None:
        """The coverage rule (ds41gates/coverage.py): every flag this session is about, against the mechanisms
        its scored positions reached; a NOT EXERCISED flag fails its flag_coverage entry (never PASS)."""
        engine_flags, ab_flags = tuple(self.options.engine_flags), tuple(self.config.getoption("--flag"))
        if self._run is None or not (self._run.coverages or engine_flags or ab_flags):
            return
        from ds41gates.coverage import judge_session

        judge_session(self._run, self.flag_registry, engine_flags, ab_flags, self.options.engine_profile or "")

    # -------------------------------------------------------------------------------------------- outcomes, report
    def _note_gate_outcome(self, item: pytest.Item, call, report) -> None:
        """A gate whose test or fixture raised anything but an assertion *errored* (the engine died, hung, answered
        malformed bytes): it neither passed nor failed. Its outcome goes to results.json the moment it is known."""
        if report.when == "setup" and report.passed:
            return
        run = self.run   # a gate that errored before any gate wrote a result still gets a results.json
        prev = run.results.outcome(item.nodeid)
        if report.when == "teardown" and (report.passed or (prev and prev.outcome != "passed")):
            return   # a clean teardown, or one after a failure/error already recorded, changes nothing
        if hasattr(report, "wasxfail"):
            outcome = "xfailed"      # expected: the gate says why it cannot apply here (its detail)
        elif report.skipped:
            outcome = "skipped"
        elif report.passed:
            outcome = "passed"
        elif report.when == "call" and call.excinfo is not None and call.excinfo.errisinstance(
                (AssertionError, pytest.fail.Exception)):
            outcome = "failed"
        else:
            outcome = "error"
        detail = None
        if outcome != "passed" and call.excinfo is not None:
            detail = f"{call.excinfo.typename}: {str(call.excinfo.value)[:800]}"
        run.mark(GateOutcome(item.nodeid, item.name, outcome, report.when, detail))

    def write_report(self) -> None:
        run = self._run
        if run is None or run.reference is None or not run.engines:
            return
        from ds41gates.pipeline import write_report

        sections = run.report_sections
        if run.results.outcomes:
            sections[OUTCOMES_TITLE] = _outcomes_section(run.results)
        if run.results.flags_seen():   # rebuilt at the end: a flag gate that errored after the last verdict is named
            sections.update(self._flag_ab_section(run.results))
        self.report_paths = write_report(run.reference, run.engines, run.folder.path, run.panel_gates, sections,
                                         plots=run.plots, errored=[o.gate for o in run.results.errored()],
                                         coverage=run.results.coverage)

    def _flag_ab_section(self, results: GateResults) -> dict:
        """The flag A/B section: each flag's verdict over every gate the registry expects of it
        (core.results.aggregate)."""
        from gates.lib.flag_ab import REPORT_NOTE, REPORT_TITLE, expected_gates, report_rows
        from nightly.flags import FlagRegistryError

        try:
            expected = expected_gates(self.flag_registry)
        except FlagRegistryError:
            expected = {}   # configure refused a broken registry already; the recorded gates still show
        return {REPORT_TITLE: {"rows": report_rows(results, expected), "note": REPORT_NOTE}}


SESSION = pytest.StashKey[GateSession]()


def _outcomes_section(results: GateResults) -> dict:
    errored = results.errored()
    note = (f"{len(errored)} gate(s) ERRORED: they neither passed nor failed, so this run is not a pass. "
            if errored else "") + "error = the gate or its fixtures raised (engine died, hung, malformed answer)."
    rows = [{"gate": o.gate, "outcome": o.outcome.upper() if o.outcome == "error" else o.outcome,
             "phase": o.phase, "detail": o.detail or ""} for o in results.outcomes]
    return {"rows": rows, "note": note}




def _redact_report(report) -> None:
    """A failing gate's traceback shows frame arguments (an engine URL with user:password@, an echoed key), and its
    captured stdout/stderr/log (printed by -rA and on failure, kept in junit with junit_logging) what the gate
    printed: the text goes through the one redaction; left as it was when it holds no secret."""
    report.sections = [(title, redact(content)) for title, content in report.sections]
    if report.longrepr is None:
        return
    text = str(report.longrepr)
    clean = redact(text)
    if clean != text:
        report.longrepr = clean


def _print_echo(line: str, **markup: bool) -> None:
    print(line, file=sys.stderr, flush=True)


def _requires_engines() -> bool:
    """With DS41_REQUIRE_ENGINES=1 (scripts/test.sh, hence CI) a skipped `engine` or `gate` test fails the run: the
    end-to-end tests against the real engines must never quietly drop out."""
    return os.environ.get("DS41_REQUIRE_ENGINES") == "1"


def _uncaptured(config: pytest.Config):
    """Output capture off for a moment: fixtures run captured, and the terminal reporter's stream is fd 1."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    return capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------ configure checks

def _gate_suite_by_default(config: pytest.Config) -> None:
    """`pytest -m gate` with no paths gates the embedded default (README): testpaths names only the project's own
    tests, so without this the gate suite in gates/ is never collected (1097 deselected, exit 5)."""
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and (config.option.markexpr or "").strip() == "gate":
        config.args = [str(config.rootpath / "gates")]


def _check_reference(config: pytest.Config):
    """--reference is loaded and checked (an oracle record) at configure time, before --results is claimed, so
    a bad reference never costs the folder --replace-results would clear. The loaded record is kept for the
    `panel_reference` fixture (read once)."""
    path = config.getoption("--reference")
    if not path:
        return None
    from core.records import Record

    try:
        ref = Record.load(path)
    except UserError as exc:
        raise pytest.UsageError(f"--reference {path}: {one_line(str(exc))}") from None
    if ref.provenance.side != "oracle":
        raise pytest.UsageError(f"--reference {path}: is an {ref.provenance.side} record; the reference must be an "
                                "oracle record (ds41gate oracle run, or the cached fp32 reference)")
    return ref


def _claim_results(config: pytest.Config) -> ResultsFolder | None:
    """--results is claimed at configure time, after the run's inputs are checked and before any gate or engine
    runs: a folder holding another run is a usage error (unless --replace-results, which clears it now, and
    only when an earlier run's marker is in it), and the folder is locked for this run, so this run's
    results.json never lies beside an earlier or a concurrent run's report. Without --results the fresh
    results/<timestamp> is made (and locked) on first use."""
    given = config.getoption("--results")
    if not given:
        return None
    try:
        return ResultsFolder.claim(given, replace=config.getoption("--replace-results"))
    except UserError as exc:
        raise pytest.UsageError(str(exc)) from None


def _engine_profile(config: pytest.Config) -> Profile:
    """The profile under test, parsed once here (its name is checked: it becomes the engine record's file name):
    --engine-profile, else the default profile; a bad one is a usage error before any gate."""
    from engine.endpoint import DEFAULT_PROFILE
    from engine.profiles import ProfileError, load_profile

    try:
        return load_profile(config.getoption("--engine-profile") or DEFAULT_PROFILE)
    except ProfileError as exc:
        raise pytest.UsageError(f"--engine-profile: {exc}") from None


def _refuse_fault_injector() -> None:
    """The fault injector (engine/vllm_perturb, DS41_PERTURB_*) plants faults for `ds41gate localize` only: a gate
    session whose environment carries one refuses to start, naming it, before anything is claimed or launched (a
    profile's or a flag's env carrying one is refused by the profile parser, engine/environment.py)."""
    from engine.environment import EngineEnvError, refuse_injector

    try:
        refuse_injector(os.environ, "gate session environment")
    except EngineEnvError as exc:
        raise pytest.UsageError(str(exc)) from None


def _check_engine_flags(config: pytest.Config, profile: Profile) -> None:
    """An --engine-flag the profile does not define is a usage error now, before any server starts."""
    unknown = [f for f in dict.fromkeys(config.getoption("--engine-flag")) if f not in profile.flags]
    if unknown:
        name = config.getoption("--engine-profile") or profile.name
        raise pytest.UsageError(f"--engine-flag: profile {name!r} has no flag(s) {unknown}; it defines "
                                f"{sorted(profile.flags)}")


def _check_requested_flags(config: pytest.Config):
    """The flag registry when --flag asks for flags (parsed here, once; None without --flag): an unknown --flag
    or a broken registry is a usage error now, before any fixture launches a server."""
    flags = config.getoption("--flag")
    if not flags:
        return None
    from nightly.flags import FlagRegistryError, load_registry

    try:
        registry = load_registry(config.getoption("--flag-registry"))
    except FlagRegistryError as exc:
        raise pytest.UsageError(f"--flag-registry: {exc}") from None
    unknown = [name for name in dict.fromkeys(flags) if name not in registry]
    if unknown:
        raise pytest.UsageError(
            f"--flag: unknown flag(s) {unknown}; known: {sorted(entry.name for entry in registry)} "
            f"(registries: {', '.join(registry.sources) or 'none'})")
    return registry


# ------------------------------------------------------------------------------------------------ collection

def _needed_by_no_flag(item: pytest.Item) -> bool:
    """An A/B gate that none of the requested flags' classes runs: pytest made it from an empty parameter set."""
    return any(str(m.kwargs.get("reason", "")).startswith("got empty parameter set") for m in item.iter_markers("skip"))


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """`flag_ab` items are deselected when no --flag is given, so the gate suite without flags neither runs nor
    skips them."""
    flags = config.getoption("--flag")
    keep, drop = [], []
    for item in items:
        unwanted = item.get_closest_marker("flag_ab") and (not flags or _needed_by_no_flag(item))
        (drop if unwanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ------------------------------------------------------------------------------------------------ fixtures: the seams
# panel reference → encoded panel (always the reference's own ids) → engine endpoint → engine record.
# `--engine-url URL --reference FILE` gates a running engine; with neither, the embedded default
# (SmolLM2 on the vllm-cpu-fp32 profile, reference built and cached) is launched here.

@pytest.fixture(scope="session")
def gate_session(request: pytest.FixtureRequest) -> GateSession:
    return session_of(request.config)


@pytest.fixture(scope="session")
def gate_run(gate_session: GateSession) -> GateRun:
    """What the session's gates measured and where its files go: a gate writes its verdict
    (`gate_run.add(GateEntry(...))`), report sections, engine records and files (`gate_run.folder`) here."""
    return gate_session.run


@pytest.fixture(scope="session")
def flag_registry(gate_session: GateSession):
    return gate_session.flag_registry


@pytest.fixture(scope="session")
def gate_target(gate_session: GateSession):
    """What the profile under test is gated on, resolved once per session from its [gate] table
    (engine.target.ResolvedTarget): model folder, panel encoded as that model reads it, tokenizer, oracle and
    precision, bands and gate sizes. No profile, or one without [gate]: the embedded default (SmolLM2)."""
    from engine.target import resolve_gate_target

    opts = gate_session.options
    try:
        return resolve_gate_target(gate_session.gated_profile, opts.panel)
    except UserError as exc:
        _stop_for_user_error(f"--engine-profile {opts.engine_profile}: {exc}")


@pytest.fixture(scope="session")
def gate_tokenizer(gate_target):
    """The served model's tokenizer and chat format (the target's: the DeepSeek tokenizer and chat encoding for
    vllm-cpu-dsv4, else SmolLM2's): the ids the engine-behaviour gates send."""
    from panels import load_tokenizer

    return load_tokenizer(gate_target.tokenizer)


@pytest.fixture(scope="session")
def gate_bands(gate_target) -> Path:
    """The KL bands file of the profile's target (gates/bands.toml unless its [gate] table names another)."""
    return gate_target.bands


@pytest.fixture(scope="session")
def panel_reference(gate_session: GateSession, request: pytest.FixtureRequest):
    """The oracle reference record: --reference FILE, or the target's panel on the target's model by the target's
    oracle at the target's precision."""
    from core.records import Record
    from ds41gates import pipeline
    from engine.target import serves_embedded_default

    opts = gate_session.options
    if gate_session.checked_reference is not None:
        ref = gate_session.checked_reference
    elif opts.reference:
        try:
            ref = Record.load(opts.reference)
        except UserError as exc:
            _stop_for_user_error(f"--reference {opts.reference}: {exc}")
        if ref.provenance.side != "oracle":
            _stop_for_user_error(f"--reference {opts.reference}: is an {ref.provenance.side} record; the reference "
                                 "must be an oracle record (ds41gate oracle run, or the cached fp32 reference)")
    else:
        if opts.engine_url and serves_embedded_default(gate_session.gated_profile):
            _require_default_model(gate_session, opts.engine_url)   # before minutes of building a reference
        target = request.getfixturevalue("gate_target")
        ref, _ = pipeline.ensure_reference(target.encoded, target.model_dir, oracle=target.oracle,
                                           precision=target.precision)
    gate_session.run.reference = ref
    return ref


@pytest.fixture(scope="session")
def long_reference(gate_target):
    """``long_reference(encoded)`` -> the target oracle's long-context reference of that encoded panel (chunked
    prefill, logits only at scored positions, mechanism masks), cached (ds41gates.pipeline.ensure_long_reference);
    an oracle kind without one is the registry's one-line error (asked only by a gate that applies)."""
    from ds41gates import pipeline

    def build(encoded):
        return pipeline.ensure_long_reference(encoded, gate_target.model_dir, gate_target.precision,
                                              oracle=gate_target.oracle)[0]

    return build


@pytest.fixture(scope="session")
def encoded_panel(panel_reference):
    from panels import encoded_from_record

    return encoded_from_record(panel_reference)


@pytest.fixture(scope="session")
def launch_engine(gate_session: GateSession):
    """`launch_engine(profile, flags=(), overrides=None)` → (server, endpoint): for gates that need a second
    server beside the one under test (speculation on, a flag flipped). The caller stops the server."""
    def launch(profile: str, flags=(), overrides=None):
        return _launch_endpoint(gate_session.profile_named(profile), flags=flags, overrides=overrides,
                                echo=gate_session.launcher_echo)

    return launch


@pytest.fixture(scope="session")
def engine_endpoint(gate_session: GateSession):
    """The engine under test: --engine-url (already running), else the session's profile launched here."""
    from engine.endpoint import EngineEndpoint

    opts = gate_session.options
    if opts.engine_url:
        from engine.target import serves_embedded_default

        register_url_credentials(opts.engine_url)
        root = opts.engine_url.rstrip("/").removesuffix("/v1")
        key = os.environ.get("DS41_ENGINE_API_KEY")   # the same key client_for sends (key-protected servers)
        models = _served_models(opts.engine_url, root, key)
        if not opts.reference and serves_embedded_default(gate_session.gated_profile):
            _require_default_model(gate_session, opts.engine_url, models)
        kind, label = "vllm", "default"
        if opts.engine_profile:   # a path (../x.toml) labels the record by the profile's name
            kind, label = gate_session.profile.engine or kind, gate_session.profile.name
        yield EngineEndpoint(root, models[0], label, engine=kind, flags=opts.engine_flags)
        return
    server, endpoint = _launch_endpoint(gate_session.profile, flags=opts.engine_flags,
                                        echo=gate_session.launcher_echo)
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def engine_client(engine_endpoint):
    from engine.endpoint import client_for

    client = client_for(engine_endpoint, max_concurrency=4)
    yield client
    client.close()


@pytest.fixture(scope="session")
def panel_engine_record(engine_endpoint, encoded_panel, gate_run: GateRun):
    """The engine's record of the panel positions, saved beside the results."""
    from engine.endpoint import DEFAULT_ENGINE_K, score_engine

    gate_run.folder.engine_record_file(engine_endpoint.profile)   # a label unfit for a file name: refused first
    rec = score_engine(engine_endpoint, encoded_panel, DEFAULT_ENGINE_K)
    gate_run.save_engine_record(engine_endpoint.profile, rec)
    if gate_run.reference is not None:   # the positions scored are the reference's: what they reached counts
        gate_run.add_coverage(gate_run.reference)
    return rec


# ------------------------------------------------------------------------------------------------ fixture helpers

def _launch_endpoint(profile: Profile, flags=(), overrides=None, echo=None):
    """Start a server from a parsed profile, serving its gate target's model (the embedded default unless its
    [gate] table names another); (server, endpoint), the caller stops the server."""
    from engine.endpoint import launch_endpoint
    from engine.target import resolve_gate_target

    model_dir = resolve_gate_target(profile, encode=False).model_dir
    return launch_endpoint(profile, model_dir, flags=flags, overrides=overrides, echo=echo)


def _stop_for_user_error(message: str):
    """A bad option or input file: one line and exit code 2 before any gate runs, never a traceback per gate."""
    pytest.exit(f"error: {redact(one_line(message))}", returncode=2)


def _served_models(url: str, root: str, key: str | None) -> list[str]:
    """The model ids `/v1/models` lists (`EngineClient.models`, so this first request has the gates' guards too:
    no redirect to another origin, a capped uncompressed body, a total deadline); anything but an OpenAI model
    list stops the run with one line naming the URL."""
    from engine.client import MAX_MODEL_NAME, ClientConfig, EngineClient, RetryPolicy
    from engine.errors import (
        EngineError,
        EngineLimitExceeded,
        EngineRequestRejected,
        EngineResponseError,
        EngineTransportError,
        Malformed,
    )

    client = EngineClient(ClientConfig(root, "", api_key=key or "unused", timeout_s=30,
                                       retry=RetryPolicy(max_attempts=1), max_body_bytes=4 << 20))
    try:
        models = client.models()
    except (EngineRequestRejected, EngineTransportError) as exc:
        if exc.status is None:
            _stop_for_user_error(f"--engine-url {url}: no engine answers at {root}/v1/models ({exc})")
        hint = " (set DS41_ENGINE_API_KEY to the server's key)" if exc.status in (401, 403) else ""
        _stop_for_user_error(f"--engine-url {url}: {root}/v1/models answered HTTP {exc.status}{hint}")
    except EngineLimitExceeded as exc:
        if exc.what.startswith("model name"):
            _stop_for_user_error(f"--engine-url {url}: /v1/models lists a model name over {MAX_MODEL_NAME} characters")
        _stop_for_user_error(f"--engine-url {url}: {exc}")
    except EngineResponseError as exc:
        if exc.kind in (Malformed.INVALID_JSON, Malformed.EMPTY_BODY):
            # the content type is what tells a user they reached a web page, not an engine; the client's error
            # does not carry the header, so it is asked for once more, on this failure only
            kind = _content_type(client, "/v1/models")
            _stop_for_user_error(f"--engine-url {url}: {root}/v1/models did not answer JSON (content-type "
                                 f"{kind!r}); is this an OpenAI-compatible server?")
        _stop_for_user_error(f"--engine-url {url}: {root}/v1/models is not an OpenAI model list "
                             '({"data": [{"id": ...}, ...]})')
    except EngineError as exc:
        _stop_for_user_error(f"--engine-url {url}: {exc}")
    finally:
        client.close()
    if not models:
        _stop_for_user_error(f"--engine-url {url}: /v1/models lists no model")
    return models


def _content_type(client, path: str) -> str:
    try:
        return client.get(path).headers.get("content-type", "?")
    except Exception:  # noqa: BLE001 - only a message detail: the run stops on the first answer either way
        return "?"


def _require_default_model(session: GateSession, url: str, models: list[str] | None = None) -> None:
    """Without --reference the embedded SmolLM2 reference is used: say so, and refuse an engine serving
    another model."""
    if not session.default_reference_announced:
        session.default_reference_announced = True
        session.warn("--engine-url without --reference: gating against the embedded SmolLM2 reference of the "
                     "default panel with the loose [profiles.default] bands; pass --reference for your model "
                     "(refused when the engine serves another model)")
    if models is None:
        root = url.rstrip("/").removesuffix("/v1")
        models = _served_models(url, root, os.environ.get("DS41_ENGINE_API_KEY"))
    default_model = session.default_profile.served_model
    if default_model not in models:
        _stop_for_user_error(
            f"--engine-url {url} serves {models}, not the embedded default model {default_model!r} whose "
            "reference is used without --reference; pass --reference with the served model's oracle reference")

"""The ds41-gates pytest plugin: markers, command-line options and the fixtures gates use as seams."""

from __future__ import annotations

import pytest

MARKERS = {
    "gate": "the gate suite (pytest -m gate)",
    "bench": "speed benches",
    "engine": "needs a real engine server",
    "slow": "slow test",
    "long": "a long end-to-end flow (several engine launches): the nightly job runs these (`pytest tests gates -m long`), "
            "CI deselects them (scripts/test.sh) to stay inside its time budget",
    "gpu": "needs a CUDA device",
    "reference": "runs DeepSeek's reference code (DS41_REFERENCE_CODE=/path to a local copy); kept out of CI",
}


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


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    _gate_suite_by_default(config)


def _gate_suite_by_default(config: pytest.Config) -> None:
    """`pytest -m gate` with no paths gates the embedded default (README): testpaths names only the project's own
    tests, so without this the gate suite in gates/ is never collected (1097 deselected, exit 5)."""
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and (config.option.markexpr or "").strip() == "gate":
        config.args = [str(config.rootpath / "gates")]


# --------------------------------------------------------------------------- no silent skips in CI
# With DS41_REQUIRE_ENGINES=1 (scripts/test.sh, hence CI) a skipped `engine` or `gate` test fails
# the run: the end-to-end tests against the real engines must never quietly drop out.

_skipped_required: list[str] = []


def _requires_engines() -> bool:
    import os

    return os.environ.get("DS41_REQUIRE_ENGINES") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    _redact_report(report)
    if item.get_closest_marker("gate"):
        _note_gate_outcome(item, call, report)
    expected_failure = hasattr(report, "wasxfail")  # a documented known issue, not a skip
    if report.skipped and not expected_failure and _requires_engines() and (
            item.get_closest_marker("engine") or item.get_closest_marker("gate")):
        _skipped_required.append(f"{item.nodeid}: {report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr}")


def _redact_report(report) -> None:
    """A failing gate's traceback shows frame arguments (an engine URL with user:password@, an echoed key), and its
    captured stdout/stderr/log (printed by -rA and on failure, kept in junit with junit_logging) what the gate
    printed: the text goes through the one redaction; left as it was when it holds no secret."""
    from core.redact import redact

    report.sections = [(title, redact(content)) for title, content in report.sections]
    if report.longrepr is None:
        return

    text = str(report.longrepr)
    clean = redact(text)
    if clean != text:
        report.longrepr = clean


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_required and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    run = getattr(config, "_ds41_gate_run", None)
    if run is not None:
        try:
            _write_session_report(config)
        except Exception as exc:
            terminalreporter.write_line(f"ds41-gates: report could not be written: {exc!r}")
        paths = getattr(config, "_ds41_report", None)
        terminalreporter.section("ds41-gates")
        terminalreporter.write_line(f"results: {run.out_dir / 'results.json'}")
        if paths is not None:
            terminalreporter.write_line(f"report:  {paths.html}")
        else:
            terminalreporter.write_line("report:  not written (no engine record: the engine never scored the panel)")
        for nodeid in run.errored():
            terminalreporter.write_line(f"ERRORED gate (neither passed nor failed): {nodeid}")
    if _skipped_required:
        terminalreporter.section("ds41-gates: engine/gate tests skipped while DS41_REQUIRE_ENGINES=1 (run fails)")
        for line in _skipped_required:
            terminalreporter.write_line(line)


# --------------------------------------------------------------------------- fixtures: the seams
# panel reference → encoded panel (always the reference's own ids) → engine endpoint → engine record.
# `--engine-url URL --reference FILE` gates a running engine; with neither, the embedded default
# (SmolLM2 on the vllm-cpu-fp32 profile, reference built and cached) is launched here.

import dataclasses
from pathlib import Path
from typing import Any

from core.errors import UserError


@dataclasses.dataclass
class GateRun:
    """What this session's gates measured; results.json is rewritten after every gate (crash-safe)."""

    out_dir: Path
    results: dict[str, Any] = dataclasses.field(default_factory=dict)
    engines: list = dataclasses.field(default_factory=list)   # (label, Record)
    reference: Any = None
    panel_gates: list = dataclasses.field(default_factory=list)  # core.verdicts.PanelGateResult
    report_sections: dict[str, dict] = dataclasses.field(default_factory=dict)
    outcomes: dict[str, dict] = dataclasses.field(default_factory=dict)   # nodeid -> outcome (see mark)

    def add(self, gate: str, data: dict) -> None:
        from core.atomic import write_json_atomic
        from core.redact import redact_data

        self.results[gate] = data
        write_json_atomic(self.out_dir / "results.json", redact_data(self.results))

    def add_section(self, title: str, rows: list[dict], note: str = "") -> None:
        self.report_sections[title] = {"rows": rows, "note": note}

    def mark(self, nodeid: str, outcome: dict) -> None:
        """Record one gate's outcome (passed / failed / error / skipped) in results.json at once."""
        from core.atomic import write_json_atomic
        from core.redact import redact_data

        self.outcomes[nodeid] = outcome
        self.results[OUTCOMES_KEY] = dict(self.outcomes)
        write_json_atomic(self.out_dir / "results.json", redact_data(self.results))

    def errored(self) -> list[str]:
        return [n for n, o in self.outcomes.items() if o["outcome"] == "error"]


def _opt(config: pytest.Config, name: str):
    return config.getoption(name)


@pytest.fixture(scope="session")
def gate_run(request: pytest.FixtureRequest) -> GateRun:
    return _gate_run_of(request.config)


def _gate_run_of(config: pytest.Config) -> GateRun:
    """This session's GateRun (one per session: results.json is rewritten after every gate within it); its
    folder is claimed once, on first use (--results: new or empty, or cleared with --replace-results)."""
    from ds41gates.pipeline import results_dir

    run = getattr(config, "_ds41_gate_run", None)
    if run is None:
        out = getattr(config, "_ds41_results_dir", None) or results_dir(None)
        run = config._ds41_gate_run = GateRun(out_dir=out)
    return run


def _claim_results(config: pytest.Config) -> None:
    """--results is claimed at configure time, before any gate or engine runs: a folder holding another run is
    a usage error (unless --replace-results, which clears it now), so this run's results.json never lies
    beside an earlier run's report. Without --results the fresh results/<timestamp> is made on first use."""
    from ds41gates.pipeline import results_dir

    given = config.getoption("--results")
    if given:
        try:
            config._ds41_results_dir = results_dir(given, replace=config.getoption("--replace-results"))
        except UserError as exc:
            raise pytest.UsageError(str(exc)) from None


@pytest.fixture(scope="session")
def gate_results(gate_run: GateRun) -> GateRun:
    return gate_run


@pytest.fixture(scope="session")
def gate_tokenizer(request: pytest.FixtureRequest):
    """The served model's tokenizer and chat format — the profile's own model (the DeepSeek tokenizer and chat
    encoding for vllm-cpu-dsv4), else SmolLM2's: the ids the engine-behaviour gates send."""
    from ds41gates.pipeline import served_model
    from engine.models import default_model_dir
    from panels import load_tokenizer

    sm = served_model(_opt(request.config, "--engine-profile"))
    return load_tokenizer(sm.tokenizer) if sm is not None else load_tokenizer(default_model_dir())


@pytest.fixture(scope="session")
def panel_reference(request: pytest.FixtureRequest, gate_run: GateRun):
    """The oracle reference record: --reference FILE, or the default panel on the default model."""
    from ds41gates import pipeline
    from core.records import Record

    path = _opt(request.config, "--reference")
    if path:
        try:
            ref = Record.load(path)
        except UserError as exc:
            _stop_for_user_error(f"--reference {path}: {exc}")
        if ref.provenance.side != "oracle":
            _stop_for_user_error(f"--reference {path}: is an {ref.provenance.side} record; the reference must be "
                                 "an oracle record (ds41gate oracle run, or the cached fp32 reference)")
    else:
        url = _opt(request.config, "--engine-url")
        profile = _opt(request.config, "--engine-profile")
        if url and pipeline.served_model(profile) is None:
            _require_default_model(request.config, url)   # before minutes of building a reference
        # the profile's own model and panel (the tiny DeepSeek-V4 on vllm-cpu-dsv4), else the embedded default
        encoded, model_dir, oracle = pipeline.encode_profile_panel(profile, _opt(request.config, "--panel"))
        ref, _ = pipeline.ensure_reference(encoded, model_dir, oracle=oracle)
    gate_run.reference = ref
    return ref


@pytest.fixture(scope="session")
def encoded_panel(panel_reference):
    from panels import encoded_from_record

    return encoded_from_record(panel_reference)


def _stop_for_user_error(message: str):
    """A bad option or input file: one line and exit code 2 before any gate runs, never a traceback per gate."""
    from core.errors import one_line
    from core.redact import redact

    pytest.exit(f"error: {redact(one_line(message))}", returncode=2)


def _warn(config: pytest.Config, message: str) -> None:
    """Loud even under -q: straight to the terminal (a warnings-summary entry is easy to miss)."""
    import sys

    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        with _uncaptured(config):
            tr.ensure_newline()
            tr.write_line(f"ds41-gates WARNING: {message}", yellow=True, bold=True)
    else:
        print(f"ds41-gates WARNING: {message}", file=sys.stderr, flush=True)


def _uncaptured(config: pytest.Config):
    """Output capture off for a moment: fixtures run captured, and the terminal reporter's stream is fd 1."""
    import contextlib

    capman = config.pluginmanager.get_plugin("capturemanager")
    return capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()


def _served_models(url: str, root: str, key: str | None) -> list[str]:
    """The model ids `/v1/models` lists; anything but an OpenAI model list is a user error naming the URL. Asked
    through the engine client, so this first request has the gates' guards too: no redirect to another origin,
    a capped uncompressed body, a total deadline."""
    from engine.client import MAX_MODEL_NAME, ClientConfig, EngineClient, RetryPolicy
    from engine.errors import EngineError, EngineRequestRejected, EngineTransportError

    client = EngineClient(ClientConfig(root, "", api_key=key or "unused", timeout_s=30,
                                       retry=RetryPolicy(max_attempts=1), max_body_bytes=4 << 20))
    try:
        resp = client.get("/v1/models")
    except (EngineRequestRejected, EngineTransportError) as exc:
        if exc.status is None:
            _stop_for_user_error(f"--engine-url {url}: no engine answers at {root}/v1/models ({exc})")
        hint = " (set DS41_ENGINE_API_KEY to the server's key)" if exc.status in (401, 403) else ""
        _stop_for_user_error(f"--engine-url {url}: {root}/v1/models answered HTTP {exc.status}{hint}")
    except EngineError as exc:
        _stop_for_user_error(f"--engine-url {url}: {exc}")
    finally:
        client.close()
    try:
        listing = resp.json()
    except ValueError:
        _stop_for_user_error(f"--engine-url {url}: {root}/v1/models did not answer JSON (content-type "
                             f"{resp.headers.get('content-type', '?')!r}); is this an OpenAI-compatible server?")
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        _stop_for_user_error(f"--engine-url {url}: {root}/v1/models is not an OpenAI model list "
                             '({"data": [{"id": ...}, ...]})')
    if not data:
        _stop_for_user_error(f"--engine-url {url}: /v1/models lists no model")
    if any(len(m["id"]) > MAX_MODEL_NAME for m in data):
        _stop_for_user_error(f"--engine-url {url}: /v1/models lists a model name over {MAX_MODEL_NAME} characters")
    return [m["id"] for m in data]


_terminal_echo = None


def _launcher_echo(line: str) -> None:
    """The launcher's progress on the terminal even under -q and output capture (an engine start takes minutes)."""
    import sys

    if _terminal_echo is not None:
        _terminal_echo(f"[engine.launcher] {line}")
    else:
        print(f"[engine.launcher] {line}", file=sys.stderr, flush=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _terminal_echo
    config = session.config
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        def echo(line: str) -> None:
            with _uncaptured(config):
                tr.ensure_newline()
                tr.write_line(line)

        _terminal_echo = echo


def _require_default_model(config: pytest.Config, url: str, models: list[str] | None = None) -> None:
    """Without --reference the embedded SmolLM2 reference is used: say so, and refuse an engine serving
    another model."""
    import os

    if not getattr(config, "_ds41_default_reference_announced", False):
        config._ds41_default_reference_announced = True
        _warn(config, "--engine-url without --reference: gating against the embedded SmolLM2 reference of the "
                      "default panel with the loose [profiles.default] bands; pass --reference for your model "
                      "(refused when the engine serves another model)")

    from engine.endpoint import DEFAULT_PROFILE
    from engine.launcher import load_profile

    if models is None:
        key = os.environ.get("DS41_ENGINE_API_KEY")
        root = url.rstrip("/").removesuffix("/v1")
        models = _served_models(url, root, key)
    default_model = load_profile(DEFAULT_PROFILE).served_model
    if default_model not in models:
        _stop_for_user_error(
            f"--engine-url {url} serves {models}, not the embedded default model {default_model!r} whose "
            "reference is used without --reference; pass --reference with the served model's oracle reference")


def launch_endpoint(profile_name: str, flags=(), overrides=None):
    """Start a server from a shipped profile: the embedded default model, or the profile's own
    (ds41gates.pipeline.SERVED_MODELS)."""
    from ds41gates import pipeline
    from engine import endpoint

    return endpoint.launch_endpoint(profile_name, pipeline.profile_model_dir(profile_name), flags=flags,
                                    overrides=overrides, echo=_launcher_echo)


@pytest.fixture(scope="session")
def launch_engine():
    """`launch_engine(profile, flags=(), overrides=None)` → (server, endpoint): for gates that need a second
    server beside the one under test (speculation on, a flag flipped). The caller stops the server."""
    return launch_endpoint


@pytest.fixture(scope="session")
def engine_endpoint(request: pytest.FixtureRequest):
    """The engine under test: --engine-url (already running), else the --engine-profile launched here."""
    from engine.endpoint import DEFAULT_PROFILE, EngineEndpoint

    url = _opt(request.config, "--engine-url")
    profile = _opt(request.config, "--engine-profile")
    engine_flags = tuple(dict.fromkeys(request.config.getoption("--engine-flag")))
    if url:
        from core.redact import register_url_credentials

        register_url_credentials(url)
        root = url.rstrip("/").removesuffix("/v1")
        import os

        key = os.environ.get("DS41_ENGINE_API_KEY")   # the same key client_for sends (key-protected servers)
        models = _served_models(url, root, key)
        from ds41gates.pipeline import served_model

        if not _opt(request.config, "--reference") and served_model(profile) is None:
            _require_default_model(request.config, url, models)
        kind, label = "vllm", "default"
        if profile:
            from engine.launcher import load_profile

            prof = load_profile(profile)   # a path (../x.toml) labels the record by the profile's checked name
            kind, label = prof.engine or kind, prof.name
        yield EngineEndpoint(root, models[0], label, engine=kind, flags=engine_flags)
        return
    server, endpoint = launch_endpoint(profile or DEFAULT_PROFILE, flags=engine_flags)
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

    from core.paths import safe_name

    label = safe_name(engine_endpoint.profile, "engine label")   # becomes a file name in the results folder
    rec = score_engine(engine_endpoint, encoded_panel, DEFAULT_ENGINE_K)
    rec.save(gate_run.out_dir / f"engine-{label}.safetensors")
    gate_run.engines.append((engine_endpoint.profile, rec))
    return rec


def _write_session_report(config: pytest.Config) -> None:
    run: GateRun | None = getattr(config, "_ds41_gate_run", None)
    if run is None or run.reference is None or not run.engines:
        return
    from ds41gates.pipeline import write_report

    sections = dict(run.report_sections)
    if run.outcomes:
        sections[OUTCOMES_TITLE] = _outcomes_section(run)
    paths = write_report(run.reference, run.engines, run.out_dir, run.panel_gates, sections,
                         plots=getattr(run, "report_plots", None),   # the localizer's (ds41gates/localize_plugin.py)
                         errored=[run.outcomes[n]["gate"] for n in run.errored()])
    config._ds41_report = paths


# --------------------------------------------------------------------------- gate outcomes
# A gate whose test or fixture raised anything but an assertion *errored* (the engine died, hung, answered
# malformed bytes): it neither passed nor failed. Each gate's outcome goes to results.json under
# "gate_outcomes" the moment it is known (so a run killed later keeps it), and to a "Gate outcomes" section
# of the session report; errored gates are named in the terminal summary too.

OUTCOMES_KEY = "gate_outcomes"
OUTCOMES_TITLE = "Gate outcomes"


def _note_gate_outcome(item: pytest.Item, call, report) -> None:
    if report.when == "setup" and report.passed:
        return
    run = _gate_run_of(item.config)   # a gate that errored before the GateRun existed still gets a results.json
    prev = run.outcomes.get(item.nodeid)
    if report.when == "teardown" and (report.passed or (prev and prev["outcome"] != "passed")):
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
    if outcome in ("error", "failed", "skipped", "xfailed") and call.excinfo is not None:
        detail = f"{call.excinfo.typename}: {str(call.excinfo.value)[:800]}"
    run.mark(item.nodeid, {"gate": item.name, "outcome": outcome, "phase": report.when, "detail": detail})


def _outcomes_section(run: GateRun) -> dict:
    errored = run.errored()
    note = (f"{len(errored)} gate(s) ERRORED: they neither passed nor failed, so this run is not a pass. "
            if errored else "") + "error = the gate or its fixtures raised (engine died, hung, malformed answer)."
    rows = [{"gate": o["gate"], "outcome": o["outcome"].upper() if o["outcome"] == "error" else o["outcome"],
             "phase": o["phase"], "detail": o["detail"] or ""} for o in run.outcomes.values()]
    return {"rows": rows, "note": note}


# ============================================================================ flag A/B + nightly
# Options --flag-registry, --per-prompt-metrics, --ab-*; the `flag_registry` fixture; `flag_ab` items are
# deselected when no --flag is given (so the gate suite without flags neither runs nor skips them);
# per_prompt.json for the nightly's paired comparisons. The code behind them lives in the nightly package.

MARKERS["flag_ab"] = "per-flag A/B gates (gates/test_flag_ab.py); deselected unless --flag is given"


def _flag_ab_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ds41-gates flag A/B")
    group.addoption("--flag-registry", action="append", default=[],
                    help="extra flag registry TOML merged over nightly/flags.toml (repeatable; also "
                         "$DS41_FLAG_REGISTRY, os.pathsep-separated)")
    group.addoption("--ab-greedy-tokens", type=int, default=64, help="greedy tokens per prompt in the A/B")
    group.addoption("--ab-prompts-per-domain", type=int, default=1, help="greedy A/B prompts per panel domain")
    group.addoption("--ab-speed-rounds", type=int, default=3, help="alternating off/on rounds of the perf compare")
    group.addoption("--per-prompt-metrics", action="store_true", default=False,
                    help="write per_prompt.json (per-prompt mean KL_part of every engine record) to --results")


_plain_addoption = pytest_addoption


def pytest_addoption(parser: pytest.Parser) -> None:  # noqa: F811 - extends the options above
    _plain_addoption(parser)
    _flag_ab_addoption(parser)


def _check_engine_profile(config: pytest.Config) -> None:
    """--engine-profile loads (its name is checked: it becomes the engine record's file name) before any gate."""
    name = config.getoption("--engine-profile")
    if not name:
        return
    from engine.launcher import ProfileError, load_profile

    try:
        load_profile(name)
    except ProfileError as exc:
        raise pytest.UsageError(f"--engine-profile: {exc}") from None


def _check_engine_flags(config: pytest.Config) -> None:
    """An --engine-flag the profile does not define is a usage error now, before any server starts."""
    flags = config.getoption("--engine-flag")
    if not flags:
        return
    from engine.endpoint import DEFAULT_PROFILE
    from engine.launcher import ProfileError, load_profile

    name = config.getoption("--engine-profile") or DEFAULT_PROFILE
    try:
        defined = load_profile(name).flags
    except ProfileError as exc:
        raise pytest.UsageError(f"--engine-profile: {exc}") from None
    unknown = [f for f in dict.fromkeys(flags) if f not in defined]
    if unknown:
        raise pytest.UsageError(f"--engine-flag: profile {name!r} has no flag(s) {unknown}; it defines "
                                f"{sorted(defined)}")


def _check_requested_flags(config: pytest.Config) -> None:
    """An unknown --flag or a broken registry is a usage error now, before any fixture launches a server."""
    flags = config.getoption("--flag")
    if not flags:
        return
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


_plain_configure = pytest_configure


def pytest_configure(config: pytest.Config) -> None:  # noqa: F811 - extends the configure above
    _plain_configure(config)
    _check_requested_flags(config)
    _check_engine_profile(config)
    _check_engine_flags(config)
    _claim_results(config)


def _needed_by_no_flag(item: pytest.Item) -> bool:
    """An A/B gate that none of the requested flags' classes runs: pytest made it from an empty parameter set."""
    return any(str(m.kwargs.get("reason", "")).startswith("got empty parameter set") for m in item.iter_markers("skip"))


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    flags = config.getoption("--flag")
    keep, drop = [], []
    for item in items:
        unwanted = item.get_closest_marker("flag_ab") and (not flags or _needed_by_no_flag(item))
        (drop if unwanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def flag_registry(request: pytest.FixtureRequest):
    from nightly.flags import load_registry

    return load_registry(request.config.getoption("--flag-registry"))


def pytest_unconfigure(config: pytest.Config) -> None:
    run = getattr(config, "_ds41_gate_run", None)
    if run is None or run.reference is None or not run.engines or not config.getoption("--per-prompt-metrics"):
        return
    from core.atomic import write_json_atomic
    from nightly.runner import per_prompt_metrics

    write_json_atomic(run.out_dir / "per_prompt.json", per_prompt_metrics(run.reference, run.engines))
# ============================================================================ end flag A/B + nightly

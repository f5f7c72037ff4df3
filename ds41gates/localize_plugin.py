"""`pytest -m gate --localize-on-fail`: when the KL panel gate fails, localize its worst prompt (the sequence with
the largest mean KL_part) with the divergence localizer (ds41gates/localize.py) and put the verdict, the per-layer
table and the plot into the session's report (results folder, named by core.results_folder.ResultsFolder:
``localize/`` or, for a flag, ``localize-flag-<F>/``, each with ``localize.json``, ``localize.png``,
``localize.md``; results.json gate entry ``localize``; a report section and figure).

The localizer runs the profile's vLLM in process, so it needs ``--engine-profile`` (the launched engine, or the
profile of the one ``--engine-url`` points at) with the session's ``--engine-flag`` flags, and nothing else: no
engine inherits the session's environment (engine/environment.py), and a session whose environment carries the
fault injector's ``DS41_PERTURB_*`` refuses to start (ds41gates/pytest_plugin.py), so there is no planted fault
to hand on; faults are planted through ``ds41gate localize --engine-env`` only. Registered, beside
ds41gates.pytest_plugin, as a ``pytest11`` entry point of the package (pyproject.toml).
"""

from __future__ import annotations

import shutil

import pytest

from core.results import GateEntry
from ds41gates.pytest_plugin import session_of

GATE = "test_kl_panel_per_domain"
TITLE = "Divergence localizer: worst prompt of the KL panel gate"
# the flag A/B gates (gates/test_flag_ab.py): a failure is localized in A/B mode, flag on against flag off
FLAG_GATES = ("test_bitwise_panel", "test_bitwise_greedy", "test_kl_band", "test_paired_not_worse")
FLAG_TITLE = "Divergence localizer: where flag {flag} leaves the engine without it"
_FLAGS_DONE = pytest.StashKey[set]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("ds41-gates").addoption(
        "--localize-on-fail", action="store_true", default=False,
        help="when the KL panel gate fails, localize its worst prompt (first divergent site) into the report; "
             "when a flag A/B gate fails, localize where the flag-on engine leaves the flag-off one (A/B mode, "
             "its worst prompt; once per flag) (needs a vLLM --engine-profile)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    name = getattr(item, "originalname", item.name)
    if not (report.when == "call" and report.failed and item.config.getoption("--localize-on-fail")):
        return
    run = session_of(item.config).started_run
    if run is None:
        return
    if name == GATE:
        localize_failed_gate(item.config, run)
    elif name in FLAG_GATES:
        args = getattr(item, "funcargs", {})
        flag = args.get("flag_name")
        done = item.config.stash.setdefault(_FLAGS_DONE, set())
        if flag is not None and flag not in done:
            done.add(flag)
            localize_failed_flag(item.config, run, flag, args.get("panel_engine_record") or
                                 args.get("panel_reference"), args.get("on_record"))


def localize_failed_gate(config: pytest.Config, run, runner=None) -> GateEntry | None:
    """Localize the worst prompt of ``run``'s engine record (a `ds41gates.pytest_plugin.GateRun`); returns the
    entry that went into results.json. Its ``passed`` is None: the localizer explains a verdict, it is not one."""
    from ds41gates.localize import run_localize, worst_prompt, write_outputs
    from engine.endpoint import DEFAULT_PROFILE
    from panels import encoded_from_record
    from reports.localize import plot_b64, section

    runner = runner or run_localize
    if run.reference is None or not run.engines:
        return None
    _, engine_rec = run.engines[-1]
    profile = config.getoption("--engine-profile")
    if config.getoption("--engine-url") and not profile:
        run.add_section(TITLE, [], "not localized: --engine-url without --engine-profile (the localizer runs the "
                                   "profile's vLLM in process; pass the profile the server was started from)")
        return None
    profile = profile or DEFAULT_PROFILE
    seq_id, kl = worst_prompt(run.reference, engine_rec)
    seq = next(s for s in encoded_from_record(run.reference).sequences if s.seq_id == seq_id)
    source = {"kind": "panel_item", "panel": f"{run.reference.provenance.panel_name}@"
                                             f"{run.reference.provenance.panel_version}",
              "seq_id": seq_id, "domain": seq.domain, "kl_part_mean": kl, "why": "worst prompt of the KL panel gate"}
    out = run.folder.localize_dir
    try:
        rec = runner(profile, list(seq.token_ids), source, out / "work",
                     flags=tuple(dict.fromkeys(config.getoption("--engine-flag"))))["run"]
    except Exception as exc:  # noqa: BLE001 - the gate already failed; the report says why there is no localization
        run.add_section(TITLE, [], f"localizer failed on {seq_id}: {type(exc).__name__}: {str(exc)[:600]}")
        run.add(GateEntry("localize", None, failures=[f"{type(exc).__name__}: {str(exc)[:600]}"],
                          evidence={"seq_id": seq_id}))
        return None
    paths = write_outputs(rec, out)
    shutil.rmtree(out / "work" / "captures", ignore_errors=True)   # the raw rows: the record holds the distances
    sec = section(rec, label=f"{seq_id} (mean KL_part {kl:.3g})")
    run.add_section(TITLE, sec["rows"], sec["note"])
    run.plots[f"Divergence localizer: {seq_id} (distance and floor per layer)"] = plot_b64(rec)
    entry = GateEntry("localize", None, profile=profile, metrics={"kl_part_mean": kl},
                      evidence={"seq_id": seq_id, "record": str(paths["json"]), "plot": str(paths["plot"]),
                                "verdict": rec.to_dict()["verdict"]})
    run.add(entry)
    return entry


def localize_failed_flag(config: pytest.Config, run, flag: str, off_record, on_record, runner=None
                         ) -> GateEntry | None:
    """A flag A/B gate failed: localize, in A/B mode (ds41gates.localize.run_ab), where the profile with ``flag``
    leaves it without, on the panel prompt where the flag-on record is furthest from ``off_record`` (the
    flag-off engine's, or the reference's when the gate holds only that); the floor is the engine's own second
    run. The entry's ``passed`` is None: it explains the gate's verdict, it is not one."""
    from ds41gates.localize import run_ab, worst_prompt, write_outputs
    from engine.endpoint import DEFAULT_PROFILE
    from panels import encoded_from_record
    from reports.localize import plot_b64, section

    runner = runner or run_ab
    title = FLAG_TITLE.format(flag=flag)
    if on_record is None:
        run.add_section(title, [], "not localized: the failed gate holds no flag-on panel record")
        return None
    profile = config.getoption("--engine-profile") or DEFAULT_PROFILE
    if off_record is not None:
        seq_id, kl = worst_prompt(off_record, on_record)
    else:
        seq_id, kl = on_record.seq_ids[0], float("nan")
    seq = next(s for s in encoded_from_record(on_record).sequences if s.seq_id == seq_id)
    source = {"kind": "panel_item", "panel": f"{on_record.provenance.panel_name}@"
                                             f"{on_record.provenance.panel_version}",
              "seq_id": seq_id, "domain": seq.domain, "kl_part_mean_on_vs_off": kl,
              "why": f"worst prompt of flag {flag} against the flag-off engine"}
    out = run.folder.localize_flag_dir(flag)
    try:
        rec = runner(profile, list(seq.token_ids), source, out / "work", flags=[flag])["flag"]
    except Exception as exc:  # noqa: BLE001 - the gate already failed; the report says why there is no localization
        run.add_section(title, [], f"localizer failed on {seq_id}: {type(exc).__name__}: {str(exc)[:600]}")
        run.add(GateEntry("localize", None, profile=profile, flag=flag,
                          failures=[f"{type(exc).__name__}: {str(exc)[:600]}"], evidence={"seq_id": seq_id}))
        return None
    paths = write_outputs(rec, out)
    for sub in ("a/captures", "b/captures"):
        shutil.rmtree(out / "work" / sub, ignore_errors=True)
    sec = section(rec, label=f"{seq_id} (flag {flag})")
    run.add_section(title, sec["rows"], sec["note"])
    run.plots[f"Divergence localizer: flag {flag} on {seq_id}"] = plot_b64(rec)
    entry = GateEntry("localize", None, profile=profile, flag=flag, metrics={"kl_part_mean_on_vs_off": kl},
                      evidence={"seq_id": seq_id, "record": str(paths["json"]), "plot": str(paths["plot"]),
                                "verdict": rec.to_dict()["verdict"]})
    run.add(entry)
    return entry

"""`ds41gate demo`: the main job end to end, on the embedded default (SmolLM2-135M + vLLM CPU) or a profile's own model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from core.results import GateEntry, GateResults, headline
from core.results_folder import ResultsFolder
from core.verdicts import judge
from ds41gates import pipeline
from engine.endpoint import (
    DEFAULT_ENGINE_K,
    DEFAULT_PROFILE,
    endpoint_for_server,
    score_engine,
)


def demo_app(
    profile: list[str] = typer.Option([DEFAULT_PROFILE], "--profile", "-p",
                                      help="engine profile(s) to gate; repeat to compare several"),
    panel: Optional[str] = typer.Option(None, help="panel name[@version] (default: the profile's own, as the gate "
                                                   "suite uses it: 'default' for SmolLM2, 'dsv4-ci' for DeepSeek-V4)"),
    out: Optional[Path] = typer.Option(None, help="results folder (default results/<timestamp>); must be new or "
                                                   "empty: a results folder holds one run"),
    replace_results: bool = typer.Option(False, "--replace-results",
                                         help="clear an earlier run's results folder given as --out first"),
    k: int = typer.Option(DEFAULT_ENGINE_K, help="engine top-k per position"),
) -> None:
    """Oracle reference, engine run, KL panel gate and report: the profile's own model, panel, encoding and oracle,
    resolved as the gate suite resolves them (the embedded default for the SmolLM2 profiles)."""
    from rich.console import Console
    from rich.table import Table

    from engine.launcher import EngineServer
    from engine.target import one_gate_target

    profiles, checked = one_gate_target(profile)   # one reference for every engine; names and files only: no work yet
    console = Console()
    ResultsFolder.check(out, replace=replace_results, option="--out")   # refused now, before any work
    target = checked.resolve(panel)
    encoded, model_dir = target.encoded, target.model_dir
    # the inputs are resolved before the folder is claimed: a bad panel or model never costs --replace-results
    # the earlier run; the claim is this run's lock on the folder until the demo ends
    folder = ResultsFolder.claim_or_fresh(out, replace=replace_results, option="--out")
    try:
        ref, ref_path = pipeline.ensure_reference(encoded, model_dir, oracle=target.oracle,
                                                  precision=target.precision)

        engines, gates, results = [], [], GateResults()
        for prof in profiles:
            with EngineServer(prof) as server:
                eng = score_engine(endpoint_for_server(server, prof, model_dir), encoded, k)
            folder.save_engine_record(prof.name, eng)
            _, gate = judge(ref, eng, prof.name, prof.name, target.bands)
            engines.append((prof.name, eng))
            gates.append(gate)
            results = results.with_gate(GateEntry("kl_panel", gate.passed, profile=prof.name, failures=gate.failures,
                                                  metrics=headline(gate.summary)))
            folder.write_results(results)   # after every engine, as the gate suite: a crash keeps the verdicts

        paths = pipeline.write_report(ref, engines, folder.path, gates)
        table = Table(title=f"KL panel gate · {encoded.panel_name}@{encoded.panel_version} · "
                            f"{ref.n_positions} positions")
        for col in ("engine", "verdict", "KL_part mean", "KL_part macro", "top-1", "PPL ratio"):
            table.add_column(col)
        for g in gates:
            s = g.summary
            table.add_row(g.label, "[green]PASS[/]" if g.passed else "[red]FAIL[/]", f"{s['kl_part_mean']:.3g}",
                          f"{s['kl_part_macro']:.3g}", f"{s['top1']:.4f}", f"{s['ppl_ratio']:.6f}")
        console.print(table)
        for g in gates:
            for f in g.failures:
                console.print(f"  [red]{g.label}[/] {f}", highlight=False)
        console.print(f"reference: {ref_path}")
        console.print(f"report:    {paths.html}")
        console.print(f"           {paths.markdown}")
        if not all(g.passed for g in gates):
            raise typer.Exit(1)
    finally:
        folder.release()

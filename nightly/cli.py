"""`ds41gate nightly` and `ds41gate flags` (ds41gates/cli.py mounts `nightly_app` and `flags_app`).

    ds41gate nightly nightly/configs/cpu-smoke.toml [--db nightly/history.sqlite] [--out nightly/runs]
                                                    [--cell NAME ...] [--dry-run]
    ds41gate flags [--registry FILE ...] [--db nightly/history.sqlite] [--results DIR] [--class exact] [--json]
    ds41gate flags show NAME
    ds41gate flags check PROFILE [--flag NAME ...]     # refuse unknown / test-only VLLM_DS41_* (exit 1)

`nightly` exits 0 when all green, 1 on a regression against the last green baseline (each named on stderr and
in nightly.md), 2 on a bad config (like every user error), 3 on failures without a green baseline (first run,
new gates) or a cell that could not run. `flags` lists the registry with each flag's last verdict (history DB, else a results.json).
docs/NIGHTLY.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.results import FILE_NAME, GateResults, ResultsError
from nightly.flags import CLASS_GATES, CLASSES, FlagRegistryError, Registry, check_profile, load_registry

DEFAULT_DB = Path("nightly") / "history.sqlite"
DEFAULT_OUT = Path("nightly") / "runs"
EXIT_CONFIG = 2  # every user error of the harness exits 2 (core.errors)

flags_app = typer.Typer(help="The flag registry (gates.md §10.7) and each flag's last A/B verdict.",
                        invoke_without_command=True, add_completion=False)

RegistryOpt = typer.Option(None, "--registry", "--flag-registry", "-r", help="extra registry TOML merged over nightly/flags.toml (repeatable)")


def _registry(paths: Optional[List[Path]]) -> Registry:
    try:
        return load_registry(paths or [])
    except FlagRegistryError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


def _expected(reg: Registry, flag: str, cls: str = "") -> tuple[str, ...]:
    """The gates a flag's A/B must run: its registry entry's, else (a flag of another registry) its class's."""
    if flag in reg:
        return reg.get(flag).effective_gates()
    return CLASS_GATES.get(cls, ())


def last_verdicts(db: Optional[Path], results: Optional[Path], reg: Registry) -> dict[str, dict]:
    """flag → {verdict, passed, label, gates: {gate: {outcome, why}}, source}: from results.json if given, else the
    history DB. The verdict is core.results.aggregate over every gate the registry expects of the flag: an
    errored, skipped or missing gate makes it ERROR / NOT EXERCISED, never pass."""
    from nightly.history import aggregate_dict, latest_flag_verdicts

    out: dict[str, dict] = {}
    if results is not None:
        try:
            run = GateResults.load(results)
        except ResultsError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
        source = str(results / FILE_NAME if results.is_dir() else results)
        for flag in run.flags_seen():
            ab = run.flag(flag)
            agg = run.flag_aggregate(flag, _expected(reg, flag, ab.cls if ab is not None else ""))
            out[flag] = {**aggregate_dict(agg), "source": source}
        return out
    if db is not None and db.exists():
        for flag, slot in latest_flag_verdicts(db, {e.name: e.effective_gates() for e in reg}).items():
            out[flag] = {**slot, "source": f"run {slot['run_id']} ({slot['started']}) cell {slot['cell']}"}
    return out


@flags_app.callback()
def list_flags(
    ctx: typer.Context,
    registry: Optional[List[Path]] = RegistryOpt,
    db: Path = typer.Option(DEFAULT_DB, "--db", help="nightly history database"),
    results: Optional[Path] = typer.Option(None, "--results", help="read verdicts from this results dir / results.json"),
    cls: Optional[str] = typer.Option(None, "--class", help=f"only this class: {', '.join(CLASSES)}"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """List the registry's flags with class, component and last verdict."""
    ctx.obj = {"registry": registry}
    if ctx.invoked_subcommand is not None:
        return
    if cls is not None and cls not in CLASSES:
        typer.echo(f"error: --class must be one of {CLASSES}", err=True)
        raise typer.Exit(2)
    reg = _registry(registry)
    verdicts = last_verdicts(db, results, reg)
    entries = [e for e in reg if cls is None or e.cls == cls]
    if as_json:
        typer.echo(json.dumps([{**e.as_dict(), "last_verdict": verdicts.get(e.name)} for e in entries],
                              indent=2, default=str))
        return
    table = Table(title=Text(f"flag registry: {len(entries)} flags ({', '.join(Path(s).name for s in reg.sources)})"))
    for col in ("flag", "class", "kind", "component", "gates", "last verdict"):
        table.add_column(col)
    for e in entries:
        v = verdicts.get(e.name)
        if v is None:
            verdict = Text("—")
        else:
            verdict = Text(v["label"], style="green" if v["passed"] else "bold red")
        table.add_row(Text(e.name), Text(e.cls), Text(e.kind or ""), Text(e.component),
                      Text(", ".join(e.effective_gates())), verdict)
    Console(width=200).print(table)   # wide enough that a verdict naming its gates stays on one row
    unknown = sorted(set(verdicts) - set(reg.entries))
    if unknown:
        typer.echo(f"verdicts for flags not in this registry (pass --registry): {unknown}")


@flags_app.command("show")
def show(ctx: typer.Context, name: str = typer.Argument(..., help="flag name")) -> None:
    """Everything the registry says about one flag."""
    reg = _registry((ctx.obj or {}).get("registry"))
    try:
        entry = reg.get(name)
    except FlagRegistryError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(json.dumps(entry.as_dict(), indent=2, default=str))


@flags_app.command("check")
def check(ctx: typer.Context, profile: str = typer.Argument(..., help="engine profile name or .toml path"),
          flag: Optional[List[str]] = typer.Option(None, "--flag", help="flag to turn on (repeatable)")) -> None:
    """Refuse a profile with unknown / malformed / test-only VLLM_DS41_* settings (gates.md §10.1, §10.7)."""
    from engine.launcher import ProfileError, load_profile

    reg = _registry((ctx.obj or {}).get("registry"))
    try:
        prof = load_profile(profile)
    except ProfileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    result = check_profile(prof, reg, flag or [])
    for k, v in result.ds41_env.items():
        typer.echo(f"  {k}={v}")
    if not result.ok:
        for p in result.problems:
            typer.echo(f"REFUSED: {p}", err=True)
        raise typer.Exit(1)
    typer.echo(f"profile {prof.name}: ok ({len(result.ds41_env)} VLLM_DS41_* set, flags {list(flag or [])})")


def nightly_app(
    config: Path = typer.Argument(..., help="nightly matrix TOML (docs/NIGHTLY.md)"),
    db: Path = typer.Option(DEFAULT_DB, "--db", help="SQLite history database (created if absent)"),
    out: Path = typer.Option(DEFAULT_OUT, "--out", help="folder for this run's results (one subfolder per run)"),
    cell: Optional[List[str]] = typer.Option(None, "--cell", help="run only these cells (repeatable)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print each cell's pytest command and exit"),
) -> None:
    """Run the nightly gate matrix (profiles × flag sets), record history, exit non-zero on regression."""
    from core.redact import redact, redact_command
    from nightly.runner import NightlyConfigError, cell_argv, load_config, register_config_secrets, run_nightly

    try:
        cfg = load_config(config)
        register_config_secrets(cfg)   # everything printed below goes through core.redact
        if dry_run:
            for c in cfg.cells:
                if not cell or c.name in cell:
                    typer.echo(redact(f"{c.name}: " + redact_command(cell_argv(cfg, c, out / "<run>" / c.name))))
            return
        result = run_nightly(cfg, db, out, only=cell or ())
    except NightlyConfigError as exc:
        typer.echo(f"error: {redact(str(exc))}", err=True)
        raise typer.Exit(EXIT_CONFIG)
    typer.echo(redact(f"nightly {cfg.name}: run {result.run_id} {result.status.upper()} -> "
                      f"{result.out_dir / 'nightly.md'}"))
    for f in result.findings:
        typer.echo(redact(f.line()), err=f.kind in ("regression", "new-failure", "error"))
    if result.regressions:
        typer.echo(f"REGRESSION: {len(result.regressions)} against the last green baseline", err=True)
    raise typer.Exit(result.exit_code)

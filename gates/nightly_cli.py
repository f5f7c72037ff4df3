"""`ds41gate nightly CONFIG`: run the matrix, store the history, compare with the last green run, alert.

    ds41gate nightly nightly/cpu-smoke.toml [--db nightly/history.sqlite] [--out nightly/runs] [--cell NAME ...]
                                            [--dry-run]

Exit 0: all green. 1: regression against the last green baseline (each named on stderr and in nightly.md).
2: failures without a green baseline (first run, new gates) or a cell that could not run. 3: bad config.
`nightly_app` is a plain function; ds41gates/cli.py mounts it as `ds41gate nightly`. docs/NIGHTLY.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

DEFAULT_DB = Path("nightly") / "history.sqlite"
DEFAULT_OUT = Path("nightly") / "runs"
EXIT_CONFIG = 3


def nightly_app(
    config: Path = typer.Argument(..., help="nightly matrix TOML (docs/NIGHTLY.md)"),
    db: Path = typer.Option(DEFAULT_DB, "--db", help="SQLite history database (created if absent)"),
    out: Path = typer.Option(DEFAULT_OUT, "--out", help="folder for this run's results (one subfolder per run)"),
    cell: Optional[List[str]] = typer.Option(None, "--cell", help="run only these cells (repeatable)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print each cell's pytest command and exit"),
) -> None:
    """Run the nightly gate matrix (profiles × flag sets), record history, exit non-zero on regression."""
    from reports.nightly import NightlyConfigError, cell_argv, load_config, run_nightly

    try:
        cfg = load_config(config)
        if dry_run:
            for c in cfg.cells:
                if not cell or c.name in cell:
                    typer.echo(f"{c.name}: " + " ".join(cell_argv(cfg, c, out / "<run>" / c.name)))
            return
        result = run_nightly(cfg, db, out, only=cell or ())
    except NightlyConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_CONFIG)
    typer.echo(f"nightly {cfg.name}: run {result.run_id} {result.status.upper()} -> {result.out_dir / 'nightly.md'}")
    for f in result.findings:
        typer.echo(f.line(), err=f.kind in ("regression", "new-failure", "error"))
    if result.regressions:
        typer.echo(f"REGRESSION: {len(result.regressions)} against the last green baseline", err=True)
    raise typer.Exit(result.exit_code)

"""`ds41gate report REFERENCE ENGINE_RECORD [MORE ...] [--out DIR] [--label NAME ...]`.

`report_app` is a plain function; ds41gates/cli.py mounts it with `app.command(name="report")`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.errors import UserError, one_line
from core.metrics import score_panel
from core.records import Record, RecordError
from core.redact import redact
from reports.render import ReportError, build_report, fmt, fmt_ci, fmt_p, fmt_pct


def default_labels(paths: list[Path]) -> list[str]:
    """File stems, made unique by appending #2, #3 ... to repeats."""
    labels, seen = [], {}
    for p in paths:
        stem = p.stem or p.name
        seen[stem] = seen.get(stem, 0) + 1
        labels.append(stem if seen[stem] == 1 else f"{stem}#{seen[stem]}")
    return labels


def require_side(rec: Record, side: str, path: Path, argument: str) -> None:
    """A record given in the wrong place (engine as reference, oracle as engine) is refused: swapped, it
    would still give a number."""
    if rec.provenance.side != side:
        raise RecordError(f"{path}: {argument} must be an {side} record, this one was written by the "
                          f"{rec.provenance.side} side (are REFERENCE and ENGINE swapped?)")


def check_out_folder(out: Path) -> None:
    """--out must be a folder (or not exist yet), and not the results folder of a gate run: a report of other
    records written there would be read as that run's report."""
    from core.results_folder import ResultsFolder

    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out}: exists and is not a folder (--out takes a folder for report.json/.md/.html)")
    blocker = next((p for p in out.parents if p.exists() or p.is_symlink()), None)
    if not out.exists() and blocker is not None and not blocker.is_dir():
        raise ReportError(f"--out {out}: {blocker} is a file, not a folder")
    run = ResultsFolder.of(out)
    if out.is_dir() and run.holds_a_run():
        raise ReportError(f"--out {out}: is the results folder of a gate run (it holds {run.results_file.name} or "
                          f"{run.marker_file.name}); "
                          "a report of these records there would read as that run's report — choose another --out")


def summary_table(data: dict) -> Table:
    """Metrics down, records across (the seed cards' layout); every cell is a rich Text, so record text
    is never read as markup."""
    table = Table(title=Text(data["title"]))
    table.add_column("metric")
    for e in data["engines"]:
        table.add_column(Text(e["label"]), justify="right")
    pvals = {}
    if data["comparison"]:
        for c in data["comparison"]["candidates"]:
            pvals[c["label"]] = fmt_p(c["overall"]["kl_part"]["wilcoxon_p"])

    def row(name: str, fn) -> None:
        table.add_row(Text(name), *[Text(fn(e, e["metrics"]["overall"])) for e in data["engines"]])

    row("positions", lambda e, o: fmt(o["n_positions"]))
    row("KL_part mean", lambda e, o: fmt(o["kl_part"]["mean"]))
    row("  95% CI", lambda e, o: fmt_ci(o["kl_part"]["ci_low"], o["kl_part"]["ci_high"]))
    row("KL_part domain-macro", lambda e, o: fmt(e["metrics"]["macro"]["kl_part"]))
    row("KL_r20 mean (imputed)", lambda e, o: f"{fmt(o['kl_r20']['mean'])} ({fmt_pct(o['r20_imputation_rate'])})")
    row("top-1 all", lambda e, o: fmt_pct(o["top1"]))
    row("top-1 decided", lambda e, o: fmt_pct(o["top1_decided"]))
    row("PPL eng / ref", lambda e, o: fmt(o["perplexity"].get("ratio"), 5))
    row("hard fails", lambda e, o: fmt(o["hard_fails"]))
    if pvals:
        row("Wilcoxon p vs first", lambda e, o: pvals.get(e["label"], "baseline"))
    return table


def report_app(
    reference: Path = typer.Argument(..., help="the reference (oracle) record, a .safetensors file"),
    engine_records: List[Path] = typer.Argument(..., help="one or more engine records; the first is the baseline"),
    out: Path = typer.Option(Path("ds41-report"), "--out", "-o", help="folder for report.json/.md/.html"),
    label: Optional[List[str]] = typer.Option(None, "--label", "-l",
                                              help="a name per engine record, in order (default: file stems)"),
    n_boot: int = typer.Option(2000, "--n-boot", min=100, help="bootstrap resamples"),
    seed: int = typer.Option(0, "--seed", help="bootstrap seed"),
    noise_floor: Optional[Path] = typer.Option(
        None, "--noise-floor",
        help="the oracle's other-precision record (e.g. reference-bf16 beside an fp32 reference); its KL is shown "
             "next to every engine's"),
) -> None:
    """Score engine records against a reference record and write the panel report (JSON, Markdown, HTML)."""
    console = Console()
    labels = list(label) if label else default_labels(list(engine_records))
    if len(labels) != len(engine_records):
        raise typer.BadParameter(f"{len(labels)} --label value(s) for {len(engine_records)} engine record(s); "
                                 "give one per record or none", param_hint="--label")
    try:
        check_out_folder(out)
        ref = Record.load(reference)
        require_side(ref, "oracle", reference, "REFERENCE")
        engines = []
        for lb, p in zip(labels, engine_records):
            rec = Record.load(p)
            require_side(rec, "engine", p, "ENGINE")
            engines.append((lb, rec))
        floor = None
        if noise_floor is not None:
            floor_rec = Record.load(noise_floor)
            floor = (f"oracle {floor_rec.provenance.precision}", floor_rec)
        paths = build_report(score_panel(ref, engines, floor, n_boot, seed), out)
    except UserError as exc:
        typer.echo(f"error: {redact(one_line(exc))}", err=True)
        raise typer.Exit(code=2)
    except OSError as exc:
        if not exc.filename:
            raise
        typer.echo(f"error: {exc.filename}: {exc.strerror or exc} (--out {out})", err=True)
        raise typer.Exit(code=2)
    data = json.loads(paths.json.read_text(encoding="utf-8"))
    console.print(summary_table(data))
    for kind, path in (("json", paths.json), ("markdown", paths.markdown), ("html", paths.html)):
        console.print(Text(f"{kind:9s} {path}"), soft_wrap=True)

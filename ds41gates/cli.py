"""`ds41gate`: the command-line entry point. Each package contributes its own sub-app."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="ds41-gates: gate LLM serving engine changes against an fp32 oracle.",
                  no_args_is_help=True, add_completion=False)



@app.callback()
def _root() -> None:
    """ds41-gates: gate LLM serving engine changes against an fp32 oracle."""


@app.command()
def version() -> None:
    """Print the harness version."""
    from ds41gates import __version__

    typer.echo(__version__)


# (module, attribute, command name): sub-apps are mounted when their package provides them.
SUB_APPS = [
    ("panels.cli", "panel_app", "panel"),
    ("oracle.cli", "oracle_app", "oracle"),
    ("reports.cli", "report_app", "report"),
    ("nightly.cli", "flags_app", "flags"),
    ("nightly.cli", "nightly_app", "nightly"),
    ("ds41gates.demo", "demo_app", "demo"),
]

for module_name, attr, name in SUB_APPS:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            continue  # that part is not built yet
        raise
    sub = getattr(module, attr)
    if isinstance(sub, typer.Typer):
        app.add_typer(sub, name=name)
    else:
        app.command(name=name)(sub)


if __name__ == "__main__":
    app()

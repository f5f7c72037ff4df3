"""`ds41gate`: the command-line entry point. Each package contributes its own sub-app."""

from __future__ import annotations

import importlib

import typer

# rich_markup_mode=None: click's plain help, for the root and every mounted sub-app (they inherit it). typer's
# rich help prints `<bool>` beside every flag as if it took a value (typer 0.29); the plain help shows a flag as
# a flag and a valued option with its type
app = typer.Typer(help="ds41-gates: gate LLM serving engine changes against an fp32 oracle.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)



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
    ("ds41gates.evals", "eval_app", "eval"),
    ("ds41gates.evals", "eval_compare_app", "eval-compare"),
    ("ds41gates.evals", "ifeval_panel_app", "ifeval-panel"),
    ("ds41gates.localize", "localize_cmd", "localize"),
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


def main(argv: list[str] | None = None) -> int:
    """The console entry point: a user error is one line on stderr and exit code 2, an engine that failed to give
    an answer a verdict may rest on (unreachable, timed out, malformed) one line and exit code 3, every known
    secret redacted; any other exception is a harness bug and keeps its traceback."""
    import sys

    from core.errors import UserError, one_line
    from core.redact import redact
    from engine.errors import EngineError

    try:
        app(args=argv, prog_name="ds41gate", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except UserError as exc:
        print(f"error: {redact(one_line(exc))}", file=sys.stderr, flush=True)
        return 2
    except EngineError as exc:
        print(f"error: {redact(one_line(exc))}", file=sys.stderr, flush=True)
        return 3
    except OSError as exc:
        if not exc.filename:
            raise
        # a file or folder the user named cannot be read or written (unwritable --out, missing input)
        print(f"error: {redact(str(exc.filename))}: {redact(exc.strerror or str(exc))}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

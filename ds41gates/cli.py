"""`ds41gate`: the command-line entry point. Each package contributes its own sub-app."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Optional

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


@app.command()
def serve(
    profile: Optional[str] = typer.Argument(None, help="a shipped profile name or a .toml path (none: list them)"),
    flag: list[str] = typer.Option([], "--flag", help="turn on a profile flag (repeatable)"),
    port: Optional[int] = typer.Option(None, "--port", help="serve on this port instead of the profile's"),
    list_profiles: bool = typer.Option(False, "--list", help="list the shipped profiles"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved command and environment, and exit"),
) -> None:
    """Start an engine from its profile, print its URL, serve until Ctrl-C, then stop its whole process group."""
    import sys
    import time

    from core.redact import redact
    from engine.launcher import EngineServer, EngineStartError, redact_argv, redact_env, resolve
    from engine.profiles import available_profiles, load_profile
    from engine.supervise import log_tail

    if list_profiles or profile is None:
        typer.echo("\n".join(available_profiles()))
        return
    overrides = {"port": port} if port is not None else None
    if dry_run:
        spec = resolve(load_profile(profile).with_overrides(overrides), flag)
        typer.echo(" ".join(redact_argv(spec.argv)))
        for key, value in redact_env(spec.env).items():
            typer.echo(f"  {key}={value}")
        return
    try:
        with EngineServer(profile, overrides=overrides, flags=flag) as srv:
            typer.echo(f"{srv.base_url}  model={srv.served_model}  log={srv.log_path}")
            while srv.running():
                time.sleep(1.0)
            print(f"server exited; log tail:\n{log_tail(srv.log_path)}", file=sys.stderr)
            raise typer.Exit(1)
    except EngineStartError as exc:   # the engine's own failure (its log tail included): not the user's input
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command()
def rehash(paths: list[Path] = typer.Argument(..., help="record files (.safetensors) you trust")) -> None:
    """Write content_sha256 into trusted old records (made before records carried it); one line per file.
    A record that fails any other check stays refused."""
    from core.records import rehash as rehash_record

    for path in paths:
        typer.echo(f"{path}: content_sha256 {rehash_record(path)}")


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
    ("ds41gates.setup", "setup_app", "setup"),
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

"""`ds41gate panel list | show NAME | stats NAME [--tokenizer smollm2|deepseek|PATH]`."""

from __future__ import annotations

from dataclasses import dataclass

import typer
from rich.console import Console
from rich.table import Table

from panels.chat import ChatFormatError
from panels.encode import encode_panel
from panels.model import EncodedPanel, Panel, PanelError
from panels.store import list_panels, load_panel
from panels.tokenizers import TokenizerError, load_tokenizer

panel_app = typer.Typer(help="Versioned, immutable prompt panels.", no_args_is_help=True, add_completion=False)


def _console() -> Console:
    return Console(width=120)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


@dataclass(frozen=True)
class DomainStats:
    domain: str
    items: int
    tokens: int
    scored: int


def domain_stats(panel: Panel, enc: EncodedPanel) -> list[DomainStats]:
    out = []
    for d in panel.domains():
        seqs = [s for s in enc.sequences if s.domain == d]
        out.append(DomainStats(d, len(seqs), sum(len(s.token_ids) for s in seqs), sum(s.n_scored for s in seqs)))
    return out


@panel_app.command("list")
def list_cmd() -> None:
    """Published panels with their content hashes."""
    try:
        infos = list_panels()
    except PanelError as e:
        _fail(str(e))
    t = Table(title="panels")
    for col in ("panel", "content hash", "description"):
        t.add_column(col, overflow="fold")
    for i in infos:
        t.add_row(f"{i.name}@{i.version}", i.content_hash, i.description)
    _console().print(t)


@panel_app.command("show")
def show_cmd(name: str = typer.Argument(..., help="NAME or NAME@VERSION")) -> None:
    """A panel's items (the hash is verified on load)."""
    try:
        panel = load_panel(name)
    except PanelError as e:
        _fail(str(e))
    c = _console()
    c.print(f"[bold]{panel.ref}[/bold]  {panel.content_hash}  (verified)")
    if panel.description:
        c.print(panel.description)
    t = Table()
    for col in ("id", "domain", "kind", "score", "lang", "messages", "chars"):
        t.add_column(col)
    for it in panel.items:
        chars = len(it.text or "") + sum(len(m.content) for m in it.messages)
        t.add_row(it.id, it.domain, it.kind, it.score, it.lang or "", str(len(it.messages) or ""), str(chars))
    c.print(t)
    if any(it.tokens is not None for it in panel.items):
        c.print(_depth_table(panel.items, "token lengths (built in the DeepSeek tokenizer) and scored positions "
                                          "per depth bucket"))


def _depth_table(items, title: str, lengths: dict[str, int] | None = None) -> Table:
    """One row per long item: its exact token length and its scored positions per depth bucket (core/depth.py).
    `lengths`: the encoded lengths (stats), else the lengths the items were built to (show)."""
    from core.depth import BUCKET_LABELS
    from panels.long import bucket_counts

    t = Table(title=title)
    for col in ("id", "tokens", "scored", *BUCKET_LABELS):
        t.add_column(col, justify="left" if col == "id" else "right", no_wrap=col == "id")
    for it in items:
        if it.tokens is None:
            continue
        n = lengths[it.id] if lengths is not None else it.tokens
        counts = bucket_counts(it.positions, n)
        t.add_row(it.id, str(n), str(len(it.positions)), *(str(counts[b]) for b in BUCKET_LABELS))
    return t


@panel_app.command("stats")
def stats_cmd(
    name: str = typer.Argument(..., help="NAME or NAME@VERSION"),
    tokenizer: str = typer.Option("smollm2", "--tokenizer", "-t", help="smollm2, deepseek, or a model/tokenizer dir"),
    allow_split_markers: bool = typer.Option(
        False, help="Count anyway when the tokenizer lacks a special token the chat format writes"
    ),
) -> None:
    """Items and scored positions per domain for one tokenizer."""
    try:
        panel = load_panel(name)
        tok = load_tokenizer(tokenizer)
        enc = encode_panel(panel, tok, allow_split_markers=allow_split_markers)
    except (PanelError, TokenizerError, ChatFormatError) as e:
        _fail(str(e))
    rows = domain_stats(panel, enc)
    mean = sum(r.scored for r in rows) / len(rows)
    t = Table(title=f"{panel.ref} with {tok.name} ({tok.chat_format.name})")
    for col in ("domain", "items", "tokens", "scored", "vs mean"):
        t.add_column(col, justify="left" if col == "domain" else "right")
    for r in rows:
        t.add_row(r.domain, str(r.items), str(r.tokens), str(r.scored), f"{(r.scored / mean - 1) * 100:+.0f}%")
    t.add_row(
        "total",
        str(sum(r.items for r in rows)),
        str(sum(r.tokens for r in rows)),
        str(sum(r.scored for r in rows)),
        "",
        style="bold",
    )
    c = _console()
    c.print(t)
    c.print(f"panel hash {panel.content_hash}")
    c.print(f"tokenizer hash {tok.hash}")
    if any(it.tokens is not None for it in panel.items):
        lengths = {s.seq_id: len(s.token_ids) for s in enc.sequences}
        c.print(_depth_table(panel.items, f"token lengths in {tok.name} and scored positions per depth bucket",
                             lengths))
    for note in enc.notes:
        c.print(f"[yellow]note:[/yellow] {note}")

"""The main job, step by step: panel → oracle record → engine record → metrics → verdict → report.

Both `ds41gate demo` and the pytest gate fixtures call these functions, so the demo and the gate
suite run the same code path. IO (servers, files) stays here; metrics and verdicts are pure.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Sequence

from core.paths import cache_dir
from core.records import Record, RecordError, RecordMismatch
from core.verdicts import PanelGateResult
from engine.models import default_model_dir

DEFAULT_PANEL = "default"
ORACLE_TOP_K = 256


def _echo(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]ds41[/] {msg}", highlight=False)


# ----------------------------------------------------------------------------- panel and reference

def encode_default_panel(panel: str = DEFAULT_PANEL, model_dir: Path | None = None):
    """Encode a panel with the model's own tokenizer and chat template (the model folder's files)."""
    from panels import encode_panel, load_panel, load_tokenizer

    model_dir = model_dir or default_model_dir()
    return encode_panel(load_panel(panel), load_tokenizer(model_dir))


def reference_path(encoded, model_hash: str, top_k: int = ORACLE_TOP_K) -> Path:
    ph = encoded.panel_hash.split(":")[-1][:12]
    th = encoded.tokenizer_hash.split(":")[-1][:12]
    mh = model_hash.split(":")[-1][:12]
    name = f"{encoded.panel_name}@{encoded.panel_version}-{ph}-tok{th}-model{mh}-k{top_k}.safetensors"
    return cache_dir() / "references" / name


def ensure_reference(encoded, model_dir: Path, top_k: int = ORACLE_TOP_K) -> tuple[Record, Path]:
    """Load the cached fp32 reference for (panel, tokenizer, model), or build it (resumably) and cache it."""
    from oracle.hf import model_hash, score_panel_hf

    path = reference_path(encoded, model_hash(model_dir), top_k)
    if path.exists():
        try:
            ref = Record.load(path)
        except RecordError as exc:
            raise RecordError(f"{exc} — this is the cached oracle reference; delete it to rebuild: rm {path}") \
                from None
        if ref.provenance.panel_hash == encoded.panel_hash and ref.provenance.tokenizer_hash == encoded.tokenizer_hash:
            _echo(f"oracle reference (cached): {path}")
            return ref, path
        raise RecordMismatch(f"{path}: cached reference does not match panel/tokenizer; delete it to rebuild")
    _echo(f"building the fp32 oracle reference for {encoded.panel_name}@{encoded.panel_version} "
          f"({len(encoded.sequences)} sequences) …")
    partial = path.with_suffix(".partial.d")  # per-sequence checkpoints: a killed run resumes here
    # one thread: on a shared 2-core box two threads were 14x slower than one (docs/RELIABILITY.md)
    ref = score_panel_hf(model_dir, encoded, top_k=top_k, checkpoint_dir=partial, progress=False, threads=1)
    ref.save(path)
    _echo(f"oracle reference written: {path}")
    return ref, path


def common_sequences(ref: Record, engines: Sequence[tuple[str, Record]]) -> tuple[Record, list, list[dict]]:
    """Reference and engine records restricted to the sequences every engine scored, plus the exclusions."""
    common = set(ref.seq_ids)
    for _, eng in engines:
        common &= set(eng.seq_ids)
    rows = [{"engine": label, "sequence": sid, "reason": why}
            for label, eng in engines for sid, why in eng.provenance.extra.get("excluded_sequences", {}).items()]
    if common == set(ref.seq_ids) and all(set(e.seq_ids) == common for _, e in engines):
        return ref, list(engines), rows
    return ref.subset(common), [(label, eng.subset(common)) for label, eng in engines], rows


# ----------------------------------------------------------------------------- verdict and report

def write_report(ref: Record, engines: Sequence[tuple[str, Record]], out_dir: Path,
                 gate_results: Sequence["PanelGateResult"] = (), extra: dict | None = None):
    from reports.render import build_report

    sections = dict(extra or {})
    ref, engines, excluded = common_sequences(ref, engines)
    if excluded:
        sections["Sequences left out of the comparison"] = {
            "rows": excluded, "note": "text-only engines cannot be sent these ids exactly; every record in this "
                                      "report is restricted to the sequences all engines scored"}
    if gate_results:
        rows = []
        for g in gate_results:
            for r in g.rows:
                rows.append({"engine": g.label, "profile": g.profile, **r})
        sections["KL panel gate verdicts"] = {
            "rows": rows, "note": "pass rule of gates.md §3; bands in gates/bands.toml"}
    return build_report(ref, list(engines), out_dir, extra=sections)


def results_dir(base: str | os.PathLike | None = None) -> Path:
    if base:
        path = Path(base)
    else:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("results") / stamp
    path.mkdir(parents=True, exist_ok=True)
    return path

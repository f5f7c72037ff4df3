"""The main job, step by step: panel → oracle record → engine record → metrics → verdict → report.

Both `ds41gate demo` and the pytest gate fixtures call these functions, so the demo and the gate
suite run the same code path. IO (servers, files) stays here; metrics and verdicts are pure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from core.console import echo
from core.paths import cache_dir, safe_name
from core.records import Record, RecordError, RecordMismatch
from core.verdicts import PanelGateResult
from engine.models import default_model_dir
from oracle.kinds import long_context_kinds, oracle_kind

DEFAULT_PANEL = "default"
ORACLE_TOP_K = 256


# ----------------------------------------------------------------------------- panel and reference

def encode_default_panel(panel: str = DEFAULT_PANEL, model_dir: Path | None = None):
    """Encode a panel with the model's own tokenizer and chat template (the model folder's files)."""
    from panels import encode_panel, load_panel, load_tokenizer

    model_dir = model_dir or default_model_dir()
    return encode_panel(load_panel(panel), load_tokenizer(model_dir))


def reference_path(encoded, identity: str, top_k: int = ORACLE_TOP_K, *, oracle: str = "transformers",
                   precision: str = "fp32") -> Path:
    """The cache file of the reference `oracle` writes over `encoded`, named by the oracle and its own identity
    of what it loads (oracle.kinds: OracleKind.identity — the weight files' hash for transformers, the checkpoint
    build's identity for deepseek, as its provenance's checkpoint_hash) and the precision it computes in."""
    safe_name(f"{encoded.panel_name}@{encoded.panel_version}", "panel name")   # part of a cache file name
    safe_name(f"{oracle}-{precision}", "oracle name")
    ph = encoded.panel_hash.split(":")[-1][:12]
    th = encoded.tokenizer_hash.split(":")[-1][:12]
    ih = identity.split(":")[-1][:12]
    name = f"{encoded.panel_name}@{encoded.panel_version}-{ph}-tok{th}-{oracle}-{ih}-{precision}-k{top_k}.safetensors"
    return cache_dir() / "references" / name


def ensure_reference(encoded, model_dir: Path, top_k: int = ORACLE_TOP_K,
                     oracle: str = "transformers", precision: str = "fp32") -> tuple[Record, Path]:
    """Load the cached reference `oracle` wrote for (panel, tokenizer, what it loads, precision), or build it
    (resumably) and cache it. `oracle`: a kind of oracle.kinds.ORACLE_KINDS; `precision` one of its
    gate_precisions."""
    kind = oracle_kind(oracle)
    kind.check_gate_precision(precision)
    identity = kind.identity(Path(model_dir))
    path = reference_path(encoded, identity.value, top_k, oracle=kind.name, precision=precision)
    if path.exists():
        return _cached_reference(path, encoded, "oracle reference"), path
    echo(f"building the {precision} {kind.name} oracle reference for {encoded.panel_name}@{encoded.panel_version} "
          f"({len(encoded.sequences)} sequences) …")
    partial = path.with_suffix(".partial.d")  # per-sequence / per-layer checkpoints: a killed run resumes here
    # one thread: on a shared 2-core box two threads were 14x slower than one (docs/RELIABILITY.md)
    ref = kind.oracle(identity, Path(model_dir), partial, precision=precision, top_k=top_k, threads=1).score(encoded)
    ref.save(path)
    import shutil

    shutil.rmtree(partial, ignore_errors=True)  # only for resuming an interrupted run
    echo(f"oracle reference written: {path}")
    return ref, path


def _cached_reference(path: Path, encoded, label: str) -> Record:
    """The cached reference at `path`, refused (naming the file and how to rebuild) when unreadable or when it was
    made for another panel or tokenizer."""
    try:
        ref = Record.load(path)
    except RecordError as exc:
        raise RecordError(f"{exc} — this is the cached oracle reference; delete it to rebuild: rm {path}") from None
    if ref.provenance.panel_hash != encoded.panel_hash or ref.provenance.tokenizer_hash != encoded.tokenizer_hash:
        raise RecordMismatch(f"{path}: cached reference does not match panel/tokenizer; delete it to rebuild")
    echo(f"{label} (cached): {path}")
    return ref


def ensure_long_reference(encoded, model_dir: Path, precision: str = "fp32", top_k: int = ORACLE_TOP_K,
                          oracle: str | None = None) -> tuple[Record, Path]:
    """The long-context reference of `encoded` by `oracle` (a kind with OracleKind.long_context; None: the one
    registered kind that has it), cached beside the other references under the name ``<kind>-long``; built
    (resumably, one sequence at a time) when missing."""
    if oracle is None:
        (oracle,) = long_context_kinds()
    kind = oracle_kind(oracle).check_long_context()
    identity = kind.identity(Path(model_dir))
    path = reference_path(encoded, identity.value, top_k, oracle=f"{kind.name}-long", precision=precision)
    if path.exists():
        return _cached_reference(path, encoded, "long-context oracle reference"), path
    echo(f"building the {precision} long-context {kind.name} oracle reference for {encoded.panel_name}@"
          f"{encoded.panel_version} ({len(encoded.sequences)} sequences) …")
    # one thread, as ensure_reference (a shared 2-core box)
    ref = kind.long_reference(identity, encoded, path, path.with_suffix(".partial.d"), precision=precision,
                              top_k=top_k, threads=1)
    echo(f"long-context oracle reference written: {path}")
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
                 gate_results: Sequence["PanelGateResult"] = (), extra: dict | None = None,
                 plots: dict | None = None, errored: Sequence[str] = (), coverage: Sequence = ()):
    """The report set; it opens with each engine's KL-panel verdict, and an ERROR row naming the gates that
    `errored` (neither passed nor failed: no PASS can stand beside them). Each engine's metrics are the ones its
    gate verdict carries (`PanelGateResult.pair`); only an engine no gate scored on exactly these sequences
    (none judged it, or the report restricts it to the sequences every engine scored) is scored here."""
    from core.metrics import panel_evidence, score_pair
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
                rows.append({"engine": g.label, "profile": g.profile, **r, "bands file": g.bands_file or "?"})
        files = sorted({g.bands_file or "?" for g in gate_results})
        sections["KL panel gate verdicts"] = {
            "rows": rows, "note": "pass rule of gates.md §3; bands file (the profile's [gate] table names it): "
                                  + ", ".join(files)}
    carried = {g.label: g.pair for g in gate_results if g.pair is not None}
    pairs = [carried[label] if label in carried and carried[label].scores(ref, eng) else score_pair(ref, label, eng)
             for label, eng in engines]
    verdicts = [{"engine": g.label, "verdict": "PASS" if g.passed else "FAIL", "why": "; ".join(g.failures[:3])}
                for g in gate_results]
    if errored:
        verdicts.append({"engine": "gate session", "verdict": "ERROR",
                         "why": f"{len(errored)} gate(s) errored: {', '.join(errored[:5])}"})
    # the coverage rule beside the verdicts (core/flag_coverage.py): a flag the run never reached is no PASS
    verdicts += [{"engine": f"flag {c.flag}", "verdict": c.verdict.upper(), "why": c.why}
                 for c in coverage if c.verdict != "not declared"]
    return build_report(panel_evidence(pairs), out_dir, extra=sections, extra_plots=plots, verdicts=verdicts)



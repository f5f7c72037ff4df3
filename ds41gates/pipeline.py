"""The main job, step by step: panel → oracle record → engine record → metrics → verdict → report.

Both `ds41gate demo` and the pytest gate fixtures call these functions, so the demo and the gate
suite run the same code path. IO (servers, files) stays here; metrics and verdicts are pure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from core.paths import cache_dir, claim_results_dir, fresh_results_dir, safe_name
from core.records import Record, RecordError, RecordMismatch
from core.verdicts import PanelGateResult
from engine.models import default_model_dir

DEFAULT_PANEL = "default"
ORACLE_TOP_K = 256


@dataclass(frozen=True)
class ServedModel:
    """What a profile that does not serve the embedded SmolLM2 serves, and what it is gated on: the model
    folder (built on demand), the panel and the tokenizer spec its panel is encoded with, and the oracle that
    writes its fp32 reference."""

    model: str        # key of MODEL_BUILDERS
    panel: str
    tokenizer: str    # panels.load_tokenizer spec
    oracle: str       # "deepseek": oracle/dsv41 (its V4 mode, fp32); "transformers": oracle/hf.py


# The tiny DeepSeek-V4 checkpoint on vLLM CPU's DeepSeek-V4 path: the dsv4-ci panel in the DeepSeek chat
# encoding, referenced by the DeepSeek oracle's V4 mode in fp32 (transformers' DeepseekV4 is the second
# opinion beside it in the report, docs/ORACLE.md).
SERVED_MODELS: dict[str, ServedModel] = {
    "vllm-cpu-dsv4": ServedModel(model="dsv4-tiny", panel="dsv4-ci", tokenizer="deepseek", oracle="deepseek"),
    # exllamav3 on a CUDA GPU (docs/EXLLAMAV3.md): the same model, panel and tokenizer; an EXL3 profile's KL
    # reference decodes its own EXL3 folder (oracle/dsv41/exllamav3_pack.py) and is passed as --reference
    "exllamav3-dsv4-bf16": ServedModel(model="dsv4-tiny", panel="dsv4-ci", tokenizer="deepseek", oracle="deepseek"),
    "exllamav3-dsv4-exl3": ServedModel(model="dsv4-tiny", panel="dsv4-ci", tokenizer="deepseek", oracle="deepseek"),
    "exllamav3-dsv4-exl3-b2": ServedModel(model="dsv4-tiny", panel="dsv4-ci", tokenizer="deepseek",
                                          oracle="deepseek"),
}


def _dsv4_tiny() -> Path:
    from engine.dsv4_model import ensure_dsv4_tiny

    return Path(ensure_dsv4_tiny())


MODEL_BUILDERS = {"dsv4-tiny": _dsv4_tiny}


def served_model(profile: str | None) -> ServedModel | None:
    """The profile's own model, or None for the profiles that serve the embedded default (SmolLM2)."""
    return SERVED_MODELS.get(profile or "")


def profile_model_dir(profile: str | None) -> Path:
    """The model folder the profile serves (the embedded default unless SERVED_MODELS names another)."""
    sm = served_model(profile)
    return MODEL_BUILDERS[sm.model]() if sm is not None else default_model_dir()


def encode_profile_panel(profile: str | None, panel: str | None = None):
    """The panel a profile is gated on, encoded as its model reads it -> (EncodedPanel, model folder, oracle)."""
    from panels import encode_panel, load_panel, load_tokenizer

    sm = served_model(profile)
    if sm is None:
        model_dir = default_model_dir()
        return encode_default_panel(panel or DEFAULT_PANEL, model_dir), model_dir, "transformers"
    return (encode_panel(load_panel(panel or sm.panel), load_tokenizer(sm.tokenizer)), profile_model_dir(profile),
            sm.oracle)


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
    safe_name(f"{encoded.panel_name}@{encoded.panel_version}", "panel name")   # part of a cache file name
    ph = encoded.panel_hash.split(":")[-1][:12]
    th = encoded.tokenizer_hash.split(":")[-1][:12]
    mh = model_hash.split(":")[-1][:12]
    name = f"{encoded.panel_name}@{encoded.panel_version}-{ph}-tok{th}-model{mh}-k{top_k}.safetensors"
    return cache_dir() / "references" / name


def ensure_reference(encoded, model_dir: Path, top_k: int = ORACLE_TOP_K,
                     oracle: str = "transformers") -> tuple[Record, Path]:
    """Load the cached fp32 reference for (panel, tokenizer, model), or build it (resumably) and cache it.
    `oracle`: "transformers" (oracle/hf.py) or "deepseek" (the layer-streamed DeepSeek oracle, oracle/dsv41)."""
    from oracle.hf import model_hash, score_panel_hf

    if oracle not in ("transformers", "deepseek"):
        raise ValueError(f"oracle {oracle!r}: expected 'transformers' or 'deepseek'")
    path = reference_path(encoded, model_hash(model_dir), top_k)
    if oracle == "deepseek":
        path = path.with_name(path.stem + "-deepseek.safetensors")
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
    if oracle == "deepseek":
        from oracle.dsv41.checkpoint import Checkpoint
        from oracle.dsv41.runner import RunOptions, run_panel

        ref = run_panel(Checkpoint(model_dir), encoded, partial,
                        RunOptions(precision="fp32", threads=1, top_k=top_k, progress=False))
        import shutil

        ref.save(path)
        shutil.rmtree(partial, ignore_errors=True)  # layer activations: only for resuming an interrupted run
    else:
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
                 gate_results: Sequence["PanelGateResult"] = (), extra: dict | None = None,
                 plots: dict | None = None, errored: Sequence[str] = ()):
    """The report set; it opens with each engine's KL-panel verdict, and an ERROR row naming the gates that
    `errored` (neither passed nor failed: no PASS can stand beside them)."""
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
    verdicts = [{"engine": g.label, "verdict": "PASS" if g.passed else "FAIL", "why": "; ".join(g.failures[:3])}
                for g in gate_results]
    if errored:
        verdicts.append({"engine": "gate session", "verdict": "ERROR",
                         "why": f"{len(errored)} gate(s) errored: {', '.join(errored[:5])}"})
    return build_report(ref, list(engines), out_dir, extra=sections, extra_plots=plots, verdicts=verdicts)


def results_dir(base: str | os.PathLike | None = None, replace: bool = False, option: str = "--results") -> Path:
    """The folder of this run, holding this run only: `base` claimed (core.paths.claim_results_dir: created,
    or empty, or — with `replace` — an earlier results folder cleared first; anything else a ResultsDirError),
    else a fresh `results/<timestamp>[-N]`."""
    if base:
        return claim_results_dir(base, replace=replace, option=option)
    return fresh_results_dir(Path("results"))

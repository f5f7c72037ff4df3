"""The main job, step by step: panel → oracle record → engine record → metrics → verdict → report.

Both `ds41gate demo` and the pytest gate fixtures call these functions, so the demo and the gate
suite run the same code path. IO (servers, files) stays here; metrics and verdicts are pure.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ds41gates.paths import cache_dir
from ds41gates.records import Record, RecordMismatch

DEFAULT_PANEL = "default"
DEFAULT_PROFILE = "vllm-cpu-fp32"
DEFAULT_ENGINE_K = 20
ORACLE_TOP_K = 256


def _echo(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]ds41[/] {msg}", highlight=False)


# ----------------------------------------------------------------------------- panel and reference

def default_model_dir() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct as an HF fp32 folder (built offline, cached)."""
    from engine.models import ensure_smollm2

    return Path(ensure_smollm2().hf_dir)


def encode_default_panel(panel: str = DEFAULT_PANEL, model_dir: Path | None = None):
    """Encode a panel with the model's own tokenizer and chat template (the model folder's files)."""
    from panels import encode_panel, load_panel, load_tokenizer

    model_dir = model_dir or default_model_dir()
    return encode_panel(load_panel(panel), load_tokenizer(model_dir))


def encoded_from_reference(ref: Record):
    """The sequences a reference scored, as an EncodedPanel: the engine gets exactly the oracle's ids."""
    from panels import EncodedPanel, EncodedSequence

    seqs = []
    for i, sid in enumerate(ref.seq_ids):
        lo, hi = int(ref.seq_offsets[i]), int(ref.seq_offsets[i + 1])
        seqs.append(EncodedSequence(sid, ref.domains[i], tuple(int(t) for t in ref.token_ids[lo:hi]),
                                    tuple(bool(b) for b in ref.scored[lo:hi])))
    p = ref.provenance
    return EncodedPanel(p.panel_name, int(p.panel_version) if str(p.panel_version).isdigit() else p.panel_version,
                        p.panel_hash, p.tokenizer_hash, tuple(seqs))


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
        ref = Record.load(path)
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


# ----------------------------------------------------------------------------- engine

@dataclass(frozen=True)
class EngineEndpoint:
    """An engine that is serving: launched here from a profile, or given by URL."""

    base_url: str
    model: str
    profile: str
    engine: str = "vllm"
    flags: tuple[str, ...] = ()
    precision: str = "unknown"
    env_flags: Mapping[str, str] = field(default_factory=dict)
    vocab_size: int | None = None  # lets adapters ask for the full distribution (llama.cpp servers)
    tokenizer_dir: str | None = None  # the served model's tokenizer, for text-only engines (llama-cpp-python)


def default_vocab_size(model_dir: Path | None = None) -> int:
    """Vocabulary of the embedded default model, which every shipped CPU profile serves."""
    config = json.loads(((model_dir or default_model_dir()) / "config.json").read_text())
    return int(config["vocab_size"])


def text_of_ids(tokenizer_dir: str | os.PathLike):
    """ids → text with special tokens kept, from the model's own tokenizer.json (no engine involved)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False)


def vocab_strings(tokenizer_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Each id's own string as a string-keyed server renders it (invalid UTF-8 dropped, specials empty)
    → every id that renders so. A string of several ids is a key collision."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    out: dict[str, list[int]] = {}
    for i in range(tok.get_vocab_size()):
        out.setdefault(tok.decode([i], skip_special_tokens=True).replace("\ufffd", ""), []).append(i)
    return {k: tuple(v) for k, v in out.items()}


def adapter_for(engine: str, vocab_size: int | None = None, tokenizer_dir: str | os.PathLike | None = None):
    from engine.adapters.llamacpp import LlamaCppPythonAdapter, LlamaServerAdapter
    from engine.adapters.sglang import SglangAdapter
    from engine.adapters.vllm import VllmAdapter

    table = {"vllm": VllmAdapter, "sglang": SglangAdapter, "llama-server": LlamaServerAdapter,
             "llama-cpp-python": LlamaCppPythonAdapter}
    if engine not in table:
        raise ValueError(f"unknown engine kind {engine!r}; known: {sorted(table)}")
    if engine == "llama-cpp-python" and tokenizer_dir is not None:
        config = Path(tokenizer_dir) / "config.json"
        bos = json.loads(config.read_text()).get("bos_token_id") if config.is_file() else None
        return table[engine](vocab_size=vocab_size, text_of=text_of_ids(tokenizer_dir), bos_id=bos,
                             vocab_strings=vocab_strings(tokenizer_dir))
    return table[engine](vocab_size=vocab_size)


def client_for(endpoint: EngineEndpoint, max_concurrency: int = 1):
    from engine.client import ClientConfig, EngineClient

    return EngineClient(ClientConfig(base_url=endpoint.base_url, model=endpoint.model,
                                     api_key=os.environ.get("DS41_ENGINE_API_KEY", "unused"),
                                     max_concurrency=max_concurrency),
                        adapter=adapter_for(endpoint.engine, endpoint.vocab_size, endpoint.tokenizer_dir))


def precision_of(profile) -> str:
    args = list(profile.args)
    if "--dtype" in args and args.index("--dtype") + 1 < len(args):
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(args[args.index("--dtype") + 1],
                                                                             args[args.index("--dtype") + 1])
    for a in args:
        if a.endswith(".gguf"):
            return Path(a).stem.split(".")[-1].lower()
    for a in args:
        for tag in ("q4_1", "f32"):
            if tag in a.lower():
                return tag
    return "unknown"


def text_only_exclusions(client, encoded) -> dict[str, str]:
    """Sequences a text-only engine cannot be sent faithfully: their ids are not what its own tokenizer
    makes of their text (engines.md §10 rule 10). Empty for engines that take token ids."""
    from engine.errors import TokenRoundTripError

    text_for = getattr(client.adapter, "text_for", None)
    if text_for is None:
        return {}
    out = {}
    for seq in encoded.sequences:
        try:
            text_for(client, seq.seq_id, list(seq.token_ids))
        except TokenRoundTripError as exc:
            out[seq.seq_id] = str(exc)
    return out


def score_engine(endpoint: EngineEndpoint, encoded, k: int = DEFAULT_ENGINE_K, stats=None) -> Record:
    """Panel positions scored by the engine (concurrency 1: batch effects belong to their own gate).

    A text-only engine scores only the sequences whose ids survive its tokenizer; the others are named
    in the record's provenance (`extra.excluded_sequences`) and every comparison restricts to the
    sequences both sides hold. Never a silent drop: the report lists them.
    """
    import dataclasses as _dc

    from engine.client import EngineSource, score_panel

    client = client_for(endpoint, max_concurrency=1)
    try:
        source = EngineSource(url=endpoint.base_url, model=endpoint.model, profile=endpoint.profile,
                              flags=list(endpoint.flags), precision=endpoint.precision)
        excluded = text_only_exclusions(client, encoded)
        if excluded:
            kept = tuple(s for s in encoded.sequences if s.seq_id not in excluded)
            if not kept:
                raise ValueError(f"engine {endpoint.profile}: no panel sequence survives its text tokenizer")
            _echo(f"{endpoint.profile}: {len(excluded)} of {len(encoded.sequences)} sequences cannot be sent "
                  f"as text with their exact ids; scoring the other {len(kept)}")
            encoded = _dc.replace(encoded, sequences=kept)
        rec = score_panel(client, encoded, k, source, max_concurrency=1, stats=stats)
        if excluded:
            rec.provenance = _dc.replace(rec.provenance,
                                         extra={**rec.provenance.extra, "excluded_sequences": excluded})
        return rec
    finally:
        client.close()


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

@dataclass
class PanelGateResult:
    label: str
    profile: str
    passed: bool
    failures: list[str]
    rows: list[dict]
    summary: dict[str, Any]


def judge(ref: Record, eng: Record, profile: str, label: str, bands_file: Path | None = None):
    from ds41gates import metrics
    from ds41gates.bands import judge_panel, load_bands

    if set(eng.seq_ids) != set(ref.seq_ids):
        ref = ref.subset(eng.seq_ids)  # a text-only engine's record names what it left out
    result = metrics.panel_metrics(ref, eng)
    verdict = judge_panel(result, load_bands(profile, bands_file), profile)
    o = result.overall
    summary = {"kl_part_mean": o.kl_part.mean, "kl_part_macro": result.macro_kl, "top1": o.top1,
               "ppl_ratio": o.perplexity.get("ratio"), "positions": o.n_positions, "prompts": o.n_prompts}
    return result, PanelGateResult(label, profile, verdict.passed, verdict.failures(), verdict.as_rows(), summary)


def write_report(ref: Record, engines: Sequence[tuple[str, Record]], out_dir: Path,
                 gate_results: Sequence[PanelGateResult] = (), extra: dict | None = None):
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


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)

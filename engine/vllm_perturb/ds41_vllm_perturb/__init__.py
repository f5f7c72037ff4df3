"""Test-only fault injection for vLLM: scale the output of ONE sub-module (attention or MLP/MoE) of ONE decoder
layer by (1 + DS41_PERTURB_SCALE), 1e-3 by default: a fault small enough that the KL panel barely moves, which the
divergence localizer (engine/localize_runner.py) must nevertheless name exactly.

Loaded by vLLM in every process through its plugin mechanism (entry point group ``vllm.general_plugins``,
installed into the engine venv by scripts/setup-vllm.sh). ``register()`` does nothing unless
``DS41_PERTURB_LAYER`` (a decoder-layer index; negative counts from the end) and ``DS41_PERTURB_MODULE``
(``attn`` | ``mlp``) are set; then the model loader is wrapped so that the freshly loaded model gets one forward
hook. A process that already holds a model turns the fault on, moves it or turns it off with
``configure(model, layer, module)`` through ``LLM.apply_model`` (the localizer's CI session does so, so one engine
process serves every planted case).

Imports only torch and vLLM; never the harness.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV_LAYER = "DS41_PERTURB_LAYER"
ENV_MODULE = "DS41_PERTURB_MODULE"
ENV_SCALE = "DS41_PERTURB_SCALE"
DEFAULT_SCALE = 1e-3
MODULES = ("attn", "mlp")
# sub-module attribute names, per role, in the order they are tried (Llama-likes, DeepSeek, others)
ROLE_NAMES = {"attn": ("self_attn", "attn", "attention"), "mlp": ("mlp", "ffn", "feed_forward", "moe")}

_ATTR = "_ds41_perturb"     # on the model: {"handle", "layer", "module", "scale", "target"}
_patched = False


class PerturbError(ValueError):
    pass


def _say(msg: str) -> None:
    print(f"[ds41-perturb pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def decoder_layers(model) -> tuple[str, Any]:
    """(qualified name, ModuleList) of the model's decoder layers: the longest ModuleList named ``layers``."""
    import torch

    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(mod):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise PerturbError(f"{type(model).__name__}: no ModuleList named 'layers' (decoder layers) found")
    return best


def role_module(layer, role: str) -> tuple[str, Any]:
    for attr in ROLE_NAMES[role]:
        sub = getattr(layer, attr, None)
        if sub is not None:
            return attr, sub
    raise PerturbError(f"{type(layer).__name__} has none of {ROLE_NAMES[role]} ({role})")


def _scaled(scale: float):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] * (1.0 + scale),) + tuple(output[1:])
        return output * (1.0 + scale)
    return hook


def configure(model, layer: int | None, module: str | None = None, scale: float = DEFAULT_SCALE) -> dict:
    """Turn the fault off (``layer`` None) or put it on ``module`` of decoder layer ``layer``; returns what is
    perturbed now (``target`` None when nothing)."""
    state = getattr(model, _ATTR, None)
    if state is not None and state.get("handle") is not None:
        state["handle"].remove()
    info: dict = {"target": None, "layer": None, "module": None, "scale": None, "pid": os.getpid()}
    if layer is not None:
        if module not in MODULES:
            raise PerturbError(f"{ENV_MODULE}={module!r}: expected one of {MODULES}")
        name, layers = decoder_layers(model)
        n = len(layers)
        idx = int(layer)
        if not -n <= idx < n:
            raise PerturbError(f"{ENV_LAYER}={layer}: the model has {n} decoder layers ({name})")
        idx %= n
        attr, sub = role_module(layers[idx], module)
        # prepended: the fault is part of the module's output, so any other hook (the localizer's capture)
        # sees the perturbed tensor
        handle = sub.register_forward_hook(_scaled(float(scale)), prepend=True)
        info = {"target": f"{name}.{idx}.{attr}", "class": type(sub).__name__, "layer": idx, "module": module,
                "scale": float(scale), "n_layers": n, "pid": os.getpid()}
        setattr(model, _ATTR, {**info, "handle": handle})
    else:
        setattr(model, _ATTR, {**info, "handle": None})
    return info


def status(model) -> dict:
    state = getattr(model, _ATTR, None) or {"target": None}
    return {k: v for k, v in state.items() if k != "handle"}


def from_env(environ=os.environ) -> tuple[int, str, float] | None:
    layer, module = environ.get(ENV_LAYER, "").strip(), environ.get(ENV_MODULE, "").strip()
    if not layer and not module:
        return None
    if not layer or not module:
        raise PerturbError(f"set both {ENV_LAYER} and {ENV_MODULE} (got {layer!r}, {module!r})")
    if module not in MODULES:
        raise PerturbError(f"{ENV_MODULE}={module!r}: expected one of {MODULES}")
    try:
        return int(layer), module, float(environ.get(ENV_SCALE, DEFAULT_SCALE))
    except ValueError as exc:
        raise PerturbError(f"{ENV_LAYER}/{ENV_SCALE}: {exc}") from None


def register() -> None:
    """vLLM's general-plugin entry point (called in every process, possibly more than once)."""
    global _patched
    wanted = from_env()
    if wanted is None or _patched:
        return
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        layer, module, scale = wanted
        info = configure(model, layer, module, scale)
        _say(f"perturbing {info['target']} ({info['class']}) output by 1{scale:+g} relative")
        return model

    BaseModelLoader.load_model = load_model
    _patched = True

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

``DS41_PERTURB_FROM_POS=N`` (optional) confines the fault to the rows of tokens at absolute position >= N: a fault
only long context can see (issue 39; every short panel scores positions below N and stays clean). The positions come
from the model's own ``forward(input_ids, positions, ...)``, read by a pre-hook on the loaded model; a chunked
prefill or a decode step carries absolute positions, so the threshold holds across chunks.

Imports only torch and vLLM; never the harness.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV_LAYER = "DS41_PERTURB_LAYER"
ENV_MODULE = "DS41_PERTURB_MODULE"
ENV_SCALE = "DS41_PERTURB_SCALE"
ENV_FROM_POS = "DS41_PERTURB_FROM_POS"
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


def _scale_rows(out, scale: float, positions, from_pos: int | None):
    """``out`` scaled by (1 + scale): every row, or only the rows whose token sits at position >= from_pos."""
    if from_pos is None:
        return out * (1.0 + scale)
    if positions is None:
        raise PerturbError(f"{ENV_FROM_POS}={from_pos}: the model's forward passed no positions to the plugin")
    flat = positions.reshape(-1)
    if out.shape[0] != flat.shape[0]:
        # a module whose rows are not one per token: scaling by a guessed mapping would plant an unknown fault
        raise PerturbError(f"{ENV_FROM_POS}={from_pos}: module output has {out.shape[0]} rows for "
                           f"{flat.shape[0]} token positions")
    factor = 1.0 + scale * (flat >= from_pos).to(out.dtype)
    return out * factor.reshape((-1,) + (1,) * (out.dim() - 1))


def _scaled(scale: float, seen: dict, from_pos: int | None):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (_scale_rows(output[0], scale, seen.get("positions"), from_pos),) + tuple(output[1:])
        return _scale_rows(output, scale, seen.get("positions"), from_pos)
    return hook


def _positions_of(seen: dict):
    """A pre-hook on the whole model keeping the positions of the tokens of the current forward call (vLLM
    models take ``forward(input_ids, positions, ...)``)."""
    def pre_hook(module, args, kwargs):
        seen["positions"] = kwargs.get("positions", args[1] if len(args) > 1 else None)
    return pre_hook


def configure(model, layer: int | None, module: str | None = None, scale: float = DEFAULT_SCALE,
              from_pos: int | None = None) -> dict:
    """Turn the fault off (``layer`` None) or put it on ``module`` of decoder layer ``layer`` (with ``from_pos``,
    only on the rows of tokens at position >= from_pos); returns what is perturbed now (``target`` None when
    nothing)."""
    state = getattr(model, _ATTR, None)
    for key in ("handle", "pos_handle"):
        if state is not None and state.get(key) is not None:
            state[key].remove()
    if from_pos is not None and (isinstance(from_pos, bool) or int(from_pos) < 0):
        raise PerturbError(f"{ENV_FROM_POS}={from_pos}: expected a position >= 0")
    info: dict = {"target": None, "layer": None, "module": None, "scale": None, "from_pos": None,
                  "pid": os.getpid()}
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
        seen: dict = {}
        pos_handle = None
        if from_pos is not None:
            from_pos = int(from_pos)
            pos_handle = model.register_forward_pre_hook(_positions_of(seen), with_kwargs=True, prepend=True)
        handle = sub.register_forward_hook(_scaled(float(scale), seen, from_pos), prepend=True)
        info = {"target": f"{name}.{idx}.{attr}", "class": type(sub).__name__, "layer": idx, "module": module,
                "scale": float(scale), "from_pos": from_pos, "n_layers": n, "pid": os.getpid()}
        setattr(model, _ATTR, {**info, "handle": handle, "pos_handle": pos_handle})
    else:
        setattr(model, _ATTR, {**info, "handle": None, "pos_handle": None})
    return info


def status(model) -> dict:
    state = getattr(model, _ATTR, None) or {"target": None}
    return {k: v for k, v in state.items() if k not in ("handle", "pos_handle")}


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


def from_pos_from_env(environ=os.environ) -> int | None:
    """DS41_PERTURB_FROM_POS as a position (None when unset: the fault applies at every position)."""
    raw = environ.get(ENV_FROM_POS, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise PerturbError(f"{ENV_FROM_POS}={raw!r}: expected a position >= 0 (a base-10 integer)")
    return int(raw)


def register() -> None:
    """vLLM's general-plugin entry point (called in every process, possibly more than once)."""
    global _patched
    wanted = from_env()
    if wanted is None or _patched:
        return
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    from_pos = from_pos_from_env()

    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        layer, module, scale = wanted
        info = configure(model, layer, module, scale, from_pos)
        where = "" if from_pos is None else f" at positions >= {from_pos}"
        _say(f"perturbing {info['target']} ({info['class']}) output by 1{scale:+g} relative{where}")
        return model

    BaseModelLoader.load_model = load_model
    _patched = True

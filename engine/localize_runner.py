"""The divergence localizer's engine side, in process. Runs INSIDE the vLLM environment and imports only torch,
safetensors and vLLM (plus the fault-injection plugin when a case asks for one), never the harness:

    <vllm python> -m engine.localize_runner request.json

request.json::

    {"engine_args": ["--model", DIR, "--dtype", "float32", ...],   # the profile's own vLLM arguments
     "prompt_ids": [ids...], "decode": true,                        # prefill, then one decode step
     "sites": ["attn", "mlp", "resid"], "layers": null,             # what to capture (null = every layer)
     "cases": [{"name": "clean", "perturb": null},                  # fault off
               {"name": "L3.mlp", "perturb": {"layer": 3, "module": "mlp", "scale": 1e-3}},
               {"name": "env", "perturb": "env"}],                  # leave what DS41_PERTURB_* set at load
     "out_dir": DIR, "report": PATH}

One ``vllm.LLM`` is built from the engine arguments (prefix caching off, so every case computes the prompt
again; eager, because forward hooks do not fire inside a compiled graph). Everything that touches the model goes
through ``LLM.apply_model(fn)``, which runs ``fn(model)`` in every worker and returns one result per worker:
forward hooks are put on each decoder layer and on its attention and MLP/MoE sub-modules, the prompt is
generated greedily for 2 tokens (the prefill forward, then one decode forward), and each worker hands back the
captured rows (fp32, CPU). Per case, one ``<out_dir>/<name>.safetensors`` holds ``prefill/L<i>.<site>`` [n, d]
and ``decode/L<i>.<site>`` [1, d].

Sites: ``attn`` = the attention module's output (o_proj, before the residual add), ``mlp`` = the MLP/MoE output
(down projection / expert sum, before the add), ``resid`` = the full residual stream leaving the layer. vLLM's
decoder layers return ``(hidden_states, residual)`` with the last add deferred into the next layer's fused
add-RMSNorm, so the stream is rebuilt as their sum; the fused norm also works IN PLACE, so every capture is
cloned inside its hook. A layer that returns one tensor (hyper-connection streams [n, hc, d] included) is
captured as it is.

Tensor / pipeline parallel (the GPU box): each TP rank's hooked outputs are the all-reduced ones (row-parallel
o_proj / down_proj reduce before returning), so every TP rank holds the same rows and the first worker's are
kept; PP ranks hold their own layers, so the per-worker dicts are merged key by key. The callables handed to
``apply_model`` are module-level functions (``functools.partial``), so they pickle by reference when the engine
core runs in another process (VLLM_ALLOW_INSECURE_SERIALIZATION=1 is set for that case).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback

SITES = ("attn", "mlp", "resid")
_ATTR = "_ds41_capture"
ROLE_NAMES = {"attn": ("self_attn", "attn", "attention"), "mlp": ("mlp", "ffn", "feed_forward", "moe")}


# -- functions run on the model inside each worker (through LLM.apply_model) -----------------------------------

def decoder_layers(model):
    import torch

    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(mod):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise RuntimeError(f"{type(model).__name__}: no ModuleList named 'layers' (decoder layers) found")
    return best


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _stream(layer, out):
    """The full residual stream leaving a decoder layer: (hidden, residual) summed, a single tensor as is. DeepSeek
    V4's mHC layers return (x, residual, post_mix, res_mix) with the last hc_post deferred into the next layer's
    fused post+pre: the streams are that hc_post, computed here with the layer's own op (it does not write its
    inputs: vLLM itself calls it on the same tensors for its aux hidden states); unfused, x is the streams."""
    if isinstance(out, (tuple, list)):
        if len(out) == 4 and hasattr(layer, "hc_post"):
            return out[0] if out[2] is None else layer.hc_post(out[0], out[1], out[2], out[3])
        h, r = out[0], (out[1] if len(out) > 1 else None)
        return h if r is None else h + r
    return out


def install(model, sites=SITES, layers=None) -> dict:
    """Hooks on the decoder layers' sites; captures accumulate per forward call until take()."""
    remove(model)
    name, mods = decoder_layers(model)
    wanted = set(range(len(mods))) if layers is None else {int(i) % len(mods) for i in layers}
    store: dict[str, list] = {}
    handles = []
    names = {}

    def keep(key, t):
        store.setdefault(key, []).append(t.detach().to("cpu", dtype=__import__("torch").float32, copy=True))

    for i, layer in enumerate(mods):
        if i not in wanted:
            continue
        if "resid" in sites:
            handles.append(layer.register_forward_hook(
                lambda m, a, out, k=f"L{i}.resid": keep(k, _stream(m, out))))
        for role in ("attn", "mlp"):
            if role not in sites:
                continue
            for attr in ROLE_NAMES[role]:
                sub = getattr(layer, attr, None)
                if sub is not None:
                    names[role] = attr
                    handles.append(sub.register_forward_hook(
                        lambda m, a, out, k=f"L{i}.{role}": keep(k, _first_tensor(out))))
                    break
            else:
                raise RuntimeError(f"{type(layer).__name__}: none of {ROLE_NAMES[role]} for site {role!r}")
    setattr(model, _ATTR, {"handles": handles, "store": store})
    return {"layers_module": name, "n_layers": len(mods), "layer_class": type(mods[0]).__name__,
            "site_modules": names, "captured_layers": sorted(wanted), "pid": os.getpid()}


def take(model) -> dict:
    """{key: [rows of each forward call]} captured since the last take(); clears them."""
    state = getattr(model, _ATTR, None)
    if state is None:
        return {}
    out = {k: list(v) for k, v in state["store"].items()}
    state["store"].clear()
    return out


def remove(model) -> None:
    state = getattr(model, _ATTR, None)
    if state is not None:
        for h in state["handles"]:
            h.remove()
        setattr(model, _ATTR, None)


def perturb(model, spec) -> dict:
    """The fault-injection plugin's state for this case: ``spec`` None = off, a dict = on there, "env" = as the
    plugin's environment variables left it at load."""
    try:
        import ds41_vllm_perturb as plugin
    except ImportError:
        if spec is None or spec == "env":
            return {"target": None, "plugin": "not installed"}
        raise
    if spec == "env":
        return plugin.status(model)
    if spec is None:
        return plugin.configure(model, None)
    return plugin.configure(model, spec["layer"], spec["module"], spec.get("scale", plugin.DEFAULT_SCALE))


# -- the driver ------------------------------------------------------------------------------------------------

def _merge(per_worker: list[dict]) -> dict:
    """TP ranks: identical rows, keep the first; PP ranks: disjoint layers, union."""
    merged: dict = {}
    for d in per_worker:
        for k, v in d.items():
            merged.setdefault(k, v)
    return merged


def build_llm(engine_args: list[str]):
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns, ignored = parser.parse_known_args(engine_args)
    ea = EngineArgs.from_cli_args(ns)
    ea.enable_prefix_caching = False  # every case must compute the prompt itself
    ea.enforce_eager = True           # hooks do not fire inside a compiled graph
    return LLM.from_engine_args(ea), ignored


def run(request: dict) -> dict:
    import torch
    import vllm
    from safetensors.torch import save_file
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm, ignored = build_llm(request["engine_args"])
    report: dict = {"vllm": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "ignored_args": ignored, "load_s": time.perf_counter() - t0, "cases": {}}
    sites = SITES if request.get("sites") is None else tuple(request["sites"])   # [] = no hooks (a plain run)
    info = _merge([{"x": r} for r in llm.apply_model(functools.partial(install, sites=sites,
                                                                       layers=request.get("layers")))])["x"]
    report["model"] = info
    ids = [int(t) for t in request["prompt_ids"]]
    n = len(ids)
    steps = 2 if request.get("decode", True) else 1
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, detokenize=False)
    os.makedirs(request["out_dir"], exist_ok=True)
    for case in request["cases"]:
        rec: dict = {}
        try:
            rec["perturb"] = _merge([{"x": r} for r in llm.apply_model(
                functools.partial(perturb, spec=case.get("perturb")))])["x"]
            llm.apply_model(take)  # nothing from before this case
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            rec["generate_s"] = time.perf_counter() - t
            gen = list(out[0].outputs[0].token_ids)
            rec["generated_ids"] = gen
            calls = _merge(llm.apply_model(take))
            tensors = {}
            calls_seen = None
            for key, parts in calls.items():
                rows = torch.cat([p.reshape(p.shape[0], -1) if p.dim() > 2 else p for p in parts], dim=0)
                shape = list(parts[0].shape[1:])
                calls_seen = [int(p.shape[0]) for p in parts]
                if rows.shape[0] < n + (steps - 1):
                    raise RuntimeError(f"{key}: {rows.shape[0]} rows captured for {n} prompt tokens "
                                       f"(+{steps - 1} decode); calls {calls_seen}")
                tensors[f"prefill/{key}"] = rows[:n].reshape([n] + shape).contiguous()
                if steps > 1:
                    tensors[f"decode/{key}"] = rows[n:n + 1].reshape([1] + shape).contiguous()
            rec["rows_per_call"] = calls_seen
            path = os.path.join(request["out_dir"], f"{case['name']}.safetensors")
            save_file(tensors, path)
            rec["file"] = path
            rec["tensors"] = len(tensors)
        except Exception as e:  # noqa: BLE001 - recorded per case, the harness raises it
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc(limit=8)
        report["cases"][case["name"]] = rec
    llm.apply_model(remove)
    report["total_s"] = time.perf_counter() - t0
    with open(request["report"], "w") as fh:
        json.dump(report, fh, indent=1)
    return report


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m engine.localize_runner request.json", file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        run(json.load(fh))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    sys.exit(main(sys.argv[1:]))

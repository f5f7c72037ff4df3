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
forward hooks are put on each decoder layer and on its attention and MLP/MoE sub-modules, and the prompt is
generated greedily for 2 tokens (the prefill forward, then one decode forward). Per case, one
``<out_dir>/<name>.safetensors`` holds ``prefill/L<i>.<site>`` [n, d] and ``decode/L<i>.<site>`` [1, d] (fp32).

Memory: one site's rows at a time, in the worker and in the driver. A hook keeps nothing: as it fires it writes
its capture (fp32, CPU) to the case's spill folder ``<out_dir>/<name>.spill/`` as one small safetensors file per
layer, site and forward call, ``L<i>.<site>.c<call>.safetensors`` (tensor ``rows``; written to ``.tmp`` and
renamed). After generate the driver assembles ``<name>.safetensors`` from the spill one site at a time: the
header from the spill files' headers, then per site its call files read, concatenated, split into the prefill
rows and the decode row and appended to the file, and deleted; the spill folder goes with the last of them.

Sites: ``attn`` = the attention module's output (o_proj, before the residual add), ``mlp`` = the MLP/MoE output
(down projection / expert sum, before the add), ``resid`` = the full residual stream leaving the layer. vLLM's
decoder layers return ``(hidden_states, residual)`` with the last add deferred into the next layer's fused
add-RMSNorm, so the stream is rebuilt as their sum; the fused norm also works IN PLACE, so every capture is
copied (and written) inside its hook. A layer that returns one tensor (hyper-connection streams [n, hc, d]
included) is captured as it is.

Tensor / pipeline parallel (the GPU box): each TP rank's hooked outputs are the all-reduced ones (row-parallel
o_proj / down_proj reduce before returning), so every TP rank holds the same rows and only rank 0 of the TP group
writes its spill (the other ranks' hooks write nothing); PP ranks hold their own layers (a layer another PP rank
owns is a ``PPMissingLayer`` here and gets no hook), so every PP rank writes its own layers' files into the same
spill folder (the workers share the host's file system; the names never collide). The callables handed to
``apply_model`` are module-level functions (``functools.partial``), so they pickle by reference when the engine
core runs in another process (VLLM_ALLOW_INSECURE_SERIALIZATION=1 is set for that case).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import time
import traceback

from engine.inproc import request_main, write_report

SITES = ("attn", "mlp", "resid")           # per decoder layer
# DeepSeek-V4's, where a layer has them
STREAM_SITES = ("attn_in", "compressor", "attn_stream", "ffn_in", "indexer", "router", "router_weights")
OUTER_SITES = ("embed", "final_norm", "logits")   # before layer 0 and after the last
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


def outer_modules(model, layers_name: str) -> dict:
    """The embedding and the final norm: the modules beside the decoder layers (``model.embed_tokens`` and
    ``model.norm`` for Llama-likes and DeepSeek-V4); a role this rank does not hold (PP) is left out."""
    parent = model.get_submodule(layers_name.rsplit(".", 1)[0]) if "." in layers_name else model
    found = {}
    for role, names in (("embed", ("embed_tokens", "embed", "wte")), ("final_norm", ("norm", "final_layernorm",
                                                                                       "ln_f"))):
        for attr in names:
            sub = getattr(parent, attr, None)
            if sub is not None and callable(sub) and type(sub).__name__ != "PPMissingLayer":
                found[role] = (attr, sub)
                break
    return found


def parent_of(model, layers_name: str):
    return model.get_submodule(layers_name.rsplit(".", 1)[0]) if "." in layers_name else model


def _install_stream_sites(layer, i: int, sites, keep, handles: list, parent) -> dict:
    """DeepSeek-V4's own sites, where the layer has them (mHC layers): ``attn_in`` / ``ffn_in`` the sub-layer's
    input (its hc_pre mix of the streams, normed: the attn_norm / ffn_norm output), ``attn_stream`` the streams
    between attention and MoE (the attention's hc_post: the first of the layer's two mhc_post calls; the second
    is the layer's output, ``resid``), ``indexer`` the compressed blocks each query selected (the model's shared
    top-k index buffer as the layer's attention leaves it, -1 padded; compared as sets). The fused post+pre path
    (tilelang, not on CPU) has no separate mhc_post call: there ``attn_stream`` is not captured."""
    found = {}
    for site, attr in (("attn_in", "attn_norm"), ("ffn_in", "ffn_norm")):
        sub = getattr(layer, attr, None)
        if site in sites and sub is not None:
            handles.append(sub.register_forward_hook(lambda m, a, out, k=f"L{i}.{site}": keep(k, _first_tensor(out))))
            found[site] = attr
    post = getattr(layer, "mhc_post", None)
    if "attn_stream" in sites and post is not None and not getattr(layer, "use_fused_mhc", False):
        calls = {"n": 0}
        handles.append(layer.register_forward_pre_hook(lambda m, a: calls.update(n=0)))

        def after_post(m, a, out, k=f"L{i}.attn_stream"):
            if calls["n"] == 0:
                keep(k, _first_tensor(out))
            calls["n"] += 1
        handles.append(post.register_forward_hook(after_post))
        found["attn_stream"] = "mhc_post (first call)"
    ffn = getattr(layer, "ffn", None)
    want_routing = {"router", "router_weights"} & set(sites)
    router = _router_of(ffn) if want_routing and ffn is not None else None
    if router is not None:
        def on_routing(weights, ids, n_experts, kr=f"L{i}.router", kw=f"L{i}.router_weights"):
            if "router" in sites:
                keep(kr, ids)
            if "router_weights" in sites:
                keep(kw, dense_routing(weights, ids, n_experts))
        handles.append(_RoutingTap(router, on_routing))
        for site in sorted(want_routing):
            found[site] = f"{type(router).__name__}._compute_routing"
    attn = getattr(layer, "attn", None)
    comp = getattr(attn, "compressor", None)
    if "compressor" in sites and getattr(comp, "k_cache_prefix", None) and \
            getattr(comp, "head_dim", None) == FP8_DS_MLA["dim"]:
        handles.append(comp.register_forward_hook(
            lambda m, a, out, k=f"L{i}.compressor": keep(k, functools.partial(compressed_entries, m, a[1]))))
        found["compressor"] = f"{type(comp).__name__}: the compressed KV entries it wrote (fp8_ds_mla, decoded)"
    buf = getattr(parent, "topk_indices_buffer", None)
    if "indexer" in sites and buf is not None and getattr(attn, "indexer", None) is not None:
        handles.append(attn.register_forward_hook(
            lambda m, a, out, k=f"L{i}.indexer": keep(k, buf[:_first_tensor(out).shape[0]])))
        found["indexer"] = "topk_indices_buffer after attn"
    return found


def _router_of(ffn):
    """vLLM's MoE router object under a MoE module (the one whose ``_compute_routing`` returns the chosen
    experts), or None."""
    import torch

    for mod in ffn.modules() if isinstance(ffn, torch.nn.Module) else ():
        for cand in (mod, getattr(mod, "router", None)):
            if cand is not None and callable(getattr(cand, "_compute_routing", None)):
                return cand
    return None


class _RoutingTap:
    """Wraps one router's ``_compute_routing`` (an instance attribute over the method) so that what it returns,
    the routing weights and the experts it chose ([n, top_k] each), reach ``on_routing(weights, ids,
    n_experts)``; ``remove()`` puts the method back. A CPU kernel that routes inside itself never calls it: then
    the sites are simply not captured."""

    def __init__(self, router, on_routing):
        self.router, self.orig = router, router._compute_routing
        n_experts = int(getattr(router, "global_num_experts", 0) or 0)

        def tapped(*args, **kwargs):
            weights, ids = self.orig(*args, **kwargs)
            on_routing(weights, ids, n_experts or int(ids.max()) + 1)
            return weights, ids
        router._compute_routing = tapped

    def remove(self) -> None:
        if self.router.__dict__.get("_compute_routing") is not None:
            del self.router._compute_routing


def dense_routing(weights, ids, n_experts: int):
    """[n, top_k] weights and expert ids -> [n, n_experts] fp32, each chosen expert's weight in its column and 0
    elsewhere: the router's output as one vector per position, so that a fault that keeps the chosen set and
    moves the weights (a gate row, a changed score function) has a distance of its own."""
    import torch

    ids = ids.to(torch.int64)
    out = torch.zeros(ids.shape[0], max(int(n_experts), int(ids.max()) + 1 if ids.numel() else 0),
                      dtype=torch.float32, device=weights.device)
    return out.scatter_(1, ids, weights.to(torch.float32))


# DeepSeek-V4's compressed KV cache rows (vLLM's fp8_ds_mla layout, the attention compressor's, head_dim 512): per
# token 448 fp8 e4m3 NoPE values and 64 bf16 RoPE values (576 bytes); a page holds its tokens' 576-byte rows
# first, then their 8-byte UE8M0 scales (7 used: one per 64 NoPE values) — the layout vLLM's own reader
# (deepseek_v4/common/ops/cache_utils.py, dequantize_and_gather_k_cache) decodes.
FP8_DS_MLA = {"dim": 512, "fp8": 448, "rope_bytes": 128, "row": 576, "scales": 8, "block": 64}


def decode_fp8_ds_mla(page, pos: int, rows_per_page: int):
    """Row ``pos`` of a flattened fp8_ds_mla page (uint8) of ``rows_per_page`` rows -> [512] fp32."""
    import torch

    f = FP8_DS_MLA
    data = page[pos * f["row"]:(pos + 1) * f["row"]]
    scale_at = rows_per_page * f["row"] + pos * f["scales"]
    exps = page[scale_at:scale_at + f["fp8"] // f["block"]].to(torch.float32) - 127.0
    nope = data[:f["fp8"]].contiguous().view(torch.float8_e4m3fn).to(torch.float32).view(-1, f["block"])
    nope = nope * torch.exp2(exps)[:, None]
    rope = data[f["fp8"]:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([nope.reshape(-1), rope])


def compressed_entries(compressor, positions):
    """After a DeepSeek-V4 attention compressor's forward: per token of the call, the compressed KV entry it
    completed and wrote to the cache ([n, 512] fp32, decoded), or zeros where the token completes no entry (an
    entry closes every ``compress_ratio`` tokens: at positions ratio-1, 2·ratio-1, …). The rows come from the
    cache itself (vLLM's compressed slot mapping, one slot per token, -1 for none), so they are what the
    attention will read."""
    import torch
    from vllm.forward_context import get_forward_context

    n = int(positions.shape[0])
    out = torch.zeros(n, FP8_DS_MLA["dim"], dtype=torch.float32)
    md = get_forward_context().attn_metadata
    if not isinstance(md, dict):        # a profiling run: nothing was written
        return out
    slots = md[compressor.k_cache_prefix].slot_mapping[:n].to("cpu")
    cache = compressor._static_forward_context[compressor.k_cache_prefix].kv_cache
    if cache.dtype != torch.uint8:
        raise RuntimeError(f"compressor site: KV cache dtype {cache.dtype}, only the fp8_ds_mla layout is read")
    rows_per_page = int(cache.shape[1])
    pages = cache.view(cache.shape[0], -1)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] = decode_fp8_ds_mla(pages[slot // rows_per_page].to("cpu"), slot % rows_per_page,
                                       rows_per_page)
    return out


def logits_rows(model, normed, rows: int = 256):
    """The engine's head (``model.compute_logits``) on every row of ``normed``, ``rows`` at a time into one fp32
    [n, vocab] tensor: the head's own output and its fp32 copy are never both whole (a 2,300-token DeepSeek
    prompt's logits are 1.2 GB in fp32). None where this rank computes no logits (PP: not the last stage)."""
    import torch

    out = None
    with torch.no_grad():
        for start in range(0, normed.shape[0], rows):
            part = model.compute_logits(normed[start:start + rows])
            if part is None:
                return None
            if out is None:
                out = torch.empty(normed.shape[0], part.shape[-1], dtype=torch.float32)
            out[start:start + part.shape[0]] = part.to("cpu", dtype=torch.float32)
    return out


def _tp_writer() -> bool:
    """Whether this worker writes the captures: rank 0 of its tensor-parallel group (TP ranks hold identical
    rows); every pipeline-parallel rank writes its own layers. No distributed state (a plain model): True."""
    try:
        from vllm.distributed import parallel_state

        return parallel_state.get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001 - not under vLLM's workers (tests, a plain torch model)
        return True


def spill_name(key: str, call: int) -> str:
    """The spill file of one site's capture in one forward call: ``L3.mlp.c00000.safetensors``."""
    return f"{key}.c{call:05d}.safetensors"


_SPILL_NAME = re.compile(r"^((?:L\d+\.)?[a-z_]+)\.c(\d+)\.safetensors$")


def _spill_write(path: str, t) -> None:
    """One capture to its own file, atomically (a reader never sees half a file)."""
    from safetensors.torch import save_file

    tmp = path + ".tmp"
    save_file({"rows": t}, tmp)
    os.replace(tmp, path)


def install(model, sites=SITES, layers=None) -> dict:
    """Hooks on the decoder layers' sites. They keep nothing: between begin() and end() each capture is written to
    the case's spill folder as it fires (this worker being a writer, see _tp_writer), else dropped."""
    import torch

    remove(model)
    name, mods = decoder_layers(model)
    bad = [int(i) for i in (layers or ()) if not -len(mods) <= int(i) < len(mods)]
    if bad:
        raise ValueError(f"layers {bad}: the model has {len(mods)} decoder layers ({name}: 0..{len(mods) - 1}, "
                         f"or -{len(mods)}..-1 from the end)")
    wanted = set(range(len(mods))) if layers is None else {int(i) % len(mods) for i in layers}
    state: dict = {"handles": [], "spill": None, "calls": {}, "writer": _tp_writer()}
    handles = state["handles"]
    names = {}

    def keep(key, t):
        folder = state["spill"]
        if folder is None or not state["writer"]:
            return
        fresh = callable(t)
        if fresh:                       # a capture that costs something, made only when it is written: its
            t = t()                     # tensor is its own, so it needs no defensive copy
            if t is None:
                return
        call = state["calls"].get(key, 0)
        state["calls"][key] = call + 1
        _spill_write(os.path.join(folder, spill_name(key, call)),
                     t.detach().to("cpu", dtype=torch.float32, copy=not fresh).contiguous())

    outer = outer_modules(model, name)
    if "embed" in sites and "embed" in outer:
        handles.append(outer["embed"][1].register_forward_hook(lambda m, a, out: keep("embed", _first_tensor(out))))
        names["embed"] = outer["embed"][0]
    if ("final_norm" in sites or "logits" in sites) and "final_norm" in outer:
        names["final_norm"] = outer["final_norm"][0]

        def after_norm(m, a, out):
            normed = _first_tensor(out)
            if "final_norm" in sites:
                keep("final_norm", normed)
            if "logits" in sites:
                # the engine's own head on every position (vLLM computes logits only where it samples)
                keep("logits", functools.partial(logits_rows, model, normed))
        handles.append(outer["final_norm"][1].register_forward_hook(after_norm))
    hooked = []
    for i, layer in enumerate(mods):
        if i not in wanted or type(layer).__name__ == "PPMissingLayer":   # PP: another rank's layer
            continue
        hooked.append(i)
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
        names.update(_install_stream_sites(layer, i, sites, keep, handles, parent_of(model, name)))
    setattr(model, _ATTR, state)
    ratios = {i: int(getattr(getattr(mods[i], "attn", None), "compress_ratio", 0) or 0) for i in hooked}
    if any(r > 1 for r in ratios.values()):
        names["compress_ratios"] = {str(i): r for i, r in ratios.items()}   # per layer: 1 = no compressor
    return {"layers_module": name, "n_layers": len(mods), "layer_class": type(mods[0]).__name__,
            "site_modules": names, "captured_layers": sorted(wanted), "hooked_layers": hooked,
            "writer": state["writer"], "pid": os.getpid()}


def begin(model, spill: str) -> dict:
    """From now on the hooks write into ``spill`` (call indices from 0)."""
    state = getattr(model, _ATTR, None)
    if state is None:
        raise RuntimeError("begin(): no capture hooks installed")
    if state["writer"]:
        os.makedirs(spill, exist_ok=True)
    state["spill"], state["calls"] = spill, {}
    return {"writer": state["writer"], "pid": os.getpid()}


def end(model) -> dict:
    """Stop writing; -> {key: forward calls written} of this worker."""
    state = getattr(model, _ATTR, None)
    if state is None:
        return {}
    calls = dict(state["calls"])
    state["spill"], state["calls"] = None, {}
    return calls


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
    return plugin.configure(model, spec["layer"], spec["module"], spec.get("scale", plugin.DEFAULT_SCALE),
                            spec.get("from_pos"))


_TWEAK_ATTR = "_ds41_tweaks"


class _ScaledPackedLinear:
    """``cpu_linear`` of a linear whose weight vLLM CPU packed and dropped (its ``weight`` is then empty): the
    packed GEMM's output times ``scale``, which is the layer with its weight matrix times ``scale`` (these gates
    have no bias)."""

    def __init__(self, orig, scale: float):
        self.orig, self.scale = orig, scale

    def __call__(self, x, weight, bias):
        return self.orig(x, weight, bias) * self.scale


def tweak(model, edits) -> dict:
    """A test-only fault planted in the weights, the way a changed checkpoint would plant it (not an output
    scale): ``edits`` a list of {"param": qualified name, "index": an index into it (int, list of ints, or None
    for all of it), "scale": x, "add": y}; the parameter slice becomes ``slice * scale + add``. A parameter the
    engine emptied (vLLM CPU packs small linears, e.g. the MoE gate, and drops ``weight``) is refused, naming it;
    such a linear's whole weight is scaled with {"packed_linear": module name, "scale": x} (its packed GEMM's
    output scaled: the same product, bias-free). ``None`` or [] puts back every edit. -> what is edited now."""
    import torch

    saved = getattr(model, _TWEAK_ATTR, None) or []
    with torch.no_grad():
        for target, idx, orig in reversed(saved):
            if idx is _TWEAK_ATTR:            # a packed linear: its own GEMM back
                target.cpu_linear = orig
            else:
                target.data[idx] = orig
    setattr(model, _TWEAK_ATTR, [])
    done = []
    params = dict(model.named_parameters())
    for e in edits or ():
        if "packed_linear" in e:
            mod = model.get_submodule(e["packed_linear"])
            orig_fn = getattr(mod, "cpu_linear", None)
            if orig_fn is None:
                raise KeyError(f"tweak: {e['packed_linear']!r} has no packed GEMM (cpu_linear); tweak its weight")
            getattr(model, _TWEAK_ATTR).append((mod, _TWEAK_ATTR, orig_fn))
            mod.cpu_linear = _ScaledPackedLinear(orig_fn, float(e["scale"]))
            done.append({"packed_linear": e["packed_linear"], "scale": float(e["scale"]),
                         "changed": int(float(e["scale"]) != 1.0)})
            continue
        if e["param"] not in params:
            near = [n for n in params if n.rsplit(".", 2)[-2:] == e["param"].rsplit(".", 2)[-2:]][:4]
            raise KeyError(f"tweak: no parameter {e['param']!r} (like it: {near})")
        param = params[e["param"]]
        if param.numel() == 0:
            raise KeyError(f"tweak: parameter {e['param']!r} is empty in the engine (packed into its GEMM and "
                           f"dropped at load); use {{'packed_linear': {e['param'].rsplit('.', 1)[0]!r}, 'scale': x}}")
        idx = e.get("index")
        idx = slice(None) if idx is None else tuple(idx) if isinstance(idx, list) else idx
        with torch.no_grad():
            orig = param.data[idx].clone()
            getattr(model, _TWEAK_ATTR).append((param, idx, orig))
            param.data[idx] = orig * float(e.get("scale", 1.0)) + float(e.get("add", 0.0))
        done.append({"param": e["param"], "index": e.get("index"), "scale": e.get("scale", 1.0),
                     "add": e.get("add", 0.0), "changed": int(torch.count_nonzero(param.data[idx] != orig))})
    return {"edits": done, "pid": os.getpid()}


# -- the driver ------------------------------------------------------------------------------------------------

def _merge(per_worker: list[dict]) -> dict:
    """TP ranks: identical rows, keep the first; PP ranks: disjoint layers, union."""
    merged: dict = {}
    for d in per_worker:
        for k, v in d.items():
            merged.setdefault(k, v)
    return merged


def _site_order(key: str) -> tuple[int, int]:
    """embed, the layers' sites, final_norm, logits."""
    if key in OUTER_SITES:
        return {"embed": (-1, 0), "final_norm": (1 << 30, 0), "logits": (1 << 30, 1)}[key]
    layer, site = key[1:].split(".", 1)
    order = ("attn_in", "compressor", "indexer", "attn", "attn_stream", "ffn_in", "router", "router_weights", "mlp",
             "resid")
    return int(layer), order.index(site) if site in order else len(order)


def _read_spill(path: str):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.get_tensor("rows")


def _spill_shape(path: str) -> list[int]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.get_slice("rows").get_shape())


class _StreamedSafetensors:
    """A safetensors file written one tensor at a time: the header (every name, shape and offset) first, then
    each tensor's bytes as it comes, in the header's order; renamed into place by close(). Float32 only (every
    capture is), little-endian as the format wants (the hosts here are)."""

    def __init__(self, path: str, entries: list[tuple[str, list[int]]]):
        import math

        header, off = {}, 0
        for name, shape in entries:
            size = 4 * math.prod(shape)
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + size]}
            off += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self._tmp, self._order, self._next = path, path + ".tmp", [n for n, _ in entries], 0
        self._shapes = dict(entries)
        self._fh = open(self._tmp, "wb")
        self._fh.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, t) -> None:
        import torch

        if self._next >= len(self._order) or name != self._order[self._next]:
            raise RuntimeError(f"streamed safetensors: {name!r} out of order")
        if list(t.shape) != self._shapes[name] or t.dtype != torch.float32:
            raise RuntimeError(f"{name}: {tuple(t.shape)} {t.dtype}, header says {self._shapes[name]} float32")
        self._fh.write(t.contiguous().numpy().data)
        self._next += 1

    def close(self) -> None:
        self._fh.close()
        if self._next != len(self._order):
            raise RuntimeError(f"streamed safetensors: {len(self._order) - self._next} tensor(s) never written")
        os.replace(self._tmp, self.path)


def assemble(spill: str, path: str, n: int, steps: int) -> dict:
    """The case's spill folder -> ``path`` (``prefill/L<i>.<site>`` [n, ...] and, with a decode step,
    ``decode/L<i>.<site>`` [1, ...]), one site in memory at a time; each spill file is deleted once read and the
    folder at the end. -> {"tensors", "spill_files", "rows_per_call"}."""
    import torch

    groups: dict[str, list[tuple[int, str]]] = {}
    for fname in (os.listdir(spill) if os.path.isdir(spill) else ()):   # no folder: no hook (sites=[])
        m = _SPILL_NAME.match(fname)
        if m is None:
            raise RuntimeError(f"{spill}: unexpected file {fname!r}")
        groups.setdefault(m.group(1), []).append((int(m.group(2)), os.path.join(spill, fname)))
    plan, entries, calls_seen = [], [], None
    for key in sorted(groups, key=_site_order):
        files = [f for _, f in sorted(groups[key])]
        shapes = [_spill_shape(f) for f in files]
        calls_seen = [int(sh[0]) for sh in shapes]
        if sum(calls_seen) < n + (steps - 1):
            raise RuntimeError(f"{key}: {sum(calls_seen)} rows captured for {n} prompt tokens "
                               f"(+{steps - 1} decode); calls {calls_seen}")
        shape = shapes[0][1:]
        plan.append((key, files, shape))
        entries.append((f"prefill/{key}", [n] + shape))
        if steps > 1:
            entries.append((f"decode/{key}", [1] + shape))
    out = _StreamedSafetensors(path, entries)
    try:
        for key, files, shape in plan:
            parts = [_read_spill(f) for f in files]
            flat = [p.reshape(p.shape[0], -1) for p in parts]
            rows = flat[0] if len(flat) == 1 else torch.cat(flat, dim=0)   # one call: no second copy of it
            del flat
            del parts
            out.write(f"prefill/{key}", rows[:n].reshape([n] + shape))
            if steps > 1:
                out.write(f"decode/{key}", rows[n:n + 1].reshape([1] + shape))
            del rows
            for f in files:
                os.remove(f)
        out.close()
    except BaseException:
        out._fh.close()
        if os.path.exists(out._tmp):
            os.remove(out._tmp)
        raise
    if os.path.isdir(spill):
        os.rmdir(spill)
    return {"tensors": len(entries), "spill_files": sum(len(f) for _, f, _ in plan), "rows_per_call": calls_seen}


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


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
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm, ignored = build_llm(request["engine_args"])
    report: dict = {"vllm": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "ignored_args": ignored, "load_s": time.perf_counter() - t0, "cases": {}}
    sites = SITES + STREAM_SITES + OUTER_SITES if request.get("sites") is None else tuple(request["sites"])
    info = _merge([{"x": r} for r in llm.apply_model(functools.partial(install, sites=sites,
                                                                       layers=request.get("layers")))])["x"]
    report["model"] = info
    report["max_rss_mb_loaded"] = round(_max_rss_mb(), 1)
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
            rec["tweak"] = _merge([{"x": r} for r in llm.apply_model(
                functools.partial(tweak, edits=case.get("tweak")))])["x"]
            spill = os.path.join(request["out_dir"], f"{case['name']}.spill")
            if os.path.isdir(spill):
                shutil.rmtree(spill)
            writers = [w for w in llm.apply_model(functools.partial(begin, spill=spill)) if w["writer"]]
            t = time.perf_counter()
            try:
                out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            finally:
                llm.apply_model(end)
            rec["generate_s"] = time.perf_counter() - t
            gen = list(out[0].outputs[0].token_ids)
            rec["generated_ids"] = gen
            rec["spill_writers"] = len(writers)
            path = os.path.join(request["out_dir"], f"{case['name']}.safetensors")
            done = assemble(spill, path, n, steps)
            rec["rows_per_call"] = done["rows_per_call"]
            rec["spill_files"] = done["spill_files"]
            rec["file"] = path
            rec["tensors"] = done["tensors"]
            rec["max_rss_mb"] = round(_max_rss_mb(), 1)
        except Exception as e:  # noqa: BLE001 - recorded per case, the harness raises it
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc(limit=8)
        report["cases"][case["name"]] = rec
    llm.apply_model(functools.partial(tweak, edits=None))
    llm.apply_model(remove)
    report["total_s"] = time.perf_counter() - t0
    report["max_rss_mb"] = round(_max_rss_mb(), 1)
    write_report(report, request["report"])
    return report


if __name__ == "__main__":
    sys.exit(request_main(run, "engine.localize_runner", {
        "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}))

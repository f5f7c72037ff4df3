"""Per-layer activations of the oracle for one prompt: the divergence localizer's oracle side (docs/DESIGN.md,
"The divergence localizer").

``capture_hf(model_dir, ids, precision)`` runs the transformers oracle (oracle/hf.py's loader, fp32) once on
``ids`` with forward hooks on every decoder layer and on its attention and MLP modules, and returns per site
``L<i>.attn`` (the attention output before the residual add), ``L<i>.mlp`` (the MLP output before the add) and
``L<i>.resid`` (the residual stream leaving the layer) as float32 [n, d], and beside the layers ``embed`` (the
embedding output), ``final_norm`` (the final norm's output) and ``logits`` [n, vocab]: the same sites, with the
same meaning, as the engine's runner captures (engine/localize_runner.py). ``precision`` is the oracle's own run at another
precision, the localizer's per-layer noise floor: ``bf16`` (the weights and activations in bfloat16, what an
honest bf16 engine could look like) or ``fp64`` (the fp32 oracle's own rounding noise, the floor of an fp32
engine). A prefill of ``ids + [next]`` gives the prefill rows and the decode step's row in one forward (the
model is causal; the decode position is row n).

``capture_dsv41(ckpt_dir, ids, precision)`` does the same with the DeepSeek oracle's in-memory model
(oracle/dsv41/model.py), block by block: ``L<i>.attn`` the attention output, ``L<i>.mlp`` the MoE output,
``L<i>.resid`` the hyper-connection streams leaving the block [n, hc * d], ``embed`` and ``logits`` (the head
computes its final norm inline, so there is no ``final_norm`` site on this oracle), and on DeepSeek-V4's
compressed layers ``L<i>.compressor``: the compressed KV entries the attention's compressor wrote (post-RoPE,
post-QDQ, [n, head_dim], the row of the token that completes each group of ``ratio`` tokens, zeros elsewhere);
``precision`` ``fp32`` or ``reference-bf16``.

Memory: with ``spill=DIR`` neither keeps a capture: each hook writes its site, as it fires, to
``DIR/<key>.safetensors`` (tensor ``rows``, written to ``.tmp`` and renamed) and the call returns
``SpillCaptures(DIR)``, a mapping that reads one site per access. Without it (tests, small benchmarks) the
captures come back as an in-memory dict.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

SITES = ("attn", "mlp", "resid")                   # per decoder layer
OUTER_SITES = ("embed", "final_norm", "logits")    # the embedding output, the final norm's output, the logits
PRECISIONS = ("fp32", "bf16", "fp64")
_ROLE_NAMES = {"attn": ("self_attn", "attn", "attention"), "mlp": ("mlp", "ffn", "feed_forward", "moe")}


class CaptureError(ValueError):
    pass


def _decoder_layers(model) -> torch.nn.ModuleList:
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(mod):
            if best is None or len(mod) > len(best):
                best = mod
    if best is None:
        raise CaptureError(f"{type(model).__name__}: no ModuleList named 'layers' (decoder layers)")
    return best


def load_hf(model_dir: str | Path, precision: str = "fp32", threads: int = 1, base=None):
    """The transformers oracle's model (oracle/hf.py's checked fp32 load), cast for a floor run. ``base``: an fp32
    load of the same folder to copy instead of loading (and hashing) the weights again."""
    import copy

    from oracle.hf import HFOracle

    if precision not in PRECISIONS:
        raise CaptureError(f"precision {precision!r}: expected one of {PRECISIONS}")
    orc = copy.deepcopy(base) if base is not None else HFOracle.load(model_dir, threads=threads)
    if precision == "bf16":
        orc.model.to(torch.bfloat16)
    elif precision == "fp64":
        orc.model.to(torch.float64)
    return orc


def spill_write(folder: str | Path, key: str, t: torch.Tensor) -> None:
    """One site's capture to ``folder/<key>.safetensors``, atomically."""
    from safetensors.torch import save_file

    path = Path(folder) / f"{key}.safetensors"
    tmp = path.with_name(path.name + ".tmp")
    save_file({"rows": t.contiguous()}, str(tmp))
    tmp.replace(path)


class SpillCaptures(Mapping):
    """A spill folder (one ``<key>.safetensors`` per site) as a mapping key -> fp32 tensor, read from disk on each
    access (memory: the one site asked for)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._keys = sorted(p.name[: -len(".safetensors")] for p in self.folder.glob("*.safetensors"))

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self._keys:
            raise KeyError(key)
        with safe_open(str(self.folder / f"{key}.safetensors"), framework="pt") as f:
            return f.get_tensor("rows")

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class _Sink:
    """Where a hook puts a capture: a dict (in memory) or a spill folder (written at once, nothing kept)."""

    def __init__(self, spill: str | Path | None):
        self.spill = None if spill is None else Path(spill)
        self.acts: dict[str, torch.Tensor] = {}
        if self.spill is not None:
            self.spill.mkdir(parents=True, exist_ok=True)

    def __setitem__(self, key: str, t: torch.Tensor) -> None:
        if self.spill is None:
            self.acts[key] = t
        else:
            spill_write(self.spill, key, t)

    def result(self) -> Mapping[str, torch.Tensor]:
        return self.acts if self.spill is None else SpillCaptures(self.spill)


def capture_model(model, ids: Sequence[int], sites: Sequence[str] = SITES + OUTER_SITES,
                  layers: Sequence[int] | None = None, threads: int = 1,
                  spill: str | Path | None = None) -> Mapping[str, torch.Tensor]:
    """One forward of a loaded transformers causal LM over ``ids`` with hooks on the sites -> {key: fp32 [n, d]}
    (``spill``: written there as the hooks fire, returned as SpillCaptures)."""
    mods = _decoder_layers(model)
    bad = [int(i) for i in (layers or ()) if not -len(mods) <= int(i) < len(mods)]
    if bad:
        raise CaptureError(f"layers {bad}: the model has {len(mods)} decoder layers (0..{len(mods) - 1})")
    wanted = set(range(len(mods))) if layers is None else {int(i) % len(mods) for i in layers}
    out = _Sink(spill)
    handles = []
    outer = {"embed": model.get_input_embeddings(), "logits": model.get_output_embeddings(),
             "final_norm": getattr(getattr(model, "model", None), "norm", None)}

    def keep(key):
        def hook(module, args, output):
            t = output[0] if isinstance(output, (tuple, list)) else output
            out[key] = t.detach()[0].to(torch.float32).clone()
        return hook

    try:
        for role in OUTER_SITES:
            if role in sites:
                if outer[role] is None:
                    raise CaptureError(f"{type(model).__name__}: no module for the {role!r} site")
                handles.append(outer[role].register_forward_hook(keep(role)))
        for i, layer in enumerate(mods):
            if i not in wanted:
                continue
            if "resid" in sites:
                handles.append(layer.register_forward_hook(keep(f"L{i}.resid")))
            for role in ("attn", "mlp"):
                if role in sites:
                    sub = next((getattr(layer, a) for a in _ROLE_NAMES[role] if getattr(layer, a, None) is not None),
                               None)
                    if sub is None:
                        raise CaptureError(f"{type(layer).__name__}: none of {_ROLE_NAMES[role]} ({role})")
                    handles.append(sub.register_forward_hook(keep(f"L{i}.{role}")))
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                model(input_ids=torch.tensor([list(ids)], dtype=torch.int64), use_cache=False)
        finally:
            torch.set_num_threads(prev)
    finally:
        for h in handles:
            h.remove()
    return out.result()


def capture_hf(model_dir: str | Path, ids: Sequence[int], precision: str = "fp32",
               sites: Sequence[str] = SITES + OUTER_SITES,
               layers: Sequence[int] | None = None, threads: int = 1, oracle=None,
               spill: str | Path | None = None) -> tuple[Mapping, dict]:
    """-> ({key: fp32 [n, d]}, info). ``oracle``: an already loaded ``load_hf`` result (its precision wins);
    ``spill``: a folder the captures go to as they are made (the mapping then reads them from there)."""
    t0 = time.perf_counter()
    orc = oracle if oracle is not None else load_hf(model_dir, precision, threads)
    t1 = time.perf_counter()
    acts = capture_model(orc.model, ids, sites, layers, threads, spill=spill)
    info = {"oracle": "oracle.hf", "model_dir": str(Path(orc.model_dir).resolve()), "model_hash": orc.model_hash,
            "precision": precision, "dtype": str(next(orc.model.parameters()).dtype).replace("torch.", ""),
            "load_s": round(t1 - t0, 3), "forward_s": round(time.perf_counter() - t1, 3), "threads": threads}
    return acts, info


class _Tap:
    """Stands in for one callable of a DeepSeek block (its attention, its MoE, the block itself) and keeps a copy
    of what it returns; everything else is the wrapped object's. The oracle's code is not touched."""

    def __init__(self, inner, store: dict, key: str, pick):
        self._inner, self._store, self._key, self._pick = inner, store, key, pick

    def __call__(self, *args, **kwargs):
        out = self._inner(*args, **kwargs)
        t = self._pick(out)
        self._store[self._key] = t[0].reshape(t.shape[1], -1).to(torch.float32).clone()
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _CompressorTap:
    """Stands in for a DeepSeek-V4 attention compressor (oracle/dsv41/compressor_v4.py's ``CompressorV4``: its
    call returns the compressed KV cache rows [b, g, d] the groups it completed give, post-RoPE and post-QDQ, or
    None) and keeps them as one row per token of the call: the token that completes group j (position
    (j + 1)·ratio − 1) holds the group's row, every other token zeros — the layout the engine's runner captures
    from vLLM's cache (engine/localize_runner.py, ``compressed_entries``)."""

    def __init__(self, inner, store, key: str):
        self._inner, self._store, self._key = inner, store, key

    def __call__(self, x, start_pos: int, *args, **kwargs):
        new = self._inner(x, start_pos, *args, **kwargs)
        r, s = int(self._inner.ratio), int(x.shape[1])
        rows = torch.zeros(s, int(self._inner.d), dtype=torch.float32)
        if new is not None:
            first = start_pos // r        # the first group this call completes: the one open when it began
            for j in range(new.shape[1]):
                rows[(first + j + 1) * r - 1 - start_pos] = new[0, j].to(torch.float32)
        self._store[self._key] = rows
        return new

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _keep_rows(store, key: str, y: torch.Tensor) -> torch.Tensor:
    store[key] = y[0].reshape(y.shape[1], -1).to(torch.float32).clone()
    return y


def capture_dsv41(ckpt_dir: str | Path, ids: Sequence[int], precision: str = "fp32",
                  layers: Sequence[int] | None = None, threads: int = 1,
                  spill: str | Path | None = None) -> tuple[Mapping, dict]:
    """The DeepSeek oracle (in-memory model, small checkpoints) block by block -> ({key: fp32 [n, d']}, info);
    ``spill`` as capture_hf's."""
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.model import Model
    from oracle.dsv41.runner import engram_token_map, full_weights

    if precision not in ("fp32", "reference-bf16"):
        raise CaptureError(f"DeepSeek oracle precision {precision!r}: expected fp32 or reference-bf16")
    t0 = time.perf_counter()
    ck = Checkpoint(Path(ckpt_dir))
    cfg = ck.model_config
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = Model(cfg, full_weights(ck), engram_token_map(ck), precision=precision, with_mtp=False,
                      with_vision=False)
        t1 = time.perf_counter()
        bad = [int(i) for i in (layers or ()) if not -cfg.n_layers <= int(i) < cfg.n_layers]
        if bad:
            raise CaptureError(f"layers {bad}: the model has {cfg.n_layers} layers (0..{cfg.n_layers - 1})")
        wanted = set(range(cfg.n_layers)) if layers is None else {int(i) % cfg.n_layers for i in layers}
        out = _Sink(spill)
        model.embed = _Tap(model.embed, out, "embed", lambda y: y)
        head_logits = model.head.logits      # an instance attribute shadows the method: the head is tapped
        model.head.logits = lambda *a, **k: _keep_rows(out, "logits", head_logits(*a, **k))
        for L in sorted(wanted):
            block = model.blocks[L]
            comp = getattr(block.attn, "compressor", None)
            if comp is not None and callable(getattr(comp, "finish", None)):   # V4: its rows are the cache's
                block.attn.compressor = _CompressorTap(comp, out, f"L{L}.compressor")
            block.attn = _Tap(block.attn, out, f"L{L}.attn", lambda y: y)
            block.ffn = _Tap(block.ffn, out, f"L{L}.mlp", lambda y: y)
            model.blocks[L] = _Tap(block, out, f"L{L}.resid", lambda hp: hp[0])
        model.forward(torch.tensor([list(ids)], dtype=torch.int64), model.new_state(1))
    finally:
        torch.set_num_threads(prev)
    info = {"oracle": "oracle.dsv41", "model_dir": str(Path(ckpt_dir).resolve()), "precision": precision,
            "load_s": round(t1 - t0, 3), "forward_s": round(time.perf_counter() - t1, 3), "threads": threads}
    return out.result(), info

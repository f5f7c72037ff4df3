"""Engine-side kernel runner. Runs INSIDE the engine's environment and imports only torch, numpy,
safetensors and the engine package (never the harness):

    <engine python> -m engine.kernels.runner request.json

request.json: {"inputs": path, "outputs": path, "report": path,
               "cases": [{"case_id", "target": "module:attr", "adapter", "params", "perturb": {out: how}}]}
Inputs are read from one safetensors file (keys "<case_id>/<name>"); outputs are written to another (same
keying); report is JSON with per-case wall time, errors and versions. A failing case records its error and
the runner goes on with the next one.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback

import torch
from safetensors.torch import load_file, save_file

from engine.inproc import request_main, write_report

# -- V4 fp8_ds_mla paged cache (per block of B tokens: B x [448 e4m3 | 64 bf16], then B x 8 ue8m0 bytes) ------
_TOKEN_BYTES, _SCALE_BYTES, _NOPE, _ROPE, _QB = 576, 8, 448, 64, 64


def pack_fp8_ds_mla(kv: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 [n, 512] rows (already exactly representable) -> uint8 [n_blocks, block * 584]. Raises if any
    row does not round-trip bit-exactly (the gate must feed the kernel exactly what the oracle sees)."""
    n = kv.shape[0]
    nb = -(-n // block)
    cache = torch.zeros(nb, block * (_TOKEN_BYTES + _SCALE_BYTES), dtype=torch.uint8)
    nope = kv[:, :_NOPE].reshape(n, _NOPE // _QB, _QB)
    amax = nope.abs().amax(-1).clamp(min=1e-4)
    e = torch.ceil(torch.log2(amax / 448.0)).to(torch.int32)
    q = (nope / torch.ldexp(torch.ones_like(amax), e).unsqueeze(-1)).to(torch.float8_e4m3fn)
    rope = kv[:, _NOPE:].to(torch.bfloat16)
    for i in range(n):
        b, p = divmod(i, block)
        cache[b, p * _TOKEN_BYTES:p * _TOKEN_BYTES + _NOPE] = q[i].reshape(-1).view(torch.uint8)
        cache[b, p * _TOKEN_BYTES + _NOPE:(p + 1) * _TOKEN_BYTES] = rope[i].view(torch.uint8)
        s0 = block * _TOKEN_BYTES + p * _SCALE_BYTES
        cache[b, s0:s0 + _NOPE // _QB] = (e[i] + 127).to(torch.uint8)
    back = unpack_fp8_ds_mla(cache, n, block)
    if not torch.equal(torch.cat(back, -1), kv):
        raise ValueError("pack_fp8_ds_mla: KV rows are not exactly representable in the fp8_ds_mla layout")
    return cache


def unpack_fp8_ds_mla(cache: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 cache -> (NoPE fp32 [n, 448], RoPE bf16 [n, 64]) for slots 0..n-1."""
    nope, rope = torch.empty(n, _NOPE), torch.empty(n, _ROPE, dtype=torch.bfloat16)
    for i in range(n):
        b, p = divmod(i, block)
        row = cache[b]
        q = row[p * _TOKEN_BYTES:p * _TOKEN_BYTES + _NOPE].view(torch.float8_e4m3fn).float().view(-1, _QB)
        s0 = block * _TOKEN_BYTES + p * _SCALE_BYTES
        e = row[s0:s0 + _NOPE // _QB].to(torch.int32) - 127
        nope[i] = (q * torch.ldexp(torch.ones(e.shape), e).unsqueeze(-1)).reshape(-1)
        rope[i] = row[p * _TOKEN_BYTES + _NOPE:(p + 1) * _TOKEN_BYTES].view(torch.bfloat16)
    return nope, rope


# -- call adapters: (engine callable, inputs, params) -> outputs ----------------------------------------------

def hc_pre_fused(fn, i, p):
    y, post, comb = fn(i["x"], i["fn"], i["scale"], i["base"], p["hc"], p["iters"], p["norm_eps"], p["hc_eps"])
    return dict(y=y, post=post, comb=comb)


def hc_post_fused(fn, i, p):
    return dict(out=fn(i["f"], i["res"], i["post"], i["comb"]))


def hc_head_fused(fn, i, p):
    return dict(y=fn(i["x"], i["fn"], i["scale"], i["base"], p["hc_eps"], p["norm_eps"]))  # kernel order


def rms_norm_out(fn, i, p):
    out = torch.empty_like(i["x"])
    fn(out, i["x"], i["weight"], p["eps"])
    return dict(out=out)


def custom_op_forward_native(cls, i, p):
    """A vLLM CustomOp class: instantiate with the case's ``limit`` and call its CPU forward."""
    from vllm.config import VllmConfig, set_current_vllm_config
    with set_current_vllm_config(VllmConfig()):
        op = cls(p["limit"])
    fwd = getattr(op, "forward_cpu", None) or op.forward_native
    return dict(out=fwd(i["x"]))


def flash_mla_sparse(fn, i, p):
    t, h, d = i["q"].shape
    wb, cb = p["win_block"], p["comp_block"]
    win, comp = pack_fp8_ds_mla(i["kv_win"], wb), pack_fp8_ds_mla(i["kv_comp"], cb)
    out = torch.zeros(t, h, d, dtype=i["q"].dtype)
    fn(out, i["q"], win, i["idx_win"], wb, comp, i["idx_comp"], cb, i["sink"], p["scale"])
    return dict(out=out)


def qnorm_rope_kv_insert(fn, i, p):
    t, h, _ = i["q"].shape
    block = p["block"]
    cache = torch.zeros(-(-t // block), block * (_TOKEN_BYTES + _SCALE_BYTES), dtype=torch.uint8)
    slots = torch.arange(t, dtype=torch.int64)
    q_out = fn(i["q"], i["kv"], i["positions"], cache, slots, i["cos_sin"], h, p["q_eps"], block)
    nope, rope = unpack_fp8_ds_mla(cache, t, block)
    return dict(q_out=q_out, kv_nope=nope, kv_rope=rope)


ADAPTERS = {f.__name__: f for f in (hc_pre_fused, hc_post_fused, hc_head_fused, rms_norm_out,
                                    custom_op_forward_native, flash_mla_sparse, qnorm_rope_kv_insert)}


# -- test-only perturbations -----------------------------------------------------------------------------------

def perturb(x: torch.Tensor, how: str) -> torch.Tensor:
    """Move every element ``n`` representable values away from zero in its own dtype (``ulp+n``)."""
    n = int(how.removeprefix("ulp+"))
    ity = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype]
    bits = x.contiguous().view(ity)
    return (bits + n).view(x.dtype) if bits.dtype == torch.int32 else (bits.to(torch.int32) + n).to(ity).view(x.dtype)


def resolve(target: str):
    mod, _, attr = target.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _v4_kernel_availability() -> tuple[dict, list[str]]:
    """The CPU features and the DeepSeek-V4 CPU kernels the loaded vLLM extension lacks (the probe's own
    functions: vllm/_C has them and loads only on AVX512-BF16 CPUs; _C_AVX2 / _C_AVX512 do not)."""
    from engine.vllm_dsv4.probe import V4_CPU_OPS, cpu_features, missing_v4_ops

    try:
        missing = missing_v4_ops()
    except Exception:  # noqa: BLE001 - then every op counts as missing, and the cases' own errors say why
        missing = list(V4_CPU_OPS)
    return cpu_features(), missing


def run(request: dict) -> dict:
    inputs = load_file(request["inputs"])
    outputs, report = {}, {"cases": {}, "python": sys.version.split()[0], "torch": torch.__version__,
                           "threads": torch.get_num_threads()}
    try:
        import vllm
        report["vllm"] = getattr(vllm, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - the report says why
        report["vllm"] = f"import failed: {e!r}"
    for c in request["cases"]:
        cid = c["case_id"]
        pre = cid + "/"
        ins = {k[len(pre):]: v for k, v in inputs.items() if k.startswith(pre)}
        rec = {"target": c["target"], "adapter": c["adapter"]}
        try:
            fn = resolve(c["target"])
            adapter = ADAPTERS[c["adapter"]]
            with torch.no_grad():
                adapter(fn, {k: v.clone() for k, v in ins.items()}, c["params"])  # warm-up
                t0 = time.perf_counter()
                outs = adapter(fn, ins, c["params"])
                rec["wall_s"] = time.perf_counter() - t0
            for name, how in (c.get("perturb") or {}).items():
                outs[name] = perturb(outs[name], how)
            for name, v in outs.items():
                outputs[pre + name] = v.contiguous()
            rec["outputs"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in outs.items()}
        except Exception as e:  # noqa: BLE001 - recorded per case, the gate reports it
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc(limit=6)
        report["cases"][cid] = rec
    report["cpu"], report["missing_ops"] = _v4_kernel_availability()
    save_file(outputs, request["outputs"])
    write_report(report, request["report"])
    return report


if __name__ == "__main__":
    sys.exit(request_main(run, "engine.kernels.runner", {"VLLM_LOGGING_LEVEL": "WARNING"}))

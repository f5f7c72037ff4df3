"""Probe, inside the vLLM venv, the two DeepSeek-V4 CPU bugs and whether this CPU can run the V4 CPU path.

Run as ``<vllm python> engine/vllm_dsv4/probe.py`` (with or without this folder's sitecustomize on
PYTHONPATH); prints one JSON object on stdout. It calls real vLLM code, no server:

* ``metadata_kernel``: ``vllm.v1.attention.ops.metadata.compute_token_to_req_indices`` (a ``@triton.jit``
  kernel the V4 CPU attention metadata uses) on a small batch: its output, or the exception and traceback;
* ``tile_scheduler_keys``: the keys ``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`` returns,
  and ``shared_build_reads``: the layer-type keys ``DeepseekSparseSWAMetadataBuilder.build`` reads from it;
* ``cpu`` / ``missing_ops``: the CPU features vLLM's kernel selection looks at, and which of the V4 CPU
  path's ``torch.ops._C`` kernels the loaded extension lacks.
"""

import json
import os
import re
import sys
import traceback

V4_CPU_OPS = ("flash_mla_with_kvcache_cpu", "convert_weight_packed", "hc_pre_fused_cpu", "hc_post_fused_cpu",
              "hc_head_fused_cpu", "fused_qnorm_rope_kv_insert_cpu", "fp8_paged_mqa_logits_cpu",
              "compress_norm_rope_store_cpu", "save_partial_states_cpu", "bmm_cpu")


def _exc(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()[-3000:]}


def cpu_features() -> dict:
    """The CPU features vLLM's CPU platform picks its extension build by (vllm/_C needs AVX512 + AVX512-BF16)."""
    import torch

    return {"avx512": bool(torch.cpu._is_avx512_supported()),
            "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
            "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())}


def missing_v4_ops() -> list[str]:
    """Load vLLM's kernels as the server does; the V4 CPU ops the loaded extension lacks."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return [op for op in V4_CPU_OPS if not hasattr(torch.ops._C, op)]


def main() -> dict:
    out: dict = {"fixes_env": os.environ.get("DS41_VLLM_FIXES", "")}
    import torch

    out["cpu"] = cpu_features()
    out["missing_ops"] = missing_v4_ops()

    from vllm.triton_utils import importing

    out["has_triton"] = bool(importing.HAS_TRITON)
    qsl = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)  # 4 requests: 3, 0, 4 and 5 tokens
    try:
        from vllm.v1.attention.ops.metadata import compute_token_to_req_indices

        res = torch.full((16,), -1, dtype=torch.int32)
        compute_token_to_req_indices(qsl, res, 12, 14)
        out["metadata_kernel"] = {"ok": True, "query_start_loc": qsl.tolist(), "num_mapped": 12, "num_tokens": 14,
                                  "result": res.tolist()}
    except Exception as e:  # noqa: BLE001 - the stock failure is the point
        out["metadata_kernel"] = {"ok": False, **_exc(e)}

    import inspect

    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder
    from vllm.v1.attention.backends.mla import sparse_swa

    out["tile_scheduler_keys"] = sorted(DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler(None, 0))
    consts = {getattr(sparse_swa, n): n for n in dir(sparse_swa) if n.startswith("_LAYER_TYPE_")}
    src = inspect.getsource(sparse_swa.DeepseekSparseSWAMetadataBuilder.build)
    out["shared_build_reads"] = sorted(v for v, n in consts.items() if re.search(rf"tile_sched\[{n}\]", src))
    out["shared_build_file"] = inspect.getsourcefile(sparse_swa.DeepseekSparseSWAMetadataBuilder)
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
    print()

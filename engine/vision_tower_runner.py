"""The engine's own vision tower, in process. Runs INSIDE the vLLM environment and imports only torch,
safetensors, transformers (for the model's config) and vLLM:

    <vllm python> -m engine.vision_tower_runner request.json

request.json: {"model_dir", "inputs": path, "outputs": path, "report": path, "dtypes": ["float32", ...]}.
``inputs`` holds per image ``pixels/<name>`` [3, H, W] fp32 and ``mask/<name>`` [H, W] (already preprocessed
by the harness, so both sides see the same pixels); ``outputs`` gets ``<dtype>/<name>`` = the rows the image
puts into the LLM, [tokens, d] in fp32. The modules are vLLM's own for Idefics3 (its
``Idefics2VisionTransformer`` and ``Idefics3Connector``, built with the prefixes vLLM's ``Idefics3Model`` gives
them, weights through vLLM's ``AutoWeightsLoader``), and the call is vLLM's: ``Idefics3Model``'s own
``image_pixels_to_features`` (padding images dropped, patch attention mask) and then the connector, as
``Idefics3ForConditionalGeneration._process_image_input`` does. vLLM's parallel linears need a (1-process)
distributed group and a current vLLM config; both are set up here and torn down at the end.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback

from engine.inproc import request_main, write_report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(request: dict) -> dict:
    import torch
    import vllm
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
    from torch import nn
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.models.idefics3 import Idefics3Connector, Idefics3Model, Idefics3VisionTransformer
    from vllm.model_executor.models.utils import AutoWeightsLoader

    class EngineImageEncoder(nn.Module):
        """vLLM's Idefics3 vision tower and connector, called through Idefics3Model's own methods."""

        image_pixels_to_features = Idefics3Model.image_pixels_to_features
        get_patch_attention_mask = Idefics3Model.get_patch_attention_mask

        def __init__(self, config):
            super().__init__()
            self.config = config
            self.vision_model = Idefics3VisionTransformer(config.vision_config, quant_config=None,
                                                          prefix="model.vision_model")
            self.connector = Idefics3Connector(config, None, prefix="model.connector")

        def forward(self, pixel_values, pixel_attention_mask):
            return self.connector(self.image_pixels_to_features(pixel_values, pixel_attention_mask=pixel_attention_mask))

    model_dir = request["model_dir"]
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    pixels = load_file(request["inputs"])
    names = sorted(k.split("/", 1)[1] for k in pixels if k.startswith("pixels/"))
    report: dict = {"vllm": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "architecture": type(cfg).__name__, "images": names, "runs": {}}
    outputs = {}
    vllm_config = VllmConfig()
    scope = set_current_vllm_config(vllm_config)
    scope.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo")
    initialize_model_parallel(1, 1)
    try:
        weights_file = os.path.join(model_dir, "model.safetensors")
        with safe_open(weights_file, framework="pt") as f:
            tower_weights = {k[len("model."):]: f.get_tensor(k) for k in f.keys()
                             if k.startswith(("model.vision_model.", "model.connector."))}
        for dtype_name in request["dtypes"]:
            rec: dict = {}
            try:
                dtype = getattr(torch, dtype_name)
                prev = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                try:
                    enc = EngineImageEncoder(cfg)
                finally:
                    torch.set_default_dtype(prev)
                loaded = AutoWeightsLoader(enc).load_weights((k, v.to(dtype)) for k, v in tower_weights.items())
                missing = sorted(set(n for n, _ in enc.named_parameters()) - set(loaded))
                if missing:
                    raise RuntimeError(f"parameters not loaded from the checkpoint: {missing[:5]}")
                # the loader's post-load step (on the CPU it picks each linear's kernel: oneDNN, packed or
                # torch's), the loop vLLM's model_loader.utils.process_weights_after_loading runs per module
                for module in enc.modules():
                    qm = getattr(module, "quant_method", None)
                    if isinstance(qm, QuantizeMethodBase):
                        qm.process_weights_after_loading(module)
                rec["layers"] = len(enc.vision_model.encoder.layers)
                rec["weights_loaded"] = len(loaded)
                enc.eval()
                t0 = time.perf_counter()
                with torch.no_grad():
                    for name in names:
                        x = pixels[f"pixels/{name}"][None].to(dtype)
                        m = pixels[f"mask/{name}"][None]
                        outputs[f"{dtype_name}/{name}"] = enc(x, m)[0].to(torch.float32).contiguous()
                rec["wall_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - recorded, the gate reports it
                rec["error"] = f"{type(e).__name__}: {e}"
                rec["traceback"] = traceback.format_exc(limit=8)
            report["runs"][dtype_name] = rec
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
        scope.__exit__(None, None, None)
    save_file(outputs, request["outputs"])
    write_report(report, request["report"])
    return report


if __name__ == "__main__":
    sys.exit(request_main(run, "engine.vision_tower_runner", {"VLLM_LOGGING_LEVEL": "WARNING"}))

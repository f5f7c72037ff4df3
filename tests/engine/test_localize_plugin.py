"""The localizer's engine-side pieces that need no engine: the fault-injection plugin on a toy model (it imports
torch only until vLLM loads it), and the profile -> runner invocation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from core.errors import UserError

PLUGIN = Path(__file__).resolve().parents[2] / "engine" / "vllm_perturb" / "ds41_vllm_perturb" / "__init__.py"


@pytest.fixture(scope="module")
def plugin():
    spec = importlib.util.spec_from_file_location("ds41_vllm_perturb_under_test", PLUGIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.Linear(4, 4)
        self.mlp = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.mlp(x + self.self_attn(x))


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer() for _ in range(3)])

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_the_plugin_scales_exactly_one_module_and_turns_off(plugin):
    toy, x = _Toy(), torch.randn(5, 4)
    seen = {}
    toy.model.layers[1].mlp.register_forward_hook(lambda m, a, out: seen.__setitem__("mlp1", out.clone()))
    clean_mlp1 = toy.model.layers[1].mlp(toy.model.layers[0](x) + toy.model.layers[1].self_attn(toy.model.layers[0](x)))
    base = toy(x)
    info = plugin.configure(toy, 1, "mlp", 1e-3)
    assert info["target"] == "model.layers.1.mlp" and info["layer"] == 1 and info["n_layers"] == 3
    toy(x)
    # prepended: a later hook (the localizer's capture) sees the perturbed output
    assert torch.allclose(seen["mlp1"], clean_mlp1 * (1 + 1e-3), rtol=0, atol=1e-7)
    assert plugin.status(toy)["target"] == "model.layers.1.mlp"
    assert plugin.configure(toy, -1, "attn")["target"] == "model.layers.2.self_attn"  # moved, not added
    assert not torch.equal(toy(x), base)
    assert plugin.configure(toy, None)["target"] is None
    assert torch.equal(toy(x), base)
    with pytest.raises(plugin.PerturbError, match="3 decoder layers"):
        plugin.configure(toy, 3, "mlp")
    with pytest.raises(plugin.PerturbError, match="attn"):
        plugin.configure(toy, 0, "norm")


def test_the_plugin_is_inert_without_its_variables(plugin):
    assert plugin.from_env({}) is None
    assert plugin.from_env({"DS41_PERTURB_LAYER": "15", "DS41_PERTURB_MODULE": "mlp"}) == (15, "mlp", 1e-3)
    assert plugin.from_env({"DS41_PERTURB_LAYER": "-1", "DS41_PERTURB_MODULE": "attn",
                            "DS41_PERTURB_SCALE": "0.01"}) == (-1, "attn", 0.01)
    with pytest.raises(plugin.PerturbError, match="both"):
        plugin.from_env({"DS41_PERTURB_LAYER": "1"})
    with pytest.raises(plugin.PerturbError, match="expected one of"):
        plugin.from_env({"DS41_PERTURB_LAYER": "1", "DS41_PERTURB_MODULE": "moe"})
    plugin.register()  # no variables in this process: nothing patched, vLLM not even imported
    assert plugin._patched is False


def test_the_invocation_is_the_profiles_engine_arguments_without_the_http_front_end(monkeypatch):
    from engine import launcher
    from engine.localize import engine_invocation

    fake = {"vllm_python": lambda: "/venv/bin/python", "model_hf_dir": lambda: "/models/smol", "cache": lambda: "/c",
            "stamp": lambda: "s"}
    monkeypatch.setattr(launcher, "default_providers", lambda: fake)
    inv = engine_invocation("vllm-cpu-fp32", flags=["chunked_prefill_64"],
                            extra_env={"DS41_PERTURB_LAYER": "2", "DS41_PERTURB_MODULE": "attn"},
                            base_env={"PATH": "/bin", "VIRTUAL_ENV": "/h", "DS41_PERTURB_LAYER": "9"})
    args = list(inv.engine_args)
    assert inv.python == "/venv/bin/python" and inv.dtype == "float32"
    assert args[args.index("--model") + 1] == "/models/smol" and "--max-num-batched-tokens" in args
    assert not {"--host", "--port", "--enable-prompt-tokens-details", "vllm.entrypoints.openai.api_server"} & set(args)
    assert inv.env["DS41_PERTURB_LAYER"] == "2" and "VIRTUAL_ENV" not in inv.env   # --engine-env wins
    assert inv.env["PYTHONPATH"].split(":")[0] == str(Path(launcher.REPO_ROOT))
    with pytest.raises(UserError, match="in process"):
        engine_invocation("llama-server-f32")

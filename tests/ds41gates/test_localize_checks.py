"""The localizer's input checks, without an engine: a requested fault the engine did not apply is an error (not a
clean-looking record), and --layers outside the model is an error naming the range."""

from __future__ import annotations

import pytest

from core.errors import UserError

PROFILE = "vllm-cpu-fp32"
ASK = {"DS41_PERTURB_LAYER": "15", "DS41_PERTURB_MODULE": "mlp"}


def test_a_requested_fault_that_the_engine_did_not_apply_is_an_error():
    from ds41gates.localize import check_fault_applied
    from engine.localize import engine_invocation

    import dataclasses

    # VLLM_PLUGINS is not on --engine-env's allow-list (engine/environment.py), so the environment that drops the
    # plugin is made here, as any other way of not loading it (a venv without the plugin) would leave it
    inv = engine_invocation(PROFILE, (), ASK, base_env={})
    inv = dataclasses.replace(inv, env={**inv.env, "VLLM_PLUGINS": "none"})
    env_case = {"name": "run", "perturb": "env"}
    # what the runner reports when vLLM never loaded the plugin (VLLM_PLUGINS=none): no target
    with pytest.raises(UserError, match=r"DS41_PERTURB_LAYER=15.*did not apply it.*VLLM_PLUGINS='none'"):
        check_fault_applied(inv, {"perturb": {"target": None}}, env_case)
    with pytest.raises(UserError, match="not the one the engine applied"):
        check_fault_applied(inv, {"perturb": {"target": "model.layers.3.mlp", "layer": 3, "module": "mlp",
                                              "n_layers": 30}}, env_case)
    check_fault_applied(inv, {"perturb": {"target": "model.layers.15.mlp", "layer": 15, "module": "mlp",
                                          "n_layers": 30}}, env_case)
    # a case that sets its own fault (or none) is not about the environment's
    check_fault_applied(inv, {"perturb": {"target": None}}, {"name": "clean", "perturb": None})
    clean = engine_invocation(PROFILE, (), {}, base_env={})
    check_fault_applied(clean, {"perturb": {"target": None}}, env_case)


def test_layers_out_of_range_are_an_error_naming_the_range():
    from ds41gates.cli import main
    from ds41gates.localize import check_layers

    with pytest.raises(UserError, match=r"--layers 999: vllm-cpu-fp32's model has 30 decoder layers \(0\.\.29, "
                                        r"or -30\.\.-1 from the end\)"):
        check_layers(PROFILE, [0, 999])
    check_layers(PROFILE, [0, 29, -30])
    assert main(["localize", "--out", "/tmp/never", "--prompt", "a b c", "--layers", "0,999"]) == 2

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
    from engine import launcher, profiles
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
    # a stray injector variable in the caller's environment never reaches the runner: only --engine-env plants one
    plain = engine_invocation("vllm-cpu-fp32", base_env={"PATH": "/bin", "DS41_PERTURB_LAYER": "9",
                                                         "DS41_PERTURB_MODULE": "mlp"})
    assert not any(k.startswith("DS41_PERTURB_") for k in plain.env)
    assert inv.env["PYTHONPATH"].split(":")[0] == str(Path(profiles.REPO_ROOT))
    with pytest.raises(UserError, match="in process"):
        engine_invocation("llama-server-f32")


def test_the_runners_hooks_keep_nothing_and_spill_one_file_per_layer_site_and_call(tmp_path, monkeypatch):
    """Memory bound, engine side: each capture is written as its hook fires and dropped (at most the one being
    written is alive), the spill has one file per layer x site x forward call, and the assembly reads one site's
    files, writes that site, deletes them, before it reads the next site's."""
    import weakref

    from safetensors import safe_open

    from engine import localize_runner as lr

    toy = _Toy()
    ref: dict[str, list[torch.Tensor]] = {}   # the same sites, kept in memory by the test, to check the values
    for i, layer in enumerate(toy.model.layers):
        for key, mod in ((f"L{i}.attn", layer.self_attn), (f"L{i}.mlp", layer.mlp), (f"L{i}.resid", layer)):
            mod.register_forward_hook(lambda m, a, out, k=key: ref.setdefault(k, []).append(out.detach().clone()))
    live, peak, written = [], [0], []
    real_write = lr._spill_write

    def spy_write(path, t):
        live.append(weakref.ref(t))
        peak[0] = max(peak[0], sum(r() is not None for r in live))
        written.append(Path(path).name)
        real_write(path, t)

    monkeypatch.setattr(lr, "_spill_write", spy_write)
    info = lr.install(toy)
    assert info["hooked_layers"] == [0, 1, 2] and info["writer"] is True
    x = torch.randn(12, 4)
    toy(x)                                     # outside begin()/end(): nothing written, nothing kept
    assert written == []
    spill = tmp_path / "case.spill"
    lr.begin(toy, str(spill))
    ref.clear()
    with torch.no_grad():
        for chunk in (x[:7], x[7:11], x[11:12]):   # a chunked prefill (7 + 4 rows), then one decode row
            toy(chunk)
    calls = lr.end(toy)
    assert peak[0] == 1, f"{peak[0]} captures alive at once in the hooks"
    assert calls == {f"L{i}.{s}": 3 for i in range(3) for s in ("attn", "mlp", "resid")}
    names = sorted(p.name for p in spill.iterdir())
    assert names == sorted(lr.spill_name(f"L{i}.{s}", c) for i in range(3) for s in ("attn", "mlp", "resid")
                           for c in range(3))
    assert lr._ATTR in vars(toy) and not any(isinstance(v, torch.Tensor) for v in vars(toy)[lr._ATTR].values())

    events = []
    real_read = lr._read_spill

    def spy_read(path):
        events.append(("read", Path(path).name.split(".c")[0]))
        return real_read(path)

    real_stream_write = lr._StreamedSafetensors.write

    def spy_stream_write(self, name, t):
        events.append(("write", name))
        real_stream_write(self, name, t)

    monkeypatch.setattr(lr, "_read_spill", spy_read)
    monkeypatch.setattr(lr._StreamedSafetensors, "write", spy_stream_write)
    out = tmp_path / "case.safetensors"
    done = lr.assemble(str(spill), str(out), 11, 2)
    assert done == {"tensors": 18, "spill_files": 27, "rows_per_call": [7, 4, 1]}
    assert not spill.exists()
    # one site at a time: its three call files read, its two tensors written, then the next site
    order = [f"L{i}.{s}" for i in range(3) for s in ("attn", "mlp", "resid")]
    want = []
    for key in order:
        want += [("read", key)] * 3 + [("write", f"prefill/{key}"), ("write", f"decode/{key}")]
    assert events == want
    with safe_open(str(out), framework="pt") as f:
        assert sorted(f.keys()) == sorted(k for key in order for k in (f"prefill/{key}", f"decode/{key}"))
        for key in order:
            rows = torch.cat(ref[key])
            assert torch.equal(f.get_tensor(f"prefill/{key}"), rows[:11])
            assert torch.equal(f.get_tensor(f"decode/{key}"), rows[11:12])
    lr.remove(toy)
    assert getattr(toy, lr._ATTR) is None
    # no hook at all (a plain run, sites=[]): an empty capture file, as before
    lr.install(toy, sites=())
    lr.begin(toy, str(tmp_path / "plain.spill"))
    toy(x)
    lr.end(toy)
    assert lr.assemble(str(tmp_path / "plain.spill"), str(tmp_path / "plain.safetensors"), 12, 1)["tensors"] == 0
    with safe_open(str(tmp_path / "plain.safetensors"), framework="pt") as f:
        assert list(f.keys()) == []


class _PositionedToy(torch.nn.Module):
    """vLLM's model signature: forward(input_ids, positions); rows are tokens, one position each."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 4)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer() for _ in range(2)])

    def forward(self, input_ids, positions):
        x = self.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_the_position_threshold_perturbs_only_rows_at_or_past_it(plugin):
    """DS41_PERTURB_FROM_POS: the long-only planted fault (issue 39). Rows of tokens before the threshold are
    bit-identical to the clean model's, rows at or past it are not; across two chunks the absolute positions
    decide, not the row index."""
    toy = _PositionedToy()
    ids = torch.arange(8)
    clean = toy(ids, torch.arange(8))
    info = plugin.configure(toy, 0, "mlp", 0.5, from_pos=5)
    assert info["from_pos"] == 5 and plugin.status(toy)["from_pos"] == 5
    out = toy(ids, torch.arange(8))
    assert torch.equal(out[:5], clean[:5])
    assert not torch.isclose(out[5:], clean[5:]).all(dim=1).any()
    # a second chunk of the same sequence (positions 4..7, keyword form): rows 0 clean, rows 1..3 perturbed
    chunk = toy(ids[4:], positions=torch.arange(4, 8))
    assert torch.equal(chunk[0], clean[4]) and torch.equal(chunk[1:], out[5:])
    # moving the fault drops the positions pre-hook with it; off restores every row
    plugin.configure(toy, None)
    assert torch.equal(toy(ids, torch.arange(8)), clean)
    assert not toy._forward_pre_hooks
    with pytest.raises(plugin.PerturbError, match="position >= 0"):
        plugin.configure(toy, 0, "mlp", 0.5, from_pos=-1)


def test_the_position_threshold_is_read_strictly_from_the_environment(plugin):
    assert plugin.from_pos_from_env({}) is None
    assert plugin.from_pos_from_env({"DS41_PERTURB_FROM_POS": "2048"}) == 2048
    with pytest.raises(plugin.PerturbError, match="DS41_PERTURB_FROM_POS='2k'"):
        plugin.from_pos_from_env({"DS41_PERTURB_FROM_POS": "2k"})


def _fp8_ds_mla_page(rows: list[torch.Tensor], rows_per_page: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An fp8_ds_mla page built the way the layout is described (independently of the runner's decoder): per row,
    448 NoPE values as fp8 e4m3 with one power-of-two scale per 64 (stored as its exponent + 127), then 64 bf16
    RoPE values; the rows' 576 bytes first, their 8 scale bytes after them. -> (page, the exact values stored)."""
    data = torch.zeros(rows_per_page, 576, dtype=torch.uint8)
    scales = torch.zeros(rows_per_page, 8, dtype=torch.uint8)
    exact = []
    for p, row in enumerate(rows):
        nope, rope = row[:448].view(7, 64), row[448:]
        exps = torch.ceil(torch.log2(nope.abs().amax(dim=1) / 448.0)).clamp(min=-127)
        q = (nope / torch.exp2(exps)[:, None]).to(torch.float8_e4m3fn)
        data[p, :448] = q.reshape(-1).view(torch.uint8)
        data[p, 448:] = rope.to(torch.bfloat16).view(torch.uint8)
        scales[p, :7] = (exps + 127).to(torch.uint8)
        exact.append(torch.cat([(q.float() * torch.exp2(exps)[:, None]).reshape(-1),
                                rope.to(torch.bfloat16).float()]))
    return torch.cat([data.reshape(-1), scales.reshape(-1)]), exact


def test_the_compressor_rows_are_decoded_from_vllms_fp8_ds_mla_layout():
    from engine import localize_runner as lr

    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(512, generator=g) * s for s in (0.01, 1.0, 300.0)]
    page, exact = _fp8_ds_mla_page(rows, rows_per_page=4)
    for p, want in enumerate(exact):
        got = lr.decode_fp8_ds_mla(page, p, 4)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (got - rows[p]).norm() / rows[p].norm() < 0.05        # what was stored, up to fp8 rounding
    assert torch.equal(lr.decode_fp8_ds_mla(page, 3, 4), torch.zeros(512))   # an empty row decodes to zeros


def test_the_router_site_keeps_the_weights_beside_the_chosen_experts():
    """``router_weights``: the routing as a dense [n, n_experts] vector, so that a fault that keeps the chosen set
    and moves its weights is a distance at that site (the ``router`` site, compared as sets, is blind to it)."""
    from core.localize import position_distances, set_distances
    from engine import localize_runner as lr

    ids = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    dense = lr.dense_routing(w, ids, 6)
    assert dense.shape == (2, 6) and dense[0, 3] == 0.7 and dense[0, 1] == 0.3 and dense[1].sum() == 1.0
    assert torch.count_nonzero(dense) == 4

    class Router:
        global_num_experts = 6

        def __init__(self, weights):
            self.weights = weights

        def _compute_routing(self, hidden, logits, indices_type):
            return self.weights, ids

    seen = []
    base, moved = Router(w), Router(torch.tensor([[0.6, 0.4], [0.6, 0.4]]))
    for r in (base, moved):
        tap = lr._RoutingTap(r, lambda weights, chosen, n: seen.append((chosen, lr.dense_routing(weights, chosen, n))))
        assert r._compute_routing(None, None, None)[1] is ids      # the router's own result passes through
        tap.remove()
        assert "_compute_routing" not in vars(r)
    (ids_a, dense_a), (ids_b, dense_b) = seen
    assert set_distances(ids_b.numpy(), ids_a.numpy()).tolist() == [0.0, 0.0]      # the same sets
    d = position_distances(dense_b.numpy(), dense_a.numpy())[0]
    assert d[0] > 0.1 and d[1] == 0.0                                              # the weights moved at row 0


def test_the_logits_are_compared_in_row_chunks_read_from_the_capture_file(tmp_path, monkeypatch):
    """Memory bound for long prompts: the logits site ([n, vocab]) is never read whole from a capture file — its
    KL is computed over RowView slices of at most KL_ROWS rows — and the distances are the ones the in-memory
    arrays give."""
    from safetensors.torch import save_file

    from core.localize import KL_ROWS, localize_sites
    from engine import localize as el

    g = torch.Generator().manual_seed(5)
    n, vocab = 150, 300
    ref = {"prefill/logits": torch.randn(n, vocab, generator=g), "prefill/L0.attn": torch.randn(n, 8, generator=g)}
    sides = {"ref": ref, "floor": {k: v + 1e-4 * torch.randn(v.shape, generator=g) for k, v in ref.items()},
             "test": {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in ref.items()}}
    for name, acts in sides.items():
        save_file(acts, str(tmp_path / f"{name}.safetensors"))
    whole, sliced = [], []
    real_get, real_rows = el.LazyCaptures.__getitem__, el.RowView.__getitem__
    monkeypatch.setattr(el.LazyCaptures, "__getitem__", lambda self, k: (whole.append(k), real_get(self, k))[1])
    monkeypatch.setattr(el.RowView, "__getitem__", lambda self, s: (sliced.append(min(s.stop, self.shape[0]) - s.start),
                                                                         real_rows(self, s))[1])
    lazy = [el.LazyCaptures(tmp_path / f"{name}.safetensors") for name in ("test", "ref", "floor")]
    got, _, _ = localize_sites(*lazy, to_numpy=lambda t: t.numpy())
    want, _, _ = localize_sites(*({k: v.numpy() for k, v in sides[s].items()} for s in ("test", "ref", "floor")))
    assert "prefill/logits" not in whole and whole.count("prefill/L0.attn") == 3
    assert sliced and max(sliced) <= KL_ROWS and sum(sliced) == 4 * n     # test+ref, floor+ref: every row, in chunks
    for a, b in zip(got, want):
        assert (a.key, a.diverged) == (b.key, b.diverged)
        assert a.worst == pytest.approx(b.worst, rel=1e-12) and a.mean == pytest.approx(b.mean, rel=1e-12)


def test_the_engines_head_runs_over_every_row_in_chunks():
    from engine import localize_runner as lr

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.lm = torch.nn.Linear(4, 9).to(torch.bfloat16)
            self.calls = []

        def compute_logits(self, h):
            self.calls.append(h.shape[0])
            return self.lm(h)

    head, h = Head(), torch.randn(10, 4).to(torch.bfloat16)
    got = lr.logits_rows(head, h, rows=3)
    assert head.calls == [3, 3, 3, 1] and got.dtype == torch.float32 and got.shape == (10, 9)
    torch.testing.assert_close(got, head.lm(h).float(), rtol=0, atol=0)
    head.compute_logits = lambda h: None          # a PP rank without the head: nothing
    assert lr.logits_rows(head, h) is None


def test_a_tweak_of_a_weight_the_engine_dropped_is_refused_and_its_packed_gemm_is_scaled_instead():
    from engine import localize_runner as lr

    toy = _Toy()
    gate = toy.model.layers[0].mlp
    gate.cpu_linear = lambda x, w, b: x @ torch.ones(4, 4)       # what vLLM CPU leaves after packing
    x = torch.randn(3, 4)
    before = gate.cpu_linear(x, None, None)
    gate.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(KeyError, match=r"empty in the engine.*packed_linear.*model\.layers\.0\.mlp"):
        lr.tweak(toy, [{"param": "model.layers.0.mlp.weight", "index": None, "scale": 1.05}])
    info = lr.tweak(toy, [{"packed_linear": "model.layers.0.mlp", "scale": 1.05}])
    assert info["edits"][0]["changed"] == 1
    torch.testing.assert_close(gate.cpu_linear(x, None, None), before * 1.05)
    lr.tweak(toy, None)                                              # put back
    torch.testing.assert_close(gate.cpu_linear(x, None, None), before, rtol=0, atol=0)

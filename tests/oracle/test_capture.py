"""oracle/capture.py: the localizer's oracle sites mean what they say (SmolLM2, transformers oracle)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def smol():
    from engine.models import default_model_dir

    return default_model_dir()


def test_the_sites_add_up_to_the_residual_stream_and_the_floor_is_the_same_model(smol):
    from oracle.capture import capture_hf, load_hf

    ids = [1, 504, 3458, 314, 260, 1345, 30, 216]
    orc = load_hf(smol, "fp32")
    acts, info = capture_hf(smol, ids, "fp32", oracle=orc)
    n_layers = orc.model.config.num_hidden_layers
    assert set(acts) == {f"L{i}.{s}" for i in range(n_layers) for s in ("attn", "mlp", "resid")} | {
        "embed", "final_norm", "logits"}
    assert info["dtype"] == "float32" and all(v.shape == (len(ids), 576) for k, v in acts.items() if k != "logits")
    assert acts["logits"].shape == (len(ids), orc.model.config.vocab_size)
    # the embedding is the rows of the token ids; layer 0 starts from it
    torch.testing.assert_close(acts["embed"], orc.model.get_input_embeddings().weight[ids], rtol=0, atol=0)
    torch.testing.assert_close(acts["L0.resid"], acts["embed"] + acts["L0.attn"] + acts["L0.mlp"],
                               rtol=1e-5, atol=1e-5)
    # the residual stream leaving layer i = the stream entering it + its attention output + its MLP output
    for i in range(1, n_layers):
        want = acts[f"L{i - 1}.resid"] + acts[f"L{i}.attn"] + acts[f"L{i}.mlp"]
        torch.testing.assert_close(acts[f"L{i}.resid"], want, rtol=1e-5, atol=1e-5)
    # and it is what transformers reports as the hidden state (the last one is after the final norm there):
    # bit for bit, because the direct forward runs at the capture's own thread count (info["threads"]); a
    # GEMM split over another number of threads sums in another order (2.3e-4 apart at L3 on a 2-core AMX
    # Xeon), so comparing across thread counts would hold only when the suite happened to leave them equal
    prev = torch.get_num_threads()
    torch.set_num_threads(info["threads"])
    try:
        with torch.inference_mode():
            hs = orc.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            head = orc.model.lm_head(hs[-1][0])
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(acts["L3.resid"], hs[4][0], rtol=0, atol=0)
    # the final norm's output is transformers' last hidden state, and the logits are the head on it
    torch.testing.assert_close(acts["final_norm"], hs[-1][0], rtol=0, atol=0)
    torch.testing.assert_close(acts["logits"], head, rtol=0, atol=0)
    # the floor runs: the same model at another precision, close to fp32 and not equal to it
    f64, info64 = capture_hf(smol, ids, "fp64", layers=[0, 3], oracle=load_hf(smol, "fp64", base=orc))
    assert info64["dtype"] == "float64" and set(f64) == {f"L{i}.{s}" for i in (0, 3) for s in ("attn", "mlp", "resid")
                                                         } | {"embed", "final_norm", "logits"}
    rel = (f64["L3.resid"] - acts["L3.resid"]).norm() / acts["L3.resid"].norm()
    assert 0 < rel < 1e-5
    bf16, _ = capture_hf(smol, ids, "bf16", layers=[3], oracle=load_hf(smol, "bf16", base=orc))
    rel = (bf16["L3.resid"] - acts["L3.resid"]).norm() / acts["L3.resid"].norm()
    assert 1e-4 < rel < 0.1
    assert next(orc.model.parameters()).dtype == torch.float32   # the floors were copies


def test_with_a_spill_folder_each_site_is_written_as_it_fires_and_read_back_one_at_a_time(smol, tmp_path,
                                                                                          monkeypatch):
    """Memory bound, oracle side: with ``spill`` no capture is kept (at most the one being written is alive),
    one file per site, and the returned mapping reads one site per access, equal to the in-memory capture."""
    import weakref

    import oracle.capture as cap

    ids = [1, 504, 3458, 314, 260, 1345, 30, 216]
    orc = cap.load_hf(smol, "fp32")
    mem, _ = cap.capture_hf(smol, ids, "fp32", layers=[0, 5, 29], oracle=orc)
    live, peak = [], [0]
    real_write = cap.spill_write

    def spy_write(folder, key, t):
        live.append(weakref.ref(t))
        peak[0] = max(peak[0], sum(r() is not None for r in live))
        real_write(folder, key, t)

    monkeypatch.setattr(cap, "spill_write", spy_write)
    lazy, _ = cap.capture_hf(smol, ids, "fp32", layers=[0, 5, 29], oracle=orc, spill=tmp_path / "o")
    assert isinstance(lazy, cap.SpillCaptures) and len(live) == 9 + 3   # 3 layers x 3 sites, embed, norm, logits
    assert peak[0] == 1, f"{peak[0]} captures alive at once in the hooks"
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == sorted(f"{k}.safetensors" for k in mem)
    opened = []
    real_open = __import__("safetensors").safe_open
    monkeypatch.setattr("safetensors.safe_open", lambda path, **kw: (opened.append(Path(path).name),
                                                                     real_open(path, **kw))[1])
    assert set(lazy) == set(mem) and opened == []          # listing the keys reads nothing
    for k in mem:
        torch.testing.assert_close(lazy[k], mem[k], rtol=0, atol=0)
    assert opened == [f"{k}.safetensors" for k in mem]     # one file per access, that site's


def test_layers_outside_the_model_are_an_error_naming_the_range(smol):
    from oracle.capture import CaptureError, capture_hf, load_hf

    with pytest.raises(CaptureError, match=r"layers \[999\]: the model has 30 decoder layers \(0\.\.29\)"):
        capture_hf(smol, [1, 2, 3], "fp32", layers=[0, 999], oracle=load_hf(smol, "fp32"))


def test_the_deepseek_v4_compressor_site_is_one_row_per_token_that_completes_a_group():
    """``L<i>.compressor`` on the tiny V4 (layer 1: ratio 4, layer 2: ratio 128): the compressed KV entry sits at
    the token that completes its group (positions 3, 7 of 11 tokens), zeros elsewhere; no ratio-128 entry before
    128 tokens; and the row at a position depends only on the tokens up to it (a shorter prompt gives the same
    rows), so it is the entry that token completed, not a row of the whole prompt."""
    from engine.dsv4_model import dsv4_tiny_dir
    from oracle.capture import capture_dsv41

    ids = list(range(100, 111))
    acts, _ = capture_dsv41(dsv4_tiny_dir(), ids, "fp32", layers=[1, 2])
    c = acts["L1.compressor"]
    assert c.shape == (11, 512)
    assert [t for t in range(11) if c[t].abs().sum() > 0] == [3, 7]
    assert float(acts["L2.compressor"].abs().sum()) == 0.0
    short, _ = capture_dsv41(dsv4_tiny_dir(), ids[:8], "fp32", layers=[1])
    torch.testing.assert_close(short["L1.compressor"], c[:8], rtol=1e-5, atol=1e-6)

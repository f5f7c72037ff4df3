"""The behaviour gates' request shapes behind the adapter seam (gates/_engine.py asks the profile's adapter).

vLLM keeps the exact bodies the gates sent before the seam; llama-server does what it can (ignore_eos, its
context length from /props) and says "not supported by this engine" for the rest; SGLang likewise."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.adapters.base import GenerateOptions, JsonReply, MetricsSnapshot, SseEvent
from engine.adapters.llamacpp import LlamaCppPythonAdapter, LlamaServerAdapter
from engine.adapters.sglang import SglangAdapter
from engine.adapters.vllm import VllmAdapter
from engine.client import ClientConfig, EngineClient
from engine.errors import EngineResponseError, UnsupportedSurface
from gates import _engine
from tests.engine.test_client_malformed import MODEL, vllm_generation_response

PROMPT = [5, 17, 3, 29]


@dataclass
class Recorder:
    """A Transport answering from canned replies and keeping every body it was sent."""

    replies: dict[str, Any]
    model: str = MODEL
    sent: list[tuple[str, dict]] = field(default_factory=list)

    def post_json(self, path, body, *, seq_id=None):
        self.sent.append((path, dict(body)))
        reply = self.replies[path]
        return JsonReply(reply(body) if callable(reply) else reply, 0.25, path)

    def get_json(self, path):
        return JsonReply(self.replies[path], 0.01, path)

    def stream_events(self, path, body, *, seq_id=None):
        self.sent.append((path, dict(body)))
        yield from (SseEvent(0.1 * i, ev) for i, ev in enumerate(self.replies[path + "#stream"]))

    def metrics(self):
        return self.replies["/metrics"]


def _vllm() -> Recorder:
    return Recorder({"/v1/completions": lambda b: vllm_generation_response(b["prompt"], b["max_tokens"], b["logprobs"])})


def test_vllm_generation_sends_the_gates_body_as_before_the_seam():
    t = _vllm()
    gen = VllmAdapter().generate(t, "g", PROMPT, 3, 2, GenerateOptions("salt-1", True, {"min_tokens": 3}))
    path, body = t.sent[-1]
    assert path == "/v1/completions" and body == {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2,
        "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "salt-1", "ignore_eos": True,
        "min_tokens": 3}
    assert len(gen.token_ids) == 3 and gen.timing.requests == 1 and gen.timing.http_s == 0.25
    VllmAdapter().generate(t, "g", PROMPT, 3, 2)                      # the client's own default: no ignore_eos
    assert "ignore_eos" not in t.sent[-1][1] and len(t.sent[-1][1]["cache_salt"]) == 32   # a fresh salt


def test_gates_complete_goes_through_the_clients_adapter():
    t = _vllm()
    client = EngineClient(ClientConfig("http://127.0.0.1:9", MODEL), adapter=VllmAdapter())
    client.post_json = t.post_json                                    # the transport seen by the adapter
    gen = _engine.complete(client, PROMPT, 4, 3, seq_id="c")
    body = t.sent[-1][1]
    assert body["ignore_eos"] is True and body["max_tokens"] == 4 and body["cache_salt"]
    assert gen.seq_id == "c" and len(gen.positions) == 4
    _engine.complete(client, PROMPT, 4, 3, salt="s", ignore_eos=False)
    assert t.sent[-1][1]["ignore_eos"] is False and t.sent[-1][1]["cache_salt"] == "s"
    client.close()


def test_vllm_server_facts_come_from_the_models_card_and_the_cache_gauge():
    snap = MetricsSnapshot({"vllm:cache_config_info": [("vllm:cache_config_info", {"block_size": "16"}, 1.0)]}, "")
    t = Recorder({"/v1/models": {"data": [{"id": "other", "max_model_len": 9},
                                          {"id": MODEL, "max_model_len": 2048}]}, "/metrics": snap})
    assert VllmAdapter().max_model_len(t) == 2048
    assert VllmAdapter().cache_config(t) == {"block_size": "16"}
    assert VllmAdapter().cache_config(Recorder({"/metrics": MetricsSnapshot({}, "")})) == {}


def test_llama_server_does_what_it_can_and_names_what_it_cannot():
    reply = {"tokens_predicted": 2, "tokens": [7, 9], "content": "ab", "stop_type": "limit"}
    t = Recorder({"/completion": reply, "/props": {"default_generation_settings": {"n_ctx": 4096}}})
    a = LlamaServerAdapter()
    gen = a.generate(t, "g", PROMPT, 2, a.ids_only_k, GenerateOptions(ignore_eos=True))
    assert t.sent[-1][1]["ignore_eos"] is True and gen.token_ids == (7, 9)
    assert a.max_model_len(t) == 4096
    with pytest.raises(UnsupportedSurface, match=r"chosen cache salt .* not supported by this engine \(llama-server\)"):
        a.generate(t, "g", PROMPT, 2, 0, GenerateOptions(cache_salt="s"))
    with pytest.raises(UnsupportedSurface, match=r"streamed generation is not supported by this engine"):
        a.stream(t, "g", PROMPT, 2, 1)
    with pytest.raises(UnsupportedSurface, match=r"KV-cache settings is not supported by this engine"):
        a.cache_config(t)
    for other in (LlamaCppPythonAdapter(), SglangAdapter()):
        with pytest.raises(UnsupportedSurface, match=f"not supported by this engine \\({other.name}\\)"):
            other.max_model_len(t)


def test_sglang_generation_keeps_ignore_eos_in_its_sampling_params():
    t = Recorder({"/generate": {}})
    with pytest.raises(EngineResponseError):   # the canned reply is empty: only the body sent matters here
        SglangAdapter().generate(t, "g", PROMPT, 2, 1, GenerateOptions(ignore_eos=True))
    assert t.sent[-1][1]["sampling_params"]["ignore_eos"] is True
    with pytest.raises(UnsupportedSurface, match="chosen cache salt"):
        SglangAdapter().generate(t, "g", PROMPT, 2, 1, GenerateOptions(cache_salt="s"))

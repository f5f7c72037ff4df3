"""Engine client against a tiny local fake HTTP server: malformed responses, retries, timeouts, streams.

The fake server (``FakeEngine``) is the one place a fake is right: it serves scripted bytes so every
malformed kind in ``engine.errors.Malformed`` can be provoked on purpose. Its well-formed answers follow
the vLLM 0.32 shapes seen on the real server (engines.md §3.2, §3.4), computed from an explicit
distribution so the parsed values can be checked exactly.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import numpy as np
import pytest

from engine.adapters.llamacpp import LlamaServerAdapter
from engine.client import ClientConfig, EngineClient, EngineSource, RetryPolicy, ScoreStats, parse_metrics, score_panel
from engine.errors import (
    EngineRequestRejected, EngineResponseError, EngineTransportError, Malformed, UnsupportedSurface,
)
from panels import EncodedPanel, EncodedSequence

MODEL = "fake-model"
VOCAB = 40


# ============================================================================================ fake server
class FakeEngine:
    """ThreadingHTTPServer on 127.0.0.1: routes map a path to a handler(request_json) → Reply."""

    def __init__(self):
        self.routes: dict[str, Callable[[Any], "Reply | list[Reply]"]] = {}
        self.requests: list[tuple[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self, method: str):
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                path = self.path.split("?")[0]
                with outer._lock:
                    outer.requests.append((path, body))
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    handler = outer.routes.get(path)
                    reply = handler(body) if handler else Reply(404, b'{"error": "no route"}')
                    reply.send(self)
                finally:
                    with outer._lock:
                        outer.in_flight -= 1

            def do_POST(self):
                self._serve("POST")

            def do_GET(self):
                self._serve("GET")

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Reply:
    def __init__(self, status: int = 200, body: bytes | str | Any = b"", *, delay_s: float = 0.0,
                 content_type: str = "application/json", declared_length: int | None = None,
                 chunks: list[tuple[float, bytes]] | None = None):
        if not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        self.status = status
        self.body = body.encode() if isinstance(body, str) else body
        self.delay_s = delay_s
        self.content_type = content_type
        self.declared_length = declared_length
        self.chunks = chunks

    def send(self, h: BaseHTTPRequestHandler):
        if self.delay_s:
            time.sleep(self.delay_s)
        h.send_response(self.status)
        h.send_header("content-type", self.content_type)
        if self.chunks is not None:  # SSE: stream then close
            h.send_header("connection", "close")
            h.end_headers()
            for delay, data in self.chunks:
                time.sleep(delay)
                h.wfile.write(data)
                h.wfile.flush()
            h.close_connection = True
            return
        h.send_header("content-length", str(self.declared_length or len(self.body)))
        if self.declared_length:
            h.send_header("connection", "close")
        h.end_headers()
        h.wfile.write(self.body)
        h.wfile.flush()
        if self.declared_length:
            h.close_connection = True


def sequence(*replies: Reply) -> Callable[[Any], Reply]:
    """Handler answering with the given replies in turn (the last one repeats)."""
    it = list(replies)

    def handler(_body):
        return it.pop(0) if len(it) > 1 else it[0]
    return handler


@pytest.fixture()
def fake():
    f = FakeEngine()
    yield f
    f.close()


def client_for(fake: FakeEngine, adapter=None, **cfg) -> tuple[EngineClient, list[float]]:
    sleeps: list[float] = []
    cfg.setdefault("retry", RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05))
    cfg.setdefault("timeout_s", 5.0)
    c = EngineClient(ClientConfig(fake.url, MODEL, vocab_size=VOCAB, **cfg), adapter=adapter, sleep=sleeps.append)
    return c, sleeps


# ============================================================================================ well-formed vLLM answers
def distribution(prefix: tuple[int, ...]) -> np.ndarray:
    """A deterministic full-vocab log-distribution for the position after ``prefix`` (no ties)."""
    rng = np.random.default_rng(abs(hash(prefix)) % (2**32))
    logits = rng.normal(0, 3, VOCAB) + np.arange(VOCAB) * 1e-6
    return logits - np.logaddexp.reduce(logits)


def ranks_of(lp: np.ndarray) -> np.ndarray:
    return 1 + (lp[None, :] > lp[:, None]).sum(axis=1)


def vllm_prompt_response(ids: list[int], k: int, model: str = MODEL, cached: int | None = 0) -> dict:
    plp: list[Any] = [None]
    for i in range(1, len(ids)):
        lp = distribution(tuple(ids[:i]))
        rk = ranks_of(lp)
        top = list(np.argsort(-lp)[:k])
        entry = {str(ids[i]): {"logprob": float(lp[ids[i]]), "rank": int(rk[ids[i]]), "decoded_token": "x"}}
        for t in top:
            entry[str(int(t))] = {"logprob": float(lp[t]), "rank": int(rk[t]), "decoded_token": "y"}
        plp.append(entry)
    usage: dict[str, Any] = {"prompt_tokens": len(ids), "total_tokens": len(ids) + 1, "completion_tokens": 1}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
            "choices": [{"index": 0, "text": "z", "logprobs": None, "finish_reason": "length", "token_ids": [3],
                         "prompt_logprobs": plp, "prompt_token_ids": list(ids)}],
            "usage": usage}


def vllm_generation_response(prompt: list[int], n: int, k: int) -> dict:
    ids, tokens, tlp, top = [], [], [], []
    ctx = list(prompt)
    for _ in range(n):
        lp = distribution(tuple(ctx))
        t = int(np.argmax(lp))
        ids.append(t)
        tokens.append(f"token_id:{t}")
        tlp.append(float(lp[t]))
        top.append({f"token_id:{int(x)}": float(lp[x]) for x in np.argsort(-lp)[:k]})
        ctx.append(t)
    return {"id": "cmpl-2", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": "abc", "finish_reason": "length", "token_ids": ids,
                         "prompt_token_ids": list(prompt),
                         "logprobs": {"tokens": tokens, "token_logprobs": tlp, "top_logprobs": top,
                                      "text_offset": list(range(n))}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}}


def vllm_route(k_default: int = 3):
    def handler(body):
        ids = body["prompt"]
        if "prompt_logprobs" in body:
            return Reply(200, vllm_prompt_response(ids, body["prompt_logprobs"]))
        return Reply(200, vllm_generation_response(ids, body["max_tokens"], body["logprobs"]))
    return handler


IDS = [5, 17, 3, 29, 11, 8]


# ============================================================================================ well-formed path
def test_prompt_logprobs_match_the_served_distribution(fake):
    fake.routes["/v1/completions"] = vllm_route()
    c, _ = client_for(fake)
    got = c.prompt_logprobs(IDS, 4, seq_id="s1")
    assert [p.position for p in got.positions] == [1, 2, 3, 4, 5]
    for p in got.positions:
        lp = distribution(tuple(IDS[:p.position]))
        order = list(np.argsort(-lp)[:4])
        assert list(p.top_ids) == order               # the appended actual token is not a top-k member
        assert np.allclose(p.top_logprobs, lp[order], rtol=0, atol=0)
        assert p.actual_logprob == lp[IDS[p.position]]
        assert p.actual_rank == ranks_of(lp)[IDS[p.position]]
    body = fake.requests[-1][1]
    assert body["prompt"] == IDS and body["prompt_logprobs"] == 4 and body["return_token_ids"] is True
    assert body["temperature"] == 0 and len(body["cache_salt"]) == 32
    assert got.cached_tokens == 0 and got.timing.requests == 1 and got.timing.http_s > 0


def test_clamped_values_read_as_minus_infinity(fake):
    resp = vllm_prompt_response(IDS, 2)
    actual = str(IDS[2])
    resp["choices"][0]["prompt_logprobs"][2][actual]["logprob"] = -9999.0
    resp["choices"][0]["prompt_logprobs"][2][actual]["rank"] = VOCAB
    fake.routes["/v1/completions"] = lambda b: Reply(200, resp)
    c, _ = client_for(fake)
    got = c.prompt_logprobs(IDS, 2, seq_id="s")
    assert got.positions[1].actual_logprob == -math.inf


def test_generation_greedy_ids_and_topk(fake):
    fake.routes["/v1/completions"] = vllm_route()
    c, _ = client_for(fake)
    g = c.generate(IDS, 3, 5, seq_id="g")
    assert len(g.token_ids) == 3 and [p.position for p in g.positions] == [6, 7, 8]
    ctx = list(IDS)
    for p, t in zip(g.positions, g.token_ids):
        lp = distribution(tuple(ctx))
        assert t == int(np.argmax(lp)) and p.actual_rank == 1 and list(p.top_ids) == list(np.argsort(-lp)[:5])
        ctx.append(t)
    body = fake.requests[-1][1]
    assert body["return_tokens_as_token_ids"] is True and body["logprobs"] == 5
    assert g.cached_tokens is None  # usage without prompt_tokens_details: unknown, not 0


def test_cached_tokens_reported_when_present(fake):
    fake.routes["/v1/completions"] = lambda b: Reply(200, vllm_prompt_response(b["prompt"], 2, cached=4))
    c, _ = client_for(fake)
    assert c.prompt_logprobs(IDS, 2, seq_id="s").cached_tokens == 4
    fake.routes["/v1/completions"] = lambda b: Reply(200, vllm_prompt_response(b["prompt"], 2, cached=None))
    assert c.prompt_logprobs(IDS, 2, seq_id="s").cached_tokens is None


# ============================================================================================ malformed kinds
def _plp(resp):
    return resp["choices"][0]["prompt_logprobs"]


def _set(path: list, value):
    def mutate(resp):
        obj = resp
        for p in path[:-1]:
            obj = obj[p]
        obj[path[-1]] = value
    return mutate


def _del(path: list):
    def mutate(resp):
        obj = resp
        for p in path[:-1]:
            obj = obj[p]
        del obj[path[-1]]
    return mutate


def _entry(pos: int, fn):
    def mutate(resp):
        fn(_plp(resp)[pos])
    return mutate


def _actual_key(pos):
    return str(IDS[pos])


def _top_key(resp, pos, rank):
    return next(k for k, v in _plp(resp)[pos].items() if v["rank"] == rank and k != _actual_key(pos))


def _mut_rank_swap(resp):
    e = _plp(resp)[3]
    a, b = _top_key(resp, 3, 1), _top_key(resp, 3, 2)
    e[a]["logprob"], e[b]["logprob"] = e[b]["logprob"], e[a]["logprob"]


def _mut_bad_rank(resp):
    e = _plp(resp)[2]
    e[_top_key(resp, 2, 2)]["rank"] = 7


def _mut_drop_top(resp):
    e = _plp(resp)[4]
    del e[_top_key(resp, 4, 3)]
    if len(e) > 3:
        del e[_top_key(resp, 4, 2)]


def _mut_extra(resp):
    e = _plp(resp)[1]
    for t in range(VOCAB):
        if str(t) not in e:
            e[str(t)] = {"logprob": -30.0, "rank": 39, "decoded_token": "q"}
            break


def _mut_actual_missing(resp):
    e = _plp(resp)[5]
    del e[_actual_key(5)]
    e[str(next(t for t in range(VOCAB) if str(t) not in e))] = {"logprob": -50.0, "rank": 40, "decoded_token": "q"}


def _mut_actual_inconsistent(resp):
    e = _plp(resp)[2]
    a = _actual_key(2)
    if e[a]["rank"] <= 3:
        pytest.skip("fixture distribution has the actual token inside the top-3")
    e[a]["logprob"] = 0.0


# (case id, mutation of a valid k=3 prompt_logprobs response, expected kind, expected position)
PROMPT_CASES = [
    ("wrong model", _set(["model"], "other-model"), Malformed.WRONG_MODEL, None),
    ("missing model", _del(["model"]), Malformed.MISSING_FIELD, None),
    ("no choices", _set(["choices"], []), Malformed.NO_CHOICES, None),
    ("choices not a list", _set(["choices"], {"0": 1}), Malformed.WRONG_TYPE, None),
    ("no prompt_logprobs", _del(["choices", 0, "prompt_logprobs"]), Malformed.MISSING_LOGPROBS, None),
    ("prompt_logprobs null", _set(["choices", 0, "prompt_logprobs"], None), Malformed.MISSING_LOGPROBS, None),
    ("no prompt_token_ids", _del(["choices", 0, "prompt_token_ids"]), Malformed.MISSING_FIELD, None),
    ("prompt ids differ", _set(["choices", 0, "prompt_token_ids", 3], 30), Malformed.PROMPT_IDS_MISMATCH, 3),
    ("prompt ids shorter", lambda r: r["choices"][0]["prompt_token_ids"].pop(), Malformed.PROMPT_IDS_MISMATCH, None),
    ("prompt_logprobs too short", lambda r: _plp(r).pop(), Malformed.LENGTH_MISMATCH, None),
    ("position 0 not null", lambda r: _plp(r).__setitem__(0, {"5": {"logprob": -1.0, "rank": 1}}),
     Malformed.POSITION0_NOT_NULL, 0),
    ("null entry", lambda r: _plp(r).__setitem__(3, None), Malformed.NULL_ENTRY, 3),
    ("entry is a list", lambda r: _plp(r).__setitem__(2, [1, 2]), Malformed.WRONG_TYPE, 2),
    ("logprob null", _entry(2, lambda e: e[_actual_key(2)].__setitem__("logprob", None)), Malformed.NULL_ENTRY, 2),
    ("logprob string", _entry(2, lambda e: e[_actual_key(2)].__setitem__("logprob", "-1.5")), Malformed.WRONG_TYPE, 2),
    ("logprob positive", _entry(1, lambda e: e[_actual_key(1)].__setitem__("logprob", 0.5)),
     Malformed.POSITIVE_LOGPROB, 1),
    ("logprob missing", _entry(1, lambda e: e[_actual_key(1)].pop("logprob")), Malformed.MISSING_FIELD, 1),
    ("rank missing", _entry(1, lambda e: e[_actual_key(1)].pop("rank")), Malformed.MISSING_FIELD, 1),
    ("rank zero", _entry(1, lambda e: e[_actual_key(1)].__setitem__("rank", 0)), Malformed.BAD_RANK, 1),
    ("top-k ranks not 1..k", _mut_bad_rank, Malformed.BAD_RANK, 2),
    ("logprob rises with rank", _mut_rank_swap, Malformed.RANK_ORDER, 3),
    ("non-integer key", _entry(2, lambda e: e.__setitem__("abc", {"logprob": -5.0, "rank": 9})),
     Malformed.BAD_TOKEN_KEY, 2),
    ("zero-padded key", _entry(2, lambda e: e.__setitem__("007", {"logprob": -5.0, "rank": 9})),
     Malformed.BAD_TOKEN_KEY, 2),
    ("id outside vocabulary", _entry(2, lambda e: e.__setitem__(str(VOCAB + 3), e.pop(next(
        k for k in list(e) if k != _actual_key(2))))), Malformed.ID_OUT_OF_RANGE, 2),
    ("too few entries", _mut_drop_top, Malformed.TOO_FEW_ENTRIES, 4),
    ("too many entries", _mut_extra, Malformed.TOO_MANY_ENTRIES, 1),
    ("actual token missing", _mut_actual_missing, Malformed.ACTUAL_MISSING, 5),
    ("actual outside top-k but above k-th", _mut_actual_inconsistent, Malformed.ACTUAL_INCONSISTENT, 2),
    ("usage cached_tokens negative", _set(["usage", "prompt_tokens_details", "cached_tokens"], -1),
     Malformed.USAGE_MALFORMED, None),
    ("usage not an object", _set(["usage"], [1]), Malformed.USAGE_MALFORMED, None),
]


@pytest.mark.parametrize("mutate,kind,position", [c[1:] for c in PROMPT_CASES], ids=[c[0] for c in PROMPT_CASES])
def test_malformed_prompt_logprobs(fake, mutate, kind, position):
    resp = vllm_prompt_response(IDS, 3)
    mutate(resp)
    fake.routes["/v1/completions"] = lambda b: Reply(200, resp)
    c, _ = client_for(fake)
    with pytest.raises(EngineResponseError) as ei:
        c.prompt_logprobs(IDS, 3, seq_id="seq-7")
    err = ei.value
    assert err.kind == kind, str(err)
    assert err.seq_id == "seq-7" and "seq-7" in str(err)
    if position is not None:
        assert err.position == position and f"position {position}" in str(err)
    assert c.attempts == 1  # malformed answers are not retried


def _with_number(pos: int, literal: str) -> bytes:
    """A valid response whose actual-token logprob at ``pos`` is written as the JSON number ``literal``."""
    resp = vllm_prompt_response(IDS, 3)
    _plp(resp)[pos][_actual_key(pos)]["logprob"] = -0.123456789
    return json.dumps(resp).replace("-0.123456789", literal).encode()


RAW_CASES = [
    ("logprob overflows to +inf (1e999)", _with_number(4, "1e999"), Malformed.NON_FINITE),
    ("empty body", b"", Malformed.EMPTY_BODY),
    ("truncated JSON", json.dumps(vllm_prompt_response(IDS, 3)).encode()[:-40], Malformed.INVALID_JSON),
    ("not JSON", b"<html>oops</html>", Malformed.INVALID_JSON),
    ("NaN literal", _with_number(2, "NaN"), Malformed.NON_STANDARD_NUMBER),
    ("Infinity literal", b'{"model": "fake-model", "choices": [], "x": Infinity}', Malformed.NON_STANDARD_NUMBER),
    ("duplicate id key", json.dumps(vllm_prompt_response(IDS, 3)).replace(
        '{"%d": {' % IDS[2], '{"%d": {"logprob": -1.0, "rank": 1}, "%d": {' % (IDS[2], IDS[2]), 1).encode(),
     Malformed.DUPLICATE_KEY),
    ("response is a list", b"[1, 2, 3]", Malformed.WRONG_TYPE),
]


@pytest.mark.parametrize("body,kind", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_malformed_bodies(fake, body, kind):
    fake.routes["/v1/completions"] = lambda b: Reply(200, body)
    c, _ = client_for(fake)
    with pytest.raises(EngineResponseError) as ei:
        c.prompt_logprobs(IDS, 3, seq_id="raw")
    assert ei.value.kind == kind, str(ei.value)
    assert ei.value.seq_id == "raw"


def _gen_case(mutate):
    def run(fake):
        resp = vllm_generation_response(IDS, 3, 3)
        mutate(resp)
        fake.routes["/v1/completions"] = lambda b: Reply(200, resp)
        c, _ = client_for(fake)
        c.generate(IDS, 3, 3, seq_id="gen")
    return run


def _lp(resp):
    return resp["choices"][0]["logprobs"]


GEN_CASES = [
    ("generated ids vs logprob entries", lambda r: r["choices"][0]["token_ids"].pop(), Malformed.GENERATED_MISMATCH),
    ("token names another id", lambda r: _lp(r)["tokens"].__setitem__(1, "token_id:39"), Malformed.GENERATED_MISMATCH),
    ("token without token_id prefix", lambda r: _lp(r)["tokens"].__setitem__(0, "hello"), Malformed.BAD_TOKEN_KEY),
    ("logprobs null", lambda r: r["choices"][0].__setitem__("logprobs", None), Malformed.MISSING_LOGPROBS),
    ("sampled logprob disagrees with its top entry",
     lambda r: _lp(r)["token_logprobs"].__setitem__(0, _lp(r)["token_logprobs"][0] - 0.5), Malformed.ACTUAL_INCONSISTENT),
    ("generated id out of range", lambda r: r["choices"][0]["token_ids"].__setitem__(0, -4), Malformed.ID_OUT_OF_RANGE),
]


@pytest.mark.parametrize("mutate,kind", [c[1:] for c in GEN_CASES], ids=[c[0] for c in GEN_CASES])
def test_malformed_generation(fake, mutate, kind):
    with pytest.raises(EngineResponseError) as ei:
        _gen_case(mutate)(fake)
    assert ei.value.kind == kind, str(ei.value)
    assert ei.value.seq_id == "gen"


def test_duplicate_id_in_an_id_list_surface(fake):
    """llama-server lists entries with ids: the same id twice is DUPLICATE_ID."""
    top = [{"id": 4, "token": "a", "bytes": [97], "logprob": -0.5}, {"id": 4, "token": "a", "bytes": [97], "logprob": -0.9}]
    body = {"model": MODEL, "tokens_evaluated": 1, "tokens": [4], "content": "a",
            "completion_probabilities": [{"id": 4, "token": "a", "bytes": [97], "logprob": -0.5, "top_logprobs": top}]}
    fake.routes["/completion"] = lambda b: Reply(200, body)
    c, _ = client_for(fake, adapter=LlamaServerAdapter(vocab_size=VOCAB))
    with pytest.raises(EngineResponseError) as ei:
        c.prompt_logprobs([1, 4], 2, seq_id="ls")
    assert ei.value.kind == Malformed.DUPLICATE_ID and ei.value.position == 1


def test_tokenize_count_mismatch(fake):
    fake.routes["/tokenize"] = lambda b: Reply(200, {"count": 3, "tokens": [1, 2], "max_model_len": 100})
    c, _ = client_for(fake)
    with pytest.raises(EngineResponseError) as ei:
        c.tokenize("hello")
    assert ei.value.kind == Malformed.TOKENIZE_MISMATCH
    fake.routes["/tokenize"] = lambda b: Reply(200, {"count": 2, "tokens": [1, 2], "max_model_len": 100})
    assert c.tokenize("hello") == [1, 2]
    assert fake.requests[-1][1] == {"model": MODEL, "prompt": "hello", "add_special_tokens": False}


def test_detokenize(fake):
    fake.routes["/detokenize"] = lambda b: Reply(200, {"prompt": "ab" * len(b["tokens"])})
    c, _ = client_for(fake)
    assert c.detokenize([1, 2, 3]) == "ababab"


# ============================================================================================ metrics
PROM = """# HELP vllm:prefix_cache_queries Prefix cache queries.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="fake-model"} 120.0
# HELP vllm:prefix_cache_hits Prefix cache hits.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="fake-model"} 48.0
"""


def test_metrics_parsed(fake):
    fake.routes["/metrics"] = lambda b: Reply(200, PROM, content_type="text/plain; version=0.0.4")
    c, _ = client_for(fake)
    m = c.metrics()
    assert m.value("vllm:prefix_cache_hits_total") == 48.0
    assert m.value("vllm:prefix_cache_queries_total", model_name="fake-model") == 120.0
    with pytest.raises(KeyError):
        m.value("vllm:prefix_cache_hits_total", model_name="other")


def test_metrics_malformed(fake):
    fake.routes["/metrics"] = lambda b: Reply(200, "vllm:x{engine=\"0\" 12\n", content_type="text/plain")
    c, _ = client_for(fake)
    with pytest.raises(EngineResponseError) as ei:
        c.metrics()
    assert ei.value.kind == Malformed.METRICS_MALFORMED
    with pytest.raises(EngineResponseError):
        parse_metrics("this is not prometheus text at all {{{")


# ============================================================================================ streaming
def _sse(events: list[Any], done: bool = True, gap: float = 0.05) -> list[tuple[float, bytes]]:
    out = [(gap if i else 0.0, f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode())
           for i, e in enumerate(events)]
    if done:
        out.append((0.0, b"data: [DONE]\n\n"))
    return out


def _stream_chunks(prompt: list[int], n: int, k: int) -> list[dict]:
    full = vllm_generation_response(prompt, n, k)["choices"][0]
    lp = full["logprobs"]
    chunks = []
    for j in range(n):
        chunks.append({"id": "c", "object": "text_completion", "created": 1, "model": MODEL, "usage": None,
                       "choices": [{"index": 0, "text": "t", "token_ids": [full["token_ids"][j]],
                                    "finish_reason": "length" if j == n - 1 else None,
                                    "logprobs": {"tokens": [lp["tokens"][j]], "token_logprobs": [lp["token_logprobs"][j]],
                                                 "top_logprobs": [lp["top_logprobs"][j]], "text_offset": [j]}}]})
    chunks.append({"id": "c", "object": "text_completion", "created": 1, "model": MODEL, "choices": [],
                   "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                             "prompt_tokens_details": {"cached_tokens": 2}}})
    return chunks


def test_stream_times_and_tokens(fake):
    fake.routes["/v1/completions"] = lambda b: Reply(200, chunks=_sse(_stream_chunks(b["prompt"], 4, 3), gap=0.06),
                                                     content_type="text/event-stream")
    c, _ = client_for(fake)
    s = c.stream(IDS, 4, 3, seq_id="st")
    g = s.generation
    assert g.token_ids == tuple(vllm_generation_response(IDS, 4, 3)["choices"][0]["token_ids"])
    assert [p.position for p in g.positions] == [6, 7, 8, 9]
    assert s.chunk_token_counts == (1, 1, 1, 1, 0)
    assert s.ttft_s is not None and s.ttft_s < 1.0
    assert len(s.inter_token_s) == 3 and all(0.05 <= d < 1.0 for d in s.inter_token_s)
    assert g.cached_tokens == 2 and g.finish_reason == "length"
    body = fake.requests[-1][1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_stream_options_reach_the_body_and_on_tokens_sees_each_chunk(fake):
    fake.routes["/v1/completions"] = lambda b: Reply(200, chunks=_sse(_stream_chunks(b["prompt"], 4, 3)),
                                                     content_type="text/event-stream")
    c, _ = client_for(fake)
    seen = []
    s = c.stream(IDS, 4, 3, seq_id="st", cache_salt="salt-1", ignore_eos=True, extra={"min_tokens": 4},
                 on_tokens=seen.append)
    body = fake.requests[-1][1]
    assert body["cache_salt"] == "salt-1" and body["ignore_eos"] is True and body["min_tokens"] == 4
    assert seen == [1, 2, 3, 4] and len(s.generation.token_ids) == 4
    c.stream(IDS, 4, 3)
    assert "ignore_eos" not in fake.requests[-1][1] and fake.requests[-1][1]["cache_salt"] != "salt-1"


def test_stream_completion_token_count_must_match_what_streamed(fake):
    def reply(b):
        chunks = _stream_chunks(b["prompt"], 3, 3)
        chunks[-1]["usage"]["completion_tokens"] = 5  # three streamed, five claimed
        return Reply(200, chunks=_sse(chunks), content_type="text/event-stream")

    fake.routes["/v1/completions"] = reply
    c, _ = client_for(fake)
    with pytest.raises(EngineResponseError) as ei:
        c.stream(IDS, 3, 3, seq_id="st")
    assert ei.value.kind == Malformed.USAGE_MALFORMED and "completion_tokens 5 but 3" in str(ei.value)


@pytest.mark.parametrize("events,done,detail", [
    (["{\"model\": \"fake-model\", \"choices\": [}"], True, "chunk"),
    ([{"model": MODEL, "choices": []}], False, "[DONE]"),
    ([{"error": {"message": "boom"}}], True, "error event"),
], ids=["broken chunk JSON", "no [DONE]", "error event"])
def test_stream_malformed(fake, events, done, detail):
    fake.routes["/v1/completions"] = lambda b: Reply(200, chunks=_sse(events, done=done), content_type="text/event-stream")
    c, _ = client_for(fake)
    with pytest.raises(EngineResponseError) as ei:
        c.stream(IDS, 2, 3, seq_id="st")
    assert ei.value.kind == Malformed.STREAM_MALFORMED and detail in str(ei.value)


def test_stream_refused_for_other_adapters(fake):
    c, _ = client_for(fake, adapter=LlamaServerAdapter())
    with pytest.raises(UnsupportedSurface):
        c.stream(IDS, 2, 3)


def test_every_malformed_kind_is_provoked_here():
    """A reliability suite can enumerate the kinds: this file provokes each one at least once."""
    covered = {c[2] for c in PROMPT_CASES} | {c[2] for c in RAW_CASES} | {c[2] for c in GEN_CASES}
    covered |= {Malformed.DUPLICATE_ID, Malformed.TOKENIZE_MISMATCH, Malformed.METRICS_MALFORMED,
                Malformed.STREAM_MALFORMED}
    assert covered == set(Malformed), sorted(k.value for k in set(Malformed) - covered)
    assert len(Malformed) >= 20


# ============================================================================================ transport
def test_retries_5xx_with_exponential_backoff_then_succeeds(fake):
    good = Reply(200, vllm_prompt_response(IDS, 2))
    fake.routes["/v1/completions"] = sequence(Reply(503, {"error": {"message": "busy"}}),
                                              Reply(502, b"bad gateway", content_type="text/plain"), good)
    c, sleeps = client_for(fake, retry=RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=1.0))
    got = c.prompt_logprobs(IDS, 2, seq_id="r")
    assert len(got.positions) == len(IDS) - 1
    assert c.attempts == 3 and sleeps == [0.01, 0.02]


def test_retries_are_bounded(fake):
    fake.routes["/v1/completions"] = lambda b: Reply(500, {"error": {"message": "kaput"}})
    c, sleeps = client_for(fake, retry=RetryPolicy(max_attempts=4, base_delay_s=0.1, max_delay_s=0.25))
    with pytest.raises(EngineTransportError) as ei:
        c.prompt_logprobs(IDS, 2, seq_id="r5")
    e = ei.value
    assert e.status == 500 and e.attempts == 4 and "kaput" in str(e) and "r5" in str(e)
    assert sleeps == [0.1, 0.2, 0.25]  # capped at max_delay_s
    assert len([r for r in fake.requests if r[0] == "/v1/completions"]) == 4


def test_4xx_is_not_retried_and_names_the_reason(fake):
    msg = "Requested sample logprobs of 21, which is greater than max allowed: 20"
    fake.routes["/v1/completions"] = lambda b: Reply(400, {"error": {"message": msg, "type": "BadRequestError"}})
    c, sleeps = client_for(fake)
    with pytest.raises(EngineRequestRejected) as ei:
        c.prompt_logprobs(IDS, 21, seq_id="cap")
    assert ei.value.status == 400 and msg in str(ei.value) and c.attempts == 1 and sleeps == []


def test_timeout_is_retried_then_named(fake):
    fake.routes["/v1/completions"] = lambda b: Reply(200, vllm_prompt_response(IDS, 2), delay_s=1.0)
    c, sleeps = client_for(fake, timeout_s=0.2, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01))
    t0 = time.perf_counter()
    with pytest.raises(EngineTransportError) as ei:
        c.prompt_logprobs(IDS, 2, seq_id="slow")
    assert ei.value.what == "timeout" and ei.value.attempts == 2
    assert time.perf_counter() - t0 < 1.5


def test_connection_refused_is_retried_then_named():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    sleeps: list[float] = []
    c = EngineClient(ClientConfig(f"http://127.0.0.1:{port}", MODEL, retry=RetryPolicy(max_attempts=3, base_delay_s=0.01)),
                     sleep=sleeps.append)
    with pytest.raises(EngineTransportError) as ei:
        c.prompt_logprobs(IDS, 2, seq_id="down")
    assert ei.value.what == "connection error" and ei.value.attempts == 3 and len(sleeps) == 2


def test_body_cut_short_is_a_connection_error_then_retried(fake):
    full = json.dumps(vllm_prompt_response(IDS, 2)).encode()
    fake.routes["/v1/completions"] = sequence(Reply(200, full[:50], declared_length=len(full)), Reply(200, full))
    c, sleeps = client_for(fake)
    got = c.prompt_logprobs(IDS, 2, seq_id="cut")
    assert len(got.positions) == 5 and c.attempts == 2


# ============================================================================================ score_panel
def _panel(seqs: list[tuple[str, list[int]]]) -> EncodedPanel:
    return EncodedPanel("unit-panel", 3, "p" * 64, "t" * 64, tuple(
        EncodedSequence(sid, "code" if i % 2 else "prose", tuple(ids), (False,) + (True,) * (len(ids) - 1))
        for i, (sid, ids) in enumerate(seqs)))


def test_score_panel_builds_an_engine_record(fake, tmp_path):
    slow = vllm_route()
    fake.routes["/v1/completions"] = lambda b: (time.sleep(0.05), slow(b))[1]
    panel = _panel([(f"s{i}", [(3 * i + j) % VOCAB for j in range(4 + i)]) for i in range(6)])
    c, _ = client_for(fake)
    stats = ScoreStats()
    src = EngineSource(url=fake.url, model=MODEL, profile="fake", flags={"no_prefix_cache": True}, precision="fp32")
    rec = score_panel(c, panel, 3, src, max_concurrency=2, progress=False, stats=stats)
    assert rec.provenance.side == "engine" and rec.provenance.precision == "fp32"
    assert rec.provenance.panel_version == "3" and rec.provenance.panel_hash == "p" * 64
    assert rec.provenance.source == {"url": fake.url, "model": MODEL, "profile": "fake",
                                     "flags": {"no_prefix_cache": True}}
    assert rec.provenance.extra["k_requested"] == 3 and rec.provenance.extra["keyed_by"] == ["id"]
    assert rec.seq_ids == [f"s{i}" for i in range(6)] and rec.k == 3
    assert rec.n_positions == sum(3 + i for i in range(6))
    for r in range(rec.n_positions):
        s, p = rec.pos_seq[r], rec.pos_index[r]
        ids = list(panel.sequences[s].token_ids)
        lp = distribution(tuple(ids[:p]))
        assert rec.actual_logprob[r] == lp[ids[p]]
        assert list(rec.topk_ids[r]) == list(np.argsort(-lp)[:3])
    salts = [b["cache_salt"] for p, b in fake.requests if p == "/v1/completions"]
    assert len(set(salts)) == 6                      # fresh salt per request
    assert fake.max_in_flight == 2                   # bounded concurrency, and it was used
    assert stats.requests == 6 and 0 < stats.http_s and stats.wall_s >= stats.build_s
    back = type(rec).load(rec.save(tmp_path / "engine.safetensors"))
    assert back.provenance == rec.provenance and np.array_equal(back.topk_logprobs, rec.topk_logprobs)


def test_score_panel_names_the_failing_sequence(fake):
    def handler(b):
        resp = vllm_prompt_response(b["prompt"], 2)
        if b["prompt"][0] == 7:
            resp["choices"][0]["prompt_token_ids"][2] += 1
        return Reply(200, resp)
    fake.routes["/v1/completions"] = handler
    c, _ = client_for(fake)
    panel = _panel([("ok", [1, 2, 3, 4]), ("bad-one", [7, 8, 9, 10])])
    with pytest.raises(EngineResponseError) as ei:
        score_panel(c, panel, 2, EngineSource(fake.url, MODEL, "fake"), progress=False)
    assert ei.value.seq_id == "bad-one" and ei.value.position == 2
    assert ei.value.kind == Malformed.PROMPT_IDS_MISMATCH


def test_stream_follows_the_sse_specification(fake):
    """CRLF line ends, comments, an ``id:`` field and a payload split over two ``data:`` lines are one event each
    (the SSE parser's rules), so a conforming stream reads the same as the plain one."""
    chunks = _stream_chunks(IDS, 2, 3)

    def odd_but_valid(b):
        out = [(0.0, b": keep-alive\r\n\r\n")]
        for i, c in enumerate(chunks):
            text = json.dumps(c)
            half = text.index(', "choices"')   # a line break between two keys: still the same JSON
            out.append((0.0, f"id: {i}\r\ndata: {text[:half]}\r\ndata:{text[half:]}\r\n\r\n".encode()))
        out.append((0.0, b"data: [DONE]\r\n\r\n"))
        return Reply(200, chunks=out, content_type="text/event-stream; charset=utf-8")

    fake.routes["/v1/completions"] = odd_but_valid
    c, _ = client_for(fake)
    s = c.stream(IDS, 2, 3, seq_id="spec")
    assert s.generation.token_ids == tuple(vllm_generation_response(IDS, 2, 3)["choices"][0]["token_ids"])


@pytest.mark.parametrize("reply,detail", [
    (lambda: Reply(200, chunks=[(0.0, b"event: ping\ndata: {}\n\n"), (0.0, b"data: [DONE]\n\n")],
                   content_type="text/event-stream"), "'ping' is not a data event"),
    (lambda: Reply(200, chunks=[(0.0, b"data: [DONE]\n\n")], content_type="application/json"),
     "text/event-stream"),
], ids=["named event", "not an event stream"])
def test_stream_that_is_not_openai_sse_is_refused(fake, reply, detail):
    fake.routes["/v1/completions"] = lambda b: reply()
    c, _ = client_for(fake)
    with pytest.raises(EngineResponseError) as ei:
        c.stream(IDS, 2, 3, seq_id="st")
    assert ei.value.kind == Malformed.STREAM_MALFORMED and detail in str(ei.value)

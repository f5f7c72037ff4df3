"""Verdict integrity, HTTP side (issue 27 item 2): a verdict is bound to the engine that produced it.

Real HTTP servers on 127.0.0.1 (two ports where a second host is needed) script the attacks byte by byte:

* a 307 from the engine URL to another origin must be an ERROR naming both origins, and the other host must
  not see a single request (before: the client followed it and scored that host's answers);
* a gzip bomb (Content-Encoding the client did not ask for) and an oversized plain body (declared, and
  chunked without a length) are refused with a named error while the client's memory stays bounded
  (before: decompressed and accepted; measured with tracemalloc);
* a server dribbling one byte at a time (in the body, or in the headers) hits the total per-request
  deadline (before: only a per-read timeout, which a dribble never trips);
* the engine record names the origin that answered;
* a 200 kB model name is refused before any request.
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
import zlib
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable

import pytest

from engine.client import ClientConfig, EngineClient, EngineSource, RetryPolicy, score_panel
from engine.errors import (
    EngineBodyRefused, EngineError, EngineLimitExceeded, EngineRedirectRefused, EngineTransportError,
)
from panels import EncodedPanel, EncodedSequence
from tests.engine.test_client_malformed import MODEL, VOCAB, vllm_prompt_response
from tests.reliability.helpers import serve_in_thread

IDS = [5, 17, 3, 29, 11, 8]
MiB = 1 << 20


# ============================================================================================ servers
class RawServer:
    """ThreadingHTTPServer on 127.0.0.1 whose ``handler(h, path, body)`` writes the whole answer itself."""

    def __init__(self, handler: Callable[[BaseHTTPRequestHandler, str, Any], None]):
        self.handler = handler
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self.stop = threading.Event()      # dribbling handlers end when the test ends
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self):
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                path = self.path.split("?")[0]
                with outer._lock:
                    outer.seen.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
                try:
                    outer.handler(self, path, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client hung up on purpose (a refused body, a deadline)

            do_GET = do_POST = _serve

            def log_message(self, *a):
                pass

        self.server, self.thread, self.url = serve_in_thread(H)
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str] | None = None,
         length: bool = True) -> None:
    h.send_response(status)
    h.send_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    if length:
        h.send_header("content-length", str(len(body)))
    else:
        h.send_header("connection", "close")
        h.close_connection = True
    h.end_headers()
    h.wfile.write(body)
    h.wfile.flush()


def honest(h: BaseHTTPRequestHandler, path: str, body: Any) -> None:
    """Well-formed vLLM answers (the fake distribution of tests/engine/test_client_malformed.py)."""
    if path == "/v1/models":
        send(h, 200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())
    else:
        send(h, 200, json.dumps(vllm_prompt_response(body["prompt"], body["prompt_logprobs"])).encode())


@pytest.fixture()
def servers():
    made: list[RawServer] = []

    def make(handler):
        s = RawServer(handler)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def client(url: str, **cfg) -> EngineClient:
    cfg.setdefault("retry", RetryPolicy(max_attempts=1))
    cfg.setdefault("timeout_s", 5.0)
    return EngineClient(ClientConfig(url, MODEL, vocab_size=VOCAB, **cfg))


def panel() -> EncodedPanel:
    seqs = [("s0", IDS), ("s1", [2, 9, 4, 33, 1])]
    return EncodedPanel("unit-panel", 1, "p" * 64, "t" * 64, tuple(
        EncodedSequence(sid, "code", tuple(ids), (False,) + (True,) * (len(ids) - 1)) for sid, ids in seqs))


# ============================================================================================ redirects
def test_redirect_to_another_origin_is_an_error_naming_both(servers):
    other = servers(honest)                    # would answer well: the verdict would be that host's

    def redirect(h, path, body):
        send(h, 307, b"", {"location": f"{other.url}{path}"})

    engine = servers(redirect)
    with client(engine.url) as c, pytest.raises(EngineRedirectRefused) as ei:
        score_panel(c, panel(), 3, EngineSource(engine.url, MODEL, "fake"), max_concurrency=1, progress=False)
    msg = str(ei.value)
    assert engine.url in msg and other.url in msg, msg
    assert "\n" not in msg and ei.value.status == 307
    assert other.seen == []                    # not one byte went to the other host
    assert len(engine.seen) == 1               # and a redirect is not retried


def test_redirect_to_another_host_name_is_another_origin(servers):
    """127.0.0.1 and localhost are other origins even on the same port: origins are compared, not sockets."""
    def redirect(h, path, body):
        send(h, 308, b"", {"location": f"http://localhost:{h.server.server_address[1]}{path}"})

    engine = servers(redirect)
    with client(engine.url) as c, pytest.raises(EngineRedirectRefused) as ei:
        c.prompt_logprobs(IDS, 3, seq_id="r")
    assert f"http://localhost:{engine.port}" in str(ei.value) and engine.url in str(ei.value)
    assert len(engine.seen) == 1


def test_same_origin_redirect_only_where_asked_for(servers):
    def moved(h, path, body):
        if path == "/v1/completions":
            send(h, 307, b"", {"location": "/v2/completions"})
        else:
            honest(h, path, body)

    engine = servers(moved)
    with client(engine.url) as c, pytest.raises(EngineRedirectRefused) as ei:
        c.prompt_logprobs(IDS, 3, seq_id="r")
    assert "same-origin" in str(ei.value) and "/v2/completions" in str(ei.value)
    with client(engine.url, same_origin_redirects=True) as c:
        got = c.prompt_logprobs(IDS, 3, seq_id="r")
    assert len(got.positions) == len(IDS) - 1
    assert [p for _, p, _ in engine.seen][-2:] == ["/v1/completions", "/v2/completions"]


# ============================================================================================ body caps
def _bomb(decompressed: int) -> bytes:
    """A valid vLLM answer followed by `decompressed` bytes of JSON whitespace, gzip-compressed (~1000:1)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [z.compress(json.dumps(vllm_prompt_response(IDS, 3)).encode())]
    block = b" " * MiB
    for _ in range(decompressed // MiB):
        out.append(z.compress(block))
    out.append(z.flush())
    return b"".join(out)


def _peak_mib(call: Callable[[], Any]) -> tuple[float, BaseException | None, Any]:
    tracemalloc.start()
    err, got = None, None
    try:
        got = call()
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        err = exc
    peak = tracemalloc.get_traced_memory()[1] / MiB
    tracemalloc.stop()
    return peak, err, got


def test_gzip_bomb_is_refused_with_bounded_memory(servers):
    bomb = _bomb(64 * MiB)
    assert len(bomb) < MiB                      # 64 MiB of answer in well under 1 MiB on the wire
    engine = servers(lambda h, path, body: send(h, 200, bomb, {"content-encoding": "gzip"}))
    with client(engine.url) as c:
        peak, err, got = _peak_mib(lambda: c.prompt_logprobs(IDS, 3, seq_id="bomb"))
    assert isinstance(err, EngineBodyRefused), f"accepted: {got!r:.80}" if err is None else repr(err)
    assert "gzip" in str(err) and "\n" not in str(err)
    assert peak < 8, f"{peak:.1f} MiB allocated while refusing the bomb"
    headers = engine.seen[0][2]
    assert headers.get("accept-encoding") == "identity"     # compression is not asked for


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked-no-length"])
def test_oversized_plain_body_is_refused_with_bounded_memory(servers, declared):
    good = json.dumps(vllm_prompt_response(IDS, 3)).encode()

    def big(h, path, body):
        pad = b" " * MiB
        n = 40
        h.send_response(200)
        h.send_header("content-type", "application/json")
        if declared:
            h.send_header("content-length", str(len(good) + n * MiB))
        else:
            h.send_header("connection", "close")
            h.close_connection = True
        h.end_headers()
        h.wfile.write(good)
        for _ in range(n):
            h.wfile.write(pad)

    engine = servers(big)
    with client(engine.url, max_body_bytes=2 * MiB) as c:
        peak, err, got = _peak_mib(lambda: c.prompt_logprobs(IDS, 3, seq_id="big"))
    assert isinstance(err, EngineLimitExceeded), f"accepted: {got!r:.80}" if err is None else repr(err)
    assert "2097152" in str(err) and engine.url in str(err) and "\n" not in str(err)
    assert peak < 12, f"{peak:.1f} MiB allocated while refusing a 40 MiB body"


def test_body_cap_leaves_room_for_what_the_request_asks(servers):
    """The cap scales with the request (positions × logprobs asked): a large honest answer still passes."""
    engine = servers(honest)
    with client(engine.url, max_body_bytes=1024) as c:
        got = c.prompt_logprobs(IDS, 3, seq_id="ok")
    assert len(got.positions) == len(IDS) - 1


# ============================================================================================ deadlines
def _run_bounded(call: Callable[[], Any], wait_s: float) -> tuple[BaseException | None, float, bool]:
    box: dict[str, Any] = {}

    def run():
        t0 = time.perf_counter()
        try:
            box["got"] = call()
        except BaseException as exc:  # noqa: BLE001
            box["err"] = exc
        box["t"] = time.perf_counter() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(wait_s)
    return box.get("err"), box.get("t", float("inf")), th.is_alive()


def _dribble_body(server_stop: threading.Event):
    def handler(h, path, body):
        h.send_response(200)
        h.send_header("content-type", "application/json")
        h.send_header("connection", "close")
        h.end_headers()
        h.close_connection = True
        for _ in range(300):                     # a space every 0.1 s: each read is well inside the timeout
            if server_stop.is_set():
                return
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.1)
    return handler


def _dribble_headers(server_stop: threading.Event):
    def handler(h, path, body):
        for ch in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 300:
            if server_stop.is_set():
                return
            h.wfile.write(bytes([ch]))
            h.wfile.flush()
            time.sleep(0.1)
    return handler


@pytest.mark.parametrize("dribble", [_dribble_body, _dribble_headers], ids=["body", "headers"])
def test_dribbling_server_hits_the_total_deadline(servers, dribble):
    holder: dict[str, RawServer] = {}
    engine = servers(lambda h, p, b: dribble(holder["s"].stop)(h, p, b))
    holder["s"] = engine
    c = client(engine.url, timeout_s=2.0, deadline_s=1.5, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01))
    err, took, alive = _run_bounded(lambda: c.prompt_logprobs(IDS, 3, seq_id="slow"), wait_s=8.0)
    assert not alive, "the client was still reading the dribble after 8 s (no total deadline)"
    assert isinstance(err, EngineTransportError), repr(err)
    assert err.what == "deadline exceeded" and err.attempts == 2 and "1.5" in str(err), str(err)
    assert took < 5.0, f"{took:.1f} s for two attempts of a 1.5 s deadline"
    c.close()


def test_the_deadline_does_not_cut_a_healthy_connection_reused_later(servers):
    """The deadline is per request: many quick requests over one client, each well inside it, all succeed."""
    engine = servers(honest)
    with client(engine.url, deadline_s=0.5) as c:
        for _ in range(6):
            assert len(c.prompt_logprobs(IDS, 3, seq_id="q").positions) == len(IDS) - 1
            time.sleep(0.12)


# ============================================================================================ provenance
def test_engine_record_names_the_origin_that_answered(servers):
    engine = servers(honest)
    with client(engine.url) as c:
        rec = score_panel(c, panel(), 3, EngineSource(engine.url, MODEL, "fake"), progress=False)
    assert rec.provenance.extra["answered_by"] == [engine.url]
    assert rec.provenance.extra["answered_peers"] == [f"127.0.0.1:{engine.port}"]
    assert rec.provenance.extra["vocab_size"] == VOCAB


def test_answered_origin_has_no_credentials(servers):
    engine = servers(honest)
    url = engine.url.replace("http://", "http://admin:pa55@")
    with client(url) as c:
        rec = score_panel(c, panel(), 3, EngineSource(url, MODEL, "fake"), progress=False)
    assert rec.provenance.extra["answered_by"] == [engine.url]


# ============================================================================================ model names
def test_oversized_model_name_is_refused_before_any_request(servers):
    engine = servers(honest)
    with pytest.raises(EngineLimitExceeded) as ei:
        EngineClient(ClientConfig(engine.url, "m" * 200_000))
    assert "200000" in str(ei.value) and len(str(ei.value)) < 400
    assert engine.seen == []


def test_oversized_model_name_listed_by_the_engine_is_refused(servers):
    def models(h, path, body):
        send(h, 200, json.dumps({"object": "list", "data": [{"id": "x" * 200_000, "object": "model"}]}).encode())

    engine = servers(models)
    with client(engine.url) as c, pytest.raises(EngineError) as ei:
        c.models()
    assert "200000" in str(ei.value) and len(str(ei.value)) < 400


def test_the_refusals_are_one_line_user_errors():
    """`ds41gate` prints a UserError as one line (exit 2): the refusals of an engine's answer are such errors."""
    from core.errors import UserError

    for cls in (EngineRedirectRefused, EngineLimitExceeded, EngineBodyRefused):
        assert issubclass(cls, EngineError) and issubclass(cls, UserError)
    e = EngineRedirectRefused(307, "http://a:1@h:1/v1/completions", "http://x:2/", "http://h:1", "http://x:2", False)
    assert "\n" not in str(e) and "a:1@" not in str(e)


def test_ds41gate_prints_a_cross_origin_redirect_as_one_line(servers, tmp_path):
    """The CLI path (`ds41gate eval --engine-url`): one line naming both origins, exit 2, the other host untouched."""
    import subprocess
    import sys
    from pathlib import Path

    other = servers(honest)
    engine = servers(lambda h, path, body: send(h, 307, b"", {"location": f"{other.url}{path}"}))
    r = subprocess.run([sys.executable, "-m", "ds41gates.cli", "eval", "humaneval", "--engine-url", engine.url,
                        "--out", str(tmp_path / "out")], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: engine answered HTTP 307"), r.stderr[-2000:]
    assert engine.url in lines[0] and other.url in lines[0]
    assert other.seen == []


def test_a_gate_session_on_a_redirecting_engine_url_errors_before_any_gate(servers, tmp_path):
    """The gate session's first request (`/v1/models`, before any gate) goes through the engine client too: a
    redirect to another origin is one `error: --engine-url` line naming both origins, exit 2, the other host
    untouched (before: the plugin's own GET, with no body cap and no total deadline)."""
    from tests.reliability.helpers import run_gate_session
    from tests.reliability.test_hardening_inputs import KL_GATE, _reference_file

    other = servers(honest)
    engine = servers(lambda h, path, body: send(h, 307, b"", {"location": f"{other.url}{path}"}))
    s = run_gate_session(tmp_path, KL_GATE, reference=_reference_file(tmp_path), engine_url=engine.url, timeout=120)
    assert s.returncode == 2, s.output[-3000:]
    errors = [ln for ln in s.output.split("\n") if "error: --engine-url" in ln]
    assert len(errors) == 1 and engine.url in errors[0] and other.url in errors[0], s.output[-3000:]
    assert other.seen == []


def test_ds41gate_prints_an_engine_that_does_not_answer_as_one_line(tmp_path):
    """`ds41gate eval` on a dead engine: one `error:` line naming the URL, exit 3 (no verdict), no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "ds41gates.cli", "eval", "humaneval", "--engine-url",
                        "http://127.0.0.1:9", "--out", str(tmp_path / "out")], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: engine connection error at http://127.0.0.1:9"), r.stderr

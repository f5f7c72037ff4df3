"""Reliability: engine faults on real server processes (llama-cpp-python: starts in seconds).

* a hung server (its whole process group SIGSTOPped) → a named timeout error within the configured bound,
  and the launcher still stops it (SIGKILL reaches stopped processes);
* a server killed (SIGKILL of the group) while a request is in flight → a named connection error after the
  bounded retries, and no process left.

The kill in the middle of a whole gate session (vLLM) is in test_reliability_vllm_session.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine import launcher
from engine.adapters.llamacpp import LlamaCppPythonAdapter
from engine.client import ClientConfig, EngineClient, RetryPolicy
from engine.errors import EngineTransportError
from engine.launcher import EngineServer
from engine.supervise import group_members

pytestmark = [pytest.mark.engine]

CANARY = [504, 3575, 282, 4649, 314]       # "The capital of France is" (SmolLM2)
VOCAB = 49152


def _require_llama():
    venv = launcher._cache() / "venvs" / launcher.LLAMA_VENV
    if not (venv / ".ds41-ready").exists():
        pytest.skip(f"{venv} not set up (scripts/setup-llamacpp.sh)")


def _client(srv: EngineServer, timeout_s: float, attempts: int) -> EngineClient:
    cfg = ClientConfig(srv.base_url, srv.served_model, timeout_s=timeout_s, connect_timeout_s=timeout_s,
                       retry=RetryPolicy(max_attempts=attempts, base_delay_s=0.2, max_delay_s=1.0), vocab_size=VOCAB)
    return EngineClient(cfg, adapter=LlamaCppPythonAdapter(vocab_size=VOCAB))


@pytest.mark.timeout(300)
def test_hung_server_is_a_timeout_error_then_recovers_and_is_stopped():
    _require_llama()
    srv = EngineServer("llamacpp-f32", overrides={"stop_grace_s": 3})
    srv.start()
    pgid = srv.pid
    try:
        with _client(srv, timeout_s=120.0, attempts=1) as patient, _client(srv, timeout_s=4.0, attempts=2) as c:
            good = patient.prompt_logprobs(CANARY, 5, seq_id="canary")
            assert [p.position for p in good.positions] == [1, 2, 3, 4]
            os.killpg(pgid, signal.SIGSTOP)                     # hang: every process of the server frozen
            t0 = time.monotonic()
            with pytest.raises(EngineTransportError) as ei:
                c.prompt_logprobs(CANARY, 5, seq_id="hung")
            took = time.monotonic() - t0
            e = ei.value
            assert e.what == "timeout" and e.attempts == 2 and e.seq_id == "hung", str(e)
            assert 8.0 <= took < 20.0, took                     # 2 × 4 s timeout + 0.2 s backoff, bounded
            os.killpg(pgid, signal.SIGCONT)                      # the engine comes back: same answers
            again = patient.prompt_logprobs(CANARY, 5, seq_id="canary")
            # same ids; values within llama-cpp-python prompt-cache noise (seen up to 5e-3 after the hang)
            assert [(p.position, p.top_ids) for p in again.positions] == [(p.position, p.top_ids) for p in good.positions]
            assert max(abs(a - b) for x, y in zip(again.positions, good.positions)
                       for a, b in zip(x.top_logprobs, y.top_logprobs)) < 2e-2
            os.killpg(pgid, signal.SIGSTOP)                      # hung again: the launcher must still stop it
        t1 = time.monotonic()
        srv.stop()                                               # SIGTERM is held while stopped → SIGKILL
        assert time.monotonic() - t1 < 20
        assert group_members(pgid) == []
    finally:
        if group_members(pgid):
            os.killpg(pgid, signal.SIGCONT)
        srv.stop()


@pytest.mark.timeout(300)
def test_server_killed_mid_request_is_a_connection_error_and_leaves_nothing():
    _require_llama()
    srv = EngineServer("llamacpp-f32")
    srv.start()
    pgid = srv.pid
    try:
        with _client(srv, timeout_s=60.0, attempts=3) as c:
            c.prompt_logprobs(CANARY, 5, seq_id="warm")
            long_ids = (CANARY * 60)[:300]                        # a request that takes a while to serve
            errors: list[BaseException] = []

            def score():
                try:
                    c.prompt_logprobs(long_ids, 20, seq_id="long")
                except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                    errors.append(exc)

            th = threading.Thread(target=score)
            th.start()
            time.sleep(1.0)                                       # the request is being served
            assert th.is_alive(), "the long request finished before the kill; make it longer"
            os.killpg(pgid, signal.SIGKILL)
            th.join(60)
            assert not th.is_alive()
        [e] = errors
        assert isinstance(e, EngineTransportError), repr(e)
        assert e.what == "connection error" and e.attempts == 3 and e.seq_id == "long", str(e)
        assert not srv.running()
        srv.stop()                                                # stopping a dead server is quiet
        assert group_members(pgid) == []
    finally:
        srv.stop()

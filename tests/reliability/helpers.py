"""Reliability-suite helpers: a canned-body HTTP server, exact references for it, gate sessions in a subprocess.

The canned server is the one place a fake engine is right: it serves exactly the bytes a test scripts
(malformed bodies, 5xx, hostile text) and records every request with its headers and arrival time, so
retries, backoff and the ``Authorization`` header can be checked from the server's side. Well-formed
answers reuse the vLLM 0.32 shapes of ``tests/engine/test_client_malformed.py`` (``vllm_prompt_response``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import numpy as np

from core.records import Provenance, Record, SequenceScores
from core.results import GateResults
from tests.engine.test_client_malformed import VOCAB, distribution, vllm_prompt_response

REPO = Path(__file__).resolve().parents[2]


# ============================================================================================ canned server
@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    t: float                      # time.monotonic() at arrival


@dataclass
class Canned:
    status: int = 200
    body: bytes | str | Any = b""
    content_type: str = "application/json"

    def raw(self) -> bytes:
        b = self.body
        if not isinstance(b, (bytes, str)):
            b = json.dumps(b)
        return b.encode() if isinstance(b, str) else b


def serve_in_thread(handler: type) -> tuple[ThreadingHTTPServer, threading.Thread, str]:
    """A ThreadingHTTPServer for `handler` on a free 127.0.0.1 port, served from a daemon thread: (server,
    thread, base URL). The caller shuts it down."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{server.server_address[1]}"


class CannedServer:
    """ThreadingHTTPServer on 127.0.0.1; ``routes[path](Seen) -> Canned``; unknown paths answer 404."""

    def __init__(self, require_key: str | None = None):
        self.routes: dict[str, Callable[[Seen], Canned]] = {}
        self.seen: list[Seen] = []
        self.require_key = require_key
        self._lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self):
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw
                req = Seen(self.command, self.path.split("?")[0], {k.lower(): v for k, v in self.headers.items()},
                           body, time.monotonic())
                with outer._lock:
                    outer.seen.append(req)
                if outer.require_key is not None and req.headers.get("authorization") != f"Bearer {outer.require_key}":
                    reply = Canned(401, {"error": {"message": "missing or wrong API key"}})
                else:
                    handler = outer.routes.get(req.path)
                    reply = handler(req) if handler else Canned(404, {"error": {"message": "no route"}})
                data = reply.raw()
                self.send_response(reply.status)
                self.send_header("content-type", reply.content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()

            do_GET = do_POST = _serve

            def log_message(self, *a):
                pass

        self.server, self.thread, self.url = serve_in_thread(H)

    def requests_to(self, path: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.path == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "CannedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_vllm(server: CannedServer, model: str) -> None:
    """Well-formed vLLM answers: /v1/models lists ``model``; prompt logprobs from the fake distribution."""
    server.routes["/v1/models"] = lambda r: Canned(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
    server.routes["/v1/completions"] = lambda r: Canned(
        200, vllm_prompt_response(r.body["prompt"], r.body["prompt_logprobs"], model=model))


# ============================================================================================ references
def exact_reference(seqs: list[tuple[str, str, list[int]]], panel_name: str = "reliability",
                    panel_hash: str = "sha256:" + "e" * 64, tokenizer_hash: str = "sha256:" + "f" * 64) -> Record:
    """An oracle record of the canned engine's own distribution (full vocabulary): the KL panel gate passes."""
    out = []
    for sid, dom, ids in seqs:
        ids = np.asarray(ids, dtype=np.int64)
        assert ids.max() < VOCAB
        full = np.stack([distribution(tuple(int(t) for t in ids[:i])) for i in range(1, ids.size)])
        order = np.lexsort((np.broadcast_to(np.arange(VOCAB), full.shape), -full), axis=-1)
        actual = ids[1:]
        act_lp = full[np.arange(actual.size), actual]
        rank = 1 + (full > act_lp[:, None]).sum(axis=1)
        scored = np.ones(ids.size, dtype=bool)
        scored[0] = False
        lse = np.zeros(actual.size)
        out.append(SequenceScores(sid, dom, ids, scored, order, np.take_along_axis(full, order, 1), act_lp, rank,
                                  logsumexp=lse))
    prov = Provenance(side="oracle", panel_name=panel_name, panel_version="1", panel_hash=panel_hash,
                      tokenizer_hash=tokenizer_hash, source={"oracle": "canned distribution"}, precision="fp64",
                      created=Provenance.now())
    return Record.from_sequences(prov, out, k=VOCAB)


def plain_sequences(n: int = 4, length: int = 12) -> list[tuple[str, str, list[int]]]:
    return [(f"s{i}", ("code", "prose")[i % 2], [(7 * i + 3 * j + 1) % VOCAB for j in range(length)])
            for i in range(n)]


# ============================================================================================ gate sessions
@dataclass
class GateSession:
    returncode: int
    output: str
    results_dir: Path
    results: GateResults | None = None
    wall_s: float = 0.0
    files: list[Path] = field(default_factory=list)

    def outcome(self, gate: str) -> dict:
        outs = self.results.outcomes if self.results is not None else ()
        hits = [o for o in outs if o.gate == gate]
        assert len(hits) == 1, (gate, outs, self.output[-3000:])
        return dataclasses.asdict(hits[0])


def gate_session_env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def run_gate_session(work: Path, source: str, *, reference: Path, engine_url: str,
                     profile: str = "vllm-cpu-fp32", env: dict[str, str] | None = None,
                     timeout: float = 300, popen_hook: Callable[[subprocess.Popen], None] | None = None) -> GateSession:
    """Run the gate files ``source`` (pytest code) as a real gate session in a subprocess, as CI would.

    ``popen_hook(proc)`` runs while the session is in progress (e.g. to kill the engine mid-gate)."""
    work.mkdir(parents=True, exist_ok=True)
    test_file = work / "test_gate_session.py"
    test_file.write_text(source)
    results = work / "results"
    cmd = [sys.executable, "-m", "pytest", "-p", "ds41gates.pytest_plugin", "-p", "no:cacheprovider", "-q",
           "-rA", str(test_file), "--engine-url", engine_url, "--engine-profile", profile,
           "--reference", str(reference), "--results", str(results)]
    t0 = time.monotonic()
    log = work / "session.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env or gate_session_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if popen_hook is not None:
                popen_hook(proc)
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    res_file = results / "results.json"
    return GateSession(proc.returncode, log.read_text(errors="replace"), results,
                       GateResults.load(res_file) if res_file.exists() else None,
                       time.monotonic() - t0, sorted(p for p in results.rglob("*") if p.is_file()) if results.exists() else [])


def files_containing(paths, needle: str) -> list[Path]:
    """Every file under ``paths`` (files or folders) whose bytes contain ``needle`` (also JSON-escaped)."""
    forms = {needle.encode(), json.dumps(needle)[1:-1].encode()}
    hits = []
    for root in paths:
        root = Path(root)
        for p in ([root] if root.is_file() else sorted(root.rglob("*"))):
            if p.is_file():
                data = p.read_bytes()
                if any(f in data for f in forms):
                    hits.append(p)
    return hits


# ============================================================================================ SmolLM2 subset
SUBSET_SEQS = 4
SUBSET_LEN = 40


def smol_subset(n: int = SUBSET_SEQS, length: int = SUBSET_LEN):
    """The first ``length`` ids of the first ``n`` default-panel sequences (one per domain where possible),
    every position 1.. scored: a small real-token panel of its own name and hash."""
    import hashlib

    from ds41gates import pipeline
    from panels import EncodedPanel, EncodedSequence

    enc = pipeline.encode_default_panel("default")
    picked, domains = [], set()
    for s in enc.sequences:
        if s.domain not in domains and len(s.token_ids) >= length:
            picked.append(s)
            domains.add(s.domain)
        if len(picked) == n:
            break
    seqs = tuple(EncodedSequence(s.seq_id, s.domain, tuple(s.token_ids[:length]), (False,) + (True,) * (length - 1))
                 for s in picked)
    digest = hashlib.sha256(json.dumps([[s.seq_id, list(s.token_ids)] for s in seqs]).encode()).hexdigest()
    return EncodedPanel("default-subset-reliability", 1, "sha256:" + digest, enc.tokenizer_hash, seqs)


_ORACLE = None


ORACLE_THREADS = 1   # 2 threads spin against each other on a busy 2-core box: 13 s vs 0.9 s per 48-token forward


def smol_oracle():
    """The fp32 HF oracle on SmolLM2, loaded once per process."""
    global _ORACLE
    if _ORACLE is None:
        from engine.models import ensure_smollm2
        from oracle.hf import HFOracle

        _ORACLE = HFOracle.load(ensure_smollm2().hf_dir, threads=ORACLE_THREADS)
    return _ORACLE


RESUME_TOP_K = 64
_REFERENCE: dict = {}


def smol_reference(top_k: int = 64) -> Record:
    """The clean (uninterrupted, no checkpoints) oracle record of ``smol_subset()``, once per process."""
    if top_k not in _REFERENCE:
        from oracle.hf import score_panel_hf

        orc = smol_oracle()
        _REFERENCE[top_k] = score_panel_hf(orc.model_dir, smol_subset(), top_k=top_k, oracle=orc)
    return _REFERENCE[top_k]


# ============================================================================================ DSv4.1 runner
def dsv41_options(spill: str = "ram"):
    """The runner options of the SIGKILL-resume test (1 thread, full logprobs, no progress bar)."""
    from oracle.dsv41.runner import RunOptions

    return RunOptions(threads=1, progress=False, full_logprobs=True, spill=spill)


def dsv41_panel_json(path: Path, lengths=(40, 17, 70, 9)) -> Path:
    """Random-id sequences for the tiny checkpoint: 70 > its window 64, odd lengths, a partial scored mask."""
    rng = np.random.default_rng(0)
    seqs = [{"seq_id": f"r{i}", "domain": ("code", "chat")[i % 2],
             "token_ids": rng.integers(0, 512, n).tolist()} for i, n in enumerate(lengths)]
    seqs[1]["scored_mask"] = [False] * 5 + [True] * (lengths[1] - 5)
    path.write_text(json.dumps({"panel_name": "reliability-resume", "panel_version": "1", "sequences": seqs}))
    return path


def http_status(url: str, key: str | None = None) -> int:
    """The HTTP status a GET of `url` answers, with a bearer key when given (4xx/5xx included)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code

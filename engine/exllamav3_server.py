"""A thin vLLM-shaped OpenAI-compatible front over exllamav3's own generator (the engine under test).

Why a front and not an in-process adapter: every engine-behaviour gate (self-consistency, batch invariance,
prefix cache, needles, speed) talks to the engine through ``engine.client`` and the vLLM adapter — concurrent
HTTP requests, ``cache_salt``, ``cached_tokens``, SSE streams, ``/metrics``. A front that speaks that subset
(engine/exllamav3_api.py) keeps the gates and the client byte-for-byte unchanged, and the profile launches it
like any other server (``engine = "vllm"`` in engine/profiles/exllamav3-*.toml). What runs behind it is
exllamav3 itself, in this one process:

* **prompt logprobs** (the KL panel record, and self-consistency's "prefill" side): one ``model.forward`` of the
  whole sequence with no cache (``attn_mode: flash_attn_nc``), logits → float64 log_softmax → top-k;
* **generation** (greedy ids + per-step top-k; self-consistency's "decode" side, batch invariance, prefix cache):
  ``exllamav3.Generator`` jobs with ``ArgmaxSampler`` and ``return_logits``. Every request is a job; concurrent
  requests are batched by the generator's own scheduler; prefix reuse is its paged cache (256-token pages, and on
  DeepSeek-V4, whose attention state is recurrent, its recurrent-state checkpoints). ``cached_tokens`` is the
  job's own ``cached_tokens`` result;
* **cache_salt**: the root of a job's page-hash chain (engine/exllamav3_api.salt_root), so only requests with the
  same salt share pages, as vLLM's salt rule says.

One worker thread owns the model (exllamav3 is not thread-safe): HTTP threads hand it requests through a queue;
between generator iterations it runs pending prompt scorings.

    python -m engine.exllamav3_server --model-dir DIR --served-model-name NAME [--host H --port P]
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import torch

from engine import exllamav3_api as api


# ---------------------------------------------------------------------------------------------- backends
@dataclass
class StepEvent:
    """What the generator produced for one request in one iteration."""

    ident: str
    ids: list[int]
    logits: torch.Tensor | None      # [len(ids), V] (the distribution each id was chosen from)
    text: str
    done: bool
    finish: str | None = None
    cached_tokens: int | None = None
    accepted_draft_tokens: int | None = None   # the job's own totals, on its last event (speculative decoding)
    rejected_draft_tokens: int | None = None


class Backend(Protocol):
    vocab_size: int
    prefix_caching: bool

    def score(self, ids: list[int]) -> torch.Tensor: ...          # [n, V] logits after each prefix

    def start(self, ident: str, ids: list[int], max_tokens: int, ignore_eos: bool, salt: str | None) -> None: ...

    def busy(self) -> bool: ...

    def step(self) -> list[StepEvent]: ...

    def piece(self, tid: int) -> str: ...


_SALT = threading.local()


def install_salted_hashing() -> None:
    """Make exllamav3's page-hash chains start from the job's cache-salt root (see engine/exllamav3_api.salt_root).

    exllamav3 hashes a job's prompt pages in ``Job.prepare_for_queue`` (``Sequence.prepare``) and completed pages
    in ``Job.hash_completed_page``, both through ``tensor_hash_checksum(page_ids, prev_hash)`` with ``prev_hash``
    None for page 0. Both calls are wrapped to expose the job's salt, and the checksum uses it as page 0's
    previous hash. Requests without a salt keep exllamav3's own chain."""
    from exllamav3.generator import job as jobmod
    from exllamav3.generator import pagetable as ptmod

    if getattr(jobmod, "_ds41_salted", False):
        return
    orig = ptmod.tensor_hash_checksum

    def salted(tensor, prev_hash):
        if prev_hash is None:
            prev_hash = getattr(_SALT, "root", None)
        return orig(tensor, prev_hash)

    def with_salt(fn):
        def wrapper(self, *a, **k):
            before = getattr(_SALT, "root", None)
            _SALT.root = getattr(self, "_ds41_salt_root", None)
            try:
                return fn(self, *a, **k)
            finally:
                _SALT.root = before
        return wrapper

    ptmod.tensor_hash_checksum = salted
    jobmod.tensor_hash_checksum = salted
    jobmod.Job.prepare_for_queue = with_salt(jobmod.Job.prepare_for_queue)
    jobmod.Job.hash_completed_page = with_salt(jobmod.Job.hash_completed_page)
    jobmod._ds41_salted = True


class Exl3Backend:
    """exllamav3 on one CUDA device: Config → Model → Cache → Generator (ArgmaxSampler, logits returned)."""

    def __init__(self, model_dir: str, cache_tokens: int = 32768, max_batch_size: int = 16,
                 checkpoint_interval: int = api.PAGE_SIZE, device: str = "cuda:0", draft_mtp: bool = False,
                 num_draft_tokens: int | None = None):
        from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Model, Tokenizer

        install_salted_hashing()
        self.config = Config.from_directory(model_dir)
        self.model = Model.from_config(self.config)
        self.cache = Cache(self.model, max_num_tokens=cache_tokens, max_batch_size=max_batch_size)
        self.model.load(device)
        self.tokenizer = Tokenizer.from_config(self.config)
        self.vocab_size = int(self.config.vocab_size)
        kw = {}
        if self.model.caps.get("recurrent_states"):
            kw["recurrent_checkpoint_interval"] = checkpoint_interval
        if draft_mtp:
            # the checkpoint's own drafter (DeepSeek-V4: DSpark under mtp.*); exllamav3 defines the component only
            # when the folder carries mtp.0.attn.wkv, so a folder without it is refused here, by name
            if "mtp" not in getattr(self.config, "model_classes", {}):
                raise SystemExit(f"--draft-mtp: {model_dir} has no mtp component (no mtp.0.attn.wkv tensors; "
                                 "build the model with its drafter)")
            draft = Model.from_config(self.config, component="mtp")
            kw["draft_cache"] = Cache(draft, max_num_tokens=cache_tokens, max_batch_size=max_batch_size)
            draft.load(device)
            kw["draft_model"] = draft
            if num_draft_tokens:
                kw["num_draft_tokens"] = num_draft_tokens
        self.generator = Generator(self.model, self.cache, self.tokenizer, max_batch_size=max_batch_size, **kw)
        self._sampler = ArgmaxSampler
        self._job_cls = __import__("exllamav3", fromlist=["Job"]).Job
        self.prefix_caching = True
        self.device = device
        self.info = {"model_dir": model_dir, "architecture": self.config.architecture,
                     "recurrent_states": bool(self.model.caps.get("recurrent_states")),
                     "checkpoint_interval": kw.get("recurrent_checkpoint_interval"), "cache_tokens": cache_tokens,
                     "draft": "mtp" if draft_mtp else None,
                     "quant": _quant_info(model_dir)}
        self._eos = self.config.eos_token_id_list if hasattr(self.config, "eos_token_id_list") else None

    def score(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            logits = self.model.forward(x, {"attn_mode": "flash_attn_nc"})
        return logits[0].float()

    def start(self, ident, ids, max_tokens, ignore_eos, salt):
        stops = None if ignore_eos else [t for t in (self._eos or []) if t is not None]
        job = self._job_cls(input_ids=torch.tensor([ids], dtype=torch.long), max_new_tokens=max_tokens,
                            sampler=self._sampler(), stop_conditions=stops or None, return_logits=True,
                            identifier=ident, decode_special_tokens=True)
        job._ds41_salt_root = api.salt_root(salt)
        self.generator.enqueue(job)

    def busy(self) -> bool:
        return self.generator.num_remaining_jobs() > 0

    def step(self) -> list[StepEvent]:
        out = []
        for r in self.generator.iterate():
            if r.get("stage") != "streaming":
                continue
            ids = r.get("token_ids")
            ids = [] if ids is None else [int(t) for t in ids.reshape(-1).tolist()]
            logits = r.get("logits")
            if logits is not None:
                logits = logits.reshape(-1, logits.shape[-1]).float().cpu()
            done = bool(r.get("eos"))
            finish = None
            if done:
                finish = "length" if r.get("eos_reason") == "max_new_tokens" else "stop"
            out.append(StepEvent(r["identifier"], ids, logits, r.get("text", "") or "", done, finish,
                                 r.get("cached_tokens") if done else None,
                                 r.get("accepted_draft_tokens") if done else None,
                                 r.get("rejected_draft_tokens") if done else None))
        return out

    def piece(self, tid: int) -> str:
        if getattr(self, "_pieces", None) is None:
            try:
                self._pieces = list(self.tokenizer.get_id_to_piece_list(True))
            except Exception:
                self._pieces = []
        return self._pieces[tid] if 0 <= tid < len(self._pieces) else ""


def _quant_info(model_dir: str) -> dict:
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg.get("quantization_config") or {"quant_method": "none (unquantized checkpoint)"}


# ---------------------------------------------------------------------------------------------- the front
@dataclass
class _Pending:
    req: api.CompletionRequest
    out: "queue.Queue[tuple[str, Any]]" = field(default_factory=queue.Queue)
    ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    generated: int = 0


class Front:
    """The worker that owns the backend, plus the request handling the HTTP threads call."""

    def __init__(self, backend: Backend, model: str, max_model_len: int):
        self.backend, self.model, self.max_model_len = backend, model, max_model_len
        self._inbox: "queue.Queue[tuple[str, _Pending]]" = queue.Queue()
        self._live: dict[str, _Pending] = {}
        self.counters = {"requests": 0.0, "prompt_tokens": 0.0, "generation_tokens": 0.0, "cached_tokens": 0.0}
        # vLLM's spec-decode counters (gates/lib/specdec.py reads them), only when a drafter is loaded
        self.spec_counters = api.spec_counters() if getattr(backend, "info", {}).get("draft") else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="exl3-worker", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(("stop", None))  # type: ignore[arg-type]
        self._thread.join(timeout=10)

    # ---------------------------------------------------------------- worker
    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.backend.busy()
            try:
                kind, p = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                self._take(kind, p)
                while True:  # everything that arrived: enqueue together, so concurrent requests batch
                    kind, p = self._inbox.get_nowait()
                    self._take(kind, p)
            except queue.Empty:
                pass
            if self.backend.busy():
                try:
                    events = self.backend.step()
                except Exception as exc:  # the engine broke: fail every live request, keep serving
                    msg = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    for p in self._live.values():
                        p.out.put(("error", msg))
                    self._live.clear()
                    continue
                for ev in events:
                    self._deliver(ev)

    def _take(self, kind: str, p: _Pending) -> None:
        if kind == "stop":
            return
        try:
            if kind == "score":
                p.out.put(("score", self.backend.score(list(p.req.prompt))))
            else:
                ident = uuid.uuid4().hex
                self._live[ident] = p
                self.backend.start(ident, list(p.req.prompt), p.req.max_tokens, p.req.ignore_eos, p.req.cache_salt)
        except Exception as exc:
            traceback.print_exc()
            p.out.put(("error", f"{type(exc).__name__}: {exc}"))

    def _deliver(self, ev: StepEvent) -> None:
        p = self._live.get(ev.ident)
        if p is None:
            return
        if ev.ids:
            if ev.logits is None or ev.logits.shape[0] != len(ev.ids):
                p.out.put(("error", f"generator returned {len(ev.ids)} ids with logits "
                                    f"{None if ev.logits is None else tuple(ev.logits.shape)}"))
                del self._live[ev.ident]
                return
            p.out.put(("tokens", (ev.ids, ev.logits, ev.text)))
            p.generated += len(ev.ids)
        if ev.done:
            del self._live[ev.ident]
            if self.spec_counters is not None:
                api.count_spec(self.spec_counters, p.generated, ev.accepted_draft_tokens, ev.rejected_draft_tokens)
            p.out.put(("done", (ev.finish, ev.cached_tokens)))

    # ---------------------------------------------------------------- requests (HTTP threads)
    def completion(self, body: Any):
        """Non-streamed: the response dict. Streamed: a generator of SSE payload dicts."""
        req = api.parse_completion(body, self.model, self.backend.vocab_size, self.max_model_len)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(req.prompt)
        if req.stream:
            return self._stream(req)
        prompt_lp = None
        if req.prompt_logprobs is not None:
            p = _Pending(req)
            self._inbox.put(("score", p))
            kind, logits = p.out.get()
            if kind == "error":
                raise RuntimeError(logits)
            lp = api.log_softmax_rows(logits, self.backend.vocab_size)
            prompt_lp = api.prompt_logprobs_entries(lp, req.prompt, req.prompt_logprobs, self.backend.piece)
            if req.max_tokens == 1:   # vLLM's prompt_request: the next token from the same forward, no job
                nxt = int(torch.argmax(lp[-1]))
                gen_lp = api.generated_logprobs(lp[-1:], [nxt], req.logprobs) if req.logprobs is not None else None
                self.counters["generation_tokens"] += 1
                return api.completion_response(self.model, req, [nxt], self.backend.piece(nxt), "length",
                                               prompt_lp, gen_lp, 0)
        ids, logits, text, finish, cached = self._generate(req)
        gen_lp = None
        if req.logprobs is not None:
            gen_lp = api.generated_logprobs(api.log_softmax_rows(logits, self.backend.vocab_size), ids, req.logprobs)
        return api.completion_response(self.model, req, ids, text, finish, prompt_lp, gen_lp, cached)

    def _run(self, req: api.CompletionRequest):
        p = _Pending(req)
        self._inbox.put(("generate", p))
        while True:
            kind, payload = p.out.get()
            if kind == "error":
                raise RuntimeError(payload)
            yield kind, payload
            if kind == "done":
                return

    def _generate(self, req):
        ids, logits, text = [], [], []
        finish, cached = "length", None
        for kind, payload in self._run(req):
            if kind == "tokens":
                ids += payload[0]
                logits.append(payload[1])
                text.append(payload[2])
            else:
                finish, cached = payload
        self.counters["generation_tokens"] += len(ids)
        self.counters["cached_tokens"] += cached or 0
        lg = torch.cat(logits) if logits else torch.empty(0, self.backend.vocab_size)
        return ids, lg, "".join(text), finish, cached

    def _stream(self, req):
        cid = f"cmpl-{uuid.uuid4().hex}"
        n = 0
        for kind, payload in self._run(req):
            if kind == "tokens":
                ids, logits, text = payload
                n += len(ids)
                lp = None
                if req.logprobs is not None:
                    lp = api.generated_logprobs(api.log_softmax_rows(logits, self.backend.vocab_size), ids,
                                                req.logprobs)
                yield api.stream_chunk(self.model, cid, ids, text, lp, None)
            else:
                finish, cached = payload
                self.counters["generation_tokens"] += n
                self.counters["cached_tokens"] += cached or 0
                yield api.stream_chunk(self.model, cid, [], "", None, finish)
                if req.include_usage:
                    yield api.usage_chunk(self.model, cid, len(req.prompt), n, cached)


def make_handler(front: Front):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: one line per request on stderr is noise at gate volumes
            pass

        def _send(self, code: int, obj: Any, ctype: str = "application/json") -> None:
            data = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, msg: str) -> None:
            self._send(code, {"error": {"message": msg, "type": "BadRequestError" if code == 400 else "ServerError",
                                        "code": code}})

        def do_GET(self):
            path = self.path.split("?")[0].rstrip("/")
            if path in ("/v1/models", "/models"):
                self._send(200, api.models_card(front.model, front.max_model_len))
            elif path == "/health":
                self._send(200, {"status": "ok"})
            elif path == "/metrics":
                self._send(200, api.metrics_text(front.backend.prefix_caching, front.counters, front.spec_counters),
                           "text/plain; version=0.0.4")
            elif path == "/ds41/info":
                self._send(200, getattr(front.backend, "info", {}))
            else:
                self._error(404, f"no route {path}")

        def do_POST(self):
            path = self.path.split("?")[0].rstrip("/")
            n = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(n) or b"null")
            except ValueError as exc:
                return self._error(400, f"body is not JSON: {exc}")
            if path != "/v1/completions":
                return self._error(404, f"no route {path} (this front serves /v1/completions)")
            try:
                result = front.completion(body)
            except api.RequestError as exc:
                return self._error(400, str(exc))
            except Exception as exc:
                traceback.print_exc()
                return self._error(500, f"{type(exc).__name__}: {exc}")
            if isinstance(result, dict):
                return self._send(200, result)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                for chunk in result:
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except Exception as exc:
                traceback.print_exc()
                try:
                    self.wfile.write(f"data: {json.dumps({'error': str(exc)})}\n\n".encode())
                except OSError:
                    pass

    return Handler


def serve(front: Front, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(front))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.exllamav3_server", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="an exllamav3-loadable folder (unquantized HF or EXL3)")
    src.add_argument("--model", help="a model of engine/exllamav3_models.py (dsv4-tiny-bf16, dsv4-tiny-exl3-b4, ...), "
                                     "built into the cache when missing")
    ap.add_argument("--served-model-name", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--cache-tokens", type=int, default=32768, help="exllamav3 Cache max_num_tokens (pages x 256)")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--checkpoint-interval", type=int, default=api.PAGE_SIZE,
                    help="recurrent-state checkpoint interval (DeepSeek-V4): the prefix-reuse granularity")
    ap.add_argument("--draft-mtp", action="store_true",
                    help="speculative decoding with the checkpoint's own drafter (DeepSeek-V4: DSpark, mtp.*)")
    ap.add_argument("--speculative-config", default=None,
                    help='vLLM\'s spelling, as gates/test_speculative.py passes it: {"method": "mtp", '
                         '"num_speculative_tokens": N, "model": an exllamav3_models name holding the drafter}')
    a = ap.parse_args(argv)
    num_draft_tokens = None
    if a.speculative_config is not None:
        try:
            spec = api.parse_speculative_config(a.speculative_config)
        except ValueError as exc:
            ap.error(str(exc))
        a.draft_mtp, num_draft_tokens = True, spec.num_speculative_tokens
        if spec.model is not None:
            if a.model is None:
                ap.error("--speculative-config 'model' names an exllamav3_models model; use it with --model")
            a.model = spec.model
    t0 = time.time()
    if a.model_dir is None:
        from engine.exllamav3_models import model_dir

        a.model_dir = str(model_dir(a.model, log=lambda m: print(m, flush=True)))
    backend = Exl3Backend(a.model_dir, a.cache_tokens, a.max_batch_size, a.checkpoint_interval,
                           draft_mtp=a.draft_mtp, num_draft_tokens=num_draft_tokens)
    front = Front(backend, a.served_model_name, a.max_model_len)
    server = serve(front, a.host, a.port)
    print(f"exllamav3 front: {a.served_model_name} from {a.model_dir} loaded in {time.time() - t0:.1f} s; "
          f"serving http://{a.host}:{server.server_address[1]} ({json.dumps(backend.info)})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        front.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

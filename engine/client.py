"""Engine client: strict, retrying HTTP on top of the ``openai`` package, and panel scoring.

Layers:

* :class:`EngineClient` — the transport. OpenAI routes (``/v1/completions``, ``/v1/chat/completions``)
  go through ``openai.OpenAI(...).completions.with_raw_response`` so the harness sees the raw bytes; other
  routes (``/tokenize``, ``/metrics``, SGLang ``/generate``, llama-server ``/completion``) go through the
  same client's generic ``post``/``get``. Every body is decoded by :func:`engine.adapters.base.strict_json`
  (truncated JSON, NaN literals and duplicate keys are named errors). 5xx, timeouts and connection errors
  are retried with bounded exponential backoff (:class:`RetryPolicy`, carried out by ``tenacity``; openai's own
  retries stay off: they would also retry 408/409/429 and follow ``Retry-After``); 4xx raises
  :class:`EngineRequestRejected` at once; anything malformed raises :class:`EngineResponseError`. Streams are
  parsed by ``httpx-sse`` (the SSE specification's parser) on the same guarded response.
  A verdict is bound to the engine that was named (``_OriginGuard``, httpx event hooks on the client's own
  ``httpx.Client``): a redirect to another origin is :class:`EngineRedirectRefused` naming both origins (within
  the origin only with ``same_origin_redirects``); bodies are uncompressed (``Accept-Encoding: identity``, any
  other ``Content-Encoding`` is :class:`EngineBodyRefused`) and capped (:class:`EngineLimitExceeded`); every
  attempt has a total deadline beside httpx's per-read timeout; the record names the origin that answered.
* high-level calls — ``prompt_logprobs``, ``generate``, ``stream``, ``tokenize``/``detokenize``,
  ``metrics``, ``models`` — delegating engine-specific shapes to an adapter (``engine/adapters``).
* :func:`score_panel` — an ``EncodedPanel`` → a ``Record`` (side ``engine``): one request per sequence,
  bounded concurrency (thread pool), fresh ``cache_salt`` per request on vLLM, a rich progress bar.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import httpx
import httpx_sse
import numpy as np
import openai
import tenacity

from core.console import counting
from core.records import Provenance, Record, SequenceScores
from core.version import code_version
from engine.adapters.base import (
    Adapter, Generation, GenerateOptions, HttpTiming, JsonReply, MetricsSnapshot, SequenceLogprobs, SseEvent,
    StreamedGeneration,
    check_id_range, need, strict_json,
)
from engine.errors import (
    EngineBodyRefused, EngineIdentityChanged, EngineLimitExceeded, EngineRedirectRefused, EngineRequestRejected,
    EngineResponseError, EngineTransportError, Malformed, UnsupportedSurface,
)

T = TypeVar("T")



def _create_fields(create: Callable) -> frozenset[str]:
    """The body fields a resource's ``create`` takes as keywords; the rest travel in ``extra_body``."""
    import inspect

    skip = {"extra_headers", "extra_query", "extra_body", "timeout"}
    return frozenset(p for p in inspect.signature(create).parameters if p not in skip)


def _split_body(fields: frozenset[str], body: Mapping[str, Any]) -> tuple[dict, dict | None]:
    known = {k: v for k, v in body.items() if k in fields}
    extra = {k: v for k, v in body.items() if k not in fields}
    return known, (extra or None)


# ---------------------------------------------------------------------------------------------- the engine's origin
MAX_MODEL_NAME = 512           # characters; a served model name is an id or a path, never a document
BYTES_PER_ENTRY = 256          # generous size of one logprob entry in any engine's JSON (id, logprob, rank, text)


# what names the engine that answered: the served model id and vLLM's system_fingerprint (a hash of its whole
# configuration, on every non-streamed answer) from the body, and the Server header
IDENTITY_FIELDS = ("model", "system_fingerprint")


def engine_identity(data: Any, headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The identity an answer carries, as sorted (name, value) pairs; () when it carries none."""
    ident = {f: data[f][:200] for f in IDENTITY_FIELDS if isinstance(data, dict) and isinstance(data.get(f), str)}
    server = headers.get("server")
    if server:
        ident["server"] = server[:200]
    return tuple(sorted(ident.items()))


def origin_of(url: httpx.URL | str) -> str:
    """``scheme://host:port`` of a URL (default port spelled out, credentials dropped): what a verdict is bound to."""
    u = url if isinstance(url, httpx.URL) else httpx.URL(str(url))
    port = u.port if u.port is not None else {"http": 80, "https": 443}.get(u.scheme)
    host = f"[{u.host}]" if ":" in u.host else u.host
    return f"{u.scheme}://{host}:{port}"


def _bare(url: httpx.URL) -> str:
    """The URL without user:password@ (it goes into error messages)."""
    return str(url.copy_with(username=None, password=None)) if url.userinfo else str(url)


def answer_budget(body: Mapping[str, Any]) -> int:
    """Bytes an honest answer to ``body`` can need: positions (prompt + generated) × entries asked per position."""
    prompt = body.get("prompt", body.get("input_ids"))
    n = len(prompt) if isinstance(prompt, (list, str)) else 0
    params = body.get("sampling_params") if isinstance(body.get("sampling_params"), Mapping) else {}
    m = next((v for v in (body.get("max_tokens"), body.get("n_predict"), params.get("max_new_tokens"))
              if isinstance(v, int) and not isinstance(v, bool) and v > 0), 0)
    k = max([v for v in (body.get(f) for f in ("prompt_logprobs", "logprobs", "top_logprobs", "n_probs",
                                               "top_logprobs_num"))
             if isinstance(v, int) and not isinstance(v, bool) and v > 0] or [0])
    return (n + m) * (k + 2) * BYTES_PER_ENTRY


class _Deadline:
    """The total deadline of one request attempt. httpx times each read, so a server that sends a byte now and
    then never trips it; a timer shuts the attempt's socket down when the deadline passes (headers or body), and
    the body stream checks it between chunks. Armed for each connection the attempt opens (httpcore's ``trace``
    extension hands over the socket; no keep-alive, so a connection is never shared with another attempt),
    disarmed when its response is closed."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.t_end = time.monotonic() + seconds
        self.fired = False
        self._timer: threading.Timer | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def expired(self) -> bool:
        if time.monotonic() >= self.t_end:
            self.fired = True
        return self.fired

    def trace(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            sock = info["return_value"].get_extra_info("socket")
            if sock is not None:
                timer = threading.Timer(max(0.0, self.t_end - time.monotonic()), self._fire, (sock,))
                timer.daemon = True
                with self._lock:
                    if self._timer is not None:
                        self._timer.cancel()
                    self._timer, self._sock = timer, sock
                timer.start()
        elif event == "http11.response_closed.complete":
            self.cancel()

    def _fire(self, sock: socket.socket) -> None:
        with self._lock:
            if self._sock is not sock:    # disarmed, or another connection of the attempt is current
                return
            self.fired = True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._sock = None, None

    def timeout(self) -> httpx.ReadTimeout:
        return httpx.ReadTimeout(f"no complete answer within the total deadline of {self.seconds:g} s per request")


class _CappedStream(httpx.SyncByteStream):
    """A response body that stops at ``limit`` bytes (a named error, the rest never read) and at the deadline."""

    def __init__(self, inner: httpx.SyncByteStream, limit: int, deadline: _Deadline, url: str):
        self._inner, self._limit, self._deadline, self._url = inner, limit, deadline, url

    def __iter__(self) -> Iterator[bytes]:
        n = 0
        try:
            for chunk in self._inner:
                n += len(chunk)
                if n > self._limit:
                    raise EngineLimitExceeded("body", self._url, None, self._limit)
                if self._deadline.expired():
                    raise self._deadline.timeout()
                yield chunk
        except httpx.HTTPError:
            if self._deadline.fired:
                raise self._deadline.timeout() from None
            raise
        if self._deadline.fired:   # a body read until close ends "normally" when the timer shut the socket
            raise self._deadline.timeout()

    def close(self) -> None:
        self._deadline.cancel()
        self._inner.close()


class _OriginGuard:
    """httpx event hooks binding a client to one origin: redirects to another origin are refused (within the
    origin only when configured), only uncompressed bodies are read (``Accept-Encoding: identity``; any other
    ``Content-Encoding`` is refused), bodies are capped, every attempt has a total deadline, and the origins and
    peer addresses that answered are kept for the record."""

    def __init__(self, origin: str, config: "ClientConfig"):
        self.origin = origin
        self.deadline_s = config.deadline_s if config.deadline_s is not None else 2 * config.timeout_s
        self.max_body = config.max_body_bytes
        self.same_origin_redirects = config.same_origin_redirects
        self.answered: set[str] = set()
        self.peers: set[str] = set()
        self._lock = threading.Lock()
        self._tls = threading.local()

    def begin(self, budget: int = 0) -> None:
        """Called before each attempt on this thread: a fresh deadline, and the body cap for its answer."""
        self._tls.limit = max(self.max_body, budget)
        self._tls.deadline = _Deadline(self.deadline_s)

    def _current(self) -> _Deadline:
        if getattr(self._tls, "deadline", None) is None:
            self.begin()
        return self._tls.deadline

    def deadline_fired(self) -> bool:
        d = getattr(self._tls, "deadline", None)
        return d is not None and d.fired

    def on_request(self, request: httpx.Request) -> None:
        request.headers["Accept-Encoding"] = "identity"
        request.extensions = {**request.extensions, "trace": self._current().trace}

    def on_response(self, response: httpx.Response) -> None:
        request = response.request
        url = _bare(request.url)
        redirect = response.has_redirect_location
        if redirect:
            location = response.headers["location"][:300]
            target = origin_of(request.url.join(location))
            same = target == self.origin
            if not (same and self.same_origin_redirects):
                raise EngineRedirectRefused(response.status_code, url, location, self.origin, target, same)
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise EngineBodyRefused(url, f"Content-Encoding {encoding[:40]!r} was not asked for (the client asks for "
                                    "'identity'): a compressed body's size is unknown until it is decoded")
        limit = getattr(self._tls, "limit", self.max_body)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise EngineLimitExceeded("body", url, int(declared), limit)
        response.stream = _CappedStream(response.stream, limit, self._current(), url)
        if redirect:   # followed within the origin (httpx reads this body first, capped like any other)
            return
        stream = response.extensions.get("network_stream")
        peer = stream.get_extra_info("server_addr") if stream is not None else None
        with self._lock:
            self.answered.add(origin_of(request.url))
            if isinstance(peer, tuple) and len(peer) >= 2:
                self.peers.add(f"{peer[0]}:{peer[1]}")


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff: delays base, 2·base, 4·base … capped at max_delay_s; only the statuses
    named here (and timeouts, connection errors) are retried."""

    max_attempts: int = 4
    base_delay_s: float = 0.25
    max_delay_s: float = 4.0
    retry_statuses: frozenset[int] = frozenset({500, 502, 503, 504})

    def retrying(self, sleep: Callable[[float], None]) -> tenacity.Retrying:
        """The tenacity loop carrying this policy out: it retries :class:`_Retryable` failures only."""
        return tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts),
            wait=tenacity.wait_exponential(multiplier=self.base_delay_s, max=self.max_delay_s),
            retry=tenacity.retry_if_exception_type(_Retryable), sleep=sleep, reraise=True)


class _Retryable(Exception):
    """One attempt that failed in a way another attempt may not: a listed 5xx, a timeout, a connection error."""

    def __init__(self, what: str, detail: str, status: int | None):
        super().__init__(what)
        self.what, self.detail, self.status = what, detail, status


@dataclass(frozen=True)
class ClientConfig:
    base_url: str                  # server root, e.g. http://127.0.0.1:8002 (no /v1)
    model: str                     # the served model name; every response must name it
    api_key: str = "unused"
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_concurrency: int = 2
    vocab_size: int | None = None  # when given, every id is range-checked
    deadline_s: float | None = None        # total per request attempt (headers + body); None: 2 × timeout_s
    max_body_bytes: int = 64 << 20         # body cap; a completions request's own size estimate may raise it
    same_origin_redirects: bool = False    # follow redirects within the origin (never to another origin)


@dataclass(frozen=True)
class EngineSource:
    """What the caller knows about the engine; becomes the record's provenance ``source`` and precision."""

    url: str
    model: str
    profile: str
    flags: Mapping[str, Any] | Sequence[str] = ()
    precision: str = "unknown"     # the engine's dtype as the caller configured it (e.g. fp32, bf16, q4_1)

    def as_source(self) -> dict[str, Any]:
        flags = dict(self.flags) if isinstance(self.flags, Mapping) else list(self.flags)
        return {"url": self.url, "model": self.model, "profile": self.profile, "flags": flags}


# ---------------------------------------------------------------------------------------------- client
class EngineClient:
    """Strict transport plus high-level calls. Thread-safe (one openai client, one connection pool)."""

    def __init__(self, config: ClientConfig, adapter: Adapter | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.config = config
        self.model = config.model
        root = config.base_url.rstrip("/")
        if root.endswith("/v1"):
            root = root[:-3]
        self.root = root
        self._sleep = sleep
        if len(config.model) > MAX_MODEL_NAME:
            raise EngineLimitExceeded(f"model name {config.model[:40]!r}…", None, len(config.model), MAX_MODEL_NAME,
                                      "characters")
        self.origin = origin_of(root)
        self._guard = _OriginGuard(self.origin, config)
        timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        # our own httpx client: no redirect to another origin, no compression, capped bodies, a total deadline;
        # no keep-alive, so every attempt's connection is its own (the deadline's timer owns that socket)
        http = httpx.Client(timeout=timeout, follow_redirects=config.same_origin_redirects, max_redirects=3,
                            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0),  # openai's cap
                            headers={"Accept-Encoding": "identity"},
                            event_hooks={"request": [self._guard.on_request], "response": [self._guard.on_response]})
        self._openai = openai.OpenAI(base_url=root + "/v1", api_key=config.api_key, max_retries=0, timeout=timeout,
                                     http_client=http)
        if adapter is None:
            from engine.adapters.vllm import VllmAdapter
            adapter = VllmAdapter(vocab_size=config.vocab_size)
        self.adapter = adapter
        self._completion_fields = _create_fields(self._openai.completions.create)
        self._chat_fields = _create_fields(self._openai.chat.completions.create)
        self._lock = threading.Lock()
        self.attempts = 0   # total HTTP attempts made (observability; tests)
        self._identities: list[tuple[tuple[tuple[str, str], ...], str | None]] = []   # (identity, seq_id) per answer

    def close(self) -> None:
        self._openai.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ transport
    def _url(self, path: str) -> str:
        return self.root + "/" + path.lstrip("/")

    def identity_mark(self) -> int:
        """A mark for `identity_since`: the answers from here on."""
        with self._lock:
            return len(self._identities)

    def identity_since(self, mark: int) -> tuple[dict[str, str], tuple | None]:
        """The engine identity the JSON answers since `mark` agree on (field → value; an answer that leaves a
        field out, e.g. llama-server's native endpoints without ``model``, does not change it), and the first
        change: (field, (value, first sequence), (other value, its first sequence)) or None."""
        with self._lock:
            first: dict[str, tuple[str, str | None]] = {}
            for ident, seq_id in self._identities[mark:]:
                for field, value in ident:
                    seen = first.setdefault(field, (value, seq_id))
                    if seen[0] != value:
                        return {f: v for f, (v, _) in first.items()}, (field, seen, (value, seq_id))
            return {f: v for f, (v, _) in first.items()}, None

    def _note_identity(self, data: Any, headers: Mapping[str, str], seq_id: str | None) -> None:
        with self._lock:
            self._identities.append((engine_identity(data, headers), seq_id))

    def answered_by(self) -> tuple[list[str], list[str]]:
        """The origins (``scheme://host:port``) and peer addresses (``ip:port``) that have answered this client."""
        with self._guard._lock:
            return sorted(self._guard.answered), sorted(self._guard.peers)

    def _with_retries(self, url: str, seq_id: str | None, call: Callable[[], T], budget: int = 0) -> T:
        """``call()`` under the retry policy: a 4xx (or an unlisted 5xx) is :class:`EngineRequestRejected` at once;
        the last retryable failure, once the attempts are spent, is :class:`EngineTransportError`."""
        policy = self.config.retry
        tries = 0

        def attempt() -> T:
            nonlocal tries
            tries += 1
            with self._lock:
                self.attempts += 1
            self._guard.begin(budget)
            try:
                return call()
            except openai.APIStatusError as exc:
                if exc.status_code not in policy.retry_statuses:
                    raise EngineRequestRejected(exc.status_code, url, _error_message(exc), seq_id) from None
                failure = _Retryable("server error", _error_message(exc), exc.status_code)
            except openai.APITimeoutError as exc:
                failure = _Retryable("timeout", str(exc) or "request timed out", None)
            except openai.APIConnectionError as exc:
                cause = exc.__cause__ or exc
                failure = _Retryable("connection error", f"{type(cause).__name__}: {cause}", None)
            if self._guard.deadline_fired():
                failure = _Retryable("deadline exceeded",
                                     f"no complete answer within the total deadline of {self._guard.deadline_s:g} s "
                                     f"per request (per-read timeout {self.config.timeout_s:g} s)", failure.status)
            raise failure

        try:
            return policy.retrying(self._sleep)(attempt)
        except _Retryable as last:
            raise EngineTransportError(last.what, url, tries, last.detail, last.status, seq_id) from None

    def post_json(self, path: str, body: Mapping[str, Any], *, seq_id: str | None = None) -> JsonReply:
        """POST a JSON body and decode the answer strictly. ``/v1/*completions`` go through openai's resources."""
        url = self._url(path)
        if path.rstrip("/") == "/v1/completions":
            known, extra = _split_body(self._completion_fields, body)
            call = lambda: self._openai.completions.with_raw_response.create(**known, extra_body=extra)
        elif path.rstrip("/") == "/v1/chat/completions":
            known, extra = _split_body(self._chat_fields, body)
            call = lambda: self._openai.chat.completions.with_raw_response.create(**known, extra_body=extra)
        else:
            call = lambda: self._openai.post(url, cast_to=httpx.Response, body=dict(body))
        resp = self._with_retries(url, seq_id, call, answer_budget(body))
        raw = resp.content
        elapsed = resp.elapsed.total_seconds()
        try:
            data = strict_json(raw, url)
        except EngineResponseError as exc:
            raise exc.at(seq_id, url) from None
        self._note_identity(data, resp.headers, seq_id)
        return JsonReply(data, elapsed, url)

    def get(self, path: str) -> httpx.Response:
        """GET under every guard of this client (same origin, body cap, total deadline, retries); 4xx raise."""
        url = self._url(path)
        return self._with_retries(url, None, lambda: self._openai.get(url, cast_to=httpx.Response))

    def get_text(self, path: str) -> tuple[str, float]:
        resp = self.get(path)
        return resp.text, resp.elapsed.total_seconds()

    def get_json(self, path: str) -> JsonReply:
        resp = self.get(path)
        return JsonReply(strict_json(resp.content, self._url(path)), resp.elapsed.total_seconds(), self._url(path))

    def stream_events(self, path: str, body: Mapping[str, Any], *, seq_id: str | None = None) -> Iterator[SseEvent]:
        """POST with ``stream: true`` and yield decoded SSE events with arrival times; stops at ``[DONE]``.

        Retries apply only to opening the stream; once bytes have arrived a failure is an error.
        """
        url = self._url(path)
        known, extra = _split_body(self._completion_fields, body)
        if path.rstrip("/") != "/v1/completions":
            raise UnsupportedSurface(f"streaming is implemented for /v1/completions only, not {path}")
        t0 = time.perf_counter()
        cm = self._with_retries(url, seq_id, lambda: _open_stream(self._openai, known, extra), answer_budget(body))
        done = False
        try:
            for event in httpx_sse.EventSource(cm.http_response).iter_sse():
                t = time.perf_counter() - t0
                if event.event not in ("", "message"):   # OpenAI-style streams send unnamed data events only
                    raise EngineResponseError(Malformed.STREAM_MALFORMED,
                                              f"SSE event {event.event[:40]!r} is not a data event", seq_id, url=url)
                payload = event.data.strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    data = strict_json(payload, url)
                except EngineResponseError as exc:
                    raise EngineResponseError(Malformed.STREAM_MALFORMED, f"chunk: {exc.detail}", seq_id, url=url) from None
                if isinstance(data, dict) and "error" in data and "choices" not in data:
                    raise EngineResponseError(Malformed.STREAM_MALFORMED, f"engine sent an error event: {data['error']!r}",
                                              seq_id, url=url)
                yield SseEvent(t, data)
        except httpx_sse.SSEError as exc:   # not an event stream at all (its Content-Type says so)
            raise EngineResponseError(Malformed.STREAM_MALFORMED, str(exc)[:200], seq_id, url=url) from None
        except httpx.HTTPError as exc:
            what = "deadline exceeded" if self._guard.deadline_fired() else "stream broken"
            raise EngineTransportError(what, url, 1, f"{type(exc).__name__}: {exc}", None, seq_id) from None
        finally:
            cm.close()
        if not done:
            raise EngineResponseError(Malformed.STREAM_MALFORMED, "stream ended without 'data: [DONE]'", seq_id, url=url)

    # ------------------------------------------------------------------ high level
    def prompt_logprobs(self, token_ids: Sequence[int], k: int, *, seq_id: str = "adhoc",
                        cache_salt: str | None = None) -> SequenceLogprobs:
        self._check_ids(token_ids, seq_id)
        return self.adapter.prompt_logprobs(self, seq_id, token_ids, k, cache_salt=cache_salt)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, k: int, *, seq_id: str = "adhoc",
                 options: GenerateOptions | None = None) -> Generation:
        """Greedy generation with top-k logprobs through the adapter (``options``: salt, ignore_eos, extra)."""
        self._check_ids(prompt_ids, seq_id)
        return self.adapter.generate(self, seq_id, prompt_ids, max_tokens, k, options)

    def stream(self, prompt_ids: Sequence[int], max_tokens: int, k: int, *, seq_id: str = "adhoc",
               cache_salt: str | None = None, ignore_eos: bool = False, extra: Mapping[str, Any] | None = None,
               on_tokens: Callable[[int], None] | None = None) -> StreamedGeneration:
        """Greedy streamed generation with per-chunk arrival times (TTFT, inter-token), through the adapter
        (UnsupportedSurface where the engine's adapter cannot stream).

        cache_salt: a fresh one unless given (a chosen salt lets the prefix cache hit on purpose);
        ignore_eos: generate exactly max_tokens (fixed-length gates); extra: more request-body fields;
        on_tokens(total): called after every chunk that carried tokens (e.g. to start a companion request
        mid-decode)."""
        self._check_ids(prompt_ids, seq_id)
        options = GenerateOptions(cache_salt, True if ignore_eos else None, dict(extra or {}))
        return self.adapter.stream(self, seq_id, prompt_ids, max_tokens, k, options, on_tokens)

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """vLLM ``POST /tokenize``; checks ``count`` against the list."""
        reply = self.post_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens})
        ids = need(reply.data, "tokens", list, "/tokenize response")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise EngineResponseError(Malformed.TOKENIZE_MISMATCH, f"/tokenize tokens[{i}] is {t!r}", url=reply.url)
            check_id_range(t, "tokenized id", None, i, self.config.vocab_size)
        count = reply.data.get("count")
        if count is not None and count != len(ids):
            raise EngineResponseError(Malformed.TOKENIZE_MISMATCH, f"/tokenize count {count} but {len(ids)} tokens",
                                      url=reply.url)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        reply = self.post_json("/detokenize", {"model": self.model, "tokens": list(ids)})
        return need(reply.data, "prompt", str, "/detokenize response")

    def models(self) -> list[str]:
        reply = self.get_json("/v1/models")
        data = need(reply.data, "data", list, "/v1/models response")
        ids = [need(m, "id", str, "/v1/models entry") for m in data]
        for name in ids:
            if len(name) > MAX_MODEL_NAME:
                raise EngineLimitExceeded(f"model name {name[:40]!r}…", reply.url, len(name), MAX_MODEL_NAME,
                                          "characters")
        return ids

    def metrics(self) -> MetricsSnapshot:
        text, _ = self.get_text("/metrics")
        return parse_metrics(text, self._url("/metrics"))

    def _check_ids(self, ids: Sequence[int], seq_id: str) -> None:
        if len(ids) == 0:
            raise ValueError(f"sequence {seq_id!r}: empty token-id sequence")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
                raise ValueError(f"sequence {seq_id!r} position {i}: {t!r} is not a token id")


def _open_stream(client: openai.OpenAI, known: dict, extra: dict):
    cm = client.completions.with_streaming_response.create(**known, extra_body=extra)
    return cm.__enter__()


def _error_message(exc: openai.APIStatusError) -> str:
    try:
        body = exc.response.json()
    except Exception:
        return (exc.response.text or str(exc))[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        return str(err)[:500]
    return str(body)[:500]


def parse_metrics(text: str, url: str = "/metrics") -> MetricsSnapshot:
    """Prometheus text exposition → :class:`MetricsSnapshot` via ``prometheus_client.parser``."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    try:
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, []).extend((s.name, dict(s.labels), float(s.value)) for s in fam.samples)
    except Exception as exc:  # the parser raises ValueError / IndexError / TypeError on bad text
        raise EngineResponseError(Malformed.METRICS_MALFORMED, f"{type(exc).__name__}: {exc}", url=url) from None
    if text.strip() and not families:
        raise EngineResponseError(Malformed.METRICS_MALFORMED, "no metric families in a non-empty body", url=url)
    return MetricsSnapshot(families, text)


# ---------------------------------------------------------------------------------------------- panel scoring
# the panels seam (docs/DESIGN.md): what is scored is always an encoded panel
from panels.model import EncodedPanel as _EncodedPanel, EncodedSequence as _EncodedSequence  # noqa: E402


@dataclass
class ScoreStats:
    """Timing of one :func:`score_panel` run (filled in place when passed)."""

    wall_s: float = 0.0
    http_s: float = 0.0            # sum of HTTP round trips (send → body received)
    requests: int = 0
    build_s: float = 0.0           # record building after all responses
    sequences: int = 0
    positions: int = 0
    ambiguous: int = 0


def to_sequence_scores(seq: _EncodedSequence, got: SequenceLogprobs) -> SequenceScores:
    """Canonical rows of one sequence → the record writer's per-sequence arrays (scored positions only)."""
    ids = tuple(int(t) for t in seq.token_ids)
    if got.token_ids != ids:
        raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH, "adapter returned another id sequence", seq.seq_id)
    mask = np.asarray(seq.scored_mask, dtype=bool)
    if mask.shape != (len(ids),):
        raise ValueError(f"sequence {seq.seq_id!r}: scored_mask has {mask.size} entries for {len(ids)} ids")
    if mask.size and mask[0]:
        raise ValueError(f"sequence {seq.seq_id!r} position 0: position 0 cannot be scored")
    by_pos = {p.position: p for p in got.positions}
    k = got.k
    positions = np.flatnonzero(mask)
    n = positions.size
    top_ids = np.full((n, k), -1, dtype=np.int64)
    top_lp = np.full((n, k), -np.inf, dtype=np.float64)
    actual = np.empty(n, dtype=np.float64)
    rank = np.zeros(n, dtype=np.int64)
    amb = np.zeros(n, dtype=bool)
    for r, pos in enumerate(positions):
        row = by_pos.get(int(pos))
        if row is None:
            raise EngineResponseError(Malformed.LENGTH_MISMATCH, "adapter returned no row for a scored position",
                                      seq.seq_id, int(pos))
        if row.actual_id != ids[pos]:
            raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH,
                                      f"row names actual id {row.actual_id}, sequence has {ids[pos]}", seq.seq_id, int(pos))
        m = len(row.top_ids)
        if m > k:
            raise EngineResponseError(Malformed.TOO_MANY_ENTRIES, f"{m} top entries for k={k}", seq.seq_id, int(pos))
        top_ids[r, :m] = row.top_ids
        top_lp[r, :m] = row.top_logprobs
        actual[r] = row.actual_logprob
        rank[r] = row.actual_rank
        amb[r] = row.ambiguous
    return SequenceScores(seq.seq_id, seq.domain, np.asarray(ids, dtype=np.int64), mask, top_ids, top_lp, actual, rank,
                          ambiguous=amb if got.keyed_by == "string" else None)


def score_panel(client: EngineClient, encoded_panel: _EncodedPanel, k: int, provenance_source: EngineSource, *,
                max_concurrency: int | None = None, progress: bool = True, stats: ScoreStats | None = None,
                cache_salt: Callable[[str], str | None] | None = None) -> Record:
    """Score every sequence of ``encoded_panel`` on the engine → a ``Record`` with side ``engine``.

    One request per sequence (llama-server: one per prefix), at most ``max_concurrency`` in flight. vLLM
    requests carry a fresh random ``cache_salt`` each (``cache_salt`` may map seq_id → salt instead, e.g. to
    study the prefix cache). The first failing sequence's error is raised after in-flight requests end; no
    further sequence is sent once one has failed (a dead engine is not retried once per queued sequence).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    seqs = list(encoded_panel.sequences)
    if not seqs:
        raise ValueError(f"panel {encoded_panel.panel_name!r} has no sequences")
    workers = max(1, int(max_concurrency or client.config.max_concurrency))
    stats = stats if stats is not None else ScoreStats()
    t0 = time.perf_counter()

    failed = threading.Event()   # set by the first failing sequence: later ones are not sent at all
    mark = client.identity_mark()

    def one(seq: _EncodedSequence) -> SequenceLogprobs:
        if failed.is_set():
            raise _NotSent(seq.seq_id)
        salt = cache_salt(seq.seq_id) if cache_salt is not None else None
        try:
            return client.prompt_logprobs(list(seq.token_ids), k, seq_id=seq.seq_id, cache_salt=salt)
        except BaseException:
            failed.set()
            raise

    results: list[SequenceLogprobs | None] = [None] * len(seqs)
    with counting(f"{client.adapter.name} · {encoded_panel.panel_name}", len(seqs), enabled=progress,
                  transient=True) as advance:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ds41-score") as pool:
            futures = [pool.submit(one, s) for s in seqs]
            try:
                for i, fut in enumerate(futures):
                    results[i] = fut.result()
                    advance()
            except BaseException:
                for f in futures:   # a dead engine must not be retried once per queued sequence
                    f.cancel()
                raise
    tb = time.perf_counter()
    scores = [to_sequence_scores(s, r) for s, r in zip(seqs, results)]
    surfaces = sorted({r.surface for r in results})
    keyed = sorted({r.keyed_by for r in results})
    timing = HttpTiming()
    for r in results:
        timing = timing + r.timing
    cached = [r.cached_tokens for r in results]
    identity, change = client.identity_since(mark)
    if change is not None:   # one record = one engine: its identity must not change between sequences
        field, (a, a_seq), (b, b_seq) = change
        raise EngineIdentityChanged(client.root, (str(a_seq), f"{field}={a!r}"), (str(b_seq), f"{field}={b!r}"))
    origins, peers = client.answered_by()
    if origins != [client.origin]:   # by construction (no redirect leaves the origin); a verdict is bound to it
        raise EngineTransportError("answer from another origin", client.origin, 1,
                                   f"answers came from {origins}; the engine under test is {client.origin}")
    vocab = client.config.vocab_size or getattr(client.adapter, "vocab_size", None)
    prov = Provenance(
        side="engine",
        panel_name=encoded_panel.panel_name,
        panel_version=str(encoded_panel.panel_version),
        panel_hash=encoded_panel.panel_hash,
        tokenizer_hash=encoded_panel.tokenizer_hash,
        source=provenance_source.as_source(),
        precision=provenance_source.precision,
        code_version=code_version(),
        created=Provenance.now(),
        extra={
            "adapter": client.adapter.name, "surface": surfaces, "keyed_by": keyed, "k_requested": k,
            "cache_salt": "fresh random salt per request" if cache_salt is None else "caller-provided",
            "cached_tokens": None if any(c is None for c in cached) else int(sum(cached)),
            "ambiguous_positions": int(sum(r.n_ambiguous for r in results)),
            "requests": timing.requests,
            "answered_by": origins,          # scheme://host:port of every answer (credentials never included)
            "answered_peers": peers,         # ip:port the answers came from
            "answered_as": identity,         # the one engine identity its answers agree on (model, fingerprint…)
            **({"vocab_size": int(vocab)} if vocab else {}),
        },
    )
    record = Record.from_sequences(prov, scores, k=k)
    t1 = time.perf_counter()
    stats.wall_s = t1 - t0
    stats.http_s = timing.http_s
    stats.requests = timing.requests
    stats.build_s = t1 - tb
    stats.sequences = len(seqs)
    stats.positions = record.n_positions
    stats.ambiguous = int(prov.extra["ambiguous_positions"])
    return record


class _NotSent(Exception):
    """A sequence skipped because an earlier one failed (its error, raised first, is the one reported)."""

"""The canonical per-position output every adapter produces (engines.md §10), and strict parsing helpers.

Adapters turn one engine's response shape into :class:`PositionLogprobs` rows: the position, the actual
id and its logprob, the engine's true top-k as (id, logprob) pairs in rank order (an actual token that the
surface appends outside the top-k is *not* a top-k member), the 1-based rank when known, and whether the
row came from a string-keyed surface with a collision (``ambiguous``).

Parsing is pure: functions take decoded JSON and the ids that were sent, and raise
:class:`~engine.errors.EngineResponseError` naming the kind, sequence and position on anything malformed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Mapping, Protocol, Sequence

from core.records import CLAMP_LOGPROB
from engine.errors import EngineResponseError, Malformed, UnsupportedSurface


KeyedBy = Literal["id", "string"]


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """One scored position in canonical form."""

    position: int
    actual_id: int
    actual_logprob: float          # -inf when the engine reports probability 0 (clamped value)
    actual_rank: int               # 1-based vocabulary rank; 0 when the surface does not say
    top_ids: tuple[int, ...]       # the engine's top-k in rank order (fewer than k only when ambiguous)
    top_logprobs: tuple[float, ...]
    ambiguous: bool = False        # string-keyed surface with a key collision / unmappable key


@dataclass(frozen=True)
class HttpTiming:
    """Time spent inside HTTP round trips (send → body received), for overhead accounting."""

    requests: int = 0
    http_s: float = 0.0

    def __add__(self, other: "HttpTiming") -> "HttpTiming":
        return HttpTiming(self.requests + other.requests, self.http_s + other.http_s)


@dataclass(frozen=True)
class SequenceLogprobs:
    """Prompt-position logprobs of one token-id sequence (positions 1..n-1, in order)."""

    seq_id: str
    token_ids: tuple[int, ...]
    k: int
    surface: str
    keyed_by: KeyedBy
    positions: tuple[PositionLogprobs, ...]
    timing: HttpTiming = field(default_factory=HttpTiming)
    cached_tokens: int | None = None   # None = the engine did not say (never read as 0)

    @property
    def n_ambiguous(self) -> int:
        return sum(p.ambiguous for p in self.positions)


@dataclass(frozen=True)
class Generation:
    """Greedy continuation of a prompt: generated ids and their per-position top-k."""

    seq_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    positions: tuple[PositionLogprobs, ...]    # position = len(prompt_ids) + j
    k: int
    surface: str
    text: str
    finish_reason: str | None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    timing: HttpTiming = field(default_factory=HttpTiming)


@dataclass(frozen=True)
class StreamedGeneration:
    """A streamed greedy continuation with per-chunk arrival times (seconds after the request was sent)."""

    generation: Generation
    chunk_times_s: tuple[float, ...]
    chunk_token_counts: tuple[int, ...]

    @property
    def ttft_s(self) -> float | None:
        for t, n in zip(self.chunk_times_s, self.chunk_token_counts):
            if n > 0:
                return t
        return None

    @property
    def inter_token_s(self) -> tuple[float, ...]:
        times = [t for t, n in zip(self.chunk_times_s, self.chunk_token_counts) if n > 0]
        return tuple(b - a for a, b in zip(times, times[1:]))


@dataclass(frozen=True)
class JsonReply:
    data: Any
    elapsed_s: float
    url: str


@dataclass(frozen=True)
class SseEvent:
    t_s: float          # seconds after the request was sent
    data: Any           # decoded JSON of the event


@dataclass(frozen=True)
class MetricsSnapshot:
    """Parsed Prometheus text: ``families[name]`` → list of (sample name, labels, value)."""

    families: dict[str, list[tuple[str, dict[str, str], float]]]
    raw: str

    def value(self, sample: str, **labels: str) -> float:
        """Sum of the samples named ``sample`` whose labels include ``labels``; KeyError if none."""
        found = [v for fam in self.families.values() for (n, lab, v) in fam
                 if n == sample and all(lab.get(k) == x for k, x in labels.items())]
        if not found:
            raise KeyError(f"no metric sample {sample!r} with labels {labels} in /metrics")
        return float(sum(found))


@dataclass(frozen=True)
class GenerateOptions:
    """What a behaviour gate asks of one greedy generation beyond prompt, length and k.

    ``cache_salt``: the prefix-cache namespace; None = a fresh one, so no request reads another's cache
    (engines.md §10 rule 8); a chosen salt lets a later request hit the cache on purpose (the prefix-cache
    gate). ``ignore_eos``: True generates exactly ``max_tokens`` (fixed-length gates); None leaves the
    engine's default and sends nothing. ``extra``: engine-specific request fields, sent as given."""

    cache_salt: str | None = None
    ignore_eos: bool | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


class Transport(Protocol):
    """What adapters need from the client: strict JSON POST/GET with retries and timing, SSE streams, metrics."""

    model: str

    def post_json(self, path: str, body: Mapping[str, Any], *, seq_id: str | None = None) -> JsonReply: ...

    def get_json(self, path: str) -> JsonReply: ...

    def stream_events(self, path: str, body: Mapping[str, Any], *,
                      seq_id: str | None = None) -> Iterator[SseEvent]: ...

    def metrics(self) -> MetricsSnapshot: ...


class Adapter(Protocol):
    """One engine's request and response shapes. What an engine cannot do raises UnsupportedSurface
    ("... not supported by this engine"), never a silent stand-in."""

    name: str
    keyed_by: KeyedBy

    def prompt_logprobs(self, transport: Transport, seq_id: str, token_ids: Sequence[int], k: int, *,
                        cache_salt: str | None = None) -> SequenceLogprobs: ...

    def generate(self, transport: Transport, seq_id: str, prompt_ids: Sequence[int], max_tokens: int,
                 k: int, options: GenerateOptions | None = None) -> Generation: ...

    def stream(self, transport: Transport, seq_id: str, prompt_ids: Sequence[int], max_tokens: int, k: int,
               options: GenerateOptions | None = None,
               on_tokens: Callable[[int], None] | None = None) -> StreamedGeneration:
        """Greedy streamed generation with per-chunk arrival times; ``on_tokens(total)`` after every chunk
        that carried tokens (e.g. to start a companion request mid-decode)."""
        ...

    def max_model_len(self, transport: Transport) -> int | None:
        """The server's context length; None when the engine does not say."""
        ...

    def cache_config(self, transport: Transport) -> dict[str, str]:
        """The server's KV-cache settings (block_size, enable_prefix_caching, ...); {} when it does not say."""
        ...


def unsupported(engine: str, what: str) -> UnsupportedSurface:
    return UnsupportedSurface(f"{what} is not supported by this engine ({engine})")


def plain_options(engine: str, options: GenerateOptions | None) -> GenerateOptions:
    """``options`` (or the defaults) for an engine without per-request cache namespaces: its requests never
    reuse another's cache, as a fresh salt would not; a chosen salt, asked to make a hit, cannot be kept."""
    o = options or GenerateOptions()
    if o.cache_salt is not None:
        raise unsupported(engine, f"a chosen cache salt ({o.cache_salt!r}: a per-request prefix-cache namespace)")
    return o


class WithoutServerSurfaces:
    """The behaviour gates' surfaces an adapter's engine does not offer, each a clear UnsupportedSurface; an
    adapter inherits this and overrides what its engine does offer."""

    name: str

    def stream(self, transport: Transport, seq_id: str, prompt_ids: Sequence[int], max_tokens: int, k: int,
               options: GenerateOptions | None = None,
               on_tokens: Callable[[int], None] | None = None) -> StreamedGeneration:
        raise unsupported(self.name, "streamed generation")

    def max_model_len(self, transport: Transport) -> int | None:
        raise unsupported(self.name, "reading the server's context length")

    def cache_config(self, transport: Transport) -> dict[str, str]:
        raise unsupported(self.name, "reading the server's KV-cache settings")


# ---------------------------------------------------------------------------------------------- strict JSON
def _reject_constant(name: str):
    raise EngineResponseError(Malformed.NON_STANDARD_NUMBER, f"JSON contains the non-standard literal {name}")


def _pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise EngineResponseError(Malformed.DUPLICATE_KEY, f"key {k!r} appears twice in one JSON object")
        out[k] = v
    return out


def strict_json(body: bytes | str, url: str | None = None) -> Any:
    """Decode JSON refusing truncation, NaN/Infinity literals and duplicate keys."""
    if not body or not body.strip():
        raise EngineResponseError(Malformed.EMPTY_BODY, "response body is empty", url=url)
    try:
        return json.loads(body, object_pairs_hook=_pairs, parse_constant=_reject_constant)
    except EngineResponseError as exc:
        raise exc.at(url=url) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        size = len(body)
        raise EngineResponseError(Malformed.INVALID_JSON, f"{exc} (body of {size} bytes; truncated?)", url=url) from None


# ---------------------------------------------------------------------------------------------- field access
def need(obj: Any, key: str, typ: type | tuple[type, ...], where: str, *, seq_id: str | None = None,
         position: int | None = None, nullable: bool = False) -> Any:
    """obj[key] with a type check; missing / wrong type / null raise named errors."""
    if not isinstance(obj, dict):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{where} is {type(obj).__name__}, expected an object",
                                  seq_id, position)
    if key not in obj:
        raise EngineResponseError(Malformed.MISSING_FIELD, f"{where} has no {key!r}", seq_id, position)
    val = obj[key]
    if val is None:
        if nullable:
            return None
        raise EngineResponseError(Malformed.NULL_ENTRY, f"{where}.{key} is null", seq_id, position)
    if typ is float:
        typ = (int, float)
    if isinstance(val, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{where}.{key} is a boolean", seq_id, position)
    if not isinstance(val, typ):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{where}.{key} is {type(val).__name__}, expected {names}",
                                  seq_id, position)
    return val


def logprob_value(val: Any, what: str, seq_id: str | None, position: int | None) -> float:
    """A JSON logprob → float; clamped values (≤ −9999) become -inf; NaN/+inf/positive are errors."""
    if val is None:
        raise EngineResponseError(Malformed.NULL_ENTRY, f"{what} is null", seq_id, position)
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{what} is {type(val).__name__} {val!r}, expected a number",
                                  seq_id, position)
    x = float(val)
    if math.isnan(x) or x == math.inf:
        raise EngineResponseError(Malformed.NON_FINITE, f"{what} is {x!r}", seq_id, position)
    if x > 1e-6:
        raise EngineResponseError(Malformed.POSITIVE_LOGPROB, f"{what} is {x!r} > 0", seq_id, position)
    if x <= CLAMP_LOGPROB:  # vLLM's -9999.0 for -inf; llama-server writes lowest() (engines.md §3.3, §5)
        return -math.inf
    return min(x, 0.0)


def token_id(val: Any, what: str, seq_id: str | None, position: int | None, vocab_size: int | None) -> int:
    if isinstance(val, bool) or not isinstance(val, int):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{what} is {type(val).__name__} {val!r}, expected an int id",
                                  seq_id, position)
    return check_id_range(val, what, seq_id, position, vocab_size)


def check_id_range(tid: int, what: str, seq_id: str | None, position: int | None, vocab_size: int | None) -> int:
    if tid < 0 or (vocab_size is not None and tid >= vocab_size):
        raise EngineResponseError(Malformed.ID_OUT_OF_RANGE,
                                  f"{what} {tid} is outside the vocabulary [0, {vocab_size})", seq_id, position)
    return tid


def parse_id_key(key: str, seq_id: str | None, position: int | None, vocab_size: int | None,
                 prefix: str = "") -> int:
    """'3575' (prefix '') or 'token_id:3575' (prefix 'token_id:') → 3575; anything else is BAD_TOKEN_KEY."""
    body = key[len(prefix):] if prefix and key.startswith(prefix) else (None if prefix else key)
    if body is None or not body.isascii() or not body.isdigit() or (len(body) > 1 and body[0] == "0"):
        want = f"'{prefix}<id>'" if prefix else "a decimal token id"
        raise EngineResponseError(Malformed.BAD_TOKEN_KEY, f"key {key!r} is not {want}", seq_id, position)
    return check_id_range(int(body), "token id key", seq_id, position, vocab_size)


def check_same_ids(sent: Sequence[int], got: Any, what: str, seq_id: str | None) -> None:
    """The ids the engine echoes must equal the ids sent (engines.md §10 rule 7)."""
    if not isinstance(got, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in got):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{what} is not a list of ints", seq_id)
    if len(got) != len(sent):
        raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH,
                                  f"{what} has {len(got)} ids, {len(sent)} were sent", seq_id)
    for i, (a, b) in enumerate(zip(sent, got)):
        if a != b:
            raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH, f"{what}: sent id {a}, engine has {b}",
                                      seq_id, i)


def split_topk(entries: dict[int, float], actual_id: int, k: int, seq_id: str | None, position: int,
               ranks: dict[int, int] | None = None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Separate the true top-k from an actual token the surface appended (k or k+1 entries, §10 rule 4).

    With ``ranks`` (vLLM), order by rank and check ranks are 1..k; otherwise order by logprob (desc),
    ties broken by id. An entry dict of k+1 means the actual token is the extra one.
    """
    n = len(entries)
    if n < k:
        raise EngineResponseError(Malformed.TOO_FEW_ENTRIES, f"{n} entries, expected {k} or {k + 1}", seq_id, position)
    if n > k + 1:
        raise EngineResponseError(Malformed.TOO_MANY_ENTRIES, f"{n} entries, expected {k} or {k + 1}", seq_id, position)
    if actual_id not in entries:
        raise EngineResponseError(Malformed.ACTUAL_MISSING, f"actual token {actual_id} is not among the entries",
                                  seq_id, position)
    if ranks is not None and n == k and ranks[actual_id] > k:
        raise EngineResponseError(Malformed.TOO_FEW_ENTRIES, f"{n} entries including the actual token at rank "
                                  f"{ranks[actual_id]}: only {k - 1} of the top-{k}", seq_id, position)
    top = dict(entries)
    if n == k + 1:
        del top[actual_id]
    if ranks is not None:
        order = sorted(top, key=lambda t: (ranks[t], -top[t], t))
        for slot, t in enumerate(order, start=1):
            r = ranks[t]
            if r == slot:
                continue
            # exact ties: vLLM ranks the actual token as 1 + #(strictly greater), so a tied actual token
            # inside the top-k may carry the rank of the entry it ties with
            tied = t == actual_id and 1 <= r < slot and abs(top[order[r - 1]] - top[t]) <= 1e-9
            if not tied:
                raise EngineResponseError(Malformed.BAD_RANK,
                                          f"top-{k} ranks are {[ranks[x] for x in order]}, expected 1..{k}",
                                          seq_id, position)
    else:
        order = sorted(top, key=lambda t: (-top[t], t))
    lps = tuple(top[t] for t in order)
    for j in range(1, len(lps)):
        if lps[j] > lps[j - 1] + 1e-9:
            raise EngineResponseError(Malformed.RANK_ORDER,
                                      f"rank {j + 1} (id {order[j]}) has logprob {lps[j]!r} above rank {j} "
                                      f"(id {order[j - 1]}) {lps[j - 1]!r}", seq_id, position)
    if n == k + 1 and k > 0 and entries[actual_id] > lps[-1] + 1e-6:
        raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT,
                                  f"actual token {actual_id} is outside the top-{k} but its logprob "
                                  f"{entries[actual_id]!r} exceeds the k-th {lps[-1]!r}", seq_id, position)
    return tuple(order), lps


def usage_cached_tokens(usage: Any, seq_id: str | None) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens) from an OpenAI usage block; absent = None, never 0 (§3.7)."""
    if usage is None:
        return None, None
    if not isinstance(usage, dict):
        raise EngineResponseError(Malformed.USAGE_MALFORMED, f"usage is {type(usage).__name__}", seq_id)
    prompt = usage.get("prompt_tokens")
    if prompt is not None and (isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 0):
        raise EngineResponseError(Malformed.USAGE_MALFORMED, f"usage.prompt_tokens is {prompt!r}", seq_id)
    details = usage.get("prompt_tokens_details")
    if details is None:
        return prompt, None
    if not isinstance(details, dict):
        raise EngineResponseError(Malformed.USAGE_MALFORMED, f"usage.prompt_tokens_details is {details!r}", seq_id)
    cached = details.get("cached_tokens")
    if cached is None:
        return prompt, None
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0 or (prompt is not None and cached > prompt):
        raise EngineResponseError(Malformed.USAGE_MALFORMED,
                                  f"usage.prompt_tokens_details.cached_tokens is {cached!r} (prompt_tokens {prompt})",
                                  seq_id)
    return prompt, cached


def check_model(data: dict, model: str, seq_id: str | None) -> None:
    got = data.get("model")
    if got is None:
        raise EngineResponseError(Malformed.MISSING_FIELD, "response has no 'model'", seq_id)
    if got != model:
        raise EngineResponseError(Malformed.WRONG_MODEL, f"response is from model {got!r}, requested {model!r}", seq_id)


def single_choice(data: Any, seq_id: str | None) -> dict:
    if not isinstance(data, dict):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"response is {type(data).__name__}, expected an object", seq_id)
    choices = need(data, "choices", list, "response", seq_id=seq_id)
    if len(choices) != 1:
        raise EngineResponseError(Malformed.NO_CHOICES, f"{len(choices)} choices, expected exactly 1", seq_id)
    choice = choices[0]
    if not isinstance(choice, dict):
        raise EngineResponseError(Malformed.WRONG_TYPE, "choices[0] is not an object", seq_id)
    return choice

"""Named errors of the engine client and adapters.

Every malformed engine response raises :class:`EngineResponseError` with a :class:`Malformed` kind, so a
reliability suite can enumerate the kinds (``list(Malformed)``) and provoke each one against a fake
server. Transport failures (after bounded retries) raise :class:`EngineTransportError`; requests that
the engine refuses on purpose (HTTP 4xx, e.g. the vLLM logprob cap) raise :class:`EngineRequestRejected`.
"""

from __future__ import annotations

import enum

from core.errors import UserError


class Malformed(str, enum.Enum):
    """What is wrong with a response. Values are stable identifiers (used in reports and tests)."""

    # body level
    EMPTY_BODY = "empty_body"                    # 2xx with no body
    INVALID_JSON = "invalid_json"                # not JSON at all / truncated JSON
    NON_STANDARD_NUMBER = "non_standard_number"  # NaN / Infinity literals in the JSON text
    DUPLICATE_KEY = "duplicate_key"              # the same key twice in one JSON object (string-key collision)
    WRONG_TYPE = "wrong_type"                    # a field has the wrong JSON type
    MISSING_FIELD = "missing_field"              # a required field is absent
    WRONG_MODEL = "wrong_model"                  # response names another model than requested
    NO_CHOICES = "no_choices"                    # choices empty, or more than one
    # logprob surfaces
    MISSING_LOGPROBS = "missing_logprobs"        # logprobs / prompt_logprobs absent or null as a whole
    NULL_ENTRY = "null_entry"                    # null where a value is required (position >= 1)
    POSITION0_NOT_NULL = "position0_not_null"    # position 0 carries a distribution
    LENGTH_MISMATCH = "length_mismatch"          # per-position list has the wrong length
    PROMPT_IDS_MISMATCH = "prompt_ids_mismatch"  # the ids the engine echoes differ from the ids sent
    NON_FINITE = "non_finite"                    # NaN or +inf logprob
    POSITIVE_LOGPROB = "positive_logprob"        # logprob > 0
    BAD_TOKEN_KEY = "bad_token_key"              # key is not an integer id / not "token_id:N"
    ID_OUT_OF_RANGE = "id_out_of_range"          # negative id, or >= vocabulary size
    DUPLICATE_ID = "duplicate_id"                # two entries of one position carry the same id
    TOO_FEW_ENTRIES = "too_few_entries"          # fewer than k entries at a position
    TOO_MANY_ENTRIES = "too_many_entries"        # more than k+1 entries at a position
    ACTUAL_MISSING = "actual_missing"            # the actual/sampled token is absent where the surface promises it
    ACTUAL_INCONSISTENT = "actual_inconsistent"  # actual token's value disagrees between two fields of one response
    BAD_RANK = "bad_rank"                        # rank missing, < 1, or top-k ranks not 1..k
    RANK_ORDER = "rank_order"                    # logprobs rise with rank
    GENERATED_MISMATCH = "generated_mismatch"    # generated ids and their logprob entries disagree
    TOKENIZE_MISMATCH = "tokenize_mismatch"      # tokenizer endpoint answer is inconsistent
    STREAM_MALFORMED = "stream_malformed"        # an SSE chunk is not a valid event
    USAGE_MALFORMED = "usage_malformed"          # usage block has wrong types / negative counts
    METRICS_MALFORMED = "metrics_malformed"      # /metrics is not Prometheus text format


class EngineError(Exception):
    """Base of every error the engine client raises."""

    def __str__(self) -> str:
        # an engine may echo the request's key in its error body, and the URL may carry user:password@
        from core.redact import redact

        return redact(super().__str__())


class EngineResponseError(EngineError):
    """The engine answered, but the answer is malformed. Names kind, sequence and position."""

    def __init__(self, kind: Malformed, detail: str, seq_id: str | None = None, position: int | None = None,
                 url: str | None = None):
        self.kind = Malformed(kind)
        self.detail = detail
        self.seq_id = seq_id
        self.position = position
        self.url = url
        where = []
        if seq_id is not None:
            where.append(f"sequence {seq_id!r}")
        if position is not None:
            where.append(f"position {position}")
        if url is not None:
            where.append(url)
        loc = (" at " + ", ".join(where)) if where else ""
        super().__init__(f"malformed engine response [{self.kind.value}]{loc}: {detail}")

    def at(self, seq_id: str | None = None, url: str | None = None,
           position: int | None = None) -> "EngineResponseError":
        """A copy with the sequence id / url / position filled in where missing (parsers may not know them)."""
        return EngineResponseError(self.kind, self.detail, self.seq_id if self.seq_id is not None else seq_id,
                                   self.position if self.position is not None else position,
                                   self.url if self.url is not None else url)


class EngineTransportError(EngineError):
    """The engine could not be reached, timed out, or kept answering 5xx after the bounded retries."""

    def __init__(self, what: str, url: str, attempts: int, detail: str, status: int | None = None,
                 seq_id: str | None = None):
        self.what = what
        self.url = url
        self.attempts = attempts
        self.status = status
        self.detail = detail
        self.seq_id = seq_id
        seq = f" (sequence {seq_id!r})" if seq_id is not None else ""
        code = f" HTTP {status}" if status is not None else ""
        super().__init__(f"engine {what}{code} at {url}{seq} after {attempts} attempt(s): {detail}")


class EngineIdentityChanged(EngineError):
    """The answers of one record came from engines of different identities (the model id, the
    ``system_fingerprint`` or the ``Server`` header changed between sequences): two engines behind one port, or
    one restarted with another configuration mid-record. A record holds the answers of one engine."""

    def __init__(self, url: str, first: tuple[str, str], second: tuple[str, str]):
        self.url = url
        self.first = first
        self.second = second
        super().__init__(f"two engines answered one record at {url}: sequence {first[0]!r} was answered by "
                         f"{first[1]}, sequence {second[0]!r} by {second[1]}; a record holds the answers of one "
                         "engine (a load balancer or a restart behind this URL?)")


class EngineRequestRejected(EngineError):
    """The engine refused the request (HTTP 4xx): not retried, the message says why."""

    def __init__(self, status: int, url: str, message: str, seq_id: str | None = None):
        self.status = status
        self.url = url
        self.message = message
        self.seq_id = seq_id
        seq = f" (sequence {seq_id!r})" if seq_id is not None else ""
        super().__init__(f"engine rejected the request with HTTP {status} at {url}{seq}: {message}")


class TokenRoundTripError(EngineError):
    """A token-id sequence cannot be sent faithfully to a text-only engine (llama-cpp-python)."""

    def __init__(self, seq_id: str | None, position: int, sent: list[int], got: list[int]):
        self.seq_id = seq_id
        self.position = position
        self.sent = sent
        self.got = got
        lo = max(0, position - 2)
        super().__init__(
            f"sequence {seq_id!r}: token ids do not round-trip through the engine's text tokenizer; first "
            f"difference at position {position} (sent {sent[lo:position + 3]}, re-tokenized "
            f"{got[lo:position + 3]}; lengths {len(sent)} vs {len(got)})")


class UnsupportedSurface(EngineError):
    """The adapter's engine does not offer what was asked (e.g. streaming prompt logprobs)."""


class EngineRedirectRefused(EngineError, UserError):
    """The engine answered with a redirect the client does not follow: to another origin (scheme, host, port)
    always — a verdict must come from the engine that was named — and within the origin unless the client was
    configured for it (``ClientConfig.same_origin_redirects``). Names both origins.

    This and the two refusals below are also `UserError`s: the engine at the URL the user named answered with
    something no verdict may rest on, and ``ds41gate`` prints them as one line, exit 2."""

    def __init__(self, status: int, url: str, location: str, from_origin: str, to_origin: str, same_origin: bool):
        self.status = status
        self.url = url
        self.location = location
        self.from_origin = from_origin
        self.to_origin = to_origin
        if same_origin:
            why = (f"a same-origin redirect to {location}, which this client does not follow "
                   "(ClientConfig.same_origin_redirects=True where an engine needs it)")
        else:
            why = (f"a redirect to another origin {to_origin} (from {from_origin}); refused: the verdict must come "
                   f"from the engine at {from_origin}")
        super().__init__(f"engine answered HTTP {status} at {url} with {why}")


class EngineLimitExceeded(EngineError, UserError):
    """The engine's answer (a body, a model name) is larger than the client accepts; nothing of it is used."""

    def __init__(self, what: str, url: str | None, size: int | None, limit: int, unit: str = "bytes"):
        self.what = what
        self.url = url
        self.size = size
        self.limit = limit
        got = f"{size} {unit}" if size is not None else f"more than {limit} {unit}"
        where = f" at {url}" if url else ""
        super().__init__(f"engine {what}{where} is {got}; the limit is {limit} {unit}")


class EngineBodyRefused(EngineError, UserError):
    """The engine's body cannot be read safely: a content encoding the client did not ask for (it asks for
    ``identity``), so its decoded size is unknown until it is decoded (a gzip bomb)."""

    def __init__(self, url: str, detail: str):
        self.url = url
        self.detail = detail
        super().__init__(f"engine body refused at {url}: {detail}")

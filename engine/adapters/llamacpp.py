"""llama.cpp adapters: the C++ ``llama-server`` (id-keyed) and the llama-cpp-python server (string-keyed).

**llama-server** (engines.md §5). Every entry carries its ``id``, but there are no prompt logprobs: prompt
position i is scored by one request per prefix, ``POST /completion`` with ``prompt = ids[:i]``,
``n_predict = 1``, ``n_probs = k``, temperature 0, reading the first generated position's pre-sampling
``top_logprobs``. ``tokens_evaluated`` must equal the prefix length (alignment self-check). Values
≤ −9999 (llama-server writes ``-FLT_MAX`` for probability 0) are −inf.

Prefixes go in order with ``cache_prompt: true`` (``reuse_prefix``, the default): the server keeps the
previous prefix's KV cache and evaluates only the one new token, so a sequence of n tokens costs n
one-token steps instead of n²/2 prompt tokens (on the 2-core rig a 150-token prefix is ~1 s cold, so the
panel would take most of an hour). Every position is then computed exactly as a decode step of the same
sequence: the one-token prefix is sent cold (``cache_prompt: false`` empties the slot), so each cached
entry was computed one token at a time with its own causal history and the values do not depend on what
the server served before (it always re-evaluates at least the last token; the profiles turn off the
host-memory prompt cache, ``--cache-ram 0``, so no other saved state is swapped in). They differ from
a cold prompt evaluation of the whole prefix (a batch of i tokens) by llama.cpp's batch-shape noise
(F32 GGUF, one 196-token sequence: median |Δ| 1.2e-3, max 1.4e-2); ``reuse_prefix=False`` sends
``cache_prompt: false`` and evaluates every prefix cold (the record's surface says which).

When the greedy token's text ends in half a UTF-8 character the server withholds its probabilities
(it waits for the rest of the character; in Chinese text ten partial-byte tokens in a row can lead).
The adapter then asks again with ``logit_bias`` pushing the sampler onto a whole-character token (the
server's own tokenization of "."): the reported values are the raw logits' softmax, which the sampler
does not touch, and the withheld greedy token must come back as the top entry.

The actual token is not appended to the list, so when it falls outside the top-k the same prefix is
asked again, first with ``n_probs = wide_k`` and, if still missing, ``n_probs = vocab_size`` (no cap on
this server), to read its logprob and rank; with the prefix cached that request repeats the same
one-token computation, so its values are the first request's up to the float32 rounding of the softmax's
sum (~1e-6: the server adds the terms in an order that depends on ``n_probs``). Without a known
vocabulary size an actual token outside the wide list is an ``actual_missing`` error.

**llama-cpp-python** (§6, 0.3.36). Text prompts only, and no ids anywhere in the logprobs. For a
token-id sequence the adapter detokenizes with ``/extras/detokenize``, re-tokenizes with
``/extras/tokenize``, and **refuses** (``TokenRoundTripError``, naming the first differing position) any
sequence whose ids do not round-trip — scoring a different tokenization would misalign every position
against the oracle. ``usage.prompt_tokens`` of the scoring request must equal the sequence length.

Its echo surface is **shifted by one position** (abetlen/llama-cpp-python#1983, verified on the 0.3.36
server): echo entry i holds the top-k of the distribution at position i+1, plus one extra key — token i's
string with its logprob *under position i+1's distribution* (also what ``token_logprobs[i]`` says), and
entry 0 is null, so position 1 is lost. The adapter therefore reads position p (2 ≤ p ≤ n−1) from echo
entry p−1, dropping that extra key when the entry has k+1 keys; position 1, and any position whose actual
token is outside the reported top-k, come from a non-echo request on the prefix text (checked to
round-trip as well) whose first generated position is unshifted: ``logprobs=k`` for position 1's top-k,
``logprobs=vocab_size`` (no cap on this server) for an actual token's value. Without ``vocab_size`` a
missing actual value is an ``actual_missing`` error.

Keys are decoded strings: each is mapped to ids with the engine's own ``/extras/tokenize`` (cached), and
a position is marked *ambiguous* (rule 2) when a key does not map to exactly one id, two keys map to one
id, the key count shows a collision (fewer than k; or k keys where the appended previous-token key is the
smallest, which a collision and a rank-k previous token both produce), or the actual token's string does
not map back to it.
Ambiguous positions keep their unambiguous entries; their actual rank is 0. Ranks from the full
distribution are given only when that distribution had no key collision.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping, Any, Sequence

from engine.adapters.base import (
    Generation, GenerateOptions, HttpTiming, PositionLogprobs, SequenceLogprobs, Transport, WithoutServerSurfaces,
    check_model, logprob_value, need, plain_options, single_choice, token_id, usage_cached_tokens,
)
from engine.errors import EngineResponseError, Malformed, TokenRoundTripError, UnsupportedSurface

COMPLETION = "/completion"


# ============================================================================================== llama-server
def prefix_request(prefix: Sequence[int], k: int, cache_prompt: bool = False) -> dict[str, Any]:
    return {"prompt": list(prefix), "n_predict": 1, "n_probs": k, "temperature": 0, "cache_prompt": cache_prompt,
            "return_tokens": True, "post_sampling_probs": False}


def _entry_list(lst: Any, what: str, seq_id: str | None, pos: int, vocab: int | None):
    if not isinstance(lst, list):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"{what} is {type(lst).__name__}, expected a list", seq_id, pos)
    ids: list[int] = []
    lps: list[float] = []
    seen: set[int] = set()
    for j, e in enumerate(lst):
        if isinstance(e, dict) and "prob" in e and "logprob" not in e:
            raise EngineResponseError(Malformed.MISSING_FIELD, f"{what}[{j}] has 'prob' (post_sampling_probs) instead "
                                      "of 'logprob'", seq_id, pos)
        tid = token_id(need(e, "id", int, f"{what}[{j}]", seq_id=seq_id, position=pos), f"{what}[{j}].id", seq_id,
                       pos, vocab)
        lp = logprob_value(need(e, "logprob", float, f"{what}[{j}]", seq_id=seq_id, position=pos),
                           f"{what}[{j}].logprob", seq_id, pos)
        if tid in seen:
            raise EngineResponseError(Malformed.DUPLICATE_ID, f"{what}: id {tid} appears twice", seq_id, pos)
        if lps and lp > lps[-1] + 1e-9:
            raise EngineResponseError(Malformed.RANK_ORDER, f"{what}[{j}] logprob {lp!r} above [{j - 1}] {lps[-1]!r}",
                                      seq_id, pos)
        seen.add(tid)
        ids.append(tid)
        lps.append(lp)
    return ids, lps


def parse_completion_probs(data: Any, n_prompt: int, n_expected: int, k: int, model: str | None,
                           seq_id: str | None, vocab: int | None, first_pos: int) -> list[tuple[int, float, list, list]]:
    """Native ``/completion`` response → [(generated id, its logprob, top ids, top logprobs)] per generated token."""
    if not isinstance(data, dict):
        raise EngineResponseError(Malformed.WRONG_TYPE, f"response is {type(data).__name__}", seq_id, first_pos)
    if model is not None:
        check_model(data, model, seq_id)
    ev = need(data, "tokens_evaluated", int, "response", seq_id=seq_id, position=first_pos)
    if ev != n_prompt:
        raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH, f"engine evaluated {ev} prompt tokens, {n_prompt} sent",
                                  seq_id, first_pos)
    probs = data.get("completion_probabilities")
    if probs is None:
        raise EngineResponseError(Malformed.MISSING_LOGPROBS, "no completion_probabilities (n_probs not honoured?)",
                                  seq_id, first_pos)
    if not isinstance(probs, list) or len(probs) != n_expected:
        got = len(probs) if isinstance(probs, list) else type(probs).__name__
        raise EngineResponseError(Malformed.LENGTH_MISMATCH, f"completion_probabilities has {got} entries, expected "
                                  f"{n_expected}", seq_id, first_pos)
    toks = data.get("tokens")
    out = []
    for j, p in enumerate(probs):
        pos = first_pos + j
        if isinstance(p, dict) and "prob" in p and "logprob" not in p:
            raise EngineResponseError(Malformed.MISSING_FIELD, f"completion_probabilities[{j}] has 'prob' "
                                      "(post_sampling_probs) instead of 'logprob'", seq_id, pos)
        gid = token_id(need(p, "id", int, f"completion_probabilities[{j}]", seq_id=seq_id, position=pos),
                       "generated id", seq_id, pos, vocab)
        glp = logprob_value(need(p, "logprob", float, f"completion_probabilities[{j}]", seq_id=seq_id, position=pos),
                            "generated token logprob", seq_id, pos)
        ids, lps = _entry_list(need(p, "top_logprobs", list, f"completion_probabilities[{j}]", seq_id=seq_id,
                                    position=pos), f"completion_probabilities[{j}].top_logprobs", seq_id, pos, vocab)
        if len(ids) < k:
            raise EngineResponseError(Malformed.TOO_FEW_ENTRIES, f"{len(ids)} top entries for n_probs={k}", seq_id, pos)
        if len(ids) > k:
            raise EngineResponseError(Malformed.TOO_MANY_ENTRIES, f"{len(ids)} top entries for n_probs={k}", seq_id, pos)
        if gid in ids and lps[ids.index(gid)] != glp:
            raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT, f"generated id {gid}: logprob {glp!r} but top entry "
                                      f"{lps[ids.index(gid)]!r}", seq_id, pos)
        out.append((gid, glp, ids, lps))
    if isinstance(toks, list) and toks and [o[0] for o in out] != toks:
        raise EngineResponseError(Malformed.GENERATED_MISMATCH, f"tokens {toks} but probability ids "
                                  f"{[o[0] for o in out]}", seq_id, first_pos)
    return out


FORCE_BIAS = 1e6  # added to one logit in the sampler only; far above any logit gap


def _withheld_partial_token(data: Any, n_prompt: int) -> int | None:
    """The sampled id when llama-server withheld one token's probabilities (its text ends mid-character)."""
    if not isinstance(data, dict) or data.get("completion_probabilities") not in (None, []):
        return None
    toks = data.get("tokens")
    if data.get("tokens_evaluated") != n_prompt or not isinstance(toks, list) or len(toks) != 1:
        return None
    tid = toks[0]
    return tid if isinstance(tid, int) and not isinstance(tid, bool) else None


class LlamaServerAdapter(WithoutServerSurfaces):
    """llama-server: prompt logprobs from token-id prefixes, greedy generation (``ignore_eos`` and extra fields
    as given; no per-request cache salt), its context length from /props; no streaming, no cache settings."""

    name = "llama-server"
    keyed_by = "id"
    # llama-server folds the tokens of one incomplete UTF-8 character (byte-fallback tokens of an emoji) into
    # ONE completion_probabilities entry (seen: 40 tokens predicted, 14 entries, tokens [10813, 232, 118] -> one
    # '🎨' entry), so per-token logprobs of such a continuation do not exist; callers that need only the ids
    # (task evals) ask with k = ids_only_k and read the server's `tokens` list instead
    ids_only_k = 0

    def __init__(self, vocab_size: int | None = None, check_model_name: bool = True, reuse_prefix: bool = True,
                 wide_k: int = 1024):
        if wide_k < 1:
            raise ValueError(f"wide_k must be >= 1, got {wide_k}")
        self.vocab_size = vocab_size
        self.check_model_name = check_model_name
        self.reuse_prefix = reuse_prefix
        self.wide_k = wide_k
        self.surface = "llama-server.completion.per-prefix" + (".incremental" if reuse_prefix else ".cold")
        self._whole_token: int | None = None

    def _model(self, transport: Transport) -> str | None:
        return transport.model if self.check_model_name else None

    def _complete_token(self, transport: Transport, seq_id: str) -> int:
        """An id whose text is one whole ASCII character (the server's own tokenization of "."), cached."""
        if self._whole_token is None:
            reply = transport.post_json("/tokenize", {"content": ".", "with_pieces": True}, seq_id=seq_id)
            toks = need(reply.data, "tokens", list, "/tokenize response", seq_id=seq_id)
            if len(toks) != 1 or not isinstance(toks[0], dict) or toks[0].get("piece") != ".":
                raise EngineResponseError(Malformed.TOKENIZE_MISMATCH, f"/tokenize of '.' gave {toks!r}, expected one "
                                          "token with piece '.'", seq_id, None, reply.url)
            self._whole_token = token_id(toks[0].get("id"), "/tokenize id", seq_id, None, self.vocab_size)
        return self._whole_token

    def _prefix_dist(self, transport: Transport, seq_id: str, prefix: list[int], n_probs: int, pos: int):
        # the one-token prefix always goes cold: it empties the slot's cache, so everything cached after it
        # was computed by this sequence's own one-token steps, whatever the server served before
        cache = self.reuse_prefix and len(prefix) > 1
        body = prefix_request(prefix, n_probs, cache)
        reply = transport.post_json(COMPLETION, body, seq_id=seq_id)
        timing = HttpTiming(1, reply.elapsed_s)
        withheld = _withheld_partial_token(reply.data, len(prefix))
        if withheld is not None:
            # The greedy token ends in half a UTF-8 character, so the server holds its text back and with it
            # the probabilities (it waits for the next token; n_predict = 1 ends first). The reported values
            # are the softmax of the raw logits, which sampler settings do not touch: ask again with the
            # sampler pushed onto a whole-character token; the withheld token must come back as the top entry.
            whole = self._complete_token(transport, seq_id)
            body = {**body, "logit_bias": [[whole, FORCE_BIAS]]}
            reply = transport.post_json(COMPLETION, body, seq_id=seq_id)
            timing = timing + HttpTiming(1, reply.elapsed_s)
        try:
            (gid, _, ids, lps), = parse_completion_probs(reply.data, len(prefix), 1, n_probs, self._model(transport),
                                                         seq_id, self.vocab_size, pos)
        except EngineResponseError as exc:
            raise exc.at(seq_id, reply.url, pos) from None
        if withheld is not None and (gid != self._whole_token or withheld not in ids or
                                     lps[ids.index(withheld)] < lps[0]):
            raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT, f"after pushing the sampler onto token "
                                      f"{self._whole_token}, sampled {gid} and the withheld greedy token {withheld} is "
                                      "not the top entry: the values moved with logit_bias", seq_id, pos, reply.url)
        return ids, lps, timing

    def prompt_logprobs(self, transport: Transport, seq_id: str, token_ids: Sequence[int], k: int, *,
                        cache_salt: str | None = None) -> SequenceLogprobs:
        ids = [int(t) for t in token_ids]
        rows: list[PositionLogprobs] = []
        timing = HttpTiming()
        for i in range(1, len(ids)):
            top_ids, top_lps, t = self._prefix_dist(transport, seq_id, ids[:i], k, i)
            timing = timing + t
            actual = ids[i]
            if actual in top_ids:
                j = top_ids.index(actual)
                rows.append(PositionLogprobs(i, actual, top_lps[j], j + 1, tuple(top_ids), tuple(top_lps)))
                continue
            lp, rank, extra = self._actual_outside_topk(transport, seq_id, ids[:i], actual, i, k)
            timing = timing + extra
            if lp > top_lps[-1] + 1e-6:
                raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT,
                                          f"actual id {actual} outside the top-{k} with logprob {lp!r} above the k-th "
                                          f"{top_lps[-1]!r}", seq_id, i)
            rows.append(PositionLogprobs(i, actual, lp, rank, tuple(top_ids), tuple(top_lps)))
        return SequenceLogprobs(seq_id, tuple(ids), k, self.surface, "id", tuple(rows), timing, None)

    def _actual_outside_topk(self, transport: Transport, seq_id: str, prefix: list[int], actual: int, pos: int,
                             k: int):
        """The actual token's logprob and rank from a wider list of the same prefix, then the whole vocabulary."""
        timing = HttpTiming()
        ladder = [n for n in (self.wide_k, self.vocab_size) if n is not None and n > k]
        if self.vocab_size is not None:
            ladder = [n for n in ladder if n <= self.vocab_size]
        for n_probs in dict.fromkeys(ladder):
            ids, lps, t = self._prefix_dist(transport, seq_id, prefix, n_probs, pos)
            timing = timing + t
            if actual in ids:
                lp = lps[ids.index(actual)]
                return lp, 1 + sum(1 for x in lps if x > lp), timing
            if n_probs == self.vocab_size:
                raise EngineResponseError(Malformed.ACTUAL_MISSING, f"actual id {actual} absent from the full "
                                          "distribution", seq_id, pos)
        raise EngineResponseError(Malformed.ACTUAL_MISSING,
                                  f"actual id {actual} is outside the top-{max(ladder, default=k)} and llama-server "
                                  "does not append it; give the adapter vocab_size to re-ask with n_probs = "
                                  "vocabulary", seq_id, pos)

    def generate(self, transport: Transport, seq_id: str, prompt_ids: Sequence[int], max_tokens: int, k: int,
                 options: GenerateOptions | None = None) -> Generation:
        o = plain_options(self.name, options)
        prompt = [int(t) for t in prompt_ids]
        body = {"prompt": prompt, "n_predict": max_tokens, "n_probs": k, "temperature": 0, "cache_prompt": False,
                "return_tokens": True, "post_sampling_probs": False}
        if o.ignore_eos is not None:
            body["ignore_eos"] = o.ignore_eos
        body.update(o.extra)
        reply = transport.post_json(COMPLETION, body, seq_id=seq_id)
        data = reply.data
        if k == 0:   # ids only: the generated ids as the server lists them, no per-position logprobs
            try:
                n = need(data, "tokens_predicted", int, "response", seq_id=seq_id)
                ids = need(data, "tokens", list, "response", seq_id=seq_id)
                if len(ids) != n or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise EngineResponseError(Malformed.LENGTH_MISMATCH, f"tokens lists {len(ids)} entries for "
                                              f"tokens_predicted {n}, or a non-integer id", seq_id, len(prompt))
            except EngineResponseError as exc:
                raise exc.at(seq_id, reply.url) from None
            return Generation(seq_id, tuple(prompt), tuple(ids), (), 0, "llama-server.completion",
                              data.get("content") or "", data.get("stop_type"), len(prompt), None,
                              HttpTiming(1, reply.elapsed_s))
        try:
            n = need(data, "tokens_predicted", int, "response", seq_id=seq_id)
            got = parse_completion_probs(data, len(prompt), n, k, self._model(transport), seq_id, self.vocab_size,
                                         len(prompt))
        except EngineResponseError as exc:
            raise exc.at(seq_id, reply.url) from None
        rows = []
        for j, (gid, glp, ids, lps) in enumerate(got):
            rank = ids.index(gid) + 1 if gid in ids else 0
            rows.append(PositionLogprobs(len(prompt) + j, gid, glp, rank, tuple(ids), tuple(lps)))
        return Generation(seq_id, tuple(prompt), tuple(r.actual_id for r in rows), tuple(rows), k,
                          "llama-server.completion", data.get("content") or "", data.get("stop_type"),
                          len(prompt), None, HttpTiming(1, reply.elapsed_s))


    def max_model_len(self, transport: Transport) -> int | None:
        """The slots' context (``default_generation_settings.n_ctx`` of /props)."""
        settings = transport.get_json("/props").data.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        return n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) else None


# ============================================================================================== llama-cpp-python
class LlamaCppPythonAdapter(WithoutServerSurfaces):
    name = "llama-cpp-python"
    keyed_by = "string"
    surface = "llama-cpp-python.completions.echo-shifted"

    def __init__(self, vocab_size: int | None = None, text_of: Callable[[Sequence[int]], str] | None = None,
                 bos_id: int | None = None, vocab_strings: Mapping[str, tuple[int, ...]] | None = None):
        self.vocab_size = vocab_size
        # every id's own string as this server renders a key (partial UTF-8 dropped) → the ids sharing it.
        # Re-tokenizing a key is not the inverse: " " + half a character renders as " " and tokenizes to the
        # id of " ". With this map a key shared by several ids is a collision (engines.md §10 rule 2).
        self.vocab_strings = vocab_strings
        self.bos_id = bos_id  # the echo leaves out every token with this id (see prompt_logprobs)
        # /extras/detokenize drops special tokens (chat markers), so a chat sequence cannot round-trip
        # through it; `text_of` (the harness's own tokenizer, specials kept) supplies the text instead.
        # Either way the engine's /extras/tokenize must give back exactly the ids, or the sequence is refused.
        self.text_of = text_of
        self._tok_cache: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    # -------------------------------------------------------------- tokenizer endpoints
    def tokenize(self, transport: Transport, text: str, seq_id: str | None = None) -> tuple[int, ...]:
        with self._lock:
            hit = self._tok_cache.get(text)
        if hit is not None:
            return hit
        reply = transport.post_json("/extras/tokenize", {"input": text}, seq_id=seq_id)
        toks = need(reply.data, "tokens", list, "/extras/tokenize response", seq_id=seq_id)
        ids = tuple(token_id(t, "/extras/tokenize id", seq_id, None, self.vocab_size) for t in toks)
        with self._lock:
            self._tok_cache[text] = ids
        return ids

    def detokenize(self, transport: Transport, ids: Sequence[int], seq_id: str | None = None) -> str:
        reply = transport.post_json("/extras/detokenize", {"tokens": [int(t) for t in ids]}, seq_id=seq_id)
        return need(reply.data, "text", str, "/extras/detokenize response", seq_id=seq_id)

    def text_for(self, transport: Transport, seq_id: str, ids: Sequence[int]) -> str:
        """The text whose engine tokenization is exactly ``ids``; TokenRoundTripError otherwise."""
        ids = [int(t) for t in ids]
        text = self.text_of(ids) if self.text_of is not None else self.detokenize(transport, ids, seq_id)
        back = list(self.tokenize(transport, text, seq_id))
        if back != ids:
            first = next((i for i, (a, b) in enumerate(zip(ids, back)) if a != b), min(len(ids), len(back)))
            raise TokenRoundTripError(seq_id, first, ids, back)
        return text

    def _ids_of_key(self, transport: Transport, seq_id: str, key: str) -> tuple[int, ...]:
        """The ids a string key can stand for: from the vocabulary map when given, else the engine's tokenizer."""
        if self.vocab_strings is not None:
            return self.vocab_strings.get(key, ())
        return self.tokenize(transport, key, seq_id)

    def _map_keys(self, transport: Transport, seq_id: str, keys: dict[str, float]) -> tuple[dict[int, float], bool]:
        """String keys → {id: logprob}; ambiguous when a key is not exactly one id or two keys share an id."""
        mapped: dict[int, float] = {}
        ambiguous = False
        for key, lp in keys.items():
            tids = self._ids_of_key(transport, seq_id, key)
            if len(tids) != 1 or tids[0] in mapped:
                ambiguous = True
                continue
            mapped[tids[0]] = lp
        return mapped, ambiguous

    # -------------------------------------------------------------- scoring
    def _complete(self, transport: Transport, seq_id: str, text: str, n_prompt: int, k: int, echo: bool,
                  position: int | None):
        body = {"model": transport.model, "prompt": text, "max_tokens": 1, "temperature": 0, "echo": echo,
                "logprobs": k}
        reply = transport.post_json("/v1/completions", body, seq_id=seq_id)
        try:
            choice = single_choice(reply.data, seq_id)
            check_model(reply.data, transport.model, seq_id)
            prompt_tokens, _ = usage_cached_tokens(reply.data.get("usage"), seq_id)
            if prompt_tokens != n_prompt:
                raise EngineResponseError(Malformed.PROMPT_IDS_MISMATCH, f"engine tokenized the text into "
                                          f"{prompt_tokens} tokens, {n_prompt} expected", seq_id, position)
            lp = choice.get("logprobs")
            if lp is None:
                raise EngineResponseError(Malformed.MISSING_LOGPROBS, "choices[0].logprobs is null", seq_id, position)
            tokens = need(lp, "tokens", list, "logprobs", seq_id=seq_id, position=position)
            tlp = need(lp, "token_logprobs", list, "logprobs", seq_id=seq_id, position=position)
            top = need(lp, "top_logprobs", list, "logprobs", seq_id=seq_id, position=position)
        except EngineResponseError as exc:
            raise exc.at(seq_id, reply.url) from None
        if not (len(tokens) == len(tlp) == len(top)):
            raise EngineResponseError(Malformed.LENGTH_MISMATCH, f"{len(tokens)} tokens, {len(tlp)} token_logprobs, "
                                      f"{len(top)} top entries", seq_id, position, reply.url)
        return tokens, tlp, top, HttpTiming(1, reply.elapsed_s)

    def _top_dict(self, entry: Any, what: str, seq_id: str, pos: int) -> dict[str, float]:
        if entry is None:
            raise EngineResponseError(Malformed.NULL_ENTRY, f"{what} is null", seq_id, pos)
        if not isinstance(entry, dict):
            raise EngineResponseError(Malformed.WRONG_TYPE, f"{what} is {type(entry).__name__}", seq_id, pos)
        return {s: logprob_value(v, f"{what}[{s!r}]", seq_id, pos) for s, v in entry.items()}

    def _prefix_dist(self, transport: Transport, seq_id: str, ids: list[int], p: int, n_probs: int):
        """Unshifted distribution at position p from a non-echo request on text(ids[:p])."""
        text = self.text_for(transport, seq_id, ids[:p])
        tokens, tlp, top, timing = self._complete(transport, seq_id, text, p, n_probs, False, p)
        if len(top) < 1:
            raise EngineResponseError(Malformed.MISSING_LOGPROBS, "no generated position", seq_id, p)
        return self._top_dict(top[0], "top_logprobs[0]", seq_id, p), timing

    def prompt_logprobs(self, transport: Transport, seq_id: str, token_ids: Sequence[int], k: int, *,
                        cache_salt: str | None = None) -> SequenceLogprobs:
        """Prompt positions from one echo request, read through the 0.3.36 echo layout.

        The echo loop of llama-cpp-python 0.3.36 (llama.py) walks ``all_tokens`` = the prompt minus a leading
        BOS, pairs entry ``idx`` with the distribution that follows prompt token ``idx`` (it predicts token
        ``idx + 1``), adds the key of ``all_tokens[idx]`` to that entry's top dict, and leaves out every entry
        whose token is the BOS id. So with a leading BOS the entries are aligned (the added key is the actual
        token, as in OpenAI's echo); without one they are shifted by one (upstream #1983: the added key is the
        previous token). Positions whose distribution is not echoed (position 1, or the token after a
        BOS-id token) come from a non-echo request on the prefix.
        """
        ids = [int(t) for t in token_ids]
        n = len(ids)
        text = self.text_for(transport, seq_id, ids)
        timing = HttpTiming()
        tokens, tlp, top, t = self._complete(transport, seq_id, text, n, k, True, None)
        timing = timing + t
        bos = self.bos_id
        lead = 1 if (bos is not None and n and ids[0] == bos) else 0
        echoed = [idx for idx, tid in enumerate(ids[lead:]) if bos is None or tid != bos]
        if len(tokens) < len(echoed):
            raise EngineResponseError(Malformed.LENGTH_MISMATCH, f"echo covers {len(tokens)} tokens for {n} sent "
                                      f"({n - len(echoed)} BOS-id tokens are never echoed)", seq_id)
        entry_of = {idx: j for j, idx in enumerate(echoed)}
        if echoed and (tlp[0] is not None or top[0] is not None):
            raise EngineResponseError(Malformed.POSITION0_NOT_NULL, "echo entry 0 is not null", seq_id, 0)
        rows: list[PositionLogprobs] = []
        for p in range(1, n):
            actual = ids[p]
            j_actual = entry_of.get(p - lead)  # the entry whose token string is ids[p]
            actual_str = tokens[j_actual] if j_actual is not None else None
            if actual_str is not None and not isinstance(actual_str, str):
                raise EngineResponseError(Malformed.WRONG_TYPE, f"tokens[{j_actual}] is {actual_str!r}", seq_id, p)
            if actual_str is None:
                # a BOS-id token (a chat turn marker in SmolLM2): this server leaves such tokens out of every
                # logprob list, echo or generated, so its position cannot be read at all. Turn markers are
                # never scored panel positions; the row says so (ambiguous, no values) rather than guess.
                rows.append(PositionLogprobs(p, actual, float("-inf"), 0, (), (), True))
                continue
            ambiguous = self._ids_of_key(transport, seq_id, actual_str) != (actual,)
            known_actual: float | None = None  # the actual's value when the aligned echo states it
            j = entry_of.get(p - 1)  # the entry carrying the distribution that predicts position p
            if j is None or j == 0:
                try:
                    keys, t = self._prefix_dist(transport, seq_id, ids, p, k)
                except TokenRoundTripError:
                    # the prefix's text tokenizes differently (a merge across the cut): this position's
                    # context cannot be sent; the row says so (ambiguous, no values) rather than guess
                    rows.append(PositionLogprobs(p, actual, float("-inf"), 0, (), (), True))
                    continue
                timing = timing + t
                if len(keys) > k + 1:
                    raise EngineResponseError(Malformed.TOO_MANY_ENTRIES, f"{len(keys)} keys for k={k}", seq_id, p)
                greedy = max(keys.values()) if keys else None
                # non-echo adds the sampled (greedy = top-1) token, so k keys unless a collision lost one
                if len(keys) == k + 1:
                    raise EngineResponseError(Malformed.TOO_MANY_ENTRIES, f"{len(keys)} keys for k={k} although the "
                                              f"sampled token is the top-1 ({greedy!r})", seq_id, p)
            else:
                keys = self._top_dict(top[j], f"top_logprobs[{j}]", seq_id, p)
                extra_key = tokens[j]
                if not isinstance(extra_key, str) or extra_key not in keys:
                    raise EngineResponseError(Malformed.ACTUAL_MISSING, f"echo entry {j} lacks its token key "
                                              f"{extra_key!r} (echo layout not found)", seq_id, p)
                added = logprob_value(tlp[j], f"token_logprobs[{j}]", seq_id, p)
                if keys[extra_key] != added:
                    raise EngineResponseError(Malformed.ACTUAL_INCONSISTENT, f"echo entry {j}: key {extra_key!r} is "
                                              f"{keys[extra_key]!r}, token_logprobs {added!r}", seq_id, p)
                if len(keys) > k + 1:
                    raise EngineResponseError(Malformed.TOO_MANY_ENTRIES, f"{len(keys)} keys for k={k}", seq_id, p)
                if lead:
                    # aligned: the added key is the actual token itself, so its value is the actual's logprob
                    # even when its string maps to no id (a special token); k+1 keys: outside the top-k
                    known_actual = added
                    if len(keys) == k + 1:
                        del keys[extra_key]
                elif len(keys) == k + 1:
                    del keys[extra_key]          # shifted: the appended previous-token key is not a top-k member
                elif len(keys) == k and k > 1 and keys[extra_key] <= min(v for x, v in keys.items() if x != extra_key):
                    # either the previous token is exactly rank k, or it sits outside the top-k and a key
                    # collision lost one member: the two look the same, so the position is ambiguous
                    del keys[extra_key]
                    ambiguous = True
            if len(keys) < k:
                ambiguous = True
            mapped, amb = self._map_keys(transport, seq_id, keys)
            ambiguous |= amb
            order = sorted(mapped, key=lambda x: (-mapped[x], x))[:k]
            top_ids = tuple(order)
            top_lps = tuple(mapped[x] for x in order)
            if known_actual is not None:
                actual_lp = known_actual
                rank = top_ids.index(actual) + 1 if actual in top_ids else 0
            elif actual in mapped:
                actual_lp = mapped[actual]
                rank = top_ids.index(actual) + 1 if actual in top_ids else 0
            else:
                try:
                    actual_lp, rank, t = self._actual_from_full(transport, seq_id, ids, p, actual_str)
                except TokenRoundTripError:  # as above: the prefix cannot be sent as text
                    rows.append(PositionLogprobs(p, actual, float("-inf"), 0, top_ids, top_lps, True))
                    continue
                timing = timing + t
                if top_lps and actual_lp > top_lps[-1] + 1e-6:
                    # the prefix request (another batch shape) disagrees with the echo: on quantized GGUFs
                    # llama.cpp's prompt kernels differ by batch size. Two computations, one position:
                    # counted as ambiguous (excluded from every metric), never mixed silently.
                    ambiguous = True
            if ambiguous:
                rank = 0
            rows.append(PositionLogprobs(p, actual, actual_lp, rank, top_ids, top_lps, ambiguous))
        return SequenceLogprobs(seq_id, tuple(ids), k, self.surface, "string", tuple(rows), timing, None)

    def _actual_from_full(self, transport: Transport, seq_id: str, ids: list[int], p: int, actual_str: str):
        if self.vocab_size is None:
            raise EngineResponseError(Malformed.ACTUAL_MISSING, f"actual id {ids[p]} is outside the reported top-k; "
                                      "give the adapter vocab_size to read it from the full distribution", seq_id, p)
        full, timing = self._prefix_dist(transport, seq_id, ids, p, self.vocab_size)
        if actual_str not in full:
            raise EngineResponseError(Malformed.ACTUAL_MISSING, f"actual token string {actual_str!r} absent from the "
                                      "full distribution", seq_id, p)
        lp = full[actual_str]
        rank = 1 + sum(1 for v in full.values() if v > lp) if len(full) == self.vocab_size else 0
        return lp, rank, timing

    def generate(self, transport: Transport, seq_id: str, prompt_ids: Sequence[int], max_tokens: int, k: int,
                 options: GenerateOptions | None = None) -> Generation:
        raise UnsupportedSurface("llama-cpp-python reports no token ids for generated positions (engines.md §6); "
                                 "generate on llama-server or vLLM instead")

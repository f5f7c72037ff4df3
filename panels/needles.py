"""Seeded needle-in-a-haystack prompts, 2K to 1M tokens, measured with the model's own tokenizer.

A haystack is built from token ids, not from one giant string: each filler paragraph is tokenized
once and its ids are repeated, so a 1M-token prompt costs a few hundred small tokenizer calls. That
shortcut is only exact if tokenizing two pieces back to back gives the concatenation of their ids,
so `_FillerCache` checks every piece boundary the builder can produce before using it, and refuses a
tokenizer for which that does not hold.

The passphrase is drawn from the seed out of a word list that shares no word with the filler, plus
digits, so it cannot be guessed from the haystack. Scoring is an exact substring match.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from core.errors import UserError
from panels.model import Message
from panels.tokenizers import PanelTokenizer

NEEDLE_LENGTHS: tuple[int, ...] = (2_048, 8_192, 32_768, 65_536, 131_072, 262_144, 524_288, 1_048_576)
NEEDLE_DEPTHS: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
ANSWER_BUDGET = 64  # tokens left free for the reply when capping at max_model_len

# Our own filler: unremarkable prose with no numbers worth remembering.
FILLER: tuple[str, ...] = (
    "The market opens early on weekdays. Traders set up their stalls before the light is fully up, "
    "stacking crates of apples and pears, hanging bunches of herbs from wooden frames, and laying out "
    "cheeses under cloth to keep the flies away. By the time the first buses arrive, the square smells "
    "of bread and coffee, and the conversations have already moved on to the weather and the prices.",
    "A river changes its course slowly, but it does change. Each flood carries sand and gravel from the "
    "outer bank of a bend and drops it on the inner bank, so the curves grow wider over the years. "
    "Old channels are cut off and become quiet ponds where reeds grow and herons wait in the shallows. "
    "Walking along the valley, you can often trace where the water used to run.",
    "Most libraries keep their reading rooms quiet, but the quiet is never complete. Pages turn, chairs "
    "creak, a radiator ticks as it warms. Someone at the far table is sorting index cards into careful "
    "piles, and a student near the window has fallen asleep over an atlas. The librarian moves between "
    "the shelves with a trolley, putting each returned book back exactly where it belongs.",
    "Baking bread at home teaches patience. The dough needs time to rise, and rushing it only gives a "
    "dense loaf with a pale crust. A warm kitchen helps, and so does a damp towel over the bowl. When "
    "the loaf finally comes out of the oven, it should sound hollow when tapped underneath, and it is "
    "worth waiting a little longer still before cutting the first slice.",
    "On windy afternoons the harbour fills with small sailing boats. Their owners tack back and forth "
    "between the breakwater and the lighthouse, leaning out over the water to keep the hulls level. "
    "Gulls circle above the fishing boats that come in with the tide, and children line the quay with "
    "buckets and lines, hoping for crabs that rarely oblige them.",
    "A good walking path does not hurry. It follows the contour of the hill where it can, crosses "
    "streams on flat stones or narrow footbridges, and turns aside to pass an old oak or a view over the "
    "valley. Signposts appear at the junctions, weathered grey, their painted letters half gone, and "
    "walkers learn to read the path itself instead: the worn grass, the gap in the hedge.",
    "The old station has been turned into a small museum. Its waiting room still has the long wooden "
    "benches, and the ticket window keeps its brass grille. Timetables from many decades ago hang on the "
    "walls behind glass, listing towns that trains no longer reach. Visitors read them slowly, tracing "
    "routes with a finger, and sometimes recognise the village where a grandparent was born.",
    "Gardeners talk about soil the way cooks talk about stock. A heavy clay holds water and nutrients but "
    "sticks to the spade and cracks in summer; a sandy soil drains quickly and warms early but needs "
    "feeding all the time. Compost improves both, opening up the clay and helping the sand hold on to "
    "moisture, which is why every garden seems to have a heap steaming quietly in one corner.",
    "In the evening the streets of the old town grow quiet. Shop shutters come down one after another, "
    "the smell of cooking drifts from open kitchen windows, and the lamps along the canal flicker on. "
    "A cyclist rattles over the cobbles, a dog barks twice and stops, and somewhere upstairs a piano "
    "student practises the same short passage again and again until it is finally right.",
    "Clouds are sorted into families by their height and shape. Low, flat layers bring grey days and "
    "drizzle; tall, heaped clouds with bright tops can grow into thunderstorms by the afternoon; thin, "
    "feathery streaks high in the sky often arrive a day or so before a change in the weather. Farmers "
    "and sailors learned to read them long before anyone printed a forecast.",
)

# Passphrase words: none of them appears in the filler (a test checks this).
PASS_WORDS: tuple[str, ...] = (
    "amber", "basalt", "cobalt", "dahlia", "ember", "falcon", "garnet", "hazel", "indigo", "juniper",
    "kestrel", "lantern", "magnet", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra",
    "umber", "velvet", "walnut", "yarrow", "zephyr", "anchor", "bramble", "citrus", "domino", "fennel",
    "glacier", "harpoon", "iris", "jasper", "kiwi", "lilac", "marble", "nutmeg", "orchid", "pewter",
    "quill", "rocket", "sequoia", "tango", "ukulele", "vortex", "wombat", "yodel", "zircon", "bison",
)

NEEDLE_TEMPLATE = "One more thing to keep in mind: the secret passphrase for the archive is {passphrase}. Remember it."
QUESTION = (
    "What is the secret passphrase for the archive mentioned in the text above? "
    "Reply with the passphrase only."
)
_SEP = "\n\n"
_MARK = "\u2063HAYSTACK\u2063"


class NeedleError(UserError, ValueError):
    pass


@dataclass(frozen=True, eq=False)
class Haystack:
    seed: int
    target_tokens: int
    depth: float
    passphrase: str
    token_ids: np.ndarray  # int64, read-only
    needle_token_offset: int  # index of the needle paragraph's first token
    chat: bool
    tokenizer_hash: str
    _pieces: tuple[str, ...] = field(repr=False, default=())

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def actual_depth(self) -> float:
        return self.needle_token_offset / self.n_tokens

    def text(self) -> str:
        """The prompt as text (built on demand: several MB at 1M tokens)."""
        return "".join(self._pieces)


def make_passphrase(seed: int) -> str:
    rng = random.Random(f"needle-passphrase/{seed}")
    words = rng.sample(PASS_WORDS, 3)
    return f"{words[0]}-{words[1]}-{rng.randrange(1000, 10000)}-{words[2]}"


def score_needle(output: str, passphrase: str) -> bool:
    """Exact substring match: case, digits and hyphens must all be right."""
    return passphrase in output


class _FillerCache:
    """Token ids of every piece for one tokenizer + framing, with boundary exactness checked.

    The prompt text is always the same: paragraphs joined by a blank line. How it is cut into
    pieces is not: byte-level BPE tokenizers treat a run of newlines differently depending on what
    surrounds it (SmolLM2 splits "\n\n" before a word but keeps it whole at the end of a string;
    DeepSeek glues newlines to the preceding punctuation). So the separator either leads each piece
    or trails it, and the first layout whose every join checks out exactly is used.
    """

    def __init__(self, tok: PanelTokenizer, chat: bool, system: str | None = None, question: str = QUESTION):
        self.tok = tok
        if chat:
            msgs = ([Message("system", system)] if system is not None else []) + [Message("user", _MARK)]
            rendered = tok.chat_format.render(msgs, (), add_generation_prompt=True)
            if rendered.count(_MARK) != 1:
                raise NeedleError(f"chat format '{tok.chat_format.name}' did not place the user text exactly once")
            self.head, template_tail = rendered.split(_MARK)
        else:
            self.head = (tok.raw_prefix or "") + (system or "")
            template_tail = ""
        # Raw text with a leading system line is separated from the filler by a blank line, which
        # then belongs to whichever side the layout puts separators on.
        head_sep = system is not None and not chat
        base_head = self.head
        failures = []
        for layout in ("lead", "trail"):
            lead = layout == "lead"
            self.layout = layout
            self.head = base_head + (_SEP if head_sep and not lead else "")
            self.next = tuple(_SEP + p for p in FILLER) if lead else tuple(p + _SEP for p in FILLER)
            self.first = self.next if not lead or head_sep else FILLER
            self.tail = (_SEP if lead else "") + question + template_tail
            bad = self._bad_boundary()
            if bad is None:
                break
            failures.append(f"{layout}: {bad}")
        else:
            raise NeedleError(
                f"tokenizer '{tok.name}' merges tokens across filler boundaries in every layout "
                f"({'; '.join(failures)}); id-level haystack assembly would not be exact"
            )
        enc = tok.tokenizer.encode_batch
        ids = enc([self.head, self.tail, *self.first, *self.next], add_special_tokens=False)
        n = len(FILLER)
        self.head_ids = np.asarray(ids[0].ids, dtype=np.int64)
        self.tail_ids = np.asarray(ids[1].ids, dtype=np.int64)
        self.first_ids = [np.asarray(e.ids, dtype=np.int64) for e in ids[2 : 2 + n]]
        self.next_ids = [np.asarray(e.ids, dtype=np.int64) for e in ids[2 + n :]]

    def insert_text(self, sentence: str) -> str:
        return _SEP + sentence if self.layout == "lead" else sentence + _SEP

    def insert(self, sentence: str) -> tuple[str, np.ndarray]:
        text = self.insert_text(sentence)
        return text, np.asarray(self.tok.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def _bad_boundary(self) -> str | None:
        """Every join the builder can make must tokenize as the concatenation of its two halves."""
        needle = self.insert_text(NEEDLE_TEMPLATE.format(passphrase=make_passphrase(0)))
        lefts = [*self.first, *self.next, needle]
        rights = [*self.next, needle, self.tail]
        pairs = [(self.head, f) for f in self.first] + [(a, b) for a in lefts for b in rights]
        pieces = list(dict.fromkeys([self.head, *lefts, *rights]))
        enc = self.tok.tokenizer.encode_batch
        singles = {p: e.ids for p, e in zip(pieces, enc(pieces, add_special_tokens=False))}
        joined = enc([a + b for a, b in pairs], add_special_tokens=False)
        for (a, b), e in zip(pairs, joined):
            if e.ids != singles[a] + singles[b]:
                return f"{a[-20:]!r} | {b[:20]!r}"
        return None


_CACHE: dict[tuple[str, bool], _FillerCache] = {}


def _filler(tok: PanelTokenizer, chat: bool) -> _FillerCache:
    key = (tok.hash, chat)
    if key not in _CACHE:
        _CACHE[key] = _FillerCache(tok, chat)
    return _CACHE[key]


@dataclass(frozen=True, eq=False)
class FillerPrompt:
    token_ids: np.ndarray  # int64, read-only
    insert_token_offset: int | None
    pieces: tuple[str, ...]


def assemble(
    fc: _FillerCache, target_tokens: int, seed: int | str, insert: str | None = None, depth: float = 0.5
) -> FillerPrompt:
    """Fill `fc`'s frame with seeded paragraphs up to `target_tokens`, with `insert` (a sentence)
    at the paragraph boundary nearest to `depth` of the filler, never before the first paragraph."""
    if not 0.0 <= depth <= 1.0:
        raise NeedleError(f"depth must be in [0, 1], got {depth}")
    if insert is not None:
        ins_text, ins_ids = fc.insert(insert)
    else:
        ins_text, ins_ids = "", np.zeros(0, dtype=np.int64)
    budget = target_tokens - len(fc.head_ids) - len(fc.tail_ids) - len(ins_ids)
    longest = max(len(p) for p in fc.next_ids)
    if budget < 2 * longest:
        raise NeedleError(f"target of {target_tokens} tokens is too small for a haystack with this tokenizer")

    # Seeded paragraph order: each cycle is a fresh permutation, so no fixed period gives the
    # needle's position away, and one seed always gives the same prompt.
    rng = random.Random(f"filler-order/{seed}")
    order: list[int] = []
    lengths: list[int] = []
    used = 0
    n = len(FILLER)
    full = False
    while not full:
        perm = list(range(n))
        rng.shuffle(perm)
        for k in perm:
            size = len(fc.first_ids[k]) if not order else len(fc.next_ids[k])
            if used + size > budget:
                full = True
                break
            order.append(k)
            lengths.append(size)
            used += size

    cum = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
    cut = int(np.argmin(np.abs(cum[1:] - depth * used))) + 1  # a boundary after >= 1 paragraph
    first, rest = order[0], order[1:]
    id_parts = [fc.head_ids, fc.first_ids[first], *(fc.next_ids[k] for k in rest[: cut - 1]), ins_ids]
    id_parts += [*(fc.next_ids[k] for k in rest[cut - 1 :]), fc.tail_ids]
    ids = np.concatenate(id_parts)
    ids.setflags(write=False)
    pieces = (
        fc.head,
        fc.first[first],
        *(fc.next[k] for k in rest[: cut - 1]),
        ins_text,
        *(fc.next[k] for k in rest[cut - 1 :]),
        fc.tail,
    )
    offset = len(fc.head_ids) + int(cum[cut]) if insert is not None else None
    return FillerPrompt(token_ids=ids, insert_token_offset=offset, pieces=pieces)


def build_haystack(tok: PanelTokenizer, target_tokens: int, depth: float, seed: int, *, chat: bool = True,
                   answer_prefix: str = "") -> Haystack:
    """A prompt of at most `target_tokens` tokens (within one filler paragraph of it) with the needle
    at about `depth` of the way through the filler (never before the first paragraph). Same
    arguments and tokenizer give the same ids.

    `answer_prefix` (chat only) opens the assistant's turn with the answer's first words (e.g. "The
    passphrase is"), tokenized on its own and appended: small models then answer instead of chatting,
    so the gate measures retrieval, not instruction following. It is not counted in `target_tokens`."""
    if not 0.0 <= depth <= 1.0:
        raise NeedleError(f"depth must be in [0, 1], got {depth}")
    if answer_prefix and not chat:
        raise NeedleError("answer_prefix opens the assistant turn, so it needs chat=True")
    passphrase = make_passphrase(seed)
    fp = assemble(_filler(tok, chat), target_tokens, f"needle/{seed}", NEEDLE_TEMPLATE.format(passphrase=passphrase), depth)
    assert fp.insert_token_offset is not None
    ids, pieces = fp.token_ids, fp.pieces
    if answer_prefix:
        extra = np.asarray(tok.tokenizer.encode(answer_prefix, add_special_tokens=False).ids, dtype=np.int64)
        ids = np.concatenate([ids, extra])
        ids.setflags(write=False)
        pieces = (*pieces, answer_prefix)
    return Haystack(
        seed=seed,
        target_tokens=target_tokens,
        depth=depth,
        passphrase=passphrase,
        token_ids=ids,
        needle_token_offset=fp.insert_token_offset,
        chat=chat,
        tokenizer_hash=tok.hash,
        _pieces=pieces,
    )


@dataclass(frozen=True)
class NeedleCase:
    length: int
    depth: float
    seed: int


def needle_grid(
    max_model_len: int,
    lengths: Sequence[int] = NEEDLE_LENGTHS,
    depths: Sequence[float] = NEEDLE_DEPTHS,
    seed: int = 0,
) -> list[NeedleCase]:
    """Every (length, depth) that fits `max_model_len` with room for the answer. Each case gets its
    own seed, so passphrases differ between cases."""
    cap = max_model_len - ANSWER_BUDGET
    usable = [n for n in lengths if n <= cap]
    if not usable:
        raise NeedleError(f"max_model_len {max_model_len} leaves no room for the shortest haystack ({min(lengths)})")
    cases = []
    for i, n in enumerate(sorted(usable)):
        for j, d in enumerate(depths):
            cases.append(NeedleCase(length=n, depth=d, seed=seed * 1_000_003 + i * 101 + j))
    return cases

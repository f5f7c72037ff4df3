"""The long-context panel `long@1` (issue 39): real text in five domains, each item built to an exact token
length in the DeepSeek tokenizer, scored only at positions chosen per depth bucket (core/depth.py).

An item is a raw panel item with `score: "positions"`, `tokens` (the exact count in the DeepSeek tokenizer, BOS
included: panels/encode.py refuses another count) and `positions` (the scored positions). The text and the
positions are part of the content hash like any other item's fields (panels/store.py).

Domains and sources (each recorded with its version, commit and licence in the manifest's `sources`):

* code — the Python sources of Pygments (installed in the harness venv; BSD-2-Clause), files in sorted order;
* knowledge — Python Enhancement Proposals (github python/peps), only those that say they are placed in the
  public domain or under CC0;
* multilingual — Spanish and Japanese translations of the Python documentation (github python/python-docs-es,
  python/python-docs-ja; contributed under CC0 by PEP 545's documentation contribution agreement), the
  translated strings (msgstr) of the .po files, the two languages interleaved file by file;
* structured — logs, JSON lines and CSV generated deterministically from a seed (`structured_documents`);
* agentic — a multi-turn tool-calling transcript (a data analyst agent querying generated tables; its answers are
  computed from the data) rendered in the DeepSeek-V4.1 chat encoding (panels/chat.py), stored as that text.

Each domain's documents form one stream; an item takes the stream from a document boundary of its own (no two
items of a domain share a prefix, so an engine's prefix cache gains nothing across them) and is cut at a token
boundary to exactly `tokens` tokens. Scored positions: PER_BUCKET per depth bucket the item reaches (outside its
last 256 positions), drawn from a seeded generator, plus PER_BUCKET among its last 256.

Built once (offline, from the source snapshots) by `python -m panels.long build`; the panel file is committed,
so loading it needs nothing but the repository.
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from core.depth import DEPTH_LABELS, TAIL_TOKENS, bucket_members, bucket_range
from panels.model import EncodedPanel, Message, Panel, PanelError, PanelItem, ToolCall, ToolSpec
from panels.store import DATA_DIR, canonical_json, content_hash

NAME = "long"
VERSION = 1
PER_BUCKET = 48
SEED = 39
CI_TOKENS = 2560          # crosses 2,048 + 3 rows, so the tiny V4's indexer (top-512 of ratio 4) prunes
LENGTHS = (CI_TOKENS, 4096, 16384, 65536)
LONGEST = 131072          # the code and knowledge domains also reach the last depth bucket
LONGEST_DOMAINS = ("code", "knowledge")
DOMAIN_ORDER = ("code", "knowledge", "multilingual", "structured", "agentic")


# ----------------------------------------------------------------------------------------------------------
# Pure pieces: scored positions, sub-panels, bucket counts


def depth_positions(tokens: int, per_bucket: int = PER_BUCKET, seed: int = SEED) -> tuple[int, ...]:
    """Scored positions of an item of `tokens` tokens: `per_bucket` in each depth bucket it reaches (outside the
    last TAIL_TOKENS, the whole bucket when it has fewer), and `per_bucket` among the last TAIL_TOKENS."""
    if tokens < 2:
        raise PanelError(f"a long item needs at least 2 tokens, got {tokens}")
    rng = np.random.default_rng([seed, tokens])
    tail_start = max(1, tokens - TAIL_TOKENS)
    chosen: list[np.ndarray] = []
    for label in DEPTH_LABELS:
        lo, hi = bucket_range(label)
        lo, hi = max(lo, 1), min(hi if hi is not None else tokens, tail_start)
        if lo < hi:
            pool = np.arange(lo, hi)
            chosen.append(pool if pool.size <= per_bucket else rng.choice(pool, per_bucket, replace=False))
    tail = np.arange(tail_start, tokens)
    chosen.append(tail if tail.size <= per_bucket else rng.choice(tail, per_bucket, replace=False))
    return tuple(int(p) for p in np.unique(np.concatenate(chosen)))


def bucket_counts(positions: Sequence[int], tokens: int) -> dict[str, int]:
    """Scored positions per bucket (core.depth.BUCKET_LABELS) of one item."""
    pos = np.asarray(positions, dtype=np.int64)
    members = bucket_members(pos, np.full(pos.shape, tokens))
    return {label: int(m.sum()) for label, m in members.items()}


def select(panel: Panel, lengths: Iterable[int] | None = None, domains: Iterable[str] | None = None) -> Panel:
    """The sub-panel of `panel`'s items of the given token lengths (and domains): its own content hash, so a
    reference and an engine record made for it pair only with each other. None keeps all."""
    want_len = None if lengths is None else {int(n) for n in lengths}
    want_dom = None if domains is None else set(domains)
    items = tuple(i for i in panel.items
                  if (want_len is None or i.tokens in want_len) and (want_dom is None or i.domain in want_dom))
    if not items:
        have = sorted({i.tokens for i in panel.items if i.tokens is not None})
        raise PanelError(f"panel {panel.ref}: no item of length {sorted(want_len or [])} in domains "
                         f"{sorted(want_dom or [])}; lengths: {have}")
    if len(items) == len(panel.items):
        return panel
    return Panel(name=panel.name, version=panel.version, content_hash=content_hash(items), items=items,
                 description=panel.description)


def encoded_bucket_counts(enc: EncodedPanel) -> dict[str, dict[str, int]]:
    """Per sequence: its scored positions per bucket, from the encoded masks (what is really scored)."""
    out = {}
    for s in enc.sequences:
        pos = np.flatnonzero(np.asarray(s.scored_mask, dtype=bool))
        out[s.seq_id] = bucket_counts(pos, len(s.token_ids))
    return out


# ----------------------------------------------------------------------------------------------------------
# Sources (the build reads them; loading the panel never does)


@dataclass(frozen=True)
class Source:
    domain: str
    origin: str     # "pypi:pygments==2.21.0" or "github:owner/repo@commit"
    licence: str
    paths: str      # which files
    note: str = ""

    def to_json(self) -> dict[str, str]:
        out = {"domain": self.domain, "origin": self.origin, "licence": self.licence, "paths": self.paths}
        if self.note:
            out["note"] = self.note
        return out


def code_documents() -> tuple[list[str], Source]:
    import importlib.metadata

    import pygments

    root = Path(pygments.__file__).parent
    docs = [f"# file: pygments/{p.relative_to(root).as_posix()}\n{p.read_text(encoding='utf-8')}"
            for p in sorted(root.rglob("*.py"))]
    version = importlib.metadata.version("pygments")
    return docs, Source("code", f"pypi:pygments=={version}", "BSD-2-Clause", "pygments/**/*.py, sorted")


def _git_files(repo: Path, pattern: str) -> list[tuple[str, str]]:
    import subprocess

    names = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", "HEAD"], check=True,
                           capture_output=True, text=True).stdout.split("\n")
    rx = re.compile(pattern)
    out = []
    for name in sorted(n for n in names if rx.fullmatch(n)):
        text = subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{name}"], check=True, capture_output=True
                              ).stdout.decode("utf-8")
        out.append((name, text))
    return out


def _git_head(repo: Path) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


_PUBLIC = re.compile(r"placed in the public domain|CC0-1\.0|public domain or under the CC0", re.I)


def prose_documents(peps_repo: Path) -> tuple[list[str], Source]:
    docs = [text for _, text in _git_files(peps_repo, r"peps/pep-\d{4}\.rst") if _PUBLIC.search(text)]
    return docs, Source("knowledge", f"github:python/peps@{_git_head(peps_repo)}",
                        "public domain / CC0-1.0 (each PEP's Copyright section; others are left out)",
                        "peps/pep-NNNN.rst that say so, sorted")


def po_strings(text: str) -> list[str]:
    """The translated strings (msgstr) of a gettext .po file, header and untranslated entries left out."""
    out, current, in_str = [], [], False
    for line in text.split("\n") + [""]:
        line = line.strip()
        if line.startswith("msgstr "):
            current, in_str = [line[len("msgstr "):]], True
        elif in_str and line.startswith('"'):
            current.append(line)
        else:
            if in_str:
                try:
                    value = "".join(json.loads(part) for part in current)
                except ValueError:   # a PO escape JSON does not know (\a, \'): the entry is left out
                    value = ""
                if value and not value.startswith("Project-Id-Version"):
                    out.append(value)
            in_str = False
    return out


def multilingual_documents(es_repo: Path, ja_repo: Path) -> tuple[list[str], Source]:
    pattern = r"(tutorial|library|howto|faq|reference)/[a-z0-9_.-]+\.po"
    es = dict(_git_files(es_repo, pattern))
    ja = dict(_git_files(ja_repo, pattern))
    docs = []
    for name in sorted(set(es) & set(ja)):
        for text in (es[name], ja[name]):
            strings = po_strings(text)
            if strings:
                docs.append("\n\n".join(strings))
    return docs, Source("multilingual", f"github:python/python-docs-es@{_git_head(es_repo)} + "
                        f"github:python/python-docs-ja@{_git_head(ja_repo)}",
                        "CC0-1.0 (PEP 545 documentation contribution agreement); the English originals are PSF-2.0",
                        "msgstr of {tutorial,library,howto,faq,reference}/*.po present in both, es then ja per file")


# -- generated: structured data and the agentic transcript


_SERVICES = ("auth", "billing", "search", "gateway", "storage", "scheduler", "mailer", "metrics")
_LEVELS = ("DEBUG", "INFO", "INFO", "INFO", "WARN", "ERROR")
_CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Perth", "Quebec", "Tunis", "Hanoi", "Graz")


def _log_lines(rng: random.Random, n: int, t0: int) -> str:
    lines = []
    t = t0
    for _ in range(n):
        t += rng.randint(1, 900)
        svc, lvl = rng.choice(_SERVICES), rng.choice(_LEVELS)
        ms = rng.randint(1, 4000)
        path = f"/{svc}/v{rng.randint(1, 3)}/{rng.choice(('items', 'users', 'jobs', 'files'))}/{rng.randint(1, 99999)}"
        code = rng.choice((200, 200, 200, 201, 204, 301, 400, 403, 404, 500, 503))
        stamp = f"2026-{1 + t // 2_592_000 % 12:02d}-{1 + t // 86400 % 28:02d}T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}Z"
        lines.append(f"{stamp} {lvl:<5} [{svc}] {rng.choice(('GET', 'POST', 'PUT', 'DELETE'))} {path} -> {code} "
                     f"in {ms} ms (req={rng.getrandbits(48):012x})")
    return "\n".join(lines) + "\n"


def _json_lines(rng: random.Random, n: int) -> str:
    rows = []
    for k in range(n):
        rows.append(json.dumps({"id": k + rng.randint(0, 9) * 100000, "user": f"u{rng.randint(1, 5000):05d}",
                                "city": rng.choice(_CITIES), "items": [rng.randint(1, 999) for _ in range(rng.randint(0, 4))],
                                "total": round(rng.uniform(0, 900), 2), "paid": rng.random() < 0.8,
                                "tags": sorted(rng.sample(("new", "promo", "gift", "bulk", "repeat"), rng.randint(0, 2)))},
                               sort_keys=True))
    return "\n".join(rows) + "\n"


def _csv_table(rng: random.Random, n: int) -> tuple[str, list[dict]]:
    rows = []
    for k in range(n):
        rows.append({"station": rng.choice(_CITIES), "day": f"2026-03-{1 + k % 28:02d}",
                     "temp_c": round(rng.gauss(14, 8), 1), "rain_mm": round(max(0.0, rng.gauss(2, 4)), 1),
                     "wind_kmh": rng.randint(0, 80)})
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue(), rows


def structured_documents(seed: int = SEED, n_docs: int = 400) -> tuple[list[str], Source]:
    rng = random.Random(seed)
    docs = []
    for k in range(n_docs):
        kind = k % 3
        if kind == 0:
            docs.append(_log_lines(rng, rng.randint(20, 60), rng.randint(0, 10**7)))
        elif kind == 1:
            docs.append(_json_lines(rng, rng.randint(15, 40)))
        else:
            docs.append(_csv_table(rng, rng.randint(20, 60))[0])
    return docs, Source("structured", f"generated: panels.long.structured_documents(seed={seed})", "CC0-1.0 (generated)",
                        "service logs, JSON lines and CSV tables, in turn")


_AGENT_TOOLS = (
    ToolSpec("query_table", "Return the rows of a weather table for one month as CSV.",
             {"type": "object", "properties": {"month": {"type": "string"}}, "required": ["month"]}),
    ToolSpec("fetch_logs", "Return service logs of one hour.",
             {"type": "object", "properties": {"service": {"type": "string"}, "hour": {"type": "integer"}},
              "required": ["service", "hour"]}),
)


def _agent_turns(rng: random.Random, k: int) -> list[Message]:
    """One user request, a tool call, its result and an answer computed from that result."""
    if k % 2 == 0:
        month = f"2026-{1 + k % 12:02d}"
        text, rows = _csv_table(rng, rng.randint(25, 60))
        hot = max(rows, key=lambda r: r["temp_c"])
        wet = sum(r["rain_mm"] for r in rows)
        city = rng.choice(_CITIES)
        mine = [r["temp_c"] for r in rows if r["station"] == city]
        mean = f"{sum(mine) / len(mine):.1f} °C over {len(mine)} readings" if mine else "no readings"
        call = ToolCall(f"call_{k}", "query_table", {"month": month})
        return [Message("user", f"For {month}: which station was hottest, how much rain fell in total, and what "
                                f"was the mean temperature in {city}?"),
                Message("assistant", "", tool_calls=(call,)),
                Message("tool", text, tool_call_id=call.id),
                Message("assistant", f"The hottest reading was {hot['temp_c']} °C at {hot['station']} on {hot['day']}. "
                                     f"Total rain across all {len(rows)} rows: {wet:.1f} mm. Mean in {city}: {mean}.")]
    svc, hour = rng.choice(_SERVICES), rng.randint(0, 23)
    logs = _log_lines(rng, rng.randint(15, 40), hour * 3600)
    errors = [line for line in logs.split("\n") if " ERROR " in line]
    slow = max((int(m.group(1)), line) for line in logs.split("\n") if (m := re.search(r"in (\d+) ms", line)))
    call = ToolCall(f"call_{k}", "fetch_logs", {"service": svc, "hour": hour})
    return [Message("user", f"Check the {svc} logs for hour {hour}: how many errors, and which request was slowest?"),
            Message("assistant", "", tool_calls=(call,)),
            Message("tool", logs, tool_call_id=call.id),
            Message("assistant", f"I found {len(errors)} ERROR lines. The slowest request took {slow[0]} ms: "
                                 f"{slow[1].split(' -> ')[0].split('] ')[-1]}.")]


def agentic_documents(tokenizer, seed: int = SEED, n_docs: int = 60, turns: int = 40) -> tuple[list[str], Source]:
    """Transcripts rendered in the tokenizer's chat encoding, each without its leading BOS (the raw encoding of
    the item writes it)."""
    from panels.chat import DS_BOS, chat_spans

    rng = random.Random(seed + 1)
    docs = []
    for d in range(n_docs):
        msgs = [Message("system", "You are a careful data analyst. Use the tools, then answer from what they return.")]
        for k in range(turns):
            msgs += _agent_turns(rng, d * turns + k)
        item = PanelItem(id=f"agent-{d}", domain="agentic", kind="chat", score="assistant", messages=tuple(msgs),
                         tools=_AGENT_TOOLS)
        text = chat_spans(tokenizer.chat_format, item).text
        docs.append(text[len(DS_BOS):] if text.startswith(DS_BOS) else text)
    return docs, Source("agentic", f"generated: panels.long.agentic_documents(seed={seed}) rendered with "
                        f"{tokenizer.chat_format.name}", "CC0-1.0 (generated)",
                        "multi-turn tool-calling transcripts (query_table / fetch_logs), answers computed from the data")


# ----------------------------------------------------------------------------------------------------------
# Exact-length cuts


def exact_prefix(text: str, tokens: int, tokenizer) -> str:
    """The longest prefix of `text` cut at a token boundary that encodes (as a raw item: BOS + text) to exactly
    `tokens` ids."""
    tk, prefix = tokenizer.tokenizer, tokenizer.raw_prefix or ""
    enc = tk.encode(prefix + text, add_special_tokens=tokenizer.raw_prefix is None)
    if len(enc.ids) < tokens:
        raise PanelError(f"source text of {len(enc.ids)} tokens is shorter than the {tokens} wanted")
    shift = len(prefix)
    for k in sorted(range(tokens - 8, tokens + 9), key=lambda k: abs(k - tokens)):
        if not 1 < k <= len(enc.offsets):
            continue
        cut = enc.offsets[k - 1][1] - shift
        if cut <= 0:
            continue
        got = tk.encode(prefix + text[:cut], add_special_tokens=tokenizer.raw_prefix is None)
        if len(got.ids) == tokens:
            return text[:cut]
    raise PanelError(f"no token-boundary cut of the source encodes to exactly {tokens} tokens")


def _stream_from(docs: Sequence[str], start_doc: int) -> Iterator[str]:
    for k in range(len(docs)):
        yield docs[(start_doc + k) % len(docs)]


def build_items(domain: str, docs: Sequence[str], lengths: Sequence[int], tokenizer) -> list[PanelItem]:
    """One item per length, each from its own document boundary of the domain's stream."""
    items = []
    n = len(docs)
    for j, tokens in enumerate(lengths):
        start = (j * max(1, n // (len(lengths) + 1))) % n
        text, budget = "", 0
        for doc in _stream_from(docs, start):
            text += doc if not text else "\n\n" + doc
            budget += len(doc)
            if budget > tokens * 8:   # characters per token stays well under 8 in every domain here
                break
        cut = exact_prefix(text, tokens, tokenizer)
        items.append(PanelItem(id=f"{domain}-{tokens}", domain=domain, kind="raw", score="positions", text=cut,
                               tokens=tokens, positions=depth_positions(tokens)))
    return items


def lengths_for(domain: str) -> tuple[int, ...]:
    return LENGTHS + ((LONGEST,) if domain in LONGEST_DOMAINS else ())


def build_panel(tokenizer, peps_repo: Path, es_repo: Path, ja_repo: Path) -> tuple[list[PanelItem], list[Source]]:
    builders = {"code": code_documents, "knowledge": lambda: prose_documents(peps_repo),
                "multilingual": lambda: multilingual_documents(es_repo, ja_repo),
                "structured": structured_documents, "agentic": lambda: agentic_documents(tokenizer)}
    items, sources = [], []
    for domain in DOMAIN_ORDER:
        docs, source = builders[domain]()
        items += build_items(domain, docs, lengths_for(domain), tokenizer)
        sources.append(source)
    return items, sources


def write_panel(items: list[PanelItem], sources: list[Source], tokenizer, data_dir: Path = DATA_DIR) -> Path:
    from core.atomic import atomic_write_bytes

    jsonl = data_dir / f"{NAME}-{VERSION}.jsonl"
    manifest = data_dir / f"{NAME}-{VERSION}.manifest.json"
    atomic_write_bytes(jsonl, b"".join(canonical_json(i.to_json()) + b"\n" for i in items))
    desc = (f"Long-context panel (issue 39): five domains of real or seeded text, each item built to an exact token "
            f"length in the DeepSeek tokenizer ({tokenizer.name}, {tokenizer.hash}); lengths "
            f"{', '.join(str(n) for n in LENGTHS)} in every domain and {LONGEST} in {', '.join(LONGEST_DOMAINS)}; "
            f"scored only at {PER_BUCKET} positions per depth bucket reached and {PER_BUCKET} in the last "
            f"{TAIL_TOKENS} (seed {SEED}). The {CI_TOKENS}-token items cross 2,048 so the tiny V4 indexer prunes "
            "(CI); the rest run nightly. Built by `python -m panels.long build` (panels/long.py).")
    doc = {"name": NAME, "version": VERSION, "file": jsonl.name, "content_hash": content_hash(items),
           "description": desc, "domains": sorted({i.domain for i in items}),
           "sources": [s.to_json() for s in sources]}
    atomic_write_bytes(manifest, (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode())
    return manifest


def main(argv: list[str] | None = None) -> int:
    """`python -m panels.long build PEPS_REPO ES_REPO JA_REPO`: git folders of python/peps, python-docs-es and
    python-docs-ja (bare or not); writes panels/data/long-1.*."""
    import sys

    from panels.tokenizers import load_tokenizer

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4 or args[0] != "build":
        print("usage: python -m panels.long build PEPS_REPO ES_REPO JA_REPO", file=sys.stderr)
        return 2
    tok = load_tokenizer("deepseek")
    items, sources = build_panel(tok, *(Path(a) for a in args[1:]))
    print(write_panel(items, sources, tok))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

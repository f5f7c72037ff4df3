"""Generate the engine's greedy replies to a suite and score them: resumable, with progress bars.

Generations go to ``<out>/<suite>.generations.jsonl``: a header line naming the run (suite data hash,
tokenizer + chat format hash, engine, max_tokens, chat mode) and one line per finished problem, each
appended in one ``write`` and fsynced. A crash keeps every finished line; a torn last line is dropped on
reading; a rerun with the same identity generates only what is missing, and a rerun with another identity
is refused (one clear error) rather than mixing two runs. Scoring (sandboxed code execution, IFEval
checkers) reruns from the generations each time and writes ``<out>/<suite>.eval.json`` atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from core.console import counting
from core.errors import UserError
from core.records import Provenance
from core.redact import redact_data
from core.results_folder import eval_record_name, generations_name
from core.version import code_version
from evals.data import CodeProblem, Dataset, IFEvalPrompt, problem_id
from evals.records import CODE_SUITES, EvalRecord, ProblemResult

CHAT_MODES = ("model", "raw")   # raw: the prompt as plain text with no chat template (a can-fail defect)


class EvalRunMismatch(UserError):
    """The generations file in --out belongs to another run (other data, engine, settings)."""


@dataclass(frozen=True)
class Settings:
    max_tokens: int = 512
    chat: str = "model"
    concurrency: int = 4
    limit: int | None = None        # the first N problems only (CI subsets)

    def __post_init__(self) -> None:
        if self.chat not in CHAT_MODES:
            raise UserError(f"--chat {self.chat!r}; allowed: {list(CHAT_MODES)}")
        if self.max_tokens < 1:
            raise UserError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.concurrency < 1:
            raise UserError(f"--concurrency must be >= 1, got {self.concurrency}")


def user_text(suite: str, p: CodeProblem | IFEvalPrompt) -> str:
    from evals.code import CODE_INSTRUCTION

    if isinstance(p, CodeProblem):
        return CODE_INSTRUCTION.format(prompt=p.prompt.strip())
    return p.prompt


def prompt_ids(tok, text: str, chat: str) -> list[int]:
    """The engine's chat encoding of one user turn (the model's template, or DeepSeek's encoder for
    DeepSeek models), rendered here and sent as ids so every engine gets exactly the same prompt."""
    from panels.model import Message

    if chat == "raw":
        return list(tok.tokenizer.encode(text, add_special_tokens=True).ids)
    rendered = tok.chat_format.render([Message("user", text)], (), add_generation_prompt=True)
    return list(tok.tokenizer.encode(rendered, add_special_tokens=False).ids)


def reply_text(tok, ids: Sequence[int]) -> str:
    return tok.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- the JSONL store
class GenerationStore:
    def __init__(self, path: Path, header: dict[str, Any]):
        self.path = path
        self.header = header
        self._header_out = redact_data(header)     # what the file holds (core.redact, like every path out)
        self._lock = threading.Lock()
        self.done: dict[str, dict[str, Any]] = {}
        if path.is_file() and path.stat().st_size:
            self._read()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"header": self._header_out}, fresh=True)

    def _read(self) -> None:
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        good = b""
        first = True
        for line in lines:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                break           # a torn last line: everything from here is regenerated
            if first:
                if obj.get("header") != self._header_out:
                    raise EvalRunMismatch(
                        f"{self.path}: holds generations of another run "
                        f"({_diff(obj.get('header'), self._header_out)}); use another --out or delete the file")
                first = False
            else:
                self.done[obj["id"]] = obj
            good += line + b"\n"
        if first:
            good = (json.dumps({"header": self._header_out}, sort_keys=True) + "\n").encode()
        if good != raw:     # drop the torn tail so the next append starts on a fresh line
            from core.atomic import atomic_write_bytes

            atomic_write_bytes(self.path, good)

    def _append(self, obj: dict[str, Any], fresh: bool = False) -> None:
        data = (json.dumps(redact_data(obj), sort_keys=True) + "\n").encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0)
        with self._lock:
            fd = os.open(self.path, flags, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    def add(self, obj: dict[str, Any]) -> None:
        """Append one finished problem: the file holds the redacted line, memory keeps the reply as the engine
        gave it. Scoring never reads the redacted text (`score` decodes the reply from its token ids), so a reply
        that breaks an instruction only inside a redacted ``?token=...`` is scored as it was written."""
        self._append(obj)           # redacted on its way to the file
        with self._lock:
            self.done[obj["id"]] = obj


def _diff(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "no header"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} here, {new.get(k)!r} asked" for k in keys[:3])


# ---------------------------------------------------------------------------------------------- generate
def run_header(dataset: Dataset, tok, settings: Settings, source: dict[str, Any]) -> dict[str, Any]:
    """What makes two generation runs the same run (``limit`` is not in it: a larger limit extends a run)."""
    return {"suite": dataset.suite, "data_sha256": dataset.sha256, "tokenizer_hash": tok.hash,
            "chat": settings.chat, "max_tokens": settings.max_tokens,
            "engine": {k: source.get(k) for k in ("model", "profile", "flags")}}


def generate(client, dataset: Dataset, tok, settings: Settings, store: GenerationStore, *,
             progress: bool = True, echo: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    problems = list(dataset.problems[: settings.limit] if settings.limit else dataset.problems)
    todo = [p for p in problems if problem_id(p) not in store.done]
    failed = threading.Event()

    def one(p) -> dict[str, Any]:
        if failed.is_set():
            return {}
        pid = problem_id(p)
        ids = prompt_ids(tok, user_text(dataset.suite, p), settings.chat)
        t0 = time.perf_counter()
        try:
            # ids are all an eval needs; an adapter that cannot always give per-token logprobs says how to ask
            gen = client.generate(ids, settings.max_tokens, getattr(client.adapter, "ids_only_k", 1), seq_id=pid)
        except BaseException:
            failed.set()
            raise
        out = {"id": pid, "prompt_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
               "prompt_tokens": len(ids), "completion_ids": [int(t) for t in gen.token_ids],
               "reply": reply_text(tok, gen.token_ids), "finish": gen.finish_reason,
               "wall_s": round(time.perf_counter() - t0, 3)}
        store.add(out)
        return out

    if echo and len(todo) < len(problems):
        echo(f"{dataset.suite}: {len(problems) - len(todo)} of {len(problems)} already generated in {store.path}")
    with counting(f"{dataset.suite} · generate", len(problems), enabled=progress,
                  done=len(problems) - len(todo)) as advance:
        with ThreadPoolExecutor(max_workers=settings.concurrency, thread_name_prefix="ds41-eval") as pool:
            futures = [pool.submit(one, p) for p in todo]
            try:
                for fut in as_completed(futures):
                    fut.result()
                    advance()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    return {problem_id(p): store.done[problem_id(p)] for p in problems}


# ---------------------------------------------------------------------------------------------- score
def score(dataset: Dataset, generations: dict[str, dict[str, Any]], *, tok=None, progress: bool = True,
          workers: int = 2) -> list[ProblemResult]:
    """Score each generation on the reply the engine gave, never on the redacted text a file holds: with the
    tokenizer the reply is decoded again from its token ids (a resumed run's lines are redacted); without it the
    in-memory ``reply`` of this run is used. Only what is written afterwards (the record) is redacted."""
    by_id = {problem_id(p): p for p in dataset.problems}
    ids = list(generations)

    def one(pid: str) -> ProblemResult:
        g, p = generations[pid], by_id[pid]
        n, fin = len(g["completion_ids"]), g.get("finish")
        reply = g["reply"] if tok is None else reply_text(tok, g["completion_ids"])
        if dataset.suite in CODE_SUITES:
            from evals.code import score_solution

            o = score_solution(p, reply)
            return ProblemResult(pid, n, fin, base=o.base, plus=o.plus, detail=o.detail)
        from evals.ifeval import score_response

        o = score_response(p, reply)
        return ProblemResult(pid, n, fin, strict=o.strict, loose=o.loose)

    results: dict[str, ProblemResult] = {}
    if dataset.suite == "ifeval":
        from evals.ifeval import checkers

        checkers()      # import once, before the worker threads
    with counting(f"{dataset.suite} · score", len(ids), enabled=progress) as advance:
        with ThreadPoolExecutor(max_workers=workers if dataset.suite in CODE_SUITES else 1) as pool:
            for pid, res in zip(ids, pool.map(one, ids)):
                results[pid] = res
                advance()
    return [results[i] for i in ids]


def evaluate(client, dataset: Dataset, tok, settings: Settings, source, out_dir: Path, *,
             progress: bool = True, echo: Callable[[str], None] | None = None, score_only: bool = False) -> EvalRecord:
    """Generate (resuming) and score one suite on one engine; the record is saved and returned."""
    src = source.as_source()
    header = run_header(dataset, tok, settings, src)
    store = GenerationStore(out_dir / generations_name(dataset.suite), header)
    t0 = time.perf_counter()
    if score_only:      # an unfinished run: score what was generated, in data order, and say so
        gens = {problem_id(p): store.done[problem_id(p)] for p in dataset.problems if problem_id(p) in store.done}
        if echo:
            echo(f"{dataset.suite}: scoring the {len(gens)} generations in {store.path} (--score-only)")
    else:
        gens = generate(client, dataset, tok, settings, store, progress=progress, echo=echo)
    t_gen = time.perf_counter() - t0
    results = score(dataset, gens, tok=tok, progress=progress)
    prov = Provenance(side="engine", panel_name=dataset.suite, panel_version=dataset.source,
                      panel_hash="sha256:" + dataset.sha256, tokenizer_hash=tok.hash, source=src,
                      precision=source.precision, code_version=code_version(), created=Provenance.now(),
                      extra={"eval": "ds41-eval/1", "max_tokens": settings.max_tokens, "chat": settings.chat,
                             "chat_format": tok.chat_format.name, "limit": settings.limit,
                             "n_problems": len(results), "generation_wall_s": round(t_gen, 1),
                             "partial": score_only and len(results) < len(dataset.problems),
                             "truncated": sum(1 for r in results if r.n_tokens >= settings.max_tokens),
                             "decoding": "greedy (temperature 0), prompt sent as token ids"})
    rec = EvalRecord(dataset.suite, prov, results)
    rec.save(out_dir / eval_record_name(dataset.suite))
    return rec



def run_suites(endpoint, suites: list[str], out: Path, settings, tokenizer: str | None = None,
               data: dict[str, Path | None] | None = None, progress: bool = True, expect_count: int | None = None,
               echo: Callable[[str], None] | None = None, score_only: bool = False,
               request_timeout_s: float = 3600.0):
    """Every suite on one serving endpoint → {suite: EvalRecord}; shared by the CLI and the pytest gate."""
    from engine.client import ClientConfig, EngineClient, EngineSource
    from engine.endpoint import adapter_for
    from evals.data import load_suite
    from panels import load_tokenizer

    tok = load_tokenizer(tokenizer or endpoint.tokenizer_dir or "smollm2")
    source = EngineSource(url=endpoint.base_url, model=endpoint.model, profile=endpoint.profile,
                          flags=list(endpoint.flags), precision=endpoint.precision)
    # a long reply in a full batch can take many minutes: a timed-out request is retried from the start,
    # so the per-request timeout must exceed the slowest reply (request_timeout_s)
    client = EngineClient(ClientConfig(base_url=endpoint.base_url, model=endpoint.model,
                                       api_key=endpoint.api_key or os.environ.get("DS41_ENGINE_API_KEY") or "unused",
                                       max_concurrency=settings.concurrency, timeout_s=request_timeout_s),
                          adapter=adapter_for(endpoint.engine, endpoint.vocab_size, endpoint.tokenizer_dir))
    out.mkdir(parents=True, exist_ok=True)
    records = {}
    try:
        for suite in suites:
            ds = load_suite(suite, (data or {}).get(suite), expect_count=expect_count)
            records[suite] = evaluate(client, ds, tok, settings, source, out, progress=progress, echo=echo,
                                      score_only=score_only)
    finally:
        client.close()
    return records
